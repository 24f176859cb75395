"""The cuTile kernel's key-tile ranges (``kernel.key_tiles``) against the reference mask, on the CPU.

The kernel cannot run without a GPU, but the arithmetic that decides which key tiles a query tile visits, and
which of them run without a mask, is plain integer code: a tile left out loses keys a row must see, a tile
wrongly taken as mask-free lets a row see keys it must not. Both are checked here for every query tile of
causal, windowed and ragged shapes, Sq != Skv both ways.
"""

import itertools
import os

import pytest

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from impls._reference import visible
from impls._validate import NO_WINDOW, window_bounds
from impls.cutile.kernel import key_tiles

SHAPES = [(300, 300), (333, 1000), (200, 130), (97, 97), (256, 256), (64, 700)]
WINDOWS = [NO_WINDOW, (0, 0), (16, 0), (100, 37), (128, -1), (-1, 50), (1000, 1000)]
TILES = [(64, 64), (128, 64), (64, 128), (128, 128)]


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
