"""Where a suite run spends its wall time: per implementation, each step of its tests, and the slowest tests.

The steps are prepare (validation, tuning or the tuning cache, compile and first call), oracle and check, from the
``seconds`` every outcome carries (``suite/recording.py``, ``Recorder.timer``). A run stopped part-way still has them
for every test that finished; the workers' files of an xdist run (``NAME.gwK.json``) are read if given.
``--heartbeat`` reads heartbeat files instead (the suite's ``--heartbeat=FILE``, or a campaign's step files: each
test's start and finish, and its xdist worker):
what bounded a sharded pass, the workers busy to its end, the heaviest ``xdist_group`` groups (a group runs on one
worker) and the tests still running when it ended.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

STEPS = ("prepare", "oracle", "check")


def outcomes(paths: list[Path]) -> list[dict[str, Any]]:
    """Timed outcomes of the files that exist (a killed run leaves only its workers' files)."""
    return [o for path in paths if path.exists() for o in json.loads(path.read_text())["fmha"]["outcomes"]
            if o.get("seconds")]


def critical_path(path: Path, top: int) -> None:
    """A sharded pass from its heartbeat file: span against the busy time of its workers and groups."""
    from suite.isolation import heartbeat_events

    started: dict[str, tuple[float, str | None]] = {}
    spans: dict[str, float] = {}
    events = heartbeat_events(path)
    t0 = min(e["t"] for e in events)
    for e in events:
        if e["event"] == "start":
            started[e["nodeid"]] = (e["t"] - t0, e.get("worker"))
        elif e["nodeid"] in started:
            spans[e["nodeid"]] = e["t"] - t0 - started[e["nodeid"]][0]
    last: dict[str | None, float] = defaultdict(float)  # each worker's last finish
    groups: dict[str, float] = defaultdict(float)  # each xdist group's test time
    for nodeid, seconds in spans.items():
        start, worker = started[nodeid]
        last[worker] = max(last[worker], start + seconds)
        groups[nodeid.rpartition("@")[2] if "@" in nodeid else "(no group)"] += seconds
    end = max(last.values(), default=0.0)
    total = sum(spans.values())
    print(f"{len(spans)} tests finished in {end:.0f} s on {len(last)} workers: {total:.0f} s of tests, "
          f"{total / max(len(last), 1):.0f} s a worker")
    print("busy to the end:", ", ".join(f"{w} {last[w]:.0f} s" for w in sorted(last, key=last.get)[::-1][:top]))
    heaviest = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    print("heaviest groups:", ", ".join(f"{group} {seconds:.0f} s" for group, seconds in heaviest))
    for nodeid in sorted(started.keys() - spans.keys(), key=lambda n: started[n][0]):
        start, worker = started[nodeid]
        print(f"still running at the end: {nodeid} (on {worker} from {start:.0f} s)")


EPILOG = """examples:
  python -m tools.where_time_goes results/correct.json --top 20
  python -m tools.where_time_goes --heartbeat results/correct.hb --top 8
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.where_time_goes", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="results JSON files of the suite, or heartbeat files")
    parser.add_argument("--top", type=int, default=15, help="how many of the slowest tests to list")
    parser.add_argument("--heartbeat", action="store_true", help="the paths are heartbeat files of sharded passes")
    args = parser.parse_args(argv)
    if args.heartbeat:
        for path in args.paths:
            print(f"{path}:")
            critical_path(path, args.top)
        return
    found = outcomes(args.paths)
    per_impl: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for o in found:
        per_impl[o["impl"]]["tests"] += 1
        for step, seconds in o["seconds"].items():
            per_impl[o["impl"]][step] += seconds
    total = {step: sum(row[step] for row in per_impl.values()) for step in STEPS}
    print(f"{'implementation':24s} {'tests':>6s} " + " ".join(f"{s + ' s':>10s}" for s in STEPS))
    for name, row in sorted(per_impl.items(), key=lambda kv: -sum(kv[1][s] for s in STEPS)):
        print(f"{name:24s} {int(row['tests']):6d} " + " ".join(f"{row[s]:10.1f}" for s in STEPS))
    print(f"{'all':24s} {len(found):6d} " + " ".join(f"{total[s]:10.1f}" for s in STEPS))
    print(f"\nslowest {args.top} tests:")
    for o in sorted(found, key=lambda o: -sum(o["seconds"].values()))[:args.top]:
        steps = ", ".join(f"{k} {v:.2f}" for k, v in o["seconds"].items())
        print(f"  {sum(o['seconds'].values()):7.2f} s  {o['impl']} {o['case']} ({steps})")


if __name__ == "__main__":
    main()
