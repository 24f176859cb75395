"""Timing on the GPU's own timeline, one home for the tuners and the suite.

GPU work is asynchronous, so every measurement here reads CUDA events or the profiler, never the host clock alone:
back-to-back calls between two events (``mean_ms``), calls captured in a CUDA graph and replayed (``graph_ms``,
``GraphTarget``), the device time of the kernels the profiler saw (``profile_kernels``). Under a power limit the
clocks fall after the first fraction of a second of load, so a measurement settles the GPU first (``settle``,
``settle_until_steady``, ``settle_gpu``); a cold L2 is kept by a flush (``L2Flusher``) or by rotating over copies
of the inputs (``copies_for_cold_l2``, ``cold_candidates``). See docs/design.md#timing.

The suite's three timing modes (``--timing``) read the device clock ``cuda_clock`` (pytest-benchmark's timer):

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
  no host cost and no gaps. Kernels that overlap (programmatic dependent launch) count once. Work between
  rounds (an L2 flush in pytest-benchmark's ``setup``) falls between a round's end reading and the next round's
  start reading, which pytest-benchmark never differences: it is excluded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

SETTLE_S = 0.25  # seconds: the suite's --settle-ms default on a GPU, and what the tuners settle for
STEADY_WINDOW_S = 0.05  # seconds of calls a window of ``settle_until_steady``
STEADY_TOLERANCE = 0.01  # two windows in a row within this fraction of each other: steady
MAX_INPUT_COPIES = 64  # cold-L2 rotation: at most this many copies of one call's inputs
MODES = ("eager", "graph", "kernel")  # the suite's timing modes (module doc)
GRAPH_REPLAY_S = 1e-3  # a replay lasts at least this long: the graph launch is amortised over many calls
MAX_CALLS_PER_GRAPH = 256


def _event_ms(fn: Callable[[], object]) -> float:
    """Milliseconds of GPU time between CUDA events recorded before and after ``fn()``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def mean_ms(call: Callable[[], object], *, warmup: int = 3, repeats: int = 10) -> float:
    """Milliseconds per call of ``call`` on the GPU: warmed up (compiled) first, then ``repeats`` calls back to
    back between two CUDA events."""
    for _ in range(warmup):
        call()
    return _event_ms(lambda: [call() for _ in range(repeats)]) / repeats


def graph_ms(call: Callable[[], object], *, warmup: int = 3, repeats: int = 10) -> float:
    """Milliseconds per call of ``call`` on the GPU without the host: ``repeats`` calls captured in one CUDA
    graph, one replay timed between CUDA events. A decode step takes 10-40 us on the GPU, about what Python
    needs to launch its kernels, so calls queued from Python would time the host. A call that cannot be
    captured is timed back to back instead (``mean_ms``)."""
    for _ in range(warmup):
        call()
    replay = _captured(call, repeats)
    if replay is None:
        return mean_ms(call, warmup=0, repeats=repeats)
    return _event_ms(replay) / repeats


def _captured(call: Callable[[], object], calls: int) -> Callable[[], object] | None:
    """The replay of a CUDA graph holding ``calls`` calls of ``call`` (uploaded: replayed once), or None where
    the call cannot be captured."""
    caller = torch.cuda.current_stream()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                call()
    except RuntimeError:
        recover_from_failed_capture(caller)
        return None
    graph.replay()  # the first replay uploads the graph
    return graph.replay


def recover_from_failed_capture(caller: torch.cuda.Stream) -> None:
    """Undo what a CUDA-graph capture that failed leaves behind, so that the process measures on (torch 2.11):
    ``torch.cuda.graph`` ends the capture before it restores the stream, so an invalid capture
    leaves the capture stream current; and the CUDA generators were marked as capturing, which only a capture
    that ends well unmarks, so that every later random draw on the device fails ("Offset increment outside graph
    capture"). An empty capture that completes does unmark them. ``caller``: the stream current before."""
    torch.cuda.set_stream(caller)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA graph is empty": it is meant to be
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
    torch.cuda.set_stream(caller)


def graph_replay(call: Callable[[], object], replay_ms: float) -> tuple[Callable[[], object], int]:
    """(replay, calls per replay): ``call`` captured that many times in a CUDA graph, enough that a replay lasts
    about ``replay_ms`` (at least one call); calls queued back to back where the call cannot be captured."""
    call()  # compiled and warm
    calls = max(1, math.ceil(replay_ms / max(mean_ms(call, warmup=1, repeats=1), 1e-3)))
    return _captured(call, calls) or (lambda: [call() for _ in range(calls)]), calls


