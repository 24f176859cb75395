"""pytest plugin of the suite: options, the implementation x case parametrisation, the fixtures of
``suite/test_*.py`` (``device``, ``problem``, ``record``), and the hooks that record a run and say what it did.
Problems live in ``suite/problem.py``, records in ``suite/recording.py``, the closing summary in
``suite/summary.py``. See docs/design.md#architecture."""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import impls
from impls import Impl, timing
from impls.timing import STEADY_TOLERANCE, STEADY_WINDOW_S
from suite import cases, presets
from suite.cases import Case
from suite.environment import environment
from suite.problem import Problem, problem_for
from suite.recording import (
    STATE_KEY,
    Recorder,
    RunState,
    benchmark_json,
    checkpoint,
    drop_from_queue,
    fmha_record,
    merge_worker_results,
    record_crash,
    run_state,
)
from suite.rest import AUTO_REST_S, HEAVIER, RestPolicy

DEVICES = ("cpu", "cuda")
DEFAULT_GRIDS = {  # phase -> (without a GPU, with one)
    "correctness": (("cpu", "serving-cpu", "varlen-cpu", "models-cpu", "models-serving-cpu", "mla-cpu",
                     "serving-mixed-cpu", "bwd-cpu"),
                    ("gpu", "serving-cpu", "varlen-cpu", "models-cpu", "models-serving-cpu", "mla-cpu",
                     "serving-mixed-cpu", "bwd-cpu")),
    "benchmark": (("cpu-bench",), ("blog",)),
}
# Timing modes by default (impls/timing.py): on a GPU the CUDA-graph number (the kernels' own time, host launch
# cost removed); eager (what a Python caller pays) and kernel time on request. Eager beside graph doubled the
# main job's benchmarks: 49 of its 144 s from cold on an H200 (docs/design.md#cold-runs).
DEFAULT_TIMING = (("eager",), ("graph",))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fmha", "fmha-bench")
    group.addoption("--impl", action="append", default=[], metavar="GLOB",
                    help="implementations to run (repeatable, globs like 'sdpa-*'); default all")
    group.addoption("--grid", action="append", default=[], metavar="PRESET",
                    help=f"case presets (repeatable): {', '.join(presets.LISTED_PRESETS)}; "
                         "default cpu/gpu for correctness, cpu-bench/blog for benchmarks")
    group.addoption("--device", default=None, metavar="DEVICE",
                    help=f"where to run: {', '.join(DEVICES)}; default cuda when available")
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
    group.addoption("--timing", action="append", default=[], metavar="MODE",
                    help="timing mode (repeatable): eager (CUDA events around queued calls), graph (CUDA-graph "
                         "replays), kernel (profiler: device time of the kernels); default graph on "
                         "a GPU, eager on CPU")
    group.addoption("--tune", action="store_true",
                    help="tune our kernels on this machine where its tuning cache has no pick, and store the pick "
                         "(FMHA_TUNING=tune; by default they run the pick shipped for the GPU, or a heuristic)")
    group.addoption("--retune", action="store_true",
                    help="tune our kernels again and overwrite the tuning cache (FMHA_TUNING=retune)")
    group.addoption("--no-tuning-cache", action="store_true",
                    help="neither read nor write the tuning cache, nor tune: shipped and heuristic picks only "
                         "(FMHA_TUNING=off)")
    group.addoption("--compile-candidates", action="store_true",
                    help="a worker that shares its GPU (and so tunes nothing) still compiles our tuners' candidates, "
                         "untimed, into the compile caches on disk, for the tuning run after it "
                         "(FMHA_COMPILE_CANDIDATES=1)")
    group.addoption("--report", metavar="HTML", default=None,
                    help="write the HTML comparison report at the end of the run")
    group.addoption("--baseline", default=None,
                    help="implementation speedups are relative to in the report (default: each case's best peer)")
    group.addoption("--benchmark-table", action="store_true",
                    help="also print pytest-benchmark's own tables (times in its units, every statistic); by "
                         "default a run prints one compact table per preset in the report's units")
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


