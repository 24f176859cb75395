"""Run one case of any preset with the given implementations inside an NVTX range, for Nsight Compute (GPU).

Each implementation is prepared (validated, tuned, compiled, planned) outside the range and its output checked
against the float64 oracle; then it is called ``--calls`` times inside the NVTX range ``profile``, so that ncu
profiles those calls only. The kernel names tell the implementations apart in ncu's report; the implementations
are printed in the order they ran, with the config each chose.
"""

from __future__ import annotations

import argparse

EPILOG = """example:
  ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight --section MemoryWorkloadAnalysis \\
    python -m tools.profile_case --case llama3-8b-paged-bf16-h32:8-q1-kv8192-uniform-p16-d128-b64 \\
    --impl triton --impl flashinfer
"""


def profile(case_id: str, names: list[str], calls: int) -> None:
    """Prepare and check each implementation on the case, then call it ``calls`` times inside the range."""
    import torch

    import impls
    from suite.checks import Oracle
    from suite.presets import case_by_id

    case = case_by_id(case_id)
    inputs = case.make_inputs("cuda")
    dense = case.op == "dense"
    oracle = Oracle.dense(*inputs, causal=case.causal, **case.variants) if dense else Oracle.serving(inputs)
    for name in names:
        impl = impls.get(name, case.op)
        prepared = impl.prepare(*inputs, causal=case.causal, **case.variants) if dense else impl.prepare(inputs)
        result = oracle.check(prepared())
        print(f"{name}: {result.message}; config {prepared.config}", flush=True)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        for _ in range(calls):
            prepared()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.profile_case", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", required=True, help="a case id of any preset")
    parser.add_argument("--impl", action="append", required=True, help="an implementation (repeatable)")
    parser.add_argument("--calls", type=int, default=1, help="calls inside each range (default 1)")
    args = parser.parse_args(argv)
    profile(args.case, args.impl, args.calls)


if __name__ == "__main__":
    main()