def time_replays(replays: list[tuple[Callable[[], object], int]]) -> list[float]:
    """Milliseconds per call of each replay, run once each, back to back (events only, one wait at the end)."""
    timed = []
    for replay, calls in replays:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        timed.append((start, end, calls))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / calls for start, end, calls in timed]


def settled_times(calls: list[Callable[[], object]], *, seconds: float = SETTLE_S, rounds: int = 7,
                  replay_ms: float = 10.0, passes: int = 2) -> list[float]:
    """Milliseconds per call of each of ``calls``, each timed alone the way the suite times a benchmark: its own
    CUDA-graph replays back to back for ``seconds`` first, then ``rounds`` replays timed, their median. Passes
    go through the calls in alternating order (drift evens out); a call's time is the mean of its passes.

    Under a power limit a kernel's sustained clock depends on the kernel: one that moves more data per FLOP
    draws more power and clocks lower. Timed in short bursts (``exhaustive_search``) or interleaved with the
    other candidates (``sustained_fastest``) every candidate runs at about the same clock, so near-equals can
    swap places in the suite (H200, Llama-3-8B 4 x 4K: three candidates within 1% in the search ran at 506 and
    535 TFLOPS in the suite). Here each runs at its own."""
    replays = [graph_replay(call, replay_ms) for call in calls]  # compiled and captured before any timing
    passes_ms: list[list[float]] = [[] for _ in calls]
    for p in range(max(passes, 1)):
        for i in (range(len(calls)) if p % 2 == 0 else reversed(range(len(calls)))):
            replay, per_replay = replays[i]
            settle(replay, seconds, _event_ms(replay) / 1e3, torch.cuda.synchronize)  # one replay: how long
            passes_ms[i].append(statistics.median(_event_ms(replay) / per_replay for _ in range(max(rounds, 1))))
    return [statistics.fmean(ms) for ms in passes_ms]


def settle(target: Callable[[], object], seconds: float, seconds_per_call: float,
           sync: Callable[[], None]) -> int:
    """Calls ``target`` back to back for about ``seconds`` (at least once, none for 0) and waits for them; returns
    how many. Under a power limit a GPU's clocks fall after the first 0.15-0.2 s of sustained tensor-core work
    (H200 at 700 W: 1980 -> 1575 MHz for our cuTile kernel, 1680 for cuDNN, 1875 for Triton; 574 -> 496 TFLOPS):
    a benchmark timed within that window measures boost clocks, one timed
    after another's load measures the sustained ones. Settling first times every benchmark at the latter."""
    if seconds <= 0:
        return 0
    calls = max(1, math.ceil(seconds / max(seconds_per_call, 1e-9)))
    for _ in range(calls):
        target()
    sync()
    return calls


def settle_until_steady(target: Callable[[], object], seconds: float, max_seconds: float, seconds_per_call: float,
                        sync: Callable[[], None], time_calls: Callable[[int], float] | None = None,
                        tolerance: float = STEADY_TOLERANCE) -> tuple[float, bool]:
    """``settle`` for ``seconds``, then on in windows of about STEADY_WINDOW_S of back-to-back calls, each timed
    (``time_calls(n)``: seconds for n calls; CUDA events by default), until two windows in a row agree within
    ``tolerance`` or ``max_seconds`` have passed in all. Returns (seconds settled, steady). A fixed settling can
    end while the clocks still move: 10 of 48 benchmarks of one H200 run moved by 2-4% while they were timed,
    mostly right after a heavier case."""
    if time_calls is None:
        def time_calls(n: int) -> float:
            return _event_ms(lambda: [target() for _ in range(n)]) / 1e3
    calls = max(1, math.ceil(STEADY_WINDOW_S / max(seconds_per_call, 1e-9)))
    spent = settle(target, seconds, seconds_per_call, sync) * seconds_per_call
    previous = None
    while spent < max_seconds:
        window = time_calls(calls)
        spent += window
        if previous is not None and abs(window - previous) <= tolerance * previous:
            return spent, True
        previous = window
    return spent, False


def settle_gpu(device: torch.device | None = None, seconds: float = SETTLE_S) -> None:
    """``settle`` with a matrix product on ``device``'s tensor cores, for tuners: what a tuner times next runs at
    the clocks the GPU's power limit sustains, not at the boost clocks after a pause (compiling the candidates
    is one). A tuner that times its candidates one after another otherwise favours the first ones: on an H200
    the cuTile tuner's pick for one causal D=64 shape was the 64x128 tile (400 TFLOPS) after a pause and the
    persistent 128x256 one (416) in a run that had settled. Nothing off CUDA."""
    device = torch.device("cuda") if device is None else device
    if device.type != "cuda" or seconds <= 0:
        return
    a = torch.ones(4096, 4096, device=device, dtype=torch.bfloat16)

    def product() -> None:
        a @ a

    with torch.cuda.device(device):  # the events of mean_ms on the product's device
        settle(product, seconds, mean_ms(product, warmup=1, repeats=4) / 1e3, torch.cuda.synchronize)


