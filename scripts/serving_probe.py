"""Where a cuTile serving case's prepare time goes, and what each candidate costs (GPU).

For one paged-decode case: building the inputs, the float64 oracle, and per decode candidate its first call
(compile) and its time per call (one replay of a CUDA graph of 20 calls). ``--cutile-form N,READ[,OCC]``
adds a form to cuTile's, ``--cutile-min-tiles N`` sets their plans' shortest chunk; ``--occupancy N`` and
``--latency K,V`` (repeatable) add each cuTile candidate with that many blocks per SM asked of the compiler or
those load latencies, ``--plans N`` (repeatable) runs each with split plans aimed at N programs per SM instead;
``--triton wide`` sweeps a wider Triton decode space (TRITON_WIDE) than the tuner's, ``--triton ab``
times each of the tuner's configs with and without the mask-free loop (MASK_FREE), alternating, ``--triton plans``
times every tuner config once, then the fastest with an aimed plan, the fastest with a fitted one (PLAN_FIT) and
each peer in alternation (``plans-wide``: over TRITON_WIDE's tiles with each plan), ``--triton deep`` the fastest
of the tuner's space and of DEEP_TILES (K/V double-buffered; ``--deep-tile N,W,S`` others) the same way;
``--fp8-dots`` (by default on the fp8 cases of ``serving-fp8``) times bf16 queries over an fp8 cache with the dots
in bf16 and in fp16 (F16_DOT): each cuTile form both ways in alternation, then the fastest Triton config of each
way and each peer in alternation; ``--cutile-pdl`` the fastest cuTile candidate without and with PDL where a
step splits, and each peer; ``--min-tiles N`` (repeatable) the fastest Triton config on split plans of chunks at
least N key tiles long, and each peer; ``--triton-switch KEY`` (the same default cases) the fastest Triton config
with a switch of its config off and on (a constexpr of the split kernel, V_WORDS: fp8 values read as bytes or as words;
or PDL, programmatic dependent launch of both kernels) and each peer; ``--peer NAME``
times a registered implementation of the operation the same way, in the same process (``--no-cutile`` leaves
cuTile out, for a machine without its toolchain). Varlen (``--varlen-only``: nothing else): each varlen
candidate on every ``varlen`` case (``--varlen-grid NAME``: another preset's, with their window and softcap), and
on the equal-length batch beside the dense kernel with the same variant on the same shape (the varlen path should
cost nothing over dense); ``--varlen-persistent`` adds the persistent
twin (on the host plan) of every one-block-per-tile candidate, ``--varlen-stores`` times each with both output
stores, ``--varlen-peel`` each candidate that runs peeled beside its masked loop, ``--varlen-whole-pairs`` each
persistent candidate beside itself on a plan of whole units (what the plan's split tail gains). Prints JSON lines.

    python scripts/serving_probe.py --case llama3-8b-paged-bf16-h32:8-q1-kv8192-uniform-p16-d128-b64
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from fnmatch import fnmatchcase
from unittest import mock

import torch

import impls
import impls._plans
from impls.contract import NO_WINDOW
from impls.cutile.config import device_sm_count as _sm_count
from impls.cutile.launch import Call
from impls.cutile.serving import (
    VARLEN_STORES,
    DecodeCall,
    DecodeVariant,
    VarlenCall,
    decode_space_for,
    plan_candidates,
    varlen_resolved,
    varlen_space,
)
from impls.cutile.tuner import precompile
from impls.timing import cold_candidates, graph_ms
from impls.triton_fa.paged import DECODE_SPACE as TRITON_SPACE
from impls.triton_fa.paged import decode_space, paged_launch
from suite import metrics
from suite.cases import case_by_id, preset
from suite.checks import Oracle


def seconds(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


# Tile width, warps and pipeline stages beyond the Triton decode tuner's space.
TRITON_WIDE = [{"BLOCK_N": n, "num_warps": w, "num_stages": st}
               for n in (32, 64, 128, 256) for w in (4, 8) for st in (2, 3, 4)]
# Deep pipelines beside the tuner's one (128, 4, 5): K and V double-buffered from 5 stages, three buffers from 7
# (why: the comment above impls.triton_fa.paged.DECODE_TILES; ``python -m impls.triton_fa.aot --decode`` counts them).
DEEP_TILES = ((128, 8, 5), (128, 8, 7), (64, 8, 5), (64, 4, 5), (64, 4, 7), (32, 4, 7))
# Tiles from 16 keys on (2 or 3 stages), each with and without the mask-free loop and with every split plan.
TRITON_WIDE_PLANS = decode_space(tuple((n, w, st) for n in (16, 32, 64, 128) for w in (4, 8) for st in (2, 3)))


def tile_arg(text: str) -> tuple[int, int, int]:
    """A decode tile given on the command line as ``N,W,S``: keys, warps, stages."""
    n, w, st = (int(x) for x in text.split(","))
    return n, w, st


def report(name: str, call, case, oracle, **extra) -> None:
    first = seconds(call)
    ms = graph_ms(call, repeats=20)
    print(json.dumps({"variant": name, "first_call_s": round(first, 2), "ms": ms, **extra,
                      "gbps": metrics.kv_bytes(case) / ms / 1e6, "passed": oracle.check(call()).passed}), flush=True)


def form_arg(text: str) -> DecodeVariant:
    """``TILE_N,READ[,OCCUPANCY]``: a cuTile decode form, e.g. ``32,pages,2``."""
    tile_n, read, *occupancy = text.split(",")
    return DecodeVariant(int(tile_n), read, occupancy=int(occupancy[0]) if occupancy else None)


def probe_decode(case_id: str, occupancies: list[int], triton: str, latencies: list[str], peers: list[str],
                 cutile: bool = True, plans: tuple[int, ...] = (),
                 deep_tiles: tuple[tuple[int, int, int], ...] = DEEP_TILES, forms: tuple[DecodeVariant, ...] = (),
                 min_tiles: int | None = None) -> None:
    case = case_by_id(case_id)
    t = time.perf_counter()
    inputs = case.make_inputs("cuda")
    torch.cuda.synchronize()
    print(json.dumps({"case": case_id, "inputs_s": time.perf_counter() - t}), flush=True)
    t = time.perf_counter()
    oracle = Oracle.serving(inputs)
    torch.cuda.synchronize()
    print(json.dumps({"oracle_s": time.perf_counter() - t}), flush=True)
    scale = inputs.head_dim ** -0.5
    peer_calls = {}
    for name in peers:
        try:
            prepared = impls.get(name, "paged").prepare(inputs, scale=scale)
            report(name, prepared, case, oracle, config=str(prepared.config)[:200])
            peer_calls[name] = prepared
        except Exception as exc:  # a peer that cannot run this case: say why, go on
            print(json.dumps({"variant": name, "error": str(exc)[:200]}), flush=True)
    space = [*decode_space_for(inputs), *forms] if cutile else []
    space += [replace(v, occupancy=n) for n in occupancies for v in space]
    for pair in latencies:  # K and V load latencies of each candidate's form
        k, v = (int(x) for x in pair.split(","))
        space += [replace(var, k_latency=k, v_latency=v) for var in space if (var.k_latency, var.v_latency) == (3, 3)]
    space = [replace(var, plan_programs=p) for var in space for p in plans] or space
    space = [replace(var, plan_min_tiles=min_tiles) for var in space]
    for variant in space:
        try:
            call = DecodeCall(variant, inputs, scale=scale, sm_count=_sm_count(None))
            report(f"cutile {variant}", call, case, oracle, splits=call.num_splits)
        except Exception as exc:  # a form this case or compiler refuses: say why, go on
            print(json.dumps({"variant": f"cutile {variant}", "error": str(exc)[:200]}), flush=True)
    if triton == "ab":
        mask_free_ab(inputs, scale, case, oracle)
        return
    if triton.startswith("plans"):
        plans_ab(inputs, scale, case, oracle, peer_calls, TRITON_WIDE_PLANS if triton == "plans-wide" else TRITON_SPACE)
        return
    if triton == "deep":
        spaces = {"space": TRITON_SPACE, "deep": decode_space(deep_tiles)}
        fastest_of_each(inputs, scale, case, oracle, peer_calls, spaces)
        return
    for config in {"tuner": TRITON_SPACE, "wide": TRITON_WIDE, "none": []}[triton]:
        try:
            run, plan = paged_launch(inputs, scale, config)
            report(f"triton {config}", run, case, oracle, splits=plan["num_splits"])
        except Exception as exc:  # a config beyond the GPU's resources: say so, go on
            print(json.dumps({"variant": f"triton {config}", "error": str(exc)[:200]}), flush=True)


def fp8_case_ids() -> list[str]:
    """The ``serving-fp8`` preset's cases over an fp8 cache (the default cases of --fp8-dots and --triton-switch)."""
    return [c.id for c in preset("serving-fp8") if c.kv_dtype == "fp8"]


