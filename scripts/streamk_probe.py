"""Does a persistent, stream-K decode beat one program per chunk? (GPU; CPU under TRITON_INTERPRET=1)

Our Triton decode (``impls.triton_fa.decode``) gives each program one chunk of one (sequence, kv head): a grid of
chunks in waves. Each program fills its pipeline from cold (block-table load, then K/V) and drains it at its end,
and 2048 equal chunks do not divide into waves of 132 SMs. This probe's kernel runs ``P`` programs that each take a
contiguous range of the step's key tiles, every (sequence, kv head) laid end to end, in one flattened loop: the
loads of the next item's first tiles are issued while the current item's last ones are computed, and every
program gets the same number of tiles (to one). An item that a range boundary cuts is merged by log-sum-exp in a
second launch over the cut items only.

Scope (a probe, not an implementation): uniform lengths, one new token, no window or softcap. Prints JSON lines:
the fastest stream-K config (tile, warps, stages, programs per SM) beside the tuner's fastest and each peer, timed
in alternation, each output checked against the float64 oracle.

    python scripts/streamk_probe.py --case llama3-8b-paged-bf16-h32:8-q1-kv8192-uniform-p16-d128-b256 --peer flashinfer
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

import impls
from impls.timing import graph_ms
from impls.triton_fa.config import block_d, interpreting
from impls.triton_fa.decode import _load, online_softmax_step
from impls.triton_fa.kernel import LOG2_E, scaled_scores
from impls.triton_fa.paged import DECODE_SPACE
from scripts.serving_probe import fastest_of_each, tile_arg
from suite.cases import case_by_id
from suite.checks import Oracle


@triton.jit
def _program_of(tile, total_tiles, num_programs):
    """The program whose range holds global tile ``tile``: range p is [p * total // P, (p + 1) * total // P)."""
    return ((tile + 1) * num_programs + total_tiles - 1) // total_tiles - 1


@triton.jit
def streamk_decode(
    Q, K, V, table, O_part, LSE_part, Out, qk_scale,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
    stride_pi, stride_ps, stride_ob, stride_oh,
    seq_len, num_kv_heads, tiles_per_item, total_tiles, num_programs,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SEG: tl.constexpr, RAGGED: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Program p: global key tiles [p * total // P, (p + 1) * total // P); tile x is tile x % T of item x // T
    (item = sequence * Hkv + kv head). Whole items go to Out; an item cut by a range boundary leaves its part's
    normalised output and log-sum-exp (log2) in slot p - first program of the item."""
    pid = tl.program_id(0).to(tl.int64)
    lo = pid * total_tiles // num_programs
    hi = (pid + 1) * total_tiles // num_programs
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    in_dims = offs_d < HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for x in range(lo, hi):
        item = x // tiles_per_item
        tile = x - item * tiles_per_item
        batch = item // num_kv_heads
        kv_head = item - batch * num_kv_heads
        # a new item starts from an empty state (its first tile, or the first of this program's range)
        fresh = (tile == 0) | (x == lo)
        m_i = tl.where(fresh, float("-inf"), m_i)
        l_i = tl.where(fresh, 0.0, l_i)
        acc = tl.where(fresh, 0.0, acc)
        head = kv_head * GROUP + rows
        q = tl.load(Q + batch * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_valid[:, None] & in_dims[None, :], other=0.0)
        pos = tile * BLOCK_N + offs_n
        in_seq = pos < seq_len
        if RAGGED:
            page = tl.load(table + batch * stride_bt + pos // PAGE_SIZE, mask=in_seq, other=0).to(tl.int64)
        else:
            page = tl.load(table + batch * stride_bt + pos // PAGE_SIZE).to(tl.int64)
        slot = pos % PAGE_SIZE
        k_ptrs = K + page[None, :] * stride_kp + slot[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None]
        v_ptrs = V + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
        k = _load(k_ptrs, in_seq[None, :], in_dims[:, None], RAGGED, BLOCK_D != HEAD_DIM)
        if DOT_FP32:  # Triton's interpreter computes half-precision dots wrongly
            q, k = q.to(tl.float32), k.to(tl.float32)
        qk = scaled_scores(tl.dot(q, k, input_precision="ieee" if DOT_FP32 else None), qk_scale, 0.0)
        if RAGGED:
            qk = tl.where(in_seq[None, :], qk, float("-inf"))
        acc, l_i, m_i = online_softmax_step(qk, acc, l_i, m_i, v_ptrs, in_seq, in_dims, RAGGED, BLOCK_D != HEAD_DIM,
                                            DOT_FP32)
        if (tile == tiles_per_item - 1) | (x == hi - 1):  # this program's part of the item ends here
            first = _program_of(item * tiles_per_item, total_tiles, num_programs)
            last = _program_of(item * tiles_per_item + tiles_per_item - 1, total_tiles, num_programs)
            if first == last:  # the whole item is this program's: the output rows
                out = Out + batch * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
                tl.store(out, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=row_valid[:, None] & in_dims[None, :])
            else:
                part = item * stride_pi + (pid - first) * stride_ps
                tl.store(O_part + part + rows[:, None] * BLOCK_D + offs_d[None, :], acc / l_i[:, None])
                tl.store(LSE_part + (item * MAX_SEG + pid - first) * BLOCK_M + rows, m_i + tl.math.log2(l_i))


@triton.jit
def streamk_merge(
    O_part, LSE_part, Out, stride_pi, stride_ps, stride_ob, stride_oh,
    num_kv_heads, tiles_per_item, total_tiles, num_programs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    MAX_SEG: tl.constexpr,
):
    """Program (boundary b = 1 .. P-1, row): the item that range boundary b cuts, merged once (by the first
    boundary inside it) over its parts."""
    b = tl.program_id(0).to(tl.int64) + 1
    row = tl.program_id(1)
    start = b * total_tiles // num_programs
    item = start // tiles_per_item
    first = _program_of(item * tiles_per_item, total_tiles, num_programs)
    if (start % tiles_per_item == 0) | (b != first + 1):
        return  # the boundary falls between items, or an earlier boundary of the same item merges it
    last = _program_of(item * tiles_per_item + tiles_per_item - 1, total_tiles, num_programs)
    seg = tl.arange(0, MAX_SEG)
    used = seg <= last - first
    lse = tl.load(LSE_part + (item * MAX_SEG + seg) * BLOCK_M + row, mask=used, other=float("-inf"))
    weight = tl.math.exp2(lse - tl.max(lse, 0))
    offs_d = tl.arange(0, BLOCK_D)
    parts = tl.load(O_part + item * stride_pi + seg[:, None] * stride_ps + row * BLOCK_D + offs_d[None, :],
                    mask=used[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    batch = item // num_kv_heads
    head = (item - batch * num_kv_heads) * GROUP + row
    tl.store(Out + batch * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def streamk_launch(inputs, scale: float, block_n: int, num_warps: int, num_stages: int, programs: int):
    """The two launches of one decode step over ``programs`` stream-K programs."""
    q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
    batch, sq, hq, head_dim = q.shape
    hkv = k_cache.shape[2]
    lengths = set(inputs.seqlens)
    if sq != 1 or len(lengths) != 1:
        raise ValueError("the stream-K probe takes one new token and uniform lengths")
    seq_len = lengths.pop()
    group, width = hq // hkv, block_d(head_dim)
    block_m = max(16, triton.next_power_of_2(group))
    tiles_per_item = -(-seq_len // block_n)
    total = batch * hkv * tiles_per_item
    programs = min(programs, total)
    max_seg = triton.next_power_of_2(-(-tiles_per_item // max(1, total // programs)) + 1)
    out = inputs.output_like()
    o_part = torch.empty(batch * hkv, max_seg, block_m, width, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(batch * hkv, max_seg, block_m, dtype=torch.float32, device=q.device)
    q3 = q[:, 0]
    common = (o_part.stride(0), o_part.stride(1), out.stride(0), out.stride(2))
    sizes = (hkv, tiles_per_item, total, programs)
    meta = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_D": width, "BLOCK_M": block_m, "MAX_SEG": max_seg}
    interp = interpreting()

    def run() -> torch.Tensor:
        streamk_decode[(programs,)](
            q3, k_cache, v_cache, inputs.block_table, o_part, lse_part, out, scale * LOG2_E,
            q3.stride(0), q3.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], inputs.block_table.stride(0),
            *common, seq_len, *sizes, PAGE_SIZE=inputs.page_size, BLOCK_N=block_n,
            RAGGED=seq_len % block_n != 0, DOT_FP32=interp or q.dtype == torch.float32,
            num_warps=num_warps, num_stages=num_stages, **meta)
        if programs > 1:
            streamk_merge[(programs - 1, group)](o_part, lse_part, out, *common, *sizes, **meta)
        return out

    return run


TILES = ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 4, 5))
PROGRAMS_PER_SM = (1, 2, 3, 4, 8)


def fastest_streamk(inputs, scale: float, tiles: tuple[tuple[int, int, int], ...] = TILES) -> tuple[str, object]:
    """Every (tile, programs per SM) once by graph time; the fastest as (name, run)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    timed = []
    for (n, w, st), per_sm in ((tile, k) for tile in tiles for k in PROGRAMS_PER_SM):
        try:
            run = streamk_launch(inputs, scale, n, w, st, per_sm * sms)
            run()
        except Exception as exc:  # beyond shared memory: say so, go on
            print(json.dumps({"variant": f"streamk {n},{w},{st} x{per_sm}", "error": str(exc)[:200]}), flush=True)
            continue
        timed.append((graph_ms(run, repeats=20), f"streamk {n},{w},{st} x{per_sm}", run))
    _, name, run = min(timed, key=lambda entry: entry[0])
    return name, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", required=True, help="a uniform serving case id (repeatable)")
    parser.add_argument("--peer", action="append", default=[], help="a registered implementation to time too")
    parser.add_argument("--tile", action="append", default=[], type=tile_arg, metavar="N,W,S",
                        help="a stream-K tile (keys, warps, stages) in place of TILES (repeatable)")
    args = parser.parse_args()
    tiles = tuple(args.tile) or TILES
    for case_id in args.case:
        case = case_by_id(case_id)
        inputs = case.make_inputs("cuda")
        scale = case.d ** -0.5
        oracle = Oracle.serving(inputs)
        name, run = fastest_streamk(inputs, scale, tiles)
        peers = {name: run}
        for peer in args.peer:
            try:
                peers[peer] = impls.get(peer, "paged").prepare(inputs, scale=scale)
            except Exception as exc:  # a peer that cannot run this case: say why, go on
                print(json.dumps({"variant": peer, "error": str(exc)[:200]}), flush=True)
        fastest_of_each(inputs, scale, case, oracle, peers, {"space": DECODE_SPACE})


if __name__ == "__main__":
    main()