def check_choices(config: pytest.Config) -> None:
    """The options that take a name, checked here rather than by argparse, whose message names ``__main__.py``
    under ``python -m pytest`` and would list the presets the README leaves out."""
    choices = {"--device": ("device", DEVICES, DEVICES), "--grid": ("preset", presets.PRESETS, presets.LISTED_PRESETS),
               "--timing": ("timing mode", timing.MODES, timing.MODES)}
    for option, (what, accepted, listed) in choices.items():
        given = config.getoption(option)
        for value in given if isinstance(given, list) else [given]:
            if value is not None and value not in accepted:
                raise pytest.UsageError(f"pytest: {option} {value}: unknown {what}; choose from {', '.join(listed)}")


def device_and_selection(config: pytest.Config) -> tuple[torch.device, list[Impl]]:
    """The device a run uses (``--device``, default cuda where there is one) and the implementations its ``--impl``
    globs (and ``--isolate``'s ``--only-impl``) pick, whether or not they can run there."""
    check_choices(config)
    requested = config.getoption("--device")
    device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        selected = impls.select(config.getoption("--impl"))
    except ValueError as error:  # a glob that names nothing: a usage error, not a traceback
        raise pytest.UsageError(f"pytest: --impl: {error}") from None
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
             for i in sorted(selected, key=lambda i: (cases.OPS.index(i.op), i.name))]
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
    tuning_mode = next((mode for option, mode in (("--retune", "retune"), ("--tune", "tune"),
                                                  ("--no-tuning-cache", "off")) if config.getoption(option)), None)
    if tuning_mode:  # read by impls.tuning, in this process and in the children of --isolate
        os.environ["FMHA_TUNING"] = tuning_mode
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
    grids = [] if marker else grids_for(metafunc.config, phase)
    selected = [("properties", c) for c in marker.args] if marker else presets.cases(grids)
    params = []
    named = bool(metafunc.config.getoption("--impl"))  # else studies (the blog's ladder) run in their presets only
    for preset, case in selected:
        holding = [name for name in grids if case in presets.preset(name)] or [preset]
        if case.id not in state.cases:
            state.cases[case.id] = {**case.as_dict(), "preset": preset, "merit": case.merit}
            state.presets.setdefault(preset, []).append(case.id)
        params += [pytest.param(impl, case, id=f"{impl.name}-{case.id}") for impl in state.impls
                   if impl.op == case.op and (named or any(map(impl.runs_in, holding)))]
    metafunc.parametrize(("impl", "case"), params)
    if "timing" in metafunc.fixturenames:
        metafunc.parametrize("timing", timing_modes(metafunc.config))


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    return run_state(pytestconfig).device


@pytest.fixture
def problem(case: Case, device: torch.device, record: Recorder) -> Problem:
    return problem_for(case, device, record)


@pytest.fixture
def record(request: pytest.FixtureRequest, impl: Impl, case: Case) -> Recorder:
    phase = "benchmark" if "benchmark" in request.fixturenames else "correctness"
    return Recorder(run_state(request.config), impl, case, phase)


def pytest_sessionstart(session: pytest.Session) -> None:
    """An xdist worker alone on its GPU times its benchmarks (suite/sharding.py): pytest-benchmark, which
    switched itself off under xdist, is switched back on. Its own tables (times in µs, every statistic) give
    way to the compact ones of ``suite/summary.py`` unless asked for."""
    from suite.sharding import worker_may_time

    config = session.config
    bench_session = getattr(config, "_benchmarksession", None)
    if bench_session is None:
        return
    if bench_session.disabled and worker_may_time():
        bench_session.disabled = False
    if not (config.getoption("--benchmark-table") or config.getoption("benchmark_compare", None)):
        bench_session.quiet = True  # its tables only: a regression check still fails the run


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook turns the markers into node-id suffixes
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--benchmark-only`` deselects the other tests (pytest-benchmark would list each as skipped). Groups for
    pytest-xdist's ``--dist loadgroup``: a benchmark goes with its case, so that every implementation of one case
    is timed on one device; a check goes with its implementation's compiled form (``check_group``), so that one
    worker compiles and tunes each kernel signature once. See docs/design.md#architecture."""
    if config.getoption("benchmark_only", False):
        others = [item for item in items if "benchmark" not in getattr(item, "fixturenames", ())]
        if others:
            config.hook.pytest_deselected(items=others)
            items[:] = [item for item in items if "benchmark" in getattr(item, "fixturenames", ())]
    tiered = project_test_run(config)
    first_of: set[tuple] = set()
    for item in items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if params and isinstance(params.get("case"), Case):
            impl = params.get("impl")
            by_impl = isinstance(impl, Impl) and "benchmark" not in item.fixturenames
            item.add_marker(pytest.mark.xdist_group(check_group(impl, params["case"]) if by_impl
                                                    else params["case"].id))
            if tiered and isinstance(impl, Impl):
                form = (item.originalname, check_group(impl, params["case"]),
                        *(f"{k}={v}" for k, v in params.items() if k not in ("impl", "case")))
                if form in first_of:
                    item.add_marker(pytest.mark.slow)
                first_of.add(form)


