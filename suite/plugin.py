"""pytest plugin of the suite: options, the implementation x case parametrisation, shared fixtures, and
the records (outcomes, unavailable implementations, machine) that go into pytest-benchmark's JSON."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import time
import traceback
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

import impls
from impls import Impl, Prepared, Unsupported, timing
from impls.timing import STEADY_TOLERANCE, STEADY_WINDOW_S, clone_inputs
from suite import cases as grid
from suite.cases import Case
from suite.checks import CheckResult, Oracle
from suite.rest import AUTO_REST_S, HEAVIER, RestPolicy

DEFAULT_GRIDS = {  # phase -> (without a GPU, with one)
    "correctness": (("cpu", "serving-cpu", "varlen-cpu", "models-cpu", "models-serving-cpu"),
                    ("gpu", "serving-cpu", "varlen-cpu", "models-cpu", "models-serving-cpu")),
    "benchmark": (("cpu-bench",), ("blog",)),
}
# Timing modes by default (impls/timing.py): on a GPU the CUDA-graph number leads (the kernels' own time,
# host launch cost removed) and eager stands beside it (what a Python caller pays); kernel time on request.
DEFAULT_TIMING = (("eager",), ("graph", "eager"))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fmha", "fmha-bench")
    group.addoption("--impl", action="append", default=[], metavar="GLOB",
                    help="implementations to run (repeatable, globs like 'sdpa-*'); default all")
    group.addoption("--grid", action="append", default=[], metavar="PRESET", choices=list(grid.PRESETS),
                    help=f"case presets (repeatable): {', '.join(grid.PRESETS)}; "
                         "default cpu/gpu for correctness, cpu-bench/blog for benchmarks")
    group.addoption("--device", default=None, choices=("cpu", "cuda"),
                    help="where to run; default cuda when available")
    group.addoption("--rounds", type=int, default=None, help="timed rounds per benchmark (default 20 GPU, 5 CPU)")
    group.addoption("--warmup-rounds", type=int, default=3, help="untimed rounds before timing (default 3)")
    group.addoption("--settle-ms", type=float, default=None,
                    help="run each benchmark's call back to back this long before its warm-up rounds, so that "
                         "the GPU's clocks have come down to what its power limit sustains (default 250 on a "
                         "GPU, 0 on CPU; 0: time from whatever state the previous work left)")
    group.addoption("--rest-ms", type=rest_option, default="auto",
                    help="GPU: leave the GPU idle this long before each benchmark's settling, so that every benchmark "
                         "starts from the same power state, not from the one the case before left; 0: never. "
                         f"Default auto: {AUTO_REST_S * 1e3:.0f} ms only after a benchmark whose calls ran at least "
                         f"{HEAVIER:g} times as long (without it a short prefill case right after a heavy one read "
                         "up to 8%% slow on an H200; docs/usage.md)")
    group.addoption("--settle-max-ms", type=float, default=0,
                    help=f"GPU: after --settle-ms, go on settling in timed windows of {STEADY_WINDOW_S * 1e3:.0f} "
                         f"ms until two in a row agree within {STEADY_TOLERANCE * 100:.0f}%%, at most this long in "
                         "all (0, the default: --settle-ms alone; on an H100 it did not reduce drift, docs/usage.md). "
                         "The report flags rounds that drifted more than 2%% while timed")
    group.addoption("--energy-ms", type=float, default=0,
                    help="GPU: after timing, run each benchmark's call back to back this long and record the "
                         "energy NVML's counter saw (joules per call, average watts). The counter moves in steps "
                         "of about 100 ms on an H200, so ask for 1000 or more (default 0: not measured)")
    group.addoption("--round-ms", type=float, default=None,
                    help="target length of a round; calls per round follow from it (default 20 GPU, 50 CPU)")
    group.addoption("--cold-l2", action="store_true",
                    help="keep the L2 cache cold: eager and kernel modes flush it before every round (one call "
                         "per round; flush not timed), graph mode rotates over enough copies of the inputs")
    group.addoption("--timing", action="append", default=[], choices=timing.MODES,
                    help="timing mode (repeatable): eager (CUDA events around queued calls), graph (CUDA-graph "
                         "replays), kernel (profiler: device time of the kernels); default graph and eager on "
                         "a GPU, eager on CPU")
    group.addoption("--retune", action="store_true",
                    help="tune our kernels again and overwrite the tuning cache (FMHA_TUNING=retune)")
    group.addoption("--no-tuning-cache", action="store_true",
                    help="tune our kernels without reading or writing the tuning cache (FMHA_TUNING=off)")
    group.addoption("--compile-candidates", action="store_true",
                    help="a worker that shares its GPU (and so tunes nothing) still compiles our tuners' candidates, "
                         "untimed, into the compile caches on disk, for the tuning run after it "
                         "(FMHA_COMPILE_CANDIDATES=1)")
    group.addoption("--report", metavar="HTML", default=None,
                    help="write the HTML comparison report at the end of the session")
    group.addoption("--baseline", default="sdpa", help="implementation speedups are relative to (report)")
    group.addoption("--isolate", action="store_true",
                    help="run each implementation in its own process: a crash, device fault or hang costs "
                         "only that implementation's case (see suite/isolation.py)")
    group.addoption("--case-timeout", type=float, default=300.0,
                    help="with --isolate: seconds one test may run before its process is killed (default 300)")
    group.addoption("--list-impls", action="store_true",
                    help="list the implementations (of --impl, default all) of every operation: family, the "
                         "variants they take, whether they can run on this device or why not; then exit")
    group.addoption("--only-impl", default=None, help=argparse.SUPPRESS)  # set by --isolate for its children
    group.addoption("--heartbeat", default=None, help=argparse.SUPPRESS)  # likewise


def rest_option(value: str) -> float | str:
    """``--rest-ms``: milliseconds, or ``auto``."""
    if value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"milliseconds or 'auto', not {value!r}") from None


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


STATE_KEY = pytest.StashKey[RunState]()


def run_state(config: pytest.Config) -> RunState:
    return config.stash[STATE_KEY]


def device_and_selection(config: pytest.Config) -> tuple[torch.device, list[Impl]]:
    """The device a run uses (``--device``, default cuda where there is one) and the implementations its ``--impl``
    globs (and ``--isolate``'s ``--only-impl``) pick, whether or not they can run there."""
    requested = config.getoption("--device")
    device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        selected = impls.select(config.getoption("--impl"))
    except ValueError as error:  # a glob that names nothing: a usage error, not a traceback
        raise pytest.UsageError(str(error)) from None
    if config.getoption("--only-impl"):
        selected = [i for i in selected if i.name == config.getoption("--only-impl")]
    return device, selected


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """``--list-impls``: the registry as a table, without collecting or running anything."""
    if not config.getoption("--list-impls"):
        return None
    device, selected = device_and_selection(config)
    rows = [("operation", "implementation", "family", "variants", f"on {device.type}")]
    rows += [(i.op, i.name, i.family, ",".join(i.variants) or "-", i.availability(device.type) or "runs")
             for i in sorted(selected, key=lambda i: (grid.OPS.index(i.op), i.name))]
    widths = [max(len(row[col]) for row in rows) for col in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4])
    return 0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cases(*cases): run this test on these cases instead of the grid")
    # pytest-xdist declares the marker the collection below puts on every case; without xdist (``-p no:xdist``)
    # the suite runs in one process, and the strict marker check would refuse it
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's --dist loadgroup runs a group on one worker")
    device, selected = device_and_selection(config)
    reasons = {(i.op, i.name): r for i in selected if (r := i.availability(device.type))}
    if config.getoption("--retune") or config.getoption("--no-tuning-cache"):
        # Read by impls.tuning, in this process and in the children of --isolate.
        os.environ["FMHA_TUNING"] = "retune" if config.getoption("--retune") else "off"
    if config.getoption("--compile-candidates"):
        os.environ["FMHA_COMPILE_CANDIDATES"] = "1"
    rest_ms = config.getoption("--rest-ms")
    config.stash[STATE_KEY] = RunState(
        device=device, impls=[i for i in selected if (i.op, i.name) not in reasons],
        unavailable=unavailable_by_name(selected, reasons),
        rest=RestPolicy(None if rest_ms == "auto" else rest_ms / 1e3),
    )
    if device.type == "cuda" and config.getoption("benchmark_timer", None) == "time.perf_counter":
        config.option.benchmark_timer = "impls.timing.cuda_clock"
    wants_file = config.getoption("--report") or config.getoption("--isolate")
    if wants_file and not benchmark_json(config):
        Path("results").mkdir(exist_ok=True)
        config.option.benchmark_json = Path("results") / "benchmark.json"


