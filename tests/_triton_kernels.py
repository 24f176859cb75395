"""Small Triton kernels that run one helper of our kernels on its own (compiled on a GPU, interpreted on CPU)."""

import triton
import triton.language as tl

from impls.triton_fa.decode import interleave_columns


@triton.jit
def spread_words(Out, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """``interleave_columns`` of four tiles that hold each word's four column numbers (row-major): ``Out`` then
    reads 0, 1, 2, ... where the columns land in order."""
    rows, words = tl.arange(0, ROWS)[:, None], tl.arange(0, WORDS)[None, :]
    first = rows * (4 * WORDS) + words * 4
    tiles = interleave_columns(first, first + 1, first + 2, first + 3)
    tl.store(Out + rows * (4 * WORDS) + tl.arange(0, 4 * WORDS)[None, :], tiles)