def project_test_run(config: pytest.Config) -> bool:
    """``pytest`` without paths (the ``testpaths``): the project's own test run, whose fast tier checks each
    compiled form of an implementation on its first case and leaves the other cases to ``-m slow``. A run that
    names ``suite`` checks every case. See docs/design.md#correctness."""
    given = {(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args}
    return given == {(config.rootpath / path).resolve() for path in config.getini("testpaths")}


def check_group(impl: Impl, case: Case) -> str:
    """Operation, dtype, head dim and mask select a compiled kernel (and a tuning class) in every family here.
    Grouping checks by implementation alone left one worker compiling all of an implementation's kernels in
    turn: 240 s of the H200's cold correctness run went to one cuTile ladder step."""
    mask = "causal" if case.causal else "full"
    return f"{impl.name}:{case.op}:{case.dtype}:d{case.d}:{mask}"


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """A compact table per preset of what was timed, which implementations ran and which could not."""
    state = config.stash.get(STATE_KEY, None)
    if state is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from suite import summary

    run = summary.measured_run(config, benchmark_json(config))
    for title, lines in summary.preset_tables(run) if run else []:
        terminalreporter.write_sep("-", title)
        for line in lines:
            terminalreporter.write_line(line)
    outcomes = run.outcomes if run else state.outcomes
    if outcomes:
        terminalreporter.write_sep("-", "implementations")
        for line in summary.implementation_lines(state, outcomes):
            terminalreporter.write_line(line)
    elif state.unavailable:  # outcomes stay with pytest-xdist's workers where no results file gathers them
        terminalreporter.write_sep("-", "unavailable implementations")
        for name, reason in state.unavailable.items():
            terminalreporter.write_line(f"{name}: {reason}")


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["fmha"] = environment(run_state(config).device)


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


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    """pytest-xdist, on the controller: a worker died in ``crashitem`` (a segfault, an abort, a device fault).
    The case is recorded as failed with that reason, like ``--isolate`` does; the other workers' files stand.
    It is not run again: it would only kill the replacement worker too."""
    drop_from_queue(sched, crashitem)
    record_crash(run_state(sched.config), crashitem)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # pytest-benchmark writes its JSON in a wrapper around this hook, so the file exists here.
    config = session.config
    report = config.getoption("--report")
    results = benchmark_json(config)
    if results and not os.environ.get("PYTEST_XDIST_WORKER"):
        merge_worker_results(config, results)
    if not report:
        return
    if not results or not results.exists():
        config.get_terminal_writer().line(f"fmha-bench: no benchmark results, {report} not written")
        return
    from reports.build import write_report

    run_state(config).report = write_report([results], Path(report), baseline=config.getoption("--baseline"))


@pytest.hookimpl(hookwrapper=True)
def pytest_unconfigure(config: pytest.Config):
    """pytest-benchmark's closing warning that xdist disabled it is dropped (docs/usage.md says what a run under
    ``-n`` times); then the report's path, the run's last line, after pytest's own summary."""
    from pytest_benchmark.logger import PytestBenchmarkWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Benchmarks are automatically disabled because xdist plugin is active",
                                PytestBenchmarkWarning)
        yield
    state = config.stash.get(STATE_KEY, None)
    if state is not None and state.report is not None:
        config.get_terminal_writer().line(f"fmha-bench: report written to {state.report}")