def unavailable_by_name(selected: list[Impl], reasons: dict[tuple[str, str], str]) -> dict[str, str]:
    """The reasons an implementation cannot run here, under its name where none of its operations can, else under
    ``name (op)`` for each operation that cannot (flex's paged entry needs a GPU, its dense one does not)."""
    ops = defaultdict(list)
    for impl in selected:
        ops[impl.name].append(impl.op)
    unavailable = {}
    for (op, name), reason in reasons.items():
        whole = all((other, name) in reasons for other in ops[name])
        unavailable[name if whole else f"{name} ({op})"] = reason
    return unavailable


def benchmark_json(config: pytest.Config) -> Path | None:
    """Where ``--benchmark-json`` writes, or None. pytest-benchmark 5.3 keeps the option as a path; older ones (5.2.3,
    the GPU image's own) as the file they opened for it, whose name is the path."""
    value = config.getoption("benchmark_json", None)
    if hasattr(value, "write"):  # an open file (a Path has a ``name`` too: the file name alone)
        value = value.name
    return Path(value) if value else None


def grids_for(config: pytest.Config, phase: str) -> list[str]:
    return config.getoption("--grid") or list(DEFAULT_GRIDS[phase][run_state(config).device.type == "cuda"])


def timing_modes(config: pytest.Config) -> list[str]:
    chosen = config.getoption("--timing") or DEFAULT_TIMING[run_state(config).device.type == "cuda"]
    return list(dict.fromkeys(chosen))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not {"impl", "case"} <= set(metafunc.fixturenames):
        return
    state = run_state(metafunc.config)
    phase = "benchmark" if "benchmark" in metafunc.fixturenames else "correctness"
    marker = metafunc.definition.get_closest_marker("cases")  # a test that names its own cases
    selected = [("properties", c) for c in marker.args] if marker else grid.cases(grids_for(metafunc.config, phase))
    params = []
    for preset, case in selected:
        if case.id not in state.cases:
            state.cases[case.id] = {**case.as_dict(), "preset": preset, "merit": case.merit}
            state.presets.setdefault(preset, []).append(case.id)
        params += [pytest.param(impl, case, id=f"{impl.name}-{case.id}") for impl in state.impls
                   if impl.op == case.op]
    metafunc.parametrize(("impl", "case"), params)
    if "timing" in metafunc.fixturenames:
        metafunc.parametrize("timing", timing_modes(metafunc.config))


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    return run_state(pytestconfig).device


