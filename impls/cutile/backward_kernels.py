"""Our FlashAttention-2 backward in cuTile: three kernels over the forward's inputs, output and log-sum-exp, the same
algorithm as ``impls.triton_fa.backward``, and the forward a training step runs before them.

0. ``fwd_lse``: the forward of a training step: ``o`` and the natural-log ``lse`` of each query row (+inf where a
   row sees no key), for the three kernels below to read. One block per TILE_M tile of query rows of one (batch,
   query head), the dense forward's online softmax (``kernel.softmax_step``, log2 units) over the key tiles the
   rows see; the mask only at the causal diagonal and a ragged last key tile, as ``bwd_dq`` walks them.

1. ``bwd_delta``: ``delta = rowsum(do * o)`` per query row, float32 (the softmax Jacobian's row term).
2. ``bwd_dkdv``: one block per TILE_N tile of keys of one (batch, kv head). It walks every query head of the kv
   head's group and their query tiles, so dk and dv sum over the GQA group in registers, with no atomics. Each step
   recomputes the transposed probabilities ``p^T = exp2(k q^T * scale * log2(e) - lse * log2(e))`` and accumulates
   ``dv += p^T do`` and ``dk += ds^T q`` with ``ds^T = p^T * (v do^T - delta)``, in float32. Working on the
   transposed scores puts ``p^T`` and ``ds^T`` where the products take them, as their left operand.
3. ``bwd_dq``: one block per TILE_M tile of query rows of one (batch, query head): it walks the key tiles the rows
   see and accumulates ``dq += ds k``. A kernel of its own rather than float32 atomics from the dk/dv kernel: cuTile's
   ``atomic_add`` updates elements one by one (no bulk reduction of a tile), and a sum in a fixed order gives the same
   dq on every run.

Causal is bottom-right (query row i sees keys j <= i + Skv - Sq); tiles that no row sees are never visited and only
the tiles at the diagonal are masked (and, in ``bwd_dq``, a ragged last key tile). Elsewhere the zeros that loads
read past the arrays' ends are exact: a query row past Sq has q, do and lse 0, so its p is 1 and it adds ``1 * 0``
to dk and dv; a key row past Skv only changes rows of dk and dv that are never stored. A row that sees no key has
lse = +inf, so its p is 0. A head dim that is not a power of two is padded to the next one (zeros read, columns
past it not stored); every tensor is contiguous (B, H, S, D).
"""

from __future__ import annotations

import math

import cuda.tile as ct

from impls.cutile.kernel import (
    INV_LOG_2,
    ZERO_PAD,
    ConstBool,
    ConstInt,
    key_tiles,
    load_rows,
    mask_scores,
    softmax_step,
    store_rows,
    with_int64_indexing,
)

LOG_2 = math.log(2)  # the running max and sum are in log2 units; lse is natural-log: lse = (m + log2(l)) * ln 2


@ct.kernel
def fwd_lse(
    Q, K, V, Out, LSE,
    qk_scale: float,
    causal_offset: int,
    group: int,
    TILE_D: ConstInt, TILE_M: ConstInt, TILE_N: ConstInt, CAUSAL: ConstBool, EVEN_N: ConstBool,
):
    """o and lse of one TILE_M tile of query rows of one (batch, query head); grid: query tiles x query heads x
    batch."""
    tile_m, head, batch = ct.bid(0), ct.bid(1), ct.bid(2)
    kv_head, kv_len, scale_log2, offs_m, q = query_tile(Q, K, batch, head, tile_m, group, qk_scale, TILE_M, TILE_D)
    m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((TILE_M, TILE_D), 0.0, dtype=ct.float32)
    # [0, free_end) seen whole by every row, [free_end, end) at the diagonal or ragged
    _, _, free_end, end = key_tiles(tile_m, kv_len, causal_offset, 0, 0, TILE_M, TILE_N, CAUSAL, False)
    for j in range(free_end):
        acc, l_i, m_i = fold_key_tile(acc, l_i, m_i, q, K, V, batch, kv_head, j, offs_m, scale_log2, kv_len,
                                      causal_offset, TILE_M, TILE_N, TILE_D, CAUSAL, EVEN_N, MASKED=False)
    if CAUSAL or not EVEN_N:  # no masked loop where nothing needs one (the compiler cannot prove it empty)
        for j in range(free_end, end):
            acc, l_i, m_i = fold_key_tile(acc, l_i, m_i, q, K, V, batch, kv_head, j, offs_m, scale_log2, kv_len,
                                          causal_offset, TILE_M, TILE_N, TILE_D, CAUSAL, EVEN_N, MASKED=True)
    seen = l_i > 0.0  # a row that sees no key: o = 0, lse = +inf (its p in the backward is then 0)
    l_safe = ct.where(seen, l_i, 1.0)
    store_rows(Out, (acc / l_safe).astype(Out.dtype), batch, head, tile_m, 0)
    lse = ct.where(seen, (m_i + ct.log2(l_safe)) * LOG_2, math.inf)
    ct.store(LSE, index=(batch, head, tile_m), tile=lse.reshape((1, 1, TILE_M)))


