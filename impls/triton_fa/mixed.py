"""Mixed prefill and decode over a paged KV cache in Triton: one launch for a whole serving step (and a combine after
it where a step too small for the GPU splits its decoding rows).

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
4. Split-KV for the decoding rows where the step's programs are too few for the GPU (the 70B slice's 64 decoding
   sequences: 64 programs on 132 SMs; ``impls._plans.mixed_split_plan``): each decoding sequence's item becomes one
   per chunk of the paged decode's split plan, each chunk's normalised output and log-sum-exp go to the partials
   (the paged decode's ``store_partials``), and the paged decode's combine, launched after the kernel, merges them
   into the output rows. Prefill tiles are never split; a step with enough programs is one launch (see
   docs/design.md#mixed-batches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from impls._plans import combine_plan, decoding, mixed_split_plan, mixed_work
from impls._registry import FLOATS, Prepared, register
from impls.contract import UNBOUNDED
from impls.triton_fa.config import HEAD_DIMS, block_d, interpreting, requires
from impls.triton_fa.decode import _decode_tiles, paged_decode_combine, store_output, store_partials
from impls.triton_fa.kernel import LOG2_E
from impls.triton_fa.paged import INTERPRETER_SM_COUNT

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
    Q, K_cache, V_cache, block_table, cache_seqlens, cu_seqlens_q, work, Out, O_part, LSE_part, qk_scale,
    num_kv_heads, num_splits, split_len,
    stride_w, stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    stride_pb, stride_ps, stride_pr,  # O_part (decoding sequences * Hkv, splits, GROUP, D)
    GROUP: tl.constexpr, TOKENS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    SPLIT: tl.constexpr = False,
):
    """Program (work item, kv head), on one axis with the kv head fastest: the GROUP x TOKENS rows of one tile of a
    sequence's new tokens over its cache. SPLIT: the work list's items are ``mixed_split_work_list``'s, and a
    decoding sequence's chunk (slot >= 0) reads keys [chunk * split_len, + split_len) and leaves its partials to the
    combine."""
    item = tl.program_id(0) // num_kv_heads
    kv_head = (tl.program_id(0) % num_kv_heads).to(tl.int64)
    entry = work + item * stride_w
    seq = tl.load(entry).to(tl.int64)
    first = tl.load(entry + 1)  # the tile's first new token
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    seq_len = tl.load(cache_seqlens + seq)
    past = seq_len - q_len  # positions cached before this step's new tokens
    end = past + tl.minimum(first + TOKENS, q_len)  # one past the tile's last new token
    chunk = 0
    slot = -1  # where a decoding sequence's chunk leaves its partials; -1: a prefill tile, or nothing split
    if SPLIT:
        chunk = tl.load(entry + 2)
        slot = tl.load(entry + 3)
    lo = chunk * split_len
    if SPLIT:
        end = tl.where(slot >= 0, tl.minimum(end, lo + split_len), end)

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
    # Whole key tiles up to the first token's position: every row sees them, no mask (a chunk starts on a tile).
    free_end = lo + tl.maximum(tl.minimum(end, past + first + 1) - lo, 0) // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _decode_tiles(
        q, acc, l_i, m_i, K_cache, V_cache, table_row, kv_head, lo, free_end, end, last_visible, 0, qk_scale,
        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_FP32, False, False, 0.0, False, False)
    acc, l_i, m_i = _decode_tiles(
        q, acc, l_i, m_i, K_cache, V_cache, table_row, kv_head, free_end, end, end, last_visible, 0, qk_scale,
        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_FP32, True, False, 0.0, False, False)
    if slot >= 0:  # the partials' row: (decoding sequence, kv head), as the paged decode's combine reads them
        bk = slot * num_kv_heads + kv_head
        store_partials(acc, l_i, m_i, O_part + bk * stride_pb + chunk * stride_ps, stride_pr, offs_d,
                       LSE_part + (bk * num_splits + chunk) * GROUP, rows, row_valid)
    else:
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


def mixed_launch(inputs, scale: float, sm_count: int | None = None):
    """The step's launches, the timed call and its config: the kernel, then, where the decoding rows are split
    (``mixed_split_plan`` for ``sm_count`` SMs, by default the GPU's), the paged decode's combine."""
    q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
    hq, head_dim = q.shape[1:]
    hkv = k_cache.shape[2]
    group = hq // hkv
    interp = interpreting()
    block_m, block_n, num_warps = tiles(group, head_dim, interp)
    tokens = block_m // group
    if sm_count is None:
        sm_count = INTERPRETER_SM_COUNT if interp else torch.cuda.get_device_properties(q.device).multi_processor_count
    num_splits, split_len = mixed_split_plan(inputs.seqlens_q(), inputs.seqlens, hkv, tokens, block_n, sm_count,
                                             min_tiles=1 if interp else None)
    work = mixed_work(inputs, tokens, split_len)
    out = inputs.output_like()
    width = block_d(head_dim)
    slots = decoding(inputs.seqlens_q())
    parts = (len(slots) * hkv, num_splits, group) if split_len else (1, 1, 1)
    o_part = torch.empty(*parts, width, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(parts, dtype=torch.float32, device=q.device)
    args = (q, k_cache, v_cache, inputs.block_table, inputs.cache_seqlens, inputs.cu_seqlens_q, work, out, o_part,
            lse_part, scale * LOG2_E, hkv, num_splits, split_len, work.stride(0), *q.stride()[:2],
            *k_cache.stride()[:3], *v_cache.stride()[:3], inputs.block_table.stride(0), *out.stride()[:2],
            *o_part.stride()[:3])
    meta = {"GROUP": group, "TOKENS": tokens, "PAGE_SIZE": inputs.page_size, "HEAD_DIM": head_dim,
            "BLOCK_D": width, "BLOCK_M": block_m, "BLOCK_N": block_n, "DOT_FP32": interp or q.dtype == torch.float32,
            "SPLIT": bool(split_len), "num_warps": num_warps, "num_stages": NUM_STAGES}
    launches = [(mixed_attention, (work.shape[0] * hkv,), args, meta)]
    if split_len:  # each decoding sequence's chunks merged into its one output row
        index = torch.tensor(slots, device=q.device)
        tile_d, chunks = combine_plan(num_splits, width)
        combine_args = (o_part, lse_part, inputs.cache_seqlens[index], out, *o_part.stride()[:3], out.stride(0), 0,
                        out.stride(1), hkv, num_splits, split_len, UNBOUNDED)
        combine_meta = {"GROUP": group, "SQ": 1, "BLOCK_M": group, "MAX_SPLITS": triton.next_power_of_2(num_splits),
                        "SPLIT_CHUNK": chunks, "BLOCK_D": tile_d, "HEAD_DIM": head_dim,
                        "Out_rows": inputs.cu_seqlens_q[index]}
        launches.append((paged_decode_combine, (len(slots) * hkv, group, width // tile_d), combine_args, combine_meta))

    def run() -> torch.Tensor:
        for kernel, grid, kernel_args, kernel_meta in launches:
            kernel[grid](*kernel_args, **kernel_meta)
        return out

    return run, {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "tokens_per_tile": tokens,
                 "work_items": work.shape[0], "num_splits": num_splits, "split_len": split_len}


@register("triton", op="mixed", family="triton", dtypes=FLOATS, head_dims=HEAD_DIMS, requires=requires,
          description="our mixed-batch kernel: one launch for decoding sequences and prefill chunks, a program per "
                      "(tile of a sequence's new tokens, kv head) from a host-built work list, query heads of a kv "
                      "head packed in one tile, pages gathered through the block table; a step of too few programs "
                      "splits its decoding rows' caches and merges them by log-sum-exp; fixed tiles")
def prepare_mixed(inputs, *, scale: float) -> Prepared:
    run, config = mixed_launch(inputs, scale)
    run()  # compile outside any timed region
    return Prepared(run, config=config)
