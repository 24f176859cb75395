"""Explore configurations on a GPU: TFLOPS of every candidate config of our kernels beside SDPA and flash-attn.

For each dense case (batch 4, 32 query heads, the sequence lengths, head dims, dtypes and kv heads given), every
candidate is first checked against the float64 oracle, then timed with ``triton.testing.do_bench`` (median, L2
flushed). cuTile's candidates are its blog ladder, the autotuner's spaces and the forms the tuner leaves out
(``other_forms`` and a few wider pipelines); Triton's are its autotuner configs and a few more, and with
``--which variants`` the named configs of the kernel's switches (``TRITON_VARIANTS``). A candidate that does not
compile or fails the check is a row with ``passed: false``, and the sweep goes on. Prints a row per
candidate and writes them as JSON. Used to choose the autotuners' search spaces: see docs/design.md#tuning.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import sys
from collections.abc import Callable, Iterator
from fnmatch import fnmatchcase
from typing import Any

# A candidate: its name, and a maker that takes (q, k, v, out, causal, scale) and returns the call to time.
Maker = Callable[..., Callable[[], Any]]

EPILOG = """examples:
  python -m tools.sweep --seqlens 1024 4096 16384 --out sweep.json
  python -m tools.sweep --seqlens 4096 --causal causal --which sdpa cutile --match sdpa-cudnn --match 'cutile:*'
  python -m tools.sweep --d 192 --dv 128 --causal causal --which cutile --tuner-space
  python -m tools.sweep --d 64 128 --layout fa3 --seqlens 2048 4096 8192 16384 --which sdpa variants
  ncu --nvtx --nvtx-include "profile/" python -m tools.sweep --profile --seqlens 4096 --match 'cutile:128x128*'
"""


def cutile_candidates(head_dim: int = 128, extras: bool = True, value_dim: int | None = None) -> Iterator[
        tuple[str, Maker]]:
    """Every cuTile candidate: the tuner's spaces, and with ``extras`` the ladder and the forms outside the
    spaces; ``value_dim``: V's head dim where it differs (MLA)."""
    from dataclasses import replace

    from impls.cutile.config import Variant, head_tiles
    from impls.cutile.launch import Call
    from impls.cutile.spaces import LADDER, other_forms, search_space

    # Wider pipelines and the blog's branch form, compared against the spaces when they were chosen
    wide = Variant(128, 128, occupancy=1, num_worker_warps=8, k_latency=3, v_latency=6, head_group=None)
    pair = Variant(64, 128, occupancy=2, head_group=None)  # one warpgroup per block, two blocks per SM
    persistent = replace(wide, persistent=True)
    extra = [wide, replace(wide, k_latency=2, v_latency=4),
             *(replace(persistent, k_latency=k, v_latency=v) for k, v in ((2, 4), (3, 6), (4, 4), (4, 8), (8, 8))),
             replace(persistent, tile_n=256), replace(persistent, tile_n=256, k_latency=2, v_latency=4),
             replace(wide, mask_branch=True), replace(wide, mask_branch=True, k_latency=2, v_latency=4),
             replace(persistent, mask_branch=True), replace(persistent, loop_split=False),
             pair, replace(pair, persistent=True),
             *(replace(persistent, two_launch=True, k_latency=k, v_latency=v) for k, v in ((2, 4), (4, 8))),
             replace(wide, two_launch=True), *other_forms()]
    if head_dim <= 64:  # 256 query rows a block, 128 a warpgroup: no spill at D=64 with 64-key tiles (128 spill)
        tall = replace(wide, tile_m=256, tile_n=64)
        extra += [tall, replace(tall, k_latency=2, v_latency=4), replace(tall, persistent=True),
                  replace(tall, persistent=True, k_latency=4, v_latency=8)]
    seen: set[Variant] = set()
    named = [(name, v) for name, (v, _) in LADDER.items()] if extras else []
    space = [*search_space((9, 0), head_dim, causal=True, value_dim=value_dim),
             *search_space((9, 0), head_dim, causal=False, value_dim=value_dim)]
    if head_tiles(head_dim)[1]:  # a head dim with a tail tile: the tuner's candidates padded too
        space += [replace(v, head_tail=False) for v in space]
    if value_dim and value_dim != head_dim:  # V of its own (MLA): the set Q/K's width alone would choose, to compare
        space += [*search_space((9, 0), head_dim, causal=True), *search_space((9, 0), head_dim, causal=False)]
    space += extra if extras else []
    named += [(f"cutile:{v.label()}", v) for v in space if not (v in seen or seen.add(v))]
    for name, variant in named:
        def make(q, k, v, out, causal: bool, scale: float, _variant: Variant = variant) -> Callable[[], Any]:
            return Call(_variant, q, k, v, out=out, causal=causal, scale=scale)
        yield name, make


