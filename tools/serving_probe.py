"""Time every serving candidate of our kernels on a case, beside registered peers (GPU; prints JSON lines).

Decode (the default, on each ``--case``): building the inputs and the float64 oracle, then per candidate its
first call (compile) and its time per call (one replay of a CUDA graph of 20 calls), GB/s of KV read and whether
its output passes: every cuTile decode form (``--cutile-form``, ``--occupancy``, ``--latency``, ``--plans`` and
``--cutile-min-tiles`` add or change forms) and the Triton decode's configs (``--triton``: the tuner's space, a
wider one, or none), then each ``--peer``.

Comparisons in alternation (rounds of each call in turn, the median, so that clock drift falls on all alike),
instead of the listing above: ``--triton-ab KEY[=V1,V2,...]`` the fastest Triton config of the tuner's space with
its entry KEY set to each value (default off and on: a constexpr switch of the kernel, or a launch key such as PDL
or PLAN_MIN_TILES), ``--triton-tiles N,W,S`` the fastest config over those tiles against the fastest of the tuner's
space; each beside the peers.

Varlen (after the decode cases, or alone with ``--varlen-only``): each cuTile varlen candidate on every varlen
case of ``--varlen-grid``, and on the equal-length batch beside the dense kernel of the same form on the same shape
(the varlen path should cost nothing over dense). See docs/design.md#cutile-serving and
docs/design.md#triton-serving.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import replace
from fnmatch import fnmatchcase
from typing import Any

DEFAULT_CASE = "llama3-8b-paged-bf16-h32:8-q1-kv8192-uniform-p16-d128-b64"
# Tile width, warps and pipeline stages beyond the Triton decode tuner's space (configs without plan keys).
TRITON_WIDE = [{"BLOCK_N": n, "num_warps": w, "num_stages": st}
               for n in (32, 64, 128, 256) for w in (4, 8) for st in (2, 3, 4)]

EPILOG = f"""examples:
  python -m tools.serving_probe --case {DEFAULT_CASE} --peer flashinfer --skip-varlen
  python -m tools.serving_probe --case {DEFAULT_CASE} --triton-ab PDL --peer flashinfer
  python -m tools.serving_probe --case {DEFAULT_CASE} --triton-ab PLAN_MIN_TILES=1,2,4
  python -m tools.serving_probe --case {DEFAULT_CASE} --triton-tiles 128,8,5 --triton-tiles 64,4,7
  python -m tools.serving_probe --varlen-only --varlen-match '*equal*'
"""


def seconds(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call, the GPU's work included."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def tile_arg(text: str) -> tuple[int, int, int]:
    """A decode tile given as ``N,W,S``: keys, warps, stages."""
    n, w, st = (int(x) for x in text.split(","))
    return n, w, st


def form_arg(text: str) -> Any:
    """``TILE_N,READ[,OCCUPANCY]``: a cuTile decode form, e.g. ``32,pages,2``."""
    from impls.cutile.serving import DecodeVariant

    tile_n, read, *occupancy = text.split(",")
    return DecodeVariant(int(tile_n), read, occupancy=int(occupancy[0]) if occupancy else None)


def values_arg(text: str) -> tuple[str, dict[str, Any]]:
    """``KEY`` (off and on) or ``KEY=V1,V2,...`` (integers): a Triton config entry and its values by label."""
    key, _, listed = text.partition("=")
    if not listed:
        return key, {"off": False, "on": True}
    return key, {value: int(value) for value in listed.split(",")}


def emit(**fields: Any) -> None:
    print(json.dumps(fields, default=str), flush=True)


def report(name: str, call: Callable[[], Any], case: Any, oracle: Any, **extra: Any) -> None:
    """A candidate's first call and graph time, GB/s and check, as one JSON line."""
    from impls.timing import graph_ms
    from suite import metrics

    first = seconds(call)
    ms = graph_ms(call, repeats=20)
    emit(variant=name, first_call_s=round(first, 2), ms=ms, **extra, gbps=metrics.kv_bytes(case) / ms / 1e6,
         passed=oracle.check(call()).passed)


