"""Tune once per machine: the configs our autotuners chose, in a JSON file per kernel family.

An entry's key holds everything that can change the choice: the GPU's name and compute capability, the
versions of torch and of the kernel's compiler (triton, cuda-tile), a hash of the kernel's source files (so an
edited kernel or search space is tuned again) and the shape class the caller tunes per. The value is the chosen
config, which still goes into every benchmark's JSON.

``FMHA_TUNING=off`` neither reads nor writes the cache, ``FMHA_TUNING=retune`` tunes again and overwrites
(the suite's ``--no-tuning-cache`` and ``--retune`` set them). ``FMHA_TUNING_CACHE=DIR`` moves the files from
``~/.cache/fmha-bench``. A file that cannot be read or parsed is ignored, and rewritten on the next store.

A process that shares its GPU with others running at the same time (``FMHA_GPU_SHARED=1``, which
``suite/sharding.py`` sets in pytest-xdist workers that outnumber the GPUs) tunes nothing and stores nothing: its
timings would measure the other processes' load as much as its candidates, and a pick stored from them would be
what later benchmarks run. It runs the cache's pick where there is one, else its tuner's fixed config.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import math
import os
import statistics
import tempfile
import warnings
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

MODES = ("on", "off", "retune")
# How the cuTile dense tuner ranks its candidates (FMHA_TUNER; the first is the default): ``settled``,
# cuda.tile.tune.exhaustive_search and then its finalists (within FINALIST_MARGIN of its best) again by
# ``settled_times``; ``exhaustive``, the search alone; or ``sustained_fastest`` (see there). H200, session 18
# (gpu_session.sh tuner-ab, 23 causal cases): sustained made the same pick as exhaustive on 17; on the other 6
# exhaustive's pick ran within 1% or up to 7% faster in the suite. Session 20 (the 18 models cases, each tuner
# from cold, then both again from their caches): settled chose otherwise on 7 and its picks ran faster in the
# suite on Qwen2.5-7B 4 x 4K (521 / 529 TFLOPS against 498 / 498) and 1 x 32K (628 / 646 against 594 / 611), MLA
# 4 x 4K (499 / 505 against 486 / 488) and 1 x 32K (571 / 588 against 567 / 574) and GPT-2 4 x 4K (393 / 393
# against 387 / 389); level on Gemma-2 (local 4 x 4K 485 / 499 against 503 / 500, global 1 x 32K 556 / 553
# against 556 / 561).
TUNERS = ("settled", "exhaustive", "sustained")
# Session 20 ran the A/B above with 3%. The probe after it (scripts/tuner_probe.py --methods graph settled, H200)
# found burst-clock times up to 20% optimistic for one candidate (64x128 with occupancy 2) and up to 6% for others, so
# a candidate the search puts 5-10% behind can lead the suite: GPT-2 1 x 32K, where the suite ran 64x128 (442
# TFLOPS) and the settled timing put the persistent paired 256x64 and 128x128 ahead (452 / 449 against 427).
# 10% takes those in, at about 0.7 s of settled timing a finalist; not yet A/B'd in the suite at 10%.
FINALIST_MARGIN = 0.10
# A tuning cache entry may hold, beside the chosen config, why the tuner chose it: under this key the settled
# tuner's finalists with their search and settled times. The benchmark's config then carries it, so that a
# published run shows what decided each pick after the machine that tuned is gone (session 51: two H200s picked
# differently for one case, and neither's reason was left).
EVIDENCE = "finalists"


# Where a lookup's config came from (a prepared call's config says it as "chosen").
CACHED, TUNED, UNTUNED = "tuning cache", "autotuned", "fixed (GPU shared: not tuned)"


def shares_gpu() -> bool:
    """Whether this process shares its GPU with others that run at the same time (``FMHA_GPU_SHARED=1``)."""
    return os.environ.get("FMHA_GPU_SHARED") == "1"


def compiles_candidates() -> bool:
    """Whether a process that shares its GPU still compiles its tuners' candidates, untimed, before it runs the
    fixed config (``FMHA_COMPILE_CANDIDATES=1``, the suite's ``--compile-candidates``). A chain's prime runs the
    checks in many workers at once for this: cuTile's and Triton's compile caches are on disk, so the one process
    that tunes after them times kernels already compiled. H200, session 59: after a prime that compiled nothing, 45
    of the `serving` preset's 46 decode shape classes took 1,390 s of tuning steps on two machines (20-30 s a class
    and kernel family); session 51's tune of all 46 and `varlen`'s 5, after a prime whose workers still compiled
    (and timed) every candidate, 355 s."""
    return os.environ.get("FMHA_COMPILE_CANDIDATES") == "1"


def mode() -> str:
    value = os.environ.get("FMHA_TUNING", "on") or "on"
    if value not in MODES:
        raise ValueError(f"FMHA_TUNING={value!r}: expected one of {', '.join(MODES)}")
    return value


def dense_tuner() -> str:
    value = os.environ.get("FMHA_TUNER", TUNERS[0]) or TUNERS[0]
    if value not in TUNERS:
        raise ValueError(f"FMHA_TUNER={value!r}: expected one of {', '.join(TUNERS)}")
    return value


def cache_dir() -> Path:
    return Path(os.environ.get("FMHA_TUNING_CACHE") or Path.home() / ".cache" / "fmha-bench")


@functools.cache
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def source_hash(paths: tuple[Path, ...]) -> str:
    """A digest of what the modules at ``paths`` compute: their code, not their comments, docstrings or layout, so
    that a note added to a search space's docstring keeps the tuning picks (and a tune of minutes) valid; nor the
    Python version that reads them, so that a cache keyed where one Python runs matches where another does."""
    return contents_hash(path.read_bytes() for path in paths)


def contents_hash(sources: Iterable[bytes]) -> str:
    """``source_hash`` of modules given as their bytes, in order (``scripts/rekey_tuning.py``: a commit's)."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(_code_only(source))
    return digest.hexdigest()[:16]


def _code_only(source: bytes) -> bytes:
    """The module's syntax tree without docstrings, written out field by field (``_canonical``); the source itself
    where it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return source
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)  # what ast.get_docstring reads
    for node in ast.walk(tree):
        if isinstance(node, documented) and ast.get_docstring(node, clean=False) is not None:
            node.body = node.body[1:] or [ast.Pass()]
    return _canonical(tree).encode()


def _canonical(node: Any) -> str:
    """A syntax tree as text that every Python from 3.11 writes alike: each node's type and its fields, those left
    empty skipped (3.12 gives functions an empty ``type_params``). Not ``ast.unparse``, which writes an f-string's
    inner quotes one way before 3.12 and another from it, so one kernel had two digests (session 56)."""
    if isinstance(node, ast.AST):
        fields = ((name, getattr(node, name, None)) for name in node._fields)
        return f"{type(node).__name__}({','.join(f'{n}={_canonical(v)}' for n, v in fields if v not in (None, []))})"
    if isinstance(node, list):
        return f"[{','.join(map(_canonical, node))}]"
    return repr(node)


def family_sources(package_init: str) -> list[Path]:
    """What a kernel family's tuning picks depend on: every module of its package (kernels, launches, search
    spaces; the decode kernel's module too, which the cache once left out) and the split and work plans the
    families share (``impls/_serving.py``)."""
    package = Path(package_init).parent
    return [*sorted(package.glob("*.py")), package.parent / "_serving.py"]


class TuningCache:
    """The tuning results of one kernel family (``family``.json), for kernels built from ``sources`` with
    ``libraries`` and, where the library's version does not say it all, the compiler ``toolchain()`` names."""

    def __init__(self, family: str, sources: Iterable[Path], libraries: Iterable[str],
                 toolchain: Callable[[], dict[str, str]] | None = None) -> None:
        self.family = family
        self.sources = tuple(sorted(Path(p) for p in sources))
        self._libraries = tuple(libraries)
        self._toolchain = toolchain

    @property
    def path(self) -> Path:
        return cache_dir() / f"{self.family}.json"

    def key(self, device: torch.device, shape_class: Iterable[Any]) -> str:
        props = torch.cuda.get_device_properties(device)
        versions = {lib: _version(lib) for lib in ("torch", *self._libraries)}
        versions |= self._toolchain() if self._toolchain else {}
        return json.dumps({
            "gpu": props.name, "capability": f"{props.major}.{props.minor}", **versions,
            "source": source_hash(self.sources), "shape": [str(x) for x in shape_class],
        }, sort_keys=True)

    def _entries(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> dict | None:
        return None if mode() != "on" else self._entries().get(key)

    def put(self, key: str, config: dict) -> None:
        if mode() == "off":
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Processes tune side by side (--isolate, pytest-xdist: 32 on a two-GPU node). The lock makes read, add
        # and write one step, so that no process's entry is lost to another's write; the rename keeps readers,
        # which do not lock, from ever seeing a torn file.
        with self._locked():
            entries = {**self._entries(), key: config}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.family}-")
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)

    @contextlib.contextmanager
    def _locked(self):
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def lookup(self, key: str, tune: Callable[[], dict], fixed: Callable[[], dict],
               compile_all: Callable[[], object] | None = None) -> tuple[dict, str]:
        """The cached config for ``key``; or where this process shares its GPU (``shares_gpu``), ``fixed()``'s,
        not stored, after ``compile_all()`` (the tuner's candidates compiled, untimed) where
        ``compiles_candidates``; or ``tune()``'s result, stored. Returns (config, CACHED, UNTUNED or TUNED)."""
        cached = self.get(key)
        if cached is not None:
            return cached, CACHED
        if shares_gpu():
            if compile_all is not None and compiles_candidates():
                compile_all()
            return fixed(), UNTUNED
        config = tune()
        self.put(key, config)
        return config, TUNED


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
    """Undo what a CUDA-graph capture that failed leaves behind, so that the process measures on (torch 2.11 on an
    H200, session 18): ``torch.cuda.graph`` ends the capture before it restores the stream, so an invalid capture
    leaves the capture stream current; and the CUDA generators were marked as capturing, which only a capture
    that ends well unmarks, so that every later random draw on the device fails ("Offset increment outside graph
    capture"). An empty capture that completes does unmark them. ``caller``: the stream current before."""
    torch.cuda.set_stream(caller)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA graph is empty": it is meant to be
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
    torch.cuda.set_stream(caller)


