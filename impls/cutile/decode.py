"""Decode over a paged KV cache in cuTile: split-KV (flash-decoding) with GQA packing.

Decode reads each sequence's whole K/V cache once per step and does about 4 FLOPs per byte, so it is bound by
HBM bandwidth (the KV-cache article in the references). The kernel is built to read the cache once, from
enough blocks to keep HBM busy:

1. GQA packing: one block serves all ``GROUP = Hq / Hkv`` query heads of one kv head, times the ``SQ`` new
   tokens: the rows of its Q tile. Every K/V element is loaded once for the whole group.
2. Split-KV: (batch, kv head) pairs alone are too few blocks at small batch (Llama-3-8B at batch 1: 8 for 132
   SMs), so each cache is cut into chunks of ``split_len`` tokens, one block each. A block writes its chunk's
   normalised output and log-sum-exp; ``paged_decode_combine`` merges a row's chunks, weighting each by
   ``2^(lse - max lse)``. With one chunk per sequence the split kernel writes the output itself.
3. Pages: position ``p`` of sequence ``b`` lives in slot ``p % PAGE_SIZE`` of page
   ``block_table[b, p // PAGE_SIZE]``. Two ways to read a key tile (GATHER):
   - ``ROWS``: gather the tile element-wise through the table; any page size, positions past the sequence
     are not loaded at all (they read zeros);
   - ``PAGES``: a tile lies within one page (PAGE_SIZE a multiple of TILE_N), so it is one block load
     (TMA on Hopper) at the page the table names; the last tile of a sequence is masked after loading, so
     whatever the slots past the end hold (NaN included) never reaches the output.

Causal within each sequence, bottom-right: new token ``t`` of ``SQ`` sees positions ``<= L - SQ + t``.
Query row ``r`` of a tile is query head ``kv_head * GROUP + r // SQ``, new token ``r % SQ``.
"""

from __future__ import annotations

import math

import cuda.tile as ct

from impls.cutile.kernel import INV_LOG_2, ConstBool, ConstInt, finite, softmax_step, with_int64_indexing

ROWS, PAGES = 0, 1  # GATHER: how a key tile is read from the pages (module docstring)


