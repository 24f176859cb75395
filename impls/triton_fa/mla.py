"""MLA decode in Triton (``impls.contract.MLADecode``: DeepSeek-V3's and Kimi-K2's absorbed form), registered as
``triton``'s ``mla`` entry.

The paged decode's design (``decode.py``) with MLA's one latent head:

1. Head packing: every query head of a sequence reads the same latent and rotary rows, so all H heads (times the
   new tokens) are the rows of one tile, and each cache row is loaded once per chunk for all of them.
2. One load, two uses: a key tile loads BLOCK_N latent rows and their rotary rows; the scores are
   ``q_nope . ckv + q_pe . kpe`` (two dots into one accumulator), and the same latent tile is the values of P V.
3. Split-KV: each sequence's cache is cut into chunks by the paged decode's split plan (``impls._plans.split_plan``
   with one kv head), a program each; their normalised outputs and log-sum-exps are merged by the paged decode's
   combine kernel, which sees the heads as one kv head's GROUP. A sequence of one chunk writes its output at once.
4. Pages by row gathers through the block table, positions past a sequence read zeros (masked loads): any page
   size, whatever the unused slots hold. Latent and rotary widths that are not powers of two are padded with zeros.
5. An fp8 cache (KV_FP8) is read as stored and each tile widened to q's dtype before its dots, as the paged
   decode's; its one scale is folded into the score scale on the host and multiplies the chunk's output once.

One fixed config, not tuned yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from impls import _plans
from impls._plans import combine_plan, split_plan
from impls._registry import FLOATS, Prepared, Unsupported, check_grid_axis, register
from impls.contract import UNBOUNDED
from impls.triton_fa.config import block_d, interpreting, requires
from impls.triton_fa.decode import (
    _load,
    _query_rows,
    paged_decode_combine,
    softmax_update,
    store_output,
    store_partials,
)
from impls.triton_fa.kernel import LOG2_E, scaled_scores
from impls.triton_fa.paged import INTERPRETER_SM_COUNT

# Query heads x new tokens in one tile. The fp32 accumulator is rows x latent: compiled for sm_90 at 512 + 64 (Triton
# 3.9, 2026-11-28), 16 and 32 rows took 200 and 174 registers and no stack, 64 rows spilled (255 and 96 B of stack).
MAX_ROWS = 64
# The one config until a tuner: 32 latent rows a tile (32 KB of bf16), the plan of the paged decode's default.
MLA_CONFIG = {"BLOCK_N": 32, "num_stages": 2, "PLAN_PROGRAMS": _plans.PROGRAMS_PER_SM}
INTERPRETER_MLA_CONFIG = {"BLOCK_N": 16, "num_stages": 1, "PLAN_PROGRAMS": _plans.PROGRAMS_PER_SM}


@triton.jit
def mla_decode_split(
    Q_nope, Q_pe, CKV, KPE, block_table, cache_seqlens, O_part, LSE_part, Out, qk_scale, kv_scale,
    stride_nb, stride_nt, stride_nh,  # Q_nope (B, Sq_new, H, LATENT)
    stride_pb, stride_pt, stride_ph,  # Q_pe (B, Sq_new, H, ROPE)
    stride_cp, stride_cs,  # CKV (num_pages, page_size, LATENT)
    stride_kp, stride_ks,  # KPE (num_pages, page_size, ROPE)
    stride_bt,
    stride_ob, stride_os, stride_or,  # O_part (B, splits, rows, BLOCK_L)
    stride_b, stride_t, stride_h,  # Out (B, Sq_new, H, LATENT)
    split_len,
    HEADS: tl.constexpr, SQ: tl.constexpr, PAGE_SIZE: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, SPLIT: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    """Program (split, sequence): attention of the HEADS x SQ query rows over one chunk of the sequence's latent
    cache. SPLIT: its normalised output and log-sum-exp go to O_part and LSE_part for the combine; otherwise (one
    chunk per sequence) the output rows go to Out. KV_FP8: the caches are fp8, ``qk_scale`` holds ``kv_scale`` and
    the output is multiplied by it."""
    split = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(cache_seqlens + batch)
    start = split * split_len
    if start >= seq_len:  # this sequence is shorter than the longest: nothing here (the combine skips it)
        return
    end = tl.minimum(start + split_len, seq_len)

    rows, head, token, row_valid = _query_rows(0, HEADS, SQ, BLOCK_M)
    offs_l, offs_r = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
    in_l, in_r = offs_l < LATENT, offs_r < ROPE
    q_nope = tl.load(Q_nope + batch * stride_nb + token[:, None] * stride_nt + head[:, None] * stride_nh
                     + offs_l[None, :], mask=row_valid[:, None] & in_l[None, :], other=0.0)
    q_pe = tl.load(Q_pe + batch * stride_pb + token[:, None] * stride_pt + head[:, None] * stride_ph
                   + offs_r[None, :], mask=row_valid[:, None] & in_r[None, :], other=0.0)
    if DOT_FP32:  # Triton's interpreter computes half-precision dots wrongly
        q_nope, q_pe = q_nope.to(tl.float32), q_pe.to(tl.float32)
    last_visible = seq_len - SQ + token  # causal, bottom-right within the sequence

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    table_row = block_table + batch * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        in_seq = pos < end
        page = tl.load(table_row + pos // PAGE_SIZE, mask=in_seq, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        ckv = _load(CKV + page[:, None] * stride_cp + slot[:, None] * stride_cs + offs_l[None, :],
                    in_seq[:, None], in_l[None, :], True, BLOCK_L != LATENT)
        kpe = _load(KPE + page[:, None] * stride_kp + slot[:, None] * stride_ks + offs_r[None, :],
                    in_seq[:, None], in_r[None, :], True, BLOCK_R != ROPE)
        if DOT_FP32 or KV_FP8:  # the interpreter computes half-precision dots wrongly; fp8 widens to q's dtype
            ckv, kpe = ckv.to(q_nope.dtype), kpe.to(q_nope.dtype)
        qk = tl.dot(q_nope, tl.trans(ckv), input_precision="ieee" if DOT_FP32 else None)
        qk = tl.dot(q_pe, tl.trans(kpe), qk, input_precision="ieee" if DOT_FP32 else None)
        qk = scaled_scores(qk, qk_scale, 0.0)
        visible = in_seq[None, :] & (pos[None, :] <= last_visible[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        acc, l_i, m_i = softmax_update(qk, acc, l_i, m_i, ckv, True, DOT_FP32)

    if KV_FP8:  # the values' scale, once per chunk (the combine is linear in the partial outputs)
        acc = acc * kv_scale
    if SPLIT:
        store_partials(acc, l_i, m_i, O_part + batch * stride_ob + split * stride_os, stride_or, offs_l,
                       LSE_part + (batch * tl.num_programs(0) + split) * BLOCK_M, rows, row_valid)
    else:
        store_output(acc, l_i, Out + batch * stride_b + token[:, None] * stride_t + head[:, None] * stride_h
                     + offs_l[None, :], row_valid, in_l)


def tile_width(width: int) -> int:
    """A latent or rotary width as the kernel tiles it: the power of two at or above it, at least a dot's 16."""
    return max(16, block_d(width))


