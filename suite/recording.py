"""What a run records beside pytest-benchmark's numbers: the state of the run, every test's outcome
(``Recorder``), the suite's ``fmha`` block of the results JSON, its checkpoint after every test, and the
merge of pytest-xdist workers' files. See docs/design.md#isolation-and-faults."""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

from impls import Impl, Prepared, Unsupported
from suite.cases import Case
from suite.checks import CheckResult
from suite.problem import Problem, is_out_of_memory, out_of_memory_message, release_device_memory
from suite.rest import RestPolicy


@dataclass
class RunState:
    device: torch.device
    impls: list[Impl]
    unavailable: dict[str, str]
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    presets: dict[str, list[str]] = field(default_factory=dict)
    cases: dict[str, dict] = field(default_factory=dict)
    machine_info: dict | None = None
    commit_info: dict | None = None
    rest: RestPolicy = field(default_factory=RestPolicy)  # --rest-ms: when a benchmark starts after a pause
    report: Path | None = None  # the HTML report, once written


STATE_KEY = pytest.StashKey[RunState]()


def run_state(config: pytest.Config) -> RunState:
    return config.stash[STATE_KEY]


class Recorder:
    """Records one implementation x case outcome: what the correctness matrix of the report shows."""

    def __init__(self, state: RunState, impl: Impl, case: Case, phase: str) -> None:
        self._state, self._impl, self._case, self._phase = state, impl, case, phase
        self.recorded = False
        self.seconds: dict[str, float] = {}  # wall time of the test's steps, so a slow suite shows where it goes

    def __call__(self, status: str, message: str = "", **extra: Any) -> None:
        self.recorded = True
        self._state.outcomes.append({
            "impl": self._impl.name, "family": self._impl.family, "case": self._case.id,
            "phase": self._phase, "status": status, "message": message, **extra,
            **({"seconds": {k: round(v, 4) for k, v in self.seconds.items()}} if self.seconds else {}),
        })

    @contextlib.contextmanager
    def timer(self, step: str) -> Iterator[None]:
        """Wall time of one step of the test (prepare: validation, tuning and compile; oracle; check), kept
        with the outcome. A host clock is right here: this is the suite's own cost, not a kernel's speed."""
        start = time.perf_counter()
        yield  # a step that raised is not timed: its outcome says what happened
        if self._state.device.type == "cuda":
            torch.cuda.synchronize(self._state.device)  # the step's device work belongs to it
        self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - start

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Whatever the implementation does, the outcome is recorded and the run goes on.

        Unsupported -> skipped with the reason; out of memory -> skipped as "out of memory (asked for N)",
        memory released; any other error -> failed with the error (and re-raised for pytest).
        """
        try:
            yield
        except Unsupported as exc:
            self("unsupported", str(exc))
            pytest.skip(f"unsupported: {exc}")
        except Exception as exc:
            if not is_out_of_memory(exc):
                if not self.recorded:
                    self("failed", f"{type(exc).__name__}: {exc}"[:500])
                raise
            self.skip_out_of_memory(exc)

    def skip_out_of_memory(self, exc: BaseException, during: str = "") -> NoReturn:
        """Record an out-of-memory error as the outcome ("out of memory (asked for N)", and ``during`` what),
        release what it held and skip the test."""
        message = out_of_memory_message(exc) + (f" {during}" if during else "")
        self("out of memory", message)
        traceback.clear_frames(exc.__traceback__)  # drop the frames' references to big tensors
        del exc
        release_device_memory(self._state.device)
        pytest.skip(message)

    def check(self, problem: Problem, prepared: Prepared) -> CheckResult:
        result = problem.check(prepared())
        if not result.passed:
            self("failed", **result.as_dict())
        return result


def benchmark_json(config: pytest.Config) -> Path | None:
    """Where ``--benchmark-json`` writes, or None. pytest-benchmark 5.3 keeps the option as a path; older ones (5.2.3)
    as the file they opened for it, whose name is the path."""
    value = config.getoption("benchmark_json", None)
    if hasattr(value, "write"):  # an open file (a Path has a ``name`` too: the file name alone)
        value = value.name
    return Path(value) if value else None


def fmha_record(config: pytest.Config) -> dict[str, Any]:
    """The suite's own block in the JSON: outcomes of every check, unavailable implementations, cases."""
    state = run_state(config)
    return {
        "schema": 1,
        "device": state.device.type,
        "baseline": config.getoption("--baseline"),
        "presets": state.presets,
        "cases": state.cases,
        "impls": {name: {"family": entries[0].family, "descriptions": {i.op: i.description for i in entries}}
                  for name, entries in by_name(state.impls).items()},
        "unavailable": state.unavailable,
        "outcomes": state.outcomes,
    }


