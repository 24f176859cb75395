"""Turn pytest-benchmark JSON files (with the suite's ``fmha`` block) into one self-contained HTML report."""

from __future__ import annotations

import gzip
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


TIMING_LEAD = ("graph", "kernel", "eager")  # the mode a run's leaderboards and charts rank by: the first it has
# Rounds whose later half ran this much slower or faster than their first half (a fraction of the median) are
# flagged: the clocks were still moving. H200, session 20: a benchmark timed right after a long heavy case read
# 1.071 ms in its first round and 1.112 ms in its fourth (+4%), the same kernel 6% slower than on another case.
DRIFT_FLAG = 0.02
NEAR_BEST = 0.10  # the leaderboards count the cases where an implementation is within this of the case's best


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
    timing: str = "eager"
    measured_as: str = "eager"
    fallback: str | None = None
    pct_of_hbm: float | None = None
    kernels: dict[str, dict] = field(default_factory=dict)
    gpu: dict[str, Any] = field(default_factory=dict)  # name, uuid, NVML state after the benchmark
    settle_s: float = 0.0  # seconds of back-to-back calls before the warm-up (--settle-ms)
    rest_s: float = 0.0  # seconds the GPU was left idle before the settling (--rest-ms)
    energy: dict[str, Any] = field(default_factory=dict)  # NVML, with --energy-ms: joules per call, watts
    drift: float | None = None  # round_drift of the timed rounds
    cold_l2: bool = False  # timed with the inputs evicted from the L2 (--cold-l2, where the rotation evicts)

    @property
    def drifted(self) -> bool:
        return self.drift is not None and abs(self.drift) > DRIFT_FLAG

    @property
    def gpu_state(self) -> dict[str, Any]:
        """NVML's reading as the timing ended (clocks, power, throttling); empty where none was taken."""
        return self.gpu.get("state") or {}

    @property
    def joules_per_call(self) -> float | None:
        return _num(self.energy.get("joules_per_call"))

    @property
    def gpu_label(self) -> str:
        uuid = str(self.gpu.get("uuid") or "").removeprefix("GPU-")
        return f"{self.gpu.get('name', 'GPU')} {uuid[:8]}" if uuid else ""

    @property
    def op(self) -> str:
        return str(self.fields.get("op") or "dense")

    def ties(self, other: Measurement) -> bool:
        """Whether one run cannot order the two: their medians are closer than the wider of their interquartile
        ranges (the rounds' own spread; one instance of a GPU against another moves a case more, 1-3%)."""
        return abs(self.median_s - other.median_s) <= max(self.iqr_s, other.iqr_s)


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
    modes: dict[str, dict[str, dict[str, Measurement]]] = field(default_factory=dict)  # case -> impl -> timing
    by_case: dict[str, dict[str, Measurement]] = field(default_factory=dict)  # case -> impl -> in the lead mode
    lead: str = "eager"

    def __post_init__(self) -> None:
        for m in self.measurements:
            self.modes.setdefault(m.case, {}).setdefault(m.impl, {})[m.timing] = m
        present = {m.timing for m in self.measurements}
        self.lead = next((t for t in TIMING_LEAD if t in present), "eager")
        for cid, per_impl in self.modes.items():
            for impl, by_mode in per_impl.items():
                if self.lead in by_mode:
                    self.by_case.setdefault(cid, {})[impl] = by_mode[self.lead]

    @property
    def timings(self) -> list[str]:
        present = {m.timing for m in self.measurements}
        return [t for t in ("eager", "graph", "kernel") if t in present]


