"""Timing with pytest-benchmark: checked once first, so that no unchecked number is ever reported."""

import pytest
import torch

from impls import Impl
from suite import metrics
from suite.cases import Case
from suite.plugin import Problem, Recorder
from suite.timing import L2Flusher, iterations_for, time_once


def peak_memory_bytes(fn, device: torch.device) -> int | None:
    """Device memory one call needs at its peak beyond its inputs, output included.

    Kernels that write into an output buffer allocated once at prepare allocate nothing per call;
    their output is counted all the same, so that every implementation is measured alike.
    """
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    output_allocated_by_call = torch.cuda.memory_allocated(device) - before >= out.untyped_storage().nbytes()
    return peak if output_allocated_by_call else peak + out.untyped_storage().nbytes()


def test_benchmark(benchmark, impl: Impl, case: Case, problem: Problem, record: Recorder,
                   pytestconfig: pytest.Config) -> None:
    with record.guard():
        measure(benchmark, impl, case, problem, record, pytestconfig)


def measure(benchmark, impl: Impl, case: Case, problem: Problem, record: Recorder,
            pytestconfig: pytest.Config) -> None:
    prepared = problem.prepare(impl)
    check = record.check(problem, prepared)
    if not check.passed:
        pytest.fail(f"not timed, output is wrong: {check.message}")

    device = problem.device
    on_gpu = device.type == "cuda"
    rounds = pytestconfig.getoption("--rounds") or (20 if on_gpu else 5)
    round_s = (pytestconfig.getoption("--round-ms") or (20 if on_gpu else 50)) / 1e3
    if pytestconfig.getoption("--cold-l2") and on_gpu:
        schedule = {"setup": L2Flusher(device), "iterations": 1}
    else:
        schedule = {"iterations": iterations_for(time_once(prepared, device), round_s)}
    peak_bytes = peak_memory_bytes(prepared, device)

    benchmark.group = case.id
    benchmark.pedantic(prepared, rounds=rounds, warmup_rounds=pytestconfig.getoption("--warmup-rounds"),
                       **schedule)

    info = benchmark.extra_info
    info.update(impl=impl.name, family=impl.family, case=case.id, **case.as_dict())
    info.update(config=prepared.config, max_error=check.max_error, tolerance=check.tolerance,
                flops=metrics.flops(case), min_bytes=metrics.min_bytes(case), peak_memory_bytes=peak_bytes,
                iterations=schedule["iterations"], cold_l2="setup" in schedule)
    if benchmark.stats is not None:  # None under --benchmark-disable: the call ran once, untimed
        median = benchmark.stats.stats.median
        peak, source = metrics.device_peak_tflops(device)
        tflops = info["flops"] / median / 1e12
        info.update(median_s=median, tflops=tflops, gbps=info["min_bytes"] / median / 1e9,
                    peak_tflops=peak, peak_source=source, pct_of_peak=100 * tflops / peak if peak else None)
    record("passed", **check.as_dict(), timed=benchmark.stats is not None)
