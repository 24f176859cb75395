"""Turn pytest-benchmark JSON files (with the suite's ``fmha`` block) into one self-contained HTML report."""

from __future__ import annotations

import html
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import jinja2

from reports import charts
from reports.blog import BLOG_LADDER, BLOG_SEQLENS, HOPPER_EVIDENCE, ladder_notes
from reports.cases import case_labels, case_parts, chart_groups
from reports.formatting import (
    config_details,
    config_label,
    env_rows,
    filled_columns,
    kernel_label,
    kernel_name,
    kernel_rows,
    number,
)
from reports.overview import HEAT_LEGEND, OURS, overview
from reports.runs import (
    DRIFT_FLAG,
    Measurement,
    ReportError,
    Run,
    figure_of_merit,
    geomean,
    load_run,
    num,
)
from reports.training import training_modes

__all__ = ["ReportError", "Run", "figure_of_merit", "fleet", "load_run", "render", "write_report"]

NEAR_BEST = 0.10  # the leaderboards count the cases where an implementation is within this of the case's best
# A case table's columns that are shown only where some row fills them (a CPU run has no peak, HBM or energy).
OPTIONAL_COLUMNS = ("host_overhead_ms", "tflops", "pct", "gbps", "pct_hbm", "speedup", "mem_mib", "sm_mhz_timed",
                    "mj_per_call", "config", "kernels")


def leaderboard(run: Run, preset: str) -> list[dict[str, Any]]:
    """Implementations of a preset ranked by the geometric mean of its figure of merit (TFLOPS, or GB/s for
    decode) in the run's lead timing mode, over the cases each was measured on; and against each case's best
    in this run: on how many it is within NEAR_BEST, and its worst case."""
    case_ids = run.presets.get(preset, [])
    metric = figure_of_merit(run.cases.get(cid, {}) for cid in case_ids)
    per_impl: dict[str, list[float]] = defaultdict(list)
    of_best: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for cid in case_ids:
        values = {impl: getattr(m, metric) for impl, m in run.by_case.get(cid, {}).items() if getattr(m, metric)}
        best = max(values.values(), default=None)
        for impl, value in values.items():
            per_impl[impl].append(value)
            of_best[impl].append((value / best, cid))
    rows = [{"impl": impl, "value": geomean(v), "cases": len(v), "of": len(case_ids),
             "near_best": sum(ratio >= 1 - NEAR_BEST for ratio, _ in of_best[impl]),
             "worst": min(of_best[impl])} for impl, v in per_impl.items()]
    return sorted(rows, key=lambda r: -(r["value"] or 0))


def reference(measured: dict[str, Measurement], impl: str, baseline: str | None) -> tuple[str, Measurement] | None:
    """What a row's speedup is against: ``baseline`` where the case measured it, else the fastest other
    implementation of the case (None where it has no other)."""
    if baseline and baseline in measured:
        return baseline, measured[baseline]
    peers = [(name, m) for name, m in measured.items() if name != impl]
    return min(peers, key=lambda nm: nm[1].median_s, default=None)


def case_table(run: Run, case_id: str, baseline: str | None) -> list[dict[str, Any]]:
    """One row per implementation: every timing mode's median, the host overhead (eager - graph), the rates in
    the lead mode, the speedup against ``reference``, and the config and kernels as a label with the whole."""
    rows = []
    by_impl = run.modes.get(case_id, {})
    measured = run.by_case.get(case_id, {})
    lead_s = {impl: modes.get(run.lead, next(iter(modes.values()))).median_s for impl, modes in by_impl.items()}
    for impl in sorted(by_impl, key=lead_s.get):
        modes = by_impl[impl]
        m = modes.get(run.lead) or next(iter(modes.values()))
        eager, graph = modes.get("eager"), modes.get("graph")
        ref = reference(measured, impl, baseline) if m.timing == run.lead else None
        rows.append({
            "impl": impl, "median_ms": m.median_s * 1e3, "iqr_ms": m.iqr_s * 1e3, "rounds": m.rounds,
            "modes": {t: {"ms": x.median_s * 1e3, "iqr_ms": x.iqr_s * 1e3, "fallback": x.fallback,
                          "drift": x.drift if x.drifted else None} for t, x in modes.items()},
            "host_overhead_ms": (eager.median_s - graph.median_s) * 1e3
            if eager and graph and graph.measured_as == "graph" else None,
            "tflops": m.tflops, "pct": m.pct_of_peak, "gbps": m.gbps, "pct_hbm": m.pct_of_hbm,
            "speedup": ref[1].median_s / m.median_s if ref else None,
            "speedup_vs": ref[0] if ref and ref[0] != baseline else None,
            "mem_mib": m.peak_memory_bytes / 2**20 if isinstance(m.peak_memory_bytes, int) else None,
            "mj_per_call": m.joules_per_call * 1e3 if m.joules_per_call is not None else None,
            "watts": num(m.energy.get("avg_power_w")),
            "sm_mhz": num(m.energy.get("sm_clock_mhz")),
            "sm_mhz_timed": num(m.gpu_state.get("sm_clock_mhz")),
            "config": config_label(m.config), "config_full": config_details(m.config),
            "kernels": kernel_label(m.kernels), "kernel_rows": kernel_rows(m.kernels),
        })
    return rows


