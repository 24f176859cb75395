"""Markdown tables of a run, for READMEs and pull requests, and documents whose tables are made from results files.

A table is one preset of one run: a case a row, an implementation a column (in the order of the preset's
leaderboard), the figure of merit in the run's lead timing mode (GB/s for decode, TFLOPS otherwise) and the row's
best in bold. With ``ours`` it ends in one more column: the best of those implementations over the best of the
other columns, marked "tie" where the run cannot order the two (their medians closer than the wider of their
interquartile ranges: ``Measurement.ties``). Only measured implementations appear, and the suite measures an
implementation on a case only after it passed the correctness check there.

A document keeps its tables current with blocks like::

    <!-- results: docs/results/serving-varlen-h200.json.gz --preset serving --ours cutile --ours triton -->
    (the table, written by `python -m reports.markdown README.md`)
    <!-- /results -->

``python -m reports.markdown DOC.md ...`` rewrites every block from its file; ``--check`` only says which are stale
(exit 1), and a test runs that on the README.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from reports.build import cache_twins, leaderboard, step_parts, twin_columns
from reports.cases import case_labels
from reports.formatting import sig3
from reports.runs import Measurement, ReportError, Run, figure_of_merit, load_run

UNITS = {"gbps": "GB/s", "tflops": "TFLOPS"}
BLOCK = re.compile(r"(<!-- results: (?P<args>.*?) -->\n)(?P<body>.*?)(<!-- /results -->)", re.DOTALL)


def _matches(name: str, globs: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def _cell(value: float | None) -> str:
    return "-" if value is None else sig3(value)


def _ours_over_peers(measured: dict[str, Measurement], value: dict[str, float | None], mine: Sequence[str],
                     peers: Sequence[str]) -> str:
    """The best of ``mine`` over the best of ``peers`` by figure of merit, "tie" added where the run cannot order
    the two."""
    top = max((c for c in mine if value[c]), key=lambda c: value[c], default=None)
    rival = max((c for c in peers if value[c]), key=lambda c: value[c], default=None)
    if top is None or rival is None:
        return "-"
    ratio = f"{value[top] / value[rival]:.3f}"
    return f"{ratio} (tie)" if measured[top].ties(measured[rival]) else ratio


def _l2_note(run: Run, case_ids: Sequence[str], columns: Sequence[str]) -> str:
    """How the table's numbers found the L2: nothing where every call found its inputs left there by the one
    before (the suite's default), "cold L2" where none did (``--cold-l2``), else which cases stayed warm (a
    rotation over copies cannot evict the L2 for the smallest calls)."""
    measured = [(cid, m) for cid in case_ids for c, m in run.by_case[cid].items() if c in columns]
    warm = sorted({cid for cid, m in measured if not m.cold_l2})
    if len(warm) == len(case_ids):
        return ""
    if not warm:
        return ", cold L2"
    return f", cold L2 but for {len(warm)} case{'s' if len(warm) > 1 else ''} whose input copies fit in it together"


def table(run: Run, preset: str, *, impls: Sequence[str] = ("*",), cases: Sequence[str] = ("*",),
          ours: Sequence[str] = ()) -> str:
    """One preset of a run as a markdown table (module docstring); implementations and cases by glob."""
    if preset not in run.presets:
        raise ReportError(f"{run.path}: no preset {preset!r} (it has {', '.join(run.presets)})")
    case_ids = [cid for cid in run.presets[preset] if run.by_case.get(cid) and _matches(cid, cases)]
    if not case_ids:
        raise ReportError(f"{run.path}: preset {preset!r} has no measured case matching {', '.join(cases)}")
    metric = figure_of_merit(run.cases.get(cid, {}) for cid in case_ids)
    columns = [r["impl"] for r in leaderboard(run, preset) if _matches(r["impl"], impls)]
    if not columns:
        raise ReportError(f"{run.path}: preset {preset!r} has no implementation matching {', '.join(impls)}")
    mine, peers = [c for c in columns if _matches(c, ours)], [c for c in columns if not _matches(c, ours)]
    labels, shared = case_labels({cid: run.cases.get(cid, {}) for cid in case_ids})
    header = ["case", *columns] + (["ours / best peer"] if mine and peers else [])
    lines = [f"`{preset}`, {UNITS[metric]} ({run.lead} timing{_l2_note(run, case_ids, columns)}, "
             f"{run.env.get('gpu') or run.env.get('device', '?')}"
             + (f"; every case {', '.join(shared)}" if shared else "") + "):", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cid in case_ids:
        measured = run.by_case[cid]
        value = {c: getattr(measured[c], metric) if c in measured else None for c in columns}
        best = max((v for v in value.values() if v), default=None)
        row = [labels[cid]] + [f"**{_cell(v)}**" if v and v == best else _cell(v) for v in value.values()]
        if mine and peers:
            row.append(_ours_over_peers(measured, value, mine, peers))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def twins_table(run: Run, preset: str, *, impls: Sequence[str] = ("*",), cases: Sequence[str] = ("*",)) -> str:
    """The preset's cases over a quantized KV cache (fp8) as a markdown table: per implementation, the step's time
    over its time on the same step over the case's own dtype (``reports.build.cache_twins``; 0.5: the bytes alone)."""
    rows = [row for row in cache_twins(run, preset) if _matches(row["case"], cases)]
    if not rows:
        raise ReportError(f"{run.path}: preset {preset!r} has no quantized-cache case matching {', '.join(cases)} "
                          "measured beside its twin")
    columns = [c for c in twin_columns(run, preset, rows) if _matches(c, impls)]
    if not columns:
        raise ReportError(f"{run.path}: preset {preset!r} has no implementation matching {', '.join(impls)}")
    labels, shared = case_labels({row["case"]: run.cases.get(row["case"], {}) for row in rows})
    narrow = "/".join(sorted({row["kv_dtype"] for row in rows}))
    wide = "/".join(sorted({str(run.cases.get(row["case"], {}).get("dtype")) for row in rows}))
    lines = [f"`{preset}`, time of a step over the {narrow} cache / the same step over a {wide} one ({_timing(run)}"
             + (f"; every case {', '.join(shared)}" if shared else "") + "):", "",
             "| " + " | ".join(["case", *columns]) + " |", "|" + "---|" * (len(columns) + 1)]
    for row in rows:
        cells = [f"{row['ratios'][c]:.2f}" if c in row["ratios"] else "-" for c in columns]
        lines.append("| " + " | ".join([labels[row["case"]], *cells]) + " |")
    return "\n".join(lines) + "\n"


