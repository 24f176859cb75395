"""Timing pieces for pytest-benchmark: the device clock and its three modes, CUDA graphs, L2 handling.

GPU work is asynchronous, so the clock pytest-benchmark reads at the start and the end of each round is
the GPU's own timeline. Three timing modes (``--timing``) read it differently:

- ``eager``:  each reading records a CUDA event and waits for it. Inside a round the implementation's calls
  are queued back to back with no synchronisation; a round is event-to-event time on the device. When a call
  is short, the host cannot queue work as fast as the GPU drains it, and this is host launch cost: what a
  Python caller sees.
- ``graph``:  the prepared call is captured (several calls per graph, :class:`GraphTarget`) and one
  iteration of a round is one replay. The clock divides what it reads by the calls in a replay, so every
  statistic pytest-benchmark keeps is per call. Host dispatch is gone; the kernels and the gaps between them
  on the device remain.
- ``kernel``: the PyTorch profiler (Kineto/CUPTI) runs during each round and the clock advances by the
  device time of the kernels it saw: the time at least one of them was running (the union of their spans), so
  no host cost and no gaps. Kernels that overlap count once: under programmatic dependent launch a kernel
  starts before the one it depends on ends and waits on the device (the serving decodes' combine steps), and a
  sum of durations counted that wait twice (session 65: 81 us of "kernel time" for a 70 us step). Work between
  rounds (an L2 flush in pytest-benchmark's ``setup``) falls between a round's end reading and the next round's
  start reading, which pytest-benchmark never differences: it is excluded.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from impls._tuning import l2_bytes, mean_ms, recover_from_failed_capture

MODES = ("eager", "graph", "kernel")
GRAPH_REPLAY_S = 1e-3  # a replay lasts at least this long: the graph launch is amortised over many calls
MAX_CALLS_PER_GRAPH = 256


class CudaClock:
    """A ``--benchmark-timer``: seconds on the current CUDA stream's timeline (see the module doc).

    Consecutive readings are differenced and summed in float64, so the clock stays precise however long the
    session runs. ``per_call`` and ``kernel_time`` switch the mode for the duration of one benchmark.
    """

    def __init__(self) -> None:
        self._last: torch.cuda.Event | None = None
        self._seconds = 0.0
        self._divisor = 1
        self._profiler: torch.profiler.profile | None = None
        self._kernel_mode = False

    def __call__(self) -> float:
        if self._kernel_mode:
            return self._kernel_reading()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        if self._last is not None:
            self._seconds += self._last.elapsed_time(event) / 1e3 / self._divisor
        self._last = event
        return self._seconds

    @contextlib.contextmanager
    def per_call(self, calls: int) -> Iterator[None]:
        """Graph mode: one iteration is a replay of ``calls`` calls; report time per call."""
        self._divisor = calls
        try:
            yield
        finally:
            self._divisor = 1

    @contextlib.contextmanager
    def kernel_time(self) -> Iterator[None]:
        """Kernel mode: the clock advances by the device time of the kernels run between two readings."""
        self._kernel_mode = True
        try:
            yield
        finally:
            self._stop_profiler()
            self._kernel_mode = False
            self._last = None

    def _kernel_reading(self) -> float:
        torch.cuda.synchronize()
        self._seconds += busy_seconds(self._stop_profiler())
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self._profiler.start()
        return self._seconds

    def _stop_profiler(self) -> list[DeviceSpan]:
        if self._profiler is None:
            return []
        self._profiler.stop()
        kernels = device_kernels(self._profiler)
        self._profiler = None
        return kernels


cuda_clock = CudaClock()


class DeviceSpan(NamedTuple):
    """One kernel, memcpy or memset on the device timeline: its name, start and end in seconds."""

    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def device_kernels(profiler: torch.profiler.profile) -> list[DeviceSpan]:
    """Every kernel, memcpy and memset the profiler saw run on a GPU."""
    return [DeviceSpan(event.name, event.time_range.start / 1e6, event.time_range.end / 1e6)
            for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def busy_seconds(spans: Iterable[DeviceSpan]) -> float:
    """How long at least one of ``spans`` was running: the length of their union (overlaps count once)."""
    busy, reach = 0.0, -math.inf
    for span in sorted(spans, key=lambda s: s.start):
        if span.end > reach:
            busy += span.end - max(span.start, reach)
            reach = span.end
    return busy


@dataclass
class KernelProfile:
    """What one call runs on the device: kernel names with launches and each one's summed durations per call
    (a kernel launched early under programmatic dependent launch counts its wait), and ``busy_s``, the device
    time of a call with overlaps counted once (:func:`busy_seconds`)."""

    calls: int
    kernels: dict[str, dict[str, float]] = field(default_factory=dict)
    busy_s: float = 0.0

    @property
    def seconds_per_call(self) -> float:
        return self.busy_s

    def as_dict(self) -> dict:
        return {"calls": self.calls, "kernels": self.kernels}


def profile_kernels(fn: Callable[[], object], calls: int = 3) -> KernelProfile:
    """The kernels ``calls`` calls of ``fn`` launch, per call. Shows which backend ran, under any name."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    spans = device_kernels(prof)
    launches: Counter[str] = Counter()
    seconds: Counter[str] = Counter()
    for span in spans:
        launches[span.name] += 1
        seconds[span.name] += span.seconds
    kernels = {name: {"launches": launches[name] / calls, "seconds": seconds[name] / calls}
               for name, _ in seconds.most_common()}
    return KernelProfile(calls, kernels, busy_seconds(spans) / calls)


class GraphCaptureError(RuntimeError):
    """The call cannot be captured in a CUDA graph; the message says why (graph mode falls back to eager)."""


