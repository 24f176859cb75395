"""How fast a paged KV cache can be read at all, and whether the access pattern matters (GPU; CPU checks only).

A decode kernel gives a program one (sequence, kv head): each token's K/V row of that head is ``D * itemsize``
bytes (256 for D=128 in bf16), strided by ``Hkv * D * itemsize`` (a page holds all kv heads of a token side by
side); a program that takes ``heads`` kv heads at a time reads pieces ``heads`` times longer, whole pages at
``heads = Hkv``. This times a read-only Triton kernel over exactly the bytes a decode step reads (every sequence's
pages of K and V, through the block table) for each grouping, tile shape and split, with the table's random page
order and with the pages sorted, beside a flat ``torch.sum`` over the caches and our tuned Triton decode. Prints
JSON lines with GB/s (a CUDA graph of 20 calls): the ceiling a decode kernel on this case can aim at. See
docs/design.md#triton-serving.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

EPILOG = """examples:
  python -m tools.bandwidth_probe --case llama3-8b-paged-bf16-h32:8-q1-kv32768-uniform-p16-d128-b64
  python -m tools.bandwidth_probe --case llama3-70b-tp8-paged-bf16-h8:1-q1-kv32768-uniform-p16-d128-b16 --chunks 1 4 16
  TRITON_INTERPRET=1 python -m tools.bandwidth_probe --device cpu --quick \\
    --case paged-bf16-h4:1-q1-kv300-uniform-p16-d64
