"""The cuTile dense kernel's search spaces per architecture, the blog's ladder, and the forms left out of the spaces.
Each Hopper candidate was kept after measuring it on an H200 against the forms left out: see
docs/design.md#cutile-forward."""

from __future__ import annotations

from dataclasses import replace

from impls.contract import NO_WINDOW
from impls.cutile import toolchain
from impls.cutile.config import Variant, head_tiles, kernel_window, tile_d

LADDER_HEAD_DIMS = (64, 128)  # the blog's steps, as the blog runs them

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
    """Hopper (sm_90) candidates, each kept after measuring it on an H200 against the forms left out. None spills
    where the tuner picks it (sm_90 SASS); the blog's 256x128 tile of one warpgroup does, the ladder's "trap".

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
    if accumulator > 128:  # causal, no window: a persistent paired 128x64 lost to one block a tile (H200, Gemma-2
        # global 1 x 32K: 564 against 572 settled TFLOPS); the 128x128 block (``wide``) leads there.
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
    # 128x128 with the diagonal peeled (peeled_space) where Q/K's tile is 128 wide (other_forms: what lost).
    if not causal:
        streams = [streaming, replace(streaming, k_latency=4, v_latency=4)]
    elif even_items:
        streams = [streaming, replace(streaming, k_latency=2, v_latency=4)]
    else:
        streams = []
    if width == 64 or (width < 64 and not causal) or (width == 128 and causal):
        streams.append(replace(streaming, tile_n=256))
        if causal:  # and with a fixed share of mirror pairs of query tiles (kernel PAIRED)
            streams.append(replace(streaming, tile_n=256, paired=True))
    space = space + streams + (sixteen_warp_space(head_dim, causal) if toolchain.sixteen_warps() else [])
    if causal and head_tiles(head_dim)[0] == PEELED_TILE and accumulator == PEELED_TILE:
        space = peeled_space(space, window)
    return planned_forms(space + deferred_forms(space, causal, window, mla=width > accumulator))


def planned_forms(space: list[Variant]) -> list[Variant]:
    """``space`` and its paired candidates again taking the host's plan (``Variant.planned``): the same mirror
    pairs, shared longest first, with the trailing ones split into their tiles where that fills the last round
    (``impls._plans.split_tail``). Both stay candidates: neither wins everywhere (H200, settled TFLOPS, planned /
    paired 128x256: GPT-2 1 x 32K 489-491 / 469-472, the Llama-3-70B slice's 1 x 32K 601 / 647)."""
    return space + [replace(v, paired=False, planned=True) for v in space if v.paired]


def peeled_space(space: list[Variant], window: bool) -> list[Variant]:
    """The causal space at head dims whose Q/K tile is 128 wide (65-128 without a tail, MLA's 128 + 64) with the
    diagonal peeled (``Variant.peel_diagonal``) in its 128x128 candidates, which then run it where the shape
    allows, the paired 128x256 of the space again with the peel, in 128-key tiles (``kernel.peel_narrow``; with a
    window its far edge too), and (no window) a persistent 128x128 with a paired share and the peel.

    With the masked tiles as straight-line code after the mask-free loop, the compiler gives that loop a deeper
    K/V pipeline and no stack (sm_90, bf16: 165 KB instead of 99-132 at D=128, 214 instead of 149 for MLA, 198
    with a window; the paired 128x256 161 -> 225 KB, with a window 165 -> 225 KB). On the H200's causal cases each
    ran within 1% of its loop form or ahead. The other shapes peeled were measured and left out."""
    peeled = [replace(v, peel_diagonal=True) if (v.tile_m, v.tile_n) == (PEELED_TILE, PEELED_TILE) else v
              for v in space]
    paired = replace(HOPPER_STREAMING, paired=True, peel_diagonal=True)
    narrow = [replace(v, peel_diagonal=True) for v in space if v.paired and v.tile_n > v.tile_m]  # the 128x256
    return [*peeled, *narrow] if window else [*peeled, paired, *narrow]


def deferred_forms(space: list[Variant], causal: bool, window: bool, mla: bool) -> list[Variant]:
    """The candidates of ``space`` again with each mask-free key tile's P V deferred to the next step
    (``Variant.defer_pv``, kernel ``free_tiles_deferred``), where that won on the H200: causal without a window,
    the one-block-a-tile 128x128 with the diagonal peeled (L2,4; at MLA's Q/K 192 every peeled 128x128) and, with a
    256-wide accumulator, the one-block-a-tile 128x64.

    Written so, the compiler issues the deferred P V beside the next tile's softmax (FlashAttention-3's
    intra-warpgroup overlap), which it does by itself only in the non-causal persistent loop (H200, MLA 1 x 32K:
    596-609 -> 640-653 settled TFLOPS). See docs/design.md#cutile-forward for the forms left out."""
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
    candidates on long rows at D=64 and 96 on an H200, causal as a persistent block with a paired share too; every
    other 16-warp shape spilled or trailed."""
    if head_tiles(head_dim)[0] > 64:
        return []
    tall = replace(HOPPER_WIDE, tile_m=256, tile_n=64, num_worker_warps=16)
    if causal:
        return [tall, replace(tall, persistent=True, paired=True)]
    return [tall, replace(tall, persistent=True, k_latency=3, v_latency=6)]


def other_forms() -> list[Variant]:
    """Forms of the kernel the autotuner does not try (they lost on the H200), kept for sweeps and checked for
    correctness with the candidates: the causal persistent kernel with a dynamic scheduler (with bytecode 13.5
    only: ``toolchain.DYNAMIC_SCHEDULER``), also with its loads issued 2 / 4 tiles ahead (132 KB of pipeline at
    D=128 where 3 / 6 gets 99), and two launches with a fixed share. Not the two combined: slower than either, and
    tileiras 13.5 fails to compile its mask-free launch with a ragged Skv; the kernel's switches still allow it."""
    # the dynamic scheduler only where tileiras compiles its loop race-free (toolchain.DYNAMIC_SCHEDULER says why)
    return [*(DYNAMIC_FORMS if toolchain.dynamic_scheduler() else ()), replace(HOPPER_STREAMING, two_launch=True)]


def candidates(capability: tuple[int, int], q, k, v, *, causal: bool, **variants) -> list[Variant]:
    """The search space as this dense call runs it: each candidate in the form the call's shape resolves it to
    (``Variant.resolved``: a peeled diagonal the shape refuses runs the masked loop, and is then its twin's
    double, kept once)."""
    window = kernel_window(variants.get("window", NO_WINDOW), causal)
    space = search_space(capability, q.shape[-1], causal=causal, value_dim=v.shape[-1], window=window is not None)
    return list(dict.fromkeys(var.resolved(causal=causal, q_len=q.shape[2], kv_len=k.shape[2], window=window)
                              for var in space))