def interleaved(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Each call's graph time (a replay of 20 calls), the calls timed in turn ``rounds`` times: the median each."""
    from impls.timing import graph_ms

    ms: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            ms[name].append(graph_ms(call, repeats=20))
    return {name: sorted(times)[rounds // 2] for name, times in ms.items()}


def prepared_peers(names: list[str], inputs: Any, scale: float) -> dict[str, Callable[[], Any]]:
    """The peers that run this case, prepared; a line for each that cannot, saying why."""
    import impls

    peers = {}
    for name in names:
        try:
            peers[name] = impls.get(name, "paged").prepare(inputs, scale=scale)
        except Exception as exc:  # a peer that cannot run this case: say why, go on
            emit(variant=name, error=str(exc)[:200])
    return peers


def probe_decode(case_id: str, args: argparse.Namespace) -> None:
    """The listing of every decode candidate on one case (the module's docstring)."""
    import torch

    from impls.cutile.config import device_sm_count as _sm_count
    from impls.cutile.serving import DecodeCall, decode_space_for
    from impls.triton_fa.paged import DECODE_SPACE, paged_launch
    from suite.checks import Oracle
    from suite.presets import case_by_id

    case = case_by_id(case_id)
    t = time.perf_counter()
    inputs = case.make_inputs("cuda")
    torch.cuda.synchronize()
    emit(case=case_id, inputs_s=time.perf_counter() - t)
    t = time.perf_counter()
    oracle = Oracle.serving(inputs)
    torch.cuda.synchronize()
    emit(oracle_s=time.perf_counter() - t)
    scale = inputs.head_dim ** -0.5
    for name, prepared in prepared_peers(args.peer, inputs, scale).items():
        report(name, prepared, case, oracle, config=str(prepared.config)[:200])
    space = [*decode_space_for(inputs), *args.cutile_form] if not args.no_cutile else []
    space += [replace(v, occupancy=n) for n in args.occupancy for v in space]
    for pair in args.latency:  # K and V load latencies, on each form at the default ones
        k, v = (int(x) for x in pair.split(","))
        space += [replace(var, k_latency=k, v_latency=v) for var in space if (var.k_latency, var.v_latency) == (3, 3)]
    space = [replace(var, plan_programs=p) for var in space for p in args.plans] or space
    space = [replace(var, plan_min_tiles=args.cutile_min_tiles) for var in space]
    for variant in space:
        try:
            call = DecodeCall(variant, inputs, scale=scale, sm_count=_sm_count(None))
            report(f"cutile {variant}", call, case, oracle, splits=call.num_splits)
        except Exception as exc:  # a form this case or compiler refuses: say why, go on
            emit(variant=f"cutile {variant}", error=str(exc)[:200])
    for config in {"tuner": DECODE_SPACE, "wide": TRITON_WIDE, "none": []}[args.triton]:
        try:
            run, plan = paged_launch(inputs, scale, config)
            report(f"triton {config}", run, case, oracle, splits=plan["num_splits"])
        except Exception as exc:  # a config beyond the GPU's resources: say so, go on
            emit(variant=f"triton {config}", error=str(exc)[:200])


def fastest(inputs: Any, scale: float, space: list[dict[str, Any]]) -> tuple[dict[str, Any], Callable[[], Any],
                                                                            dict[str, Any]] | None:
    """The fastest Triton decode config of ``space`` by one graph time each (compiled first): (config, run,
    plan), or None where none runs."""
    from impls.timing import graph_ms
    from impls.triton_fa.paged import paged_launch

    timed = []
    for config in space:
        try:
            run, plan = paged_launch(inputs, scale, config)
            run()  # compile outside the timing
        except Exception as exc:  # a config beyond the GPU's resources: say so, go on
            emit(variant=f"triton {config}", error=str(exc)[:200])
            continue
        timed.append((graph_ms(run, repeats=20), config, run, plan))
    return min(timed, key=lambda entry: entry[0])[1:] if timed else None


def compare_spaces(case_id: str, spaces: dict[str, list[dict[str, Any]]], peers: list[str], rounds: int) -> None:
    """The fastest config of each named space and each peer, timed in alternation: a JSON line each with its
    time, GB/s, config and plan, and whether its output passes."""
    from suite import metrics
    from suite.checks import Oracle
    from suite.presets import case_by_id

    case = case_by_id(case_id)
    inputs = case.make_inputs("cuda")
    scale, oracle = inputs.head_dim ** -0.5, Oracle.serving(inputs)
    calls: dict[str, Callable[[], Any]] = {}
    details: dict[str, dict[str, Any]] = {}
    for kind, space in spaces.items():
        found = fastest(inputs, scale, space)
        if found:
            config, calls[f"triton {kind}"], plan = found
            details[f"triton {kind}"] = {"config": config, "plan": plan}
    calls |= prepared_peers(peers, inputs, scale)
    median = interleaved(calls, rounds)
    for name, call in calls.items():
        emit(case=case.id, variant=name, ms=median[name], gbps=metrics.kv_bytes(case) / median[name] / 1e6,
             **details.get(name, {}), passed=oracle.check(call()).passed)


def probe_varlen(grid: str, match: str, rounds: int = 3) -> None:
    """Each varlen candidate on every varlen case of ``grid`` whose id matches ``match`` (with its window and
    softcap), beside the dense kernel of the same form on the equal-length batch where the grid has its dense
    twin; ``rounds`` rounds in alternation, the median."""
    import torch

    from impls.contract import NO_WINDOW
    from impls.cutile.launch import Call
    from impls.cutile.serving import VarlenCall, varlen_space
    from impls.cutile.tuner import precompile
    from suite import metrics
    from suite.checks import Oracle
    from suite.presets import preset

    dense = [c.make_inputs("cuda") for c in preset(grid) if c.op == "dense"][:1]
    for case in [c for c in preset(grid) if c.op == "varlen" and fnmatchcase(c.id, match)]:
        inputs = case.make_inputs("cuda")
        scale = inputs.head_dim ** -0.5
        variants = {"window": case.window, "softcap": case.softcap}
        oracle = Oracle.serving(inputs, **variants)
        space = varlen_space(torch.cuda.get_device_capability(), inputs.head_dim, True, window=case.window != NO_WINDOW)
        for variant in space:
            calls: dict[str, Callable[[], Any]] = {"varlen": VarlenCall(variant, inputs, scale=scale, **variants)}
            if case.lengths == "equal" and dense:
                calls["dense"] = Call(variant, *dense[0], causal=True, scale=scale)
            precompile(list(calls.values()))
            median = interleaved(calls, rounds)
            emit(case=case.id, variant=variant.label(), **{f"{name}_ms": ms for name, ms in median.items()},
                 tflops=metrics.flops(case) / median["varlen"] / 1e9, passed=oracle.check(calls["varlen"]()).passed)


def comparison_spaces(ab: tuple[str, dict[str, Any]] | None,
                      tiles: list[tuple[int, int, int]]) -> dict[str, list[dict[str, Any]]] | None:
    """The named Triton spaces a comparison takes the fastest of: the tuner's space with a key at each value
    (``--triton-ab``), or the tuner's space and one over other tiles (``--triton-tiles``); None for neither."""
    if not ab and not tiles:
        return None
    from impls.triton_fa.paged import DECODE_SPACE, decode_space

    if not ab:
        return {"space": DECODE_SPACE, "tiles": decode_space(tuple(tiles))}
    key, values = ab
    return {f"{key} {label}": [{**config, key: value} for config in DECODE_SPACE] for label, value in values.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.serving_probe", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", help=f"a paged serving case id (repeatable; default {DEFAULT_CASE})")
    parser.add_argument("--peer", action="append", default=[], help="a registered paged implementation to time too")
    parser.add_argument("--no-cutile", action="store_true", help="leave cuTile's decode forms out")
    parser.add_argument("--cutile-form", action="append", default=[], type=form_arg, metavar="N,READ[,OCC]",
                        help="a cuTile decode form beside the tuner's (repeatable), e.g. 32,pages,2")
    parser.add_argument("--occupancy", action="append", type=int, default=[],
                        help="each cuTile form again with this many blocks per SM asked of the compiler (repeatable)")
    parser.add_argument("--latency", action="append", default=[], metavar="K,V",
                        help="each cuTile form again with these K and V load latencies (repeatable)")
    parser.add_argument("--plans", action="append", type=int, default=[],
                        help="programs per SM the cuTile forms' split plans aim at (repeatable; default: the usual)")
    parser.add_argument("--cutile-min-tiles", type=int, metavar="N",
                        help="the cuTile forms' shortest chunk in key tiles (default: SPLIT_MIN_TILES)")
    parser.add_argument("--triton", choices=("tuner", "wide", "none"), default="tuner",
                        help="the Triton configs listed: the tuner's space (default), TRITON_WIDE, or none")
    parser.add_argument("--triton-ab", type=values_arg, metavar="KEY[=V1,V2,...]",
                        help="instead of the listing: the fastest Triton config with KEY at each value (default off "
                             "and on), beside each --peer, in alternation")
    parser.add_argument("--triton-tiles", action="append", type=tile_arg, default=[], metavar="N,W,S",
                        help="instead of the listing: the fastest Triton config over these tiles (keys, warps, "
                             "stages; repeatable) against the fastest of the tuner's space, beside each --peer")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of a comparison in alternation (default 7)")
    parser.add_argument("--skip-varlen", action="store_true", help="no varlen probe")
    parser.add_argument("--varlen-only", action="store_true", help="no decode case, only the varlen probe")
    parser.add_argument("--varlen-grid", default="varlen",
                        help="the preset whose varlen cases the varlen probe runs (default varlen)")
    parser.add_argument("--varlen-match", default="*", metavar="GLOB", help="varlen: only the cases whose id matches")
    args = parser.parse_args(argv)
    case_ids = args.case or ([] if args.varlen_only else [DEFAULT_CASE])
    spaces = comparison_spaces(args.triton_ab, args.triton_tiles)
    if spaces:
        for case_id in case_ids:
            compare_spaces(case_id, spaces, args.peer, args.rounds)
        return
    for case_id in case_ids:
        probe_decode(case_id, args)
    if not args.skip_varlen:
        probe_varlen(args.varlen_grid, args.varlen_match)


if __name__ == "__main__":
    main()