def fp8_dots_ab(case_id: str, peers: list[str], cutile: bool = True, rounds: int = 5) -> None:
    """Bf16 queries over an fp8 cache with the dots in bf16 and in fp16: each cuTile decode form both ways,
    timed in alternation (median of ``rounds``); then ``triton_switch`` of F16_DOT."""
    case = case_by_id(case_id)
    inputs = case.make_inputs("cuda")
    oracle = Oracle.serving(inputs)
    scale = inputs.head_dim ** -0.5
    for variant in decode_space_for(inputs) if cutile else []:
        calls = {dots: DecodeCall(variant, inputs, scale=scale, sm_count=_sm_count(None), f16_dot=dots == "fp16")
                 for dots in ("bf16", "fp16")}
        precompile(list(calls.values()))
        median = interleaved(calls, rounds)
        print(json.dumps({"case": case_id, "variant": f"cutile {variant}",
                          **{f"{dots}_ms": ms for dots, ms in median.items()},
                          "bf16_over_fp16": median["bf16"] / median["fp16"],
                          "fp16_gbps": metrics.kv_bytes(case) / median["fp16"] / 1e6,
                          "passed": [oracle.check(call()).passed for call in calls.values()]}), flush=True)
    triton_switch(case, inputs, scale, oracle, "F16_DOT", peers, rounds)


