"""Run one case of any preset with the given implementations inside NVTX ranges, for Nsight Compute (GPU).

Each implementation is prepared (compile, tune, plan) outside the range, checked against the float64 oracle,
then called ``--calls`` times inside an NVTX range ``profile`` (the kernel names tell the implementations apart in
ncu's report; they are printed in order):

    ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight --section MemoryWorkloadAnalysis \\
      python3 scripts/profile_case.py --case llama3-8b-paged-bf16-h32:8-q1-kv8192-uniform-p16-d128-b64 \\
      --impl triton --impl flashinfer
"""

from __future__ import annotations

import argparse

import torch

import impls
from suite.cases import case_by_id
from suite.checks import Oracle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", required=True, help="a case id of any preset")
    parser.add_argument("--impl", action="append", required=True, help="an implementation (repeatable)")
    parser.add_argument("--calls", type=int, default=1, help="calls inside each range")
    args = parser.parse_args()
    case = case_by_id(args.case)
    inputs = case.make_inputs("cuda")
    oracle = Oracle.serving(inputs) if case.op != "dense" else Oracle.dense(*inputs, causal=case.causal,
                                                                            **case.variants)
    for name in args.impl:
        impl = impls.get(name, case.op)
        prepared = impl.prepare(inputs) if case.op != "dense" else impl.prepare(*inputs, causal=case.causal,
                                                                                 **case.variants)
        result = oracle.check(prepared())
        print(f"{name}: {result.message}; config {prepared.config}", flush=True)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        for _ in range(args.calls):
            prepared()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
