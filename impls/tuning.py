"""Tune once per machine: the configs our autotuners chose, in a JSON file per kernel family, and how the tuners
rank their candidates (built on ``impls.timing``).

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
import fcntl
import functools
import hashlib
import json
import os
import statistics
import tempfile
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from impls.timing import graph_ms, graph_replay, settle_gpu, settled_times, time_replays

MODES = ("on", "off", "retune")
# How the cuTile dense tuner ranks its candidates (FMHA_TUNER; the first is the default): ``settled``,
# cuda.tile.tune.exhaustive_search and then its finalists again by ``settled_times``; ``exhaustive``, the search
# alone; or ``sustained_fastest``. Settled picks ran up to 6% faster in the suite (H200, Qwen2.5-7B 1 x 32K: 646
# TFLOPS against 611). See docs/design.md#tuning.
TUNERS = ("settled", "exhaustive", "sustained")
# The search's burst-clock times ran up to 20% optimistic for some candidates (H200), so one it puts 5-10% behind can
# lead the suite: the finalists are those within this margin of its best.
FINALIST_MARGIN = 0.10
# A tuning cache entry may hold, under this key beside the chosen config, why the tuner chose it (the settled tuner's
# finalists with their search and settled times), so a published run shows what decided each pick.
EVIDENCE = "finalists"

# Where a lookup's config came from (a prepared call's config says it as "chosen").
CACHED, TUNED, UNTUNED = "tuning cache", "autotuned", "fixed (GPU shared: not tuned)"


def shares_gpu() -> bool:
    """Whether this process shares its GPU with others that run at the same time (``FMHA_GPU_SHARED=1``)."""
    return os.environ.get("FMHA_GPU_SHARED") == "1"


def compiles_candidates() -> bool:
    """Whether a process that shares its GPU still compiles its tuners' candidates, untimed, before it runs the
    fixed config (``FMHA_COMPILE_CANDIDATES=1``, the suite's ``--compile-candidates``): cuTile's and Triton's
    compile caches are on disk, so the one process that tunes after them times kernels already compiled (the
    `serving` preset's tune: 355 s so, against 1,390 s after workers that compiled nothing)."""
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
    inner quotes one way before 3.12 and another from it, so one kernel had two digests."""
    if isinstance(node, ast.AST):
        fields = ((name, getattr(node, name, None)) for name in node._fields)
        return f"{type(node).__name__}({','.join(f'{n}={_canonical(v)}' for n, v in fields if v not in (None, []))})"
    if isinstance(node, list):
        return f"[{','.join(map(_canonical, node))}]"
    return repr(node)


def family_sources(package_init: str) -> list[Path]:
    """What a kernel family's tuning picks depend on: every module of its package (kernels, launches, search
    spaces), the split and work plans the families share (``impls/_plans.py``) and the inputs those plans read
    (``impls/contract.py``)."""
    package = Path(package_init).parent
    return [*sorted(package.glob("*.py")), package.parent / "_plans.py", package.parent / "contract.py"]


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
    its numbers ran up to 26% above the suite's graph time, by an amount
    that differs by candidate (boost clocks after each pause), and its pick left 5% at GPT-2 1 x 32K. Here the
    GPU stays busy from the settling through the last round, so every candidate is timed at the clocks its
    power limit sustains, and interleaving spreads any drift over all of them."""
    candidates = list(candidates)
    replays = [graph_replay(call, replay_ms) for _, call in candidates]  # compiles, captures: before the settling
    settle_gpu()
    per_call = interleaved_medians(lambda: time_replays(replays), rounds)
    return candidates[min(range(len(candidates)), key=per_call.__getitem__)][0]


def finalists(timings: Iterable[tuple[Any, float]], margin: float = FINALIST_MARGIN) -> list[Any]:
    """The candidates whose time is within ``margin`` (a fraction) of the least, fastest first."""
    ranked = sorted(timings, key=lambda t: t[1])
    return [candidate for candidate, time in ranked if time <= ranked[0][1] * (1 + margin)] if ranked else []


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