SWITCH = {"off": False, "on": True}  # a constexpr switch's values, by label


def triton_values(case, inputs, scale: float, oracle, key: str, values: dict[str, object], peers: list[str],
                  rounds: int = 5) -> None:
    """The fastest Triton config of the tuner's space with its entry ``key`` set to each of ``values`` (by label),
    and each peer, timed in alternation (``fastest_of_each``)."""
    spaces = {f"{key} {label}": [{**config, key: value} for config in TRITON_SPACE] for label, value in values.items()}
    peer_calls = {name: impls.get(name, "paged").prepare(inputs, scale=scale) for name in peers}
    fastest_of_each(inputs, scale, case, oracle, peer_calls, spaces, rounds=rounds)


def triton_switch(case, inputs, scale: float, oracle, key: str, peers: list[str], rounds: int = 5) -> None:
    """``triton_values`` of a switch ``key``: off and on."""
    triton_values(case, inputs, scale, oracle, key, SWITCH, peers, rounds)


def values_ab(case_id: str, key: str, values: dict[str, object], peers: list[str], rounds: int = 5) -> None:
    """``triton_values`` of ``key`` on one case. With PLAN_MIN_TILES: split plans whose chunks are at least so
    many key tiles long (the tuner's: SPLIT_MIN_TILES, and PLAN_MIN_TILES): on a short step a program's tiles are a
    chain of dependent loads, so shorter chunks may end it sooner."""
    case = case_by_id(case_id)
    inputs = case.make_inputs("cuda")
    triton_values(case, inputs, inputs.head_dim ** -0.5, Oracle.serving(inputs), key, values, peers, rounds)


