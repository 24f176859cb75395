"""MLA decode in cuTile (``impls.contract.MLADecode``: DeepSeek-V3's and Kimi-K2's absorbed form), launched and
registered as ``cutile``'s ``mla`` entry by ``mla_serving.py``: the design of the Triton MLA kernel
(``impls/triton_fa/mla.py``) in the paged decode's cuTile forms (``decode.py``).

1. Head packing: every query head of a sequence reads the same latent and rotary rows, so all H heads (times the
   new tokens) are the rows of one tile: row ``r`` is head ``r // SQ``, new token ``r % SQ``; each cache row is
   loaded once per chunk for all of them.
2. One load, two uses: a key tile loads TILE_N latent rows and their rotary rows; the scores are
   ``q_nope . ckv + q_pe . kpe`` (two products into one accumulator), and the same latent tile is the values of P V.
3. Keys as the products' rows: the tile computes the transposed scores ``S^T = ckv q_nope^T + kpe q_pe^T``
   (TILE_N, TILE_M), a column per query row, and the transposed output ``O^T += ckv^T P^T`` (TILE_L, TILE_M). The
   query rows (16 or 32) are too few for Hopper's warpgroup MMA, whose row count is 64 a warpgroup; 64 keys and
   512 latent columns are not. So both products run on HGMMA with the latent tile read from shared memory, and
   the accumulator is spread over two warpgroups (``mla_serving``'s worker warps): no register spills, where the
   query rows as the products' rows spilled (docs/design.md, "MLA decode").
4. Split-KV: each sequence's cache is cut into chunks by the paged decode's split plan (``impls._plans.split_plan``
   with one kv head), a block per chunk that holds keys, from a work list built on the host when the call is
   prepared (``impls._plans.split_work_list``: full chunks first); their normalised outputs and log-sum-exps are
   merged by the paged decode's combine (``decode.paged_decode_combine``), which sees the heads as one kv head's
   GROUP and reads the same chunks. A sequence of one chunk writes its output at once.
5. Pages: block loads (TMA on Hopper) of the part of a page a key tile lies in, or of the whole pages it spans,
   joined (decode.py's PAGES); where no such tile fits the page size, the rows are gathered through the table
   (ROWS). Every tile is masked: positions past a row's last visible one are hidden, and the latent and rotary rows
   past the sequence are zeroed, so that whatever unused slots hold (NaN included) never reaches the output.
   Widths that are not powers of two are padded with zeros (loads pad, gathers are bounds-checked).
6. An fp8 cache is loaded as stored and each tile widened to q's dtype after its load; its one scale is folded
   into the score scale on the host and multiplies the chunk's output once.

Causal within each sequence, bottom-right: new token ``t`` of ``SQ`` sees positions ``<= L - SQ + t``.
"""

from __future__ import annotations

import math

import cuda.tile as ct

from impls.cutile.decode import concatenate, page_of
from impls.cutile.kernel import ConstBool, ConstInt, score_scale, softmax_step, with_int64_indexing

ROWS, PAGES = 0, 1  # GATHER: how a key tile is read (module docstring, 5)


