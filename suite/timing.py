"""Timing pieces for pytest-benchmark: a CUDA-event clock, L2 flushing, and iteration sizing.

GPU work is asynchronous, so the clock pytest-benchmark reads at the start and the end of each round is
the GPU's own timeline: each reading records a CUDA event and waits for it. Inside a round the
implementation's calls are queued back to back with no synchronisation; the round's duration is the
event-to-event time on the device, which excludes host work that overlaps the GPU.
"""

from __future__ import annotations

import math

import torch


class CudaEventClock:
    """A ``--benchmark-timer``: seconds on the current CUDA stream's timeline.

    Consecutive readings are differenced event to event (microsecond resolution) and summed in float64,
    so the clock stays precise however long the session runs.
    """

    def __init__(self) -> None:
        self._last: torch.cuda.Event | None = None
        self._seconds = 0.0

    def __call__(self) -> float:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        if self._last is not None:
            self._seconds += self._last.elapsed_time(event) / 1e3
        self._last = event
        return self._seconds


cuda_clock = CudaEventClock()


class L2Flusher:
    """Evicts the L2 cache by writing a buffer larger than it; called as pytest-benchmark's ``setup``.

    The setup runs before the round's first clock reading, and the clock waits for all queued work,
    so the flush stays out of the measured time.
    """

    def __init__(self, device: torch.device) -> None:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
        self._buffer = torch.empty(max(2 * l2, 256 << 20), dtype=torch.int8, device=device)

    def __call__(self) -> None:
        self._buffer.zero_()


def time_once(fn, device: torch.device, repeats: int = 3) -> float:
    """Seconds per call of ``fn`` after the warm-up, on the device's timeline (host clock on CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    import time

    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def iterations_for(seconds_per_call: float, round_seconds: float, cap: int = 1000) -> int:
    """Calls per round so that a round lasts about ``round_seconds``: launch overhead stays amortised."""
    if seconds_per_call <= 0:
        return cap
    return max(1, min(cap, math.ceil(round_seconds / seconds_per_call)))