def triton_candidates() -> Iterator[tuple[str, Maker]]:
    """The Triton autotuner's configs (pointer and TMA) and a few outside them."""
    from impls.triton_fa.dense import configs, launch

    extra = [{"BLOCK_M": m, "BLOCK_N": n, "USE_TMA": tma, "num_warps": w, "num_stages": s}
             for tma, m, n, w, s in [(False, 128, 128, 8, 4), (False, 128, 64, 8, 2), (True, 128, 64, 8, 4),
                                     (True, 128, 128, 8, 3), (True, 64, 128, 4, 2)]]
    for cfg in configs(pointer=True, tma=True) + extra:
        def make(q, k, v, out, causal: bool, scale: float, cfg: dict[str, Any] = cfg) -> Callable[[], Any]:
            return lambda: launch(cfg, q, k, v, out, causal=causal, scale=scale)
        tiles = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}:w{cfg['num_warps']}s{cfg['num_stages']}"
        path = "-host" if cfg.get("HOST_DESC") else "-tma" if cfg["USE_TMA"] else ""
        yield f"triton{path}:{tiles}", make


# Named configs of the Triton kernel's switches (impls/triton_fa/dense.py SWITCHES), each beside the plain kernel
# at the tile the tuner favours (128x64, 8 warps): `--which variants`. "host": descriptors built on the host.
# Every switch off, as measured against: FOLD_SCALE is now on by default at D <= 64, so base names it.
_BASE = {"BLOCK_M": 128, "BLOCK_N": 64, "USE_TMA": False, "num_warps": 8, "num_stages": 3, "FOLD_SCALE": False}
_TMA = {**_BASE, "USE_TMA": True, "num_stages": 2}
_HOST = {**_TMA, "HOST_DESC": True}
_FOLD_LAZY = {"FOLD_SCALE": True, "LAZY_RESCALE": 8.0}
_OVERLAP = {"OVERLAP_PV": True}
_PERSIST = {"PERSISTENT": 1}  # head by head (2: the heaviest tiles of all heads first)
TRITON_VARIANTS: dict[str, dict[str, Any]] = {
    "base": _BASE,
    "base-s4": {**_BASE, "num_stages": 4},
    "fold": {**_BASE, "FOLD_SCALE": True},
    "lazy8": {**_BASE, "LAZY_RESCALE": 8.0},
    "fold-lazy8": {**_BASE, **_FOLD_LAZY},
    "overlap": {**_BASE, **_OVERLAP},
    "overlap-fold": {**_BASE, **_OVERLAP, "FOLD_SCALE": True},
    "overlap-s4": {**_BASE, **_OVERLAP, "num_stages": 4},
    "loop2": {**_BASE, "LOOP_STAGES": 2},
    "loop4": {**_BASE, "LOOP_STAGES": 4},
    "persist": {**_BASE, **_PERSIST},
    "persist-fold-lazy8": {**_BASE, **_PERSIST, **_FOLD_LAZY},
    "128x128-s2": {**_BASE, "BLOCK_N": 128, "num_stages": 2},
    "128x128-s3": {**_BASE, "BLOCK_N": 128},
    "128x128-fold-lazy8": {**_BASE, "BLOCK_N": 128, **_FOLD_LAZY},
    "tma": _TMA,
    "host": _HOST,
    "host-s3": {**_HOST, "num_stages": 3},
    "host-fold-lazy8": {**_HOST, **_FOLD_LAZY},
    "host-overlap": {**_HOST, **_OVERLAP},
    "host-overlap-fold": {**_HOST, **_OVERLAP, "FOLD_SCALE": True},
    "host-overlap-s3": {**_HOST, **_OVERLAP, "num_stages": 3},
    "host-128x128-overlap": {**_HOST, **_OVERLAP, "BLOCK_N": 128},
    "host-128x128-overlap-s3": {**_HOST, **_OVERLAP, "BLOCK_N": 128, "num_stages": 3},
    "host-ws": {**_HOST, "WARP_SPECIALIZE": True},
    "host-128x128-s2": {**_HOST, "BLOCK_N": 128},
    "host-128x128-s3": {**_HOST, "BLOCK_N": 128, "num_stages": 3},
    "host-persist": {**_HOST, **_PERSIST},
    "host-persist-x2": {**_HOST, **_PERSIST, "PROGRAMS_PER_SM": 2},
    "host-persist-heavy": {**_HOST, "PERSISTENT": 2},
    "host-persist-fold-lazy8": {**_HOST, **_PERSIST, **_FOLD_LAZY},
    "host-persist-overlap-fold": {**_HOST, **_PERSIST, **_OVERLAP, "FOLD_SCALE": True},
}


