"""A training preset's three modes side by side: per shape and implementation, the forward's, the backward's and
the whole step's (fwd+bwd) rate, the step's time against its parts timed apart, and the backward's peak memory
against the best peer's plus a float32 dq (what a backward that accumulates dq in float32 may add)."""

from __future__ import annotations

import json
from typing import Any

from reports.cases import case_labels, packed
from reports.overview import OURS, is_ours
from reports.runs import TRAINING_MODES, Run

MODES = tuple(TRAINING_MODES.values())
FLOAT32_BYTES = 4


def mode_parts(run: Run, preset: str) -> list[str]:
    """The sections ``by_training_mode`` made of ``preset``'s own preset, when ``preset`` is the first of them;
    else none (the side-by-side table shows once, in the first)."""
    base = preset.rpartition(": ")[0]
    parts = [f"{base}: {mode}" for mode in MODES if f"{base}: {mode}" in run.presets]
    return parts if len(parts) > 1 and parts[0] == preset else []  # a preset split by figure of merit has none


def dq_float32_bytes(case: dict[str, Any]) -> int:
    rows = case.get("sq", 0) * (1 if packed(case) else case.get("batch", 1))  # packed: sq counts every token
    return rows * case.get("hq", 0) * case.get("d", 0) * FLOAT32_BYTES


def memory_bound(run: Run, backward_id: str) -> float | None:
    """The peak bytes a backward of ours may take on this case: the best (smallest) peer's plus dq in float32."""
    peers = [m.peak_memory_bytes for impl, m in run.by_case.get(backward_id, {}).items()
             if not is_ours(impl, OURS) and isinstance(m.peak_memory_bytes, int)]
    return min(peers) + dq_float32_bytes(run.cases.get(backward_id, {})) if peers else None


def training_modes(run: Run, preset: str) -> dict[str, Any] | None:
    """Rows per shape and implementation: ``tflops`` {mode: rate in the lead timing}, ``step_over_parts`` (the
    step's time over the forward's plus the backward's: below 1, the step costs less than its parts timed apart),
    ``bwd_mib`` (the backward's peak) and, for ours, ``within_bound`` (``memory_bound``)."""
    parts = mode_parts(run, preset)
    if not parts:
        return None
    shapes: dict[str, dict[str, str]] = {}  # the case less its op -> mode -> case id
    for part in parts:
        mode = part.rpartition(": ")[2]
        for cid in run.presets[part]:
            shape = {k: v for k, v in run.cases.get(cid, {}).items() if k not in ("op", "merit")}
            shapes.setdefault(json.dumps(shape, sort_keys=True), {})[mode] = cid
    labels, shared = case_labels({key: json.loads(key) for key in shapes})
    rows = []
    for key, ids in shapes.items():
        measured = {mode: run.by_case.get(cid, {}) for mode, cid in ids.items()}
        bound = memory_bound(run, ids["backward"]) if "backward" in ids else None
        for impl in sorted({impl for per_impl in measured.values() for impl in per_impl}):
            m = {mode: per_impl[impl] for mode, per_impl in measured.items() if impl in per_impl}
            parts_s = m["forward"].median_s + m["backward"].median_s if "forward" in m and "backward" in m else None
            peak = m["backward"].peak_memory_bytes if "backward" in m else None
            rows.append({
                "shape": labels[key], "impl": impl, "ours": is_ours(impl, OURS),
                "tflops": {mode: x.tflops for mode, x in m.items()},
                "step_over_parts": m["fwd+bwd"].median_s / parts_s if parts_s and "fwd+bwd" in m else None,
                "bwd_mib": peak / 2**20 if isinstance(peak, int) else None,
                "within_bound": peak <= bound if is_ours(impl, OURS) and bound and isinstance(peak, int)
                else None,
            })
    present = [mode for mode in MODES if any(mode in r["tflops"] for r in rows)]
    shared = [part for part in shared if part != "dense"]  # the op, which the shapes were stripped of
    return {"preset": parts[0].rpartition(": ")[0], "modes": present, "shared": ", ".join(shared), "rows": rows,
            "memory": any(r["bwd_mib"] is not None for r in rows)}
