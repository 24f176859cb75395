"""``python -m reports RESULTS.json [MORE.json ...] -o report.html``"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reports.build import ReportError, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reports", description=__doc__)
    parser.add_argument("results", nargs="+", type=Path, help="pytest-benchmark JSON files of the suite")
    parser.add_argument("-o", "--output", type=Path, default=Path("results/report.html"))
    parser.add_argument("--baseline", default=None, help="speedups relative to this implementation")
    args = parser.parse_args(argv)
    try:
        out = write_report(args.results, args.output, baseline=args.baseline)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