class GraphTarget:
    """``calls`` captured once in a CUDA graph, ``repeats`` times over; calling it replays the graph.

    ``calls`` holds one prepared call per copy of the inputs (one, unless the L2 is kept cold by rotating
    over copies). Warm-up runs on a side stream first, as capture requires, so that lazy initialisation
    (cuBLAS handles, JIT) happens outside the graph.

    The graph keeps ``calls`` (and so what they read: their inputs, workspaces, outputs): a replay reads and
    writes the memory their kernels were captured with. Session 65 found the copies' calls dropped once the
    graph was made, their memory recycled by the allocator while replays still used it: under ``--cold-l2`` the
    Triton decode read a block table overwritten by later allocations (an illegal address), and what the other
    implementations read in their timed replays was not their inputs any more.
    """

    def __init__(self, calls: Sequence[Callable[[], torch.Tensor]], repeats: int) -> None:
        self.calls = list(calls)  # alive as long as the graph: its kernels use their memory
        self.calls_per_replay = len(calls) * repeats
        caller = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(caller)
        try:
            with torch.cuda.stream(side):
                for call in calls:
                    call()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                for _ in range(repeats):
                    outputs = [call() for call in calls]
        except Exception as exc:  # capture refuses host syncs, some allocations, CPU tensors, ...
            torch.cuda.synchronize()
            recover_from_failed_capture(caller)
            raise GraphCaptureError(f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]) from exc
        self.outputs = outputs  # written by every replay: the check reads them after one

    def __call__(self) -> None:
        self.graph.replay()


def graph_repeats(seconds_per_call: float, copies: int) -> int:
    """Repeats of the copies' calls in one graph so that a replay lasts about ``GRAPH_REPLAY_S``."""
    per_pass = max(seconds_per_call, 1e-7) * copies
    return max(1, min(MAX_CALLS_PER_GRAPH // copies, math.ceil(GRAPH_REPLAY_S / per_pass)))


class L2Flusher:
    """Evicts the L2 cache by writing a buffer larger than it; called as pytest-benchmark's ``setup``.

    The setup runs before the round's first clock reading, and the clock waits for all queued work,
    so the flush stays out of the measured time.
    """

    def __init__(self, device: torch.device) -> None:
        self._buffer = torch.empty(max(2 * l2_bytes(device), 256 << 20), dtype=torch.int8, device=device)

    def __call__(self) -> None:
        self._buffer.zero_()


def time_once(fn, device: torch.device, repeats: int = 3) -> float:
    """Seconds per call of ``fn`` after the warm-up, on the device's timeline (host clock on CPU)."""
    if device.type == "cuda":
        return mean_ms(fn, warmup=0, repeats=repeats) / 1e3
    import time

    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def event_rounds_median(target, calls_per_iteration: int = 1, rounds: int = 15, round_s: float = 0.02) -> float:
    """Seconds per call the suite's way, outside pytest (scripts): rounds of back-to-back calls of ``target``
    between two readings of the CUDA-event clock, median over rounds after three warm-up rounds."""
    import statistics

    iterations = iterations_for(time_once(target, torch.device("cuda")), round_s)
    samples = []
    for _ in range(rounds + 3):
        start = cuda_clock()
        for _ in range(iterations):
            target()
        samples.append((cuda_clock() - start) / iterations / calls_per_iteration)
    return statistics.median(samples[3:])


def iterations_for(seconds_per_call: float, round_seconds: float, cap: int = 1000) -> int:
    """Calls per round so that a round lasts about ``round_seconds``: launch overhead stays amortised."""
    if seconds_per_call <= 0:
        return cap
    return max(1, min(cap, math.ceil(round_seconds / seconds_per_call)))


AUTO_REST_S = 1.0  # the pause of ``--rest-ms auto``
HEAVIER = 2.0  # ... taken after a benchmark whose calls ran at least this many times as long as the next one's


class RestPolicy:
    """When the GPU stays idle before a benchmark (``--rest-ms``): a fixed pause before every one, or (``auto``, the
    default) AUTO_REST_S only after a benchmark whose calls ran at least HEAVIER times as long. Under a power cap a
    light case timed right after a heavy one starts from the power state the heavy one left. Session 46, H200,
    ``gpu_session.sh rest``: FlashInfer's ``models`` 4 x 4K cases read 0.93-0.98 of their time alone when each ran
    right after a 1 x 32K case, 0.99-1.03 with a second's pause before every benchmark; cutile ran Mistral-7B 4 x 4K
    (Llama-3-8B 4 x 4K's kernel and config) 8% slower than the Llama case without it, level with it. Decode steps,
    heavy or light, did not move either way (0.98-1.02), so a pause before every one would only cost time."""

    def __init__(self, fixed_s: float | None = None) -> None:
        self.fixed_s = fixed_s  # None: auto
        self.previous_call_s: float | None = None

    def before(self, call_s: float) -> float:
        """Seconds to rest before a benchmark whose one call took ``call_s``; remembered for the next benchmark."""
        previous, self.previous_call_s = self.previous_call_s, call_s
        if self.fixed_s is not None:
            return self.fixed_s
        return AUTO_REST_S if previous is not None and previous >= HEAVIER * call_s else 0.0


def rest(seconds: float, device: torch.device) -> float:
    """Leave the GPU idle for ``seconds`` once its queue has drained: under a power cap the clocks a benchmark starts
    at depend on what ran before it (one H100 run timed one kernel 12% apart on two cases, the first of its process and
    one right after a heavy case), and a pause gives every benchmark the same start. Returns the seconds rested."""
    if seconds <= 0:
        return 0.0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    time.sleep(seconds)
    return seconds