def fold_key_tile(acc, l_i, m_i, q, K, V, batch, kv_head, j, offs_m, scale_log2, kv_len, causal_offset, TILE_M,
                  TILE_N, TILE_D, CAUSAL, EVEN_N, MASKED):
    """Key tile j folded into the running max, sum (log2 units) and unnormalised output. MASKED: keys past a row's
    diagonal or past Skv score -inf, and a row may not have seen any key yet (``kernel.finite``)."""
    k = load_rows(K, batch, kv_head, j, TILE_N, TILE_D, 0, None)
    v = load_rows(V, batch, kv_head, j, TILE_N, TILE_D, 0, None)
    scores = ct.mma(q, ct.transpose(k), ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
    if MASKED:
        scores = mask_scores(scores, offs_m, j, kv_len, causal_offset, 0, 0, TILE_N, CAUSAL, EVEN_N, False)
    p, alpha, l_i, m_i = softmax_step(scores, l_i, m_i, scale_log2, MASKED, True)
    return ct.mma(p.astype(v.dtype), v, acc * alpha), l_i, m_i


@ct.kernel
def bwd_delta(Out, DO, Delta, TILE_D: ConstInt, TILE_M: ConstInt):
    """``delta = rowsum(do * o)`` of TILE_M rows of one (batch, head); grid: query tiles x heads x batch."""
    tile_m, head, batch = ct.bid(0), ct.bid(1), ct.bid(2)
    o = load_rows(Out, batch, head, tile_m, TILE_M, TILE_D, 0, None).astype(ct.float32)
    do = load_rows(DO, batch, head, tile_m, TILE_M, TILE_D, 0, None).astype(ct.float32)
    ct.store(Delta, index=(batch, head, tile_m), tile=ct.sum(o * do, axis=1).reshape((1, 1, TILE_M)))


@ct.kernel
def bwd_dkdv(
    Q, K, V, DO, LSE, Delta, DK, DV,
    qk_scale: float,
    causal_offset: int,
    group: int,
    TILE_D: ConstInt, TILE_M: ConstInt, TILE_N: ConstInt, CAUSAL: ConstBool, LOOP_SPLIT: ConstBool,
):
    """dk and dv of one TILE_N tile of keys of one (batch, kv head); grid: key tiles x kv heads x batch.
    LOOP_SPLIT: causal, the query tiles at the diagonal in a masked loop and the rest in a mask-free one; otherwise
    one loop that masks every tile (one loop body fewer to hold registers for)."""
    tile_n, kv_head, batch = ct.bid(0), ct.bid(1), ct.bid(2)
    num_m = ct.cdiv(Q.shape[2], TILE_M)
    scale_log2 = qk_scale * INV_LOG_2
    offs_n = (tile_n * TILE_N + ct.arange(TILE_N, dtype=ct.int32))[:, None]
    k = load_rows(K, batch, kv_head, tile_n, TILE_N, TILE_D, 0, None)
    v = load_rows(V, batch, kv_head, tile_n, TILE_N, TILE_D, 0, None)
    dk = ct.full((TILE_N, TILE_D), 0.0, dtype=ct.float32)
    dv = ct.full((TILE_N, TILE_D), 0.0, dtype=ct.float32)
    first, free_start = query_tiles(tile_n, num_m, causal_offset, TILE_M, TILE_N, CAUSAL)
    for h in range(group):
        head = kv_head * group + h
        if CAUSAL:  # the query tiles at the diagonal (some rows see part of this key tile), or all of them
            for tile_m in range(first, free_start if LOOP_SPLIT else num_m):
                dk, dv = add_query_tile(dk, dv, k, v, Q, DO, LSE, Delta, batch, head, tile_m, offs_n, scale_log2,
                                        causal_offset, TILE_M, TILE_N, TILE_D, MASKED=True)
        if LOOP_SPLIT or not CAUSAL:  # no mask-free loop at all where it would be empty
            for tile_m in range(free_start, num_m):
                dk, dv = add_query_tile(dk, dv, k, v, Q, DO, LSE, Delta, batch, head, tile_m, offs_n, scale_log2,
                                        causal_offset, TILE_M, TILE_N, TILE_D, MASKED=False)
    store_rows(DK, (dk * qk_scale).astype(DK.dtype), batch, kv_head, tile_n, 0)
    store_rows(DV, dv.astype(DV.dtype), batch, kv_head, tile_n, 0)


def query_tiles(tile_n, num_m, causal_offset, TILE_M, TILE_N, CAUSAL):
    """Query tiles ``[first, num_m)`` whose rows see some key of key tile ``tile_n``, and ``free_start``: from it
    on every row sees the whole key tile. Row i sees key j when j <= i + causal_offset."""
    if not CAUSAL:
        return 0, 0
    start_n = tile_n * TILE_N
    first = max(start_n - causal_offset, 0) // TILE_M  # the first row that sees the tile's first key
    sees_all = max(start_n + TILE_N - 1 - causal_offset, 0)  # the first row that sees its last key
    return first, min(max(ct.cdiv(sees_all, TILE_M), first), num_m)


def add_query_tile(dk, dv, k, v, Q, DO, LSE, Delta, batch, head, tile_m, offs_n, scale_log2, causal_offset, TILE_M,
                   TILE_N, TILE_D, MASKED):
    """dk and dv plus query tile ``tile_m`` of one query head's share, in the transposed (keys x queries) frame."""
    q = load_rows(Q, batch, head, tile_m, TILE_M, TILE_D, 0, None)
    do = load_rows(DO, batch, head, tile_m, TILE_M, TILE_D, 0, None)
    lse_log2 = load_row_values(LSE, batch, head, tile_m, TILE_M).reshape((1, TILE_M)) * INV_LOG_2
    delta = load_row_values(Delta, batch, head, tile_m, TILE_M).reshape((1, TILE_M))
    scores_t = ct.mma(k, ct.transpose(q), ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32))
    if MASKED:
        offs_m = (tile_m * TILE_M + ct.arange(TILE_M, dtype=ct.int32))[None, :]
        scores_t = ct.where(offs_n <= offs_m + causal_offset, scores_t, -math.inf)
    p_t = ct.exp2(scores_t * scale_log2 - lse_log2, flush_to_zero=True)
    dv = ct.mma(p_t.astype(do.dtype), do, dv)
    dp_t = ct.mma(v, ct.transpose(do), ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32))
    ds_t = p_t * (dp_t - delta)
    dk = ct.mma(ds_t.astype(q.dtype), q, dk)
    return dk, dv