"""


@triton.jit
def read_pages(K, V, table, seqlens, Out, stride_kp, stride_ks, stride_bt, num_groups, split_len,
               PAGE_SIZE: tl.constexpr, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (split, sequence * head group): sum K and V over the group's WIDTH contiguous columns of every
    token of one chunk of the sequence (the sum only keeps the loads alive)."""
    split = tl.program_id(0)
    bg = tl.program_id(1)
    batch = bg // num_groups
    column0 = (bg % num_groups) * WIDTH
    seq_len = tl.load(seqlens + batch)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    offs_n = tl.arange(0, BLOCK_N)
    cols = column0 + tl.arange(0, WIDTH)
    acc = tl.zeros([BLOCK_N, WIDTH], dtype=tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        keep = pos < end
        page = tl.load(table + batch * stride_bt + pos // PAGE_SIZE, mask=keep, other=0).to(tl.int64)
        offs = page[:, None] * stride_kp + (pos % PAGE_SIZE)[:, None] * stride_ks + cols[None, :]
        acc += tl.load(K + offs, mask=keep[:, None], other=0.0).to(tl.float32)
        acc += tl.load(V + offs, mask=keep[:, None], other=0.0).to(tl.float32)
    tl.store(Out + split * tl.num_programs(1) + bg, tl.sum(tl.sum(acc, 1), 0))


def visible_sum(inputs: Any, k: torch.Tensor, v: torch.Tensor) -> float:
    """The sum of every K and V element a decode step reads: what each grouping's partial sums add up to."""
    total = 0.0
    for b, length in enumerate(inputs.seqlens):
        pages = inputs.block_table[b, : -(-length // inputs.page_size)].long()
        total += sum(c[pages].flatten(0, 1)[:length].double().sum().item() for c in (k, v))
    return total


def sorted_table(inputs: Any) -> torch.Tensor:
    """The block table with each sequence's full pages in address order (the same pages; the last, partly
    filled one stays last)."""
    table = inputs.block_table.clone()
    for b, length in enumerate(inputs.seqlens):
        full = length // inputs.page_size
        table[b, :full] = table[b, :full].sort().values
    return table


def reader(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, inputs: Any, heads: int, block_n: int,
           warps: int, stages: int, chunks: int = 1) -> tuple[Callable[[], None], torch.Tensor]:
    """A call reading every sequence's pages, ``heads`` kv heads a program, with as many programs as a decode
    launch of ``chunks`` chunks a (sequence, kv head) (batch x Hkv x chunks): fewer head groups, more chunks.
    Returns (call, output)."""
    batch, hkv, d = table.shape[0], k.shape[2], k.shape[3]
    groups, splits = hkv // heads, heads * chunks  # batch x groups x splits programs: batch x Hkv x chunks
    split_len = -(-max(inputs.seqlens) // splits)
    out = torch.empty(splits * batch * groups, device=k.device)

    def call() -> None:
        read_pages[(splits, batch * groups)](
            k, v, table, inputs.cache_seqlens, out, k.stride(0), k.stride(1), table.stride(0), groups, split_len,
            PAGE_SIZE=inputs.page_size, WIDTH=heads * d, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return call, out


def probe(case_id: str, device: str = "cuda", quick: bool = False, chunks: tuple[int, ...] = (1,)) -> None:
    """Every grouping, tile shape and split of the reader on the case, each checked against the sum it must read
    (and, on a GPU, timed beside a flat read and the tuned decode)."""
    import impls
    from impls.timing import graph_ms
    from suite import metrics
    from suite.presets import case_by_id

    case = case_by_id(case_id)
    inputs = case.make_inputs(device)
    k, v = (torch.nan_to_num(c) for c in (inputs.k_cache, inputs.v_cache))  # spare pages hold NaN
    hkv, d = k.shape[2], k.shape[3]
    nbytes = metrics.kv_bytes(case)
    expected = visible_sum(inputs, k, v)
    timed = device == "cuda"
    if timed:
        flat = (k.numel() + v.numel()) * k.element_size()
        ms = graph_ms(lambda: (k.sum(dtype=torch.float32), v.sum(dtype=torch.float32)), repeats=20)
        print(json.dumps({"case": case_id, "pattern": "torch.sum over both caches (every page)",
                          "gbps": round(flat / ms / 1e6)}), flush=True)
        prepared = impls.get("triton", "paged").prepare(inputs, scale=d ** -0.5)
        ms = graph_ms(prepared, repeats=20)
        print(json.dumps({"pattern": "our Triton decode (tuned)", "config": str(prepared.config)[:160],
                          "gbps": round(nbytes / ms / 1e6)}), flush=True)
    shapes = [(16, 4, 2)] if quick else [(n, w, s) for n in (16, 32, 64) for w in (4, 8) for s in (2, 3, 4)]
    for order, table in {"random": inputs.block_table, "sorted": sorted_table(inputs)}.items():
        for heads in sorted({1, 2, 4, hkv}):
            for (block_n, warps, stages), chunk in itertools.product(shapes, chunks):
                if hkv % heads or block_n * heads * d > 16384:
                    continue
                call, out = reader(k, v, table, inputs, heads, block_n, warps, stages, chunk)
                try:
                    call()
                    ms = graph_ms(call, repeats=20) if timed else float("nan")
                except Exception as exc:  # out of resources: say so, go on
                    print(json.dumps({"heads": heads, "error": str(exc)[:120]}), flush=True)
                    continue
                error = abs(out.double().sum().item() - expected) / max(abs(expected), 1.0)
                print(json.dumps({
                    "order": order, "heads": heads, "bytes_contiguous": heads * d * k.element_size(),
                    "block_n": block_n, "warps": warps, "stages": stages, "chunks": chunk,
                    "relative_error": f"{error:.1e}", "gbps": round(nbytes / ms / 1e6) if timed else None}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bandwidth_probe", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", help="a paged serving case id (repeatable)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: check the sums under TRITON_INTERPRET=1, no timing (default cuda)")
    parser.add_argument("--quick", action="store_true", help="one tile shape per grouping")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1],
                        help="chunks a (sequence, kv head), as a split-KV decode launch has (few sequences and kv "
                             "heads leave most SMs idle with one)")
    args = parser.parse_args(argv)
    for case_id in args.case or ["llama3-8b-paged-bf16-h32:8-q1-kv32768-uniform-p16-d128-b64"]:
        probe(case_id, args.device, args.quick, tuple(args.chunks))


if __name__ == "__main__":
    main()
