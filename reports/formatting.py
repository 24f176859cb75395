"""How the report writes what a run recorded: numbers to three significant digits, a config or a kernel list as a
short label with the whole underneath, the columns a table keeps, and the environment's rows."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from reports.runs import Run

DASH = "–"  # a cell with nothing measured


def sig3(value: float | None, *, zeros: bool = False) -> str:
    """Three significant digits: 361, 12.3, 0.0241, 2.72e-4 (a number below 0.001 in e-notation); hundreds and
    up keep every digit of their whole part (1433). ``zeros`` keeps trailing zeros (1.00, 0.500)."""
    if value is None:
        return DASH
    if value == 0:
        return "0"
    size = abs(value)
    if size >= 99.95:
        return f"{value:.0f}"
    if size < 1e-3:
        mantissa, exponent = f"{value:.2e}".split("e")
        if not zeros:
            mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exponent)}"
    text = f"{value:#.3g}"
    return text.rstrip(".") if zeros else text.rstrip("0").rstrip(".")


def number(value: float | None, fmt: str | None = None) -> str:
    """The template's ``num`` filter: ``sig3`` with its trailing zeros, or ``fmt % value`` where a cell asks for
    a format of its own."""
    if value is None:
        return DASH
    return fmt % value if fmt else sig3(value, zeros=True)


def filled_columns(rows: Sequence[dict[str, Any]], keys: Iterable[str]) -> list[str]:
    """The keys that at least one row fills (not None, not an empty string or collection): a column that no row
    fills is left out of its table."""
    return [key for key in keys if any(row.get(key) not in (None, "", [], {}) for row in rows)]


# How a config was chosen, from its "chosen" field (impls/tuning.py): tuned on the run's machine (now or earlier, in
# its tuning cache), a pick shipped for the GPU, a heuristic (the nearest shipped class, or the kernel's fixed config),
# or fixed by design (the interpreter's config, the ladder's steps).
CHOSEN = {"tuning cache": "tuned here", "autotuned": "tuned here", "fixed (GPU shared: not tuned)": "heuristic",
          "fixed (interpreter)": "fixed"}
EVIDENCE = "finalists"  # impls.tuning.EVIDENCE: the settled tuner's finalists and their times


def chosen(config: dict[str, Any]) -> str:
    source = config.get("chosen")
    if source is None:
        return "fixed" if {"tile_m", "tile_n", "BLOCK_M", "BLOCK_N"} & set(config) else ""
    source = str(source)
    return CHOSEN.get(source) or next((word for word in ("shipped", "heuristic") if source.startswith(word)), source)


def _tile(config: dict[str, Any]) -> str:
    rows, cols = config.get("tile_m", config.get("BLOCK_M")), config.get("tile_n", config.get("BLOCK_N"))
    if rows and cols:
        return f"{rows}×{cols}"
    if cols:
        return f"tile {cols}"
    block = config.get("block_size")
    return f"block {block[0]}×{block[1]}" if isinstance(block, list) and len(block) == 2 else ""


def _split(config: dict[str, Any]) -> str:
    splits = config.get("num_splits")
    if splits is None:
        return ""
    if splits == 0:
        return "split auto"
    if splits == 1:
        return "no split"
    return f"split {splits}×{config['split_len']}" if config.get("split_len") else f"split {splits}"


def _route(config: dict[str, Any]) -> str:
    route = str(config.get("route") or "")
    if route.startswith("split-KV decode"):
        return "via split-KV decode"
    return "via dense kernel" if route.startswith("dense kernel") else ""


def _count(n: int | None, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}" if n else ""


def config_label(config: dict[str, Any]) -> str:
    """A config in a few words: tile, pipeline stages (cuTile's K/V latency hints), warps, split, and how it was
    chosen (shipped, heuristic, tuned here, fixed): ``128×128 · 8 warps · L3,6 · persistent · tuned here``."""
    warps = config.get("num_worker_warps") or config.get("num_warps")
    latency = (config.get("k_latency"), config.get("v_latency"))
    parts = [
        _tile(config),
        _count(config.get("num_stages"), "stage"),
        f"L{latency[0]},{latency[1]}" if all(latency) else "",
        _count(warps, "warp"),
        f"occupancy {config['occupancy']}" if (config.get("occupancy") or 1) > 1 else "",
        "persistent" if config.get("persistent") else "",
        _split(config),
        _route(config),
        "not compiled" if config.get("compiled") is False else "",
        chosen(config),
    ]
    if not any(parts):  # a peer's own settings (a wrapper's name, a layout): the first of them
        text = ", ".join(f"{key}={value}" for key, value in config.items() if key != EVIDENCE)
        return text if len(text) <= 48 else text[:47] + "…"
    return " · ".join(p for p in parts if p)


def config_details(config: dict[str, Any]) -> dict[str, Any]:
    """The whole config for the folded part of a row: ``pairs`` (key, value as text) and the tuner's
    ``finalists`` (variant, settled and search time per call in us), fastest settled first."""
    finalists = config.get(EVIDENCE)
    if not (isinstance(finalists, list) and all(isinstance(f, dict) and "variant" in f for f in finalists)):
        finalists = []
    pairs = [(key, str(value)) for key, value in config.items() if not (key == EVIDENCE and finalists)]
    ranked = sorted(finalists, key=lambda f: f.get("settled_us") if isinstance(f.get("settled_us"), int | float)
                    else float("inf"))
    return {"pairs": pairs, "finalists": [{"variant": str(f["variant"]), "settled_us": f.get("settled_us"),
                                           "search_us": f.get("search_us")} for f in ranked]}


KERNEL_NAMES = [  # (pattern, replacement): what makes a generated kernel's name long, and what to keep of it
    (re.compile(r"_Kt\d.*$"), ""),  # cuTile's encoding of the arguments
    (re.compile(r"^kernel_cutlass_kernel_.*?([A-Z]\w*?)_object_at_.*$"), r"\1"),  # CuTe DSL: the class
    (re.compile(r"^cudnn_generated_fort_native_(.*?)_knob.*$"), r"cudnn_\1"),  # cuDNN: the engine, less knobs
]


def kernel_name(name: str, width: int = 40) -> str:
    """A kernel's name without its return type, template and argument lists or generated encodings, cut to
    ``width`` characters."""
    short = re.split(r"[<(]", name.removeprefix("void "), maxsplit=1)[0].strip() or name
    for pattern, keep in KERNEL_NAMES:
        short = pattern.sub(keep, short)
    return short if len(short) <= width else short[: width - 1] + "…"


def kernel_rows(kernels: dict[str, dict]) -> list[dict[str, Any]]:
    """The kernels one call ran, the longest first: full name, launches, share of the call's device time."""
    total = sum(float(k.get("seconds", 0)) for k in kernels.values()) or 1.0
    ranked = sorted(kernels.items(), key=lambda kv: -float(kv[1].get("seconds", 0)))
    return [{"name": name, "launches": float(k.get("launches", 0)), "share": float(k.get("seconds", 0)) / total}
            for name, k in ranked]


def kernel_label(kernels: dict[str, dict]) -> str:
    """The kernels of one call in a few words: the longest one's short name and share, and how many others."""
    rows = kernel_rows(kernels)
    if not rows:
        return ""
    top = rows[0]
    label = f"{kernel_name(top['name'])} ({100 * top['share']:.0f}%)"
    return label + (f" + {len(rows) - 1} more" if len(rows) > 1 else "")


GPU_FIELDS = [  # (row label, key of the suite's environment record)
    ("GPU", "gpu"), ("compute capability", "compute_capability"), ("SMs", "sm_count"),
    ("GPU memory (GiB)", "memory_gib"), ("L2 (MiB)", "l2_mib"), ("max SM clock (MHz)", "sm_clock_max_mhz"),
    ("max memory clock (MHz)", "mem_clock_max_mhz"), ("driver", "driver"), ("CUDA runtime", "cuda_runtime"),
]
SOFTWARE_FIELDS = [("Python", "python"), ("torch", "torch"), ("triton", "triton"), ("cuda-tile", "cuda-tile"),
                   ("flash-attn", "flash-attn")]
ENV_HIDDEN = {"device", "cpu", "peak_tflops", "peak_source"}  # the title, the host CPU and peak rows say them


def _peak(run: Run) -> str | None:
    """The dense 16-bit peak that "% of peak" divides by, and where it comes from (or why there is none)."""
    peak, source = run.env.get("peak_tflops"), run.env.get("peak_source")
    if peak is None:
        return f"none ({source})" if source else None
    return f"{peak} ({source})" if source else str(peak)


def _os(run: Run) -> str | None:
    system, release = run.host.get("system"), run.host.get("release")
    return " ".join(str(p) for p in (system, release) if p) or None


def _field(key: str) -> Callable[[Run], Any]:
    return lambda run: run.env.get(key)


def env_rows(runs: Sequence[Run]) -> list[tuple[str, list[str]]]:
    """The environment table: a row per field that at least one run recorded (n/a for the runs without it),
    the host CPU by name, and any field the record has that the lists above do not know, under its own key."""
    known = {key for _, key in GPU_FIELDS + SOFTWARE_FIELDS} | ENV_HIDDEN
    extra = [(key, key) for key in dict.fromkeys(k for r in runs for k in r.env) if key not in known]
    getters: list[tuple[str, Callable[[Run], Any]]] = [
        *((label, _field(key)) for label, key in GPU_FIELDS), ("host CPU", lambda r: r.host_cpu), ("OS", _os),
        *((label, _field(key)) for label, key in SOFTWARE_FIELDS + extra), ("peak TFLOPS", _peak),
        ("results file", lambda r: r.path)]
    rows = []
    for label, get in getters:
        values = [get(r) for r in runs]
        if any(v not in (None, "") for v in values):
            rows.append((label, ["n/a" if v in (None, "") else str(v) for v in values]))
    return rows
