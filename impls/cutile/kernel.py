"""FlashAttention forward in cuTile (``cuda.tile``), after NVIDIA's "Tuning Flash Attention in CUDA Tile".

One block computes one TILE_M tile of query rows of one (batch, query head): it loads that Q tile once,
streams the K/V tiles of the matching kv head (GQA by index) through an online softmax in base 2, and
normalises the float32 accumulator once at the end.

Every step of the blog's optimisation ladder is a compile-time switch of this one kernel:
- FAST_MATH:     exp2 with denormals flushed to zero, approximate final division;
- LOOP_SPLIT:    key tiles that every query row sees run without any mask; only the tiles at the causal
                 diagonal and the ragged end of Skv are masked (otherwise every tile is masked);
- REVERSE_ORDER: causal blocks run heaviest first (last query tile first), which evens out the last wave;
- tile shape:    TILE_M x TILE_N; occupancy, num_ctas and num_worker_warps are compiler hints set at launch;
- latencies:     how far ahead K and V loads are issued (the blog uses 2 for K, needed first in an iteration,
                 and 4 for V, needed only after the softmax);
- LAZY_RESCALE:  not in the blog (FlashAttention-4's trick): keep a stale running max, and rescale the
                 accumulator only in iterations where some row's max grew by more than RESCALE_THRESHOLD;
- PIPELINE_QK:   not in the blog (FlashAttention-3's overlap): in the unmasked loop, issue the next tile's
                 Q K^T before this tile's softmax. Both measured on an H200: see docs/.

Conventions (the suite's contract): causal is aligned bottom-right, i.e. query row i sees keys
j <= i + causal_offset with causal_offset = Skv - Sq (the blog's ``input_pos``); a row that sees no key
is written as zeros.
"""

from __future__ import annotations

import math
import types

import cuda.tile as ct

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

INV_LOG_2 = 1.0 / math.log(2)  # exp(x) == exp2(x * INV_LOG_2)
ZERO_PAD = ct.PaddingMode.ZERO  # ragged K/V tiles read zeros (0 * garbage could be NaN)
# LAZY_RESCALE: how far (log2 units) a row max may pass the stale reference before the accumulator is
# rescaled. p then stays below 2**8, which fp32 (l, acc) and the fp16/bf16 copy of P hold exactly as well.
RESCALE_THRESHOLD = 8.0


def attend_tiles(acc, l_i, m_i, q, K, V, batch, kv_head, offs_m, lo, hi, kv_len, causal_offset,
                 qk_scale_log2, TILE_M, TILE_N, TILE_D, MASKED, CAUSAL, EVEN_N, FAST_MATH, LAZY_RESCALE,
                 K_LATENCY, V_LATENCY, PIPELINE_QK):
    """Online softmax over key tiles [lo, hi); masks only when MASKED.

    ``m_i`` is the reference max (log2 units) the tile's scores are exponentiated against. It is -inf for a
    row that has seen no key yet; ``finite`` replaces that by 0 wherever it is subtracted (-inf - -inf is NaN).
    """
    if PIPELINE_QK and not MASKED:
        # Software pipelining (FlashAttention-3's intra-warpgroup overlap): the next tile's Q K^T is issued
        # before this tile's softmax, so the tensor cores work while the softmax runs.
        if lo < hi:
            qk = scores(q, K, batch, kv_head, lo, TILE_M, TILE_N, TILE_D, K_LATENCY)
            for j in range(lo, hi - 1):
                qk_next = scores(q, K, batch, kv_head, j + 1, TILE_M, TILE_N, TILE_D, K_LATENCY)
                acc, l_i, m_i = online_softmax(acc, l_i, m_i, qk, q, V, batch, kv_head, offs_m, j, kv_len,
                                               causal_offset, qk_scale_log2, TILE_N, TILE_D, MASKED, CAUSAL,
                                               EVEN_N, FAST_MATH, LAZY_RESCALE, V_LATENCY)
                qk = qk_next
            acc, l_i, m_i = online_softmax(acc, l_i, m_i, qk, q, V, batch, kv_head, offs_m, hi - 1, kv_len,
                                           causal_offset, qk_scale_log2, TILE_N, TILE_D, MASKED, CAUSAL,
                                           EVEN_N, FAST_MATH, LAZY_RESCALE, V_LATENCY)
    else:
        for j in range(lo, hi):
            qk = scores(q, K, batch, kv_head, j, TILE_M, TILE_N, TILE_D, K_LATENCY)
            acc, l_i, m_i = online_softmax(acc, l_i, m_i, qk, q, V, batch, kv_head, offs_m, j, kv_len,
                                           causal_offset, qk_scale_log2, TILE_N, TILE_D, MASKED, CAUSAL,
                                           EVEN_N, FAST_MATH, LAZY_RESCALE, V_LATENCY)
    return acc, l_i, m_i


