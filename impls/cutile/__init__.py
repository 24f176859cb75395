"""Our cuTile FMHA kernel (``kernel.py``): the NVIDIA blog's optimisation ladder and the autotuned kernel.

- ``cutile-1-baseline`` ... ``cutile-5-remap``: the blog's steps, each a :class:`Variant` of one kernel;
- ``cutile``: every optimisation on, tile shape and occupancy chosen from a per-architecture search space by
  ``cuda.tile.tune.exhaustive_search`` and its finalists timed again the suite's way (``tuned``), once per
  shape class, cached on disk and in the process.

A variant's hints (occupancy, num_ctas) are applied by ``Variant.kernel()``, the one object both the launch
and the cubin export use (``tests/test_cutile_export.py`` checks that they reach the compiler).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from impls._registry import HALF, Prepared, heads_by_batch, length_class, module_available, parallel_class, register
from impls._serving import decode_route, varlen_work_plan
from impls._tuning import (
    EVIDENCE,
    TUNERS,
    TuningCache,
    dense_tuner,
    family_sources,
    finalists,
    settle_gpu,
    settled_ranking,
    sustained_fastest,
)
from impls._validate import NO_WINDOW, UNBOUNDED, binding_window, window_bounds
from impls.cutile import toolchain

HEAD_DIMS = tuple(range(16, 257, 8))  # the autotuned kernel: a head dim pads to the next power of two
LADDER_HEAD_DIMS = (64, 128)  # the blog's steps, as the blog runs them
COMPILE_TIMEOUT_S = 120  # per config while tuning: a config that compiles longer is dropped
# Causal work goes heaviest-first across a group of heads whose K/V stay in L2 together (kernel.work_item).
# 8 MiB, a fraction of the H200's L2: in the session-3 sweep 8 heads led at 2K and 4 at 4K (+1-4%), while 8
# heads at 16K (64 MB of K/V) lost 5% to one.
L2_BUDGET_BYTES = 8 << 20
MAX_HEAD_GROUP = 16


@dataclass(frozen=True)
class Variant:
    """One compiled form of the kernel: tile shape, the ladder's switches and the compiler hints."""

    tile_m: int
    tile_n: int
    fast_math: bool = True
    loop_split: bool = True
    mask_branch: bool = False  # the loop split as one loop with a run-time branch (the blog's form)
    reverse_order: bool = True
    occupancy: int | None = None
    num_ctas: int | None = None
    num_worker_warps: int | None = None
    k_latency: int = 2
    v_latency: int = 4
    head_group: int | None = 1  # causal: heads ordered heaviest-first together; None: as many as L2 holds
    persistent: bool = False  # one block per SM slot, looping over the query tiles
    two_launch: bool = False  # the masked tiles in a launch of their own, then the mask-free ones (kernel PHASE)
    dynamic: bool = False  # persistent: the next work item from an atomic counter (kernel DYNAMIC)
    paired: bool = False  # persistent, causal: a fixed share of mirror pairs of query tiles (kernel PAIRED)
    planned: bool = False  # persistent: the host's plan of mirror pairs, its last round filled (kernel PLANNED)
    head_tail: bool = True  # a head dim that is not a power of two: one and a tail tile, not padded (head_tiles)
    peel_diagonal: bool = False  # causal, aligned: the diagonal's masked tiles as straight-line code, no loop
    defer_pv: bool = False  # each mask-free tile's P V in the next step, beside its softmax (kernel DEFER_PV)

    def __post_init__(self) -> None:
        # the kernel takes PAIRED only for a persistent fixed share of heaviest-first causal work: refuse the rest
        conflict = ("one block per item" if not self.persistent else "a dynamic scheduler" if self.dynamic
                    else "plain order (reverse_order=False)" if not self.reverse_order else None)
        if self.paired and conflict:
            raise ValueError(f"paired: an order for a persistent block's fixed share of heaviest-first work items, "
                             f"not for {conflict}")
        conflict = ("one block per item" if not self.persistent else "a dynamic scheduler" if self.dynamic
                    else "a fixed paired share" if self.paired else None)
        if self.planned and conflict:
            raise ValueError(f"planned: a persistent block's share of the host's plan, not {conflict}")

    def heads_per_group(self, *, causal: bool, kv_len: int, head_dim: int, itemsize: int) -> int:
        """HEAD_GROUP for this launch: 1 unless the causal blocks run heaviest first. The automatic choice keeps
        the K/V of the heads in flight within ``L2_BUDGET_BYTES``: 8 heads at 2K (fp16, D=128), 1 from 16K.
        Counted by query head, also under GQA: session 18 (H200, 4 x 4K causal, ``gpu_session.sh groups``) timed
        16 / 32 / 128 heads against it: 2-3% faster only at 32-48 batch-heads (70B slice, GPT-2), up to 37% slower
        elsewhere; counting by kv head would give Llama-3-8B 16 heads, 6% slower."""
        if not (causal and self.reverse_order):
            return 1
        if self.head_group is not None:
            return self.head_group
        heads = L2_BUDGET_BYTES // (2 * kv_len * head_dim * itemsize)  # K and V of one head
        return 1 << (min(max(heads, 1), MAX_HEAD_GROUP).bit_length() - 1)  # a power of two, at least 1

    def hints(self) -> dict:
        """The compiler hints this variant sets (unset ones are left to the compiler)."""
        names = ("occupancy", "num_ctas", "num_worker_warps")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def kernel(self, int64: bool = False, base: str = "fmha_fwd"):
        """The kernel object to launch or export, with this variant's hints: ``base`` names the kernel of
        kernel.py (``fmha_fwd``, ``fmha_varlen``), ``int64`` asks for 64-bit indexing."""
        return _kernel_with_hints(base + ("_int64" if int64 else ""), tuple(sorted(self.hints().items())))

    def constants(self, *, head_dim: int, causal: bool, kv_len: int, itemsize: int, phase: int = 0,
                  window: tuple[int, int] | None = None, softcap: float = 0.0, value_dim: int | None = None,
                  q_len: int | None = None) -> dict[str, Any]:
        """The kernels' compile-time arguments by parameter name (``fmha_varlen`` takes a subset); ``window``:
        the kernel's (left, right) bounds (``window_bounds``) or None, ``q_len``: Sq where known."""
        group = self.heads_per_group(causal=causal, kv_len=kv_len, head_dim=head_dim, itemsize=itemsize)
        tiles = dict(zip(("TILE_D", "TILE_D_TAIL", "TILE_DV", "TILE_DV_TAIL"), self.head_tiles(head_dim, value_dim),
                         strict=True))
        return {**tiles, "TILE_M": self.tile_m, "TILE_N": self.tile_n, "CAUSAL": causal,
                "EVEN_N": kv_len % self.tile_n == 0, "HAS_WINDOW": window is not None, "SOFTCAP": float(softcap),
                "FAST_MATH": self.fast_math, "LOOP_SPLIT": self.loop_split, "MASK_BRANCH": self.mask_branch,
                "REVERSE_ORDER": self.reverse_order, "K_LATENCY": self.k_latency, "V_LATENCY": self.v_latency,
                "HEAD_GROUP": group, "PERSISTENT": self.persistent, "DYNAMIC": self.dynamic, "PAIRED": self.paired,
                "PLANNED": self.planned, "PHASE": phase, "DEFER_PV": self.defer_pv,
                "DIAGONAL_TILES": self.diagonal_tiles(causal=causal, q_len=q_len, kv_len=kv_len, phase=phase,
                                                      window=window)}

    def diagonal_tiles(self, *, causal: bool, q_len: int | None, kv_len: int, phase: int = 0,
                       window: tuple[int, int] | None = None) -> int:
        """The kernel's DIAGONAL_TILES: 0 (masked key tiles run in a loop), or, ``peel_diagonal``, the number of
        masked tiles every query tile has, run as straight-line code after the mask-free loop."""
        if not self.peel_diagonal:
            return 0
        refusal = self.peel_refusal(causal=causal, q_len=q_len, kv_len=kv_len, phase=phase, window=window)
        if refusal:
            raise ValueError(f"{self.label()}: the diagonal cannot be peeled: {refusal}")
        return self.peeled_tiles()

    def peeled_tiles(self) -> int:
        """The masked diagonal tiles each query tile runs where the diagonal is peeled: TILE_M / TILE_N of them
        where query tiles are the wider, else one (``peel_narrow`` runs it at the query tile's width)."""
        return max(self.tile_m // self.tile_n, 1)

    def peel_refusal(self, *, causal: bool, q_len: int | None, kv_len: int, phase: int = 0,
                     window: tuple[int, int] | None = None) -> str | None:
        """Why the masked tiles of this call are not the same few for every query tile (None: they are). They
        are where every query tile is whole and the diagonal crosses key tiles at the same place in each: then
        query tile t masks the keys from ``t * TILE_M + Skv - Sq`` on, ``max(TILE_M / TILE_N, 1)`` tiles of
        ``min(TILE_M, TILE_N)`` keys (key tiles wider than query tiles peel at the query tile's width), and each of
        its rows sees a key in the first. A window's far edge, where the left size is a multiple of TILE_M (and,
        for key tiles wider than query tiles, at least TILE_N), adds as many tiles at its start to the tiles past
        the first window (one masked and up to TILE_N / TILE_M - 1 whole ones where key tiles are wider)."""
        offset = None if q_len is None else kv_len - q_len
        left, right = window or (-1, -1)
        width = min(self.tile_m, self.tile_n)  # of the peeled tiles
        return next((why for why, bad in (
            ("not causal", not causal), ("a split launch", phase != 0),
            ("the mask as a run-time branch", self.mask_branch or not self.loop_split),
            ("query length unknown", q_len is None),
            (f"Sq={q_len} not a multiple of TILE_M={self.tile_m}", q_len is not None and q_len % self.tile_m),
            (f"Skv={kv_len} not a multiple of {width}", kv_len % width),
            (f"Skv - Sq={offset} negative or not a multiple of {width}",
             offset is not None and (offset < 0 or offset % width)),
            (f"a window to the right ({right})", right > 0),
            (f"a window's left size {left} not a positive multiple of TILE_M={self.tile_m}",
             window is not None and (left <= 0 or left % self.tile_m)),
            (f"a window's left size {left} below TILE_N={self.tile_n}",  # peel_narrow's far edge: whole tiles
             window is not None and self.tile_n > self.tile_m and left < self.tile_n),
        ) if bad), None)

    def resolved(self, *, causal: bool, q_len: int, kv_len: int, window: tuple[int, int] | None = None) -> Variant:
        """The form a call of this shape runs: with the masked loop where the shape refuses this variant's peeled
        diagonal (``peel_refusal``), as it is otherwise. The tuner's candidates and its cached pick come this way,
        so a prepared call's ``variant`` is what it launches."""
        if self.peel_diagonal and self.peel_refusal(causal=causal, q_len=q_len, kv_len=kv_len, window=window):
            return replace(self, peel_diagonal=False)
        return self

    def head_tiles(self, head_dim: int, value_dim: int | None = None) -> tuple[int, int, int, int]:
        """The kernel's TILE_D, TILE_D_TAIL, TILE_DV, TILE_DV_TAIL for these head dims."""
        return (*head_tiles(head_dim, self.head_tail), *head_tiles(value_dim or head_dim, self.head_tail))

    def arguments(self, q, k, v, out, state, *, causal: bool, scale: float, phase: int = 0,
                  window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0) -> tuple:
        """Everything ``fmha_fwd`` takes, in order."""
        heads, q_len, head_dim = q.shape[1:]
        kv_len = k.shape[2]
        window_left, window_right = window_bounds(window, causal)
        constants = self.constants(head_dim=head_dim, causal=causal, kv_len=kv_len, itemsize=q.element_size(),
                                   phase=phase, window=kernel_window(window, causal), softcap=softcap,
                                   value_dim=v.shape[-1], q_len=q_len)
        return bind("fmha_fwd", Q=q, K=k, V=v, Out=out, **state_arrays(state), qk_scale=scale,
                    causal_offset=kv_len - q_len, window_left=window_left, window_right=window_right,
                    num_heads=heads, group=heads // k.shape[1], **constants)

    def launches(self, q, k, v, out, state, *, causal: bool, scale: float, **variants) -> list[tuple]:
        """(grid, kernel, arguments) of each launch one call makes, in order; ``variants``: window, softcap."""
        kernel = self.kernel(int64=needs_int64(q, k, v, *state))
        return [(form.grid(q), kernel, form.arguments(q, k, v, out, state, causal=causal, scale=scale, phase=phase,
                                                      **variants))
                for form, phase in self.phases()]

    def phases(self) -> list[tuple[Variant, int]]:
        """The form and kernel PHASE of each launch: the whole forward, or its diagonal and mask-free launches
        (``two_launch``)."""
        from impls.cutile.kernel import DIAGONAL, OFF_DIAGONAL, WHOLE

        if self.two_launch:
            return [(self.diagonal(), DIAGONAL), (self, OFF_DIAGONAL)]
        return [(self, WHOLE)]

    def diagonal(self) -> Variant:
        """Launch 1 of a two-launch variant: one block per query tile, all alike (a tile or two of masked work
        each), in plain order."""
        return replace(self, persistent=False, reverse_order=False, paired=False, planned=False)

    def state(self, q: torch.Tensor, value_dim: int | None = None, *, kv_len: int | None = None,
              causal: bool = True, window: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
        """The kernel's workspace: the softmax state the two launches pass on (max and sum (B, Hq, Sq) and the
        unnormalised accumulator (B, Hq, Sq, TILE_DV), all float32, the kernel's own precision), the dynamic
        scheduler's counter (one int32, zeroed before every launch), then the host's plan (``work_plan``; for Skv
        ``kv_len``, default Sq, and the kernel's ``window`` bounds). Unused parts are placeholders."""
        rows = q.shape[:3] if self.two_launch else (1, 1, 1)
        width = tile_d(value_dim or q.shape[-1]) if self.two_launch else 1
        return (torch.empty(rows, dtype=torch.float32, device=q.device),
                torch.empty(rows, dtype=torch.float32, device=q.device),
                torch.empty((*rows, width), dtype=torch.float32, device=q.device),
                torch.zeros((1,), dtype=torch.int32, device=q.device),
                *self.work_plan(q, q.shape[2] if kv_len is None else kv_len, causal, window))

    def work_plan(self, q: torch.Tensor, kv_len: int, causal: bool,
                  window: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """PLANNED's arrays, WorkStarts (one more than ``grid``'s blocks) and WorkItems: every (batch, head)'s query
        tiles as one sequence each of the varlen plan (``impls._serving.varlen_work_plan``, whose item encoding the
        kernel decodes), or placeholders. On the meta device (compiling without a GPU) placeholders are enough."""
        placeholder = torch.zeros((1,), dtype=torch.int32, device=q.device)
        if not self.planned:
            return placeholder, placeholder
        batch, heads, q_len = q.shape[:3]
        if q.device.type == "meta":
            tiles = batch * heads * math.ceil(q_len / self.tile_m)
            return placeholder, torch.empty((tiles,), dtype=torch.int32, device=q.device)
        blocks = self.grid(q)[0]
        bounds = window or (UNBOUNDED, UNBOUNDED)
        plan = varlen_work_plan([q_len] * batch, [kv_len] * batch, heads, self.tile_m, self.tile_n, causal, blocks,
                                bounds)
        starts = plan.starts + (plan.starts[-1],) * (blocks - plan.blocks)  # blocks past the plan's: no work
        return (torch.tensor(starts, dtype=torch.int32, device=q.device),
                torch.tensor(plan.items, dtype=torch.int32, device=q.device))

    def resident_blocks(self, sm_count: int) -> int:
        """How many blocks of this variant the GPU holds at once: ``occupancy`` a SM, a block being a cluster of
        ``num_ctas`` CTAs (on as many SMs) where the hint asks for one."""
        return max(sm_count * (self.occupancy or 1) // (self.num_ctas or 1), 1)

    def grid(self, q) -> tuple[int, int, int]:
        tiles = math.ceil(q.shape[2] / self.tile_m)
        if self.persistent:  # as many blocks as fit on the GPU at once, each looping over the work
            slots = self.resident_blocks(_sm_count(q.device.index))
            return (min(slots, tiles * q.shape[0] * q.shape[1]), 1, 1)
        return (tiles, *heads_by_batch(q.shape[1], q.shape[0]))

    def describe(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        """A short name: tiles, hints, latencies and the switches that differ from the defaults."""
        flags = (("nosplit", not self.loop_split), ("branch", self.mask_branch), ("persistent", self.persistent),
                 ("dynamic", self.dynamic), ("paired", self.paired), ("planned", self.planned),
                 ("two-launch", self.two_launch),
                 ("peeled", self.peel_diagonal), ("padded", not self.head_tail), ("deferred", self.defer_pv))
        switches = "".join(f":{flag}" for flag, on in flags if on)
        group = {1: "", None: ":g-auto"}.get(self.head_group, f":g{self.head_group}")
        return f"{self.tile_m}x{self.tile_n}:{self.hints()}:L{self.k_latency},{self.v_latency}{switches}{group}"


def kernel_window(window: tuple[int, int], causal: bool) -> tuple[int, int] | None:
    """A call's window as ``Variant.constants`` and ``Variant.resolved`` take it: the kernel's (left, right)
    bounds (``window_bounds``), or None for no window."""
    return None if window == NO_WINDOW else window_bounds(window, causal)


def tile_d(head_dim: int) -> int:
    """The tile width a head dim runs in: the next power of two (cuTile tiles are powers of two), at least 16
    (the smallest K of a tensor-core product)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def head_tiles(head_dim: int, tail: bool = True) -> tuple[int, int]:
    """The tiles a head dim runs in: (a power of two, a narrower power of two beside it, or 0 for none).

    Padded (``tail`` False, or where a tail would save nothing): the next power of two, ``tile_d``. With a
    tail: half of that and the tail's own ``tile_d`` (96 = 64 + 32, 80 = 64 + 16, 72 = 64 + 16 with 8 columns
    padded, 192 = 128 + 64), where the tail is narrower than the first tile (112 pads to 128)."""
    padded = tile_d(head_dim)
    first = padded // 2
    rest = tile_d(head_dim - first) if head_dim > first else padded
    if not tail or head_dim == padded or rest >= first:
        return padded, 0
    return first, rest


@functools.cache
def _sm_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def bind(base: str, **values: Any) -> tuple:
    """The arguments of kernel ``base`` (of kernel.py) in its parameter order, taken by name from ``values``,
    which may name more (the compile-time constants of both kernels); a parameter without a value is an error.
    The order lives in the kernel's signature only."""
    from impls.cutile import kernel

    names = list(inspect.signature(getattr(kernel, base)._pyfunc).parameters)
    missing = [name for name in names if name not in values]
    if missing:
        raise TypeError(f"{base}: no value for {', '.join(missing)}")
    return tuple(values[name] for name in names)


def state_arrays(state: tuple) -> dict[str, Any]:
    """The workspace (``Variant.state``, or constraints on it) by the kernel's parameter names."""
    from impls.cutile.kernel import ARRAYS

    return dict(zip(ARRAYS[4:], state, strict=True))


@functools.cache
def _kernel_with_hints(base: str, hints: tuple[tuple[str, int], ...], module: str = "kernel"):
    """One kernel object per kernel (``base`` of ``impls.cutile.<module>``) and set of hints: each has its own
    JIT cache, so it is made once."""
    toolchain.enable()  # before the first compile: the bytecode version is chosen once
    plain = getattr(importlib.import_module(f"impls.cutile.{module}"), base)
    return plain.replace_hints(**dict(hints)) if hints else plain


def needs_int64(*tensors: torch.Tensor) -> bool:
    """True when an offset into one of the tensors can reach 2**31 elements: its last element's, which is its element
    count less one where it is contiguous, and less than that in a view whose rows overlap (the pages a dense cache
    is seen as, ``impls._serving.dense_as_paged``)."""
    return any(sum((n - 1) * step for n, step in zip(t.shape, t.stride(), strict=True)) >= 2**31 - 1 for t in tensors)


# The blog's ladder (B200 study): each step adds one change to the one before.
LADDER: dict[str, tuple[Variant, str]] = {}
_step = Variant(64, 64, fast_math=False, loop_split=False, reverse_order=False, occupancy=2)
LADDER["cutile-1-baseline"] = (_step, "64x64 tiles, occupancy 2, precise math, every tile masked")
_step = replace(_step, tile_m=256, tile_n=128, occupancy=1)
LADDER["cutile-2-large-tiles"] = (_step, "256x128 tiles, occupancy 1 (the blog's 'trap')")
_step = replace(_step, fast_math=True)
LADDER["cutile-3-fast-math"] = (_step, "+ flush-to-zero exp2 and approximate division (the 'rescue')")
_step = replace(_step, loop_split=True, mask_branch=True)
LADDER["cutile-4-loop-split"] = (_step, "+ K-loop split: mask only the diagonal and ragged tiles (one loop, "
                                        "a run-time branch, as the blog writes it)")
_step = replace(_step, reverse_order=True)
LADDER["cutile-5-remap"] = (_step, "+ causal blocks in reverse order (heaviest first)")


def search_space(capability: tuple[int, int], head_dim: int = 128, *, causal: bool = True,
                 value_dim: int | None = None, window: bool = False) -> list[Variant]:
    """Candidates for the autotuner, per architecture, head dim (and V's, ``value_dim``, where it differs: MLA)
    and mask (all optimisations on; ``window``: a sliding window that hides some keys)."""
    if capability[0] == 9:
        return hopper_space(head_dim, causal, value_dim, window)
    if capability[0] == 12:  # RTX 50 / DGX Spark: few SMs, small tiles
        shapes = [(64, 64, 2), (128, 64, 1)]
    elif capability[0] == 10:  # B200/B300: the blog's three
        shapes = [(64, 64, 2), (128, 128, 2), (256, 128, 1)]
    else:
        shapes = [(64, 64, 2), (128, 64, 1), (128, 128, 1)]
    if tile_d(head_dim) > 128:  # a 256-wide accumulator: half the rows per block
        shapes = [(m // 2 if m > 64 else m, n, occ) for m, n, occ in shapes]
    return [Variant(m, n, occupancy=occ) for m, n, occ in shapes]


# The causal candidates whose diagonal runs peeled (``peeled_space``) peel it in tiles of 128 keys (128x128, and
# the 128x256 at its query tile's width): a shape class notes whether its lengths come in whole tiles of this size.
PEELED_TILE = 128
# Hopper's two warpgroup tile: one block per query tile, and the persistent form that streams K/V on.
HOPPER_WIDE = Variant(128, 128, occupancy=1, num_worker_warps=8, head_group=None)
HOPPER_STREAMING = replace(HOPPER_WIDE, persistent=True, k_latency=3, v_latency=6)
HOPPER_DYNAMIC = replace(HOPPER_STREAMING, dynamic=True)  # its next work item from a counter (other_forms)
# the dynamic scheduler with loads issued 3 / 6 and 2 / 4 tiles ahead (other_forms says why both)
DYNAMIC_FORMS = (HOPPER_DYNAMIC, replace(HOPPER_DYNAMIC, k_latency=2, v_latency=4))


def hopper_space(head_dim: int, causal: bool, value_dim: int | None = None, window: bool = False) -> list[Variant]:
    """Hopper (sm_90) candidates, each kept after measuring it on an H200 against the forms left out
    (``docs/cutile-hopper-space.md`` has the numbers and the sessions that took them). None spills where the tuner
    picks it (sm_90 SASS, ``scripts/cutile_sass.py``); the blog's 256x128 tile of one warpgroup does, the ladder's
    "trap".

    - Non-causal: the persistent 128x128 of 8 worker warps (the compiler streams K/V on from one work item into the
      next: 198 KB of pipeline against 132) beside one block a tile; 64x64 and 128x64 with occupancy 2 for short
      rows, 128x256 for long ones.
    - Causal: one block a tile (64x128 with occupancy 2, 128x128 of 8 warps), heaviest first over as many heads as
      L2 holds. Any mask in a persistent loop body keeps its pipeline shallow (99 KB), so the persistent causal
      candidates are the 128x256 (half the masked loop's trips), with a fixed or a paired share (mirror pairs of
      query tiles), and the peeled forms of ``peeled_space``.
    - A sliding window: the items past the first window all cost the same, so the persistent 128x128 (128x64 at
      D=256) join.
    - Head dims: a V head dim (the accumulator's width) over 128 takes half the rows per warpgroup (128x64, and the
      128x128 of 8 warps); MLA (Q/K wider than V) runs the 128-wide space less the two candidates that spill
      there; blocks of 16 warps join at head dims up to 96 (``sixteen_warp_space``)."""
    wide, streaming, width = HOPPER_WIDE, HOPPER_STREAMING, tile_d(head_dim)
    accumulator = tile_d(value_dim or head_dim)
    even_items = causal and window  # causal work items that (almost) all cost the same
    if accumulator > 128:  # causal, no window: a persistent paired 128x64 lost (session 25, H200, Gemma-2 global
        # D=256 cap 50, settled TFLOPS: 1 x 32K 564 / 553 at L2,4 / L3,6 against 572 / 564 one block a tile; 4 x 4K
        # 511 / 498 against 497 / 510). The 128x128 block (``wide``) leads there (session 27, below).
        tall = replace(wide, tile_n=64, persistent=not causal, k_latency=3, v_latency=6)
        space = [Variant(64, 64, occupancy=1, head_group=None), replace(wide, tile_n=64), tall, wide,
                 *([replace(tall, persistent=True)] if even_items else [])]
        return space + deferred_forms(space, causal, window, mla=False)
    space = [Variant(64, 64, occupancy=2, head_group=None), Variant(128, 64, occupancy=2, head_group=None),
             Variant(64, 128, occupancy=2, head_group=None), wide, replace(wide, k_latency=3, v_latency=6),
             replace(wide, tile_n=256)]
    if width > accumulator:  # Q/K wider than V (MLA): a warpgroup's 128 rows and the causal 256-key tile spill
        space = [v for v in space if not (v.tile_m == 128 and v.occupancy == 2) and not (causal and v.tile_n == 256)]
    # Causal: no persistent candidate but the 128x256 one at head dims 33-64 and 65-128 (see above), and the
    # 128x128 with the diagonal peeled (peeled_space) where Q/K's tile is 128 wide. The two-launch and
    # dynamically scheduled forms stay switches of the kernel for scripts/sweep.py; on the H200 they lost to these.
    if not causal:
        streams = [streaming, replace(streaming, k_latency=4, v_latency=4)]
    elif even_items:
        streams = [streaming, replace(streaming, k_latency=2, v_latency=4)]
    else:
        streams = []
    if width == 64 or (width < 64 and not causal) or (width == 128 and causal):
        streams.append(replace(streaming, tile_n=256))
        if causal:  # and with a fixed share of mirror pairs of query tiles (kernel PAIRED; session 19)
            streams.append(replace(streaming, tile_n=256, paired=True))
    space = space + streams + (sixteen_warp_space(head_dim, causal) if toolchain.sixteen_warps() else [])
    if causal and head_tiles(head_dim)[0] == PEELED_TILE and accumulator == PEELED_TILE:
        space = peeled_space(space, window)
    return planned_forms(space + deferred_forms(space, causal, window, mla=width > accumulator))


def planned_forms(space: list[Variant]) -> list[Variant]:
    """``space`` and its paired candidates again taking the host's plan (``Variant.planned``): the same mirror
    pairs, shared longest first, with the trailing ones split into their tiles where that fills the last round.
    Equal pairs leave it part empty: 768 on 132 blocks (GPT-2 1 x 32K) give the busiest block 6 against a mean of
    5.82, and every ``models`` case that a paired form runs loses about 3% of its launch so (simulated,
    ``impls._serving.split_tail``). Both stay candidates: the tuner picks by settled time, and neither wins
    everywhere (session 55, ``docs/cutile-hopper-space.md``). H200, settled TFLOPS, planned / paired 128x256: GPT-2
    1 x 32K 489-491 / 469-472; Phi-3 1 x 32K 537 / 528 with each item's index read one item ahead (485 before,
    though both compiled to the same registers, pipeline and HGMMA runs); the Llama-3-70B slice's 1 x 32K 601 / 647.
    The tuner picked a planned form on 11 of the 18 ``models`` cases and on the causal ``blog`` / ``fa3`` rows from
    2K but two (session 55, before the read-ahead); with it, on 5 of the 18 on another H200 (session 56: both Phi-3
    and GPT-2 cases, Mistral-7B 1 x 32K; the D=128 forms are near-ties there)."""
    return space + [replace(v, paired=False, planned=True) for v in space if v.paired]


def peeled_space(space: list[Variant], window: bool) -> list[Variant]:
    """The causal space at head dims whose Q/K tile is 128 wide (65-128 without a tail, MLA's 128 + 64) with the
    diagonal peeled (``Variant.peel_diagonal``) in its 128x128 candidates, which then run it where the shape
    allows, the paired 128x256 of the space again with the peel, in 128-key tiles (``kernel.peel_narrow``; with a
    window its far edge too), and (no window) a persistent 128x128 with a paired share and the peel.

    With the masked tiles as straight-line code after the mask-free loop, the compiler gives that loop a deeper
    K/V pipeline and no stack (sm_90, bf16: 165 KB instead of 99-132 at D=128, 214 instead of 149 for MLA, 198
    with a window; the paired 128x256 161 -> 225 KB, with a window 165 -> 225 KB). On the H200's causal cases each
    ran within 1% of its loop form or ahead; with a window (session 47, Mistral-7B 1 x 32K) the paired 128x256
    peeled read 561 settled TFLOPS against 552 for the best peeled 128x128. Measured and left out
    (``docs/cutile-hopper-space.md``): the other shapes peeled, the plain persistent 128x256 peeled (with a window
    too: 525), and the 16-warp 256x64 peeled."""
    peeled = [replace(v, peel_diagonal=True) if (v.tile_m, v.tile_n) == (PEELED_TILE, PEELED_TILE) else v
              for v in space]
    paired = replace(HOPPER_STREAMING, paired=True, peel_diagonal=True)
    narrow = [replace(v, peel_diagonal=True) for v in space if v.paired and v.tile_n > v.tile_m]  # the 128x256
    return [*peeled, *narrow] if window else [*peeled, paired, *narrow]


def deferred_forms(space: list[Variant], causal: bool, window: bool, mla: bool) -> list[Variant]:
    """The candidates of ``space`` again with each mask-free key tile's P V deferred to the next step
    (``Variant.defer_pv``, kernel ``free_tiles_deferred``), where that won on the H200 (session 52,
    ``docs/cutile-hopper-space.md``): causal without a window, the one-block-a-tile 128x128 with the diagonal peeled
    (L2,4; at MLA's Q/K 192 every peeled 128x128) and, with a 256-wide accumulator, the one-block-a-tile 128x64.

    Written so, the compiler issues the deferred P V beside the next tile's softmax (FlashAttention-3's
    intra-warpgroup overlap), which it does by itself only in the non-causal persistent loop: sm_90, tileiras 13.5,
    no stack, 193-225 KB of pipeline. Settled TFLOPS, best plain -> best deferred, on three H200s: MLA 4 x 4K
    527-533 -> 560-574, 1 x 32K 596-609 -> 640-653; Gemma-2 global 1 x 32K 592-595 -> 607; Llama-3-8B 4 x 4K
    524-526 -> 530-533. Measured and left out: non-causal (the compiler's own overlap is faster), a window
    (Mistral-7B 1 x 32K 564 -> 543), D=64's blocks (7-10% slower; the 16-warp persistent one 35% where causal), the
    128x256 (360 B of stack), D=96 (its tail's products already wait one by one)."""
    if not causal or window:
        return []

    def wins(v: Variant) -> bool:
        if v.tile_n == 64:  # the two-warpgroup 128x64 blocks of a 256-wide accumulator
            return v.tile_m == 128 and v.num_worker_warps == HOPPER_WIDE.num_worker_warps and not v.persistent
        return v.peel_diagonal and v.tile_n == v.tile_m == PEELED_TILE and (mla or (
            not v.persistent and (v.k_latency, v.v_latency) == (HOPPER_WIDE.k_latency, HOPPER_WIDE.v_latency)))

    return [replace(v, defer_pv=True) for v in space if wins(v)]


def sixteen_warp_space(head_dim: int, causal: bool) -> list[Variant]:
    """Blocks of 16 worker warps (four consumer warpgroups; tileiras 13.5, see ``toolchain``) at head dims whose
    first tile is at most 64 wide (up to 64, and 72-96 as 64 + a tail tile): 256 query rows against 64-key tiles,
    no spill on sm_90 (96 registers; 83-99 KB of pipeline at D=64, 124-149 KB at D=96). They lead the 8-warp
    candidates on long rows at D=64 and 96, causal as a persistent block with a paired share too (H200, sessions
    15, 16 and 19: ``docs/cutile-hopper-space.md``); every other 16-warp shape spilled or trailed."""
    if head_tiles(head_dim)[0] > 64:
        return []
    tall = replace(HOPPER_WIDE, tile_m=256, tile_n=64, num_worker_warps=16)
    if causal:
        return [tall, replace(tall, persistent=True, paired=True)]
    return [tall, replace(tall, persistent=True, k_latency=3, v_latency=6)]


def other_forms() -> list[Variant]:
    """Forms of the kernel the autotuner does not try (they lost on the H200: ``docs/cutile-hopper-space.md``),
    kept for scripts/sweep.py and checked for correctness with the candidates: the causal persistent kernel with a
    dynamic scheduler (with bytecode 13.5 only: ``toolchain.DYNAMIC_SCHEDULER``), also with its loads issued 2 / 4
    tiles ahead (132 KB of pipeline at D=128 where 3 / 6 gets 99), and two launches with a fixed share. Not the two
    combined: slower than either, and tileiras 13.5 fails to compile its mask-free launch with a ragged Skv; the
    kernel's switches still allow it."""
    # the dynamic scheduler only where tileiras compiles its loop race-free (toolchain.DYNAMIC_SCHEDULER says why)
    return [*(DYNAMIC_FORMS if toolchain.dynamic_scheduler() else ()), replace(HOPPER_STREAMING, two_launch=True)]


def requires(device: str) -> str | None:
    """cuTile installed, its compiler ``tileiras`` found, and the bytecode FMHA_CUTILE_BYTECODE asks for readable by
    it. Without a ``tileiras`` cuda-tile still imports and then fails every compile: a device call that carried the
    13.5 toolchain but did not source its settings failed all 46 cuTile serving benchmarks so (session 60)."""
    missing = module_available("cuda.tile", 'pip install "cuda-tile[tileiras]"')(device)
    if missing:
        return missing
    try:
        toolchain.compiler()
        toolchain.enable()
    except (ValueError, RuntimeError, FileNotFoundError) as error:
        return str(error)
    return None


class Launches:
    """A prepared call: ``launches`` (grid, kernel, arguments), made once, so that a timed call only launches;
    ``variant`` is the form it runs (its ``describe()`` goes into the benchmark's config), ``out`` the result."""

    variant: Variant
    launches: list[tuple]
    out: torch.Tensor
    dependent_launch = False  # every launch a programmatic dependent of the one before it (kernels that wait: PDL)

    def reset(self) -> None:
        """What must happen before every call's launches (a scheduler's counter to zero): nothing here."""

    def __call__(self) -> torch.Tensor:
        import cuda.tile as ct

        stream = torch.cuda.current_stream()
        self.reset()
        for grid, kernel, arguments in self.launches:
            ct.launch(stream, grid, kernel, arguments, programmatic_dependent_launch=self.dependent_launch)
        return self.out

    def prepared(self, **config) -> Prepared:
        self()  # compile outside any timed region
        return Prepared(self, config={**self.variant.describe(), **toolchain.describe(), **config})


class Call(Launches):
    """One prepared dense call of a variant: contiguous inputs, the output, the workspace and every launch's
    arguments."""

    def __init__(self, variant: Variant, q, k, v, *, causal: bool, scale: float,
                 out: torch.Tensor | None = None, **variants) -> None:
        window = kernel_window(variants.get("window", NO_WINDOW), causal)
        self.variant = variant = variant.resolved(causal=causal, q_len=q.shape[2], kv_len=k.shape[2], window=window)
        self.q, self.k, self.v = (t.contiguous() for t in (q, k, v))  # a no-op for the contract's usual layout
        self.out = self.q.new_empty((*self.q.shape[:3], self.v.shape[-1])) if out is None else out
        self.state = variant.state(self.q, self.v.shape[-1], kv_len=self.k.shape[2], causal=causal, window=window)
        self.launches = variant.launches(self.q, self.k, self.v, self.out, self.state, causal=causal, scale=scale,
                                         **variants)

    def reset(self) -> None:
        if self.variant.dynamic:  # the scheduler's counter: part of every call, so inside any timed region
            self.state[-1].zero_()


def _prepare_fixed(variant: Variant):
    def prepare(q, k, v, *, causal: bool, scale: float) -> Prepared:
        return Call(variant, q, k, v, causal=causal, scale=scale).prepared()

    return prepare


for _name, (_variant, _what) in LADDER.items():
    register(_name, family="cutile", dtypes=HALF, devices=("cuda",), head_dims=LADDER_HEAD_DIMS,
             requires=requires, description=_what)(_prepare_fixed(_variant))


# Tune once per machine: the chosen variant per shape class, on disk (impls/_tuning.py), and in the process.
TUNING = TuningCache("cutile", family_sources(__file__), ["cuda-tile"],
                     toolchain.describe)
Choice = TypeVar("Choice")


class Tuned(NamedTuple, Generic[Choice]):
    """A tuner's pick: the choice, where it came from (``_tuning``'s CACHED, TUNED or UNTUNED), and what decided it
    where the tuner kept that (``_tuning.EVIDENCE``: the settled tuner's finalists and their times), else None."""

    choice: Choice
    source: str
    finalists: list[dict] | None = None

    def provenance(self) -> dict[str, Any]:
        """What a prepared call's config says of its pick."""
        return {"chosen": self.source, **({EVIDENCE: self.finalists} if self.finalists else {})}


_TUNED: dict[str, Tuned[Any]] = {}


def remembered(key: str, search: Callable[[], dict], build: Callable[..., Choice],
               fixed: Callable[[], dict], compile_all: Callable[[], object] | None = None) -> Tuned[Choice]:
    """The choice for tuning key ``key``, made once per process: ``build(**config)`` of the config in the tuning
    cache, of ``fixed()``'s where the GPU is shared (``TuningCache.lookup``, which may ``compile_all()`` first), or
    of ``search()``'s result (stored there), with where it came from and the evidence the entry keeps beside the
    config."""
    if key not in _TUNED:
        entry, source = TUNING.lookup(key, search, fixed, compile_all)
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


def tuned(shape: tuple, device: torch.device, space: list[Variant],
          make_call: Callable[[Variant], Launches]) -> Tuned[Variant]:
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
    return remembered(TUNING.key(device, shape), search, Variant, space[0].describe, compiled)


def tune(q, k, v, *, causal: bool, scale: float, **variants) -> Tuned[Variant]:
    """The best variant of the search space for this dense shape class; ``variants``: window, softcap (as the
    call will run)."""
    q, k, v = (t.contiguous() for t in (q, k, v))  # once here, not once per candidate
    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    space = candidates(torch.cuda.get_device_capability(q.device), q, k, v, causal=causal, **variants)
    return tuned(shape_class(q, k, causal, value_dim=v.shape[-1], **variants), q.device, space,
                 lambda variant: Call(variant, q, k, v, causal=causal, scale=scale, out=out, **variants))


def candidates(capability: tuple[int, int], q, k, v, *, causal: bool, **variants) -> list[Variant]:
    """The search space as this dense call runs it: each candidate in the form the call's shape resolves it to
    (``Variant.resolved``: a peeled diagonal the shape refuses runs the masked loop, and is then its twin's
    double, kept once)."""
    window = kernel_window(variants.get("window", NO_WINDOW), causal)
    space = search_space(capability, q.shape[-1], causal=causal, value_dim=v.shape[-1], window=window is not None)
    return list(dict.fromkeys(var.resolved(causal=causal, q_len=q.shape[2], kv_len=k.shape[2], window=window)
                              for var in space))


@register("cutile", family="cutile", dtypes=HALF, devices=("cuda",), head_dims=HEAD_DIMS, requires=requires,
          variants=("window", "softcap", "value_dim"),
          description="our cuTile kernel, all optimisations, tile shape and occupancy autotuned; decode steps (up to "
                      "16 new tokens) through our split-KV decode over the cache as pages where that is faster")
def prepare_tuned(q, k, v, *, causal: bool, scale: float, **variants) -> Prepared:
    """``variants``: a sliding window (key tiles outside it are never visited) and softcap, as they come; v may
    have a head dim of its own (MLA), padded like the query/key one. A decode shape runs the split-KV decode
    where that is faster (``impls._serving.decode_route``). More sequences or heads than CUDA's cap on a
    grid axis are refused before tuning: the one-block-per-tile candidates give each an axis."""
    def dense() -> Prepared:
        heads_by_batch(q.shape[1], q.shape[0])
        dense_variants = dict(variants)
        if "window" in variants:  # one that hides no key runs as no window: no masked loop before the free tiles
            dense_variants["window"] = binding_window(variants["window"], causal, q.shape[2], k.shape[2])
        picked = tune(q, k, v, causal=causal, scale=scale, **dense_variants)
        return Call(picked.choice, q, k, v, causal=causal, scale=scale, **dense_variants).prepared(
            **picked.provenance(), tuner=dense_tuner())

    return decode_route("cutile", q, k, v, causal=causal, scale=scale, dense=dense, tuning=TUNING, **variants)


from impls.cutile import serving  # noqa: E402, F401 - registers the paged decode and varlen entries
