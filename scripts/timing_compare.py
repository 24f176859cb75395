"""Cross-check the suite's three timing modes against ``triton.testing.do_bench_cudagraph`` (GPU).

    python scripts/timing_compare.py --grid blog --grid decode --impl cutile --impl sdpa-cudnn [--out FILE]

For every case and implementation, in this process and back to back: eager (the suite's CUDA-event rounds),
graph (the suite's ``GraphTarget``, replays timed with events, per call), kernel (the profiler's device time of
one call's kernels) and ``do_bench_cudagraph`` (median). Prints one row each and the median differences.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

import impls
from impls.timing import GraphTarget, event_rounds_median, graph_repeats, profile_kernels, time_once
from suite.cases import cases
from suite.plugin import Problem


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--grid", action="append", required=True)
    p.add_argument("--impl", action="append", required=True)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device("cuda")
    rows = []
    for _, case in cases(a.grid):
        problem = Problem(case, device)
        for impl in impls.select(a.impl):
            if impl.op != case.op or impl.availability("cuda"):
                continue
            try:
                prepared = problem.prepare(impl)
            except impls.Unsupported as exc:
                print(f"{impl.name:16s} {case.id}: unsupported ({exc})")
                continue
            eager = event_rounds_median(prepared) * 1e3
            graph = GraphTarget([prepared], graph_repeats(time_once(prepared, device), 1))
            graphed = event_rounds_median(graph, graph.calls_per_replay) * 1e3
            kernel = profile_kernels(prepared, calls=10).seconds_per_call * 1e3
            theirs = triton.testing.do_bench_cudagraph(prepared, rep=200, return_mode="median")
            rows.append({"impl": impl.name, "case": case.id, "eager_ms": eager, "graph_ms": graphed,
                         "kernel_ms": kernel, "do_bench_cudagraph_ms": theirs,
                         "graph_vs_dobench_pct": 100 * (graphed / theirs - 1),
                         "graph_vs_kernel_pct": 100 * (graphed / kernel - 1)})
            r = rows[-1]
            print(f"{impl.name:16s} {case.id:48s} eager {eager:8.4f}  graph {graphed:8.4f}  kernel {kernel:8.4f}  "
                  f"do_bench_cudagraph {theirs:8.4f} ms  graph/dbcg {r['graph_vs_dobench_pct']:+5.1f}%  "
                  f"graph/kernel {r['graph_vs_kernel_pct']:+5.1f}%", flush=True)
            del prepared, graph
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(rows, f, indent=1)
        del problem
        torch.cuda.empty_cache()
    for lo, label in ((0.1, "over 0.1 ms"), (0.0, "all")):
        sel = [r for r in rows if r["graph_ms"] >= lo]
        if sel:
            print(f"{label}: {len(sel)} rows; median |graph vs do_bench_cudagraph| "
                  f"{statistics.median(abs(r['graph_vs_dobench_pct']) for r in sel):.1f}%, median |graph vs kernel| "
                  f"{statistics.median(abs(r['graph_vs_kernel_pct']) for r in sel):.1f}%")


if __name__ == "__main__":
    main()
