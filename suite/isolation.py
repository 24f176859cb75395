"""``--isolate``: each implementation runs in its own pytest process, so one bad kernel cannot cost the run.

A device-side fault leaves the CUDA context unusable for the rest of its process (errors are sticky) and
forking after CUDA is initialised is unsafe, so the parent spawns a fresh ``python -m pytest`` per
implementation with the same options. Each child streams its results to its own pytest-benchmark JSON
(rewritten after every test) and logs the start and end of every test to a heartbeat file. The parent:

- kills a child whose current test has run longer than ``--case-timeout`` and records that case as timed out;
- records the case in flight when a child dies (segfault, abort, killed) as failed with the exit status;
- restarts the child on the cases it had not reached, deselecting the ones already done;
- merges the children's JSON into one results file, which the report reads like any other.

Cases after a device fault in the same child fail with CUDA's sticky error and are recorded as failed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

POLL_S = 0.2
OWN_OPTIONS = ("--isolate", "--benchmark-json", "--report", "--case-timeout")  # the parent's, not the child's


@dataclass
class ChildResult:
    impl: str
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    json_files: list[Path] = field(default_factory=list)


XDIST_VARIABLES = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID")


def child_env() -> dict[str, str]:
    """The environment for a pytest started from inside a run: without pytest-xdist's worker variables, which
    would make the child believe it is a worker (pytest-benchmark then disables itself, and results go to a
    worker's file)."""
    return {k: v for k, v in os.environ.items() if k not in XDIST_VARIABLES}


def child_args(config: pytest.Config) -> list[str]:
    """The parent's command line without the options the parent keeps for itself."""
    args, skip_next = [], False
    for arg in config.invocation_params.args:
        if skip_next:
            skip_next = False
            continue
        name = arg.split("=", 1)[0]
        if name in OWN_OPTIONS:
            skip_next = "=" not in arg and name != "--isolate"
            continue
        args.append(arg)
    return args


def heartbeat_events(path: Path) -> list[dict]:
    """The events of a heartbeat file (``--heartbeat``): ``{"event": "start" | "finish", "nodeid", "t", "worker"}``
    (the xdist worker, None outside xdist; older files have no "worker")."""
    events = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
    return events


def read_heartbeat(path: Path) -> tuple[set[str], str | None, float]:
    """(finished node ids, node id in flight, its start time) from a child's heartbeat file."""
    finished, current, started = set(), None, 0.0
    for event in heartbeat_events(path):
        if event["event"] == "start":
            current, started = event["nodeid"], event["t"]
        elif event["event"] == "finish":
            finished.add(event["nodeid"])
            current = None if current == event["nodeid"] else current
    return finished, current, started


def heartbeat_span(path: Path) -> tuple[int, float]:
    """(tests finished, seconds from the first start to the last event) of a run's heartbeat file, shared by
    all its xdist workers: what a pass did by the time it ended or was stopped."""
    events = heartbeat_events(path)
    times = [event["t"] for event in events]
    return sum(event["event"] == "finish" for event in events), (max(times) - min(times) if times else 0.0)


def run_isolated(config: pytest.Config, items: list[pytest.Item], workdir: Path) -> list[ChildResult]:
    by_impl: dict[str, list[str]] = defaultdict(list)
    for item in items:
        by_impl[item.callspec.params["impl"].name].append(item.nodeid)
    timeout = config.getoption("--case-timeout")
    writer = config.get_terminal_writer()
    results = []
    for impl, nodeids in by_impl.items():
        result = ChildResult(impl)
        done: set[str] = set()
        attempt = 0
        while len(done) < len(nodeids):
            heartbeat = workdir / f"{impl}-{attempt}.heartbeat"
            out = workdir / f"{impl}-{attempt}.json"
            cmd = [sys.executable, "-m", "pytest", *child_args(config), "--only-impl", impl,
                   f"--heartbeat={heartbeat}", f"--benchmark-json={out}",
                   *(f"--deselect={nid}" for nid in sorted(done))]
            writer.line(f"[isolate] {impl}: {len(nodeids) - len(done)} cases in a fresh process")
            proc = subprocess.Popen(cmd, cwd=config.invocation_params.dir, start_new_session=True, env=child_env(),
                                    stdout=subprocess.DEVNULL if not config.getoption("verbose") else None)
            in_flight, reason = _watch(proc, heartbeat, timeout)
            finished, _, _ = read_heartbeat(heartbeat)
            done |= finished
            result.json_files.append(out)
            if in_flight:
                done.add(in_flight)
                result.outcomes.append(_outcome(impl, in_flight, reason))
                writer.line(f"[isolate] {impl}: {in_flight}: {reason}", red=True)
            elif len(done) < len(nodeids):  # exited between tests without finishing: give up on the rest
                for nid in nodeids:
                    if nid not in done:
                        result.outcomes.append(_outcome(impl, nid, f"not run: process exited ({reason})"))
                break
            attempt += 1
        results.append(result)
    return results


def _watch(proc: subprocess.Popen, heartbeat: Path, timeout: float) -> tuple[str | None, str]:
    """Wait for the child; kill it if its current test overruns. Returns (case in flight, what happened)."""
    while True:
        code = proc.poll()
        _, current, started = read_heartbeat(heartbeat)
        if code is not None:
            return current, f"process died (exit status {code})" if current else f"exit status {code}"
        if current and time.time() - started > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return current, f"timed out after {timeout:g} s (process killed)"
        time.sleep(POLL_S)


def _outcome(impl: str, nodeid: str, message: str) -> dict[str, Any]:
    case = nodeid.split("[", 1)[1].rstrip("]").removeprefix(f"{impl}-") if "[" in nodeid else nodeid
    phase = "benchmark" if "test_benchmark" in nodeid else "correctness"
    status = "timed out" if "timed out" in message else "failed"
    return {"impl": impl, "case": case, "phase": phase, "status": status, "message": message}


def merge(results: list[ChildResult], fmha: dict[str, Any]) -> dict[str, Any]:
    """One pytest-benchmark JSON from the children's: benchmarks concatenated, the fmha blocks united."""
    merged = merge_files([path for result in results for path in result.json_files], fmha)
    for result in results:
        fmha["outcomes"] += result.outcomes
    return merged


def merge_files(paths: list[Path], fmha: dict[str, Any]) -> dict[str, Any]:
    """The suite's JSON files as one (those that exist): benchmarks concatenated, their fmha blocks united into
    ``fmha`` (its lists and tables made where it lacks them). The first file's machine, commit and date stand for
    all."""
    merged: dict[str, Any] = {"benchmarks": [], "fmha": fmha}
    fmha.setdefault("outcomes", [])
    for key in ("cases", "impls", "unavailable", "presets"):
        fmha.setdefault(key, {})
    for path in paths:
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        for key in ("machine_info", "commit_info", "datetime", "version"):
            merged.setdefault(key, data.get(key))
        merged["benchmarks"] += data.get("benchmarks", [])
        child = data.get("fmha", {})
        fmha["outcomes"] += child.get("outcomes", [])
        for key in ("cases", "impls", "unavailable"):
            fmha[key].update(child.get(key, {}))
        for preset, ids in child.get("presets", {}).items():
            known = fmha["presets"].setdefault(preset, [])
            known += [i for i in ids if i not in known]
    return merged


def workdir() -> Path:
    """A fresh folder for the children's results: under FMHA_ISOLATE_DIR where set (a folder that outlives the run,
    so the files stay even if the parent is stopped before it merges them), else the system's temporary folder.
    Not TMPDIR: a JIT's compiler (FlashInfer's nvcc) writes its own temporary files there."""
    parent = os.environ.get("FMHA_ISOLATE_DIR")
    if parent:
        Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="fmha-isolate-", dir=parent or None))