def cache_twins(run: Run, preset: str) -> list[dict[str, Any]]:
    """Each case of the preset whose KV cache has a dtype of its own (fp8) beside its twin over the case's dtype
    (the same case otherwise: the same lengths and values), where the run measured both: per implementation timed
    on both, the step's time over the twin's, in the lead mode. Halving the bytes alone would give 0.5; GB/s counts
    the bytes a cache holds, so the two rows' GB/s do not compare. Rows: ``case``, ``twin``, ``kv_dtype``,
    ``ratios`` {impl: ratio}."""
    case_ids = run.presets.get(preset, [])
    by_params = {json.dumps(run.cases[cid], sort_keys=True): cid for cid in case_ids if cid in run.cases}
    rows = []
    for cid in case_ids:
        case = run.cases.get(cid, {})
        if not case.get("kv_dtype"):
            continue
        twin = by_params.get(json.dumps({**case, "kv_dtype": ""}, sort_keys=True))
        narrow, wide = run.by_case.get(cid, {}), run.by_case.get(twin or "", {})
        ratios = {impl: m.median_s / wide[impl].median_s for impl, m in narrow.items() if impl in wide}
        if ratios:
            rows.append({"case": cid, "twin": twin, "kv_dtype": case["kv_dtype"], "ratios": ratios})
    return rows


def twin_columns(run: Run, preset: str, rows: list[dict[str, Any]], key: str = "ratios") -> list[str]:
    """The implementations of ``cache_twins`` rows (``step_parts``' with ``key`` "times"), in the preset's
    leaderboard order (its sections' in turn where it was split)."""
    ranked = [b["impl"] for part in preset_family(run, preset) or [preset] for b in leaderboard(run, part)]
    return [impl for impl in dict.fromkeys(ranked) if any(impl in row[key] for row in rows)]


# A mixed step's parts: the fields each resets (the suite's ``suite.cases.MIXED_PARTS``, which a test keeps equal;
# the reports do not import the suite, which needs torch).
MIXED_PARTS = {"decode": {"chunks": 0, "sq": 1}, "prefill": {"batch": 0, "skv": 0, "lengths": "uniform"}}
RECORDED_ONLY = ("merit", "preset")  # fields a run records beside a case's own, which a part's differ in


def _shape(case: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in case.items() if k not in RECORDED_ONLY}, sort_keys=True)


def preset_family(run: Run, preset: str) -> list[str]:
    """The sections a preset was split into (``by_figure_of_merit``: "PRESET: decode", "PRESET: prefill"), when
    ``preset`` is the first of them; the preset alone where it was not split; else none (a table over the whole
    preset shows once, in its first section)."""
    base = preset.rpartition(": ")[0] or preset
    family = [p for p in run.presets if p == base or p.startswith(f"{base}: ")]
    return family if family and family[0] == preset else []


def step_parts(run: Run, preset: str) -> list[dict[str, Any]]:
    """Each mixed step of the preset (over every section it was split into) whose decode part and prefill part
    (``MIXED_PARTS``) the run measured too: per implementation timed on all three, in the lead mode, the step's
    milliseconds, the parts' and the step's time over the parts' sum (at most 1: the one launch costs no more than
    two). Rows: ``case``, ``decode``, ``prefill`` (case ids), ``times`` {impl: {step_ms, decode_ms, prefill_ms,
    ratio}}."""
    case_ids = [cid for part in preset_family(run, preset) for cid in run.presets[part]]
    by_shape = {_shape(run.cases[cid]): cid for cid in case_ids if cid in run.cases}
    rows = []
    for cid in case_ids:
        case = run.cases.get(cid, {})
        if case.get("op") != "mixed" or not (case.get("batch") and case.get("chunks")):
            continue
        ids = {part: by_shape.get(_shape({**case, **fields})) for part, fields in MIXED_PARTS.items()}
        step, decode, prefill = (run.by_case.get(i or "", {}) for i in (cid, ids["decode"], ids["prefill"]))
        times = {impl: {"step_ms": m.median_s * 1e3, "decode_ms": decode[impl].median_s * 1e3,
                        "prefill_ms": prefill[impl].median_s * 1e3,
                        "ratio": m.median_s / (decode[impl].median_s + prefill[impl].median_s)}
                 for impl, m in step.items() if impl in decode and impl in prefill}
        if times:
            rows.append({"case": cid, **ids, "times": times})
    return rows