class Problem:
    """One case's inputs on the device and, on first use, its oracle."""

    def __init__(self, case: Case, device: torch.device) -> None:
        self.case = case
        self.device = device
        self.inputs = case.make_inputs(device)

    @property
    def q(self) -> torch.Tensor:
        return self.inputs[0] if self.case.op == "dense" else self.inputs.q

    @property
    def k(self) -> torch.Tensor:  # dense only
        return self.inputs[1]

    @property
    def v(self) -> torch.Tensor:  # dense only
        return self.inputs[2]

    @cached_property
    def oracle(self) -> Oracle:
        if self.case.op == "dense":
            return Oracle.dense(*self.inputs, causal=self.case.causal, **self.case.variants)
        return Oracle.serving(self.inputs, **self.case.variants)

    def prepare(self, impl: Impl, inputs: Any = None) -> Prepared:
        """``impl`` prepared on this case's inputs (or on a copy of them, ``inputs``)."""
        inputs = self.inputs if inputs is None else inputs
        if self.case.op == "dense":
            return impl.prepare(*inputs, causal=self.case.causal, **self.case.variants)
        return impl.prepare(inputs, **self.case.variants)

    def input_copies(self, n: int) -> list[Any]:
        """``n`` copies of the inputs in fresh memory, the first being the inputs themselves."""
        return [self.inputs] + [clone_inputs(self.inputs) for _ in range(n - 1)]

    def check(self, out: torch.Tensor) -> CheckResult:
        return self.oracle.check(out)


