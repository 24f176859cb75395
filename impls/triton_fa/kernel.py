"""FlashAttention-2 forward in Triton.

One program computes one BLOCK_M tile of query rows of one (batch, query head). It streams the key/value
tiles of its kv head through an online softmax in base 2 (the softmax scale folded into log2 units, so
each score costs one multiply and one ``exp2``), accumulates ``P @ V`` in float32, and normalises once
at the end.

The key loop is split in two, as in the NVIDIA cuTile blog:
1. key tiles entirely visible to every row of the query tile: no mask at all;
2. the tiles at the causal diagonal and the ragged tail of Skv: masked.
Tiles entirely in the future are never visited. Causal is aligned bottom-right (query i sees keys
j <= i + Skv - Sq); a row that sees no key keeps l == 0 and is written as zeros.

USE_TMA: tiles move through tensor descriptors (Hopper's bulk tensor copy engine) over the contiguous
(B*H, S, D) view of each tensor, instead of pointer arithmetic; ragged tiles read zeros and stores are
clipped per head by the descriptor itself. HOST_DESC: those descriptors come from the host, as the arguments
``desc_q`` .. ``desc_o`` beside the pointers (so one autotuner serves both), instead of being written by each
program.

Schedule and softmax switches (all off by default; docs/design.md#triton-forward):
- PERSISTENT (1: head by head, 2: heaviest tiles of all heads first): as many programs as the launcher sizes
  the grid to, each looping over (query tile, head, batch) work items (dense only);
- FOLD_SCALE: raw scores kept, the scale and the max subtraction fused into one multiply-add a score;
- LAZY_RESCALE > 0: in the unmasked loop, acc and l are rescaled only when some row's max grew by more than
  this many log2 units (FlashAttention-4); until then the stale max bounds p by 2**LAZY_RESCALE;
- OVERLAP_PV: in the unmasked loop, a tile's P @ V runs while the next tile's softmax is computed;
- LOOP_STAGES > 0: the key loops' own pipeline depth; WARP_SPECIALIZE: ask Triton to warp-specialise them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from impls.triton_fa.config import PERSISTENT_HEAVY_FIRST

LOG2_E = 1.4426950408889634
_LOG2_E: tl.constexpr = tl.constexpr(LOG2_E)
_HEAVY_FIRST: tl.constexpr = tl.constexpr(PERSISTENT_HEAVY_FIRST)


@triton.jit
def scaled_scores(qk, qk_scale, SOFTCAP: tl.constexpr):
    """Raw ``q @ k^T`` scores in log2 units (``qk_scale`` is the softmax scale times log2(e)); with SOFTCAP
    > 0, ``cap * tanh(scaled / cap)`` first, through tanh(x) = 2 sigmoid(2x) - 1."""
    if SOFTCAP > 0:
        return (2 * tl.sigmoid(qk * (2 * qk_scale / (_LOG2_E * SOFTCAP))) - 1) * (SOFTCAP * _LOG2_E)
    return qk * qk_scale


@triton.jit
def _scores(q, k_ptrs, k_desc, kv_row, kv_len, start_n, offs_n, offs_d, MASK_N: tl.constexpr, DOT_FP32: tl.constexpr,
            USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """``q @ k^T`` for one key tile, in float32. ``k_ptrs`` address the tile transposed (BLOCK_D x BLOCK_N).
    A head dim that is not a power of two is padded to BLOCK_D with zeros, which add nothing to the dot."""
    if USE_TMA:
        k = tl.trans(k_desc.load([kv_row, start_n, 0]).reshape(BLOCK_N, HEAD_DIM))
    elif MASK_N and BLOCK_D != HEAD_DIM:
        k = tl.load(k_ptrs, mask=((start_n + offs_n)[None, :] < kv_len) & (offs_d[:, None] < HEAD_DIM), other=0.0)
    elif MASK_N:
        k = tl.load(k_ptrs, mask=(start_n + offs_n)[None, :] < kv_len, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        k = tl.load(k_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
    else:
        k = tl.load(k_ptrs)
    if DOT_FP32:  # Triton's interpreter computes half-precision dots wrongly; see launch()
        k = k.to(tl.float32)
    return tl.dot(q, k, input_precision="ieee" if DOT_FP32 else None)


@triton.jit
def _values(v_ptrs, v_desc, kv_row, kv_len, start_n, offs_n, offs_d, MASK_N: tl.constexpr, USE_TMA: tl.constexpr,
            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One V tile (BLOCK_N x BLOCK_D, V's own head dim); rows past kv_len and padded columns read zeros."""
    if USE_TMA:
        v = v_desc.load([kv_row, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    elif MASK_N and BLOCK_D != HEAD_DIM:
        v = tl.load(v_ptrs, mask=((start_n + offs_n)[:, None] < kv_len) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif MASK_N:
        v = tl.load(v_ptrs, mask=(start_n + offs_n)[:, None] < kv_len, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        v = tl.load(v_ptrs)
    return v


@triton.jit
def _softmax(
    qk, l_i, m_i, kv_len, causal_offset, start_n, offs_m, offs_n, window_left, window_right, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    FOLD_SCALE: tl.constexpr, LAZY_RESCALE: tl.constexpr,
):
    """One key tile's online-softmax step on ``qk``, its raw scores (masked where MASKED): its probabilities
    ``p``, the factor ``alpha`` that moves the accumulator to the new max, whether it must be applied (LAZY
    only: otherwise always), and the new running sum and max."""
    # Scale folded into the exponent's multiply-add: the scores stay raw (a softcap needs them scaled first).
    FOLD: tl.constexpr = FOLD_SCALE and SOFTCAP == 0
    # Lazy rescaling in the unmasked loop only: a masked row may still have seen no key (m == -inf).
    LAZY: tl.constexpr = LAZY_RESCALE > 0 and not MASKED
    if not FOLD:
        qk = scaled_scores(qk, qk_scale, SOFTCAP)
    if MASKED:
        keys = (start_n + offs_n)[None, :]
        visible = keys < kv_len
        if CAUSAL:
            visible = visible & (keys <= offs_m[:, None] + causal_offset)
        if HAS_WINDOW:
            position = offs_m[:, None] + causal_offset
            visible = visible & (keys >= position - window_left) & (keys <= position + window_right)
        qk = tl.where(visible, qk, float("-inf"))
    row_max = tl.max(qk, 1)
    if FOLD:  # qk_scale > 0, so the max of the raw scores scales to the max of the scaled ones
        row_max = row_max * qk_scale
    m_new = tl.maximum(m_i, row_max)
    rescale = True
    if LAZY:  # keep the old max unless some row's grew past the threshold (the first tile's: from -inf)
        rescale = tl.max(m_new - m_i, 0) > LAZY_RESCALE
        m_new = tl.where(rescale, m_new, m_i)  # p below stays under 2**LAZY_RESCALE
        m_new_safe = m_new
    elif MASKED:  # a row that has seen no key yet has m == -inf: subtract 0 instead of NaN-ing
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    if FOLD:
        p = tl.math.exp2(qk * qk_scale - m_new_safe[:, None])
    else:
        p = tl.math.exp2(qk - m_new_safe[:, None])
    alpha = tl.math.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, rescale, l_i, m_new


@triton.jit
def _accumulate(acc, p, alpha, rescale, v, DOT_FP32: tl.constexpr, LAZY: tl.constexpr):
    """``acc * alpha + p @ v``; LAZY: the multiply only where ``rescale`` (one branch for the whole tile)."""
    if LAZY:
        if rescale:
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    if DOT_FP32:
        return tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(p.to(v.dtype), v, acc)


@triton.jit
def _tile_ptrs(ptrs, rows, stride, USE_TMA: tl.constexpr):
    """``ptrs`` moved ``rows`` key rows on (None on the descriptor path)."""
    if USE_TMA:
        moved = None
    else:
        moved = ptrs + rows * stride
    return moved


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, K_head, V_head, k_desc, v_desc, kv_row, stride_kn, stride_vn, kv_len, causal_offset,
    offs_m, offs_d, offs_dv, lo, hi, window_left, window_right,
    qk_scale, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_FP32: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, FOLD_SCALE: tl.constexpr, LAZY_RESCALE: tl.constexpr, LOOP_STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, OVERLAP_PV: tl.constexpr,
):
    """Online softmax over key tiles [lo, hi); masks (causal, window and bounds) only when MASKED.

    OVERLAP_PV (unmasked loop): tile j's ``P @ V`` is issued before tile j+1's softmax, with p and alpha carried
    over, so the tensor cores run it while the softmax does (Triton waits on a ``q @ k^T`` at once but on the
    accumulator's dot only where the accumulator is next read: FlashAttention-3's intra-warpgroup overlap)."""
    LAZY: tl.constexpr = LAZY_RESCALE > 0 and not MASKED
    offs_n = tl.arange(0, BLOCK_N)
    if USE_TMA:  # the tiles come through the descriptors
        k_ptrs, v_ptrs = None, None
    else:
        k_ptrs = K_head + offs_n[None, :] * stride_kn + offs_d[:, None] + lo * stride_kn
        v_ptrs = V_head + offs_n[:, None] * stride_vn + offs_dv[None, :] + lo * stride_vn
    stages: tl.constexpr = LOOP_STAGES if LOOP_STAGES > 0 else None
    if OVERLAP_PV and not MASKED:
        # The first tile as a plain step (keys masked to [lo, hi): p == 0 on an empty range), so the accumulator
        # enters the loop as a product's result; then each iteration issues its scores, the previous tile's
        # P @ V (p == 0 on the first: that tile's is done) and its own softmax. p stays float32 until its dot.
        # Why each: docs/design.md#triton-forward.
        qk = _scores(q, k_ptrs, k_desc, kv_row, kv_len, lo, offs_n, offs_d, True, DOT_FP32, USE_TMA, BLOCK_N,
                     HEAD_DIM, BLOCK_D)
        p, alpha, rescale, l_i, m_i = _softmax(
            qk, l_i, m_i, hi, causal_offset, lo, offs_m, offs_n, window_left, window_right, qk_scale, True, False,
            False, SOFTCAP, FOLD_SCALE, LAZY_RESCALE)
        v = _values(v_ptrs, v_desc, kv_row, kv_len, lo, offs_n, offs_dv, True, USE_TMA, BLOCK_N, HEAD_DIM_V, BLOCK_DV)
        acc = _accumulate(acc, p, alpha, rescale, v, DOT_FP32, LAZY)
        p = tl.zeros([q.shape[0], BLOCK_N], tl.float32)
        alpha = tl.full(m_i.shape, 1.0, tl.float32)
        for start_n in tl.range(lo + BLOCK_N, hi, BLOCK_N, num_stages=stages, warp_specialize=WARP_SPECIALIZE):
            if not USE_TMA:
                k_ptrs += BLOCK_N * stride_kn
            qk = _scores(q, k_ptrs, k_desc, kv_row, kv_len, start_n, offs_n, offs_d, False, DOT_FP32, USE_TMA,
                         BLOCK_N, HEAD_DIM, BLOCK_D)
            previous = start_n - BLOCK_N
            v = _values(_tile_ptrs(v_ptrs, previous - lo, stride_vn, USE_TMA), v_desc, kv_row, kv_len, previous,
                        offs_n, offs_dv, False, USE_TMA, BLOCK_N, HEAD_DIM_V, BLOCK_DV)
            acc = _accumulate(acc, p, alpha, rescale, v, DOT_FP32, LAZY)
            p, alpha, rescale, l_i, m_i = _softmax(
                qk, l_i, m_i, kv_len, causal_offset, start_n, offs_m, offs_n, window_left, window_right,
                qk_scale, False, CAUSAL, HAS_WINDOW, SOFTCAP, FOLD_SCALE, LAZY_RESCALE)
        # The last tile's values (after no loop: the first tile's again, and p == 0).
        last = tl.maximum(hi - BLOCK_N, lo)
        v = _values(_tile_ptrs(v_ptrs, last - lo, stride_vn, USE_TMA), v_desc, kv_row, kv_len, last, offs_n,
                    offs_dv, True, USE_TMA, BLOCK_N, HEAD_DIM_V, BLOCK_DV)
        acc = _accumulate(acc, p, alpha, rescale, v, DOT_FP32, LAZY)
    else:
        for start_n in tl.range(lo, hi, BLOCK_N, num_stages=stages, warp_specialize=WARP_SPECIALIZE):
            qk = _scores(q, k_ptrs, k_desc, kv_row, kv_len, start_n, offs_n, offs_d, MASKED, DOT_FP32, USE_TMA,
                         BLOCK_N, HEAD_DIM, BLOCK_D)
            p, alpha, rescale, l_i, m_i = _softmax(
                qk, l_i, m_i, kv_len, causal_offset, start_n, offs_m, offs_n, window_left, window_right, qk_scale,
                MASKED, CAUSAL, HAS_WINDOW, SOFTCAP, FOLD_SCALE, LAZY_RESCALE)
            v = _values(v_ptrs, v_desc, kv_row, kv_len, start_n, offs_n, offs_dv, MASKED, USE_TMA, BLOCK_N,
                        HEAD_DIM_V, BLOCK_DV)
            acc = _accumulate(acc, p, alpha, rescale, v, DOT_FP32, LAZY)
            if not USE_TMA:
                k_ptrs += BLOCK_N * stride_kn
                v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _attention_tile(
    Q, K, V, Out, q_desc, k_desc, v_desc, o_desc, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    num_heads, q_len, kv_len, group, window_left, window_right, head, batch, tile_m,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FOLD_SCALE: tl.constexpr,
    LAZY_RESCALE: tl.constexpr, LOOP_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, OVERLAP_PV: tl.constexpr,
):
    """Query tile ``tile_m`` of (``batch``, ``head``): its output rows. ``Q``..``Out`` point at this sequence
    (varlen: already offset to it); ``*_desc``: the descriptors where USE_TMA."""
    kv_head = head // group  # GQA by index: K/V are never repeated in memory
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)  # BLOCK_D: the head dim, or the power of two above it (padded with zeros)
    offs_dv = tl.arange(0, BLOCK_DV)  # likewise for V and the output
    num_kv_heads = num_heads // group
    kv_row = (batch * num_kv_heads + kv_head).to(tl.int32)  # row of the (B*Hkv, Skv, D) view (descriptors: i32)
    if USE_TMA:
        bh = (batch * num_heads + head).to(tl.int32)
        q = q_desc.load([bh, tile_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_DIM)
        K_head, V_head = None, None  # the loops read through the descriptors
    else:
        q_ptrs = Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
        if BLOCK_D != HEAD_DIM:
            q = tl.load(q_ptrs, mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < q_len, other=0.0)
        K_head = K + batch * stride_kb + kv_head * stride_kh
        V_head = V + batch * stride_vb + kv_head * stride_vh
    out_dtype = q.dtype
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Key ranges. Causal: query row i sees keys j <= i + causal_offset (bottom-right alignment).
    causal_offset = kv_len - q_len
    full_tiles_end = (kv_len // BLOCK_N) * BLOCK_N  # past this, the tile is ragged: bounds mask needed
    if CAUSAL:
        # Keys every row of this tile sees, and the keys any row of it sees.
        seen_by_all = tile_m * BLOCK_M + causal_offset + 1
        seen_by_any = tl.minimum(kv_len, (tile_m + 1) * BLOCK_M + causal_offset)
        unmasked_end = tl.minimum(tl.maximum(seen_by_all, 0) // BLOCK_N * BLOCK_N, full_tiles_end)
        masked_end = tl.maximum(seen_by_any, 0)
    else:
        unmasked_end = full_tiles_end
        masked_end = kv_len
    unmasked_start = 0
    if HAS_WINDOW:
        # Tiles no row's window reaches are never visited; tiles across a window edge are masked; tiles that
        # every row's window covers (from the last row's left edge to the first row's right edge) are not.
        first = tile_m * BLOCK_M + causal_offset
        last = first + BLOCK_M - 1
        window_start = tl.maximum(first - window_left, 0) // BLOCK_N * BLOCK_N
        masked_end = tl.minimum(masked_end, tl.maximum(last + window_right + 1, 0))
        if not CAUSAL:
            unmasked_end = tl.minimum(unmasked_end, tl.maximum(first + window_right + 1, 0) // BLOCK_N * BLOCK_N)
        unmasked_start = tl.minimum(tl.cdiv(tl.maximum(last - window_left, 0), BLOCK_N) * BLOCK_N, masked_end)
        unmasked_start = tl.maximum(unmasked_start, window_start)
        unmasked_end = tl.minimum(tl.maximum(unmasked_end, unmasked_start), masked_end)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, K_head, V_head, k_desc, v_desc, kv_row, stride_kn, stride_vn, kv_len, causal_offset,
            offs_m, offs_d, offs_dv, window_start, unmasked_start, window_left, window_right, qk_scale, BLOCK_N,
            HEAD_DIM, True, CAUSAL, DOT_FP32, USE_TMA, BLOCK_D, HEAD_DIM_V, BLOCK_DV, HAS_WINDOW, SOFTCAP,
            FOLD_SCALE, LAZY_RESCALE, LOOP_STAGES, WARP_SPECIALIZE, OVERLAP_PV)

    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, K_head, V_head, k_desc, v_desc, kv_row, stride_kn, stride_vn, kv_len, causal_offset,
        offs_m, offs_d, offs_dv, unmasked_start, unmasked_end, window_left, window_right, qk_scale, BLOCK_N,
        HEAD_DIM, False, CAUSAL, DOT_FP32, USE_TMA, BLOCK_D, HEAD_DIM_V, BLOCK_DV, HAS_WINDOW, SOFTCAP,
        FOLD_SCALE, LAZY_RESCALE, LOOP_STAGES, WARP_SPECIALIZE, OVERLAP_PV)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, K_head, V_head, k_desc, v_desc, kv_row, stride_kn, stride_vn, kv_len, causal_offset,
        offs_m, offs_d, offs_dv, unmasked_end, masked_end, window_left, window_right, qk_scale, BLOCK_N,
        HEAD_DIM, True, CAUSAL, DOT_FP32, USE_TMA, BLOCK_D, HEAD_DIM_V, BLOCK_DV, HAS_WINDOW, SOFTCAP,
        FOLD_SCALE, LAZY_RESCALE, LOOP_STAGES, WARP_SPECIALIZE, OVERLAP_PV)

    # Rows that saw no key have l == 0: write zeros rather than 0/0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_safe[:, None]).to(out_dtype)
    if USE_TMA:
        o_desc.store([bh, tile_m * BLOCK_M, 0], out.reshape(1, BLOCK_M, HEAD_DIM_V))
    else:
        o_ptrs = Out + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :]
        if BLOCK_DV != HEAD_DIM_V:
            tl.store(o_ptrs, out, mask=(offs_m[:, None] < q_len) & (offs_dv[None, :] < HEAD_DIM_V))
        else:
            tl.store(o_ptrs, out, mask=offs_m[:, None] < q_len)


@triton.jit
def attention_fwd(
    Q, K, V, Out, qk_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    num_batch, num_heads, q_len, kv_len,
    q_len_class, kv_len_class,  # autotuning key only: the sequence lengths' buckets
    group,
    cu_seqlens_q, cu_seqlens_k,  # VARLEN: sequence b is rows cu[b]:cu[b+1] of the packed tensors
    window_left, window_right,  # HAS_WINDOW: keys position - left ... position + right (see window_bounds)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,  # V's and the output's head dim (MLA: other than HEAD_DIM)
    USE_TMA: tl.constexpr = False,
    VARLEN: tl.constexpr = False, BLOCK_D: tl.constexpr = 64, HAS_WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0,
    HOST_DESC: tl.constexpr = False, PERSISTENT: tl.constexpr = 0, FOLD_SCALE: tl.constexpr = False,
    LAZY_RESCALE: tl.constexpr = 0.0, LOOP_STAGES: tl.constexpr = 0, WARP_SPECIALIZE: tl.constexpr = False,
    OVERLAP_PV: tl.constexpr = False,
    desc_q=None, desc_k=None, desc_v=None, desc_o=None,  # HOST_DESC: descriptors over the (B*H, S, D) views
):
    tl.static_assert(not (PERSISTENT and VARLEN), "the persistent schedule is for dense batches")
    tl.static_assert(not (USE_TMA and VARLEN), "descriptors cover dense batches only")
    tl.static_assert(USE_TMA or not HOST_DESC, "host descriptors are the descriptor (USE_TMA) path")
    tl.static_assert(not (OVERLAP_PV and LAZY_RESCALE > 0), "a conditional rescale undoes the P @ V overlap")
    if HOST_DESC:
        q_desc, k_desc, v_desc, o_desc = desc_q, desc_k, desc_v, desc_o
    elif USE_TMA:  # descriptors over the contiguous (B*H, S, D) views; their bounds are per head
        num_bh = num_batch * num_heads
        q_desc = tl.make_tensor_descriptor(Q, shape=[num_bh, q_len, HEAD_DIM],
                                           strides=[stride_qh, stride_qm, 1], block_shape=[1, BLOCK_M, HEAD_DIM])
        k_desc = tl.make_tensor_descriptor(K, shape=[num_bh // group, kv_len, HEAD_DIM],
                                           strides=[stride_kh, stride_kn, 1], block_shape=[1, BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(V, shape=[num_bh // group, kv_len, HEAD_DIM_V],
                                           strides=[stride_vh, stride_vn, 1], block_shape=[1, BLOCK_N, HEAD_DIM_V])
        o_desc = tl.make_tensor_descriptor(Out, shape=[num_bh, q_len, HEAD_DIM_V],
                                           strides=[stride_oh, stride_om, 1], block_shape=[1, BLOCK_M, HEAD_DIM_V])
    else:
        q_desc, k_desc, v_desc, o_desc = None, None, None, None
    num_m_tiles = tl.cdiv(q_len, BLOCK_M)

    if PERSISTENT:
        # Each program takes every num_programs-th work item. BY_HEAD: item w is tile w % tiles of head-batch
        # w // tiles, so the programs running together share one head's K/V in L2 (each head heaviest causal
        # tile first, as the one-tile grid); HEAVY_FIRST: tile rank w // (B*H) of head-batch w % (B*H), so every
        # program starts on the heaviest causal tiles of all heads and ends on the lightest.
        num_bh_items = num_batch * num_heads
        for work in tl.range(tl.program_id(0), num_m_tiles * num_bh_items, tl.num_programs(0)):
            if PERSISTENT == _HEAVY_FIRST:
                rank = work // num_bh_items
                bh = work % num_bh_items
            else:
                rank = work % num_m_tiles
                bh = work // num_m_tiles
            tile_m = num_m_tiles - 1 - rank if CAUSAL else rank
            _attention_tile(
                Q, K, V, Out, q_desc, k_desc, v_desc, o_desc, qk_scale,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                stride_ob, stride_oh, stride_om, num_heads, q_len, kv_len, group, window_left, window_right,
                (bh % num_heads).to(tl.int64), (bh // num_heads).to(tl.int64), tile_m,
                HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N, DOT_FP32, HEAD_DIM_V, BLOCK_DV, USE_TMA, BLOCK_D, HAS_WINDOW,
                SOFTCAP, FOLD_SCALE, LAZY_RESCALE, LOOP_STAGES, WARP_SPECIALIZE, OVERLAP_PV)
    else:
        # Grid: (query tiles, heads, batch), so that neither axis passes CUDA's cap of 65535 where batch x heads
        # would.
        head = tl.program_id(1).to(tl.int64)
        batch = tl.program_id(2).to(tl.int64)  # 64-bit: batch * stride can exceed 2**31
        if VARLEN:  # packed (total, H, D): this sequence's rows start at cu[batch]; q_len/kv_len are its own
            q_start = tl.load(cu_seqlens_q + batch).to(tl.int64)
            kv_start = tl.load(cu_seqlens_k + batch).to(tl.int64)
            q_len = (tl.load(cu_seqlens_q + batch + 1) - q_start).to(tl.int32)
            kv_len = (tl.load(cu_seqlens_k + batch + 1) - kv_start).to(tl.int32)
            Q += q_start * stride_qm
            Out += q_start * stride_om
            K += kv_start * stride_kn
            V += kv_start * stride_vn
            num_m_tiles = tl.cdiv(q_len, BLOCK_M)
            if tl.program_id(0) >= num_m_tiles:  # the grid is sized for the longest sequence
                return
        # Causal: heaviest query tiles (most keys) first, so the last wave is made of short programs.
        tile_m = num_m_tiles - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
        _attention_tile(
            Q, K, V, Out, q_desc, k_desc, v_desc, o_desc, qk_scale,
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
            stride_ob, stride_oh, stride_om, num_heads, q_len, kv_len, group, window_left, window_right,
            head, batch, tile_m,
            HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N, DOT_FP32, HEAD_DIM_V, BLOCK_DV, USE_TMA, BLOCK_D, HAS_WINDOW,
            SOFTCAP, FOLD_SCALE, LAZY_RESCALE, LOOP_STAGES, WARP_SPECIALIZE, OVERLAP_PV)