def variant_candidates() -> Iterator[tuple[str, Maker]]:
    """``TRITON_VARIANTS`` through ``launch``, named ``triton-v:NAME``."""
    from impls.triton_fa.dense import fixed_launch

    for name, cfg in TRITON_VARIANTS.items():
        def make(q, k, v, out, causal: bool, scale: float, cfg: dict[str, Any] = cfg) -> Callable[[], Any]:
            return fixed_launch(cfg, q, k, v, out, causal=causal, scale=scale)
        yield f"triton-v:{name}", make


def precompile_variants(names: list[str], q, k, v, causal: bool, scale: float) -> None:
    """Compile the named variants (``triton-v:NAME``) in threads before any is timed; one that does not compile
    is left for its timed turn to report."""
    from concurrent.futures import ThreadPoolExecutor

    from impls.triton_fa.dense import launch

    def compile_one(name: str) -> None:
        out = q.new_empty((*q.shape[:3], v.shape[-1]))
        with contextlib.suppress(Exception):  # reported when the candidate runs
            launch(TRITON_VARIANTS[name.removeprefix("triton-v:")], q, k, v, out, causal=causal, scale=scale,
                   warmup=True)

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(compile_one, [n for n in names if n.startswith("triton-v:")]))


def variant_summary(rows: list[dict[str, Any]], base: str = "triton-v:base",
                    peer: str = "flash-attn4") -> list[str]:
    """Per timed case with Triton variants: the best variant, its TFLOPS, and its ratio to ``base`` and to ``peer``
    (where they were timed)."""
    lines = []
    for case in dict.fromkeys(row["case"] for row in rows):
        timed = {row["name"]: row["tflops"] for row in rows if row["case"] == case and row["tflops"]}
        variants = {name: tf for name, tf in timed.items() if name.startswith("triton-v:")}
        if not variants:
            continue
        best = max(variants, key=variants.get)
        ratios = [f"{variants[best] / timed[ref]:.3f} of {ref}" for ref in (base, peer) if ref in timed]
        lines.append(f"{case:40s} best {best} {variants[best]:.1f} TFLOPS ({', '.join(ratios)})")
    return lines