_last_problem: list[Problem] = []  # tests run case-major, so one cached case serves all implementations


@pytest.fixture
def problem(case: Case, device: torch.device, record: Recorder) -> Problem:
    if not _last_problem or _last_problem[0].case != case or _last_problem[0].device != device:
        _last_problem.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            _last_problem.append(Problem(case, device))
        except Exception as exc:  # the case's inputs alone outgrow the memory free now (e.g. many xdist workers
            if not is_out_of_memory(exc):  # sharing one 80 GB GPU, session 29): recorded, and the run goes on
                raise
            record.skip_out_of_memory(exc, "making the case's inputs")
    return _last_problem[0]


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's refusal (a plain RuntimeError)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def out_of_memory_message(exc: BaseException) -> str:
    text = str(exc)
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    if asked:
        return f"out of memory (asked for {asked.group(1)})"
    asked = re.search(r"tried to allocate (\d+) bytes", text)
    return f"out of memory (asked for {int(asked.group(1))} bytes)" if asked else "out of memory"


def release_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


@pytest.fixture
def record(request: pytest.FixtureRequest, impl: Impl, case: Case) -> Recorder:
    phase = "benchmark" if "benchmark" in request.fixturenames else "correctness"
    return Recorder(run_state(request.config), impl, case, phase)


def pytest_sessionstart(session: pytest.Session) -> None:
    """An xdist worker alone on its GPU times its benchmarks (suite/sharding.py): pytest-benchmark, which
    switched itself off under xdist, is switched back on."""
    from suite.sharding import worker_may_time

    bench_session = getattr(session.config, "_benchmarksession", None)
    if bench_session is not None and bench_session.disabled and worker_may_time():
        bench_session.disabled = False


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook turns the markers into node-id suffixes
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist's ``--dist loadgroup``. A benchmark goes with its case: every implementation of
    one case is timed on one worker, one device, so that side-by-side ratios compare like with like. A check
    goes with its implementation's compiled form (``check_group``): the cases one kernel signature serves run
    on one worker, which compiles and tunes them once, while an implementation's other forms run beside it."""
    for item in items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if params and isinstance(params.get("case"), Case):
            impl = params.get("impl")
            by_impl = isinstance(impl, Impl) and "benchmark" not in item.fixturenames
            item.add_marker(pytest.mark.xdist_group(check_group(impl, params["case"]) if by_impl
                                                    else params["case"].id))


def check_group(impl: Impl, case: Case) -> str:
    """Operation, dtype, head dim and mask select a compiled kernel (and a tuning class) in every family here.
    Grouping checks by implementation alone left one worker compiling all of an implementation's kernels in
    turn: 240 s of the H200's cold correctness run went to one cuTile ladder step."""
    mask = "causal" if case.causal else "full"
    return f"{impl.name}:{case.op}:{case.dtype}:d{case.d}:{mask}"


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    state = config.stash.get(STATE_KEY, None)
    if state and state.unavailable:
        terminalreporter.section("unavailable implementations")
        for name, reason in state.unavailable.items():
            terminalreporter.write_line(f"{name}: {reason}")


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and, on a GPU, the device's identity: what a reader needs to place the numbers."""
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    from suite.metrics import device_peak_tflops

    info: dict[str, Any] = {
        "device": device.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "triton": version("triton"),
        "cuda-tile": version("cuda-tile"),
        "flash-attn": version("flash-attn") or version("flash-attn-4") or version("flash_attn_3"),
    }
    peak, source = device_peak_tflops(device)
    info.update(peak_tflops=peak, peak_source=source)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
            driver=_nvidia_smi("driver_version"),
            sm_clock_max_mhz=_nvidia_smi("clocks.max.sm"),
            mem_clock_max_mhz=_nvidia_smi("clocks.max.mem"),
        )
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def _nvidia_smi(query: str) -> str | None:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["fmha"] = environment(run_state(config).device)


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
                  for name, entries in _by_name(state.impls).items()},
        "unavailable": state.unavailable,
        "outcomes": state.outcomes,
    }