SETTLE_S = 0.25  # seconds: the suite's --settle-ms default on a GPU, and what the tuners settle for


def settle(target: Callable[[], object], seconds: float, seconds_per_call: float,
           sync: Callable[[], None]) -> int:
    """Calls ``target`` back to back for about ``seconds`` (at least once, none for 0) and waits for them; returns
    how many. Under a power limit a GPU's clocks fall after the first 0.15-0.2 s of sustained tensor-core work
    (H200 at 700 W, session 12, scripts/clock_probe.py: 1980 -> 1575 MHz for our cuTile kernel, 1680 for cuDNN,
    1875 for Triton; 574 -> 496 TFLOPS): a benchmark timed within that window measures boost clocks, one timed
    after another's load measures the sustained ones. Settling first times every benchmark at the latter."""
    if seconds <= 0:
        return 0
    calls = max(1, math.ceil(seconds / max(seconds_per_call, 1e-9)))
    for _ in range(calls):
        target()
    sync()
    return calls


STEADY_WINDOW_S = 0.05  # seconds of calls a window of ``settle_until_steady``
STEADY_TOLERANCE = 0.01  # two windows in a row within this fraction of each other: steady


def settle_until_steady(target: Callable[[], object], seconds: float, max_seconds: float, seconds_per_call: float,
                        sync: Callable[[], None], time_calls: Callable[[int], float] | None = None,
                        tolerance: float = STEADY_TOLERANCE) -> tuple[float, bool]:
    """``settle`` for ``seconds``, then on in windows of about STEADY_WINDOW_S of back-to-back calls, each timed
    (``time_calls(n)``: seconds for n calls; CUDA events by default), until two windows in a row agree within
    ``tolerance`` or ``max_seconds`` have passed in all. Returns (seconds settled, steady). A fixed settling can
    end while the clocks still move: the report's drift flag found 10 of 48 benchmarks of one H200 run (session
    20) whose rounds moved by 2-4% while they were timed, on every implementation, mostly right after a heavier
    case."""
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