def cutile_pdl_ab(case_id: str, peers: list[str], rounds: int = 7) -> None:
    """The fastest of cuTile's decode candidates (the tuner's forms and plans, split ones with and without
    programmatic dependent launch, as its tuner tries them) launched without PDL and with it where a step splits,
    then both and each peer in alternation (median of ``rounds``), a JSON line each."""
    case = case_by_id(case_id)
    inputs = case.make_inputs("cuda")
    scale, oracle = inputs.head_dim ** -0.5, Oracle.serving(inputs)
    timed = []
    for call in plan_candidates(decode_space_for(inputs), inputs, scale=scale, sm_count=_sm_count(None)):
        call()  # compile outside the timing
        timed.append((graph_ms(call, repeats=20), call))
    calls, details = {}, {}
    for kind, with_pdl in (("PDL off", False), ("PDL where split", True)):
        best = min((entry for entry in timed if entry[1].dependent_launch == (with_pdl and entry[1].num_splits > 1)),
                   key=lambda entry: entry[0])[1]
        calls[f"cutile {kind}"] = best
        details[f"cutile {kind}"] = {"variant": str(best.variant), "splits": best.num_splits,
                                     "PDL": best.dependent_launch}
    calls |= {name: impls.get(name, "paged").prepare(inputs, scale=scale) for name in peers}
    report_alternating(case, oracle, calls, details, rounds)


def prefetch_ab(case_id: str, config: dict | None, peers: list[str], rounds: int = 7) -> None:
    """The Triton decode with ``config`` (a tuned pick: the tuning cache's entry) without and with its lookups
    prefetched before the wait by the first chunk's program (PREFETCH; on by default under PDL), and each peer,
    warm (back to back over the same inputs) and cold (over copies of them, ``impls.timing.cold_candidates``), all
    in alternation: a JSON line each, us a step."""
    case = case_by_id(case_id)
    inputs = case.make_inputs("cuda")
    scale, oracle = inputs.head_dim ** -0.5, Oracle.serving(inputs)
    if config is None:  # the case's pick from the tuning cache (a tune where it has none), its tile and plan keys
        picked = impls.get("triton", "paged").prepare(inputs, scale=scale).config
        config = {key: picked[key] for key in TRITON_SPACE[0] if key in picked}
        print(json.dumps({"case": case.id, "config": config, "chosen": picked["chosen"]}), flush=True)
    makers = {f"triton PREFETCH {label}": lambda on, v=v: paged_launch(on, scale, {**config, "PREFETCH": v})[0]
              for label, v in SWITCH.items()}
    makers |= {name: lambda on, name=name: impls.get(name, "paged").prepare(on, scale=scale) for name in peers}
    warm = [(name, make(inputs)) for name, make in makers.items()]
    cold = cold_candidates(warm, inputs, lambda copy, name: makers[name](copy))
    # a rotated call runs a step over each copy (a step of twice the L2 or more is not rotated: cold as it is)
    steps = {name: len(call()) if cold is not warm else 1 for name, call in cold}
    calls = {(name, "warm"): call for name, call in warm} | {(name, "cold"): call for name, call in cold}
    median, outputs = interleaved(calls, rounds), {name: call() for name, call in warm}
    for (name, state), ms in median.items():
        us = ms * 1e3 / (steps[name] if state == "cold" else 1)
        print(json.dumps({"case": case.id, "variant": name, "l2": state, "us": us, "copies": steps[name],
                          "gbps": metrics.kv_bytes(case) / us / 1e3, "passed": oracle.check(outputs[name]).passed}),
              flush=True)