def correctness_matrix(run: Run) -> dict[str, Any]:
    """(impl, check) -> the last recorded outcome; a check is a case, or a case and a property
    (non-finite inputs), in the order the run produced them. A benchmark's own check counts too."""
    cells: dict[tuple[str, str], dict] = {}
    rows: dict[str, None] = {}
    for o in run.outcomes:
        row = str(o.get("case")) + (f" · {o['property']}" if o.get("property") else "")
        if o.get("timing") not in (None, "eager") and o.get("status") != "passed":
            row += f" · {o['timing']} timing"  # a mode that could not run is not the case's verdict
        rows[row] = None
        cells[(str(o.get("impl")), row)] = {**o, "css": str(o.get("status", "")).replace(" ", "-")}
    return {"impls": sorted({i for i, _ in cells}), "cases": list(rows), "cells": cells}


def values(runs: list[Run], case_ids: list[str], value: str) -> dict[str, dict[str, float]]:
    """label -> case -> the value (a figure of merit, or "memory": peak MiB) of each implementation on each case
    it was measured on; with several runs, the label names the run."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    holders = [run for run in runs if any(cid in run.by_case for cid in case_ids)]
    for run in holders:
        for cid in case_ids:
            for impl, m in run.by_case.get(cid, {}).items():
                y = (m.peak_memory_bytes or 0) / 2**20 if value == "memory" else getattr(m, value)
                if y:
                    out[impl if len(holders) == 1 else f"{impl} @ {run.label}"][cid] = y
    return dict(out)


def series(runs: list[Run], case_ids: list[str], value: str) -> dict[str, list[tuple[int, float]]]:
    """``values`` as points (sequence or cache length, value) for a line chart."""
    skv = {cid: r.cases[cid].get("skv") for r in runs for cid in case_ids if cid in r.cases}
    return {label: sorted((skv[cid], y) for cid, y in by_case.items())
            for label, by_case in values(runs, case_ids, value).items()}


def _x_lengths(runs: list[Run], ids: list[str]) -> set[Any]:
    return {r.cases[cid].get("skv") for r in runs for cid in ids if cid in r.cases}


def _chunks(ids: list[str], per_case: int, bars: int = 60) -> list[list[str]]:
    """Cases in charts of at most about ``bars`` bars each."""
    size = max(1, bars // max(1, per_case))
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def section_charts(runs: list[Run], preset: str, metric: str, style, ceilings) -> dict[str, list[dict]]:
    """The preset's charts: a line chart for each group of cases alike but for a length that spans
    ``charts.LINE_POINTS`` lengths or more, grouped bars for a group of fewer, and the cases of one length each
    as grouped bars by case. Each chart: its ``svg``, its ``kind`` and the ``points`` along its axis."""
    unit = "GB/s" if metric == "gbps" else "TFLOPS"
    xlabel = "Skv (longest cache)" if metric == "gbps" else "Skv"
    cases = {cid: r.cases.get(cid, {}) for r in runs for cid in r.presets.get(preset, [])}
    out: dict[str, list[dict]] = {"lengths": [], "by_case": [], "memory": []}
    single = []
    for key, ids in chart_groups(runs, preset).items():
        points = len(_x_lengths(runs, ids))
        if points >= charts.LINE_POINTS:
            out["lengths"].append({"kind": "line", "points": points, "svg": charts.line_chart(
                series(runs, ids, metric), xlabel=xlabel, ylabel=unit, title=key, style=style, hlines=ceilings)})
            out["memory"].append({"kind": "line", "points": points, "svg": charts.line_chart(
                series(runs, ids, "memory"), xlabel="Skv", ylabel="peak memory (MiB)", title=key, style=style)})
        elif points > 1:
            names = {cid: case_parts(cases[cid])[2] for cid in ids}
            out["lengths"].append({"kind": "bars", "points": points, "svg": charts.bar_chart(
                ids, values(runs, ids, metric), xlabel=unit, title=key, style=style, vlines=ceilings, names=names)})
        else:
            single += ids
    if single:
        names, shared = case_labels({cid: cases[cid] for cid in single})
        per_case = max(1, len(values(runs, single, metric)))
        for part in _chunks(single, per_case):
            out["by_case"].append({"kind": "bars", "points": 1, "svg": charts.bar_chart(
                part, values(runs, part, metric), xlabel=unit, title=", ".join([preset, *shared]), style=style,
                vlines=ceilings, names=names)})
    return {key: [c for c in made if c["svg"]] for key, made in out.items()}


def ladder(run: Run) -> dict[str, Any] | None:
    steps = list(BLOG_LADDER)
    case_ids = run.presets.get("ladder") or run.presets.get("blog") or []
    by_seq = {run.cases[c]["sq"]: c for c in case_ids if c in run.cases}
    if not any(s in run.by_case.get(by_seq.get(seq, ""), {}) for s in steps if s != "cutile" for seq in by_seq):
        return None  # the autotuned kernel alone is no ladder
    here = {s: {seq: getattr(run.by_case.get(by_seq.get(seq, ""), {}).get(s), "tflops", None)
                for seq in BLOG_SEQLENS} for s in steps}
    hopper = str(run.env.get("compute_capability", "")).startswith("9.")
    return {"steps": steps, "seqlens": BLOG_SEQLENS, "here": here, "blog": BLOG_LADDER,
            "notes": ladder_notes(here), "evidence": HOPPER_EVIDENCE if hopper else []}


FLEET_TOLERANCE = 0.03  # a GPU whose benchmarks run this much slower or faster than the pack's is flagged


def fleet(run: Run) -> dict[str, Any] | None:
    """The same benchmarks on several GPUs (``--dist each``): spread per benchmark, and each GPU against the pack.

    A GPU's ratio is the geometric mean, over the benchmarks it ran, of its median time over the median of all
    GPUs' medians; outside 1 +- FLEET_TOLERANCE it is flagged. NVML's readings (clocks, temperature, power,
    throttle reasons) recorded with its benchmarks stand beside it.
    """
    groups: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    states: dict[str, list[dict]] = defaultdict(list)
    for m in run.measurements:
        if m.gpu_label:
            groups[(m.impl, m.case, m.timing)][m.gpu_label] = m.median_s
            states[m.gpu_label].append(m.gpu_state)
    shared = {key: per_gpu for key, per_gpu in groups.items() if len(per_gpu) >= 2}
    if not shared:
        return None
    spreads, ratios = [], defaultdict(list)
    for (impl, case, timing), per_gpu in shared.items():
        times = list(per_gpu.values())
        center = statistics.median(times)
        spreads.append({"impl": impl, "case": case, "timing": timing, "gpus": len(times),
                        "spread": max(times) / min(times), "cv": statistics.pstdev(times) / statistics.fmean(times)})
        for gpu, t in per_gpu.items():
            ratios[gpu].append(t / center)
    gpus = []
    for gpu, gpu_ratios in sorted(ratios.items()):
        ratio = geomean(gpu_ratios) or 1.0
        readings = [s for s in states[gpu] if s and "unavailable" not in s]
        gpus.append({"gpu": gpu, "ratio": ratio, "benchmarks": len(gpu_ratios),
                     "flagged": abs(ratio - 1) > FLEET_TOLERANCE,
                     "max_temperature_c": max((s["temperature_c"] for s in readings), default=None),
                     "min_sm_clock_mhz": min((s["sm_clock_mhz"] for s in readings), default=None),
                     "power_limit_w": max((s["power_limit_w"] for s in readings), default=None),
                     "throttle": sorted({r for s in readings for r in s.get("throttle", [])})})
    spreads.sort(key=lambda r: -r["spread"])
    return {"gpus": gpus, "spreads": spreads, "tolerance": FLEET_TOLERANCE}


def rooflines(runs: list[Run], preset: str) -> list[tuple[float, str]]:
    """The HBM bandwidth line (GB/s, its datasheet peak) of each GPU whose runs measured the preset's decode."""
    lines: dict[tuple[str, int], tuple[float, str]] = {}
    for run in runs:
        cases = set(run.presets.get(preset, []))
        for m in run.measurements:
            if m.case in cases and m.pct_of_hbm and m.gbps:
                peak, gpu = m.gbps / m.pct_of_hbm * 100, str(run.env.get("gpu") or "this GPU")
                lines.setdefault((gpu, round(peak)), (peak, f"HBM peak {peak / 1000:.2f} TB/s ({gpu}, datasheet)"))
                break
    return list(lines.values())