def _require(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise ReportError(f"{path}: {what}")


def load_run(path: Path) -> Run:
    """Read and validate one results file: malformed or truncated input is refused with a clear reason."""
    path = Path(path)
    try:
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
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
                fields={k: info.get(k) for k in ("batch", "hq", "hkv", "sq", "skv", "d", "dtype", "causal", "op",
                                                 "page_size", "lengths", "model", "kv_bytes")},
                median_s=float(stats["median"]), iqr_s=float(stats.get("iqr", 0.0)),
                stddev_s=float(stats.get("stddev", 0.0)), rounds=int(stats.get("rounds", 0)),
                tflops=_num(info.get("tflops")), pct_of_peak=_num(info.get("pct_of_peak")),
                gbps=_num(info.get("gbps")), peak_memory_bytes=info.get("peak_memory_bytes"),
                max_error=_num(info.get("max_error")), config=dict(info.get("config") or {}),
                timing=str(info.get("timing", "eager")), measured_as=str(info.get("measured_as", "eager")),
                fallback=info.get("fallback"), pct_of_hbm=_num(info.get("pct_of_hbm")),
                kernels=dict(info.get("kernels") or {}), gpu=dict(info.get("gpu") or {}),
                settle_s=float(info.get("settle_s") or 0.0), rest_s=float(info.get("rest_s") or 0.0),
                energy=dict(info.get("energy") or {}),
                drift=round_drift(stats.get("data") or []), cold_l2=bool(info.get("cold_l2")),
            ))
        except (KeyError, TypeError, ValueError) as exc:
            raise ReportError(f"{path}: benchmark #{i} ({bench.get('name', '?')}) is missing or has a bad "
                              f"field: {exc}") from exc
    env = (data.get("machine_info") or {}).get("fmha") or {}
    label = f"{env.get('gpu') or env.get('cpu') or env.get('device', 'run')} ({path.name.split('.')[0]})"
    return Run(label=label, path=str(path), env=env, measurements=measurements, outcomes=fmha["outcomes"],
               unavailable=fmha["unavailable"], presets=by_figure_of_merit(fmha["presets"], fmha["cases"]),
               cases=fmha["cases"],
               baseline=str(fmha.get("baseline") or "sdpa"))


