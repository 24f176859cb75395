"""Decode over a paged KV cache in Triton: split-KV (flash-decoding) with GQA packing.

Decode is memory-bound: each new token reads its sequence's whole K/V cache once and does 4 FLOPs per byte.
So the kernel is built around reading the cache once, from enough programs to keep HBM busy:

1. GQA packing: one program serves all ``GROUP = Hq / Hkv`` query heads of one kv head (times the ``Sq_new``
   new tokens): the rows of its Q tile. Each K/V element is loaded once and used by every query head of its
   group, instead of once per query head.
2. Split-KV: a (batch, kv head) pair alone is far too little parallelism at small batch (Llama-3-8B at batch 1
   has 8 kv heads for 132 SMs), so each sequence's cache is cut into ``num_splits`` chunks of ``split_len``
   tokens, one program each. Every program writes its chunk's normalised partial output and log-sum-exp; a
   second kernel combines the chunks of a row, weighting each by ``2^(lse - max lse)``. With one chunk per
   sequence (``SPLIT`` off) the split kernel writes the output rows itself and there is no second launch: on
   the H200 the combine cost 2.6-7 us a step, 10% of a 70B slice's 256 x 512 decode.
3. Pages: key position ``p`` of sequence ``b`` lives in slot ``p % page_size`` of page
   ``block_table[b, p // page_size]``. A key tile gathers its rows through the table, so any page size works;
   positions past the sequence read zeros (masked loads) and never reach the output, whatever the unused
   slots hold.
4. MASK_FREE (a tuner axis): whole key tiles that every new token sees run in a loop without any mask, and
   only the chunk's last tile (ragged, or holding the newest Sq_new - 1 positions) is masked, as in the dense
   kernel's split loop; otherwise every tile is masked. Which compiles faster depends on the config.

5. Model variants: a sliding window of ``window_left`` keys (HAS_WINDOW) moves each sequence's start to the
   first position the first new token sees, so the chunks cut only the window and nothing before it is read;
   the tiles across the window's edge (seen by some new tokens only) are masked. SOFTCAP caps the scores.
6. An fp8 cache (KV_FP8) is read as it is stored, half the bytes of a 16-bit one, and each tile is widened to
   q's dtype in registers before its dot. Its per-tensor scales cost nothing in the loop: ``k_scale`` is folded
   into the score scale on the host and ``v_scale`` multiplies the chunk's output once, at the end.
   Under bf16 queries (F16_DOT) the dots run in fp16 instead: e4m3 widens to fp16 in one instruction per two
   elements, where reaching bf16 takes a second conversion per element. Each query row is scaled by a power of
   two into fp16's range first (``_f16_rows``), so q is exact in fp16 and the scores are those of the bf16 dot;
   the probabilities gain precision (11 significant bits instead of 8).
   Over fp16 dots V is read as 32-bit words (V_WORDS) and widened before the dot's layout is made. PV wants
   each thread's values in pairs of keys, which memory holds a head-dim row apart; sm_90 has no transposing
   shared-memory load of bytes, so Triton gathered an fp8 V tile byte by byte (256 ``LDS.U8`` a thread for 128
   keys, and spills). Widened first, the tile takes the transposing 16-bit load a bf16 cache does.

7. Programmatic dependent launch (USE_PDL, Hopper and later): both kernels are launched so that the next kernel
   in the stream may start before this one ends. Each waits (``gdc_wait``) before its first load -- the combine
   for the split kernel's partials, the split kernel for whatever wrote Q, the table and the cache -- and lets
   its dependents launch (``gdc_launch_dependents``) once it runs. What overlaps is the next kernel's launch and
   block scheduling with this one's last wave: about a microsecond a launch, which is a tenth of a short step
   (the 70B slice at 64 x 512 takes 10-11 us, two launches). FlashInfer's kernels run this way by default on
   Hopper; ours where a step splits (measured: impls.triton_fa's comment on the decode space). Before its wait, the
   first chunk's program of each sequence and kv head asks the L2 for what the chunks' first loads wait on
   (PREFETCH): cold, the length, the table line and the query rows are each a round trip to HBM, one after another.

Causal within each sequence, bottom-right: new token ``t`` (of ``Sq_new``) sees positions ``<= L - Sq_new + t``
(and, windowed, ``>= L - Sq_new + t - window_left``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from impls._plans import F16_ROW_EXP
from impls.triton_fa.kernel import scaled_scores


@triton.jit
def await_inputs(USE_PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the kernel before this one in the stream has finished and
    its writes are visible, then let the next kernel launch (its programs wait here in turn)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs):
    """Ask the L2 for the lines holding ``ptrs`` and go on (PTX ``prefetch.global.L2``): a hint that neither
    waits nor faults. Every address given lies in a tensor the program reads later."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _query_rows(kv_head, GROUP: tl.constexpr, SQ: tl.constexpr, BLOCK_M: tl.constexpr):
    """The tile's rows: row r is query head kv_head * GROUP + r // SQ, new token r % SQ (and whether it is one)."""
    rows = tl.arange(0, BLOCK_M)
    return rows, kv_head * GROUP + rows // SQ, rows % SQ, rows < GROUP * SQ


