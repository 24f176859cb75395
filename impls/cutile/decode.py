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
   ``block_table[b, p // PAGE_SIZE]``. Three ways to read a key tile (GATHER):
   - ``ROWS``: gather it element by element through the table; any page size, and positions past the
     sequence are not loaded at all (they read zeros). Measured on an H200: at most 1.4 TB/s;
   - ``PAGES``: block loads (TMA on Hopper) of whole pages, or of the part of one page a tile lies in;
     a tile of several pages joins them;
   - ``INDEXED``: the tile's pages in one indexed load over the page axis (``ct.load_advanced_indexing``);
   - ``WORD_PAGES``: ``PAGES`` through a view of the caches as 32-bit words (pairs of 16-bit elements), each
     loaded part reinterpreted as the cache's dtype. For caches of 2**31 elements or more: cuTile indexes
     those in 64 bits, and then reads them without TMA (sm_90 SASS: no UTMALDG, twice the integer work),
     where the word view has half the elements and keeps 32-bit indexing; its SASS is a small cache's. On
     the H200: 8B 64 x 32K and 256 x 8K 3.58 / 3.63 -> 4.34 TB/s, 16 x 128K 3.62 -> 3.98.
   The last tile of a sequence is masked after loading, so that whatever the slots past its end hold (NaN
   included) never reaches the output; table entries past its last page are never followed.

4. Model variants: a sliding window of ``window_left`` keys (HAS_WINDOW) moves each sequence's first key tile
   to the one that holds the first position the first new token sees, so the chunks cut only the window and
   nothing before it is read; tiles across the window's edge are masked. SOFTCAP caps the scores (a tanh).
5. An fp8 cache is loaded as stored (half the bytes of a 16-bit one) and each tile widened to q's dtype after
   its load. The per-tensor scales stay out of the loop: ``k_scale`` is folded into ``qk_scale`` on the host,
   ``v_scale`` multiplies the chunk's output once (1 for any other cache). Under bf16 queries (F16_DOT) the
   dots run in fp16: e4m3 widens to fp16 in one instruction per two elements, to bf16 only through a second
   conversion. Each query row is first scaled by a power of two into fp16's range (``f16_rows``), so q is exact
   in fp16 and the scores are those of the bf16 dot; the probabilities gain precision (11 bits instead of 8).
6. Programmatic dependent launch (PDL, Hopper and later, where a step splits and the tuner found it faster: see
   ``serving.plan_candidates``): both kernels may start while the kernel before them in the stream still runs;
   each waits for it first (``await_inputs``) and lets its successor launch. The combine's launch hides behind the
   split kernel's last wave, about a microsecond a step (impls.triton_fa's decode space comment has the
   measurements of the Triton twin); on some steps that fill every SM slot the combine then ran 3x longer.

