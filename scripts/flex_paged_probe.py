"""flex's paged decode in each of its forms, side by side on a GPU (session 58's open question).

For each case: the entry's own choice (``impls.flex.flex_paged``), full blocks, every page partial, and, where full
blocks split badly (``impls.flex.full_blocks_split_well``: torch's decoding template cuts its ranges from the whole
physical cache), full blocks with ``SPLIT_KV`` raised so that every sequence covers as many ranges as torch's
``get_split_k`` aims at (``split_kv_covering``), then each ``--peer``. Timed in alternation (a CUDA graph
of 20 calls, the median of ``--rounds``), each output checked against the float64 oracle
(``serving_probe.report_alternating``). Prints JSON lines. Needs the repository on PYTHONPATH.

    PYTHONPATH=$PWD python scripts/flex_paged_probe.py \
        --case llama3-70b-tp8-paged-bf16-h8:1-q1-kv32768-uniform-p16-d128-b16 --peer flashinfer
"""

from __future__ import annotations

import argparse
import json

import torch

import impls
from impls import flex
from scripts.serving_probe import report_alternating
from suite.cases import case_by_id
from suite.checks import Oracle

# one case a regime: one split (full blocks pay), a few splits, many splits, a single sequence
DEFAULT_CASES = ("llama3-8b-paged-bf16-h32:8-q1-kv8192-uniform-p16-d128-b64",
                 "llama3-8b-paged-bf16-h32:8-q1-kv8192-uniform-p16-d128-b16",
                 "llama3-70b-tp8-paged-bf16-h8:1-q1-kv32768-uniform-p16-d128-b16",
                 "llama3-8b-paged-bf16-h32:8-q1-kv32768-uniform-p16-d128")


def split_kv_covering(lengths: list[int], slots: int, kv_heads: int, sms: int) -> int:
    """SPLIT_KV for full blocks such that the shortest sequence still covers ``get_split_k``'s number of ranges:
    ranges of the whole cache ``slots`` long, each at most that sequence's length over that number."""
    aimed = flex.decode_splits(len(lengths), kv_heads, sms)
    per_split = max(-(-min(lengths) // aimed), 1)
    return -(-slots // per_split)


def forms(inputs, scale: float, peers: list[str]) -> dict:
    """The calls to compare by name, each made (and compiled by a first call) only when asked for."""
    slots, kv_heads = inputs.k_cache.shape[0] * inputs.page_size, inputs.k_cache.shape[2]
    sms = torch.cuda.get_device_properties(inputs.q.device).multi_processor_count

    def form(full_blocks: bool, **options):
        return lambda: flex.paged_call(inputs, scale=scale, full_blocks=full_blocks, **options)

    def registered(name: str):
        return lambda: impls.get(name, "paged").prepare(inputs, scale=scale)

    calls = {"flex (entry)": registered("flex"), "flex full blocks": form(True), "flex partial blocks": form(False)}
    if not flex.full_blocks_split_well(inputs.seqlens, slots, kv_heads, sms):  # else torch's split is right
        split = split_kv_covering(inputs.seqlens, slots, kv_heads, sms)
        calls[f"flex full blocks, SPLIT_KV {split}"] = form(True, SPLIT_KV=split)
    return calls | {name: registered(name) for name in peers}


def probe(case_id: str, peers: list[str], rounds: int) -> None:
    case = case_by_id(case_id)
    if case.variants:  # the forms below build the plain causal mask, no window, no softcap
        print(json.dumps({"case": case_id, "error": "a case with a window or a softcap: not probed"}), flush=True)
        return
    inputs = case.make_inputs("cuda")
    scale, oracle = inputs.head_dim ** -0.5, Oracle.serving(inputs)
    calls = {}
    for name, make in forms(inputs, scale, peers).items():
        try:
            calls[name] = make()
        except Exception as exc:  # a form or peer that cannot run this case: say why, go on
            print(json.dumps({"case": case_id, "variant": name, "error": flex.compile_error(exc)}), flush=True)
    report_alternating(case, oracle, calls, {}, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", help=f"a paged case id (repeatable; default {DEFAULT_CASES})")
    parser.add_argument("--peer", action="append", default=[], help="a registered paged implementation to time too")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for case_id in args.case or DEFAULT_CASES:
        probe(case_id, args.peer, args.rounds)


if __name__ == "__main__":
    main()
