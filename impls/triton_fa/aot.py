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


def compile_cubin(arch: int, *, dtype: str = "fp16", head_dim: int = 128, causal: bool = True,
                  block_m: int = 128, block_n: int = 64, num_warps: int = 8, num_stages: int = 3,
                  use_tma: bool = False, window: bool = False, softcap: float = 0.0) -> bytes:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from impls.triton_fa.kernel import attention_fwd as fn

    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("the kernel was imported under TRITON_INTERPRET=1: run python -m impls.triton_fa.aot")
    constants = {**head_dims(head_dim), "CAUSAL": causal, "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "DOT_FP32": dtype == "fp32", "USE_TMA": use_tma, "VARLEN": False,  # head dims padded to powers of 2
                 "HAS_WINDOW": window, "SOFTCAP": softcap,
                 "cu_seqlens_q": None, "cu_seqlens_k": None}  # dense: no sequence offsets
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V", "Out"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    # What the JIT specialises at run time for the usual contiguous tensors: pointers and strides (not
    # lengths, not the unit stride) divisible by 16. Without it loads cannot be vectorised and the cubin
    # would not be the one that runs.
    aligned = [i for i, name in enumerate(fn.arg_names)
               if name in ("Q", "K", "V", "Out") or (name.startswith("stride_") and not name.endswith("_d"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    return kernel.asm["cubin"]


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
