"""Where the dynamically scheduled persistent cuTile forms go wrong (session 42: wrong under compute-sanitizer
memcheck on a chunked prefill, right without it; session 43: with tileiras 13.4 only, ``toolchain.DYNAMIC_SCHEDULER``).
Run it under ``compute-sanitizer --tool memcheck`` with either toolchain to compare; it builds the forms itself, so
it runs them where ``other_forms`` leaves them out.

Each variant runs ``--runs`` times on each case; every run is checked against a float32 ``attention_ref`` of the
whole output (every batch, head and row), and prints its max error, the scheduler's counter after the call (a correct
dynamic call leaves it at the number of work items: one atomic after each item) and the wrong (batch, head,
query tile) items, so that a wrong item, a wrong row range or a wrong counter each show.
"""

import argparse
import json

import torch

from impls.cutile.launch import Call
from impls.cutile.spaces import DYNAMIC_FORMS, HOPPER_STREAMING, HOPPER_WIDE
from impls.reference import attention_ref
from suite.cases import Case

CASES = {
    "chunk-d64": Case(2, 8, 8, 333, 1000, 64, "bf16", True),
    "chunk-d128": Case(2, 8, 2, 333, 1000, 128, "bf16", True),
    "square-d64": Case(2, 8, 8, 1000, 1000, 64, "bf16", True),
    "long-d128": Case(4, 32, 8, 4096, 4096, 128, "fp16", True),  # more items than blocks: the counter schedules
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", action="append", choices=list(CASES))
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--forms", default="all", choices=["all", "dynamic"])
    parser.add_argument("--out")
    args = parser.parse_args()
    forms = [*DYNAMIC_FORMS] + ([] if args.forms == "dynamic" else [HOPPER_STREAMING, HOPPER_WIDE])
    results = []
    for name in args.case or list(CASES):
        case = CASES[name]
        q, k, v = case.make_inputs("cuda")
        scale = case.d ** -0.5
        ref = attention_ref(q.float(), k.float(), v.float(), causal=case.causal, scale=scale, upcast=False)
        for variant in forms:
            call = Call(variant, q, k, v, causal=case.causal, scale=scale)
            tile_m = call.variant.tile_m
            runs = []
            for _ in range(args.runs):
                call.out.fill_(float("nan"))
                out = call()
                torch.cuda.synchronize()
                err = (out.float() - ref).abs().nan_to_num(float("inf"))
                bad_rows = (err.amax(-1) > 0.05).nonzero().tolist()
                items = sorted({(b, h, r // tile_m) for b, h, r in bad_rows})
                runs.append({"max_error": float(err.max()), "counter": int(call.state[-1].item()),
                             "bad_rows": len(bad_rows), "bad_items": items[:12], "n_bad_items": len(items)})
            grid = call.launches[0][0]
            record = {"case": name, "variant": call.variant.label(), "grid": grid, "runs": runs}
            results.append(record)
            wrong = [r for r in runs if r["bad_rows"]]
            print(f"{name:11} {call.variant.label():70} grid {grid}: {len(wrong)}/{len(runs)} runs wrong; "
                  f"counters {sorted({r['counter'] for r in runs})}; "
                  f"max error {max(r['max_error'] for r in runs):.3g}", flush=True)
            for r in wrong[:3]:
                print(f"    {r['bad_rows']} rows, {r['n_bad_items']} items, e.g. {r['bad_items']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