def row_tile(rows: int) -> tuple[int, int]:
    """(BLOCK_M, warps) for a tile of ``rows`` query rows: 4 warps for 16 rows, 8 from 32 (a 32 x 512 fp32
    accumulator over 4 warps is 128 registers a thread alone)."""
    block_m = max(16, triton.next_power_of_2(rows))
    return block_m, 4 if block_m <= 16 else 8


def mla_launch(inputs, scale: float, config: dict):
    """The launches of one MLA decode step with ``config`` (split, then combine where a sequence has more than one
    chunk), and the split plan."""
    q_nope, q_pe, ckv, kpe = inputs.q_nope, inputs.q_pe, inputs.ckv, inputs.kpe
    batch, sq, heads, latent = q_nope.shape
    check_grid_axis(batch, "sequences")
    interp = interpreting()
    sm_count = INTERPRETER_SM_COUNT if interp else torch.cuda.get_device_properties(q_nope.device).multi_processor_count
    rows, block_n = heads * sq, config["BLOCK_N"]
    (block_m, num_warps), block_l = row_tile(rows), tile_width(latent)
    num_splits, split_len = split_plan(inputs.seqlens, 1, block_n, sm_count, min_tiles=1 if interp else None,
                                       programs_per_sm=config["PLAN_PROGRAMS"])
    split = num_splits > 1
    parts = (batch, num_splits, block_m) if split else (1, 1, 1)  # unused without a split
    o_part = torch.empty(*parts, block_l if split else 1, dtype=torch.float32, device=q_nope.device)
    lse_part = torch.empty(parts, dtype=torch.float32, device=q_nope.device)
    out = inputs.output_like()
    split_args = (q_nope, q_pe, ckv, kpe, inputs.block_table, inputs.cache_seqlens, o_part, lse_part, out,
                  scale * inputs.kv_scale * LOG2_E, inputs.kv_scale, *q_nope.stride()[:3], *q_pe.stride()[:3],
                  *ckv.stride()[:2], *kpe.stride()[:2],
                  inputs.block_table.stride(0), *o_part.stride()[:3], *out.stride()[:3], split_len)
    split_meta = {"HEADS": heads, "SQ": sq, "PAGE_SIZE": inputs.page_size, "LATENT": latent,
                  "ROPE": inputs.rope_dim, "BLOCK_L": block_l, "BLOCK_R": tile_width(inputs.rope_dim),
                  "BLOCK_M": block_m, "BLOCK_N": block_n, "DOT_FP32": interp or q_nope.dtype == torch.float32,
                  "SPLIT": split, "KV_FP8": inputs.kv_fp8, "num_warps": num_warps, "num_stages": config["num_stages"]}
    launches = [(mla_decode_split, (num_splits, batch), split_args, split_meta)]
    if split:  # the paged decode's combine: the heads are one kv head's GROUP, nothing windowed
        tile_d, chunks = combine_plan(num_splits, block_l)
        combine_args = (o_part, lse_part, inputs.cache_seqlens, out, *o_part.stride()[:3], *out.stride()[:3], 1,
                        num_splits, split_len, UNBOUNDED)
        combine_meta = {"GROUP": heads, "SQ": sq, "BLOCK_M": block_m, "MAX_SPLITS": triton.next_power_of_2(num_splits),
                        "SPLIT_CHUNK": chunks, "BLOCK_D": tile_d, "HEAD_DIM": latent}
        launches.append((paged_decode_combine, (batch, rows, block_l // tile_d), combine_args, combine_meta))

    def run() -> torch.Tensor:
        for kernel, grid, args, meta in launches:
            kernel[grid](*args, **meta)
        return out

    return run, {"num_splits": num_splits, "split_len": split_len, "BLOCK_M": block_m, "num_warps": num_warps}


@register("triton", op="mla", family="triton", dtypes=FLOATS, requires=requires, variants=("kv_fp8",),
          description="our split-KV MLA decode: all query heads of a sequence in one tile over its latent head, "
                      "each latent row loaded once for the scores and the values, pages gathered through the block "
                      "table, chunks merged by log-sum-exp (an fp8 cache widened after each load); one fixed config")
def prepare_mla(inputs, *, scale: float) -> Prepared:
    _, sq, heads, _ = inputs.q_nope.shape
    if heads * sq > MAX_ROWS:
        raise Unsupported(f"{heads} query heads x {sq} new tokens = {heads * sq} rows: this kernel packs at most "
                          f"{MAX_ROWS} in one tile")
    config = INTERPRETER_MLA_CONFIG if interpreting() else MLA_CONFIG
    run, plan = mla_launch(inputs, scale, config)
    run()  # compile outside any timed region
    return Prepared(run, config={**config, **plan, "chosen": "fixed (interpreter)" if interpreting() else "fixed"})
