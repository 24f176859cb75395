"""FlashAttention-2 backward in Triton: three kernels over the forward's inputs, output and log-sum-exp.

1. ``bwd_delta``: ``delta = rowsum(do * o)`` per query row, float32 (the softmax Jacobian's row term).
2. ``bwd_dkdv``: one program per BLOCK_N tile of keys of one (batch, kv head). It walks every query head of the
   kv head's group (so dk and dv sum over GQA groups without atomics) and their query tiles, recomputing
   ``p = exp(s - lse)`` from q, k and the forward's lse, and accumulates ``dv += p^T do`` and
   ``dk += ds^T q`` with ``ds = p * (do v^T - delta)`` in float32.
3. ``bwd_dq``: one program per BLOCK_M tile of query rows of one (batch, query head): it walks the key tiles
   the rows see and accumulates ``dq += ds k``.
Probabilities are recomputed in natural units from the given lse. Causal is bottom-right (query i sees keys
j <= i + Skv - Sq) and is a sliding window's right side of 0: row i sees keys from its position - left to its
position + right, so a key tile walks only the query tiles that reach it and a query tile only the key tiles it
reaches; a row that sees no key has lse = +inf, so its p is 0. Softcap ``s = c tanh(x / c)`` scales ``ds`` by its
slope ``1 - tanh^2``. ``fwd_lse`` is the forward a training step runs first: o and the lse this backward reads.
Every tensor is contiguous (B, H, S, D), or under PACKED documents packed as (total, H, D) rows with cu_seqlens:
each program reads its document's first row and length from cu_seqlens (the grid is sized for the longest; a
program past its document's end returns) and steps H rows of the packed tensor from one of a head's rows to the
next; lse and delta are (B, H, S) or (total, H), one value per row of q in its order. A head dim that is not a power
of two is padded to BLOCK_D with zeros by masked loads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from impls._plans import timed_here
from impls._registry import FLOATS, Prepared, heads_by_batch, length_class, register
from impls.contract import NO_WINDOW, UNBOUNDED, Backward, window_bounds
from impls.triton_fa.config import HEAD_DIMS, TUNING, block_d, interpreting, requires
from impls.tuning import fastest

DELTA_ROWS = 64  # rows of do * o each program of the pre-pass sums
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): one natural-log unit in base 2


@triton.jit
def _tile(ptr, offs_r, stride, offs_d, length, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FP32: tl.constexpr,
          TRANSPOSED: tl.constexpr = False):
    """The (len(offs_r), BLOCK_D) tile of rows ``offs_r`` of a head at ``ptr`` whose rows are ``stride`` rows of
    HEAD_DIM apart (``_head_rows``), as float32 where ``FP32``, or its (BLOCK_D, len(offs_r)) transpose loaded as
    such where ``TRANSPOSED`` (a dot's right operand, with no shuffle of a register tile); rows past ``length`` and
    padded columns read zeros."""
    rows = offs_r[None, :] if TRANSPOSED else offs_r[:, None]
    cols = offs_d[:, None] if TRANSPOSED else offs_d[None, :]
    mask = rows < length
    if BLOCK_D != HEAD_DIM:
        mask = mask & (cols < HEAD_DIM)
    t = tl.load(ptr + (rows * stride) * HEAD_DIM + cols, mask=mask, other=0.0)
    return t.to(tl.float32) if FP32 else t


@triton.jit
def _key_tiles(K, V, kv_base, offs_n, kv_stride, offs_d, kv_len, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               FP32: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """The K and V tiles of key rows ``offs_n`` of the kv head whose rows start at ``kv_base`` (``_tile``)."""
    return (_tile(K + kv_base * HEAD_DIM, offs_n, kv_stride, offs_d, kv_len, HEAD_DIM, BLOCK_D, FP32, TRANSPOSED),
            _tile(V + kv_base * HEAD_DIM, offs_n, kv_stride, offs_d, kv_len, HEAD_DIM, BLOCK_D, FP32, TRANSPOSED))


@triton.jit
def _store_tile(ptr, value, offs_r, stride, offs_d, length, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                ADD: tl.constexpr = False):
    """Stores a tile as ``_tile`` addresses it; ``ADD``: adds it atomically (float32), as programs that share
    the rows do."""
    mask = offs_r[:, None] < length
    if BLOCK_D != HEAD_DIM:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    ptrs = ptr + (offs_r[:, None] * stride) * HEAD_DIM + offs_d[None, :]
    if ADD:
        tl.atomic_add(ptrs, value, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """``a @ b`` accumulated in float32; half inputs stay half on a GPU (the interpreter's half dots are wrong)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tanh(x, EXACT: tl.constexpr):
    """tanh in float32; ``EXACT``: through float64. ``2 sigmoid(2x) - 1`` (the forward kernel's form) is off by
    float32's rounding of a value near 1, 1e-4 relative at small x, below 16-bit inputs' noise; at float32 inputs
    under a softcap of 20 it put a training step's dq over the oracle's tolerance (1.05x; 0.65x through float64)."""
    if EXACT:
        e = tl.exp(-2 * tl.abs(x.to(tl.float64)))
        return tl.where(x < 0, -1.0, 1.0) * ((1 - e) / (1 + e)).to(tl.float32)
    return 2 * tl.sigmoid(2 * x) - 1


@triton.jit
def _exp(x, LOG2: tl.constexpr):
    return tl.math.exp2(x) if LOG2 else tl.exp(x)


@triton.jit
def _units(LOG2: tl.constexpr):
    """What one natural-log unit is in the kernels' units: log2(e) in base 2, else 1."""
    return LOG2E if LOG2 else 1.0


@triton.jit
def _full_span(lo, hi, first, end, BLOCK: tl.constexpr):
    """Of the tiles walked from ``lo`` (a multiple of BLOCK) to ``hi``, the run ``[full_lo, full_hi)`` of those
    that start at ``first`` or later and end by ``end`` (the run reaches ``hi`` where ``end`` does): they run
    without a mask, the tiles before and after the run with one."""
    full_lo = tl.minimum(tl.cdiv(tl.maximum(first, lo), BLOCK) * BLOCK, hi)
    full_hi = tl.where(end >= hi, hi, tl.maximum(end, 0) // BLOCK * BLOCK)
    return full_lo, tl.maximum(full_hi, full_lo)


@triton.jit
def _key_spans(start_m, q_len, kv_len, window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               RAGGED: tl.constexpr):
    """The key tiles ``[lo, hi)`` that some row of the query tile at ``start_m`` sees, and within them the run
    every row sees whole (``_full_span``): row i sits at key position i + kv_len - q_len (bottom-right) and sees the
    keys from its position - left to its position + right. ``RAGGED``: a last key tile that passes kv_len is
    masked too (the forward's; a backward's zero-filled keys add nothing to dq)."""
    first = start_m + (kv_len - q_len)
    lo = tl.maximum(first - window_left, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(kv_len, tl.maximum(first + BLOCK_M + window_right, 0))
    end = first + window_right + 1  # the first row's right edge; the last row's left edge starts the run
    if RAGGED:
        end = tl.minimum(end, kv_len // BLOCK_N * BLOCK_N)
    full_lo, full_hi = _full_span(lo, hi, first + BLOCK_M - 1 - window_left, end, BLOCK_N)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_spans(start_n, q_len, kv_len, window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The query tiles ``[lo, hi)`` whose rows see some key of the key tile at ``start_n``, and the run of them
    that sees the tile whole: the rows at positions from start_n - right to the tile's last key + left. Rows past
    q_len need no mask: their lse is +inf, so their p is 0."""
    offset = kv_len - q_len
    lo = tl.maximum(start_n - window_right - offset, 0) // BLOCK_M * BLOCK_M
    hi = tl.minimum(q_len, tl.maximum(start_n + BLOCK_N + window_left - offset, 0))
    full_lo, full_hi = _full_span(lo, hi, start_n + BLOCK_N - 1 - window_right - offset,
                                  start_n + window_left + 1 - offset, BLOCK_M)
    return lo, full_lo, full_hi, hi


@triton.jit
def _scores(s, rows, keys, q_len, kv_len, window_left, window_right, scale, MASK: tl.constexpr,
            SOFTCAP: tl.constexpr, LOG2: tl.constexpr, EXACT: tl.constexpr):
    """Raw scores ``s`` as the kernels' scores in their units (``_units``), ``cap * tanh(x / cap)`` under SOFTCAP,
    and the softcap's slope ``1 - tanh^2`` (1 without one). ``rows`` and ``keys`` index s's two axes (either may be
    the first: the dk/dv kernel works on s^T); under MASK a pair whose key the row does not see, or that is out of
    bounds, scores -inf."""
    if SOFTCAP > 0:
        t = _tanh(s * (scale / SOFTCAP), EXACT)
        s = t * (SOFTCAP * _units(LOG2))
        slope = 1 - t * t
    else:
        s = s * (scale * _units(LOG2))
        slope = 1.0
    if MASK:
        position = rows + (kv_len - q_len)
        seen = (keys < kv_len) & (keys >= position - window_left) & (keys <= position + window_right)
        s = tl.where(seen, s, float("-inf"))
    return s, slope


@triton.jit
def _sequence(CuSeqlens, batch, q_len, kv_len, PACKED: tl.constexpr):
    """Sequence ``batch``'s first packed row (64-bit) and its query and key lengths: under PACKED, its document's
    from cu_seqlens (a document attends to itself), else 0 and the dense lengths."""
    if PACKED:
        start = tl.load(CuSeqlens + batch).to(tl.int64)
        length = (tl.load(CuSeqlens + batch + 1) - start).to(tl.int32)
        return start, length, length
    return batch * 0, q_len, kv_len


@triton.jit
def _head_rows(start, batch, head, num_heads, length, PACKED: tl.constexpr):
    """Where ``head``'s rows of one sequence start, in rows of HEAD_DIM (lse's and delta's index of its first row),
    and how many rows apart two consecutive ones are: dense (B, H, S, D) keeps a head's rows together, packed
    (total, H, D) interleaves the H heads from the document's first row ``start`` (64-bit: rows x D pass 2**31)."""
    if PACKED:
        return start * num_heads + head, num_heads
    return (batch * num_heads + head) * length, 1


@triton.jit
def _query_tile(CuSeqlens, num_heads, q_len, kv_len, group, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                PACKED: tl.constexpr):
    """This program's query tile, on a grid of (query tiles, query heads, batch): its first row, its rows and
    columns, its sequence's lengths, and where its head's rows and its kv head's rows start and step."""
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    start, q_len, kv_len = _sequence(CuSeqlens, batch, q_len, kv_len, PACKED)
    start_m = tl.program_id(0) * BLOCK_M
    row_base, row_stride = _head_rows(start, batch, head, num_heads, q_len, PACKED)
    kv_base, kv_stride = _head_rows(start, batch, head // group, num_heads // group, kv_len, PACKED)
    return (start_m, start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D), q_len, kv_len, row_base, row_stride,
            kv_base, kv_stride)


@triton.jit
def _row_terms(LSE, Delta, row_base, offs_m, row_stride, q_len, LOG2: tl.constexpr):
    """A query tile's lse in the kernels' units (+inf past the rows: their p is 0), and its delta."""
    lse = tl.load(LSE + row_base + offs_m * row_stride, mask=offs_m < q_len, other=float("inf"))
    delta = tl.load(Delta + row_base + offs_m * row_stride, mask=offs_m < q_len, other=0.0)
    return lse * _units(LOG2), delta


@triton.jit
def _forward_step(q, K, V, kv_base, kv_stride, offs_m, offs_d, start_n, m_i, l_i, acc, q_len, kv_len, window_left,
                  window_right, scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, LOG2: tl.constexpr, MASK: tl.constexpr):
    """One key tile of the online softmax: the running max ``m_i`` and sum ``l_i`` in the kernels' units."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_t, v = (_tile(K + kv_base * HEAD_DIM, offs_n, kv_stride, offs_d, kv_len, HEAD_DIM, BLOCK_D, DOT_FP32, True),
              _tile(V + kv_base * HEAD_DIM, offs_n, kv_stride, offs_d, kv_len, HEAD_DIM, BLOCK_D, DOT_FP32))
    s, _ = _scores(_dot(q, k_t, DOT_FP32), offs_m[:, None], offs_n[None, :], q_len, kv_len, window_left,
                   window_right, scale, MASK, SOFTCAP, LOG2, DOT_FP32)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: no NaN
    p = _exp(s - m_safe[:, None], LOG2)
    alpha = _exp(m_i - m_safe, LOG2)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)


@triton.jit
def fwd_lse(
    Q, K, V, Out, LSE, CuSeqlens, scale,
    num_heads, q_len, kv_len, group, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, LOG2: tl.constexpr, PACKED: tl.constexpr, LEFT: tl.constexpr,
    RIGHT: tl.constexpr,
):
    """The forward a training step runs before this backward: ``o`` and the natural-log ``lse`` of each row
    (``+inf`` where a row sees no key), by an online softmax over the key tiles the rows see, masked only where
    some pair is not seen (``_key_spans``)."""
    start_m, offs_m, offs_d, q_len, kv_len, row_base, row_stride, kv_base, kv_stride = _query_tile(
        CuSeqlens, num_heads, q_len, kv_len, group, BLOCK_M, BLOCK_D, PACKED)
    if start_m >= q_len:  # past its document's end: the grid is sized for the longest
        return
    q = _tile(Q + row_base * HEAD_DIM, offs_m, row_stride, offs_d, q_len, HEAD_DIM, BLOCK_D, DOT_FP32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_spans(start_m, q_len, kv_len, window_left, window_right, BLOCK_M, BLOCK_N, True)
    if LEFT:
        for start_n in range(lo, full_lo, BLOCK_N):
            m_i, l_i, acc = _forward_step(q, K, V, kv_base, kv_stride, offs_m, offs_d, start_n, m_i, l_i, acc,
                                          q_len, kv_len, window_left, window_right, scale, HEAD_DIM, BLOCK_D, BLOCK_N,
                                          SOFTCAP, DOT_FP32, LOG2, MASK=True)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        m_i, l_i, acc = _forward_step(q, K, V, kv_base, kv_stride, offs_m, offs_d, start_n, m_i, l_i, acc, q_len,
                                      kv_len, window_left, window_right, scale, HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP,
                                      DOT_FP32, LOG2, MASK=False)
    for start_n in range(full_hi, hi, BLOCK_N):
        m_i, l_i, acc = _forward_step(q, K, V, kv_base, kv_stride, offs_m, offs_d, start_n, m_i, l_i, acc, q_len,
                                      kv_len, window_left, window_right, scale, HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP,
                                      DOT_FP32, LOG2, MASK=True)
    seen = l_i > 0
    _store_tile(Out + row_base * HEAD_DIM, acc / tl.where(seen, l_i, 1.0)[:, None], offs_m, row_stride, offs_d, q_len,
                HEAD_DIM, BLOCK_D)
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + (tl.math.log2(l_safe) if LOG2 else tl.log(l_safe))) / _units(LOG2), float("inf"))
    tl.store(LSE + row_base + offs_m * row_stride, lse, mask=offs_m < q_len)


@triton.jit
def bwd_delta(Out, DO, Delta, rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """``delta = rowsum(do * o)`` over the flattened (B * H * Sq, HEAD_DIM) rows (packed: (total * H, HEAD_DIM)),
    so in lse's layout."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _tile(Out, offs_m, 1, offs_d, rows, HEAD_DIM, BLOCK_D, True)
    do = _tile(DO, offs_m, 1, offs_d, rows, HEAD_DIM, BLOCK_D, True)
    tl.store(Delta + offs_m, tl.sum(o * do, 1), mask=offs_m < rows)


@triton.jit
def _dkdv_step(k, v, Q, DO, LSE, Delta, row_base, row_stride, offs_n, offs_d, start_m, dk, dv, q_len, kv_len,
               window_left, window_right, scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, LOG2: tl.constexpr, MASK: tl.constexpr):
    """One query tile against this program's key tile, in the transposed frame: ``s^T = k q^T``, so that ``p^T``
    and ``ds^T`` are the left operands of ``dv += p^T do`` and ``dk += ds^T q`` as they come out of their dots."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q_t = _tile(Q + row_base * HEAD_DIM, offs_m, row_stride, offs_d, q_len, HEAD_DIM, BLOCK_D, DOT_FP32, True)
    do = _tile(DO + row_base * HEAD_DIM, offs_m, row_stride, offs_d, q_len, HEAD_DIM, BLOCK_D, DOT_FP32)
    lse, delta = _row_terms(LSE, Delta, row_base, offs_m, row_stride, q_len, LOG2)
    s_t, slope = _scores(_dot(k, q_t, DOT_FP32), offs_m[None, :], offs_n[:, None], q_len, kv_len, window_left,
                         window_right, scale, MASK, SOFTCAP, LOG2, DOT_FP32)
    p_t = _exp(s_t - lse[None, :], LOG2)
    dv += _dot(p_t.to(do.dtype), do, DOT_FP32)
    ds_t = p_t * (_dot(v, tl.trans(do), DOT_FP32) - delta[None, :]) * slope
    dk += _dot(ds_t.to(q_t.dtype), tl.trans(q_t), DOT_FP32)
    return dk, dv


@triton.jit
def bwd_dkdv(
    Q, K, V, DO, LSE, Delta, DK, DV, CuSeqlens, scale,
    num_heads, q_len, kv_len, group, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, LOG2: tl.constexpr, PACKED: tl.constexpr, LEFT: tl.constexpr,
    RIGHT: tl.constexpr,
    SPLIT: tl.constexpr = True, HEAD_SPLITS: tl.constexpr = 1,
):
    # Grid: (key tiles, kv heads x HEAD_SPLITS, batch); each program walks its share of the kv head's group.
    kv_head = (tl.program_id(1) // HEAD_SPLITS).to(tl.int64)
    heads = group // HEAD_SPLITS
    first_head = kv_head * group + tl.program_id(1) % HEAD_SPLITS * heads
    batch = tl.program_id(2).to(tl.int64)
    start, q_len, kv_len = _sequence(CuSeqlens, batch, q_len, kv_len, PACKED)
    start_n = tl.program_id(0) * BLOCK_N
    if start_n >= kv_len:  # past its document's end: the grid is sized for the longest
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_base, kv_stride = _head_rows(start, batch, kv_head, num_heads // group, kv_len, PACKED)
    k, v = _key_tiles(K, V, kv_base, offs_n, kv_stride, offs_d, kv_len, HEAD_DIM, BLOCK_D, DOT_FP32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _query_spans(start_n, q_len, kv_len, window_left, window_right, BLOCK_M, BLOCK_N)
    for h in range(0, heads):  # query heads of this kv head's group: dk and dv sum over them here
        row_base, row_stride = _head_rows(start, batch, first_head + h, num_heads, q_len, PACKED)
        if SPLIT:  # the tiles whole (most of them) without a mask, the others with one
            if RIGHT:
                for start_m in range(lo, full_lo, BLOCK_M):
                    dk, dv = _dkdv_step(k, v, Q, DO, LSE, Delta, row_base, row_stride, offs_n, offs_d, start_m, dk,
                                        dv, q_len, kv_len, window_left, window_right, scale, HEAD_DIM, BLOCK_D,
                                        BLOCK_M, SOFTCAP, DOT_FP32, LOG2, MASK=True)
            for start_m in range(full_lo, full_hi, BLOCK_M):
                dk, dv = _dkdv_step(k, v, Q, DO, LSE, Delta, row_base, row_stride, offs_n, offs_d, start_m, dk, dv,
                                    q_len, kv_len, window_left, window_right, scale, HEAD_DIM, BLOCK_D, BLOCK_M,
                                    SOFTCAP, DOT_FP32, LOG2, MASK=False)
            if LEFT:
                for start_m in range(full_hi, hi, BLOCK_M):
                    dk, dv = _dkdv_step(k, v, Q, DO, LSE, Delta, row_base, row_stride, offs_n, offs_d, start_m, dk,
                                        dv, q_len, kv_len, window_left, window_right, scale, HEAD_DIM, BLOCK_D,
                                        BLOCK_M, SOFTCAP, DOT_FP32, LOG2, MASK=True)
        else:  # one loop, every tile masked: each loop compiled holds registers, and at head dim 128 two spill
            for start_m in range(lo, hi, BLOCK_M):
                dk, dv = _dkdv_step(k, v, Q, DO, LSE, Delta, row_base, row_stride, offs_n, offs_d, start_m, dk, dv,
                                    q_len, kv_len, window_left, window_right, scale, HEAD_DIM, BLOCK_D, BLOCK_M,
                                    SOFTCAP, DOT_FP32, LOG2, MASK=True)
    _store_tile(DK + kv_base * HEAD_DIM, dk * scale, offs_n, kv_stride, offs_d, kv_len, HEAD_DIM, BLOCK_D,
                HEAD_SPLITS > 1)
    _store_tile(DV + kv_base * HEAD_DIM, dv, offs_n, kv_stride, offs_d, kv_len, HEAD_DIM, BLOCK_D, HEAD_SPLITS > 1)


@triton.jit
def _dq_step(q, do, lse, delta, K, V, kv_base, kv_stride, offs_m, offs_d, start_n, dq, q_len, kv_len, window_left,
             window_right, scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
             SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, LOG2: tl.constexpr, MASK: tl.constexpr):
    """One key tile against this program's query tile: ``dq += ds k``, K and V loaded transposed for the dots."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_t, v_t = _key_tiles(K, V, kv_base, offs_n, kv_stride, offs_d, kv_len, HEAD_DIM, BLOCK_D, DOT_FP32, True)
    s, slope = _scores(_dot(q, k_t, DOT_FP32), offs_m[:, None], offs_n[None, :], q_len, kv_len, window_left,
                       window_right, scale, MASK, SOFTCAP, LOG2, DOT_FP32)
    p = _exp(s - lse[:, None], LOG2)
    ds = p * (_dot(do, v_t, DOT_FP32) - delta[:, None]) * slope
    return dq + _dot(ds.to(k_t.dtype), tl.trans(k_t), DOT_FP32)


@triton.jit
def bwd_dq(
    Q, K, V, DO, LSE, Delta, DQ, CuSeqlens, scale,
    num_heads, q_len, kv_len, group, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, LOG2: tl.constexpr, PACKED: tl.constexpr, LEFT: tl.constexpr,
    RIGHT: tl.constexpr,
):
    start_m, offs_m, offs_d, q_len, kv_len, row_base, row_stride, kv_base, kv_stride = _query_tile(
        CuSeqlens, num_heads, q_len, kv_len, group, BLOCK_M, BLOCK_D, PACKED)
    if start_m >= q_len:  # past its document's end: the grid is sized for the longest
        return
    q = _tile(Q + row_base * HEAD_DIM, offs_m, row_stride, offs_d, q_len, HEAD_DIM, BLOCK_D, DOT_FP32)
    do = _tile(DO + row_base * HEAD_DIM, offs_m, row_stride, offs_d, q_len, HEAD_DIM, BLOCK_D, DOT_FP32)
    lse, delta = _row_terms(LSE, Delta, row_base, offs_m, row_stride, q_len, LOG2)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_spans(start_m, q_len, kv_len, window_left, window_right, BLOCK_M, BLOCK_N, False)
    if LEFT:
        for start_n in range(lo, full_lo, BLOCK_N):
            dq = _dq_step(q, do, lse, delta, K, V, kv_base, kv_stride, offs_m, offs_d, start_n, dq, q_len, kv_len,
                          window_left, window_right, scale, HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP, DOT_FP32, LOG2,
                          MASK=True)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        dq = _dq_step(q, do, lse, delta, K, V, kv_base, kv_stride, offs_m, offs_d, start_n, dq, q_len, kv_len,
                      window_left, window_right, scale, HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP, DOT_FP32, LOG2,
                      MASK=False)
    if RIGHT:
        for start_n in range(full_hi, hi, BLOCK_N):
            dq = _dq_step(q, do, lse, delta, K, V, kv_base, kv_stride, offs_m, offs_d, start_n, dq, q_len, kv_len,
                          window_left, window_right, scale, HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP, DOT_FP32, LOG2,
                          MASK=True)
    _store_tile(DQ + row_base * HEAD_DIM, dq * scale, offs_m, row_stride, offs_d, q_len, HEAD_DIM, BLOCK_D)


# Launch options per head-dim tile at 16-bit inputs: (BLOCK_M, BLOCK_N, warps, stages) of the dk/dv kernel with its
# SPLIT, of the dq kernel and of the step's forward, the fastest of a sweep on an H200 (Triton 3.6; the sweep and
# its figures: docs/design.md#the-backward-pass): the fixed config, where no tune or shipped pick answers. Head dim
# 256 keeps the largest tiles that compile without spilling.
GPU_TILES = {
    64: ((32, 64, 4, 3, False), (64, 64, 4, 3), (64, 64, 4, 3)),
    128: ((64, 128, 8, 3, True), (128, 64, 8, 3), (64, 64, 4, 3)),
    256: ((16, 32, 4, 2, False), (128, 32, 8, 2), (128, 32, 8, 2)),
}
# float32 inputs (ieee dots, twice the registers): the smallest tiles, which still spill from head dim 128.
FP32_TILES = ((16, 32, 4, 2, False), (32, 32, 4, 2), (32, 32, 4, 2))
DKDV_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "SPLIT")
DQ_KEYS = DKDV_KEYS[:4]
# The tuners' candidates at 16-bit inputs and head-dim tiles up to TUNED_MAX_D, each kernel timed alone: the sweep's
# leaders on some shape (docs/design.md#the-backward-pass), GPU_TILES' among them. Larger tiles spill, and at head
# dim 256 and float32 the fixed tiles are the only candidates.
DKDV_SPACE = ((32, 64, 4, 3, False), (64, 64, 8, 2, False), (64, 64, 8, 3, False), (32, 128, 8, 2, False),
              (32, 128, 8, 3, False), (64, 128, 8, 2, True), (64, 128, 8, 3, True), (64, 128, 8, 2, False))
DQ_SPACE = ((128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4), (128, 128, 8, 2))
TUNED_MAX_D = 128
# A kv head's group is split over programs (dk and dv then added atomically) until the dk/dv kernel has this many
# programs per SM: a causal key tile's work falls with its position, so one wave of them leaves most SMs idle. 4
# picks the fastest split of those timed on an H200 (docs/design.md#the-backward-pass).
WAVES = 4


def tiles(head_dim: int, dtype: torch.dtype) -> tuple[dict, dict, dict]:
    """The fixed launch options of the dk/dv kernel, the dq kernel and the step's forward; under the interpreter, one
    64 x 64 tile, and the dk/dv kernel's masked and mask-free loops apart (``SPLIT``)."""
    if interpreting():
        one = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
        return {**one, "SPLIT": True}, one, one
    dkdv, dq, forward = FP32_TILES if dtype == torch.float32 else GPU_TILES[max(block_d(head_dim), 64)]
    return dict(zip(DKDV_KEYS, dkdv, strict=True)), *(dict(zip(DQ_KEYS, t, strict=True)) for t in (dq, forward))


def search_space(head_dim: int, dtype: torch.dtype) -> tuple[list[dict], list[dict]]:
    """The tuners' candidates for the dk/dv and the dq kernel at this head dim and dtype (``DKDV_SPACE``,
    ``DQ_SPACE``; the fixed tiles alone at float32 and past TUNED_MAX_D)."""
    if dtype == torch.float32 or block_d(head_dim) > TUNED_MAX_D:
        dkdv, dq, _ = tiles(head_dim, dtype)
        return [dkdv], [dq]
    return ([dict(zip(DKDV_KEYS, t, strict=True)) for t in DKDV_SPACE],
            [dict(zip(DQ_KEYS, t, strict=True)) for t in DQ_SPACE])


def head_splits(group: int, programs: int, device: torch.device) -> int:
    """Over how many programs each kv head's group of query heads is split: the fewest (a divisor of the group)
    that give the dk/dv kernel WAVES programs per SM."""
    if device.type != "cuda":
        return 1
    target = WAVES * torch.cuda.get_device_properties(device).multi_processor_count
    return next(s for s in range(1, group + 1) if group % s == 0 and (programs * s >= target or s == group))


def _lengths(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int
             ) -> tuple[int, int, int]:
    """The grid's sequences and their query and key lengths: dense (B, H, S, D) tensors' own; packed (total, H, D)
    ones' documents at the longest one's length (a document attends to itself)."""
    if cu_seqlens is None:
        return q.shape[0], q.shape[2], k.shape[2]
    return cu_seqlens.shape[0] - 1, max_seqlen, max_seqlen


def _launch_shape(q: torch.Tensor, k: torch.Tensor, q_len: int, kv_len: int, window: tuple[int, int],
                  causal: bool) -> tuple:
    """The kernels' (num_heads, q_len, kv_len, group, window_left, window_right), causal as a right side of 0. The
    heads are axis 1 of dense and packed tensors alike."""
    heads = q.shape[1]
    return (heads, q_len, kv_len, heads // k.shape[1], *window_bounds(window, causal))


def _meta(head_dim: int, dtype: torch.dtype, softcap: float, packed: bool, window: tuple[int, int],
          causal: bool) -> dict:
    """The kernels' compile-time switches. LEFT / RIGHT: whether the window's side (causal: the right) hides keys,
    so that the loops over the tiles it cuts are compiled only then (each loop compiled costs registers)."""
    exact = interpreting() or dtype == torch.float32  # the interpreter's half dots are wrong
    left, right = window_bounds(window, causal)
    # Natural units where exact: lse in log2 units is rounded once more, which at float32 doubled dv's error.
    return {"HEAD_DIM": head_dim, "BLOCK_D": block_d(head_dim), "SOFTCAP": softcap, "PACKED": packed,
            "DOT_FP32": exact, "LOG2": not exact, "LEFT": left < UNBOUNDED, "RIGHT": right < UNBOUNDED}


def training_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int = 0,
                     window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0) -> Prepared:
    """The forward of a training step (``forward=`` of the backward's entry): ``(o, lse)`` written into the same
    two buffers each call, for the backward to read; packed documents with ``cu_seqlens`` and their longest
    length ``max_seqlen``. The dense kernel returns no lse, so this is a plain masked FlashAttention-2 loop of its
    own."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    head_dim = q.shape[-1]
    batch, q_len, kv_len = _lengths(q, k, cu_seqlens, max_seqlen)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)  # one per row of q, in its order
    *_, tile = tiles(head_dim, q.dtype)
    grid = (triton.cdiv(max(q_len, 1), tile["BLOCK_M"]), *heads_by_batch(q.shape[1], batch))
    meta = {**_meta(head_dim, q.dtype, softcap, cu_seqlens is not None, window, causal), **tile}
    shape = _launch_shape(q, k, q_len, kv_len, window, causal)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        fwd_lse[grid](q, k, v, o, lse, cu_seqlens, scale, *shape, **meta)
        return o, lse

    run()  # compiles, outside any timed region
    return Prepared(run, config={"forward": tile})


# The backward's shape class (``shape_class``): a shipped pick carries across these positions, the length classes.
NEAR_LENGTHS = (8, 9)


def shape_class(dtype: torch.dtype, head_dim: int, causal: bool, window: tuple[int, int], softcap: float,
                packed: bool, group: int, q_len: int, kv_len: int) -> tuple:
    """What decides the backward's tiles, as its tuning key holds it: the dtype, the head-dim tile, the mask and
    softcap as compiled in, packed documents, the GQA group and the length classes (packed: the longest
    document's)."""
    return ("backward", dtype, block_d(head_dim), causal, window != NO_WINDOW, softcap, packed, group,
            length_class(q_len), length_class(kv_len))


# Each kernel's candidates as (tiles, call): the dk/dv kernel's, the dq kernel's.
Candidates = tuple[list[tuple[dict, Callable[[], None]]], list[tuple[dict, Callable[[], None]]]]


def _fastest(candidates: list[tuple[dict, Callable[[], None]]]) -> dict:
    """The fastest candidate's tiles; a lone candidate (the fixed tiles) without timing."""
    return candidates[0][0] if len(candidates) == 1 else fastest(candidates)


def chosen_tiles(q: torch.Tensor, shape_key: tuple,
                 candidates: Callable[[list[dict], list[dict]], Candidates]) -> tuple[tuple[dict, dict], str]:
    """The dk/dv and dq tiles for a call on ``q`` of shape class ``shape_key``, and where they came from
    (``TuningCache.lookup``). A tune times each kernel alone over its space, ``candidates(dkdv_space, dq_space)``
    giving the calls."""
    dkdv_space, dq_space = search_space(q.shape[-1], q.dtype)
    dkdv_fixed, dq_fixed, _ = tiles(q.shape[-1], q.dtype)

    def tune() -> dict:
        dkdv, dq = candidates(dkdv_space, dq_space)
        return {"dkdv": _fastest(dkdv), "dq": _fastest(dq)}

    def compile_all() -> None:
        for kernel in candidates(dkdv_space, dq_space):
            for _, call in kernel:
                call()

    def valid(config: dict) -> bool:
        return config.get("dkdv") in dkdv_space and config.get("dq") in dq_space

    config, source = TUNING.lookup(TUNING.key(q.device, shape_key), tune, lambda: {"dkdv": dkdv_fixed, "dq": dq_fixed},
                                   compile_all, NEAR_LENGTHS, valid)
    return (config["dkdv"], config["dq"]), source


@register("triton", op="backward", family="triton", dtypes=FLOATS, head_dims=HEAD_DIMS, requires=requires,
          needs=("lse",), variants=("window", "softcap", "packed"), forward=training_forward,
          description="our FlashAttention-2 backward in Triton: delta pre-pass, dk/dv over key tiles walking the "
                      "query tiles (a GQA group split over programs where they are few), dq over query tiles; packed "
                      "documents read from cu_seqlens; the dk/dv and dq tiles each tuned per shape class, shipped "
                      "for the H200")
def triton_backward(inputs: Backward, *, scale: float, window: tuple[int, int] = NO_WINDOW,
                    softcap: float = 0.0) -> Prepared:
    # Contiguous as the kernels address them: a copy only where an input is not (out of timed calls).
    q, k, v, o, do = (t.contiguous() for t in (inputs.q, inputs.k, inputs.v, inputs.o, inputs.do))
    lse = inputs.lse.contiguous()
    head_dim, cu_seqlens = q.shape[-1], inputs.cu_seqlens
    batch, q_len, kv_len = _lengths(q, k, cu_seqlens, inputs.max_seqlen)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    delta = torch.empty_like(lse)
    meta = _meta(head_dim, q.dtype, softcap, inputs.packed, window, inputs.causal)
    shape = _launch_shape(q, k, q_len, kv_len, window, inputs.causal)
    rows = lse.numel()  # every row of every head, in lse's layout

    def delta_pass() -> None:
        bwd_delta[(triton.cdiv(rows, DELTA_ROWS),)](o, do, delta, rows, HEAD_DIM=head_dim, BLOCK_D=meta["BLOCK_D"],
                                                    BLOCK_M=DELTA_ROWS)

    def dkdv_launch(tile: dict) -> tuple[Callable[[], None], dict]:
        """The dk/dv kernel's call on ``tile`` and its launch options, the group split (``head_splits``) added."""
        tile = {**tile}
        key_tiles = triton.cdiv(max(kv_len, 1), tile["BLOCK_N"])
        splits = tile.pop("HEAD_SPLITS", None) or head_splits(shape[3], key_tiles * k.shape[1] * batch, q.device)
        grid = (key_tiles, *heads_by_batch(k.shape[1] * splits, batch, "kv heads"))
        # Programs that share a kv head add into float32 sums, zeroed and cast in the call.
        dk_sum, dv_sum = (torch.empty_like(t, dtype=torch.float32) for t in (k, v)) if splits > 1 else (dk, dv)

        def run() -> None:
            if splits > 1:
                dk_sum.zero_()
                dv_sum.zero_()
            bwd_dkdv[grid](q, k, v, do, lse, delta, dk_sum, dv_sum, cu_seqlens, scale, *shape, **meta, **tile,
                           HEAD_SPLITS=splits)
            if splits > 1:
                dk.copy_(dk_sum)
                dv.copy_(dv_sum)

        return run, {**tile, "HEAD_SPLITS": splits}

    def dq_launch(tile: dict) -> Callable[[], None]:
        grid = (triton.cdiv(max(q_len, 1), tile["BLOCK_M"]), *heads_by_batch(q.shape[1], batch))
        return lambda: bwd_dq[grid](q, k, v, do, lse, delta, dq, cu_seqlens, scale, *shape, **meta, **tile)

    def candidates(dkdv_space: list[dict], dq_space: list[dict]) -> Candidates:
        delta_pass()  # both kernels read delta: computed once, before either is timed
        return [(t, dkdv_launch(t)[0]) for t in dkdv_space], [(t, dq_launch(t)) for t in dq_space]

    if timed_here(q):
        shape_key = shape_class(q.dtype, head_dim, inputs.causal, window, softcap, inputs.packed, shape[3], q_len,
                                kv_len)
        (dkdv_tiles, dq_tiles), source = chosen_tiles(q, shape_key, candidates)
    else:  # the interpreter times nothing
        (dkdv_tiles, dq_tiles, _), source = tiles(head_dim, q.dtype), "fixed (interpreter)"
    dkdv_run, dkdv_options = dkdv_launch(dkdv_tiles)
    dq_run = dq_launch(dq_tiles)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        delta_pass()
        dkdv_run()
        dq_run()
        return dq, dk, dv

    run()  # compiles, outside any timed region
    return Prepared(run, config={"dkdv": dkdv_options, "dq": dq_tiles, "chosen": source})