@triton.jit
def _prefetch_lookups(q_seq, stride_qt, stride_qh, seq_len_ptr, table_row, kv_head, GROUP: tl.constexpr,
                      SQ: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Before the wait for the kernel ahead (USE_PDL), while it still runs: ask the L2 for what a chunk's first
    K/V load depends on, its sequence's length and the start of its table row (a line: 32 pages), and for the
    query rows (from ``q_seq``, the sequence's queries; within each row's HEAD_DIM elements, so that no address lies
    past the tensors even where the tile pads the head dim). Cold, each is a round trip to HBM, and they come one
    after another: the length bounds the chunk, the table names the pages."""
    _, head, token, row_valid = _query_rows(kv_head, GROUP, SQ, BLOCK_M)
    q_rows = q_seq + tl.where(row_valid, token * stride_qt + head * stride_qh, 0)
    one = tl.zeros([1], dtype=tl.int32)
    _prefetch_l2(seq_len_ptr + one)
    _prefetch_l2(table_row + one)
    cols = tl.arange(0, (BLOCK_D + 31) // 32) * 32  # each row, every 32 elements
    if HEAD_DIM != BLOCK_D:  # a padded tile: the last ones at the row's last element
        cols = tl.minimum(cols, HEAD_DIM - 1)
    _prefetch_l2(q_rows[:, None] + cols[None, :])


@triton.jit
def _load(ptrs, in_seq, in_dims, MASKED: tl.constexpr, PADDED: tl.constexpr):
    """A K or V tile: positions outside ``in_seq`` (MASKED) and columns outside ``in_dims`` (PADDED) read
    zeros; each mask only where it can hide something."""
    if MASKED and PADDED:
        return tl.load(ptrs, mask=in_seq & in_dims, other=0.0)
    if MASKED:
        return tl.load(ptrs, mask=in_seq, other=0.0)
    if PADDED:
        return tl.load(ptrs, mask=in_dims, other=0.0)
    return tl.load(ptrs)


_F16_ROW_EXP: tl.constexpr = tl.constexpr(F16_ROW_EXP)  # where ``_f16_rows`` puts each row's largest |q|
_F32_BIAS: tl.constexpr = tl.constexpr(127)
_F32_MANTISSA_BITS: tl.constexpr = tl.constexpr(23)


@triton.jit
def _f16_rows(q):
    """A bf16 query tile as fp16, each row multiplied by a power of two that brings its largest |q| to
    [2**13, 2**14), and the inverse of each row's factor (fp32), for its score scale. A power of two changes no
    significand bit, so every element down to 2**-27 of its row's largest is exact in fp16 (bf16's 8 significant
    bits fit fp16's 11); the smaller ones move a score by less than 2**-27 of its largest term."""
    amax = tl.max(tl.abs(q.to(tl.float32)), 1)
    # The biased fp32 exponent of each row's largest |q|, floored so that both factors stay normal (an all-zero
    # row, which padding rows are, gets the floor).
    exp = tl.maximum((amax.to(tl.int32, bitcast=True) >> _F32_MANTISSA_BITS) & 0xFF, _F16_ROW_EXP + 1)
    up = ((-exp + (2 * _F32_BIAS + _F16_ROW_EXP)) << _F32_MANTISSA_BITS).to(tl.float32, bitcast=True)  # 2**(13 - e)
    down = ((exp - _F16_ROW_EXP) << _F32_MANTISSA_BITS).to(tl.float32, bitcast=True)  # 2**(e - 13)
    return (q.to(tl.float32) * up[:, None]).to(tl.float16), down


@triton.jit
def _e4m3_words_as_f16(words):
    """A tile of 32-bit words, each four e4m3 values along the head dim (lowest byte first), as the fp16 tile of
    those values: four times as wide. The widening is sm_90's two-element conversion, twice a word."""
    v0, v1, v2, v3 = tl.inline_asm_elementwise(
        asm="{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 x, lo; cvt.rn.f16x2.e4m3x2 y, hi; mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
        constraints="=h,=h,=h,=h,r", args=[words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True, pack=1)
    return interleave_columns(v0, v1, v2, v3)


@triton.jit
def interleave_columns(c0, c1, c2, c3):
    """Four (rows, w) tiles as one (rows, 4w): column 4j + i from ``ci[:, j]``. tl.join stacks along a new last
    axis, so join(join(c0, c2), join(c1, c3))[n, j, a, b] is c(2a + b)[n, j], column 4j + 2a + b once flattened."""
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (c0.shape[0], c0.shape[1] * 4))


@triton.jit
def _decode_tiles(
    q, acc, l_i, m_i, K_cache, V_cache, table_row, kv_head, lo, hi, end, last_visible, window_left, qk_scale,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr, V_WORDS: tl.constexpr,
):
    """Online softmax of the tile's rows over cache positions [lo, hi), BLOCK_N at a time. MASKED: positions
    at or past ``end`` read zeros and are left out, and so are those past a row's ``last_visible`` (or, with a
    window, more than ``window_left`` before it); otherwise every row sees every position (no mask at all)."""
    tl.static_assert(not V_WORDS or q.dtype == tl.float16, "V_WORDS widens the values to fp16: fp16 dots only")
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    in_dims = offs_d < HEAD_DIM  # a head dim below the tile's reads zeros past its end
    if V_WORDS:  # V's columns as 32-bit words of four (the launch checks that the strides hold whole words)
        V_cache = V_cache.to(tl.pointer_type(tl.int32))
        stride_vp, stride_vs, stride_vh = stride_vp // 4, stride_vs // 4, stride_vh // 4
        offs_v = tl.arange(0, BLOCK_D // 4)
        in_v_dims = offs_v * 4 < HEAD_DIM
    else:
        offs_v = offs_d
        in_v_dims = in_dims
    for tile_start in range(lo, hi, BLOCK_N):
        pos = tile_start + offs_n
        in_seq = pos < end
        if MASKED:
            page = tl.load(table_row + pos // PAGE_SIZE, mask=in_seq, other=0).to(tl.int64)
        else:
            page = tl.load(table_row + pos // PAGE_SIZE).to(tl.int64)
        slot = pos % PAGE_SIZE
        k_ptrs = K_cache + page[None, :] * stride_kp + slot[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None]
        v_ptrs = V_cache + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh + offs_v[None, :]
        k = _load(k_ptrs, in_seq[None, :], in_dims[:, None], MASKED, BLOCK_D != HEAD_DIM)
        if DOT_FP32 or KV_FP8:  # the interpreter computes half-precision dots wrongly; fp8 widens to q's dtype
            k = k.to(q.dtype)
        qk = scaled_scores(tl.dot(q, k, input_precision="ieee" if DOT_FP32 else None), qk_scale, SOFTCAP)
        if MASKED:
            visible = in_seq[None, :] & (pos[None, :] <= last_visible[:, None])
            if HAS_WINDOW:
                visible = visible & (pos[None, :] >= last_visible[:, None] - window_left)
            qk = tl.where(visible, qk, float("-inf"))
        acc, l_i, m_i = online_softmax_step(qk, acc, l_i, m_i, v_ptrs, in_seq, in_v_dims, MASKED,
                                            BLOCK_D != HEAD_DIM, DOT_FP32, q.dtype if KV_FP8 else None, V_WORDS)
    return acc, l_i, m_i


@triton.jit
def online_softmax_step(qk, acc, l_i, m_i, v_ptrs, in_seq, in_dims, MASKED: tl.constexpr, PADDED: tl.constexpr,
                        DOT_FP32: tl.constexpr, WIDEN_TO: tl.constexpr = None, V_WORDS: tl.constexpr = False):
    """One key tile of the online softmax: the running max, sum and output rescaled to the tile's scores ``qk``
    (log2 units, hidden keys -inf) and its values (``_load``'s masks) added in. ``WIDEN_TO``: the dtype an fp8
    value tile is widened to before its dot; ``V_WORDS``: the values come as words of four e4m3, widened to
    fp16."""
    p, alpha, l_i, m_new = softmax_rescale(qk, l_i, m_i, MASKED)
    # the values are loaded after the exponentials, as before the MLA kernel shared this step: loaded first, they
    # stay live across them and the 2-warp (64, 3) tile spills 8 B (tests/test_triton_compile.py)
    v = _load(v_ptrs, in_seq[:, None], in_dims[None, :], MASKED, PADDED)
    if V_WORDS:
        v = _e4m3_words_as_f16(v)
    elif WIDEN_TO is not None:
        v = v.to(WIDEN_TO)
    return accumulate(acc, p, alpha, v, DOT_FP32), l_i, m_new


@triton.jit
def softmax_update(qk, acc, l_i, m_i, v, MASKED: tl.constexpr, DOT_FP32: tl.constexpr):
    """The online softmax's step over one key tile's scores ``qk`` (log2 units, hidden keys -inf) and its value
    tile ``v``, already loaded: the running max, sum and output rescaled, the tile's values added in."""
    p, alpha, l_i, m_new = softmax_rescale(qk, l_i, m_i, MASKED)
    return accumulate(acc, p, alpha, v, DOT_FP32), l_i, m_new


@triton.jit
def softmax_rescale(qk, l_i, m_i, MASKED: tl.constexpr):
    """The tile's probabilities ``p`` against the new running max, the factor ``alpha`` that rescales what came
    before, and the new running sum and max."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # MASKED: a row that has seen no key yet has m == -inf: subtract 0 instead of NaN-ing
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    p = tl.math.exp2(qk - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def accumulate(acc, p, alpha, v, DOT_FP32: tl.constexpr):
    """``acc`` rescaled by ``alpha`` plus ``p @ v``."""
    if DOT_FP32:
        return tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    return tl.dot(p.to(v.dtype), v, acc * alpha[:, None])


@triton.jit
def paged_decode_split(
    Q, K_cache, V_cache, block_table, cache_seqlens, O_part, LSE_part, Out, qk_scale,
    stride_qb, stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_bt,
    stride_ob, stride_os, stride_or,  # O_part (B*Hkv, splits, rows, D)
    stride_b, stride_t, stride_h,  # Out (B, Sq_new, Hq, D)
    num_kv_heads, split_len, window_left, v_scale,
    GROUP: tl.constexpr, SQ: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT: tl.constexpr,
    MASK_FREE: tl.constexpr = True, HAS_WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0,
    KV_FP8: tl.constexpr = False, F16_DOT: tl.constexpr = False, V_WORDS: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):
    """Program (split, kv head, sequence): attention of the GROUP x SQ query rows over one chunk of the cache.
    SPLIT: its normalised output and log-sum-exp go to O_part and LSE_part for the combine; otherwise (one
    chunk per sequence) the output rows go to Out. KV_FP8: the caches are fp8, ``qk_scale`` holds k_scale and
    the output is multiplied by ``v_scale``; F16_DOT (bf16 queries over fp8): the dots run in fp16; V_WORDS (fp8
    under fp16 dots, compiled): V is read as 32-bit words and widened before its dot's layout. PREFETCH (under
    USE_PDL): the lookups the first K/V load waits on asked of the L2 before the wait (``_prefetch_lookups``) by
    the first chunk's program of each sequence and kv head, for all its chunks."""
    split = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    bk = tl.program_id(2) * num_kv_heads + tl.program_id(1)  # the partials' row (B*Hkv, ...)
    # One program of each (sequence, kv head) asks for what all its chunks share: the length, the query rows and
    # the table line where the chunks of a short sequence all start. Every chunk asking sent hundreds of requests
    # for the same lines and ran 25-40% slower on steps of many one-tile chunks (impls.triton_fa's decode comment).
    if PREFETCH and split == 0:
        _prefetch_lookups(Q + batch * stride_qb, stride_qt, stride_qh, cache_seqlens + batch,
                          block_table + batch * stride_bt, kv_head, GROUP, SQ, BLOCK_M, HEAD_DIM, BLOCK_D)
    await_inputs(USE_PDL)
    seq_len = tl.load(cache_seqlens + batch)
    start = split * split_len
    if HAS_WINDOW:  # the chunks cut what the first new token's window sees, not the cache before it
        start += tl.maximum(seq_len - SQ - window_left, 0)
    if start >= seq_len:  # this sequence is shorter than the longest: nothing here (the combine skips it)
        return
    end = tl.minimum(start + split_len, seq_len)

    rows, head, token, row_valid = _query_rows(kv_head, GROUP, SQ, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)  # BLOCK_D: the head dim, or the power of two above it (padded with zeros)
    in_dims = offs_d < HEAD_DIM
    q_ptrs = Q + batch * stride_qb + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & in_dims[None, :], other=0.0)
    if F16_DOT:  # each row's power-of-two factor comes back out of its scores through the score scale
        q, row_down = _f16_rows(q)
        qk_scale = qk_scale * row_down[:, None]
    if DOT_FP32:  # Triton's interpreter computes half-precision dots wrongly
        q = q.to(tl.float32)
    last_visible = seq_len - SQ + token  # causal, bottom-right within the sequence

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = block_table + batch * stride_bt
    # A window's near edge: positions before the last new token's window (seq_len - 1 - window_left) are hidden
    # from some rows, so the chunk's tiles up to there are masked.
    free_from = start
    if HAS_WINDOW:
        hidden = tl.maximum(seq_len - 1 - window_left - start, 0)
        free_from = tl.minimum(start + tl.cdiv(hidden, BLOCK_N) * BLOCK_N, end)
        acc, l_i, m_i = _decode_tiles(
            q, acc, l_i, m_i, K_cache, V_cache, table_row, kv_head, start, free_from, end, last_visible, window_left,
            qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_FP32, True, HAS_WINDOW, SOFTCAP, KV_FP8, V_WORDS)
    # Whole tiles of positions that every new token sees (up to seq_len - SQ) run without a mask; only the
    # chunk's last tile (ragged, or holding the newest SQ - 1 positions) is masked.
    mask_from = free_from
    if MASK_FREE:
        mask_from = free_from + tl.maximum(tl.minimum(end, seq_len - SQ + 1) - free_from, 0) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _decode_tiles(
            q, acc, l_i, m_i, K_cache, V_cache, table_row, kv_head, free_from, mask_from, end, last_visible,
            window_left, qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_FP32, False, HAS_WINDOW, SOFTCAP, KV_FP8, V_WORDS)
    acc, l_i, m_i = _decode_tiles(
        q, acc, l_i, m_i, K_cache, V_cache, table_row, kv_head, mask_from, end, end, last_visible, window_left,
        qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_FP32, True, HAS_WINDOW, SOFTCAP, KV_FP8, V_WORDS)

    if KV_FP8:  # the values' scale, once per chunk (the combine is linear in the partial outputs)
        acc = acc * v_scale
    # The split's addresses are formed after its log-sum-exp, inside ``store_partials``: formed before it, they stay
    # live across it and the 2-warp (64, 3) tile spills 8 B (tests/test_triton_compile.py).
    if SPLIT:
        store_partials(acc, l_i, m_i, O_part + bk * stride_ob + split * stride_os, stride_or, offs_d,
                       LSE_part + (bk * tl.num_programs(0) + split) * BLOCK_M, rows, row_valid)
    else:
        store_output(acc, l_i, Out + batch * stride_b + token[:, None] * stride_t + head[:, None] * stride_h
                     + offs_d[None, :], row_valid, in_dims)


@triton.jit
def store_partials(acc, l_i, m_i, o_part, stride_or, offs_d, lse_part, rows, row_valid):
    """A split chunk's end: its normalised output rows and their log-sum-exp (log2 units, -inf where a row saw no
    key here) to the partials at ``o_part`` and ``lse_part``, for the combine."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
    tl.store(o_part + rows[:, None] * stride_or + offs_d[None, :], acc / l_safe[:, None], mask=row_valid[:, None])
    tl.store(lse_part + rows, lse, mask=row_valid)


@triton.jit
def store_output(acc, l_i, out_ptrs, row_valid, in_dims):
    """An unsplit sequence's end: its output rows themselves (``in_dims``: the head dim's columns of the tile)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(out_ptrs, (acc / l_safe[:, None]).to(out_ptrs.dtype.element_ty),
             mask=row_valid[:, None] & in_dims[None, :])


@triton.jit
def paged_decode_combine(
    O_part, LSE_part, cache_seqlens, Out,
    stride_ob, stride_os, stride_or,
    stride_b, stride_t, stride_h,
    num_kv_heads, num_splits, split_len, window_left,
    GROUP: tl.constexpr, SQ: tl.constexpr, BLOCK_M: tl.constexpr,
    MAX_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    USE_PDL: tl.constexpr = False, Out_rows=None,
):
    """Program (batch * kv head, row, head-dim slice): merge the row's chunks by log-sum-exp over BLOCK_D of
    its columns and write them to ``Out``. ``Out_rows``: where batch b's rows go, ``Out_rows[b]`` times stride_b
    (a mixed step's decoding sequences, one new token each, in its packed tokens); by default b.

    The log-sum-exps of all chunks fit in registers (one float each); the partial outputs are read SPLIT_CHUNK
    chunks at a time (``impls._plans.combine_plan``: with many chunks the slice narrows so that one step
    takes them all, instead of a loop of dependent loads).
    """
    await_inputs(USE_PDL)
    bk = tl.program_id(0)
    row = tl.program_id(1)
    batch = bk // num_kv_heads
    kv_head = bk % num_kv_heads
    seq_len = tl.load(cache_seqlens + batch)
    first = tl.maximum(seq_len - SQ - window_left, 0)  # where the split kernel's chunks start (UNBOUNDED: 0)
    used = tl.minimum(tl.cdiv(seq_len - first, split_len), num_splits)  # chunks that hold keys
    splits = tl.arange(0, MAX_SPLITS)
    lse = tl.load(LSE_part + (bk * num_splits + splits) * BLOCK_M + row, mask=splits < used, other=float("-inf"))
    lse_max = tl.max(lse, 0)  # the row saw a key somewhere: finite
    total = tl.sum(tl.math.exp2(lse - lse_max), 0)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    chunk = tl.arange(0, SPLIT_CHUNK)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(0, used, SPLIT_CHUNK):
        s = first + chunk
        keep = s < used
        weight = tl.math.exp2(tl.load(LSE_part + (bk * num_splits + s) * BLOCK_M + row, mask=keep,
                                      other=float("-inf")) - lse_max)
        parts = tl.load(O_part + bk * stride_ob + s[:, None] * stride_os + row * stride_or + offs_d[None, :],
                        mask=keep[:, None], other=0.0)
        acc += tl.sum(parts * weight[:, None], 0)
    head = kv_head * GROUP + row // SQ
    token = row % SQ
    out = (acc / total).to(Out.dtype.element_ty)
    out_row = batch
    if Out_rows is not None:
        out_row = tl.load(Out_rows + batch)
    tl.store(Out + out_row * stride_b + token * stride_t + head * stride_h + offs_d, out, mask=offs_d < HEAD_DIM)
