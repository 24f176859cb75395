"""Timing with pytest-benchmark, in each ``--timing`` mode: checked once first, so that no unchecked number
is ever reported (graph mode checks the replayed output too)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import pytest
import torch

from impls import Impl, Prepared
from impls.timing import (
    SETTLE_S,
    GraphCaptureError,
    GraphTarget,
    L2Flusher,
    copies_for_cold_l2,
    cuda_clock,
    graph_repeats,
    iterations_for,
    profile_kernels,
    rotation_evicts,
    settle,
    settle_until_steady,
    time_once,
)
from suite import metrics
from suite.cases import Case
from suite.problem import Problem
from suite.recording import Recorder, run_state
from suite.rest import rest
from suite.telemetry import energy_during, gpu_state


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
    outputs = out if isinstance(out, tuple | list) else (out,)  # the backward returns (dq, dk, dv)
    out_bytes = sum(t.untyped_storage().nbytes() for t in outputs)
    output_allocated_by_call = torch.cuda.memory_allocated(device) - before >= out_bytes
    return peak if output_allocated_by_call else peak + out_bytes


def test_benchmark(benchmark, impl: Impl, case: Case, problem: Problem, record: Recorder, timing: str,
                   pytestconfig: pytest.Config) -> None:
    with record.guard():
        if timing != "eager" and problem.device.type != "cuda":
            record("unsupported", f"{timing} timing needs CUDA", timing=timing)
            pytest.skip(f"{timing} timing needs CUDA")
        measure(benchmark, impl, case, problem, record, timing, pytestconfig)


def graph_target(impl: Impl, problem: Problem, prepared: Prepared, seconds_per_call: float,
                 cold_l2: bool) -> tuple[GraphTarget, int]:
    """The prepared call captured in a CUDA graph; cold L2: rotating over input copies (their count too)."""
    copies = copies_for_cold_l2(metrics.min_bytes(problem.case), problem.device) if cold_l2 else 1
    calls = [prepared] + [problem.prepare(impl, inputs) for inputs in problem.input_copies(copies)[1:]]
    return GraphTarget(calls, graph_repeats(seconds_per_call, copies)), copies


def energy_of_calls(target: Callable[[], object], seconds: float, seconds_per_target: float, calls_per_target: int,
                    uuid: str) -> dict:
    """The energy of the target's calls run back to back for ``seconds`` (after the timed rounds, so at the
    clocks those ended at): NVML's counter across them, shared out per call (a graph target is several)."""
    sync = torch.cuda.synchronize
    with energy_during(uuid, sync) as energy:
        targets = settle(target, seconds, seconds_per_target, sync)
    if "joules" in energy:
        calls = targets * calls_per_target
        state = energy.pop("state", {})
        energy.update(calls=calls, joules_per_call=energy["joules"] / calls, sm_clock_mhz=state.get("sm_clock_mhz"))
    return energy


