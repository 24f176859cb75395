"""Cross-check the suite's three timing modes against ``triton.testing.do_bench_cudagraph`` (GPU).

For every case of the presets and every implementation given, in this process and back to back: eager (the
suite's CUDA-event rounds), graph (the suite's ``GraphTarget``, replays timed with events, per call), kernel (the
profiler's device time of one call's kernels) and ``do_bench_cudagraph`` (median). Prints a row each and the
median differences; ``--out`` keeps the rows as JSON, rewritten after each so that a run cut short keeps them.
Rerun it after a change to ``impls/timing.py`` or on a new GPU: see docs/design.md#timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

EPILOG = """example:
  python -m tools.timing_compare --grid blog --grid decode --impl cutile --impl sdpa-cudnn --out timing.json
"""


def compare(grids: list[str], names: list[str], out: str | None) -> list[dict[str, Any]]:
    """A row per case and implementation that runs it: each way's milliseconds and graph's differences."""
    import torch
    import triton

    import impls
    from impls.timing import GraphTarget, event_rounds_median, graph_repeats, profile_kernels, time_once
    from suite.presets import cases
    from suite.problem import Problem

    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    for _, case in cases(grids):
        problem = Problem(case, device)
        for impl in impls.select(names):
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
            row = {"impl": impl.name, "case": case.id, "eager_ms": eager, "graph_ms": graphed, "kernel_ms": kernel,
                   "do_bench_cudagraph_ms": theirs, "graph_vs_dobench_pct": 100 * (graphed / theirs - 1),
                   "graph_vs_kernel_pct": 100 * (graphed / kernel - 1)}
            rows.append(row)
            print(f"{impl.name:16s} {case.id:48s} eager {eager:8.4f}  graph {graphed:8.4f}  kernel {kernel:8.4f}  "
                  f"do_bench_cudagraph {theirs:8.4f} ms  graph/dbcg {row['graph_vs_dobench_pct']:+5.1f}%  "
                  f"graph/kernel {row['graph_vs_kernel_pct']:+5.1f}%", flush=True)
            del prepared, graph
            if out:
                with open(out, "w") as f:
                    json.dump(rows, f, indent=1)
        del problem
        torch.cuda.empty_cache()
    return rows


def summarize(rows: list[dict[str, Any]]) -> None:
    """The median absolute differences, over the rows of 0.1 ms or more (launch overheads aside) and over all."""
    for lo, label in ((0.1, "over 0.1 ms"), (0.0, "all")):
        sel = [r for r in rows if r["graph_ms"] >= lo]
        if sel:
            print(f"{label}: {len(sel)} rows; median |graph vs do_bench_cudagraph| "
                  f"{statistics.median(abs(r['graph_vs_dobench_pct']) for r in sel):.1f}%, median |graph vs kernel| "
                  f"{statistics.median(abs(r['graph_vs_kernel_pct']) for r in sel):.1f}%")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.timing_compare", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", action="append", required=True, help="a preset (repeatable)")
    parser.add_argument("--impl", action="append", required=True, help="an implementation or glob (repeatable)")
    parser.add_argument("--out", default=None, help="write the rows here as JSON")
    args = parser.parse_args(argv)
    summarize(compare(args.grid, args.impl, args.out))


if __name__ == "__main__":
    main()