Causal within each sequence, bottom-right: new token ``t`` of ``SQ`` sees positions ``<= L - SQ + t`` (and,
windowed, ``>= L - SQ + t - window_left``).
Query row ``r`` of a tile is query head ``kv_head * GROUP + r // SQ``, new token ``r % SQ``.
"""

from __future__ import annotations

import math

import cuda.tile as ct

from impls._plans import F16_ROW_EXP
from impls.cutile.kernel import (
    ConstBool,
    ConstFloat,
    ConstInt,
    capped,
    finite,
    score_scale,
    softmax_step,
    with_int64_indexing,
)

ROWS, PAGES, INDEXED, WORD_PAGES = 0, 1, 2, 3  # GATHER: how a key tile is read from the pages (module docstring)
F32_BIAS, F32_MANTISSA_BITS = 127, 23


def await_inputs(PDL):
    """Under programmatic dependent launch: wait until the kernel before this one in the stream has finished and
    its writes are visible (SASS ``ACQBULK``), then let the next kernel launch (``PREEXIT``)."""
    if PDL:
        ct.grid_dependency_control_wait()
        ct.grid_dependency_control_launch_dependents()


@ct.kernel
def paged_decode_split(
    Q, KCache, VCache, BlockTable, CacheSeqlens, OutPart, LsePart, Out,
    qk_scale: float, num_kv_heads: int, split_len: int, window_left: int, v_scale: float,
    GROUP: ConstInt, SQ: ConstInt, TILE_M: ConstInt, TILE_N: ConstInt, TILE_D: ConstInt, PAGE_SIZE: ConstInt,
    GATHER: ConstInt, SPLIT: ConstBool, K_LATENCY: ConstInt, V_LATENCY: ConstInt, HAS_WINDOW: ConstBool,
    SOFTCAP: ConstFloat, F16_DOT: ConstBool, PDL: ConstBool,
):
    """Block (chunk, kv head, sequence): the GROUP x SQ query rows over one chunk of the cache. SPLIT: write
    the chunk's normalised output (B * Hkv, chunks, TILE_M, TILE_D) and log-sum-exp (B * Hkv, chunks,
    TILE_M) float32; otherwise (one chunk per sequence) the output rows themselves. F16_DOT (bf16 queries over
    an fp8 cache): the dots run in fp16. PDL: launched as a programmatic dependent of the kernel before it."""
    await_inputs(PDL)
    chunk = ct.bid(0)
    kv_head = ct.bid(1)
    batch = ct.bid(2)
    batch_kv = batch * num_kv_heads + kv_head  # the partials' row
    seq_len = ct.gather(CacheSeqlens, batch).item()

    rows = ct.arange(TILE_M, dtype=ct.int32)[:, None]
    token = rows % SQ
    head = kv_head * GROUP + rows // SQ
    real_row = rows < GROUP * SQ
    dims = ct.arange(TILE_D, dtype=ct.int32)
    q = ct.gather(Q, (batch, token, head, dims[None, :]), mask=real_row)  # dims past D read zeros
    row_down = None  # F16_DOT: what each row's scores are multiplied by first (its factor's inverse)
    if F16_DOT:
        q, row_down = f16_rows(q)
    last_visible = seq_len - SQ + token  # (TILE_M, 1): causal, bottom-right within the sequence

    m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((TILE_M, TILE_D), 0.0, dtype=ct.float32)
    score_scale_log2 = score_scale(qk_scale, SOFTCAP)
    # split_len is whole tiles; the chunks start at the tile that holds the first position read (first_tile)
    first = first_tile(seq_len, window_left, SQ, TILE_N) + chunk * (split_len // TILE_N)
    end = min(first + split_len // TILE_N, ct.cdiv(seq_len, TILE_N))
    # A window's near edge: tiles before the last new token's window (from L - 1 - window_left) are hidden from
    # some rows, so masked.
    free = first
    if HAS_WINDOW:
        free = max(first, min(end, ct.cdiv(max(seq_len - 1 - window_left, 0), TILE_N)))
        for j in range(first, free):
            acc, l_i, m_i = masked_fold(q, row_down, acc, l_i, m_i, KCache, VCache, BlockTable, batch, kv_head, j,
                                        seq_len, last_visible, window_left, dims, qk_scale, score_scale_log2, TILE_M,
                                        TILE_N, TILE_D, PAGE_SIZE, GATHER, K_LATENCY, V_LATENCY, HAS_WINDOW, SOFTCAP)
    # Tiles every new token sees whole (their last position <= L - SQ) need no mask; the rest are masked.
    whole = max(free, min(end, (seq_len - SQ + 1) // TILE_N))
    for j in range(free, whole):
        acc, l_i, m_i = whole_fold(q, row_down, acc, l_i, m_i, KCache, VCache, BlockTable, batch, kv_head, j, seq_len,
                                   dims, qk_scale, score_scale_log2, TILE_M, TILE_N, TILE_D, PAGE_SIZE, GATHER,
                                   K_LATENCY, V_LATENCY, SOFTCAP)
    for j in range(whole, end):
        acc, l_i, m_i = masked_fold(q, row_down, acc, l_i, m_i, KCache, VCache, BlockTable, batch, kv_head, j,
                                    seq_len, last_visible, window_left, dims, qk_scale, score_scale_log2, TILE_M,
                                    TILE_N, TILE_D, PAGE_SIZE, GATHER, K_LATENCY, V_LATENCY, HAS_WINDOW, SOFTCAP)

    l_safe = ct.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key in this chunk: output 0, weight 0
    acc = ct.truediv(acc * v_scale, l_safe)  # an fp8 cache's value scale (the combine is linear in the parts)
    if SPLIT:
        lse = ct.where(l_i == 0.0, -math.inf, m_i + ct.log2(l_safe))
        ct.store(OutPart, index=(batch_kv, chunk, 0, 0), tile=acc.reshape((1, 1, TILE_M, TILE_D)))
        ct.store(LsePart, index=(batch_kv, chunk, 0), tile=lse.reshape((1, 1, TILE_M)))
    else:
        ct.scatter(Out, (batch, token, head, dims[None, :]), acc.astype(Out.dtype), mask=real_row)


def f16_rows(q):
    """A bf16 query tile as fp16, each row multiplied by a power of two that brings its largest |q| to
    [2**13, 2**14), and the inverse of each row's factor (TILE_M, 1) fp32, for its scores. A power of two
    changes no significand bit, so every element down to 2**-27 of its row's largest is exact in fp16 (bf16's 8
    significant bits fit fp16's 11); the smaller ones move a score by less than 2**-27 of its largest term."""
    wide = q.astype(ct.float32)
    amax = ct.max(ct.abs(wide), axis=-1, keepdims=True)
    # The biased fp32 exponent of each row's largest |q|, floored so that both factors stay normal (an all-zero
    # row, which padding rows are, gets the floor).
    exp = ct.bitwise_and(ct.bitwise_rshift(ct.bitcast(amax, ct.int32), F32_MANTISSA_BITS), 0xFF)
    exp = ct.maximum(exp, F16_ROW_EXP + 1)
    up = ct.bitcast(ct.bitwise_lshift(2 * F32_BIAS + F16_ROW_EXP - exp, F32_MANTISSA_BITS), ct.float32)
    down = ct.bitcast(ct.bitwise_lshift(exp - F16_ROW_EXP, F32_MANTISSA_BITS), ct.float32)
    return (wide * up).astype(ct.float16), down


