"""Does the cuTile tuner pick what the suite then measures fastest? (GPU)

The dense tuner ranks its candidates with ``cuda.tile.tune.exhaustive_search``: one launch at a time, L2 flushed
before each, mean of at least five; by default (``FMHA_TUNER=settled``) it then times the finalists again, each
alone at its own sustained clocks (``--methods settled`` here). The suite reports CUDA-graph time of
back-to-back calls, and ``scripts/sweep.py`` do_bench's median. On the blog preset (H200, session 16) the
tuner kept 64x128 with occupancy 2 at causal 2K-8K where the sweep measured 128x128 of 8 warps 2-6% faster.

For each case this times every candidate of the tuner's space three ways, in this process, on a settled GPU:
``exhaustive_search`` (its mean), graph time (``impls.timing.graph_ms``, 20 calls a replay, the suite's graph
mode) and do_bench (median, L2 flushed), twice each, and prints one JSON line per candidate (TFLOPS at its best
and at its median time, per method) and a summary line per case with each method's pick and what that pick costs
under graph time.

    python scripts/tuner_probe.py --case fp16-causal-h32:32-s4096x4096-d128-b4 [--case ...]

``--match GLOB`` keeps the candidates whose label matches; ``--head-groups 16 64`` adds each of them again with
that many heads ordered heaviest-first together (causal; the tuner's own choice is ``g-auto``);
``--paired-of GLOB`` adds the candidates whose label matches again as persistent blocks taking mirror pairs
of causal query tiles (``Variant.paired``); ``--methods graph`` times one way only; ``--methods settled`` times
each candidate alone after 0.25 s of its own calls (``impls.timing.settled_times``, the ``settled`` tuner's
second round), the suite's way; ``--two-launch-of GLOB`` adds the candidates whose label matches again as two
launches (kernel PHASE: the masked tiles, then the mask-free ones in a persistent launch), and then checks every
candidate's output against the float64 oracle before timing (``--check`` does that alone); ``--wide-paired`` adds
the persistent 128x256 with a paired share where the space lacks it; ``--peeled-of GLOB`` adds the matching
candidates (paired ones too) again with the causal diagonal peeled out of the loop (``Variant.peel_diagonal``),
where the case's lengths allow it, outputs checked first; ``--add FIELD=VALUE,...`` adds a candidate outside the
space, the Hopper two-warpgroup block (``HOPPER_WIDE``) with those fields of ``Variant`` changed (e.g.
``tile_n=256,persistent=1,k_latency=3,v_latency=6``; outputs checked first), where the case's shape allows it;
``--planned-of GLOB`` adds the matching paired candidates again taking the host's plan instead
(``Variant.planned``: the last round of equal pairs filled with split ones), outputs checked first;
``--whole-pairs`` makes every planned candidate's plan of whole pairs only (the paired share's, read from the
plan: what the split itself gains, apart from reading the plan).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from fnmatch import fnmatchcase

import torch
import triton

from impls.contract import NO_WINDOW
from impls.timing import graph_ms, settle_gpu, settled_times
from suite.cases import case_by_id
from suite.checks import Oracle
from suite.metrics import flops

METHODS = ("tune", "graph", "do_bench", "settled")


def added(spec: str):
    """The candidate ``--add`` names: HOPPER_WIDE with the fields of ``spec`` (``FIELD=VALUE,...``) changed, each
    value read as its field's type (an int; a bool as 0 / 1)."""
    from impls.cutile.spaces import HOPPER_WIDE

    fields = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        current = getattr(HOPPER_WIDE, name)  # an unknown field name raises here
        fields[name] = bool(int(value)) if isinstance(current, bool) else int(value)
    return replace(HOPPER_WIDE, **fields)


