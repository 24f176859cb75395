"""Where our kernels' configs come from: a table shipped for the GPU, a heuristic, or a tune on this machine; the
on-disk cache of those tunes; and how the tuners rank their candidates (built on ``impls.timing``).

No call waits for a tuner by default. A lookup takes, in order: the pick this machine tuned earlier (the cache),
the pick shipped for this GPU model and shape class (``impls/<family>/tuned/<gpu>.json``, written by ``python -m
impls.tune``), the shipped pick of the nearest shape class (lengths and batch may differ, nothing else; this GPU's
table first, then those of GPUs of the same compute capability), and last the kernel's fixed config.

``FMHA_TUNING=tune`` (the suite's ``--tune``) tunes each shape class the cache lacks, and stores it; ``retune``
tunes again and overwrites; ``off`` neither reads nor writes the cache nor tunes (shipped and heuristic picks
only). A cache entry's key holds everything that can change the choice: the GPU's name and compute capability,
the versions of torch and of the kernel's compiler, a hash of the kernel's source files (an edited kernel or search
space is tuned again) and the shape class. ``FMHA_TUNING_CACHE=DIR`` moves the files from ``~/.cache/fmha-bench``.
A file that cannot be read or parsed is ignored, and rewritten on the next store.

A process that shares its GPU with others running at the same time (``FMHA_GPU_SHARED=1``, which
``suite/sharding.py`` sets in pytest-xdist workers that outnumber the GPUs) tunes nothing and stores nothing: its
timings would measure the other processes' load as much as its candidates. See docs/design.md#tuning.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import functools
import hashlib
import json
import math
import os
import re
import statistics
import tempfile
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from impls.timing import graph_ms, graph_replay, settle_gpu, settled_times, time_replays

MODES = ("on", "tune", "retune", "off")
TUNING_MODES = ("tune", "retune")  # the modes that time candidates
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

# Where a lookup's config came from (a prepared call's config says it as "chosen", the GPU's table in brackets).
CACHED, TUNED = "tuning cache", "autotuned"
SHIPPED, NEAREST, FIXED = "shipped", "heuristic: nearest shipped class", "heuristic: fixed config"


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
    """``source_hash`` of modules given as their bytes, in order (a commit's, given as its files' bytes)."""
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
    (``impls/contract/``)."""
    package = Path(package_init).parent
    return [*sorted(package.glob("*.py")), package.parent / "_plans.py",
            *sorted((package.parent / "contract").glob("*.py"))]


class TuningCache:
    """The tuning results of one kernel family (``family``.json), for kernels built from ``sources`` with
    ``libraries`` and, where the library's version does not say it all, the compiler ``toolchain()`` names; the
    picks shipped in ``tables`` (a folder, ``ShippedTables``) answer where this machine has tuned nothing."""

    def __init__(self, family: str, sources: Iterable[Path], libraries: Iterable[str],
                 toolchain: Callable[[], dict[str, str]] | None = None, tables: Path | None = None) -> None:
        self.family = family
        self.tables = ShippedTables(tables) if tables else None
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
        return self._entries().get(key) if mode() in ("on", "tune") else None

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
               compile_all: Callable[[], object] | None = None, near: Sequence[int] = (),
               valid: Callable[[dict], bool] | None = None) -> tuple[dict, str]:
        """(config, where it came from) for ``key``: this machine's earlier tune (CACHED); under ``tune`` or
        ``retune`` and alone on the GPU, ``tune()``'s result, stored (TUNED); else the shipped table's pick
        (SHIPPED), that of the nearest shipped shape class, whose shape may differ at the positions ``near``
        (NEAREST), either only where ``valid(config)``, or ``fixed()``'s (FIXED). A process sharing its GPU under a
        tuning mode compiles the candidates first (``compile_all``) where ``compiles_candidates``, for the process
        that tunes after it."""
        cached = self.get(key)
        if cached is not None:
            return cached, CACHED
        if mode() in TUNING_MODES:
            if not shares_gpu():
                config = tune()
                self.put(key, config)
                return config, TUNED
            if compile_all is not None and compiles_candidates():
                compile_all()
        shipped = self.tables.pick(key, near, valid) if self.tables else None
        return shipped if shipped else (fixed(), FIXED)


def gpu_file(gpu: str) -> str:
    """The file name of a GPU model's shipped table: ``NVIDIA H200`` -> ``nvidia-h200.json``."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ".json"


def _shape_distance(shape: Sequence[str], other: Sequence[str], near: Sequence[int]) -> float | None:
    """How far apart two shape classes are: None unless they match everywhere but at the positions ``near``, where
    sizes count by their ratio (powers of two apart), other integers by their difference and anything else as 1."""
    if len(shape) != len(other):
        return None
    distance = 0.0
    for i, (a, b) in enumerate(zip(shape, other, strict=True)):
        if a == b:
            continue
        if i not in near:
            return None
        if not (a.lstrip("-").isdigit() and b.lstrip("-").isdigit()):
            distance += 1
            continue
        x, y = int(a), int(b)
        distance += abs(math.log2(x / y)) if x > 0 and y > 0 else abs(x - y)
    return distance


class ShippedTables:
    """The picks shipped beside a kernel family, one JSON file per GPU model in ``folder`` (``gpu_file``):
    ``{"gpu", "capability", "picks": [{"shape": [...], "config": {...}}, ...]}``."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @functools.cached_property
    def tables(self) -> list[dict]:
        tables = []
        for path in sorted(self.folder.glob("*.json")):
            table = json.loads(path.read_text())
            table["by_shape"] = {tuple(pick["shape"]): pick["config"] for pick in table["picks"]}
            tables.append(table)
        return tables

    def pick(self, key: str, near: Sequence[int] = (),
             valid: Callable[[dict], bool] | None = None) -> tuple[dict, str] | None:
        """The shipped config for a cache key (``TuningCache.key``) and where it came from, or None; a config that
        ``valid`` refuses (not in the caller's space for this shape) is passed over."""
        try:
            fields = json.loads(key)
            gpu, capability, shape = fields["gpu"], fields["capability"], tuple(fields["shape"])
        except (ValueError, TypeError, KeyError):
            return None
        def usable(config: dict) -> bool:
            return valid is None or valid(config)

        own = [t for t in self.tables if t["gpu"] == gpu]
        if own and shape in own[0]["by_shape"] and usable(own[0]["by_shape"][shape]):
            return dict(own[0]["by_shape"][shape]), f"{SHIPPED} ({gpu})"
        kin = [t for t in self.tables if t["gpu"] != gpu and t["capability"] == capability]
        def larger_first(other: tuple) -> list[int]:  # between classes as near, the one tuned for more work
            return [-int(other[i]) if other[i].lstrip("-").isdigit() else 0 for i in near]

        for table in own + kin:  # this GPU's nearest class first
            ranked = sorted((d, larger_first(other), other) for other, config in table["by_shape"].items()
                            if (d := _shape_distance(shape, other, near)) is not None and usable(config))
            if ranked:
                return dict(table["by_shape"][ranked[0][2]]), f"{NEAREST} ({table['gpu']})"
        return None


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
