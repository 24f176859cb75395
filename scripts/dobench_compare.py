"""Cross-check the suite's timings against ``triton.testing.do_bench`` on the same kernels (GPU).

    python scripts/dobench_compare.py results/bench.json [--min-ms 1] [--impl cutile --impl triton ...]

For every benchmark of the JSON longer than ``--min-ms``, re-creates the case, prepares the same
implementation and times it both ways in this process, back to back: the suite's way (CUDA-event clock,
rounds of back-to-back calls, median) and do_bench (median, L2 flushed between calls). Prints the JSON's
median too, which was measured earlier.
"""

from __future__ import annotations

import argparse
import json
from fnmatch import fnmatchcase

import triton

import impls
from impls.timing import event_rounds_median
from suite.cases import Case


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("--min-ms", type=float, default=1.0)
    p.add_argument("--impl", action="append", default=[])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    with open(a.results) as f:
        data = json.load(f)
    rows = []
    for bench in data["benchmarks"]:
        info, median_ms = bench["extra_info"], bench["stats"]["median"] * 1e3
        if median_ms < a.min_ms or (a.impl and not any(fnmatchcase(info["impl"], g) for g in a.impl)):
            continue
        case = Case(**{k: info[k] for k in ("batch", "hq", "hkv", "sq", "skv", "d", "dtype", "causal")})
        q, k, v = case.make_inputs("cuda")
        run = impls.get(info["impl"]).prepare(q, k, v, causal=case.causal)
        ours = event_rounds_median(run) * 1e3
        theirs = triton.testing.do_bench(run, warmup=100, rep=500, return_mode="median")
        rows.append({"impl": info["impl"], "case": case.id, "json_ms": median_ms, "suite_ms": ours,
                     "do_bench_ms": theirs, "diff_pct": 100 * (ours / theirs - 1)})
        print(f"{info['impl']:22s} {case.id:40s} json {median_ms:8.3f}  suite {ours:8.3f}  "
              f"do_bench {theirs:8.3f} ms  {rows[-1]['diff_pct']:+5.1f}%", flush=True)
        del q, k, v, run
        if a.out:  # after every row: a run cut short keeps what it measured
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)
    worst = max((abs(r["diff_pct"]) for r in rows), default=0)
    print(f"{len(rows)} benchmarks compared; largest difference {worst:.1f}%")


if __name__ == "__main__":
    main()