def first_tile(seq_len, window_left, SQ, TILE_N):
    """The key tile that holds the first position a sequence's new tokens see: 0, or with a window of
    ``window_left`` keys (UNBOUNDED: none) the tile of position L - SQ - window_left."""
    return max(seq_len - SQ - window_left, 0) // TILE_N


def whole_fold(q, row_down, acc, l_i, m_i, KCache, VCache, BlockTable, batch, kv_head, j, seq_len, dims, qk_scale,
               score_scale_log2, TILE_M, TILE_N, TILE_D, PAGE_SIZE, GATHER, K_LATENCY, V_LATENCY, SOFTCAP):
    """Key tile j into the online softmax (``tile_scores``' rows) where every row sees the whole tile: no mask."""
    k, v = key_tile(KCache, VCache, BlockTable, batch, kv_head, j, seq_len, dims, TILE_N, TILE_D, PAGE_SIZE, GATHER,
                    False, K_LATENCY, V_LATENCY, q.dtype)
    qk = tile_scores(q, k, row_down, qk_scale, SOFTCAP, TILE_M, TILE_N)
    return fold(acc, l_i, m_i, qk, v, score_scale_log2, False)


def masked_fold(q, row_down, acc, l_i, m_i, KCache, VCache, BlockTable, batch, kv_head, j, seq_len, last_visible,
                window_left, dims, qk_scale, score_scale_log2, TILE_M, TILE_N, TILE_D, PAGE_SIZE, GATHER, K_LATENCY,
                V_LATENCY, HAS_WINDOW, SOFTCAP):
    """Key tile j into the online softmax (``tile_scores``' rows), each row's positions past its ``last_visible``
    (past the sequence too) and, HAS_WINDOW, more than ``window_left`` before it, hidden."""
    k, v = key_tile(KCache, VCache, BlockTable, batch, kv_head, j, seq_len, dims, TILE_N, TILE_D,
                    PAGE_SIZE, GATHER, True, K_LATENCY, V_LATENCY, q.dtype)
    qk = tile_scores(q, k, row_down, qk_scale, SOFTCAP, TILE_M, TILE_N)
    positions = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[None, :]
    visible = positions <= last_visible
    if HAS_WINDOW:
        visible = visible & (positions >= last_visible - window_left)
    return fold(acc, l_i, m_i, ct.where(visible, qk, -math.inf), v, score_scale_log2, True)


