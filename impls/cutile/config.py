"""What one compiled form of our cuTile dense kernel is (``Variant``) and how its launch arguments are bound: tile
widths of a head dim, the kernel's parameters by name (``bind``, ``state_arrays``), kernel objects with hints."""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from impls._plans import varlen_work_plan
from impls._registry import heads_by_batch
from impls.contract import NO_WINDOW, UNBOUNDED, window_bounds
from impls.cutile import toolchain

HEAD_DIMS = tuple(range(16, 257, 8))  # the autotuned kernel: a head dim pads to the next power of two
# Causal work goes heaviest-first across a group of heads whose K/V stay in L2 together (kernel.work_item): 8 MiB,
# a fraction of the H200's L2 (8 heads led at 2K and 4 at 4K by 1-4%, while 8 heads at 16K lost 5% to one).
L2_HEAD_GROUP_BYTES = 8 << 20
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
        the K/V of the heads in flight within ``L2_HEAD_GROUP_BYTES``: 8 heads at 2K (fp16, D=128), 1 from 16K.
        Counted by query head, also under GQA (H200, 4 x 4K causal: larger groups were up to 37% slower; counting by
        kv head would give Llama-3-8B 16 heads, 6% slower)."""
        if not (causal and self.reverse_order):
            return 1
        if self.head_group is not None:
            return self.head_group
        heads = L2_HEAD_GROUP_BYTES // (2 * kv_len * head_dim * itemsize)  # K and V of one head
        return 1 << (min(max(heads, 1), MAX_HEAD_GROUP).bit_length() - 1)  # a power of two, at least 1

    def hints(self) -> dict:
        """The compiler hints this variant sets (unset ones are left to the compiler)."""
        names = ("occupancy", "num_ctas", "num_worker_warps")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def kernel(self, int64: bool = False, base: str = "fmha_fwd"):
        """The kernel object to launch or export, with this variant's hints: ``base`` names the kernel of
        kernel.py (``fmha_fwd``, ``fmha_varlen``), ``int64`` asks for 64-bit indexing."""
        return kernel_with_hints(base + ("_int64" if int64 else ""), tuple(sorted(self.hints().items())))

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
        tiles as one sequence each of the varlen plan (``impls._plans.varlen_work_plan``, whose item encoding the
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
            slots = self.resident_blocks(device_sm_count(q.device.index))
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
def device_sm_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def bind(base: str, module: str = "kernel", /, **values: Any) -> tuple:
    """The arguments of kernel ``base`` (of ``impls.cutile.<module>``) in its parameter order, taken by name from
    ``values``, which may name more (the compile-time constants of both kernels); a parameter without a value is an
    error. The order lives in the kernel's signature only."""
    kernels = importlib.import_module(f"impls.cutile.{module}")
    names = list(inspect.signature(getattr(kernels, base)._pyfunc).parameters)
    missing = [name for name in names if name not in values]
    if missing:
        raise TypeError(f"{base}: no value for {', '.join(missing)}")
    return tuple(values[name] for name in names)


def state_arrays(state: tuple) -> dict[str, Any]:
    """The workspace (``Variant.state``, or constraints on it) by the kernel's parameter names."""
    from impls.cutile.kernel import ARRAYS

    return dict(zip(ARRAYS[4:], state, strict=True))


@functools.cache
def kernel_with_hints(base: str, hints: tuple[tuple[str, int], ...], module: str = "kernel"):
    """One kernel object per kernel (``base`` of ``impls.cutile.<module>``) and set of hints: each has its own
    JIT cache, so it is made once."""
    toolchain.enable()  # before the first compile: the bytecode version is chosen once
    plain = getattr(importlib.import_module(f"impls.cutile.{module}"), base)
    return plain.replace_hints(**dict(hints)) if hints else plain


def needs_int64(*tensors: torch.Tensor) -> bool:
    """True when an offset into one of the tensors can reach 2**31 elements: its last element's, which is its element
    count less one where it is contiguous, and less than that in a view whose rows overlap (the pages a dense cache
    is seen as, ``impls._plans.dense_as_paged``)."""
    return any(sum((n - 1) * step for n, step in zip(t.shape, t.stride(), strict=True)) >= 2**31 - 1 for t in tensors)