def fastest(candidates: Iterable[tuple[Any, Callable[[], object]]], *, warmup: int = 3, repeats: int = 10) -> Any:
    """The candidate whose call takes the least GPU time (``graph_ms``), on a settled GPU (``settle_gpu``). For
    tuners whose candidate is more than one launch (split and combine), where ``cuda.tile.tune`` and Triton's
    autotuner time one kernel. Every candidate is called once (compiled) before the GPU settles, so that no
    compile pause falls between the settling and the timing."""
    candidates = list(candidates)
    for _, call in candidates:
        call()
    settle_gpu()
    timings = [(graph_ms(call, warmup=warmup, repeats=repeats), candidate) for candidate, call in candidates]
    return min(timings, key=lambda t: t[0])[1]


def sustained_fastest(candidates: Iterable[tuple[Any, Callable[[], object]]], *, rounds: int = 5,
                      replay_ms: float = 2.0) -> Any:
    """The candidate with the least median GPU time per call over ``rounds`` rounds, timed the way the suite's
    graph mode runs: each candidate's calls captured in a CUDA graph (enough of them that a replay lasts about
    ``replay_ms``), and in every round all the replays back to back, in turn, with no host pause between them.

    ``cuda.tile.tune.exhaustive_search`` times single launches with a synchronisation between them: on an H200
    (session 17, scripts/tuner_probe.py) its numbers ran up to 26% above the suite's graph time, by an amount
    that differs by candidate (boost clocks after each pause), and its pick left 5% at GPT-2 1 x 32K. Here the
    GPU stays busy from the settling through the last round, so every candidate is timed at the clocks its
    power limit sustains, and interleaving spreads any drift over all of them."""
    candidates = list(candidates)
    replays = [_replay(call, replay_ms) for _, call in candidates]  # compiles, captures: before the settling
    settle_gpu()
    per_call = interleaved_medians(lambda: _time_round(replays), rounds)
    return candidates[min(range(len(candidates)), key=per_call.__getitem__)][0]