def scores(q, K, batch, kv_head, j, TILE_M, TILE_N, TILE_D, K_LATENCY):
    """Q K^T for key tile j, in float32. K is loaded transposed through the load's dimension order."""
    k = ct.load(K, index=(batch, kv_head, 0, j), shape=(1, 1, TILE_D, TILE_N), order=(0, 1, 3, 2),
                latency=K_LATENCY, padding_mode=ZERO_PAD).reshape((TILE_D, TILE_N))
    return ct.mma(q, k, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))


def online_softmax(acc, l_i, m_i, qk, q, V, batch, kv_head, offs_m, j, kv_len, causal_offset, qk_scale_log2,
                   TILE_N, TILE_D, MASKED, CAUSAL, EVEN_N, FAST_MATH, LAZY_RESCALE, V_LATENCY):
    """Fold key tile j (its scores ``qk``) into the running max, sum and accumulator."""
    if MASKED:
        offs_n = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[None, :]
        visible = ct.full(qk.shape, True, dtype=ct.bool_)
        if not EVEN_N:
            visible = visible & (offs_n < kv_len)
        if CAUSAL:
            visible = visible & (offs_m + causal_offset >= offs_n)
        qk = ct.where(visible, qk, -math.inf)

    # The tile's row max in log2 units: the scale multiplies the row max once, not the whole tile twice.
    m_tile = ct.max(qk, axis=-1, keepdims=True) * qk_scale_log2
    if LAZY_RESCALE:
        growth = m_tile - m_i
        if MASKED:  # a row with no key in this tile does not grow (and -inf - -inf would be NaN)
            growth = ct.where(m_tile == -math.inf, 0.0, growth)
        # A block-wide decision: NaN compares false, so a NaN row never forces (or blocks) a rescale.
        if ct.max(ct.where(growth > RESCALE_THRESHOLD, 1, 0)) > 0:
            acc, l_i, m_i = rescale(acc, l_i, m_i, ct.maximum(m_i, m_tile), MASKED, FAST_MATH)
    else:
        acc, l_i, m_i = rescale(acc, l_i, m_i, ct.maximum(m_i, m_tile), MASKED, FAST_MATH)
    p = ct.exp2(qk * qk_scale_log2 - finite(m_i, MASKED), flush_to_zero=FAST_MATH)
    l_i = l_i + ct.sum(p, axis=-1, keepdims=True)

    v = ct.load(V, index=(batch, kv_head, j, 0), shape=(1, 1, TILE_N, TILE_D),
                latency=V_LATENCY, padding_mode=ZERO_PAD).reshape((TILE_N, TILE_D))
    acc = ct.mma(p.astype(q.dtype), v, acc)  # tensor cores take P in the input dtype
    return acc, l_i, m_i


def finite(m, MAY_BE_EMPTY):
    """The reference max with -inf (a row that has seen no key) replaced by 0."""
    if MAY_BE_EMPTY:
        return ct.where(m == -math.inf, 0.0, m)
    return m


def rescale(acc, l_i, m_i, m_new, MAY_BE_EMPTY, FAST_MATH):
    """Move the reference max to ``m_new``: what was summed against the old one shrinks by 2**(old - new)."""
    alpha = ct.exp2(m_i - finite(m_new, MAY_BE_EMPTY), flush_to_zero=FAST_MATH)
    return acc * alpha, l_i * alpha, m_new