def _timing(run: Run) -> str:
    return f"{run.lead} timing, {run.env.get('gpu') or run.env.get('device', '?')}"


def parts_table(run: Run, preset: str, *, impls: Sequence[str] = ("*",), cases: Sequence[str] = ("*",)) -> str:
    """The preset's mixed steps against their parts timed apart as a markdown table (``reports.build.step_parts``):
    a row per step and implementation, the three times and the step's over the parts' sum, bold where at most 1."""
    rows = [row for row in step_parts(run, preset) if _matches(row["case"], cases)]
    if not rows:
        raise ReportError(f"{run.path}: preset {preset!r} has no mixed step matching {', '.join(cases)} measured "
                          "beside its decode and prefill parts")
    columns = [c for c in twin_columns(run, preset, rows, "times") if _matches(c, impls)]
    if not columns:
        raise ReportError(f"{run.path}: preset {preset!r} has no implementation matching {', '.join(impls)}")
    labels, shared = case_labels({row["case"]: run.cases.get(row["case"], {}) for row in rows})
    lines = [f"`{preset}`, a mixed step against its decode and prefill parts timed apart, ms ({_timing(run)}"
             + (f"; every step {', '.join(shared)}" if shared else "") + "):", "",
             "| step | implementation | step | decode | prefill | step / parts |", "|" + "---|" * 6]
    for row in rows:
        for impl in (c for c in columns if c in row["times"]):
            t = row["times"][impl]
            ratio = f"{t['ratio']:.2f}"
            cells = [labels[row["case"]], impl, *(_cell(t[k]) for k in ("step_ms", "decode_ms", "prefill_ms")),
                     f"**{ratio}**" if t["ratio"] <= 1 else ratio]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def block_parser() -> argparse.ArgumentParser:
    """The arguments of one ``<!-- results: ... -->`` block."""
    parser = argparse.ArgumentParser(prog="<!-- results: FILE ... -->", add_help=False, exit_on_error=False)
    parser.add_argument("file", type=Path)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--impl", action="append", default=None, help="columns, by glob (repeatable)")
    parser.add_argument("--case", action="append", default=None, help="rows, by glob on the case id (repeatable)")
    parser.add_argument("--ours", action="append", default=[], help="add the best of these over the best of the rest")
    parser.add_argument("--twins", action="store_true",
                        help="the quantized-cache cases' step time over their 16-bit twins' instead (twins_table)")
    parser.add_argument("--parts", action="store_true",
                        help="the mixed steps against their decode and prefill parts instead (parts_table)")
    return parser


def render_block(args: str, root: Path, runs: dict[Path, Run]) -> str:
    """The body of a block: the table its arguments name (paths relative to the document's folder), between blank
    lines so that markdown does not run it into the comments around it. ``runs``: the files already read, by path
    (a document's blocks often share one)."""
    try:
        ns = block_parser().parse_args(shlex.split(args))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ReportError(f"bad results block arguments {args!r}: {exc}") from exc
    if ns.twins and ns.parts:
        raise ReportError(f"bad results block arguments {args!r}: --twins and --parts are two tables")
    if (ns.twins or ns.parts) and ns.ours:
        raise ReportError(f"bad results block arguments {args!r}: --ours does not apply to "
                          f"{'--twins' if ns.twins else '--parts'}")
    path = root / ns.file
    if path not in runs:
        runs[path] = load_run(path)
    selection = {"impls": ns.impl or ["*"], "cases": ns.case or ["*"]}
    if ns.twins or ns.parts:
        made = twins_table if ns.twins else parts_table
        return "\n" + made(runs[path], ns.preset, **selection) + "\n"
    return "\n" + table(runs[path], ns.preset, ours=ns.ours, **selection) + "\n"


def sync(text: str, root: Path) -> str:
    """The document with every results block made anew from its file."""
    runs: dict[Path, Run] = {}
    return BLOCK.sub(lambda m: m.group(1) + render_block(m.group("args"), root, runs) + m.group(4), text)


def stale_blocks(path: Path) -> list[str]:
    """The arguments of each block of the document whose table differs from what its file gives now."""
    runs: dict[Path, Run] = {}
    return [m.group("args") for m in BLOCK.finditer(path.read_text())
            if m.group("body") != render_block(m.group("args"), path.parent, runs)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reports.markdown",
                                     description="Rewrite (or --check) the results tables of markdown documents.")
    parser.add_argument("documents", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = parser.parse_args(argv)
    stale = 0
    try:
        for doc in args.documents:
            if args.check:
                for block in stale_blocks(doc):
                    print(f"{doc}: stale table <!-- results: {block} -->", file=sys.stderr)
                    stale += 1
            else:
                doc.write_text(sync(doc.read_text(), doc.parent))
    except (ReportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
