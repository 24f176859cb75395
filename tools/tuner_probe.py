"""Time every candidate of cuTile's dense tuner on a case several ways: does the tuner pick what the suite then
measures fastest? (GPU)

The tuner ranks its candidates with ``cuda.tile.tune.exhaustive_search`` (one launch at a time, L2 flushed, the
mean of at least five) and by default (``FMHA_TUNER=settled``) times its finalists again, each alone at its own
sustained clocks; the suite reports CUDA-graph time of back-to-back calls, and ``tools.sweep`` do_bench's median.
For each case this times every candidate of the tuner's space by each method (``tune``: exhaustive_search;
``graph``: ``impls.timing.graph_ms``, 20 calls a replay; ``do_bench``: median, L2 flushed; ``settled``: each
alone after 0.25 s of its own calls, as the suite times a benchmark), ``--repeats`` times, and prints a JSON line
per candidate (TFLOPS at its best and at its median time, per method) and, with ``graph`` among the methods, each
method's pick and what that pick costs under graph time.

Candidates outside the space: ``--add`` builds one from ``HOPPER_WIDE`` (the Hopper two-warpgroup block) and
``--also`` adds the space's candidates that match a glob again with fields of ``Variant`` changed (a persistent,
paired, peeled, two-launch or planned twin, another head group); forms the case's shape refuses are left out.
Every output is checked against the float64 oracle before timing when any is added (``--check`` does it alone).
See docs/design.md#tuning.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from fnmatch import fnmatchcase
from typing import Any

METHODS = ("tune", "graph", "do_bench", "settled")

EPILOG = """examples:
  python -m tools.tuner_probe --case fp16-causal-h32:32-s4096x4096-d128-b4 --methods graph settled
  python -m tools.tuner_probe --case fp16-causal-h32:32-s2048x2048-d128-b4 --match '128x128*' --methods settled \\
    --also '128x128*:peel_diagonal=1' --also '128x128*:persistent=1,paired=1' --also '*:head_group=16'
  python -m tools.tuner_probe --case fp16-full-h16:16-s4096x4096-d128-b4 --methods settled \\
    --add tile_n=256,persistent=1,k_latency=3,v_latency=6
"""


def changed(base: Any, spec: str) -> Any:
    """``base`` (a ``Variant``) with the fields of ``spec`` (``FIELD=VALUE,...``) changed, each value read as its
    field's type (an int; a bool as 0 / 1). An unknown field raises."""
    fields: dict[str, Any] = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        current = getattr(base, name)
        fields[name] = bool(int(value)) if isinstance(current, bool) else int(value)
    return replace(base, **fields)


def candidates(case: Any, match: list[str], also: list[str], add: list[str]) -> list[Any]:
    """The tuner's space for ``case`` (those matching ``match``), then the ``also`` twins and the ``add`` forms
    that the case's shape allows, each once."""
    import torch

    from impls.contract import NO_WINDOW
    from impls.cutile.config import kernel_window
    from impls.cutile.spaces import HOPPER_WIDE, search_space

    full = search_space(torch.cuda.get_device_capability(), case.d, causal=case.causal, value_dim=case.dv or None,
                        window="window" in case.variants)
    space = [var for var in full if any(fnmatchcase(var.label(), glob) for glob in match or ["*"])]
    extra = [changed(HOPPER_WIDE, spec) for spec in add]
    for rule in also:
        glob, _, spec = rule.partition(":")
        extra += [changed(var, spec) for var in full if fnmatchcase(var.label(), glob)]
    window = kernel_window(case.variants.get("window", NO_WINDOW), case.causal)
    for var in extra:  # a peel needs the same masked tiles in every query tile
        refused = var.peel_diagonal and var.peel_refusal(causal=case.causal, q_len=case.sq, kv_len=case.skv,
                                                        window=window)
        if not refused and var not in space:
            space.append(var)
    return space