@ct.kernel
def fmha_fwd(
    Q, K, V, Out,
    qk_scale: float,
    causal_offset: int,
    num_heads: int,
    group: int,
    TILE_D: ConstInt,
    TILE_M: ConstInt, TILE_N: ConstInt,
    CAUSAL: ConstBool, EVEN_N: ConstBool,
    FAST_MATH: ConstBool, LOOP_SPLIT: ConstBool, REVERSE_ORDER: ConstBool,
    K_LATENCY: ConstInt, V_LATENCY: ConstInt, LAZY_RESCALE: ConstBool, PIPELINE_QK: ConstBool,
):
    if CAUSAL and REVERSE_ORDER:
        tile_m = ct.num_blocks(0) - 1 - ct.bid(0)
    else:
        tile_m = ct.bid(0)
    batch = ct.bid(1) // num_heads
    head = ct.bid(1) % num_heads
    kv_head = head // group  # GQA by index: K/V are never repeated in memory

    qk_scale_log2 = qk_scale * INV_LOG_2
    offs_m = (tile_m * TILE_M + ct.arange(TILE_M, dtype=ct.int32))[:, None]
    m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((TILE_M, TILE_D), 0.0, dtype=ct.float32)
    q = ct.load(Q, index=(batch, head, tile_m, 0), shape=(1, 1, TILE_M, TILE_D)).reshape((TILE_M, TILE_D))

    kv_len = K.shape[2]
    if CAUSAL:
        # Keys any row of this tile sees: the rest lie in the future and are never visited.
        seen_by_any = min(kv_len, (tile_m + 1) * TILE_M + causal_offset)
        num_tiles = ct.cdiv(max(seen_by_any, 0), TILE_N)
        # Tiles every row of this tile sees entirely: no mask needed there.
        unmasked_tiles = max(tile_m * TILE_M + causal_offset + 1, 0) // TILE_N
    else:
        num_tiles = ct.cdiv(kv_len, TILE_N)
        unmasked_tiles = num_tiles
    if not EVEN_N:
        unmasked_tiles = min(unmasked_tiles, kv_len // TILE_N)  # the ragged last tile needs its mask

    needs_mask = CAUSAL or not EVEN_N
    if LOOP_SPLIT:
        mask_start = min(unmasked_tiles, num_tiles)
    else:
        mask_start = 0
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, K, V, batch, kv_head, offs_m, 0, mask_start, kv_len,
                                 causal_offset, qk_scale_log2, TILE_M, TILE_N, TILE_D, False, CAUSAL,
                                 EVEN_N, FAST_MATH, LAZY_RESCALE, K_LATENCY, V_LATENCY, PIPELINE_QK)
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, K, V, batch, kv_head, offs_m, mask_start, num_tiles,
                                 kv_len, causal_offset, qk_scale_log2, TILE_M, TILE_N, TILE_D, needs_mask,
                                 CAUSAL, EVEN_N, FAST_MATH, LAZY_RESCALE, K_LATENCY, V_LATENCY, PIPELINE_QK)

    l_i = ct.where(l_i == 0.0, 1.0, l_i)  # rows that saw no key: 0 / 1 = 0
    if FAST_MATH:
        acc = ct.truediv(acc, l_i, flush_to_zero=True, rounding_mode=ct.RoundingMode.APPROX)
    else:
        acc = ct.truediv(acc, l_i)
    out = acc.reshape((1, 1, TILE_M, TILE_D)).astype(Out.dtype)
    ct.store(Out, index=(batch, head, tile_m, 0), tile=out)


def with_int64_indexing(kernel: ct.kernel) -> ct.kernel:
    """The same kernel with 64-bit shapes, strides and offsets for its four arrays.

    cuTile indexes an array in 32 bits unless its parameter is annotated ``ct.IndexedWithInt64``; a tensor of
    2**31 elements or more needs it (the launcher refuses it otherwise: "stride is too big"). The body is
    shared: only the annotations of a copy of the function differ.
    """
    fn = kernel._pyfunc
    wide = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    wide.__qualname__, wide.__module__, wide.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    wide.__annotations__ = {**fn.__annotations__, **dict.fromkeys(("Q", "K", "V", "Out"), ct.IndexedWithInt64)}
    return ct.kernel(wide)


fmha_fwd_int64 = with_int64_indexing(fmha_fwd)