def by_name(entries: list[Impl]) -> dict[str, list[Impl]]:
    """Implementations by name: one name is registered once per operation it runs."""
    grouped: dict[str, list[Impl]] = defaultdict(list)
    for impl in entries:
        grouped[impl.name].append(impl)
    return dict(grouped)


def checkpoint(config: pytest.Config) -> None:
    """Rewrite the results JSON after every test, atomically: a run killed part-way leaves a valid file
    with everything that finished (pytest-benchmark writes the same file once more at the end)."""
    path = benchmark_json(config)
    bench_session = getattr(config, "_benchmarksession", None)  # pytest-benchmark keeps its results there
    if not path or bench_session is None:
        return
    state = run_state(config)
    if state.machine_info is None:
        state.machine_info = bench_session.get_machine_info()
        state.commit_info = config.hook.pytest_benchmark_generate_commit_info(config=config)
    benchmarks = [b for b in bench_session.benchmarks if b and b.stats.rounds]
    output = config.hook.pytest_benchmark_generate_json(
        config=config, benchmarks=benchmarks, include_data=False,
        machine_info=state.machine_info, commit_info=state.commit_info)
    config.hook.pytest_benchmark_update_json(config=config, benchmarks=benchmarks, output_json=output)
    path = worker_results_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(output, indent=1, default=str))
    os.replace(partial, path)


def worker_results_path(path: Path) -> Path:
    """Under pytest-xdist each worker streams its results to its own file beside ``path`` (``bench.gw0.json``);
    the controller merges them into ``path`` at the end."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return path.with_name(f"{path.stem}.{worker}{path.suffix}") if worker else path


def merge_worker_results(config: pytest.Config, path: Path) -> None:
    """The controller of an xdist run: one results file from the workers' (each removed once merged)."""
    from suite import isolation

    files = sorted(path.parent.glob(f"{path.stem}.gw*{path.suffix}"))
    if not files:
        return
    merged = isolation.merge([isolation.ChildResult("xdist", json_files=files)], fmha_record(config))
    path.write_text(json.dumps(merged, indent=1, default=str))
    for f in files:
        f.unlink()


def record_crash(state: RunState, crashitem: str) -> None:
    """A pytest-xdist worker died running ``crashitem``: its case is recorded as failed with that reason."""
    param = crashitem.split("[", 1)[1].split("]", 1)[0] if "[" in crashitem else crashitem
    impl = max((i for i in state.impls if param.startswith(f"{i.name}-")), key=lambda i: len(i.name), default=None)
    if impl is None:
        return
    case = param.removeprefix(f"{impl.name}-")
    phase = "benchmark" if "test_benchmark" in crashitem else "correctness"
    if phase == "benchmark":
        case = case.rsplit("-", 1)[0]  # the timing mode
    state.outcomes.append({"impl": impl.name, "family": impl.family, "case": case, "phase": phase,
                           "status": "failed", "message": f"the worker process died running it ({crashitem})"})


def drop_from_queue(sched: Any, nodeid: str) -> None:
    """Mark ``nodeid`` done in pytest-xdist's group/scope scheduler, which puts a dead worker's whole unit of
    work back in its queue, the test that killed it included. An empty unit left there would hang the run."""
    queue = getattr(sched, "workqueue", None)
    if not isinstance(queue, dict):
        return  # the load scheduler does not run a crashed test again
    for scope, unit in list(queue.items()):
        if nodeid in unit:
            unit[nodeid] = True
        if all(unit.values()):
            del queue[scope]