def probe(case_id: str, repeats: int, methods: list[str], match: list[str], also: list[str], add: list[str],
          check: bool) -> None:
    """The JSON lines of one case: checks where asked, then a line per candidate and the picks."""
    import triton

    from impls.cutile.launch import Call
    from impls.cutile.tuner import exhaustive_timings, precompile
    from impls.timing import graph_ms, settle_gpu, settled_times
    from suite.checks import Oracle
    from suite.metrics import flops
    from suite.presets import case_by_id

    case = case_by_id(case_id)
    q, k, v = case.make_inputs("cuda")
    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    space = candidates(case, match, also, add)
    calls = precompile([Call(var, q, k, v, out=out, causal=case.causal, scale=case.d ** -0.5, **case.variants)
                        for var in space])
    if also or add or check:  # forms outside the tuner's space: outputs checked before they are timed
        oracle = Oracle.dense(q, k, v, causal=case.causal, scale=case.d ** -0.5, **case.variants)
        passed = []
        for call in calls:
            result = oracle.check(call().clone())
            print(json.dumps({"case": case_id, "candidate": call.variant.label(), "check": result.passed,
                              "max_error": result.max_error}), flush=True)
            if result.passed:
                passed.append(call)
        calls = passed
    times: dict[str, dict[str, list[float]]] = {call.variant.label(): {m: [] for m in methods} for call in calls}
    for _ in range(repeats):
        if "tune" in methods:  # the search times one launch: two-launch forms are left out of it
            settle_gpu()
            for measured in exhaustive_timings([call for call in calls if len(call.launches) == 1]).successes:
                times[measured.config.label()]["tune"].append(measured.mean_us / 1e3)
        for method, time_call in (("graph", lambda call: graph_ms(call, repeats=20)),
                                  ("do_bench", triton.testing.do_bench)):
            if method in methods:
                settle_gpu()
                for call in calls:
                    times[call.variant.label()][method].append(time_call(call))
        if "settled" in methods:
            for call, ms in zip(calls, settled_times(calls), strict=True):
                times[call.variant.label()]["settled"].append(ms)
    work = flops(case)
    best: dict[str, tuple[str, float]] = {}
    for label, by_method in times.items():
        row, median = ({method: round(work / (pick(ms) * 1e9), 1) for method, ms in by_method.items() if ms}
                       for pick in (min, statistics.median))  # each method's TFLOPS at its best and median time
        print(json.dumps({"case": case_id, "candidate": label, "tflops": row, "median_tflops": median}), flush=True)
        for method, tflops in row.items():
            if tflops > best.get(method, ("", 0.0))[1]:
                best[method] = (label, tflops)
    if "graph" in methods:
        graph = {label: work / (min(by_method["graph"]) * 1e9) for label, by_method in times.items()}
        picks = {method: {"candidate": label, "graph_tflops": round(graph[label], 1)}
                 for method, (label, _) in best.items()}
        print(json.dumps({"case": case_id, "picks": picks}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.tuner_probe", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", required=True, help="a dense case id (repeatable)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the methods (default 2)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--match", action="append", default=[], metavar="GLOB",
                        help="keep only the space's candidates with a label like this (repeatable; default: all)")
    parser.add_argument("--also", action="append", default=[], metavar="GLOB:FIELD=VALUE,...",
                        help="the space's candidates with a label like GLOB again with these Variant fields changed "
                             "(repeatable; outputs checked first)")
    parser.add_argument("--add", action="append", default=[], metavar="FIELD=VALUE,...",
                        help="a candidate outside the space: HOPPER_WIDE with these Variant fields changed "
                             "(repeatable; outputs checked first)")
    parser.add_argument("--check", action="store_true", help="every candidate's output against the float64 oracle "
                                                             "first")
    args = parser.parse_args(argv)
    for case_id in args.case:
        probe(case_id, args.repeats, args.methods, args.match, args.also, args.add, args.check)


if __name__ == "__main__":
    main()
