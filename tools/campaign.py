"""Run pytest invocations of the suite in time-limited, resumable steps that merge into one results file.

Each ``--run`` is one invocation (its arguments after ``python -m pytest``). A step runs it with a results file
and a heartbeat file of its own in a parts folder beside OUT (``results/x.parts/`` for ``results/x.json``), and
is killed at ``--step-seconds``: the suite rewrites its results after every test, so a killed step keeps
everything that finished, and the next step deselects the tests whose finish the heartbeat files hold. A test
that never finishes within a whole step is given up and listed. After every step the results of all steps so far
are merged into OUT by the suite's own merge (``tools.publish_results.combine``). The parts folder holds the
state: the same command run again goes on where it stopped, so under a job time limit resubmit it until it exits
0 (3: time ran out with tests left; 2: an invocation failed, see its step's log).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DONE = (0, 1, 5)  # pytest's exits for a finished pass: all passed, some failed, nothing left (all deselected)
EXIT_FAILED, EXIT_MORE = 2, 3
POLL_S = 0.5

EPILOG = """example (steps of at most 20 minutes, within a job of 4 hours; resubmit until it exits 0):
  python -m tools.campaign results/models.json --step-seconds 1200 --total-seconds 14400 \\
    --run "suite --benchmark-only --grid models --timing graph --impl cutile --impl triton" \\
    --run "suite --benchmark-only --grid models --timing graph --impl flashinfer"
  python -m reports results/models.json -o results/models.html
"""


def heartbeat(path: Path) -> tuple[set[str], set[str]]:
    """(finished, started but not finished) node ids of one step's heartbeat file."""
    from suite.isolation import heartbeat_events

    events = heartbeat_events(path)
    finished = {e["nodeid"] for e in events if e["event"] == "finish"}
    return finished, {e["nodeid"] for e in events if e["event"] == "start"} - finished


def load_state(parts: Path, index: int, args: str) -> dict[str, Any]:
    """A run's state: named by its place and arguments, so that a changed list starts the changed runs afresh."""
    name = f"run{index}-{hashlib.sha1(args.encode()).hexdigest()[:8]}"
    path = parts / f"{name}.state.json"
    if path.exists():
        return json.loads(path.read_text())
    return {"name": name, "args": args, "steps": 0, "status": "pending", "abandoned": []}


def save_state(parts: Path, state: dict[str, Any]) -> None:
    (parts / f"{state['name']}.state.json").write_text(json.dumps(state, indent=1))


def finished_before(parts: Path, state: dict[str, Any]) -> set[str]:
    return {nodeid for k in range(state["steps"]) for nodeid in heartbeat(parts / f"{state['name']}.{k}.hb")[0]}


def wait(proc: subprocess.Popen, hb: Path, limit: float, max_tests: int | None) -> int | None:
    """The step's exit status, or None where it was killed at its limit (time, or tests finished). SIGKILL, not
    SIGINT: an interrupted test still writes its finish, and would then never run again."""
    start = time.monotonic()
    while (status := proc.poll()) is None:
        if time.monotonic() - start > limit or (max_tests and len(heartbeat(hb)[0]) >= max_tests):
            os.killpg(proc.pid, signal.SIGKILL)  # the step's xdist workers too
            proc.wait()
            return None
        time.sleep(POLL_S)
    return status


def step(parts: Path, state: dict[str, Any], limit: float, max_tests: int | None) -> tuple[int | None, set[str],
                                                                                          set[str], float]:
    """One step of a run: (exit status or None, tests finished, tests in flight when it was killed, seconds)."""
    from suite.isolation import child_env

    stem = parts / f"{state['name']}.{state['steps']}"
    skip = sorted(finished_before(parts, state) | set(state["abandoned"]))
    cmd = [sys.executable, "-m", "pytest", *shlex.split(state["args"]), f"--benchmark-json={stem}.json",
           f"--heartbeat={stem}.hb", *(f"--deselect={nodeid}" for nodeid in skip)]
    start = time.monotonic()
    with open(f"{stem}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
        status = wait(proc, Path(f"{stem}.hb"), limit, max_tests)
    state["steps"] += 1
    finished, in_flight = heartbeat(Path(f"{stem}.hb"))
    return status, finished, in_flight, time.monotonic() - start


def merge(parts: Path, states: list[dict[str, Any]], out: Path) -> None:
    """Every step's results (the workers' files of a killed xdist step too), in run and step order, as OUT."""
    from tools.publish_results import combine

    files = [path for state in states for k in range(state["steps"])
             for path in sorted(parts.glob(f"{state['name']}.{k}.json")) + sorted(parts.glob(
                 f"{state['name']}.{k}.gw*.json"))]
    if files:
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps(combine(files), indent=1, default=str))
        os.replace(partial, out)


def campaign(out: Path, runs: list[str], step_seconds: float, total_seconds: float | None,
             max_tests: int | None) -> int:
    """Every run's steps in turn until all are done or the time is spent: 0, EXIT_FAILED or EXIT_MORE."""
    parts = out.with_name(out.name.split(".")[0] + ".parts")
    parts.mkdir(parents=True, exist_ok=True)
    states = [load_state(parts, i, args) for i, args in enumerate(runs)]
    start = time.monotonic()
    for state in states:
        while state["status"] == "pending":
            left = None if total_seconds is None else total_seconds - (time.monotonic() - start)
            if left is not None and left < 1:
                break
            limit = step_seconds if left is None else min(step_seconds, left)
            status, finished, in_flight, took = step(parts, state, limit, max_tests)
            done = len(finished_before(parts, state))
            print(f"{state['name']} step {state['steps'] - 1}: {len(finished)} tests finished ({done} in all), "
                  + f"{'exit ' + str(status) if status is not None else 'stopped'} after {took:.0f} s", flush=True)
            if status in DONE:
                state["status"] = "done"
            elif status is not None:
                state["status"] = "failed"
                print(f"{state['name']}: pytest exit {status}; see {parts}/{state['name']}.{state['steps'] - 1}.log")
            elif not finished and limit >= step_seconds:  # a whole step without a finish: give its tests up
                if not in_flight:
                    state["status"] = "failed"
                    print(f"{state['name']}: no test started within {limit:.0f} s (collection is slower)")
                for nodeid in sorted(in_flight):
                    print(f"{state['name']}: gave up {nodeid} (not finished within a step)")
                state["abandoned"] += sorted(in_flight)
            save_state(parts, state)
            merge(parts, states, out)
    statuses = {state["status"] for state in states}
    return EXIT_MORE if "pending" in statuses else EXIT_FAILED if "failed" in statuses else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.campaign", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the merged results file (its steps go to OUT.parts/ beside it)")
    parser.add_argument("--run", action="append", required=True, metavar="PYTEST_ARGS",
                        help="one pytest invocation's arguments, quoted (repeatable; run in order)")
    parser.add_argument("--step-seconds", type=float, default=600.0, help="each step's time limit (default 600)")
    parser.add_argument("--total-seconds", type=float, default=None,
                        help="no step runs past this many seconds from the start (default: no limit)")
    parser.add_argument("--step-tests", type=int, default=None, metavar="N",
                        help="also end a step once N tests have finished in it")
    args = parser.parse_args(argv)
    if any(option in run for run in args.run for option in ("--benchmark-json", "--heartbeat", "--isolate")):
        # --isolate's children keep their results apart until the parent merges them: a killed step loses them
        parser.error("--run takes no --benchmark-json, --heartbeat or --isolate (each step has its own files)")
    return campaign(args.out, args.run, args.step_seconds, args.total_seconds, args.step_tests)


if __name__ == "__main__":
    sys.exit(main())
