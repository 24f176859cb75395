"""Compile the Triton kernel for a GPU architecture without a GPU, and read its resource usage.

Triton compiles to a cubin for any ``GPUTarget`` with the ptxas it ships; ``cuobjdump`` reads the result.
This is how the pointer path's spills on sm_90 were found (docs/design.md#triton-forward), and what CI checks. It
needs the kernel as compiled code, so it refuses to run under ``TRITON_INTERPRET=1``; from such a process use
``python -m impls.triton_fa.aot`` (which drops the variable):

    python -m impls.triton_fa.aot --arch 90 --tma
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

from impls.sass import hgmma_runs, products_beside_softmax, sass_summary
from impls.triton_fa.config import head_dims


def compile_cubin(arch: int, *, dtype: str = "fp16", head_dim: int = 128, causal: bool = True,
                  block_m: int = 128, block_n: int = 64, num_warps: int = 8, num_stages: int = 3,
                  use_tma: bool = False, window: bool = False, softcap: float = 0.0,
                  switches: dict | None = None) -> bytes:
    """``switches``: the kernel's switches (``dense.SWITCHES``) to set; HOST_DESC takes descriptor arguments, which
    this compiles no signature for."""
    from impls.triton_fa.dense import DESCRIPTORS, SWITCHES, folds_scale
    from impls.triton_fa.kernel import attention_fwd

    # the switches as a launch sets them, then the ones asked for
    switches = {**SWITCHES, "FOLD_SCALE": folds_scale(head_dim), **(switches or {})}
    if switches["HOST_DESC"]:
        raise ValueError("HOST_DESC: compile the in-kernel descriptor path (--tma) instead")
    constants = {**switches, **head_dims(head_dim), "CAUSAL": causal, "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "DOT_FP32": dtype == "fp32", "USE_TMA": use_tma, "VARLEN": False,  # head dims padded to powers of 2
                 "HAS_WINDOW": window, "SOFTCAP": softcap,
                 "cu_seqlens_q": None, "cu_seqlens_k": None,  # dense: no sequence offsets
                 **dict.fromkeys(DESCRIPTORS)}  # nor host descriptors
    kernel = compile_for(attention_fwd, arch, constants, dict.fromkeys(("Q", "K", "V", "Out"), dtype),
                         num_warps, num_stages)
    return kernel.asm["cubin"]


def compile_decode(arch: int, *, block_n: int, num_warps: int, num_stages: int, dtype: str = "bf16",
                   head_dim: int = 128, group: int = 4, page_size: int = 16, mask_free: bool = True,
                   kv_fp8: bool = False, v_words: bool = True, pdl: bool = False, prefetch: bool = False):
    """The paged decode's split kernel (decode.py) as the decode tuner launches it for a split step (one new
    token per sequence, GROUP query heads per kv head); ``kv_fp8``: over an fp8 (e4m3) cache, whose values are
    read as words (V_WORDS) unless ``v_words`` is off; ``pdl``: for programmatic dependent launch (USE_PDL);
    ``prefetch``: with the lookups asked of the L2 before the wait (PREFETCH)."""
    import triton

    from impls.triton_fa.decode import paged_decode_split

    constants = {"GROUP": group, "SQ": 1, "PAGE_SIZE": page_size, "HEAD_DIM": head_dim, "BLOCK_D": head_dim,
                 "BLOCK_M": max(16, triton.next_power_of_2(group)),  # the rows as paged_launch tiles them
                 "BLOCK_N": block_n, "DOT_FP32": False, "SPLIT": True,
                 "MASK_FREE": mask_free, "HAS_WINDOW": False, "SOFTCAP": 0.0,  # every constexpr, defaults too
                 "KV_FP8": kv_fp8, "F16_DOT": kv_fp8 and dtype == "bf16",  # impls._plans.fp16_dots
                 "V_WORDS": kv_fp8 and v_words, "USE_PDL": pdl,  # word_values, for a word-aligned cache
                 "PREFETCH": prefetch}
    pointers = {**dict.fromkeys(("Q", "Out"), dtype), **dict.fromkeys(("K_cache", "V_cache"), "fp8e4nv" if kv_fp8
                                                                        else dtype), "block_table": "i32",
                "cache_seqlens": "i32", "O_part": "fp32", "LSE_part": "fp32"}
    return compile_for(paged_decode_split, arch, constants, pointers, num_warps, num_stages)


def compile_mla(arch: int, *, rows: int, latent: int = 512, rope: int = 64, page_size: int = 64,
                kv_fp8: bool = False):
    """The MLA decode's split kernel (mla.py) as its fixed config launches a split step of ``rows`` query rows (heads
    x new tokens) over a bf16 latent cache (``kv_fp8``: an fp8 one under bf16 queries), DeepSeek's widths by
    default."""
    from impls.triton_fa.mla import MLA_CONFIG, mla_decode_split, row_tile, tile_width

    block_m, num_warps = row_tile(rows)
    constants = {"HEADS": rows, "SQ": 1, "PAGE_SIZE": page_size, "LATENT": latent, "ROPE": rope,
                 "BLOCK_L": tile_width(latent), "BLOCK_R": tile_width(rope), "BLOCK_M": block_m,
                 "BLOCK_N": MLA_CONFIG["BLOCK_N"], "DOT_FP32": False, "SPLIT": True, "KV_FP8": kv_fp8}
    pointers = {**dict.fromkeys(("Q_nope", "Q_pe", "Out"), "bf16"), "block_table": "i32", "cache_seqlens": "i32",
                **dict.fromkeys(("CKV", "KPE"), "fp8e4nv" if kv_fp8 else "bf16"), "O_part": "fp32", "LSE_part": "fp32"}
    return compile_for(mla_decode_split, arch, constants, pointers, num_warps, MLA_CONFIG["num_stages"])


def compile_mixed(arch: int, *, group: int, head_dim: int = 128, page_size: int = 16, dtype: str = "bf16",
                  split: bool = False):
    """The mixed prefill+decode kernel (mixed.py) with the tiles its launch picks for ``group`` query heads per kv
    head at this head dim; ``split``: the form that splits the decoding rows (SPLIT)."""
    from impls.triton_fa.config import block_d
    from impls.triton_fa.mixed import NUM_STAGES, mixed_attention, tiles

    block_m, block_n, num_warps = tiles(group, head_dim, interp=False)
    constants = {"GROUP": group, "TOKENS": block_m // group, "PAGE_SIZE": page_size, "HEAD_DIM": head_dim,
                 "BLOCK_D": block_d(head_dim), "BLOCK_M": block_m, "BLOCK_N": block_n, "DOT_FP32": False,
                 "SPLIT": split}
    pointers = {**dict.fromkeys(("Q", "K_cache", "V_cache", "Out"), dtype),
                **dict.fromkeys(("block_table", "cache_seqlens", "cu_seqlens_q", "work"), "i32"),
                **dict.fromkeys(("O_part", "LSE_part"), "fp32")}
    return compile_for(mixed_attention, arch, constants, pointers, num_warps, NUM_STAGES)


def compile_for(fn, arch: int, constants: dict, pointers: dict[str, str], num_warps: int, num_stages: int):
    """``fn`` compiled for sm_``arch`` with these constexprs; ``pointers``: its pointer parameters and their
    element types; ``qk_scale``, ``v_scale``, ``kv_scale`` and ``scale`` are floats, every other parameter an int32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("the kernel was imported under TRITON_INTERPRET=1: run python -m impls.triton_fa.aot")
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = f"*{pointers[name]}"
        else:
            signature[name] = "fp32" if name in ("qk_scale", "v_scale", "kv_scale", "scale") else "i32"
    # What the JIT specialises at run time for the usual contiguous tensors: pointers and strides (not
    # lengths, not the unit stride) divisible by 16. Without it loads cannot be vectorised and the cubin
    # would not be the one that runs.
    aligned = [i for i, name in enumerate(fn.arg_names)
               if name in pointers or (name.startswith("stride_") and not name.endswith("_d"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def kv_buffers(ttgir: str) -> int:
    """How many K tiles the decode kernel's loops keep in shared memory at once (the leading dimension of the
    buffer its pipeliner allocates for the ``k`` load: 1 means no load of the next tile overlaps this one's)."""
    found = re.findall(r"%k\w* = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", ttgir)
    if not found:
        raise ValueError("no pipelined K buffer in this TTGIR")
    return min(int(n) for n in found)


def dependent_launch(ptx: str) -> dict[str, int]:
    """Where the kernel waits for the grid before it (``griddepcontrol.wait``): the count of waits and of
    launch-dependents triggers, and how many global loads come before the first wait (0: none reads early)."""
    first_wait = ptx.find("griddepcontrol.wait")
    return {"pdl_waits": ptx.count("griddepcontrol.wait"),
            "pdl_triggers": ptx.count("griddepcontrol.launch_dependents"),
            "loads_before_wait": ptx[:first_wait].count("ld.global") if first_wait >= 0 else -1,
            "prefetches_before_wait": ptx[:first_wait].count("prefetch.global.L2") if first_wait >= 0 else -1,
            "prefetches": ptx.count("prefetch.global.L2")}


def describe(cubin: bytes) -> dict[str, int]:
    return sass_summary(cubin)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="compile the Triton kernel for an arch; print its resources")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--tma", action="store_true")
    parser.add_argument("--block", type=int, nargs=2, default=(128, 64), metavar=("M", "N"))
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--full", action="store_true", help="non-causal (default causal)")
    parser.add_argument("--window", action="store_true", help="with the sliding-window masks")
    parser.add_argument("--softcap", type=float, default=0.0, help="with this softcap (0: none)")
    parser.add_argument("--switch", action="append", default=[], metavar="KEY=VALUE",
                        help="set one of the kernel's switches (FOLD_SCALE=1, LAZY_RESCALE=8, PERSISTENT=1, ...)")
    parser.add_argument("--decode", type=int, nargs=3, metavar=("BLOCK_N", "WARPS", "STAGES"),
                        help="the paged decode's split kernel with this tile instead (bf16, D=128, group 4, pages of "
                             "16): its resources, shared memory and K/V buffers")
    parser.add_argument("--kv-fp8", action="store_true", help="--decode or --mla over an fp8 (e4m3) cache")
    parser.add_argument("--value-bytes", action="store_true",
                        help="--kv-fp8 with the values read as bytes (V_WORDS off), the older form")
    parser.add_argument("--pdl", action="store_true", help="--decode for programmatic dependent launch (USE_PDL)")
    parser.add_argument("--prefetch", action="store_true", help="--decode with its lookups prefetched (PREFETCH)")
    parser.add_argument("--mla", type=int, metavar="ROWS",
                        help="the MLA decode's split kernel instead, for ROWS query rows (bf16, 512 + 64, pages of 64)")
    parser.add_argument("--mixed", type=int, metavar="GROUP",
                        help="the mixed prefill+decode kernel instead, for GROUP query heads per kv head (bf16, "
                             "--d, pages of 16)")
    parser.add_argument("--split", action="store_true", help="--mixed in the form that splits the decoding rows")
    parser.add_argument("--each", action="store_true",
                        help="read one line of these options per configuration from stdin; print a JSON line each "
                             "(one process for many compiles)")
    return parser


def resources(args: argparse.Namespace) -> dict[str, int]:
    if args.mixed:
        kernel = compile_mixed(args.arch, group=args.mixed, head_dim=args.d, split=args.split)
        return {**describe(kernel.asm["cubin"]), "shared": kernel.metadata.shared}
    if args.mla:
        kernel = compile_mla(args.arch, rows=args.mla, kv_fp8=args.kv_fp8)
        return {**describe(kernel.asm["cubin"]), "shared": kernel.metadata.shared}
    if args.decode:
        block_n, num_warps, num_stages = args.decode
        kernel = compile_decode(args.arch, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                                kv_fp8=args.kv_fp8, v_words=not args.value_bytes, pdl=args.pdl,
                                prefetch=args.prefetch)
        return {**describe(kernel.asm["cubin"]), "shared": kernel.metadata.shared,
                "kv_buffers": kv_buffers(kernel.asm["ttgir"]), **dependent_launch(kernel.asm["ptx"])}
    cubin = compile_cubin(args.arch, head_dim=args.d, causal=not args.full, block_m=args.block[0],
                          block_n=args.block[1], num_warps=args.warps, num_stages=args.stages, use_tma=args.tma,
                          window=args.window, softcap=args.softcap, switches=parse_switches(args.switch))
    # hgmma_max_run 1: ptxas serialised the warpgroup MMAs (each waited for alone); products_beside_softmax: MMAs
    # in flight while the softmax's exponentials run (OVERLAP_PV)
    return {**describe(cubin), "hgmma_max_run": max(hgmma_runs(cubin), default=0),
            "products_beside_softmax": products_beside_softmax(cubin)}


def parse_switches(pairs: list[str]) -> dict:
    """``KEY=VALUE`` pairs as the switches' values, typed like their defaults."""
    from impls.triton_fa.dense import SWITCHES

    switches = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in SWITCHES or not value:
            raise SystemExit(f"--switch {pair!r}: expected KEY=VALUE with KEY one of {sorted(SWITCHES)}")
        default = SWITCHES[key]
        switches[key] = value not in ("0", "false", "False") if isinstance(default, bool) else type(default)(value)
    return switches


def main(argv: list[str] | None = None) -> None:
    options = parser()
    args = options.parse_args(argv)
    if not args.each:
        print(json.dumps(resources(args)))
        return
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(resources(options.parse_args(shlex.split(line)))), flush=True)


if __name__ == "__main__":
    if os.environ.pop("TRITON_INTERPRET", "0") not in ("", "0"):  # must be gone before triton is imported
        os.execv(sys.executable, [sys.executable, "-m", "impls.triton_fa.aot", *sys.argv[1:]])
    main()
