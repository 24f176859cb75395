"""Where a correctness run spends its wall time: per implementation, the seconds of each step of its tests
(prepare = validation, tuning or the tuning cache, compile and first call; oracle; check), and the slowest tests.

    python scripts/where_time_goes.py results/correct.json [--top 20]

Reads the ``seconds`` each outcome carries (``suite/plugin.py``, ``Recorder.timer``); a run killed part-way
still has them for every test that finished, and the worker files (``NAME.gwK.json``) are read if given.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

STEPS = ("prepare", "oracle", "check")


def outcomes(paths: list[Path]) -> list[dict]:
    """Timed outcomes of the files that exist (a killed run leaves only its workers' files)."""
    return [o for path in paths if path.exists() for o in json.loads(path.read_text())["fmha"]["outcomes"]
            if o.get("seconds")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=15, help="how many of the slowest tests to list")
    args = parser.parse_args()
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