def round_drift(times: list[float]) -> float | None:
    """How much a benchmark's timed rounds moved while it ran: the median of their later half minus that of their
    first half, over the median of all (positive: slowing down). None below 6 rounds: from 3 rounds a half, one
    odd round does not move its half's median."""
    if len(times) < 6 or not all(isinstance(t, int | float) for t in times):
        return None
    half = len(times) // 2
    middle = statistics.median(times)
    return (statistics.median(times[-half:]) - statistics.median(times[:half])) / middle if middle > 0 else None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _geomean(values: Iterable[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def case_merit(case: dict[str, Any]) -> str:
    """What a case ranks by, as its run recorded it (``suite.cases.Case.merit``): ``gbps`` for decode, which is
    memory-bound, ``tflops`` for the rest. Files written before session 61 do not say: their paged cases are the
    decode ones."""
    return case.get("merit") or ("gbps" if case.get("op") == "paged" else "tflops")


def figure_of_merit(cases: Iterable[dict[str, Any]]) -> str:
    """GB/s where every case is decode, TFLOPS otherwise."""
    return "gbps" if {case_merit(c) for c in cases} == {"gbps"} else "tflops"


def by_figure_of_merit(presets: dict[str, list[str]], cases: dict[str, dict]) -> dict[str, list[str]]:
    """A preset whose cases rank by different figures of merit (decode by GB/s, prefill by TFLOPS: the
    ``models-serving`` preset has both) becomes two sections, "PRESET: decode" and "PRESET: prefill", so that
    no leaderboard averages GB/s with TFLOPS."""
    split: dict[str, list[str]] = {}
    for preset, ids in presets.items():
        kinds = {cid: figure_of_merit([cases.get(cid, {})]) for cid in ids}
        if len(set(kinds.values())) < 2:
            split[preset] = ids
            continue
        for metric, part in (("gbps", "decode"), ("tflops", "prefill")):
            split[f"{preset}: {part}"] = [cid for cid in ids if kinds[cid] == metric]
    return split


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
    rows = [{"impl": impl, "value": _geomean(v), "cases": len(v), "of": len(case_ids),
             "near_best": sum(ratio >= 1 - NEAR_BEST for ratio, _ in of_best[impl]),
             "worst": min(of_best[impl])} for impl, v in per_impl.items()]
    return sorted(rows, key=lambda r: -(r["value"] or 0))


def case_table(run: Run, case_id: str, baseline: str) -> list[dict[str, Any]]:
    """One row per implementation: every timing mode's median, the host overhead (eager - graph), and the
    rates in the lead mode."""
    rows = []
    base = run.by_case.get(case_id, {}).get(baseline)
    by_impl = run.modes.get(case_id, {})
    lead_s = {impl: modes.get(run.lead, next(iter(modes.values()))).median_s for impl, modes in by_impl.items()}
    for impl in sorted(by_impl, key=lead_s.get):
        modes = by_impl[impl]
        m = modes.get(run.lead) or next(iter(modes.values()))
        eager, graph = modes.get("eager"), modes.get("graph")
        rows.append({
            "impl": impl, "median_ms": m.median_s * 1e3, "iqr_ms": m.iqr_s * 1e3, "rounds": m.rounds,
            "modes": {t: {"ms": x.median_s * 1e3, "iqr_ms": x.iqr_s * 1e3, "fallback": x.fallback,
                          "drift": x.drift if x.drifted else None} for t, x in modes.items()},
            "host_overhead_ms": (eager.median_s - graph.median_s) * 1e3
            if eager and graph and graph.measured_as == "graph" else None,
            "tflops": m.tflops, "pct": m.pct_of_peak, "gbps": m.gbps, "pct_hbm": m.pct_of_hbm,
            "speedup": base.median_s / m.median_s if base and m.timing == run.lead else None,
            "mem_mib": m.peak_memory_bytes / 2**20 if isinstance(m.peak_memory_bytes, int) else None,
            "mj_per_call": m.joules_per_call * 1e3 if m.joules_per_call is not None else None,
            "watts": _num(m.energy.get("avg_power_w")),
            "sm_mhz": _num(m.energy.get("sm_clock_mhz")),
            "sm_mhz_timed": _num(m.gpu_state.get("sm_clock_mhz")),
            "config": config_summary(m.config),
            "kernels": kernel_summary(m.kernels),
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


def twin_columns(run: Run, preset: str, rows: list[dict[str, Any]]) -> list[str]:
    """The implementations of ``cache_twins`` rows, in the preset's leaderboard order."""
    return [b["impl"] for b in leaderboard(run, preset) if any(b["impl"] in row["ratios"] for row in rows)]


def config_summary(config: dict[str, Any]) -> str:
    """A benchmark's config as ``key=value`` pairs; a tuner's finalists (``impls.tuning.EVIDENCE``: a list of
    each variant's times) as each one's settled time per call, the search's in brackets, fastest first."""
    def shown(value: Any) -> str:
        if isinstance(value, list) and value and all(isinstance(f, dict) and "variant" in f for f in value):
            return "; ".join(f"{f['variant']} {f.get('settled_us')} us ({f.get('search_us')})" for f in value)
        return str(value)
    return ", ".join(f"{key}={shown(value)}" for key, value in config.items())


def kernel_summary(kernels: dict[str, dict], top: int = 3) -> str:
    """The kernels one call ran, the longest first: ``name x launches (share of device time)``."""
    total = sum(float(k.get("seconds", 0)) for k in kernels.values()) or 1.0
    ranked = sorted(kernels.items(), key=lambda kv: -float(kv[1].get("seconds", 0)))
    parts = [f"{name[:70]} x{k.get('launches', 0):g} ({100 * float(k.get('seconds', 0)) / total:.0f}%)"
             for name, k in ranked[:top]]
    return "; ".join(parts) + (f"; +{len(ranked) - top} more" if len(ranked) > top else "")


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


def length(n: int) -> str:
    """A token count the way people say it: 32768 -> 32K, 3000 -> 3000."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def case_parts(case: dict[str, Any], *, with_length: bool = True, with_batch: bool = True) -> list[str]:
    """What tells a case apart, in reading order: model, operation, shape, mask, heads, head dim, dtype, variants
    (an fp8 KV cache's last);
    empty strings where a case has no such part. Without ``with_length`` the shape loses its sequence (cache,
    token) length and keeps the batch as ``B=4`` (unless ``with_batch`` is off too): what the cases of one line
    chart share. Markdown tables label their rows with these parts; charts are grouped and titled by them."""
    op, sq, skv, batch = case.get("op") or "dense", case.get("sq", 0), case.get("skv", 0), case.get("batch", 1)
    mask = "causal" if case.get("causal") else "non-causal"
    spread = f"{case.get('lengths')} lengths"
    if op == "paged":
        sized = f"{batch} x {length(skv)}"
        shape = [spread, f"pages of {case.get('page_size')}", f"{sq} new token" + ("s" if sq > 1 else "")]
    elif op == "varlen":
        sized, shape = f"{length(sq)} tokens in {batch}", [spread, mask]
    else:  # a chart's x is the key length: a query length of its own stays in the chart's key
        sized = f"{batch} x {length(sq)}" + (f" x {length(skv)}" if sq != skv else "")
        shape = [mask] if with_length or sq == skv else [f"Sq {sq}", mask]
    if not with_length:
        sized = f"B={batch}" if with_batch else ""
    window, softcap, dv = tuple(case.get("window") or (-1, -1)), case.get("softcap"), case.get("dv")
    return [case.get("model") or "", op, sized, *shape, f"h{case.get('hq')}:{case.get('hkv')}",
            f"D {case.get('d')}" + (f"/{dv}" if dv else ""), str(case.get("dtype")),
            f"window {window[0]}:{window[1]}" if window != (-1, -1) else "", f"softcap {softcap:g}" if softcap else "",
            f"{case['kv_dtype']} KV cache" if case.get("kv_dtype") else ""]


def chart_key(case: dict[str, Any], with_batch: bool = True) -> str:
    """What a case is, less its sequence (or cache) length: the cases of one line chart differ only there."""
    return ", ".join(p for p in case_parts(case, with_length=False, with_batch=with_batch) if p)


def chart_groups(runs: list[Run], preset: str) -> dict[str, list[str]]:
    """The preset's cases (of every run) that a line chart of one x axis, the sequence length, can show: those
    alike but for it, batch included, or whose batch shrinks as the length grows (the fa3 preset keeps B x S
    fixed). A group of one length makes no line: the report shows those by case."""
    cases = {cid: r.cases.get(cid, {}) for r in runs for cid in r.presets.get(preset, [])}
    loose: dict[str, list[str]] = defaultdict(list)
    for cid, c in cases.items():
        loose[chart_key(c, with_batch=False)].append(cid)
    groups: dict[str, list[str]] = {}
    for key, ids in loose.items():
        lengths = {cases[cid].get("skv") for cid in ids}
        tokens = {cases[cid].get("batch") * cases[cid].get("skv") for cid in ids}
        if len(lengths) == len(ids) > 1 and len(tokens) == 1:
            groups[f"{key}, B x Skv = {tokens.pop()}"] = ids
        else:
            for cid in ids:
                groups.setdefault(chart_key(cases[cid]), []).append(cid)
    return groups


def _x_lengths(runs: list[Run], ids: list[str]) -> set[Any]:
    return {r.cases[cid].get("skv") for r in runs for cid in ids if cid in r.cases}


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
    for gpu, values in sorted(ratios.items()):
        ratio = _geomean(values) or 1.0
        readings = [s for s in states[gpu] if s and "unavailable" not in s]
        gpus.append({"gpu": gpu, "ratio": ratio, "benchmarks": len(values),
                     "flagged": abs(ratio - 1) > FLEET_TOLERANCE,
                     "max_temperature_c": max((s["temperature_c"] for s in readings), default=None),
                     "min_sm_clock_mhz": min((s["sm_clock_mhz"] for s in readings), default=None),
                     "power_limit_w": max((s["power_limit_w"] for s in readings), default=None),
                     "throttle": sorted({r for s in readings for r in s.get("throttle", [])})})
    spreads.sort(key=lambda r: -r["spread"])
    return {"gpus": gpus, "spreads": spreads, "tolerance": FLEET_TOLERANCE}


def build_context(runs: list[Run], baseline: str) -> dict[str, Any]:
    # Presets with measurements (a correctness-only run, or the property checks, have none to chart).
    presets = [p for p in dict.fromkeys(p for r in runs for p in r.presets)
               if any(cid in r.by_case for r in runs for cid in r.presets.get(p, []))]
    sections = []
    for preset in presets:
        metric = figure_of_merit(r.cases.get(cid, {}) for r in runs for cid in r.presets.get(preset, []))
        ceilings = rooflines(runs, preset) if metric == "gbps" else []
        unit = "GB/s" if metric == "gbps" else "TFLOPS"
        groups = chart_groups(runs, preset)
        lines = {key: ids for key, ids in groups.items() if len(_x_lengths(runs, ids)) > 1}
        charts_ = [charts.line_chart(series(runs, ids, metric), xlabel="Skv (longest cache)" if metric == "gbps"
                                     else "Skv", ylabel=unit, title=key, hlines=ceilings)
                   for key, ids in lines.items()]
        memory = [charts.line_chart(series(runs, ids, "memory"), xlabel="Skv", ylabel="peak memory (MiB)",
                                    title=key, logy=True) for key, ids in lines.items()]
        single = [cid for key, ids in groups.items() if key not in lines for cid in ids]
        sections.append({
            "preset": preset,
            "metric": unit,
            "roofline": "; ".join(label for _, label in ceilings) or None,
            "leaderboards": [(r.label, r.lead, board) for r in runs if (board := leaderboard(r, preset))],
            "twins": [(r.label, r.lead, rows, twin_columns(r, preset, rows)) for r in runs
                      if (rows := cache_twins(r, preset))],
            "charts": [svg for svg in charts_ if svg],
            "by_case": charts.dot_chart(single, values(runs, single, metric), xlabel=unit,
                                        title=f"{preset}: cases of one length each", vlines=ceilings),
            "memory": [svg for svg in memory if svg],
            "tables": [(r.label, r, cid, case_table(r, cid, baseline)) for r in runs
                       for cid in r.presets.get(preset, []) if r.modes.get(cid)],
            "lead_note": " / ".join(dict.fromkeys(r.lead for r in runs)) or "eager",
        })
    return {
        "runs": runs, "baseline": baseline, "sections": sections,
        "settled_ms": sorted({round(1e3 * m.settle_s) for r in runs for m in r.measurements if m.settle_s}),
        "unsettled": any(m.gpu and not m.settle_s for r in runs for m in r.measurements),
        "rested_ms": sorted({round(1e3 * m.rest_s) for r in runs for m in r.measurements if m.rest_s}),
        "rested": (sum(bool(m.rest_s) for r in runs for m in r.measurements),
                   sum(len(r.measurements) for r in runs)),  # (after a pause, of all)
        "cold": (sum(m.cold_l2 for r in runs for m in r.measurements),
                 sum(bool(m.gpu) for r in runs for m in r.measurements)),  # (timed L2-cold, of those on a GPU)
        "matrices": [(r.label, correctness_matrix(r), r.unavailable) for r in runs],
        "ladders": [(r.label, lad) for r in runs if (lad := ladder(r))],
        "fleets": [(r.label, f) for r in runs if (f := fleet(r))],
        "near_best": NEAR_BEST,
        "drifted": sorted(((r.label, m) for r in runs for m in r.measurements if m.drifted),
                          key=lambda lm: -abs(lm[1].drift)),
        "drift_flag": DRIFT_FLAG,
    }


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