@ct.kernel
def paged_decode_split(
    Q, KCache, VCache, BlockTable, CacheSeqlens, OutPart, LsePart, Out,
    qk_scale: float, num_kv_heads: int, split_len: int,
    GROUP: ConstInt, SQ: ConstInt, TILE_M: ConstInt, TILE_N: ConstInt, TILE_D: ConstInt, PAGE_SIZE: ConstInt,
    GATHER: ConstInt, SPLIT: ConstBool, K_LATENCY: ConstInt, V_LATENCY: ConstInt,
):
    """Block (chunk, batch * kv head): the GROUP x SQ query rows over one chunk of the cache. SPLIT: write
    the chunk's normalised output (B * Hkv, chunks, TILE_M, TILE_D) and log-sum-exp (B * Hkv, chunks,
    TILE_M) float32; otherwise (one chunk per sequence) the output rows themselves."""
    chunk = ct.bid(0)
    batch_kv = ct.bid(1)
    batch = batch_kv // num_kv_heads
    kv_head = batch_kv % num_kv_heads
    seq_len = ct.gather(CacheSeqlens, batch).item()

    rows = ct.arange(TILE_M, dtype=ct.int32)[:, None]
    token = rows % SQ
    head = kv_head * GROUP + rows // SQ
    real_row = rows < GROUP * SQ
    dims = ct.arange(TILE_D, dtype=ct.int32)
    q = ct.gather(Q, (batch, token, head, dims[None, :]), mask=real_row)  # dims past D read zeros
    last_visible = seq_len - SQ + token  # (TILE_M, 1): causal, bottom-right within the sequence

    m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((TILE_M, TILE_D), 0.0, dtype=ct.float32)
    score_scale_log2 = qk_scale * INV_LOG_2
    first = chunk * (split_len // TILE_N)  # split_len is whole tiles
    end = min(first + split_len // TILE_N, ct.cdiv(seq_len, TILE_N))
    # Tiles every new token sees whole (their last position <= L - SQ) need no mask; the rest are masked.
    whole = max(first, min(end, (seq_len - SQ + 1) // TILE_N))
    for j in range(first, whole):
        k, v = key_tile(KCache, VCache, BlockTable, batch, kv_head, j, seq_len, dims, TILE_N, TILE_D,
                        PAGE_SIZE, GATHER, False, K_LATENCY, V_LATENCY)
        acc, l_i, m_i = fold(acc, l_i, m_i, ct.mma(q, k, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32)), v,
                             score_scale_log2, False)
    for j in range(whole, end):
        k, v = key_tile(KCache, VCache, BlockTable, batch, kv_head, j, seq_len, dims, TILE_N, TILE_D,
                        PAGE_SIZE, GATHER, True, K_LATENCY, V_LATENCY)
        qk = ct.mma(q, k, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
        positions = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[None, :]
        qk = ct.where(positions <= last_visible, qk, -math.inf)  # also hides positions past the sequence
        acc, l_i, m_i = fold(acc, l_i, m_i, qk, v, score_scale_log2, True)

    l_safe = ct.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key in this chunk: output 0, weight 0
    acc = ct.truediv(acc, l_safe)
    if SPLIT:
        lse = ct.where(l_i == 0.0, -math.inf, m_i + ct.log2(l_safe))
        ct.store(OutPart, index=(batch_kv, chunk, 0, 0), tile=acc.reshape((1, 1, TILE_M, TILE_D)))
        ct.store(LsePart, index=(batch_kv, chunk, 0), tile=lse.reshape((1, 1, TILE_M)))
    else:
        ct.scatter(Out, (batch, token, head, dims[None, :]), acc.astype(Out.dtype), mask=real_row)


def key_tile(KCache, VCache, BlockTable, batch, kv_head, j, seq_len, dims, TILE_N, TILE_D, PAGE_SIZE, GATHER,
             MASKED, K_LATENCY, V_LATENCY):
    """Key tile j of a sequence: K as (TILE_D, TILE_N) for Q K^T, V as (TILE_N, TILE_D); positions past the
    sequence are zeros in V (where MASKED), so that P V never multiplies what an unused slot holds."""
    if GATHER == PAGES:
        page = ct.gather(BlockTable, (batch, j * TILE_N // PAGE_SIZE)).item()
        in_page = j % (PAGE_SIZE // TILE_N)  # the tile's index within its page
        k = ct.load(KCache, index=(page, 0, kv_head, in_page), shape=(1, TILE_D, 1, TILE_N), order=(0, 3, 2, 1),
                    latency=K_LATENCY, padding_mode=ct.PaddingMode.ZERO).reshape((TILE_D, TILE_N))
        v = ct.load(VCache, index=(page, in_page, kv_head, 0), shape=(1, TILE_N, 1, TILE_D),
                    latency=V_LATENCY, padding_mode=ct.PaddingMode.ZERO).reshape((TILE_N, TILE_D))
        if MASKED:
            positions = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[:, None]
            v = ct.where(positions < seq_len, v, 0.0)  # an unused slot may hold NaN, and 0 * NaN is NaN
    else:
        positions = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)
        in_seq = positions < seq_len
        page = ct.gather(BlockTable, (batch, positions // PAGE_SIZE), mask=in_seq)
        slot = positions % PAGE_SIZE
        k = ct.gather(KCache, (page[None, :], slot[None, :], kv_head, dims[:, None]), mask=in_seq[None, :],
                      latency=K_LATENCY)
        v = ct.gather(VCache, (page[:, None], slot[:, None], kv_head, dims[None, :]), mask=in_seq[:, None],
                      latency=V_LATENCY)
    return k, v


def fold(acc, l_i, m_i, qk, v, score_scale_log2, MAY_BE_EMPTY):
    """The dense kernel's online softmax step (kernel.softmax_step) on a tile already loaded, then P V."""
    p, alpha, l_i, m_new = softmax_step(qk, l_i, m_i, score_scale_log2, MAY_BE_EMPTY, True)
    return ct.mma(p.astype(v.dtype), v, acc * alpha), l_i, m_new


@ct.kernel
def paged_decode_combine(
    OutPart, LsePart, CacheSeqlens, Out,
    num_kv_heads: int, split_len: int,
    GROUP: ConstInt, SQ: ConstInt, TILE_M: ConstInt, TILE_D: ConstInt, PART_LATENCY: ConstInt,
):
    """Block (batch * kv head): merge the chunks of every row by log-sum-exp and write the rows to ``Out``.
    Only the chunks that hold keys of this sequence are read (a short sequence of a long-tailed batch has
    few)."""
    batch_kv = ct.bid(0)
    batch = batch_kv // num_kv_heads
    kv_head = batch_kv % num_kv_heads
    seq_len = ct.gather(CacheSeqlens, batch).item()
    used = min(ct.cdiv(seq_len, split_len), OutPart.shape[1])

    m = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    total = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((TILE_M, TILE_D), 0.0, dtype=ct.float32)
    for chunk in range(used):  # the same running-max merge as the softmax, one chunk at a time
        lse = ct.load(LsePart, index=(batch_kv, chunk, 0), shape=(1, 1, TILE_M),
                      latency=PART_LATENCY).reshape((TILE_M, 1))
        part = ct.load(OutPart, index=(batch_kv, chunk, 0, 0), shape=(1, 1, TILE_M, TILE_D),
                       latency=PART_LATENCY).reshape((TILE_M, TILE_D))
        m_new = ct.maximum(m, lse)
        m_ref = finite(m_new, True)  # a row may have seen no key in the chunks so far (several new tokens)
        alpha = ct.exp2(m - m_ref)
        weight = ct.exp2(lse - m_ref)
        acc = acc * alpha + part * weight
        total = total * alpha + weight
        m = m_new

    rows = ct.arange(TILE_M, dtype=ct.int32)[:, None]
    dims = ct.arange(TILE_D, dtype=ct.int32)[None, :]
    out = ct.truediv(acc, ct.where(total == 0.0, 1.0, total)).astype(Out.dtype)
    ct.scatter(Out, (batch, rows % SQ, kv_head * GROUP + rows // SQ, dims), out, mask=rows < GROUP * SQ)


# A cache of 2**31 elements or more (64 sequences of 32K tokens, 8 kv heads of 128) needs 64-bit offsets.
paged_decode_split_int64 = with_int64_indexing(paged_decode_split, ("KCache", "VCache"))