def probe(case_id: str, repeats: int, wide_persistent: bool, head_groups: list[int], match: list[str],
          methods: list[str], paired_of: list[str], two_launch_of: list[str], wide_paired: bool = False,
          check: bool = False, peeled_of: list[str] | None = None, add: list[str] | None = None,
          planned_of: list[str] | None = None) -> None:
    from impls.cutile.config import kernel_window
    from impls.cutile.launch import Call
    from impls.cutile.spaces import HOPPER_STREAMING, search_space
    from impls.cutile.tuner import exhaustive_timings, precompile

    case = case_by_id(case_id)
    q, k, v = case.make_inputs("cuda")
    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    space = search_space(torch.cuda.get_device_capability(), case.d, causal=case.causal, value_dim=case.dv or None,
                         window="window" in case.variants)
    for wanted, extra in ((wide_persistent, replace(HOPPER_STREAMING, tile_n=256)),
                          (wide_paired and case.causal, replace(HOPPER_STREAMING, tile_n=256, paired=True))):
        if wanted and extra not in space:
            space.append(extra)

    def like(var, globs: list[str]) -> bool:
        return any(fnmatchcase(var.label(), glob) for glob in globs)

    pairable = [var for var in space if case.causal and not var.persistent and like(var, paired_of)]
    # two launches (kernel PHASE): the masked tiles, then the mask-free ones persistent, with each share
    splittable = [var for var in space if case.causal and like(var, two_launch_of)]
    space = [var for var in space if like(var, match or ["*"])]
    space += [replace(var, persistent=True, paired=True) for var in pairable]
    window = kernel_window(case.variants.get("window", NO_WINDOW), case.causal)
    peeled = [replace(var, peel_diagonal=True) for var in space if case.causal and like(var, peeled_of or [])
              and not var.peel_refusal(causal=True, q_len=case.sq, kv_len=case.skv, window=window)]
    space += [var for var in peeled if var not in space]  # the space has some peeled forms itself
    space += [replace(var, persistent=True, paired=paired, two_launch=True) for var in splittable
              for paired in (False, True)]
    extras = [added(spec) for spec in add or []]  # those the case's shape allows (a peel needs whole tiles)
    space += [var for var in extras if not (var.peel_diagonal and var.peel_refusal(
        causal=case.causal, q_len=case.sq, kv_len=case.skv, window=window)) and var not in space]
    planned = [replace(var, paired=False, planned=True) for var in space if var.paired and like(var, planned_of or [])]
    space += [var for var in planned if var not in space]  # and every paired form's planned twin (planned_forms)
    # the paired order takes no head group: only the others again with one
    space += [replace(var, head_group=group) for var in space for group in head_groups
              if case.causal and not (var.paired or var.planned)]
    calls = precompile([Call(var, q, k, v, out=out, causal=case.causal, scale=case.d ** -0.5, **case.variants)
                        for var in space])
    if two_launch_of or peeled_of or add or planned_of or check:  # outside the tuner's space: outputs checked first
        oracle = Oracle.dense(q, k, v, causal=case.causal, scale=case.d ** -0.5, **case.variants)
        passed = []
        for call in calls:
            check = oracle.check(call().clone())
            print(json.dumps({"case": case_id, "candidate": call.variant.label(), "check": check.passed,
                              "max_error": check.max_error}), flush=True)
            if check.passed:
                passed.append(call)
        calls = passed
    times: dict[str, dict[str, list[float]]] = {call.variant.label(): {m: [] for m in methods} for call in calls}
    for _ in range(repeats):
        if "tune" in methods:
            settle_gpu()
            for measured in exhaustive_timings([call for call in calls if len(call.launches) == 1]).successes:
                times[measured.config.label()]["tune"].append(measured.mean_us / 1e3)
        for method, time_call in (("graph", lambda call: graph_ms(call, repeats=20)),
                                  ("do_bench", triton.testing.do_bench)):
            if method in methods:
                settle_gpu()
                for call in calls:
                    times[call.variant.label()][method].append(time_call(call))
        if "settled" in methods:  # each alone at the clocks it sustains, as the suite times it
            for call, ms in zip(calls, settled_times(calls), strict=True):
                times[call.variant.label()]["settled"].append(ms)
    work = flops(case)
    best = {}
    for label, by_method in times.items():
        row, median = ({method: round(work / (pick(ms) * 1e9), 1) for method, ms in by_method.items() if ms}
                       for pick in (min, statistics.median))  # each method's TFLOPS at its best and median time
        print(json.dumps({"case": case_id, "candidate": label, "tflops": row, "median_tflops": median}), flush=True)
        for method, tflops in row.items():
            if tflops > best.get(method, ("", 0.0))[1]:
                best[method] = (label, tflops)
    if "graph" not in methods:
        return
    graph = {label: work / (min(by_method["graph"]) * 1e9) for label, by_method in times.items()}
    print(json.dumps({"case": case_id, "picks": {method: {"candidate": label, "graph_tflops": round(graph[label], 1)}
                                                 for method, (label, _) in best.items()}}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", required=True, help="a dense case id (repeatable)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the methods")
    parser.add_argument("--wide-persistent", action="store_true",
                        help="the persistent 128x256 (L3,6) beside the space, where it is not in it (causal D=128: "
                             "165 KB of pipeline, no stack with whole key tiles, sm_90, tileiras 13.5)")
    parser.add_argument("--wide-paired", action="store_true",
                        help="causal: the persistent 128x256 (L3,6) with a paired share beside the space, where it is "
                             "not in it (MLA: 56 B of stack with a ragged last key tile, none with whole ones)")
    parser.add_argument("--check", action="store_true", help="every candidate's output against the float64 oracle "
                                                             "first (always with --two-launch-of)")
    parser.add_argument("--head-groups", type=int, nargs="+", default=[],
                        help="causal: matched candidates again with these explicit head groups")
    parser.add_argument("--match", action="append", default=[], metavar="GLOB",
                        help="keep only the candidates with a label like this (repeatable; default: all)")
    parser.add_argument("--paired-of", action="append", default=[], metavar="GLOB",
                        help="causal: candidates with a label like this again as persistent blocks taking mirror "
                             "pairs of query tiles (repeatable)")
    parser.add_argument("--two-launch-of", action="append", default=[], metavar="GLOB",
                        help="causal: candidates with a label like this again as two launches, the mask-free one "
                             "persistent (repeatable; every candidate's output is then checked first, and "
                             "exhaustive_search, which times one launch, leaves them out)")
    parser.add_argument("--peeled-of", action="append", default=[], metavar="GLOB",
                        help="causal: candidates with a label like this (the paired ones too) again with the "
                             "diagonal's masked tiles peeled out of the loop (Variant.peel_diagonal; outputs checked "
                             "first)")
    parser.add_argument("--add", action="append", default=[], metavar="FIELD=VALUE,...",
                        help="a candidate outside the space: HOPPER_WIDE with these Variant fields changed "
                             "(repeatable; outputs checked first)")
    parser.add_argument("--planned-of", action="append", default=[], metavar="GLOB",
                        help="causal: paired candidates with a label like this again taking the host's plan "
                             "(Variant.planned; outputs checked first)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--whole-pairs", action="store_true",
                        help="planned candidates: a plan of whole mirror pairs, none split (the paired share's)")
    args = parser.parse_args()
    if args.whole_pairs:
        import impls._plans

        impls._plans.SPLIT_TAIL_SHARES = (0,)
    for case_id in args.case:
        probe(case_id, args.repeats, args.wide_persistent, args.head_groups, args.match, args.methods, args.paired_of,
              args.two_launch_of, wide_paired=args.wide_paired, check=args.check, peeled_of=args.peeled_of,
              add=args.add, planned_of=args.planned_of)


if __name__ == "__main__":
    main()
