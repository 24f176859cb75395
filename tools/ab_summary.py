"""Implementations timed in alternating runs on one machine: each case's figure of merit per run, and per pass
``--ours`` over the best other implementation, so that a gap of 1% can be told from the machine's own drift.

Give each implementation's runs in pass order; the n-th run of every implementation makes pass n. The figure is
the one the report uses for the case (GB/s for decode, TFLOPS otherwise).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

EPILOG = """example (three passes of two implementations, alternating):
  for pass in 1 2 3; do for impl in triton flashinfer; do
    python -m pytest suite --benchmark-only --grid serving --timing graph --impl $impl \\
      --benchmark-json results/ab-$impl-$pass.json
  done; done
  python -m tools.ab_summary --ours triton results/ab-*.json
"""


def summary(paths: list[Path], ours: str) -> list[str]:
    """One line per case and implementation: its figure in each run that has it (in the order given), and their
    median; then, per case, ``ours`` over the best other implementation in each pass (the n-th run of each)."""
    from reports.build import figure_of_merit, load_run

    runs = [load_run(p) for p in paths]
    merit = {cid: figure_of_merit([fields]) for run in runs for cid, fields in run.cases.items()}
    figures: dict[str, dict[str, list[float]]] = {}  # case -> impl -> one figure a run, in order
    for run in runs:
        for cid, per_impl in run.by_case.items():
            for impl, m in per_impl.items():
                value = getattr(m, merit[cid])
                if value is not None:
                    figures.setdefault(cid, {}).setdefault(impl, []).append(value)
    lines: list[str] = []
    for cid in sorted(figures):
        per_impl = figures[cid]
        for impl, values in per_impl.items():
            listed = " ".join(f"{v:8.1f}" for v in values)
            lines.append(f"{cid:70s} {impl:12s} {listed}   median {statistics.median(values):8.1f} {merit[cid]}")
        others = [impl for impl in per_impl if impl != ours]
        if ours in per_impl and others:
            passes = min(len(v) for v in per_impl.values())
            ratios = [per_impl[ours][i] / max(per_impl[o][i] for o in others) for i in range(passes)]
            lines.append(f"{cid:70s} {ours} / best other, per pass: " + " ".join(f"{r:.3f}" for r in ratios))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.ab_summary", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="pytest-benchmark JSON files of the suite")
    parser.add_argument("--ours", default="triton", help="the implementation set over the best of the others")
    args = parser.parse_args(argv)
    print("\n".join(summary(args.runs, args.ours)))


if __name__ == "__main__":
    main()
