"""Mixed prefill and decode over a paged KV cache in Triton: one launch for a whole serving step.

A server's step holds sequences that decode (one new token) beside prefill chunks (hundreds to thousands of new
tokens), all over the same paged cache (``impls.contract.MixedBatch``). One kernel serves them all:

1. A work list, built on the host when the call is prepared (as a server builds its step's metadata;
   ``impls._plans.mixed_work_list``, the cuTile kernel's too): one item per tile of ``TOKENS`` new tokens of a
   sequence, ``(sequence, first new token)``. A decoding sequence is one item, a chunk of 4096 tokens hundreds. One
   program per (item, kv head), the kv head fastest (blocks start in index order), and items ordered by the keys
   they read, longest first: the long items of every kv head start in the first wave and the short ones fill in
   behind them. With the item fastest instead, the last kv heads' long items started after every item of the first.
2. GQA packing: a tile's BLOCK_M rows are ``TOKENS`` new tokens times the ``GROUP = Hq / Hkv`` query heads of its kv
   head (row r: token r // GROUP, head r % GROUP), so each K/V tile read serves every query head of its group, for a
   decode row as for a prefill tile.
3. The key loop is the paged decode's (``decode._decode_tiles``): pages gathered through the block table, the keys
   every row of the tile sees without a mask, then the tiles up to the tile's last new token masked causally
   (bottom-right within the sequence: token t of q_len sees positions <= L - q_len + t).

No split-KV and no second launch: with a decoding sequence one program per kv head reads its whole cache, which
keeps a step of many decoding sequences busy but leaves a step of few long ones short of programs (the paged
decode's split plan is the answer there; see docs/design.md#mixed-batches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from impls._plans import mixed_work
from impls._registry import FLOATS, Prepared, register
from impls.triton_fa.config import HEAD_DIMS, block_d, interpreting, requires
from impls.triton_fa.decode import _decode_tiles, store_output
from impls.triton_fa.kernel import LOG2_E

# Fixed tiles, no tuner. 64 packed rows is the dense kernel's query tile at 4 warps (16 rows a warp): a prefill tile
# keeps its arithmetic intensity, and a decode row wastes at most 64 - GROUP rows of a dot whose cost hides behind
# reading its K/V. Keys 64 at a time up to D 128; at D 256 32 keys over 8 warps (the fp32 accumulator alone is 128
# registers a thread over 4: compiled for sm_90 that spilled, 8 warps did not; python -m impls.triton_fa.aot --mixed).
BLOCK_M = 64
KEY_TILE = {128: (64, 4), 256: (32, 8)}  # BLOCK_D -> (BLOCK_N, warps)
NUM_STAGES = 2
ROWS_PER_WARP = 16
# The interpreter's tiles: small enough that the CPU cases cross several query and key tiles and page boundaries.
INTERPRETER_BLOCK_M, INTERPRETER_BLOCK_N = 16, 16


@triton.jit
def mixed_attention(
    Q, K_cache, V_cache, block_table, cache_seqlens, cu_seqlens_q, work, Out, qk_scale, num_kv_heads,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Program (work item, kv head), on one axis with the kv head fastest: the GROUP x TOKENS rows of one tile of a
    sequence's new tokens over its cache."""
    item = tl.program_id(0) // num_kv_heads
    kv_head = (tl.program_id(0) % num_kv_heads).to(tl.int64)
    seq = tl.load(work + 2 * item).to(tl.int64)
    first = tl.load(work + 2 * item + 1)  # the tile's first new token
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    seq_len = tl.load(cache_seqlens + seq)
    past = seq_len - q_len  # positions cached before this step's new tokens

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < TOKENS * GROUP) & (token < q_len)
    offs_d = tl.arange(0, BLOCK_D)  # the head dim, or the power of two above it (padded with zeros)
    in_dims = offs_d < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & in_dims[None, :], other=0.0)
    if DOT_FP32:  # Triton's interpreter computes half-precision dots wrongly
        q = q.to(tl.float32)
    last_visible = tl.where(row_valid, past + token, -1)  # causal, bottom-right; padding rows see nothing

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = block_table + seq * stride_bt
    end = past + tl.minimum(first + TOKENS, q_len)  # one past the tile's last new token
    # Whole key tiles up to the first token's position: every row sees them, no mask.
    free_end = (past + first + 1) // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _decode_tiles(
        q, acc, l_i, m_i, K_cache, V_cache, table_row, kv_head, 0, free_end, end, last_visible, 0, qk_scale,
        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_FP32, False, False, 0.0, False, False)
    acc, l_i, m_i = _decode_tiles(
        q, acc, l_i, m_i, K_cache, V_cache, table_row, kv_head, free_end, end, end, last_visible, 0, qk_scale,
        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_FP32, True, False, 0.0, False, False)
    store_output(acc, l_i, Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 row_valid, in_dims)


def tiles(group: int, head_dim: int, interp: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps): the rules above; a group wider than BLOCK_M takes a tile of its own power of two, so
    that a decode row's query heads share one tile, and a warp per ROWS_PER_WARP of its rows (a 128-row tile over 4
    warps spilled 264 B on sm_90)."""
    if interp:
        block_m, (block_n, warps) = INTERPRETER_BLOCK_M, (INTERPRETER_BLOCK_N, 4)
    else:
        block_m, (block_n, warps) = BLOCK_M, KEY_TILE[max(block_d(head_dim), 128)]
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, block_n, max(warps, block_m // ROWS_PER_WARP)


def mixed_launch(inputs, scale: float):
    """The step's one launch: the timed call and its config."""
    q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
    hq, head_dim = q.shape[1:]
    hkv = k_cache.shape[2]
    group = hq // hkv
    interp = interpreting()
    block_m, block_n, num_warps = tiles(group, head_dim, interp)
    tokens = block_m // group
    work = mixed_work(inputs, tokens)
    out = inputs.output_like()
    args = (q, k_cache, v_cache, inputs.block_table, inputs.cache_seqlens, inputs.cu_seqlens_q, work, out,
            scale * LOG2_E, hkv, *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
            inputs.block_table.stride(0), *out.stride()[:2])
    meta = {"GROUP": group, "TOKENS": tokens, "PAGE_SIZE": inputs.page_size, "HEAD_DIM": head_dim,
            "BLOCK_D": block_d(head_dim), "BLOCK_M": block_m, "BLOCK_N": block_n,
            "DOT_FP32": interp or q.dtype == torch.float32, "num_warps": num_warps, "num_stages": NUM_STAGES}
    grid = (work.shape[0] * hkv,)

    def run() -> torch.Tensor:
        mixed_attention[grid](*args, **meta)
        return out

    return run, {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "tokens_per_tile": tokens,
                 "work_items": work.shape[0]}


@register("triton", op="mixed", family="triton", dtypes=FLOATS, head_dims=HEAD_DIMS, requires=requires,
          description="our mixed-batch kernel: one launch for decoding sequences and prefill chunks, a program per "
                      "(tile of a sequence's new tokens, kv head) from a host-built work list, query heads of a kv "
                      "head packed in one tile, pages gathered through the block table; fixed tiles")
def prepare_mixed(inputs, *, scale: float) -> Prepared:
    run, config = mixed_launch(inputs, scale)
    run()  # compile outside any timed region
    return Prepared(run, config=config)