MAX_INPUT_COPIES = 64  # cold-L2 rotation: at most this many copies of one call's inputs


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
    a decode step under 2 MB): their "cold" times are warm ones, and the record says so (session 65)."""
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


# Decode tuners time their candidates cold where a step's inputs fit in twice the L2: each candidate's call runs over
# the inputs and copies of them in turn, as the suite's --cold-l2 graph mode times it and as a server's step finds
# each layer's K/V evicted by the other layers'. Timed back to back over the same inputs, a short step reads its K/V
# from the L2, and the pick fits that: session 66 (H200), the 70B slice's 64 x 512 (17 MB) timed cold took 1.34x
# Triton's warm time and 1.10x flash-attn-4's, and Triton's warm-tuned pick fell from 1.19 of flash-attn-4 to 0.98.
# Tuned cold (session 66, the 17 `serving` steps of up to twice the L2, then `gpu_session.sh serve-cold` on the same
# H200), Triton took other picks on 3. Against session 65's serve-cold (another H200, the warm-tuned picks), ours /
# best peer cold: 8B 16 x 512 0.88 -> 0.98 of flash-attn-4 (16.84 -> 15.16 us; unsplit 128-key tiles at 5 stages),
# the 70B slice's 1 x 2K 1.34 -> 1.50 of FlashInfer (7.07 -> 6.42 us), 8B 1 x 8K 1.19 -> 1.19 (warm 1.28 -> 1.17).
# The 70B slice's 64 x 512 kept its pick (0.976 cold): nothing in the space is faster cold there.
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


def finalists(timings: Iterable[tuple[Any, float]], margin: float = FINALIST_MARGIN) -> list[Any]:
    """The candidates whose time is within ``margin`` (a fraction) of the least, fastest first."""
    ranked = sorted(timings, key=lambda t: t[1])
    return [candidate for candidate, time in ranked if time <= ranked[0][1] * (1 + margin)] if ranked else []


def settled_times(calls: list[Callable[[], object]], *, seconds: float = SETTLE_S, rounds: int = 7,
                  replay_ms: float = 10.0, passes: int = 2) -> list[float]:
    """Milliseconds per call of each of ``calls``, each timed alone the way the suite times a benchmark: its own
    CUDA-graph replays back to back for ``seconds`` first, then ``rounds`` replays timed, their median. Passes
    go through the calls in alternating order (drift evens out); a call's time is the mean of its passes.

    Under a power limit a kernel's sustained clock depends on the kernel: one that moves more data per FLOP
    draws more power and clocks lower. Timed in short bursts (``exhaustive_search``) or interleaved with the
    other candidates (``sustained_fastest``) every candidate runs at about the same clock, so near-equals can
    swap places in the suite (H200, session 19: Llama-3-8B 4 x 4K, three candidates within 1% in the search;
    the suite ran one of them at 506 TFLOPS and another, in session 17, at 535). Here each runs at its own."""
    replays = [_replay(call, replay_ms) for call in calls]  # compiled and captured before any timing
    passes_ms: list[list[float]] = [[] for _ in calls]
    for p in range(max(passes, 1)):
        for i in (range(len(calls)) if p % 2 == 0 else reversed(range(len(calls)))):
            replay, per_replay = replays[i]
            settle(replay, seconds, _event_ms(replay) / 1e3, torch.cuda.synchronize)  # one replay: how long
            passes_ms[i].append(statistics.median(_event_ms(replay) / per_replay for _ in range(max(rounds, 1))))
    return [statistics.fmean(ms) for ms in passes_ms]


def settled_ranking(candidates: Iterable[tuple[Any, Callable[[], object]]], **timing: Any) -> list[tuple[Any, float]]:
    """(candidate, milliseconds per call) by ``settled_times`` (``timing``: its keyword arguments), fastest first."""
    candidates = list(candidates)
    times = settled_times([call for _, call in candidates], **timing)
    return sorted(((candidate, ms) for (candidate, _), ms in zip(candidates, times, strict=True)),
                  key=lambda entry: entry[1])


def interleaved_medians(time_round: Callable[[], list[float]], rounds: int) -> list[float]:
    """Each candidate's median over ``rounds`` calls of ``time_round`` (one time per candidate, in order)."""
    samples = [time_round() for _ in range(max(rounds, 1))]
    return [statistics.median(column) for column in zip(*samples, strict=True)]


def _replay(call: Callable[[], object], replay_ms: float) -> tuple[Callable[[], object], int]:
    """(replay, calls per replay): ``call`` captured that many times in a CUDA graph, enough that a replay lasts
    about ``replay_ms`` (at least one call); calls queued back to back where the call cannot be captured."""
    call()  # compiled and warm
    calls = max(1, math.ceil(replay_ms / max(mean_ms(call, warmup=1, repeats=1), 1e-3)))
    return _captured(call, calls) or (lambda: [call() for _ in range(calls)]), calls


def _time_round(replays: list[tuple[Callable[[], object], int]]) -> list[float]:
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
