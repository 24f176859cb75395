"""Compile the Triton kernel for a GPU architecture without a GPU, and read its resource usage.

Triton compiles to a cubin for any ``GPUTarget`` with the ptxas it ships; ``cuobjdump`` reads the result.
This is how the pointer path's spills on sm_90 were found (see ``docs/``), and what CI checks. It needs the
kernel as compiled code, so it refuses to run under ``TRITON_INTERPRET=1``; from such a process use
``python -m impls.triton_fa.aot`` (which drops the variable):

    python -m impls.triton_fa.aot --arch 90 --tma
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from impls._sass import sass_summary
from impls.triton_fa import head_dims


def _compile(fn, arch: int, constants: dict, pointers: dict[str, str], floats: tuple[str, ...], options: dict):
    """``fn`` compiled for ``arch`` with these constexprs; ``pointers`` maps each pointer argument to its element
    type, ``floats`` names the float scalars, every other argument is an int32."""
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
            signature[name] = "fp32" if name in floats else "i32"
    # What the JIT specialises at run time for the usual contiguous tensors: pointers and strides (not
    # lengths, not the unit stride) divisible by 16. Without it loads cannot be vectorised and the cubin
    # would not be the one that runs.
    aligned = [i for i, name in enumerate(fn.arg_names)
               if name in pointers or (name.startswith("stride_") and not name.endswith("_d"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def compile_cubin(arch: int, *, dtype: str = "fp16", head_dim: int = 128, causal: bool = True,
                  block_m: int = 128, block_n: int = 64, num_warps: int = 8, num_stages: int = 3,
                  use_tma: bool = False, window: bool = False, softcap: float = 0.0) -> bytes:
    from impls.triton_fa.kernel import attention_fwd

    constants = {**head_dims(head_dim), "CAUSAL": causal, "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "DOT_FP32": dtype == "fp32", "USE_TMA": use_tma, "VARLEN": False,  # head dims padded to powers of 2
                 "HAS_WINDOW": window, "SOFTCAP": softcap,
                 "cu_seqlens_q": None, "cu_seqlens_k": None}  # dense: no sequence offsets
    kernel = _compile(attention_fwd, arch, constants, dict.fromkeys(("Q", "K", "V", "Out"), dtype), ("qk_scale",),
                      {"num_warps": num_warps, "num_stages": num_stages})
    return kernel.asm["cubin"]


def compile_decode_ptx(arch: int, *, use_pdl: bool, head_dim: int = 128, group: int = 4) -> dict[str, str]:
    """PTX of the paged decode's split and combine kernels (bf16, pages of 16, one new token)."""
    from impls.triton_fa.decode import paged_decode_combine, paged_decode_split

    rows = {"GROUP": group, "SQ": 1, "BLOCK_M": 16, "USE_PDL": use_pdl}
    split = _compile(paged_decode_split, arch, {**rows, "PAGE_SIZE": 16, "HEAD_DIM": head_dim, "BLOCK_N": 64,
                                                "DOT_FP32": False, "SPLIT": True},
                     {"Q": "bf16", "K_cache": "bf16", "V_cache": "bf16", "block_table": "i32", "cache_seqlens": "i32",
                      "O_part": "fp32", "LSE_part": "fp32", "Out": "bf16"}, ("qk_scale",),
                     {"num_warps": 4, "num_stages": 3, "launch_pdl": use_pdl})
    combine = _compile(paged_decode_combine, arch, {**rows, "MAX_SPLITS": 64, "SPLIT_CHUNK": 16, "BLOCK_D": 32},
                       {"O_part": "fp32", "LSE_part": "fp32", "cache_seqlens": "i32", "Out": "bf16"}, (),
                       {"num_warps": 4, "launch_pdl": use_pdl})
    return {"split": split.asm["ptx"], "combine": combine.asm["ptx"]}


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
    parser.add_argument("--each", action="store_true",
                        help="read one line of these options per configuration from stdin; print a JSON line each "
                             "(one process for many compiles)")
    return parser


def resources(args: argparse.Namespace) -> dict[str, int]:
    cubin = compile_cubin(args.arch, head_dim=args.d, causal=not args.full, block_m=args.block[0],
                          block_n=args.block[1], num_warps=args.warps, num_stages=args.stages, use_tma=args.tma,
                          window=args.window, softcap=args.softcap)
    return describe(cubin)


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