def interleaved(calls: dict, rounds: int) -> dict:
    """Each call's graph time (a replay of 20 calls), the calls timed in turn ``rounds`` times, so that clock
    drift falls on all alike: the median per name."""
    ms = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            ms[name].append(graph_ms(call, repeats=20))
    return {name: sorted(times)[rounds // 2] for name, times in ms.items()}


def timed_space(inputs, scale: float, space: list[dict]) -> list[tuple[float, dict, object, dict]]:
    """Each Triton decode config of ``space`` once (graph time, compiled first), fastest first: (ms, config,
    run, plan)."""
    timed = []
    for config in space:
        try:
            run, plan = paged_launch(inputs, scale, config)
            run()  # compile outside the timing
        except Exception as exc:  # a config beyond the GPU's resources: say so, go on
            print(json.dumps({"variant": f"triton {config}", "error": str(exc)[:200]}), flush=True)
            continue
        timed.append((graph_ms(run, repeats=20), config, run, plan))
    return sorted(timed, key=lambda entry: entry[0])


def fastest_of_each(inputs, scale: float, case, oracle, peers: dict, spaces: dict[str, list[dict]],
                    rounds: int = 7) -> None:
    """Every Triton decode config of each named space once; then the fastest of each space and each peer, in
    alternation (median of ``rounds``), a JSON line each."""
    calls, details = {}, {}
    for kind, space in spaces.items():
        timed = timed_space(inputs, scale, space)
        if timed:
            _, config, calls[f"triton {kind}"], plan = timed[0]
            details[f"triton {kind}"] = {"config": config, "plan": plan}
    report_alternating(case, oracle, calls | peers, details, rounds)


def report_alternating(case, oracle, calls: dict, details: dict, rounds: int) -> None:
    """``calls`` timed in alternation (median of ``rounds``), then a JSON line each: its time, GB/s, what
    ``details`` says of it and whether its output passes the oracle."""
    median = interleaved(calls, rounds)
    for name, call in calls.items():
        print(json.dumps({"case": case.id, "variant": name, "ms": median[name],
                          "gbps": metrics.kv_bytes(case) / median[name] / 1e6, **details.get(name, {}),
                          "passed": oracle.check(call()).passed}), flush=True)


def plans_ab(inputs, scale: float, case, oracle, peers: dict, space: list[dict]) -> None:
    """The fastest config of ``space`` with an aimed plan, the fastest with a fitted plan (PLAN_FIT) and each
    peer, in alternation."""
    fastest_of_each(inputs, scale, case, oracle, peers, {
        "aimed": [config for config in space if not config["PLAN_FIT"]],
        "fitted": [config for config in space if config["PLAN_FIT"]]})


def mask_free_ab(inputs, scale: float, case, oracle, rounds: int = 5) -> None:
    """Each distinct Triton decode config with MASK_FREE off and on, timed in alternation (median of
    ``rounds``), so that clock drift falls on both alike."""
    seen = set()
    for config in TRITON_SPACE:
        _, plan = paged_launch(inputs, scale, config)  # the split plan does not depend on MASK_FREE
        form = (config["BLOCK_N"], config["num_warps"], config["num_stages"], plan["num_splits"])
        if form in seen:
            continue
        seen.add(form)
        calls = {mask_free: paged_launch(inputs, scale, {**config, "MASK_FREE": mask_free})[0]
                 for mask_free in (False, True)}
        median = interleaved(calls, rounds)
        print(json.dumps({"form": form, "off_ms": median[False], "on_ms": median[True],
                          "off_over_on": median[False] / median[True],
                          "on_gbps": metrics.kv_bytes(case) / median[True] / 1e6,
                          "passed": [oracle.check(run()).passed for run in calls.values()]}), flush=True)


def probe_varlen(rounds: int = 3, persistent_twins: bool = False, stores: tuple[str, ...] = (),
                 grid: str = "varlen", peel_pairs: bool = False, match: str = "*", whole_pairs: bool = False) -> None:
    """Each varlen candidate on every varlen case of ``grid`` (with its window and softcap), and on an equal-length
    batch beside the dense kernel of the same variant where the grid has the dense twin (``varlen`` does), in
    ``rounds`` interleaved rounds (median); ``persistent_twins``: each one-block-per-tile candidate's persistent
    twin too; ``stores``: the varlen call once per output store (else FMHA_VARLEN_STORE's); ``peel_pairs``: only
    the candidates that run peeled on the case (``varlen_resolved``), each beside its masked-loop twin ("loop");
    ``whole_pairs``: only the persistent candidates, each beside itself on a plan of whole units, none split
    ("whole": ``split_tail``'s gain); ``match``: only the cases whose id matches this glob."""
    dense = [c.make_inputs("cuda") for c in preset(grid) if c.op == "dense"][:1]
    for varlen_case in [c for c in preset(grid) if c.op == "varlen" and fnmatchcase(c.id, match)]:
        inputs = varlen_case.make_inputs("cuda")
        scale = inputs.head_dim ** -0.5
        variants = {"window": varlen_case.window, "softcap": varlen_case.softcap}
        oracle = Oracle.serving(inputs, **variants)
        space = varlen_space(torch.cuda.get_device_capability(), inputs.head_dim, True,
                             window=varlen_case.window != NO_WINDOW)
        twins = [replace(v, persistent=True) for v in space if persistent_twins and not v.persistent]
        for variant in space + [twin for twin in twins if twin not in space]:
            if peel_pairs and not varlen_resolved(variant, inputs, varlen_case.window).peel_diagonal:
                continue  # neither made nor timed: it would run its masked loop here
            if whole_pairs and not variant.persistent:
                continue  # only a persistent block runs the host's plan
            calls = {f"varlen_{store}" if store else "varlen": VarlenCall(variant, inputs, scale=scale, store=store,
                                                                          **variants)
                     for store in stores or (None,)}
            if peel_pairs:
                calls["loop"] = VarlenCall(replace(variant, peel_diagonal=False), inputs, scale=scale, **variants)
            if whole_pairs:  # the plan is made when the call is prepared
                with mock.patch.object(impls._plans, "SPLIT_TAIL_SHARES", (0,)):
                    calls["whole"] = VarlenCall(variant, inputs, scale=scale, **variants)
            if varlen_case.lengths == "equal" and dense:
                calls["dense"] = Call(variant, *dense[0], causal=True, scale=scale)
            precompile(list(calls.values()))
            median = interleaved(calls, rounds)
            print(json.dumps({"case": varlen_case.id, "variant": variant.label(),
                              **{f"{name}_ms": ms for name, ms in median.items()},
                              "tflops": metrics.flops(varlen_case) / median[next(iter(calls))] / 1e9,
                              "passed": [oracle.check(call()).passed for name, call in calls.items()
                                         if name.startswith("varlen") or name in ("loop", "whole")]}),
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", help="a serving case id (repeatable)")
    parser.add_argument("--skip-varlen", action="store_true")
    parser.add_argument("--varlen-only", action="store_true", help="no decode case, only the varlen probe")
    parser.add_argument("--varlen-persistent", action="store_true",
                        help="varlen: the persistent twin of every one-block-per-tile candidate too")
    parser.add_argument("--varlen-grid", default="varlen",
                        help="the preset whose varlen cases the varlen probe runs (with their window and softcap)")
    parser.add_argument("--varlen-match", default="*", metavar="GLOB",
                        help="varlen: only the cases whose id matches GLOB")
    parser.add_argument("--varlen-peel", action="store_true",
                        help="varlen: each candidate that runs peeled beside its masked-loop twin, interleaved")
    parser.add_argument("--varlen-whole-pairs", action="store_true",
                        help="varlen: each persistent candidate beside itself on a plan of whole units, interleaved")
    parser.add_argument("--varlen-stores", action="store_true",
                        help=f"varlen: each candidate with each output store ({', '.join(VARLEN_STORES)}), interleaved")
    parser.add_argument("--occupancy", action="append", type=int, default=[], help="cuTile blocks per SM to try")
    parser.add_argument("--plans", action="append", type=int, default=[],
                        help="programs per SM the cuTile candidates' split plans aim at (repeatable; default: "
                             "the usual one, PROGRAMS_PER_SM)")
    parser.add_argument("--triton", choices=("tuner", "wide", "ab", "plans", "plans-wide", "deep", "none"),
                        default="tuner", help="the Triton configs beside cuTile's: the tuner's space, TRITON_WIDE, "
                                              "or none; ab, plans and deep: the A/B comparisons above")
    parser.add_argument("--peer", action="append", default=[], help="a registered implementation to time too")
    parser.add_argument("--no-cutile", action="store_true", help="leave cuTile's candidates out")
    parser.add_argument("--fp8-dots", action="store_true",
                        help="bf16 queries over an fp8 cache, the dots in bf16 and in fp16 (only this)")
    parser.add_argument("--deep-tile", action="append", default=[], type=tile_arg, metavar="N,W,S",
                        help="--triton deep: a tile (keys, warps, stages) in place of DEEP_TILES (repeatable)")
    parser.add_argument("--latency", action="append", default=[], metavar="K,V",
                        help="cuTile K and V load latencies to try on every candidate (repeatable)")
    parser.add_argument("--cutile-pdl", action="store_true",
                        help="the fastest cuTile decode candidate without and with programmatic dependent launch "
                             "where a step splits, beside each --peer (on the --case cases; only this)")
    parser.add_argument("--triton-switch", metavar="KEY",
                        help="the fastest Triton config with its switch KEY (a constexpr, or PDL) off and on, beside "
                             "each --peer (default cases: serving-fp8's fp8 ones; only this)")
    parser.add_argument("--cutile-form", action="append", default=[], type=form_arg, metavar="N,READ[,OCC]",
                        help="a cuTile decode form beside the tuner's (repeatable), e.g. 32,pages,2")
    parser.add_argument("--cutile-min-tiles", type=int, metavar="N",
                        help="the cuTile candidates' shortest chunk in key tiles (default: SPLIT_MIN_TILES)")
    parser.add_argument("--prefetch-ab", metavar="CONFIG",
                        help="the Triton decode with this config (JSON: a tuning cache entry, or 'tuned': each "
                             "case's pick) without and with PREFETCH, and each --peer, warm and cold "
                             "(on the --case cases; only this)")
    parser.add_argument("--min-tiles", action="append", type=int, default=[], metavar="N",
                        help="the fastest Triton config on split plans of chunks of at least N key tiles "
                             "(repeatable), beside each --peer (on the --case cases; only this)")
    args = parser.parse_args()
    if args.prefetch_ab:
        for case_id in args.case:
            prefetch_ab(case_id, None if args.prefetch_ab == "tuned" else json.loads(args.prefetch_ab), args.peer)
        return
    if args.min_tiles:
        for case_id in args.case:
            values_ab(case_id, "PLAN_MIN_TILES", {str(n): n for n in args.min_tiles}, args.peer, rounds=7)
        return
    if args.cutile_pdl:
        for case_id in args.case:
            cutile_pdl_ab(case_id, args.peer)
        return
    if args.triton_switch:
        for case_id in args.case or fp8_case_ids():
            values_ab(case_id, args.triton_switch, SWITCH, args.peer)
        return
    if args.fp8_dots:
        for case_id in args.case or fp8_case_ids():
            fp8_dots_ab(case_id, args.peer, cutile=not args.no_cutile)
        return
    default = [] if args.varlen_only else ["llama3-8b-paged-bf16-h32:8-q1-kv8192-uniform-p16-d128-b64"]
    for case_id in args.case or default:
        probe_decode(case_id, args.occupancy, args.triton, args.latency, args.peer, cutile=not args.no_cutile,
                     plans=tuple(args.plans), deep_tiles=tuple(args.deep_tile) or DEEP_TILES,
                     forms=tuple(args.cutile_form), min_tiles=args.cutile_min_tiles)
    if not args.skip_varlen:
        probe_varlen(persistent_twins=args.varlen_persistent,
                     stores=VARLEN_STORES if args.varlen_stores else (), grid=args.varlen_grid,
                     peel_pairs=args.varlen_peel, match=args.varlen_match, whole_pairs=args.varlen_whole_pairs)


if __name__ == "__main__":
    main()
