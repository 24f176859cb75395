"""The command line: ``python -m reports RESULTS.json [MORE.json ...] -o report.html``, or ``--markdown``."""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

from reports.build import cache_twins, step_parts, write_runs
from reports.markdown import parts_table, table, twins_table
from reports.runs import ReportError, Run, load_run

DEFAULT_HTML = Path("results/report.html")
DESCRIPTION = ("Build a self-contained HTML report from the benchmark JSON files of the fmha-bench suite (written "
               "with --benchmark-json), or with --markdown print a markdown table per preset.")


def check_names(runs: list[Run], option: str, names: list[str]) -> None:
    """Refuse a name (or glob) given to ``option`` that matches no implementation measured in the runs, naming
    the ones there are."""
    impls = sorted({m.impl for run in runs for m in run.measurements})
    unknown = [name for name in names if not any(fnmatch.fnmatchcase(impl, name) for impl in impls)]
    if unknown:
        raise ReportError(f"{option} {', '.join(unknown)}: no implementation measured in the runs is called so "
                          f"(available: {', '.join(impls) or 'none'})")


def markdown(paths: list[Path], ours: list[str]) -> str:
    """A table per preset with measurements, of each run in turn (reports/markdown.py); after a preset's table, its
    quantized-cache cases against their 16-bit twins and its mixed steps against their parts, where it has them."""
    runs = [load_run(path) for path in paths]
    check_names(runs, "--ours", ours)
    tables = []
    for run in runs:
        for preset in run.presets:
            if any(run.by_case.get(cid) for cid in run.presets[preset]):
                tables.append(table(run, preset, ours=ours))
                if cache_twins(run, preset):
                    tables.append(twins_table(run, preset))
                if step_parts(run, preset):
                    tables.append(parts_table(run, preset))
    return "\n".join(tables)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reports", description=DESCRIPTION)
    parser.add_argument("results", nargs="+", type=Path, help="benchmark JSON files of the suite (.json or .json.gz)")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help=f"where to write (default {DEFAULT_HTML}; with --markdown, standard output)")
    parser.add_argument("--baseline", default=None, metavar="NAME",
                        help="speedups against this implementation (HTML; default: each case's best other "
                             "implementation)")
    parser.add_argument("--markdown", action="store_true", help="markdown tables instead of the HTML report")
    parser.add_argument("--ours", action="append", default=[], metavar="NAME",
                        help="with --markdown: implementations (names or globs such as 'cutile*') whose best is set "
                             "against the best of the rest; repeatable")
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
            runs = [load_run(path) for path in args.results]
            check_names(runs, "--baseline", [args.baseline] if args.baseline else [])
            out = write_runs(runs, args.output or DEFAULT_HTML, baseline=args.baseline)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
