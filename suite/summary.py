"""What a run prints at its end: one compact table per preset, in the report's units (the figure of merit,
TFLOPS or GB/s, and median milliseconds per case), which implementations ran, and which could not and why.
See docs/design.md#reports."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from reports.build import ReportError, Run, figure_of_merit, leaderboard, load_run
from reports.markdown import UNITS, case_labels
from suite.recording import RunState, by_name

MAX_CASE_COLUMNS = 6  # more cases than this: the table keeps the geometric mean and leaves the cases to the report


def measured_run(config: pytest.Config, results: Path | None) -> Run | None:
    """The run's benchmarks as the report reads them: from the results file, else from pytest-benchmark's
    memory (a run without ``--benchmark-json``). None where nothing was timed."""
    if results is not None and results.exists():
        try:
            return load_run(results)
        except ReportError:
            return None
    bench_session = getattr(config, "_benchmarksession", None)
    benchmarks = [b for b in getattr(bench_session, "benchmarks", []) if b and b.stats.rounds]
    if not benchmarks:
        return None
    output = config.hook.pytest_benchmark_generate_json(
        config=config, benchmarks=benchmarks, include_data=False, machine_info={}, commit_info={})
    config.hook.pytest_benchmark_update_json(config=config, benchmarks=benchmarks, output_json=output)
    with tempfile.TemporaryDirectory(prefix="fmha-summary-") as folder:
        path = Path(folder) / "benchmarks.json"
        path.write_text(json.dumps(output, default=str))
        return load_run(path)


def number(value: float | None) -> str:
    """Three significant digits, whole numbers from 100 up; "-" where there is none."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def aligned(rows: list[list[str]]) -> list[str]:
    """Rows as text columns: the first left-aligned, the others (numbers) right-aligned."""
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if col == 0 else cell.rjust(w) for col, (cell, w) in enumerate(zip(row, widths,
            strict=True))).rstrip() for row in rows]


def preset_table(run: Run, preset: str) -> tuple[str, list[str]]:
    """(preset, lines): a caption, then an implementation a row, ranked as the report's leaderboard ranks them by
    the geometric mean of the figure of merit; then, up to MAX_CASE_COLUMNS cases, each case's median in ms."""
    ids = [cid for cid in run.presets.get(preset, []) if run.by_case.get(cid)]
    if not ids:
        return preset, []
    metric = figure_of_merit(run.cases.get(cid, {}) for cid in ids)
    labels, shared = case_labels({cid: run.cases.get(cid, {}) for cid in ids})
    per_case = len(ids) <= MAX_CASE_COLUMNS
    caption = (f"{UNITS[metric]} (geomean)" + (", median ms per case" if per_case else "")
               + f"; {run.lead} timing" + (f"; every case {', '.join(shared)}" if shared else ""))
    header = ["", UNITS[metric]] + ([labels[cid] for cid in ids] if per_case else ["cases"])
    rows = [header]
    for row in leaderboard(run, preset):
        impl = row["impl"]
        cells = [number(run.by_case[cid][impl].median_s * 1e3) if impl in run.by_case[cid] else "-" for cid in ids]
        rows.append([impl, number(row["value"])] + (cells if per_case else [f"{row['cases']}/{len(ids)}"]))
    return preset, [caption, *aligned(rows)]


def preset_tables(run: Run) -> list[tuple[str, list[str]]]:
    """A table per preset that has measured cases, in the run's order."""
    tables = [preset_table(run, preset) for preset in run.presets]
    return [(title, lines) for title, lines in tables if lines]


def implementation_lines(state: RunState, outcomes: Iterable[dict[str, Any]]) -> list[str]:
    """How many implementations ran (passed a check or were timed on at least one case), then one line for each
    that could not: unavailable here, or refused or failed every case it was given."""
    by_impl: dict[str, list[dict[str, Any]]] = {name: [] for name in by_name(state.impls)}
    for outcome in outcomes:
        by_impl.setdefault(str(outcome.get("impl")), []).append(outcome)
    ran = [name for name, seen in by_impl.items() if any(o.get("status") == "passed" for o in seen)]
    could_not = dict(state.unavailable)
    for name, seen in by_impl.items():
        if seen and name not in ran:
            status, message = Counter((o.get("status"), o.get("message") or "") for o in seen).most_common(1)[0][0]
            could_not[name] = f"{status} on every case" + (f" ({message[:100]})" if message else "")
    lines = [f"{len(ran)} implementation{'s' if len(ran) != 1 else ''} ran: {', '.join(sorted(ran)) or '-'}"]
    if could_not:
        lines.append(f"{len(could_not)} could not:")
        lines += [f"  {name}: {reason}" for name, reason in could_not.items()]
    return lines