def _by_name(entries: list[Impl]) -> dict[str, list[Impl]]:
    """Implementations by name: one name is registered once per operation it runs."""
    grouped: dict[str, list[Impl]] = defaultdict(list)
    for impl in entries:
        grouped[impl.name].append(impl)
    return dict(grouped)


def pytest_benchmark_update_json(config: pytest.Config, benchmarks, output_json: dict) -> None:
    output_json["fmha"] = fmha_record(config)


def _heartbeat(config: pytest.Config, event: str, nodeid: str) -> None:
    path = config.getoption("--heartbeat")
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER")  # which process ran it: a sharded pass's critical path
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "nodeid": nodeid, "t": time.time(), "worker": worker}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _heartbeat(item.config, "start", item.nodeid)
    yield
    checkpoint(item.config)
    _heartbeat(item.config, "finish", item.nodeid)  # only once its results are on disk


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    """With --isolate the parent runs nothing itself: it runs one child process per implementation."""
    config = session.config
    if not config.getoption("--isolate") or config.getoption("--only-impl") or not session.items:
        return None
    if config.getoption("collectonly"):
        return None
    from suite import isolation

    results = isolation.run_isolated(config, session.items, isolation.workdir())
    merged = isolation.merge(results, fmha_record(config))
    path = benchmark_json(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=1, default=str))
    counts: dict[str, int] = defaultdict(int)
    for outcome in merged["fmha"]["outcomes"]:
        counts[outcome["status"]] += 1
    session.testsfailed = counts["failed"] + counts["timed out"]
    config.get_terminal_writer().line(
        f"[isolate] {', '.join(f'{n} {status}' for status, n in sorted(counts.items()))}; results in {path}")
    return True


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


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    """pytest-xdist, on the controller: a worker died in ``crashitem`` (a segfault, an abort, a device fault).
    The case is recorded as failed with that reason, like ``--isolate`` does; the other workers' files stand.
    It is not run again: it would only kill the replacement worker too."""
    drop_from_queue(sched, crashitem)
    state = run_state(sched.config)
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


def drop_from_queue(sched, nodeid: str) -> None:
    """Mark ``nodeid`` done in pytest-xdist's group/scope scheduler, which puts a dead worker's whole unit of
    work back in its queue, the test that killed it included. A unit with nothing left to run is removed: an
    empty one left in the queue keeps the run waiting for ever (seen with a crash in the last group)."""
    queue = getattr(sched, "workqueue", None)
    if not isinstance(queue, dict):
        return  # the load scheduler does not run a crashed test again
    for scope, unit in list(queue.items()):
        if nodeid in unit:
            unit[nodeid] = True
        if all(unit.values()):
            del queue[scope]


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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # pytest-benchmark writes its JSON in a wrapper around this hook, so the file exists here.
    report = session.config.getoption("--report")
    results = benchmark_json(session.config)
    if results and not os.environ.get("PYTEST_XDIST_WORKER"):
        merge_worker_results(session.config, results)
    if not report:
        return
    if not results or not results.exists():
        session.config.get_terminal_writer().line(f"fmha-bench: no benchmark results, {report} not written")
        return
    from reports.build import write_report

    write_report([results], Path(report), baseline=session.config.getoption("--baseline"))
    session.config.get_terminal_writer().line(f"fmha-bench: report written to {report}")