@ct.kernel
def bwd_dq(
    Q, K, V, DO, LSE, Delta, DQ,
    qk_scale: float,
    causal_offset: int,
    group: int,
    TILE_D: ConstInt, TILE_M: ConstInt, TILE_N: ConstInt, CAUSAL: ConstBool, EVEN_N: ConstBool,
):
    """dq of one TILE_M tile of query rows of one (batch, query head); grid: query tiles x query heads x batch."""
    tile_m, head, batch = ct.bid(0), ct.bid(1), ct.bid(2)
    kv_head, kv_len, scale_log2, offs_m, q = query_tile(Q, K, batch, head, tile_m, group, qk_scale, TILE_M, TILE_D)
    do = load_rows(DO, batch, head, tile_m, TILE_M, TILE_D, 0, None)
    lse_log2 = load_row_values(LSE, batch, head, tile_m, TILE_M).reshape((TILE_M, 1)) * INV_LOG_2
    delta = load_row_values(Delta, batch, head, tile_m, TILE_M).reshape((TILE_M, 1))
    dq = ct.full((TILE_M, TILE_D), 0.0, dtype=ct.float32)
    # the forward's key tiles: [0, free_end) seen whole by every row, [free_end, end) at the diagonal or ragged
    _, _, free_end, end = key_tiles(tile_m, kv_len, causal_offset, 0, 0, TILE_M, TILE_N, CAUSAL, False)
    for j in range(free_end):
        dq = add_key_tile(dq, q, do, lse_log2, delta, K, V, batch, kv_head, j, offs_m, scale_log2, kv_len,
                          causal_offset, TILE_M, TILE_N, TILE_D, CAUSAL, EVEN_N, MASKED=False)
    if CAUSAL or not EVEN_N:  # no masked loop where nothing needs one (the compiler cannot prove it empty)
        for j in range(free_end, end):
            dq = add_key_tile(dq, q, do, lse_log2, delta, K, V, batch, kv_head, j, offs_m, scale_log2, kv_len,
                              causal_offset, TILE_M, TILE_N, TILE_D, CAUSAL, EVEN_N, MASKED=True)
    store_rows(DQ, (dq * qk_scale).astype(DQ.dtype), batch, head, tile_m, 0)


