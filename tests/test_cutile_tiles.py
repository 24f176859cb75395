"""The cuTile kernel's key-tile ranges (``kernel.key_tiles``) against the reference mask, and its persistent
blocks' paired share of the causal work items (``kernel.paired_*``), on the CPU.

The kernel cannot run without a GPU, but the arithmetic that decides which key tiles a query tile visits, and
which of them run without a mask, is plain integer code: a tile left out loses keys a row must see, a tile
wrongly taken as mask-free lets a row see keys it must not. Both are checked here for every query tile of
causal, windowed and ragged shapes, Sq != Skv both ways.
"""

import itertools
import os
from collections import Counter

import pytest

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from impls.contract import NO_WINDOW, window_bounds
from impls.cutile.config import Variant
from impls.cutile.kernel import (
    far_edge_or_same,
    key_tiles,
    narrow_far_tiles,
    paired_item,
    paired_linear,
    paired_steps,
    work_item,
)
from impls.reference import visible

SHAPES = [(300, 300), (333, 1000), (200, 130), (97, 97), (256, 256), (64, 700)]
WINDOWS = [NO_WINDOW, (0, 0), (16, 0), (100, 37), (128, -1), (-1, 50), (1000, 1000)]
TILES = [(64, 64), (128, 64), (64, 128), (128, 128), (128, 256)]


