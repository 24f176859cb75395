"""``python -m reports RESULTS.json [MORE.json ...] -o report.html``, or ``--markdown`` for a table per preset."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reports.build import ReportError, cache_twins, load_run, write_report
from reports.markdown import table, twins_table

DEFAULT_HTML = Path("results/report.html")


def markdown(paths: list[Path], ours: list[str]) -> str:
    """A table per preset with measurements, of each run in turn (reports/markdown.py); after a preset's table, its
    quantized-cache cases against their 16-bit twins where it has them."""
    tables = []
    for run in map(load_run, paths):
        for preset in run.presets:
            if any(run.by_case.get(cid) for cid in run.presets[preset]):
                tables.append(table(run, preset, ours=ours))
                if cache_twins(run, preset):
                    tables.append(twins_table(run, preset))
    return "\n".join(tables)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reports", description=__doc__)
    parser.add_argument("results", nargs="+", type=Path, help="pytest-benchmark JSON files of the suite")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help=f"where to write (default {DEFAULT_HTML}; with --markdown, standard output)")
    parser.add_argument("--baseline", default=None, help="speedups relative to this implementation (HTML)")
    parser.add_argument("--markdown", action="store_true", help="markdown tables instead of the HTML report")
    parser.add_argument("--ours", action="append", default=[],
                        help="with --markdown: implementations (globs) whose best is set against the rest's")
    args = parser.parse_args(argv)
    if args.ours and not args.markdown:
        parser.error("--ours applies to --markdown tables")
    if args.baseline and args.markdown:
        parser.error("--baseline applies to the HTML report, not to --markdown")
    try:
        if args.markdown:
            text = markdown(args.results, args.ours)
            if args.output is None:
                print(text, end="")
                return 0
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(text)
            out = args.output
        else:
            out = write_report(args.results, args.output or DEFAULT_HTML, baseline=args.baseline)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