def add_key_tile(dq, q, do, lse_log2, delta, K, V, batch, kv_head, j, offs_m, scale_log2, kv_len, causal_offset,
                 TILE_M, TILE_N, TILE_D, CAUSAL, EVEN_N, MASKED):
    """dq plus key tile j's share: ``ds k`` with ``ds = p * (do v^T - delta)``. MASKED: keys past a row's
    diagonal or past Skv score -inf (a ragged tile's zeros would otherwise weigh exp2(-lse), which need not be
    small)."""
    k = load_rows(K, batch, kv_head, j, TILE_N, TILE_D, 0, None)
    v = load_rows(V, batch, kv_head, j, TILE_N, TILE_D, 0, None)
    scores = ct.mma(q, ct.transpose(k), ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
    if MASKED:
        scores = mask_scores(scores, offs_m, j, kv_len, causal_offset, 0, 0, TILE_N, CAUSAL, EVEN_N, False)
    p = ct.exp2(scores * scale_log2 - lse_log2, flush_to_zero=True)
    dp = ct.mma(do, ct.transpose(v), ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
    ds = p * (dp - delta)
    return ct.mma(ds.astype(k.dtype), k, dq)


def query_tile(Q, K, batch, head, tile_m, group, qk_scale, TILE_M, TILE_D):
    """What a program over a tile of query rows reads first: its kv head (GQA by index, as the forward), the keys'
    length, the scale in log2 units, the rows' positions and their q tile."""
    kv_head = head // group
    kv_len = K.shape[2]
    scale_log2 = qk_scale * INV_LOG_2
    offs_m = (tile_m * TILE_M + ct.arange(TILE_M, dtype=ct.int32))[:, None]
    return kv_head, kv_len, scale_log2, offs_m, load_rows(Q, batch, head, tile_m, TILE_M, TILE_D, 0, None)


def load_row_values(A, batch, head, tile_m, TILE_M):
    """TILE_M values of a (B, H, S) float32 array (lse, delta), zeros past S, as a (1, 1, TILE_M) tile. Plain loads,
    not TMA, as the forward's state vectors (``kernel.load_state``)."""
    return ct.load(A, index=(batch, head, tile_m), shape=(1, 1, TILE_M), allow_tma=False, padding_mode=ZERO_PAD)


ARRAYS = {"fwd_lse": ("Q", "K", "V", "Out", "LSE"), "bwd_delta": ("Out", "DO", "Delta"),
          "bwd_dkdv": ("Q", "K", "V", "DO", "LSE", "Delta", "DK", "DV"),
          "bwd_dq": ("Q", "K", "V", "DO", "LSE", "Delta", "DQ")}
fwd_lse_int64 = with_int64_indexing(fwd_lse, ARRAYS["fwd_lse"])
bwd_delta_int64 = with_int64_indexing(bwd_delta, ARRAYS["bwd_delta"])
bwd_dkdv_int64 = with_int64_indexing(bwd_dkdv, ARRAYS["bwd_dkdv"])
bwd_dq_int64 = with_int64_indexing(bwd_dq, ARRAYS["bwd_dq"])
