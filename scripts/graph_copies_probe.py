"""Replay one serving case's prepared call in a CUDA graph over copies of its inputs, as ``--cold-l2`` graph timing
does, and say whether the replays run and stay correct (GPU).

Session 65's `serve-cold` run lost the Triton decode to an illegal memory access on its first `--cold-l2` case (8B 1 x
512: 61 copies, one split and one combine each, under programmatic dependent launch), where one copy ran every case.
Each form here runs in a process of its own (an illegal access ends the CUDA context):

    python scripts/graph_copies_probe.py --case llama3-8b-paged-bf16-h32:8-q1-kv512-uniform-p16-d128 \\
        --impl triton --copies 61 [--no-pdl] [--replays 5]

Prints one JSON line: the form, and the replay that failed with its error, or that all replayed and checked.
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch

import impls
import impls.triton_fa.paged
from impls.timing import GraphTarget
from suite.cases import preset
from suite.plugin import Problem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, help="a case id of --grid")
    parser.add_argument("--grid", default="serving")
    parser.add_argument("--impl", default="triton")
    parser.add_argument("--copies", type=int, default=61, help="prepared calls on distinct copies of the inputs")
    parser.add_argument("--repeats", type=int, default=1, help="passes over the copies in one graph")
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--no-pdl", action="store_true", help="programmatic dependent launch off (the Triton decode)")
    parser.add_argument("--back-to-back", action="store_true",
                        help="replay without waiting between replays (as the suite times a graph), checked at the end")
    args = parser.parse_args()
    form = {key: value for key, value in vars(args).items() if key != "grid"}
    case = next(c for c in preset(args.grid) if c.id == args.case)
    problem = Problem(case, torch.device("cuda"))
    impl = impls.get(args.impl, case.op)  # loads the implementations, Triton's module among them
    with mock.patch.object(impls.triton_fa.paged, "dependent_launch_available", lambda device: not args.no_pdl):
        calls = [problem.prepare(impl, inputs) for inputs in problem.input_copies(args.copies)]
    torch.cuda.synchronize()
    form["config"] = calls[0].config
    graph = GraphTarget(calls, args.repeats)
    if args.back_to_back:
        try:
            for _ in range(args.replays):
                graph()
            torch.cuda.synchronize()
        except Exception as exc:
            print(json.dumps({**form, "failed": f"{type(exc).__name__}: {exc}"[:300]}, default=str))
            return
    for replay in range(1, args.replays + 1):
        try:
            graph()
            torch.cuda.synchronize()
            check = problem.check(graph.outputs[0])
        except Exception as exc:  # the illegal access surfaces at the first synchronisation after it
            print(json.dumps({**form, "failed_replay": replay, "error": f"{type(exc).__name__}: {exc}"[:300]},
                             default=str))
            return
        if not check.passed:
            print(json.dumps({**form, "wrong_replay": replay, "check": check.message}, default=str))
            return
    print(json.dumps({**form, "replayed": args.replays, "checked": True}, default=str))


if __name__ == "__main__":
    main()