def tile_scores(q, k, row_down, qk_scale, SOFTCAP, TILE_M, TILE_N):
    """Q K^T of a key tile in fp32, each row multiplied by ``row_down`` (``f16_rows``' inverse factors; None: q as
    loaded), then capped where SOFTCAP. The factors go in here, before any mask, and not into the softmax's scale:
    a factor that underflows to 0 (an all-zero row's) would meet a hidden key's -inf there, and -inf * 0 is NaN."""
    qk = ct.mma(q, k, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
    if row_down is not None:
        qk = qk * row_down
    return capped(qk, qk_scale, SOFTCAP, True)


def key_tile(KCache, VCache, BlockTable, batch, kv_head, j, seq_len, dims, TILE_N, TILE_D, PAGE_SIZE, GATHER,
             MASKED, K_LATENCY, V_LATENCY, dtype):
    """Key tile j of a sequence: K as (TILE_D, TILE_N) for Q K^T, V as (TILE_N, TILE_D), of ``dtype`` (an fp8
    cache's tiles widened to it; a no-op for a cache of that dtype); where MASKED, positions past the sequence
    are zeros in V, so that P V never multiplies what an unused slot holds."""
    if GATHER == ROWS:
        positions = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)
        in_seq = positions < seq_len
        page = ct.gather(BlockTable, (batch, positions // PAGE_SIZE), mask=in_seq)
        slot = positions % PAGE_SIZE
        k = ct.gather(KCache, (page[None, :], slot[None, :], kv_head, dims[:, None]), mask=in_seq[None, :],
                      latency=K_LATENCY)
        v = ct.gather(VCache, (page[:, None], slot[:, None], kv_head, dims[None, :]), mask=in_seq[:, None],
                      latency=V_LATENCY)
    else:
        if GATHER == INDEXED:
            k, v = indexed_pages(KCache, VCache, BlockTable, batch, kv_head, j, seq_len, TILE_N, TILE_D, PAGE_SIZE,
                                 K_LATENCY, V_LATENCY)
        else:
            k, v = page_loads(KCache, VCache, BlockTable, batch, kv_head, j, seq_len, TILE_N, TILE_D, PAGE_SIZE,
                              K_LATENCY, V_LATENCY, dtype if GATHER == WORD_PAGES else None)
    k, v = k.astype(dtype), v.astype(dtype)
    if MASKED and GATHER != ROWS:  # (a row gather reads zeros past the sequence)
        positions = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[:, None]
        v = ct.where(positions < seq_len, v, 0.0)  # an unused slot may hold NaN, and 0 * NaN is NaN
    return k, v


def page_of(BlockTable, batch, page_index, seq_len, PAGE_SIZE):
    """The cache page that holds page ``page_index`` of the sequence (a scalar or a tile of them); page 0
    where the sequence has no such page, since table entries past its last page may hold anything."""
    page = ct.gather(BlockTable, (batch, page_index))
    return ct.where(page_index * PAGE_SIZE < seq_len, page, 0)


def page_loads(KCache, VCache, BlockTable, batch, kv_head, j, seq_len, TILE_N, TILE_D, PAGE_SIZE, K_LATENCY,
               V_LATENCY, words_of=None):
    """PAGES: key tile j as block loads (TMA on Hopper): the part of one page it lies in, or the
    TILE_N / PAGE_SIZE whole pages it spans, concatenated. ``words_of``: the caches are 32-bit word views
    (WORD_PAGES) of this dtype."""
    rows = min(TILE_N, PAGE_SIZE)  # rows per load
    k_parts = ()
    v_parts = ()
    for part in ct.static_iter(range(TILE_N // rows)):
        first = j * TILE_N + part * rows  # the part's first position
        page = page_of(BlockTable, batch, first // PAGE_SIZE, seq_len, PAGE_SIZE).item()
        in_page = first % PAGE_SIZE // rows  # the part's index within its page, in units of ``rows``
        if words_of is None:
            k_parts += (ct.load(KCache, index=(page, 0, kv_head, in_page), shape=(1, TILE_D, 1, rows),
                                order=(0, 3, 2, 1), latency=K_LATENCY,
                                padding_mode=ct.PaddingMode.ZERO).reshape((TILE_D, rows)),)
            v_parts += (ct.load(VCache, index=(page, in_page, kv_head, 0), shape=(1, rows, 1, TILE_D),
                                latency=V_LATENCY, padding_mode=ct.PaddingMode.ZERO).reshape((rows, TILE_D)),)
        else:
            k_parts += (ct.transpose(page_words(KCache, page, in_page, kv_head, rows, TILE_D, K_LATENCY, words_of)),)
            v_parts += (page_words(VCache, page, in_page, kv_head, rows, TILE_D, V_LATENCY, words_of),)
    return concatenate(k_parts, 1), concatenate(v_parts, 0)


def page_words(Cache, page, in_page, kv_head, rows, TILE_D, latency, dtype):
    """``rows`` positions of one page of a 32-bit word view of a cache, as a (rows, TILE_D) tile of ``dtype``
    (each word holds two elements, the first in its low half: the bytes in memory order)."""
    words = ct.load(Cache, index=(page, in_page, kv_head, 0), shape=(1, rows, 1, TILE_D // 2), latency=latency,
                    padding_mode=ct.PaddingMode.ZERO)
    return ct.unpack_from_bytes(ct.pack_to_bytes(words), dtype).reshape((rows, TILE_D))


def concatenate(parts, axis):
    """One tile of a power-of-two number of equal tiles, joined pairwise along ``axis``."""
    for _ in ct.static_iter(range(len(parts).bit_length() - 1)):
        joined = ()
        for i in ct.static_iter(range(len(parts) // 2)):
            joined += (ct.cat((parts[2 * i], parts[2 * i + 1]), axis),)
        parts = joined
    return parts[0]


def indexed_pages(KCache, VCache, BlockTable, batch, kv_head, j, seq_len, TILE_N, TILE_D, PAGE_SIZE, K_LATENCY,
                  V_LATENCY):
    """INDEXED: the TILE_N / PAGE_SIZE pages of key tile j in one indexed load over the page axis."""
    pages = TILE_N // PAGE_SIZE
    page = page_of(BlockTable, batch, j * pages + ct.arange(pages, dtype=ct.int32), seq_len, PAGE_SIZE)
    where = (page, ct.Slice(0, PAGE_SIZE), ct.Slice(kv_head, 1), ct.Slice(0, TILE_D))
    k = ct.load_advanced_indexing(KCache, where, padding_mode=ct.PaddingMode.ZERO, latency=K_LATENCY)
    v = ct.load_advanced_indexing(VCache, where, padding_mode=ct.PaddingMode.ZERO, latency=V_LATENCY)
    return ct.transpose(k.reshape((TILE_N, TILE_D))), v.reshape((TILE_N, TILE_D))


def fold(acc, l_i, m_i, qk, v, score_scale_log2, MAY_BE_EMPTY):
    """The dense kernel's online softmax step (kernel.softmax_step) on a tile already loaded, then P V."""
    p, alpha, l_i, m_new = softmax_step(qk, l_i, m_i, score_scale_log2, MAY_BE_EMPTY, True)
    return ct.mma(p.astype(v.dtype), v, acc * alpha), l_i, m_new


@ct.kernel
def paged_decode_combine(
    OutPart, LsePart, CacheSeqlens, Out,
    num_kv_heads: int, split_len: int, window_left: int,
    GROUP: ConstInt, SQ: ConstInt, TILE_D: ConstInt, CHUNKS: ConstInt, TILE_N: ConstInt, PDL: ConstBool,
):
    """Block (batch * kv head, row, head-dim slice): merge the row's chunks by log-sum-exp over TILE_D of its
    columns, CHUNKS chunks per step, and write them to ``Out``. Only the chunks that hold keys of this sequence
    are read (a short sequence of a long-tailed batch has few). ``impls._plans.combine_plan`` narrows the
    slice when there are many chunks (a long cache at batch 1: hundreds), so that one step takes them all and
    the row is merged by several blocks at once instead of one block looping over dependent loads."""
    await_inputs(PDL)
    batch_kv = ct.bid(0)
    row = ct.bid(1)
    column = ct.bid(2)
    batch = batch_kv // num_kv_heads
    kv_head = batch_kv % num_kv_heads
    seq_len = ct.gather(CacheSeqlens, batch).item()
    read = seq_len - first_tile(seq_len, window_left, SQ, TILE_N) * TILE_N  # from the split kernel's first tile
    used = min(ct.cdiv(read, split_len), OutPart.shape[1])

    m = ct.full((1, 1), -math.inf, dtype=ct.float32)
    total = ct.full((1, 1), 0.0, dtype=ct.float32)
    acc = ct.full((1, TILE_D), 0.0, dtype=ct.float32)
    for step in range(ct.cdiv(used, CHUNKS)):  # the softmax's running-max merge, CHUNKS chunks at a time
        real = (step * CHUNKS + ct.arange(CHUNKS, dtype=ct.int32))[:, None] < used  # past ``used``: unwritten
        lse = ct.load(LsePart, index=(batch_kv, step, row), shape=(1, CHUNKS, 1),
                      padding_mode=ct.PaddingMode.ZERO).reshape((CHUNKS, 1))
        part = ct.load(OutPart, index=(batch_kv, step, row, column), shape=(1, CHUNKS, 1, TILE_D),
                       padding_mode=ct.PaddingMode.ZERO).reshape((CHUNKS, TILE_D))
        lse = ct.where(real, lse, -math.inf)
        m_new = ct.maximum(m, ct.max(lse, axis=0, keepdims=True))
        m_ref = finite(m_new, True)  # the row may have seen no key in the chunks so far (several new tokens)
        alpha = ct.exp2(m - m_ref)
        weight = ct.exp2(lse - m_ref)
        acc = acc * alpha + ct.sum(ct.where(real, part, 0.0) * weight, axis=0, keepdims=True)
        total = total * alpha + ct.sum(weight, axis=0, keepdims=True)
        m = m_new

    dims = column * TILE_D + ct.arange(TILE_D, dtype=ct.int32)[None, :]
    out = ct.truediv(acc, ct.where(total == 0.0, 1.0, total)).astype(Out.dtype)
    ct.scatter(Out, (batch, row % SQ, kv_head * GROUP + row // SQ, dims), out)


# A cache of 2**31 elements or more (64 sequences of 32K tokens, 8 kv heads of 128) needs 64-bit offsets.
paged_decode_split_int64 = with_int64_indexing(paged_decode_split, ("KCache", "VCache"))
