"""The cuTile tuners: candidates compiled in parallel, timed (``FMHA_TUNER``), and the pick kept per shape class in
the family's tuning cache and in the process."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from impls._registry import length_class, parallel_class
from impls.contract import NO_WINDOW
from impls.cutile import toolchain
from impls.cutile.config import Variant
from impls.cutile.launch import Call, Launches
from impls.cutile.spaces import PEELED_TILE, candidates
from impls.timing import settle_gpu
from impls.tuning import (
    EVIDENCE,
    TUNERS,
    TuningCache,
    dense_tuner,
    family_sources,
    finalists,
    settled_ranking,
    sustained_fastest,
)

COMPILE_TIMEOUT_S = 120  # per config while tuning: a config that compiles longer is dropped
# The chosen variant per shape class: shipped in tuned/, tuned on this machine on request (impls/tuning.py).
TUNING = TuningCache("cutile", family_sources(__file__), ["cuda-tile"], toolchain.describe,
                     tables=Path(__file__).parent / "tuned")
# The positions of a shape class a shipped pick carries across: the query and key length classes and the parallel
# class (dense and varlen), and whether the lengths are whole peeled tiles (dense; a pick the shape's space lacks,
# a peeled form where they are not, is passed over).
NEAR_LENGTHS = (5, 6, 7)
NEAR_DENSE = (*NEAR_LENGTHS, 10)
Choice = TypeVar("Choice")


class Tuned(NamedTuple, Generic[Choice]):
    """A tuner's pick: the choice, where it came from (``impls.tuning``'s CACHED, TUNED, SHIPPED, NEAREST or
    FIXED), and what decided it where the tuner kept that (``impls.tuning.EVIDENCE``: the settled tuner's finalists
    and their times)."""

    choice: Choice
    source: str
    finalists: list[dict] | None = None

    def provenance(self) -> dict[str, Any]:
        """What a prepared call's config says of its pick."""
        return {"chosen": self.source, **({EVIDENCE: self.finalists} if self.finalists else {})}


_TUNED: dict[str, Tuned[Any]] = {}


def remembered(key: str, search: Callable[[], dict], build: Callable[..., Choice],
               fixed: Callable[[], dict], compile_all: Callable[[], object] | None = None,
               near: Sequence[int] = (), valid: Callable[[dict], bool] | None = None) -> Tuned[Choice]:
    """The choice for tuning key ``key``, made once per process: ``build(**config)`` of the config
    ``TuningCache.lookup`` gives (this machine's tune, a shipped or nearest shipped pick that ``valid`` accepts,
    ``search()``'s result where tuning is asked for, else ``fixed()``'s), with where it came from and the evidence
    the entry keeps beside the config."""
    if key not in _TUNED:
        entry, source = TUNING.lookup(key, search, fixed, compile_all, near, valid)
        config = {name: value for name, value in entry.items() if name != EVIDENCE}
        _TUNED[key] = Tuned(build(**config), source, entry.get(EVIDENCE))
    return _TUNED[key]


def shape_class(q: torch.Tensor, k: torch.Tensor, causal: bool, window: tuple[int, int] = NO_WINDOW,
                softcap: float = 0.0, value_dim: int | None = None) -> tuple:
    """What the dense tuner's pick depends on; ``whole``: lengths (and a window's left size) in whole tiles of the
    peeled candidates, whose peel shapes without them refuse."""
    whole = not (q.shape[2] % PEELED_TILE or k.shape[2] % PEELED_TILE or (window[0] > 0 and window[0] % PEELED_TILE))
    return (q.dtype, q.shape[-1], value_dim or q.shape[-1], causal, q.shape[1] // k.shape[1], length_class(q.shape[2]),
            length_class(k.shape[2]), parallel_class(q.shape[0] * q.shape[1]), window != NO_WINDOW, softcap > 0,
            whole)