@pytest.mark.parametrize(("tile_m", "tile_n"), TILES)
@pytest.mark.parametrize(("sq", "skv"), SHAPES)
def test_key_tiles_cover_every_visible_key_and_free_tiles_need_no_mask(sq, skv, tile_m, tile_n):
    for causal, window in itertools.product((False, True), WINDOWS):
        seen = visible(sq, skv, causal=causal, window=window)
        left, right = window_bounds(window, causal)
        has_window = window != NO_WINDOW
        for tile in range(-(-sq // tile_m)):
            rows = seen[tile * tile_m:(tile + 1) * tile_m]
            first, free_start, free_end, end = key_tiles(tile, skv, skv - sq, left, right, tile_m, tile_n, causal,
                                                         has_window)
            where = f"causal={causal} window={window} query tile {tile}"
            assert first <= free_start <= free_end <= end, where
            seen_tiles = [j for j in range(-(-skv // tile_n)) if rows[:, j * tile_n:(j + 1) * tile_n].any()]
            if seen_tiles:  # every key tile some row sees is visited, and the first and last visited are seen
                assert (first, end) == (seen_tiles[0], seen_tiles[-1] + 1), where
            else:
                assert first >= end, where
            for j in range(free_start, free_end):  # mask-free: whole in Skv and seen whole by every row
                assert (j + 1) * tile_n <= skv and rows[:, j * tile_n:(j + 1) * tile_n].all(), f"{where} tile {j}"
            for masked_from in (free_end, free_start):  # after the mask-free loop, or MASK_BRANCH's one loop
                assert visits(first, free_start, free_end, end, masked_from) == list(range(first, end)), where


def visits(first: int, free_start: int, free_end: int, end: int, masked_from: int) -> list[int]:
    """The key tiles one query tile visits, sorted, as the kernel's mask-free loop (unless MASK_BRANCH: then
    ``masked_from`` is ``free_start``) and its one masked loop, far-edge steps first, walk them."""
    free = range(free_start, free_end) if masked_from == free_end else range(0)
    far_edge = free_start - first
    masked = [far_edge_or_same(step, masked_from, free_start) for step in range(masked_from - far_edge, end)]
    return sorted([*free, *masked])


PEEL_SHAPES = [(256, 256), (128, 512), (512, 512), (384, 1024), (384, 640)]


def narrow_peel_visits(tile: int, free_end: int, offset: int, tile_m: int, tile_n: int) -> tuple[list[int], int]:
    """The TILE_M-key tiles ``peel_narrow`` runs after the mask-free loop of ``tile_n``-key tiles: those without a
    mask (its run-time ``if``), and the masked diagonal one."""
    diagonal = (tile * tile_m + offset) // tile_m
    return [j for j in range(free_end * (tile_n // tile_m), (free_end + 1) * (tile_n // tile_m) - 1)
            if j < diagonal], diagonal


@pytest.mark.parametrize(("tile_m", "tile_n"), TILES)
@pytest.mark.parametrize(("sq", "skv"), PEEL_SHAPES + SHAPES)
def test_peeled_diagonal_visits_the_same_tiles_as_the_masked_loop(sq, skv, tile_m, tile_n):
    """Variant.peel_diagonal: where peel_refusal accepts a shape, every query tile has exactly DIAGONAL_TILES
    masked tiles at the diagonal (and a window's far edge none or as many), the kernel's straight-line code
    visits the same key tiles as the masked loop would, and every row sees a key in the first diagonal tile
    (so the online softmax there needs no guard against a row without keys)."""
    variant = Variant(tile_m, tile_n, peel_diagonal=True)
    accepted = 0
    for window in (NO_WINDOW, (128, 0), (256, 0), (100, 0), (384, 0), (512, 0)):
        bounds = window_bounds(window, True) if window != NO_WINDOW else None
        if variant.peel_refusal(causal=True, q_len=sq, kv_len=skv, window=bounds):
            assert variant.resolved(causal=True, q_len=sq, kv_len=skv, window=bounds) == Variant(tile_m, tile_n)
            with pytest.raises(ValueError, match="cannot be peeled"):
                variant.diagonal_tiles(causal=True, q_len=sq, kv_len=skv, window=bounds)
            continue
        accepted += 1
        count = variant.diagonal_tiles(causal=True, q_len=sq, kv_len=skv, window=bounds)
        seen = visible(sq, skv, causal=True, window=window)
        left, right = window_bounds(window, True)
        for tile in range(sq // tile_m):
            rows = seen[tile * tile_m:(tile + 1) * tile_m]
            first, free_start, free_end, end = key_tiles(tile, skv, skv - sq, left, right, tile_m, tile_n, True,
                                                         bounds is not None)
            where = f"window={window} query tile {tile}"
            if tile_n > tile_m:  # peel_narrow: keys past the loop in tiles of tile_m, the diagonal's one masked
                assert count == 1, where
                free, diagonal = narrow_peel_visits(tile, free_end, skv - sq, tile_m, tile_n)
                far, far_stop = narrow_far_tiles(tile, free_start, skv - sq, left, tile_m, tile_n)
                far_tiles = list(range(far, far_stop)) if bounds is not None else []  # the first one masked
                assert len(far_tiles) <= tile_n // tile_m, where
                in_tiles = [*free, diagonal, *far_tiles]
                keys = [*range(free_start * tile_n, free_end * tile_n),
                        *(k for j in in_tiles for k in range(j * tile_m, (j + 1) * tile_m))]
                assert sorted(keys) == rows.any(axis=0).nonzero().flatten().tolist(), where  # all seen keys, once
                assert all(rows[:, j * tile_m:(j + 1) * tile_m].all() for j in [*free, *far_tiles[1:]]), where
                assert rows[:, diagonal * tile_m:(diagonal + 1) * tile_m].any(axis=1).all(), where
                continue
            assert end - free_end == count and free_start - first in (0, count), where
            far = range(first, free_start) if bounds is not None and first < free_start else range(0)
            assert sorted([*range(free_start, free_end), *range(free_end, free_end + count), *far]) == list(
                range(first, end)), where
            assert rows[:, free_end * tile_n:(free_end + 1) * tile_n].any(axis=1).all(), where
    assert accepted or (sq, skv) in SHAPES  # each aligned shape peels at least without a window


def test_peel_refusals_name_the_reason():
    peeled = Variant(128, 128, peel_diagonal=True)
    reasons = {
        "not causal": dict(causal=False, q_len=256, kv_len=256),
        "Sq=300 not a multiple of TILE_M=128": dict(causal=True, q_len=300, kv_len=384),
        "Skv=300 not a multiple of 128": dict(causal=True, q_len=256, kv_len=300),
        "Skv - Sq=-128 negative": dict(causal=True, q_len=384, kv_len=256),
        "left size 100 not a positive multiple": dict(causal=True, q_len=256, kv_len=256, window=(100, 0)),
        "query length unknown": dict(causal=True, q_len=None, kv_len=256),
    }
    for reason, shape in reasons.items():
        assert reason in peeled.peel_refusal(**shape)
    assert "run-time branch" in Variant(128, 128, peel_diagonal=True, mask_branch=True).peel_refusal(
        causal=True, q_len=256, kv_len=256)
    assert peeled.peel_refusal(causal=True, q_len=256, kv_len=512, window=(256, 0)) is None


def causal_share(num_m: int, num_bh: int, num_blocks: int, paired: bool,
                 head_group: int = 1) -> dict[int, list[tuple[int, int]]]:
    """The (query tile, batch * head) items each persistent block runs, as the kernel's loops order them
    (heaviest first, ``head_group`` heads at a time)."""
    items = num_m * num_bh
    blocks = min(num_blocks, items)  # Variant.grid: no more blocks than items
    if paired:
        return {b: [paired_item(paired_linear(step, b, blocks, items), num_m)
                    for step in range(paired_steps(b, blocks, items))] for b in range(blocks)}
    return {b: [work_item(linear, num_m, num_bh, True, head_group) for linear in range(b, items, blocks)]
            for b in range(blocks)}


@pytest.mark.parametrize(("num_m", "num_bh", "num_blocks"),
                         [(32, 32, 132), (32, 128, 132), (256, 8, 132), (7, 3, 4), (5, 1, 8), (3, 5, 132), (1, 1, 132)])
def test_paired_share_runs_every_query_tile_and_evens_out_the_causal_work(num_m, num_bh, num_blocks):
    share = causal_share(num_m, num_bh, num_blocks, paired=True)
    runs = Counter(item for items in share.values() for item in items)
    assert set(runs) == set(itertools.product(range(num_m), range(num_bh)))
    # an odd item count runs its last item twice (the same output stored twice), nothing else runs twice
    assert sorted(runs.values()) == [1] * (num_m * num_bh - (num_m * num_bh) % 2) + [2] * ((num_m * num_bh) % 2)
    assert all(len(items) % 2 == 0 for items in share.values())
    if num_m % 2 == 0:  # whole pairs: a causal tile t costs about t + 1, a pair num_m + 1, the busiest block
        work = {b: sum(t + 1 for t, _ in items) for b, items in share.items()}  # one pair more than the least
        assert max(work.values()) - min(work.values()) <= num_m + 1


def test_paired_share_fixes_the_fixed_share_at_few_items_a_block():
    """The Llama-3-70B slice at 4 x 4K, 128-row query tiles on 132 SMs: 1024 items, about 8 a block. Taken every
    132nd in turn, heaviest first over 4 heads at a time (the L2 group at 4K), the busiest block gets 1.5x the
    mean work; in mirror pairs, within 4%."""
    def busiest_over_mean(paired: bool) -> float:
        share = causal_share(32, 32, 132, paired, head_group=4)
        work = [sum(t + 1 for t, _ in items) for items in share.values()]
        return max(work) * len(work) / sum(work)

    assert busiest_over_mean(paired=False) > 1.5
    assert busiest_over_mean(paired=True) < 1.04


@pytest.mark.parametrize("form", [dict(persistent=False), dict(persistent=True, dynamic=True),
                                  dict(persistent=True, reverse_order=False)])
def test_paired_order_is_for_a_persistent_fixed_share_only(form):
    with pytest.raises(ValueError, match="paired"):
        Variant(128, 256, paired=True, **form)


def test_a_paired_two_launch_variant_runs_its_diagonal_as_one_block_per_tile():
    diagonal = Variant(128, 256, persistent=True, paired=True, two_launch=True).diagonal()
    assert not (diagonal.persistent or diagonal.paired or diagonal.reverse_order)