@ct.kernel
def mla_decode_split(
    QNope, QPe, CKV, KPE, BlockTable, CacheSeqlens, Work, OutPart, LsePart, Out,
    qk_scale: float, kv_scale: float, split_len: int,
    HEADS: ConstInt, SQ: ConstInt, TILE_M: ConstInt, TILE_N: ConstInt, TILE_L: ConstInt, TILE_R: ConstInt,
    PAGE_SIZE: ConstInt, GATHER: ConstInt, SPLIT: ConstBool, LATENCY: ConstInt,
):
    """Block ``item``: the HEADS x SQ query rows over one chunk of a sequence's latent cache, ``Work`` (items, 2)
    holding the item's sequence and chunk (module docstring, 4). SPLIT: write the chunk's normalised output (B,
    chunks, TILE_M, TILE_L) and log-sum-exp (B, chunks, TILE_M) float32; otherwise (one chunk per sequence) the
    output rows themselves. ``qk_scale`` holds an fp8 cache's ``kv_scale``, which multiplies the output (1 for any
    other cache)."""
    item = ct.bid(0)
    batch = ct.gather(Work, (item, 0)).item()
    chunk = ct.gather(Work, (item, 1)).item()
    seq_len = ct.gather(CacheSeqlens, batch).item()

    rows = ct.arange(TILE_M, dtype=ct.int32)[None, :]  # the query rows are columns (module docstring, 3)
    token = rows % SQ
    head = rows // SQ
    real_row = rows < HEADS * SQ
    latent_dims = ct.arange(TILE_L, dtype=ct.int32)[:, None]
    rope_dims = ct.arange(TILE_R, dtype=ct.int32)[:, None]
    q_nope = ct.gather(QNope, (batch, token, head, latent_dims), mask=real_row)  # (TILE_L, TILE_M); past the width 0
    q_pe = ct.gather(QPe, (batch, token, head, rope_dims), mask=real_row)
    last_visible = seq_len - SQ + token  # (1, TILE_M): causal, bottom-right within the sequence

    m_i = ct.full((1, TILE_M), -math.inf, dtype=ct.float32)
    l_i = ct.full((1, TILE_M), 0.0, dtype=ct.float32)
    acc = ct.full((TILE_L, TILE_M), 0.0, dtype=ct.float32)
    score_scale_log2 = score_scale(qk_scale, 0.0)
    first = chunk * (split_len // TILE_N)  # split_len is whole tiles
    end = min(first + split_len // TILE_N, ct.cdiv(seq_len, TILE_N))
    for j in range(first, end):
        ckv, kpe = latent_tile(CKV, KPE, BlockTable, batch, j, seq_len, TILE_N, TILE_L, TILE_R, PAGE_SIZE, GATHER,
                               LATENCY, q_nope.dtype)
        qk = ct.mma(ckv, q_nope, ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32))
        qk = ct.mma(kpe, q_pe, qk)
        positions = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[:, None]
        qk = ct.where(positions <= last_visible, qk, -math.inf)  # past the sequence too: last_visible < L
        acc, l_i, m_i = fold_keys(acc, l_i, m_i, qk, ckv, score_scale_log2)

    l_safe = ct.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key in this chunk: output 0, weight 0
    acc = ct.truediv(acc * kv_scale, l_safe)  # an fp8 cache's scale, once (the combine is linear in the parts)
    if SPLIT:
        lse = ct.where(l_i == 0.0, -math.inf, m_i + ct.log2(l_safe))
        ct.store(OutPart, index=(batch, chunk, 0, 0), tile=ct.transpose(acc).reshape((1, 1, TILE_M, TILE_L)))
        ct.store(LsePart, index=(batch, chunk, 0), tile=lse.reshape((1, 1, TILE_M)))
    else:
        ct.scatter(Out, (batch, token, head, latent_dims), acc.astype(Out.dtype), mask=real_row)


def fold_keys(acc, l_i, m_i, qk, ckv, score_scale_log2):
    """The online softmax step on transposed scores (TILE_N, TILE_M), then ``O^T += ckv^T P^T`` (decode.fold with
    the keys as rows): P in the latent tile's 16 bits, as the paged decode's."""
    p, alpha, l_i, m_new = softmax_step(qk, l_i, m_i, score_scale_log2, True, True, KEY_AXIS=0)
    return ct.mma(ct.transpose(ckv), p.astype(ckv.dtype), acc * alpha), l_i, m_new


def latent_tile(CKV, KPE, BlockTable, batch, j, seq_len, TILE_N, TILE_L, TILE_R, PAGE_SIZE, GATHER, LATENCY, dtype):
    """Key tile j of a sequence: its latent rows (TILE_N, TILE_L) and rotary rows (TILE_N, TILE_R) as ``dtype`` (an
    fp8 cache's widened to it), zeros at positions past the sequence."""
    positions = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[:, None]
    in_seq = positions < seq_len
    if GATHER == ROWS:
        page = ct.gather(BlockTable, (batch, positions // PAGE_SIZE), mask=in_seq)
        slot = positions % PAGE_SIZE
        ckv = ct.gather(CKV, (page, slot, ct.arange(TILE_L, dtype=ct.int32)[None, :]), mask=in_seq, latency=LATENCY)
        kpe = ct.gather(KPE, (page, slot, ct.arange(TILE_R, dtype=ct.int32)[None, :]), mask=in_seq, latency=LATENCY)
        return ckv.astype(dtype), kpe.astype(dtype)  # a masked gather reads zeros past the sequence
    ckv = page_rows(CKV, BlockTable, batch, j, seq_len, TILE_N, TILE_L, PAGE_SIZE, LATENCY).astype(dtype)
    kpe = page_rows(KPE, BlockTable, batch, j, seq_len, TILE_N, TILE_R, PAGE_SIZE, LATENCY).astype(dtype)
    # an unused slot may hold NaN: 0 * NaN is NaN in P V (a hidden score is -inf whatever it was)
    return ct.where(in_seq, ckv, 0.0), ct.where(in_seq, kpe, 0.0)


def page_rows(Cache, BlockTable, batch, j, seq_len, TILE_N, WIDTH, PAGE_SIZE, LATENCY):
    """PAGES: key tile j's rows of a ``(num_pages, page_size, width)`` cache as block loads (TMA on Hopper): the
    part of one page the tile lies in, or the TILE_N / PAGE_SIZE whole pages it spans, joined."""
    rows = min(TILE_N, PAGE_SIZE)  # rows per load
    parts = ()
    for part in ct.static_iter(range(TILE_N // rows)):
        first = j * TILE_N + part * rows  # the part's first position
        page = page_of(BlockTable, batch, first // PAGE_SIZE, seq_len, PAGE_SIZE).item()
        in_page = first % PAGE_SIZE // rows  # the part's index within its page, in units of ``rows``
        parts += (ct.load(Cache, index=(page, in_page, 0), shape=(1, rows, WIDTH), latency=LATENCY,
                          padding_mode=ct.PaddingMode.ZERO).reshape((rows, WIDTH)),)
    return concatenate(parts, 0)


# A cache of 2**31 elements or more needs 64-bit offsets (DeepSeek's 512-wide rows: 4M tokens).
mla_decode_split_int64 = with_int64_indexing(mla_decode_split, ("CKV", "KPE"))