def precompile(calls: list[Launches]) -> list[Launches]:
    """Make every candidate's first call from as many threads: each first launch compiles (tileiras runs as a
    process of its own), so the search then times compiled kernels and a cold tune costs about one compile.
    The calls share one output; the search overwrites it. Returns the calls that compiled: a candidate the
    compiler gives up on (its time limit) drops out of the search; if none compiled, the first error is raised."""
    from concurrent.futures import ThreadPoolExecutor

    import cuda.tile as ct

    if not calls:
        return []
    stream = torch.cuda.current_stream()

    def first_call(call: Launches) -> ct.TileError | None:
        torch.cuda.set_device(stream.device)  # the thread's current context, which cuTile's launch asks for
        with torch.cuda.stream(stream):
            try:
                call()
            except ct.TileError as error:
                return error
        return None

    with ThreadPoolExecutor(max_workers=min(len(calls), os.cpu_count() or 1)) as pool:
        errors = list(pool.map(first_call, calls))
    torch.cuda.synchronize()
    compiled = [call for call, error in zip(calls, errors, strict=True) if error is None]
    if not compiled:
        raise errors[0]
    return compiled


def compiled_candidates(calls: list[Launches]) -> list[Launches]:
    """``precompile`` within the compiler's time limit for one candidate (``COMPILE_TIMEOUT_S``)."""
    import cuda.tile as ct

    with ct.compiler_timeout(COMPILE_TIMEOUT_S):
        return precompile(calls)


def exhaustive_timings(calls: list[Launches]):
    """``cuda.tile.tune.exhaustive_search`` over these compiled calls, each timed as its one launch (the search
    times one launch per candidate, so the search space holds single-launch variants only); its TuningResult,
    configs being the calls' variants."""
    from cuda.tile.tune import exhaustive_search

    launches = {}
    for call in calls:
        (launches[call.variant],) = call.launches  # (grid, kernel, arguments)
    return exhaustive_search(list(launches), torch.cuda.current_stream(), grid_fn=lambda var: launches[var][0],
                             kernel=lambda var: launches[var][1],  # the hints travel with it
                             args_fn=lambda var: launches[var][2], quiet=True)


def tuned(shape: tuple, device: torch.device, space: list[Variant], make_call: Callable[[Variant], Launches],
          near: Sequence[int] = NEAR_LENGTHS) -> Tuned[Variant]:
    """The fastest variant of ``space`` for shape class ``shape`` (``make_call`` prepares one candidate; all
    share one output; on a shared GPU the first, untimed), where it came from, and the finalists' times where there
    were several.
    ``FMHA_TUNER`` says how candidates are timed: ``settled`` (default: ``cuda.tile.tune.exhaustive_search``,
    then the candidates within ``FINALIST_MARGIN`` of its best again by ``settled_times``, each alone at the
    clocks it sustains, as the suite times), ``exhaustive`` (the search alone) or ``sustained``
    (``sustained_fastest``: graph replays interleaved). Each method's picks are cached apart."""
    method = dense_tuner()

    def compiled() -> list[Launches]:
        return compiled_candidates([make_call(variant) for variant in space])

    def search() -> dict:
        calls = compiled()
        if method == "sustained":
            return sustained_fastest((call.variant, call) for call in calls).describe()
        settle_gpu(device)  # compiling was a pause: time every candidate at sustained clocks
        result = exhaustive_timings(calls)
        if method == "settled":  # the search's finalists again, each at the clocks it sustains
            search_us = {m.config: m.mean_us for m in result.successes}
            near = finalists(search_us.items())
            if len(near) > 1:
                by_variant = {call.variant: call for call in calls}
                ranked = settled_ranking((variant, by_variant[variant]) for variant in near)
                return {**ranked[0][0].describe(), EVIDENCE: [
                    {"variant": variant.label(), "search_us": round(search_us[variant], 1),
                     "settled_us": round(ms * 1e3, 1)} for variant, ms in ranked]}
        return result.best.config.describe()

    shape = shape if method == TUNERS[0] else (*shape, f"tuner={method}")  # each method's picks kept apart
    described = [variant.describe() for variant in space]
    return remembered(TUNING.key(device, shape), search, Variant, space[0].describe, compiled, near,
                      lambda config: config in described)


def tune(q, k, v, *, causal: bool, scale: float, **variants) -> Tuned[Variant]:
    """The best variant of the search space for this dense shape class; ``variants``: window, softcap (as the
    call will run)."""
    q, k, v = (t.contiguous() for t in (q, k, v))  # once here, not once per candidate
    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    space = candidates(torch.cuda.get_device_capability(q.device), q, k, v, causal=causal, **variants)
    return tuned(shape_class(q, k, causal, value_dim=v.shape[-1], **variants), q.device, space,
                 lambda variant: Call(variant, q, k, v, causal=causal, scale=scale, out=out, **variants), NEAR_DENSE)