def measure(benchmark, impl: Impl, case: Case, problem: Problem, record: Recorder, timing: str,
            pytestconfig: pytest.Config) -> None:
    prepared = problem.prepare(impl)
    check = record.check(problem, prepared)
    if not check.passed:
        pytest.fail(f"not timed, output is wrong: {check.message}")

    device = problem.device
    on_gpu = device.type == "cuda"
    rounds = pytestconfig.getoption("--rounds") or (20 if on_gpu else 5)
    round_s = (pytestconfig.getoption("--round-ms") or (20 if on_gpu else 50)) / 1e3
    cold_l2 = bool(pytestconfig.getoption("--cold-l2")) and on_gpu
    per_call = time_once(prepared, device)
    info = benchmark.extra_info
    info.update(timing=timing, measured_as=timing)

    target, clock = prepared, contextlib.nullcontext()
    if timing == "graph":
        try:
            graph, copies = graph_target(impl, problem, prepared, per_call, cold_l2)
        except GraphCaptureError as exc:  # measured eagerly instead, and said so
            info.update(measured_as="eager", fallback=f"not capturable in a CUDA graph: {exc}")
        else:
            graph()
            replayed = problem.check(graph.outputs[0])
            if not replayed.passed:
                record("failed", f"wrong under CUDA-graph replay: {replayed.message}", timing=timing)
                pytest.fail(f"not timed, output is wrong under CUDA-graph replay: {replayed.message}")
            target, clock = graph, cuda_clock.per_call(graph.calls_per_replay)
            info.update(calls_per_replay=graph.calls_per_replay, input_copies=copies)
    elif timing == "kernel":
        clock = cuda_clock.kernel_time()

    seconds = per_call if target is prepared else time_once(target, device)  # a graph: one replay
    if cold_l2 and info["measured_as"] != "graph":
        schedule = {"setup": L2Flusher(device), "iterations": 1}
    else:
        schedule = {"iterations": iterations_for(seconds, round_s)}
    peak_bytes = peak_memory_bytes(prepared, device)

    benchmark.group = f"{case.id} [{timing}]"
    info["rest_s"] = rest(run_state(pytestconfig).rest.before(per_call) if on_gpu else 0.0, device)
    settle_ms = pytestconfig.getoption("--settle-ms")
    info["settle_s"] = max(0.0, (SETTLE_S * 1e3 if on_gpu else 0) if settle_ms is None else settle_ms) / 1e3
    settle_max_s = pytestconfig.getoption("--settle-max-ms") / 1e3
    if on_gpu and settle_max_s > info["settle_s"]:  # on until the clocks stop moving, within the bound
        info["settle_s"], info["settled_steady"] = settle_until_steady(target, info["settle_s"], settle_max_s,
                                                                       seconds, torch.cuda.synchronize)
    else:
        settle(target, info["settle_s"], seconds, torch.cuda.synchronize if on_gpu else lambda: None)
    with clock:
        benchmark.pedantic(target, rounds=rounds, warmup_rounds=pytestconfig.getoption("--warmup-rounds"),
                           **schedule)
    if on_gpu:
        uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
        state = gpu_state(uuid)  # clocks, power, throttling as the timed calls ended
        energy_s = pytestconfig.getoption("--energy-ms") / 1e3
        if energy_s > 0:
            info["energy"] = energy_of_calls(target, energy_s, seconds, info.get("calls_per_replay", 1), uuid)

    info.update(impl=impl.name, family=impl.family, case=case.id, **case.as_dict())
    info["worker"] = os.environ.get("PYTEST_XDIST_WORKER")  # pytest-xdist's worker, when sharded
    info.update(config=prepared.config, max_error=check.max_error, tolerance=check.tolerance,
                flops=metrics.flops(case), min_bytes=metrics.min_bytes(case), kv_bytes=metrics.kv_bytes(case),
                peak_memory_bytes=peak_bytes, iterations=schedule["iterations"], cold_l2="setup" in schedule
                or rotation_evicts(metrics.min_bytes(case), info.get("input_copies", 1), device))
    if on_gpu:  # which GPU measured it (several workers, several GPUs), and what ran there, by kernel name
        info["gpu"] = {"name": torch.cuda.get_device_properties(device).name, "uuid": uuid, "state": state,
                       "visible_as": os.environ.get("CUDA_VISIBLE_DEVICES", str(device.index or 0))}
        profile = profile_kernels(prepared)  # shows sdpa's backend, and any entry's real kernels
        info.update(kernels=profile.as_dict()["kernels"], kernel_s_per_call=profile.seconds_per_call)
        if timing == "kernel" and not profile.kernels:
            pytest.fail("kernel timing: the profiler saw no kernel of this implementation")
    if benchmark.stats is not None:  # None under --benchmark-disable: the call ran once, untimed
        median = benchmark.stats.stats.median
        peak, source = metrics.device_peak_tflops(device)
        hbm, hbm_source = metrics.device_peak_hbm(device)
        tflops = info["flops"] / median / 1e12
        gbps = info["min_bytes"] / median / 1e9
        info.update(median_s=median, tflops=tflops, gbps=gbps, peak_tflops=peak, peak_source=source,
                    pct_of_peak=100 * tflops / peak if peak else None, peak_hbm_tbps=hbm, hbm_source=hbm_source,
                    pct_of_hbm=gbps / 10 / hbm if hbm else None)
    record("passed", **check.as_dict(), timed=benchmark.stats is not None, timing=timing)
