"""Mixed prefill and decode over a paged KV cache in cuTile (``impls.contract.MixedBatch``), launched and registered as
``cutile``'s ``mixed`` entry by ``mixed_serving.py``: the design of the Triton kernel (``impls/triton_fa/mixed.py``)
in the paged decode's cuTile forms (``decode.py``). One launch serves the whole step:

1. A work list, built on the host when the call is prepared (``impls._plans.mixed_work_list``, the Triton kernel's):
   one item per tile of ``TOKENS`` new tokens of a sequence, ``(sequence, first new token)``, those that read the
   most keys first. A decoding sequence is one item, a chunk of 4096 tokens hundreds. One block per (item, kv head),
   kv heads adjacent on one grid axis, so that the blocks start in the list's order, longest first, across the kv
   heads too (a grid (item, kv head) starts every item of kv head 0 before the first of kv head 1).
2. GQA packing: row ``r`` of a tile is new token ``first + r // GROUP`` of query head ``kv_head * GROUP + r % GROUP``,
   so each K/V tile read serves every query head of the kv head, for a decode row as for a prefill tile.
3. The key loop is the paged decode's: key tiles read through the block table as the decode reads them
   (``decode.key_tile``: block loads of the pages, or row gathers), the tiles every row sees whole without a mask
   (``decode.whole_fold``), then those up to the tile's last new token masked (``decode.masked_fold``), which also
   zeroes V past the sequence so that an unused slot's NaN never reaches P V.

Causal within each sequence, bottom-right: new token ``t`` of ``q_len`` sees positions ``<= L - q_len + t``. No
split-KV: a decoding sequence is one block per kv head over its whole cache (docs/design.md#mixed-batches).
"""

from __future__ import annotations

import math

import cuda.tile as ct

from impls.cutile.decode import masked_fold, whole_fold
from impls.cutile.kernel import ConstInt, score_scale, with_int64_indexing

NO_SOFTCAP, NO_WINDOW_LEFT = 0.0, 0  # the decode helpers' model variants, off: a mixed step has neither


@ct.kernel
def mixed_attention(
    Q, KCache, VCache, BlockTable, CacheSeqlens, CuSeqlensQ, Work, Out, qk_scale: float, num_kv_heads: int,
    GROUP: ConstInt, TOKENS: ConstInt, TILE_M: ConstInt, TILE_N: ConstInt, TILE_D: ConstInt, PAGE_SIZE: ConstInt,
    GATHER: ConstInt, K_LATENCY: ConstInt, V_LATENCY: ConstInt,
):
    """Block ``item * num_kv_heads + kv_head``: the TOKENS x GROUP query rows of one tile of a sequence's new tokens
    over its cache. ``Work`` (items, 2) holds each item's sequence and first new token; Q and Out are packed
    (total_q, Hq, D)."""
    item = ct.bid(0) // num_kv_heads
    kv_head = ct.bid(0) % num_kv_heads
    seq = ct.gather(Work, (item, 0)).item()
    first = ct.gather(Work, (item, 1)).item()  # the tile's first new token
    q_start = ct.gather(CuSeqlensQ, seq).item()
    q_len = ct.gather(CuSeqlensQ, seq + 1).item() - q_start
    seq_len = ct.gather(CacheSeqlens, seq).item()
    past = seq_len - q_len  # positions cached before this step's new tokens

    rows = ct.arange(TILE_M, dtype=ct.int32)[:, None]
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    real_row = (rows < TOKENS * GROUP) & (token < q_len)
    dims = ct.arange(TILE_D, dtype=ct.int32)
    q = ct.gather(Q, (q_start + token, head, dims[None, :]), mask=real_row)  # dims past D read zeros
    last_visible = ct.where(real_row, past + token, -1)  # (TILE_M, 1): padding rows see nothing masked

    m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((TILE_M, TILE_D), 0.0, dtype=ct.float32)
    score_scale_log2 = score_scale(qk_scale, NO_SOFTCAP)
    end = ct.cdiv(past + min(first + TOKENS, q_len), TILE_N)  # through the tile's last new token
    whole = (past + first + 1) // TILE_N  # tiles up to the first token's position: every row sees them whole
    for j in range(whole):
        acc, l_i, m_i = whole_fold(q, None, acc, l_i, m_i, KCache, VCache, BlockTable, seq, kv_head, j, seq_len, dims,
                                   qk_scale, score_scale_log2, TILE_M, TILE_N, TILE_D, PAGE_SIZE, GATHER, K_LATENCY,
                                   V_LATENCY, NO_SOFTCAP)
    for j in range(whole, end):
        acc, l_i, m_i = masked_fold(q, None, acc, l_i, m_i, KCache, VCache, BlockTable, seq, kv_head, j, seq_len,
                                    last_visible, NO_WINDOW_LEFT, dims, qk_scale, score_scale_log2, TILE_M, TILE_N,
                                    TILE_D, PAGE_SIZE, GATHER, K_LATENCY, V_LATENCY, False, NO_SOFTCAP)

    out = ct.truediv(acc, l_i)  # every real row saw its own position; padding rows, never stored, may divide by 0
    ct.scatter(Out, (q_start + token, head, dims[None, :]), out.astype(Out.dtype), mask=real_row)


# A cache of 2**31 elements or more needs 64-bit offsets where it cannot be read through word views (decode.py).
mixed_attention_int64 = with_int64_indexing(mixed_attention, ("KCache", "VCache"))