def l2_bytes(device: torch.device) -> int:
    """The device's L2 cache in bytes (none off CUDA: nothing there for a rotation to evict)."""
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)


def copies_for_cold_l2(bytes_per_call: int, device: torch.device) -> int:
    """Input copies to rotate over so that a call's inputs were evicted since their last use: the other
    copies' bytes together exceed twice the L2 cache (at most MAX_INPUT_COPIES: see ``rotation_evicts``)."""
    return max(1, min(MAX_INPUT_COPIES, math.ceil(2 * l2_bytes(device) / max(bytes_per_call, 1)) + 1))


def rotation_evicts(bytes_per_call: int, copies: int, device: torch.device) -> bool:
    """Whether rotating over ``copies`` evicts a call's inputs before their next use, the other copies' bytes
    together twice the L2 cache. Not for the smallest calls, whose MAX_INPUT_COPIES all fit in the L2 (on an H200
    a decode step under 2 MB): their "cold" times are warm ones, and the record says so."""
    return copies > 1 and (copies - 1) * bytes_per_call >= 2 * l2_bytes(device)


def input_tensors(inputs: Any) -> dict[str, torch.Tensor]:
    """A serving operation's input tensors (``PagedKV``, ``Varlen``: the dataclass's tensor fields), by name."""
    fields = ((f.name, getattr(inputs, f.name)) for f in dataclasses.fields(inputs) if f.init)
    return {name: value for name, value in fields if isinstance(value, torch.Tensor)}


def clone_inputs(inputs: Any) -> Any:
    """A copy of a call's inputs in fresh memory: a tuple of tensors (dense), or a serving operation's dataclass
    with each tensor field cloned."""
    if isinstance(inputs, tuple):
        return tuple(t.clone() for t in inputs)
    return dataclasses.replace(inputs, **{name: t.clone() for name, t in input_tensors(inputs).items()})


# Decode tuners time their candidates cold, as a server's step finds each layer's K/V evicted by the other layers':
# timed warm, a short step reads its K/V from the L2 and the pick fits that (H200, the 70B slice's 64 x 512 cold took
# 1.34x its warm time). See docs/design.md#tuning.
def cold_candidates(candidates: list[tuple[Any, Callable[[], object]]], inputs: Any,
                    call_on: Callable[[Any, Any], Callable[[], object]]) -> list[tuple[Any, Callable[[], object]]]:
    """``candidates`` ((candidate, call) over ``inputs``) as calls that rotate over the inputs and copies of them
    where that evicts the L2 between a copy's uses (``call_on(copy, candidate)``: the candidate's call over a copy);
    as they are elsewhere (a step of twice the L2 or more evicts its own inputs)."""
    tensors = list(input_tensors(inputs).values())
    size, device = sum(t.nbytes for t in tensors), tensors[0].device
    copies = copies_for_cold_l2(size, device) if size < 2 * l2_bytes(device) else 1
    if not rotation_evicts(size, copies, device):
        return candidates
    others = [clone_inputs(inputs) for _ in range(copies - 1)]

    def rotation(calls: list[Callable[[], object]]) -> Callable[[], object]:
        return lambda: [call() for call in calls]

    return [(candidate, rotation([call, *(call_on(copy, candidate) for copy in others)]))
            for candidate, call in candidates]


class CudaClock:
    """A ``--benchmark-timer``: seconds on the current CUDA stream's timeline (see the module doc).

    Consecutive readings are differenced and summed in float64, so the clock stays precise however long the
    process runs. ``per_call`` and ``kernel_time`` switch the mode for the duration of one benchmark.
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
    writes the memory their kernels were captured with, which the allocator must not hand out again while the
    graph lives (a dropped call's block table, overwritten, was once read as an illegal address).
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
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def event_rounds_median(target, calls_per_iteration: int = 1, rounds: int = 15, round_s: float = 0.02) -> float:
    """Seconds per call the suite's way, outside pytest (scripts): rounds of back-to-back calls of ``target``
    between two readings of the CUDA-event clock, median over rounds after three warm-up rounds."""
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