def label_runs(runs: list[Run]) -> None:
    """Several runs in one report: each is named by its machine and its file."""
    if len(runs) > 1:
        for run in runs:
            run.label = f"{run.machine} ({Path(run.path).name.split('.')[0]})"


def section(runs: list[Run], preset: str, baseline: str | None, style) -> dict[str, Any]:
    metric = figure_of_merit(r.cases.get(cid, {}) for r in runs for cid in r.presets.get(preset, []))
    ceilings = rooflines(runs, preset) if metric == "gbps" else []
    tables = []
    for r in runs:
        for cid in r.presets.get(preset, []):
            if r.modes.get(cid):
                rows = case_table(r, cid, baseline)
                tables.append((r.label, r, cid, rows, filled_columns(rows, OPTIONAL_COLUMNS)))
    return {
        "preset": preset,
        "metric": "GB/s" if metric == "gbps" else "TFLOPS",
        "roofline": "; ".join(label for _, label in ceilings) or None,
        "leaderboards": [(r.label, r, board) for r in runs if (board := leaderboard(r, preset))],
        "training": [(r.label, r.lead, table) for r in runs if (table := training_modes(r, preset))],
        "twins": [(r.label, r.lead, rows, twin_columns(r, preset, rows)) for r in runs
                  if (rows := cache_twins(r, preset))],
        "step_parts": [(r.label, r.lead, rows, twin_columns(r, preset, rows, "times")) for r in runs
                       if (rows := step_parts(r, preset))],
        **section_charts(runs, preset, metric, style, ceilings),
        "tables": tables,
        "shown": {col for *_, cols in tables for col in cols},  # what the notes under the tables explain
        "fallback": any(mode["fallback"] for *_, rows, _ in tables for r in rows for mode in r["modes"].values()),
        "lead_note": " / ".join(dict.fromkeys(r.lead for r in runs)) or "eager",
    }


