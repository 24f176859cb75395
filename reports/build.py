"""Turn pytest-benchmark JSON files (with the suite's ``fmha`` block) into one self-contained HTML report."""

from __future__ import annotations

import html
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from reports import charts
from reports.blog import BLOG_LADDER, BLOG_SEQLENS, HOPPER_EVIDENCE, ladder_notes


class ReportError(ValueError):
    """A results file the report cannot use; the message names the file and the problem."""


@dataclass
class Measurement:
    impl: str
    family: str
    case: str
    fields: dict[str, Any]
    median_s: float
    iqr_s: float
    stddev_s: float
    rounds: int
    tflops: float | None
    pct_of_peak: float | None
    gbps: float | None
    peak_memory_bytes: int | None
    max_error: float | None
    config: dict


@dataclass
class Run:
    label: str
    path: str
    env: dict[str, Any]
    measurements: list[Measurement]
    outcomes: list[dict[str, Any]]
    unavailable: dict[str, str]
    presets: dict[str, list[str]]
    cases: dict[str, dict[str, Any]]
    baseline: str = "sdpa"
    by_case: dict[str, dict[str, Measurement]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for m in self.measurements:
            self.by_case.setdefault(m.case, {})[m.impl] = m


def _require(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise ReportError(f"{path}: {what}")


def load_run(path: Path) -> Run:
    """Read and validate one results file: malformed or truncated input is refused with a clear reason."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not valid JSON (truncated?) at line {exc.lineno} column {exc.colno}: "
                          f"{exc.msg}") from exc
    _require(isinstance(data, dict), path, "top level is not a JSON object")
    _require(isinstance(data.get("benchmarks"), list), path,
             "no 'benchmarks' list: expected the file pytest-benchmark writes with --benchmark-json")
    fmha = data.get("fmha")
    _require(isinstance(fmha, dict), path, "no 'fmha' block: not written by the fmha-bench suite")
    for key, kind in (("outcomes", list), ("unavailable", dict), ("presets", dict), ("cases", dict)):
        _require(isinstance(fmha.get(key), kind), path, f"'fmha.{key}' missing or not a {kind.__name__}")
    measurements = []
    for i, bench in enumerate(data["benchmarks"]):
        _require(isinstance(bench, dict) and isinstance(bench.get("stats"), dict)
                 and isinstance(bench.get("extra_info"), dict), path, f"benchmark #{i} lacks stats/extra_info")
        info, stats = bench["extra_info"], bench["stats"]
        try:
            measurements.append(Measurement(
                impl=str(info["impl"]), family=str(info.get("family", "")), case=str(info["case"]),
                fields={k: info.get(k) for k in ("batch", "hq", "hkv", "sq", "skv", "d", "dtype", "causal")},
                median_s=float(stats["median"]), iqr_s=float(stats.get("iqr", 0.0)),
                stddev_s=float(stats.get("stddev", 0.0)), rounds=int(stats.get("rounds", 0)),
                tflops=_num(info.get("tflops")), pct_of_peak=_num(info.get("pct_of_peak")),
                gbps=_num(info.get("gbps")), peak_memory_bytes=info.get("peak_memory_bytes"),
                max_error=_num(info.get("max_error")), config=dict(info.get("config") or {}),
            ))
        except (KeyError, TypeError, ValueError) as exc:
            raise ReportError(f"{path}: benchmark #{i} ({bench.get('name', '?')}) is missing or has a bad "
                              f"field: {exc}") from exc
    env = (data.get("machine_info") or {}).get("fmha") or {}
    label = f"{env.get('gpu') or env.get('cpu') or env.get('device', 'run')} ({path.stem})"
    return Run(label=label, path=str(path), env=env, measurements=measurements, outcomes=fmha["outcomes"],
               unavailable=fmha["unavailable"], presets=fmha["presets"], cases=fmha["cases"],
               baseline=str(fmha.get("baseline") or "sdpa"))


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _geomean(values: Iterable[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def leaderboard(run: Run, preset: str) -> list[dict[str, Any]]:
    """Implementations of a preset ranked by geometric-mean TFLOPS over the cases each was measured on."""
    case_ids = run.presets.get(preset, [])
    per_impl: dict[str, list[float]] = defaultdict(list)
    for cid in case_ids:
        for impl, m in run.by_case.get(cid, {}).items():
            if m.tflops:
                per_impl[impl].append(m.tflops)
    rows = [{"impl": impl, "tflops": _geomean(v), "cases": len(v), "of": len(case_ids)}
            for impl, v in per_impl.items()]
    return sorted(rows, key=lambda r: -(r["tflops"] or 0))


def case_table(run: Run, case_id: str, baseline: str) -> list[dict[str, Any]]:
    rows = []
    base = run.by_case.get(case_id, {}).get(baseline)
    for impl, m in sorted(run.by_case.get(case_id, {}).items(), key=lambda kv: kv[1].median_s):
        rows.append({
            "impl": impl, "median_ms": m.median_s * 1e3, "iqr_ms": m.iqr_s * 1e3, "rounds": m.rounds,
            "tflops": m.tflops, "pct": m.pct_of_peak, "gbps": m.gbps,
            "speedup": base.median_s / m.median_s if base else None,
            "mem_mib": m.peak_memory_bytes / 2**20 if isinstance(m.peak_memory_bytes, int) else None,
            "config": ", ".join(f"{k}={v}" for k, v in m.config.items()),
        })
    return rows


def correctness_matrix(run: Run) -> dict[str, Any]:
    """(impl, check) -> the last recorded outcome; a check is a case, or a case and a property
    (non-finite inputs), in the order the run produced them. A benchmark's own check counts too."""
    cells: dict[tuple[str, str], dict] = {}
    rows: dict[str, None] = {}
    for o in run.outcomes:
        row = str(o.get("case")) + (f" · {o['property']}" if o.get("property") else "")
        rows[row] = None
        cells[(str(o.get("impl")), row)] = {**o, "css": str(o.get("status", "")).replace(" ", "-")}
    return {"impls": sorted({i for i, _ in cells}), "cases": list(rows), "cells": cells}


def chart_groups(run: Run, preset: str) -> dict[str, list[str]]:
    """Cases of a preset grouped so that only the sequence length varies along a chart's x axis."""
    groups: dict[str, list[str]] = defaultdict(list)
    for cid in run.presets.get(preset, []):
        c = run.cases.get(cid, {})
        shape = "Sq=Skv" if c.get("sq") == c.get("skv") else f"Sq={c.get('sq')}"
        key = (f"{'causal' if c.get('causal') else 'non-causal'}, h{c.get('hq')}:{c.get('hkv')}, "
               f"d{c.get('d')}, {c.get('dtype')}, {shape}, B={c.get('batch')}")
        groups[key].append(cid)
    return dict(groups)


def series(runs: list[Run], preset: str, case_ids: list[str], value: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    holders = [run for run in runs if any(cid in run.by_case for cid in case_ids)]
    for run in holders:
        for cid in case_ids:
            skv = run.cases.get(cid, {}).get("skv")
            for impl, m in run.by_case.get(cid, {}).items():
                y = m.tflops if value == "tflops" else (m.peak_memory_bytes or 0) / 2**20
                if y:
                    label = impl if len(holders) == 1 else f"{impl} @ {run.label}"
                    out[label].append((skv, y))
    return {k: sorted(v) for k, v in out.items()}


def ladder(run: Run) -> dict[str, Any] | None:
    steps = list(BLOG_LADDER)
    case_ids = run.presets.get("ladder") or run.presets.get("blog") or []
    by_seq = {run.cases[c]["sq"]: c for c in case_ids if c in run.cases}
    if not any(s in run.by_case.get(by_seq.get(seq, ""), {}) for s in steps for seq in by_seq):
        return None
    here = {s: {seq: getattr(run.by_case.get(by_seq.get(seq, ""), {}).get(s), "tflops", None)
                for seq in BLOG_SEQLENS} for s in steps}
    hopper = str(run.env.get("compute_capability", "")).startswith("9.")
    return {"steps": steps, "seqlens": BLOG_SEQLENS, "here": here, "blog": BLOG_LADDER,
            "notes": ladder_notes(here), "evidence": HOPPER_EVIDENCE if hopper else []}


def build_context(runs: list[Run], baseline: str) -> dict[str, Any]:
    # Presets with measurements (a correctness-only run, or the property checks, have none to chart).
    presets = [p for p in dict.fromkeys(p for r in runs for p in r.presets)
               if any(cid in r.by_case for r in runs for cid in r.presets.get(p, []))]
    sections = []
    for preset in presets:
        groups = chart_groups(runs[0], preset) if runs else {}
        for r in runs[1:]:
            for k, v in chart_groups(r, preset).items():
                groups.setdefault(k, v)
        charts_ = [{"title": f"{preset}: {key}", "svg": charts.line_chart(
                        series(runs, preset, ids, "tflops"), xlabel="Skv", ylabel="TFLOPS", title=key)}
                   for key, ids in groups.items() if len(ids) > 1]
        memory = [{"title": f"{preset}: {key}", "svg": charts.line_chart(
                       series(runs, preset, ids, "memory"), xlabel="Skv", ylabel="peak memory (MiB)",
                       title=key, logy=True)}
                  for key, ids in groups.items() if len(ids) > 1 and series(runs, preset, ids, "memory")]
        sections.append({
            "preset": preset,
            "leaderboards": [(r.label, board) for r in runs if (board := leaderboard(r, preset))],
            "charts": [c for c in charts_ if c["svg"]],
            "memory": [c for c in memory if c["svg"]],
            "tables": [(r.label, cid, case_table(r, cid, baseline)) for r in runs
                       for cid in r.presets.get(preset, []) if r.by_case.get(cid)],
        })
    return {
        "runs": runs, "baseline": baseline, "sections": sections,
        "matrices": [(r.label, correctness_matrix(r), r.unavailable) for r in runs],
        "ladders": [(r.label, lad) for r in runs if (lad := ladder(r))],
    }


def _format_number(value: float | None, fmt: str | None = None) -> str:
    if value is None:
        return "–"
    if fmt:
        return fmt % value
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def render(runs: list[Run], baseline: str = "sdpa") -> str:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("reports", "templates"),
        autoescape=True,  # every string from the JSON is escaped; only our own SVG is marked safe
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = _format_number
    env.filters["short"] = lambda s, n=160: s if len(s) <= n else s[: n - 1] + "…"
    return env.get_template("report.html.j2").render(**build_context(runs, baseline), esc=html.escape)


def write_report(paths: list[Path], out: Path, baseline: str | None = None) -> Path:
    runs = [load_run(p) for p in paths]
    if not runs:
        raise ReportError("no results files given")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(runs, baseline or runs[0].baseline))
    return out
