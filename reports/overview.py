"""The report's answer first: for each preset of each run, every implementation's rate over each case's best as a
heat map, and one sentence naming the leader and how our kernels stand against it."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

from reports.cases import case_labels
from reports.formatting import sig3
from reports.runs import Run, figure_of_merit, geomean

OURS = ("cutile*", "triton*")  # our kernels, by name: what the sentence sets against the leader
CHUNK = 16  # heat-map columns per table: more would not fit the page's width
UNITS = {"gbps": "GB/s", "tflops": "TFLOPS"}


def is_ours(impl: str, ours: Sequence[str] = OURS) -> bool:
    return any(fnmatch.fnmatchcase(impl, glob) for glob in ours)


def heat(ratio: float) -> str:
    """A cell's background: green at the case's best, yellow at three quarters of it, red at half or less."""
    hue = 120 * max(0.0, min(1.0, (ratio - 0.5) / 0.5))
    return f"hsl({hue:.0f}, 70%, {80 if ratio >= 0.5 else 74}%)"


HEAT_LEGEND = [(text, heat(ratio)) for text, ratio in (("1: the best", 1.0), ("0.9", 0.9), ("0.75", 0.75),
                                                       ("0.5 or less", 0.5))]


def _ratio_to(values: dict[str, dict[str, float]], impl: str, other: str) -> float | None:
    """The geometric mean, over the cases both were measured on, of impl's rate over other's."""
    return geomean(v[impl] / v[other] for v in values.values() if impl in v and other in v)


def sentence(preset: str, unit: str, rows: list[dict[str, Any]], values: dict[str, dict[str, float]],
             ours: Sequence[str] = OURS) -> str:
    """The leader (the first row) and each of our kernels' rate as a multiple of its, on the cases both ran;
    where the leader is ours, the best peer's too."""
    leader, cases = rows[0], len(values)
    text = (f"{preset} ({unit}): {leader['impl']} leads, the best on {leader['wins']} of {cases} case"
            + ("s" if cases > 1 else "") + (f" (it ran {leader['measured']})" if leader["measured"] < cases else ""))
    named = [(r["impl"], r["impl"]) for r in rows[1:] if is_ours(r["impl"], ours)]
    if is_ours(leader["impl"], ours):
        peer = next((r["impl"] for r in rows[1:] if not is_ours(r["impl"], ours)), None)
        named = ([(f"{peer} (best peer)", peer)] if peer else []) + named
    elif not any(r["ours"] for r in rows):
        return f"{text}; none of our kernels ({', '.join(ours)}) was measured."
    ratios = [(name, _ratio_to(values, impl, leader["impl"])) for name, impl in named]
    said = [f"{name} {sig3(r, zeros=True)}×" if r else f"{name}: no case in common" for name, r in ratios]
    return f"{text}" + (f"; against it, on the cases both ran: {', '.join(said)}." if said else ".")


def standing(run: Run, preset: str, ours: Sequence[str] = OURS) -> dict[str, Any] | None:
    """One heat map: rows are implementations, best first by the geometric mean of their rate over each case's
    best; columns are the cases, in chunks of CHUNK. The leader is the first row among those measured on at
    least half the cases (a kernel that ran two easy cases does not lead)."""
    case_ids = [cid for cid in run.presets.get(preset, []) if run.by_case.get(cid)]
    metric = figure_of_merit(run.cases.get(cid, {}) for cid in case_ids)
    values = {cid: {impl: v for impl, m in run.by_case[cid].items() if (v := getattr(m, metric))}
              for cid in case_ids}
    values = {cid: v for cid, v in values.items() if v}
    if not values:
        return None
    best = {cid: max(v.values()) for cid, v in values.items()}
    impls = sorted({impl for v in values.values() for impl in v})
    rows = []
    for impl in impls:
        cells = {cid: {"ratio": v[impl] / best[cid], "value": v[impl], "win": v[impl] == best[cid],
                       "colour": heat(v[impl] / best[cid])} for cid, v in values.items() if impl in v}
        mean = geomean(c["ratio"] for c in cells.values()) or 0.0
        rows.append({"impl": impl, "ours": is_ours(impl, ours), "cells": cells, "measured": len(cells),
                     "wins": sum(c["win"] for c in cells.values()), "geomean": mean, "colour": heat(mean)})
    rows.sort(key=lambda r: (-r["geomean"], -r["measured"]))
    leader = next((r for r in rows if 2 * r["measured"] >= len(values)), rows[0])
    rows.remove(leader)
    rows.insert(0, leader)
    labels, shared = case_labels({cid: run.cases.get(cid, {}) for cid in values}, short=True)
    columns = [(cid, labels[cid]) for cid in values]
    unit = UNITS[metric]
    return {"preset": preset, "run": run.label, "unit": unit, "shared": ", ".join(shared), "rows": rows,
            "chunks": [columns[i:i + CHUNK] for i in range(0, len(columns), CHUNK)],
            "sentence": sentence(preset, unit, rows, values, ours)}


def overview(runs: Sequence[Run], presets: Sequence[str], ours: Sequence[str] = OURS) -> list[dict[str, Any]]:
    """A heat map and its sentence for each preset of each run that measured it."""
    return [s for preset in presets for run in runs if (s := standing(run, preset, ours))]