def build_context(runs: list[Run], baseline: str | None) -> dict[str, Any]:
    label_runs(runs)
    # Presets with measurements (a correctness-only run, or the property checks, have none to chart).
    presets = [p for p in dict.fromkeys(p for r in runs for p in r.presets)
               if any(cid in r.by_case for r in runs for cid in r.presets.get(p, []))]
    style = charts.styles({m.impl for r in runs for m in r.measurements}, (r.label for r in runs))
    measured = [m for r in runs for m in r.measurements]
    return {
        "runs": runs, "baseline": baseline, "ours": OURS, "heat_legend": HEAT_LEGEND,
        "cpu": [r.label for r in runs if r.on_cpu],
        "overview": overview(runs, presets),
        "sections": [section(runs, preset, baseline, style) for preset in presets],
        "env": env_rows(runs),
        "settled_ms": sorted({round(1e3 * m.settle_s) for m in measured if m.settle_s}),
        "unsettled": any(m.gpu and not m.settle_s for m in measured),
        "rested_ms": sorted({round(1e3 * m.rest_s) for m in measured if m.rest_s}),
        "rested": (sum(bool(m.rest_s) for m in measured), len(measured)),  # (after a pause, of all)
        "cold": (sum(m.cold_l2 for m in measured), sum(bool(m.gpu) for m in measured)),  # (L2-cold, of GPU ones)
        "matrices": [(r.label, correctness_matrix(r), r.unavailable) for r in runs],
        "ladders": [(r.label, lad) for r in runs if (lad := ladder(r))],
        "fleets": [(r.label, f) for r in runs if (f := fleet(r))],
        "near_best": NEAR_BEST,
        "drifted": sorted(((r.label, m) for r in runs for m in r.measurements if m.drifted),
                          key=lambda lm: -abs(lm[1].drift)),
        "drift_flag": DRIFT_FLAG,
    }


def render(runs: list[Run], baseline: str | None = None) -> str:
    """The report of ``runs``; speedups against ``baseline`` where a case measured it, else the case's best
    other implementation."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("reports", "templates"),
        autoescape=True,  # every string from the JSON is escaped; only our own SVG is marked safe
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = number
    env.filters["kernel"] = kernel_name
    env.filters["short"] = lambda s, n=160: s if len(s) <= n else s[: n - 1] + "…"
    return env.get_template("report.html.j2").render(**build_context(runs, baseline), esc=html.escape)


def write_report(paths: list[Path], out: Path, baseline: str | None = None) -> Path:
    return write_runs([load_run(p) for p in paths], out, baseline)


def write_runs(runs: list[Run], out: Path, baseline: str | None = None) -> Path:
    if not runs:
        raise ReportError("no results files given")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(runs, baseline))
    return out
