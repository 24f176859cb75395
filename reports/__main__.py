"""``python -m reports RESULTS.json [MORE.json ...] -o report.html``, or ``--markdown`` for tables on stdout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reports.build import ReportError, load_run, write_report
from reports.markdown import table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reports", description=__doc__)
    parser.add_argument("results", nargs="+", type=Path, help="pytest-benchmark JSON files of the suite")
    parser.add_argument("-o", "--output", type=Path, default=Path("results/report.html"))
    parser.add_argument("--baseline", default=None, help="speedups relative to this implementation")
    parser.add_argument("--markdown", action="store_true",
                        help="print a markdown table per preset of each run instead (reports/markdown.py)")
    parser.add_argument("--ours", action="append", default=[],
                        help="with --markdown: implementations (globs) whose best is set against the rest's")
    args = parser.parse_args(argv)
    try:
        if args.markdown:
            for run in map(load_run, args.results):
                for preset in run.presets:
                    if any(run.by_case.get(cid) for cid in run.presets[preset]):
                        print(table(run, preset, ours=args.ours))
            return 0
        out = write_report(args.results, args.output, baseline=args.baseline)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