def batch_heads(layout: str, seqlen: int, head_dim: int) -> tuple[int, int]:
    """(batch, query heads) of a case: the blog's 4 x 32, the FlashAttention-3 chart's B * S = 16384 tokens and
    Hq * D = 2048 (suite/presets.py), or ``BxH`` as given."""
    if "x" in layout:
        batch, heads = layout.split("x")
        return int(batch), int(heads)
    if layout == "fa3":
        return max(1, 16384 // seqlen), 2048 // head_dim
    return 4, 32


def peer_candidates(device: str = "cuda") -> Iterator[tuple[str, Maker]]:
    """cuDNN's and flash SDPA, and flash-attn 4, where they run here."""
    import impls

    for name in ("sdpa-cudnn", "sdpa-flash", "flash-attn4"):
        impl = impls.get(name)
        if impl.availability(device) is None:
            def make(q, k, v, out, causal: bool, scale: float, impl: Any = impl) -> Callable[[], Any]:
                return impl.prepare(q, k, v, causal=causal, scale=scale)
            yield name, make


def profile_once(fn: Callable[[], Any], warmup: int = 3) -> None:
    """One call inside the NVTX range ``profile``, after warm-up calls outside it."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every matching candidate on every case of the options: checked, then timed, profiled or neither."""
    import torch
    import triton

    from suite.cases import Case
    from suite.checks import Oracle
    from suite.metrics import flops

    on_gpu = args.device == "cuda"
    if not (on_gpu or args.check_only):
        raise SystemExit("timing needs a GPU: on CPU (Triton's interpreter) pass --check-only")
    causal_opts = {"both": [True, False], "causal": [True], "full": [False]}[args.causal]
    rows: list[dict[str, Any]] = []
    unmatched: set[str] = set()
    for d, causal, s, dtype, hkv in itertools.product(args.d, causal_opts, args.seqlens, args.dtype, args.hkv):
        batch, heads = batch_heads(args.layout, s, d)
        case = Case(batch, heads, min(hkv, heads), s, s, d, dtype, causal, dv=args.dv)
        q, k, v = case.make_inputs(args.device)
        oracle = Oracle.dense(q, k, v, causal=causal)
        scale = d ** -0.5
        cands: list[tuple[str, Maker]] = []
        if "sdpa" in args.which:
            cands += list(peer_candidates(args.device))
        if "cutile" in args.which:
            cands += list(cutile_candidates(d, extras=not args.tuner_space, value_dim=args.dv or None))
        if "triton" in args.which:
            cands += list(triton_candidates())
        if "variants" in args.which:
            cands += list(variant_candidates())
        for glob in (g for g in args.match if not any(fnmatchcase(n, g) for n, _ in cands) and g not in unmatched):
            # e.g. cuTile's dynamically scheduled forms, which other_forms offers with bytecode 13.5 only
            print(f"--match {glob!r}: no candidate here", file=sys.stderr)
            unmatched.add(glob)  # said once, not for every case
        cands = [(n, m) for n, m in cands if not args.match or any(fnmatchcase(n, g) for g in args.match)]
        precompile_variants([n for n, _ in cands], q, k, v, causal, scale)
        for name, make in cands:
            out = q.new_empty((*q.shape[:3], v.shape[-1]))
            try:
                fn = make(q, k, v, out, causal, scale)
                res = fn()
                res = res if isinstance(res, torch.Tensor) else out  # launchers return handles
                if on_gpu:
                    torch.cuda.synchronize()
                chk = oracle.check(res)
                ms = None
                if chk.passed and not args.check_only:
                    if args.profile:
                        profile_once(fn)
                    else:
                        ms = triton.testing.do_bench(fn, warmup=100, rep=args.rep, return_mode="median")
            except Exception as e:  # a candidate this shape or compiler refuses: say why, go on
                chk, ms = None, None
                print(f"{case.id} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            tf = flops(case) / (ms * 1e-3) / 1e12 if ms else None
            rows.append({"case": case.id, "seq": s, "d": d, "causal": causal, "dtype": dtype, "hkv": hkv, "name": name,
                         "ms": ms, "tflops": tf,
                         "passed": chk.passed if chk else False, "err": chk.max_error if chk else None})
            done = "checked" if args.check_only else "profiled" if args.profile else None
            shown = f"{tf:.1f}" if tf else done if done and chk and chk.passed else "FAIL"
            print(f"{case.id:40s} {name:55s} {shown:>8} {'' if chk is None else chk.message[:50]}", flush=True)
        del q, k, v, oracle
        if on_gpu:
            torch.cuda.empty_cache()
    return rows


def layout_arg(text: str) -> str:
    if text in ("blog", "fa3") or re.fullmatch(r"[1-9]\d*x[1-9]\d*", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected blog, fa3 or BxH (e.g. 2x8)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.sweep", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384],
                        help="query and key lengths (equal), one case each")
    parser.add_argument("--causal", choices=["both", "causal", "full"], default="both")
    parser.add_argument("--d", type=int, nargs="+", default=[128], help="Q/K head dims (and V's, without --dv)")
    parser.add_argument("--layout", type=layout_arg, default="blog",
                        help="batch x query heads: 'blog' (4 x 32), 'fa3' (the FlashAttention-3 chart's 16384 tokens "
                             "and Hq * D = 2048) or BxH, e.g. 2x8 (--hkv is capped at Hq)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: check the Triton candidates under TRITON_INTERPRET=1 (with --check-only)")
    parser.add_argument("--rep", type=int, default=400, help="milliseconds of timed calls per candidate")
    parser.add_argument("--dv", type=int, default=0,
                        help="V's head dim where it differs from --d (MLA: --d 192 --dv 128)")
    parser.add_argument("--dtype", nargs="+", default=["fp16"], choices=["fp16", "bf16"])
    parser.add_argument("--hkv", type=int, nargs="+", default=[32], help="kv heads (of 32 query heads): GQA below 32")
    parser.add_argument("--which", nargs="+", default=["sdpa", "cutile", "triton"],
                        choices=["sdpa", "cutile", "triton", "variants"],
                        help="candidate families (sdpa: the peers; variants: the Triton kernel's switches, "
                             "TRITON_VARIANTS)")
    parser.add_argument("--match", action="append", default=[], metavar="GLOB", help="candidate names to keep")
    parser.add_argument("--out", default=None, help="write the rows here as JSON")
    parser.add_argument("--tuner-space", action="store_true",
                        help="cuTile: only the autotuner's candidates (padded too, for a head dim with a tail tile), "
                             "not the ladder and the other forms")
    parser.add_argument("--check-only", action="store_true",
                        help="compile and check every candidate, no timing (fills the compile caches: several such "
                             "runs side by side compile in parallel before one timed run)")
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing, run each checked candidate once more inside an NVTX range 'profile' "
                             "(for ncu --nvtx --nvtx-include profile/); the order printed is ncu's order")
    args = parser.parse_args(argv)
    rows = sweep(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    for line in variant_summary(rows):
        print(line)


if __name__ == "__main__":
    main()
