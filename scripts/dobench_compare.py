"""Cross-check the suite's timings against ``triton.testing.do_bench`` on the same kernels (GPU).

    python scripts/dobench_compare.py results/bench.json [--min-ms 1] [--impl cutile --impl triton ...]

For every benchmark of the JSON longer than ``--min-ms``, re-creates the case, prepares the same
implementation, times it with do_bench (median) and prints both medians and their difference.
"""

from __future__ import annotations

import argparse
import json
from fnmatch import fnmatchcase

import triton

import impls
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
        theirs = triton.testing.do_bench(run, warmup=100, rep=500, return_mode="median")
        rows.append({"impl": info["impl"], "case": case.id, "suite_ms": median_ms, "do_bench_ms": theirs,
                     "diff_pct": 100 * (median_ms / theirs - 1)})
        print(f"{info['impl']:22s} {case.id:40s} suite {median_ms:8.3f} ms  do_bench {theirs:8.3f} ms  "
              f"{rows[-1]['diff_pct']:+5.1f}%", flush=True)
        del q, k, v, run
    worst = max((abs(r["diff_pct"]) for r in rows), default=0)
    print(f"{len(rows)} benchmarks compared; largest difference {worst:.1f}%")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
