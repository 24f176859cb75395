"""A results file of the suite read and checked: pytest-benchmark's JSON with the suite's ``fmha`` block."""

from __future__ import annotations

import gzip
import json
import math
import statistics
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ReportError(ValueError):
    """A results file the report cannot use; the message names the file and the problem."""


TIMING_LEAD = ("graph", "kernel", "eager")  # the mode a run's leaderboards and charts rank by: the first it has
# Rounds whose later half ran this much slower or faster than their first half (a fraction of the median) are
# flagged: the clocks were still moving. H200: a benchmark timed right after a long heavy case read 1.071 ms in
# its first round and 1.112 ms in its fourth (+4%), the same kernel 6% slower than on another case.
DRIFT_FLAG = 0.02


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
        return num(self.energy.get("joules_per_call"))

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
    host: dict[str, Any] = field(default_factory=dict)  # pytest-benchmark's machine_info: the host CPU, the OS
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

    @property
    def on_cpu(self) -> bool:
        """Whether the run timed the CPU (no benchmark names a GPU): its numbers check the pipeline, they do not
        compare kernels."""
        return self.env.get("device") != "cuda" and not any(m.gpu for m in self.measurements)

    @property
    def host_cpu(self) -> str | None:
        """The host's processor as pytest-benchmark's cpuinfo names it, with its core count."""
        cpu = self.host.get("cpu") or {}
        name = cpu.get("brand_raw") or self.env.get("cpu")
        if not name:
            return None
        return f"{name}, {cpu['count']} cores" if cpu.get("count") else str(name)

    @property
    def machine(self) -> str:
        """What ran it, in a word: the GPU's name, or the host CPU's on a CPU run."""
        if self.env.get("gpu"):
            return str(self.env["gpu"])
        name = (self.host.get("cpu") or {}).get("brand_raw")
        return f"CPU: {name}" if name else "CPU"


def _require(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise ReportError(f"{path}: {what}")


def read_json(path: Path) -> Any:
    """The parsed file; refused with what is wrong: unreadable, a truncated or broken gzip, not JSON at all (a
    README given by mistake), or JSON cut short or malformed."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise ReportError(f"{path}: a truncated or damaged gzip file ({exc})") from exc
    where = f" ({path})" if str(path) != path.name else ""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ReportError(f"{path.name} is not a JSON run file: it is binary, not text{where}") from None
    if not text.lstrip().startswith(("{", "[")):
        raise ReportError(f"{path.name} is not a JSON run file: expected the JSON that pytest-benchmark writes "
                          f"with --benchmark-json{where}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if not text[exc.pos:].strip() or exc.msg.startswith("Unterminated string"):  # input ended early
            raise ReportError(f"{path}: not valid JSON (truncated?) at line {exc.lineno} column {exc.colno}: "
                              f"{exc.msg}") from exc
        raise ReportError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc


def _measurement(bench: dict[str, Any]) -> Measurement:
    info, stats = bench["extra_info"], bench["stats"]
    return Measurement(
        impl=str(info["impl"]), family=str(info.get("family", "")), case=str(info["case"]),
        fields={k: info.get(k) for k in ("batch", "hq", "hkv", "sq", "skv", "d", "dtype", "causal", "op",
                                         "page_size", "lengths", "model", "kv_bytes")},
        median_s=float(stats["median"]), iqr_s=float(stats.get("iqr", 0.0)),
        stddev_s=float(stats.get("stddev", 0.0)), rounds=int(stats.get("rounds", 0)),
        tflops=num(info.get("tflops")), pct_of_peak=num(info.get("pct_of_peak")),
        gbps=num(info.get("gbps")), peak_memory_bytes=info.get("peak_memory_bytes"),
        max_error=num(info.get("max_error")), config=dict(info.get("config") or {}),
        timing=str(info.get("timing", "eager")), measured_as=str(info.get("measured_as", "eager")),
        fallback=info.get("fallback"), pct_of_hbm=num(info.get("pct_of_hbm")),
        kernels=dict(info.get("kernels") or {}), gpu=dict(info.get("gpu") or {}),
        settle_s=float(info.get("settle_s") or 0.0), rest_s=float(info.get("rest_s") or 0.0),
        energy=dict(info.get("energy") or {}),
        drift=round_drift(stats.get("data") or []), cold_l2=bool(info.get("cold_l2")),
    )


def load_run(path: Path) -> Run:
    """Read and validate one results file: malformed or truncated input is refused with a clear reason."""
    path = Path(path)
    data = read_json(path)
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
        try:
            measurements.append(_measurement(bench))
        except (KeyError, TypeError, ValueError) as exc:
            raise ReportError(f"{path}: benchmark #{i} ({bench.get('name', '?')}) is missing or has a bad "
                              f"field: {exc}") from exc
    host = data.get("machine_info") if isinstance(data.get("machine_info"), dict) else {}
    run = Run(label="", path=str(path), env=host.get("fmha") or {}, measurements=measurements,
              outcomes=fmha["outcomes"], unavailable=fmha["unavailable"],
              presets=by_training_mode(by_figure_of_merit(fmha["presets"], fmha["cases"]), fmha["cases"]),
              cases=fmha["cases"], host=host)
    run.label = run.machine  # a report of several runs adds each file's name (reports.build.label_runs)
    return run


def round_drift(times: list[float]) -> float | None:
    """How much a benchmark's timed rounds moved while it ran: the median of their later half minus that of their
    first half, over the median of all (positive: slowing down). None below 6 rounds: from 3 rounds a half, one
    odd round does not move its half's median."""
    if len(times) < 6 or not all(isinstance(t, int | float) for t in times):
        return None
    half = len(times) // 2
    middle = statistics.median(times)
    return (statistics.median(times[-half:]) - statistics.median(times[:half])) / middle if middle > 0 else None


def num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def geomean(values: Iterable[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def case_merit(case: dict[str, Any]) -> str:
    """What a case ranks by, as its run recorded it (``suite.cases.Case.merit``): ``gbps`` for decode, which is
    memory-bound, ``tflops`` for the rest. Older files do not say: their paged cases are the decode ones."""
    return case.get("merit") or ("gbps" if case.get("op") in ("paged", "mla") else "tflops")


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


TRAINING_MODES = {"dense": "forward", "backward": "backward", "fwdbwd": "fwd+bwd"}  # op -> its section's suffix


def by_training_mode(presets: dict[str, list[str]], cases: dict[str, dict]) -> dict[str, list[str]]:
    """A preset that holds a backward or a training step (``fwdbwd``) beside another of the three training modes
    becomes one section per mode, "PRESET: forward", "PRESET: backward", "PRESET: fwd+bwd", so that each leaderboard
    and heat map ranks one mode (``reports.training`` sets the three side by side)."""
    split: dict[str, list[str]] = {}
    for preset, ids in presets.items():
        ops = {cid: cases.get(cid, {}).get("op") or "dense" for cid in ids}
        kinds = set(ops.values())
        if len(kinds) < 2 or not kinds <= set(TRAINING_MODES) or kinds == {"dense"}:
            split[preset] = ids
            continue
        for op, mode in TRAINING_MODES.items():
            if part := [cid for cid in ids if ops[cid] == op]:
                split[f"{preset}: {mode}"] = part
    return split
