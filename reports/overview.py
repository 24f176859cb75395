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


def leader(rows: list[dict[str, Any]], values: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The row faster than each other on the cases both ran (by geometric mean), among those that ran at least
    half the cases (two easy cases do not make a leader); where no row is, the first (best rate over each case's
    best)."""
    contenders = [r for r in rows if 2 * r["measured"] >= len(values)] or rows
    def beats_all(row: dict[str, Any]) -> bool:
        return all((_ratio_to(values, row["impl"], other["impl"]) or 1.0) >= 1.0
                   for other in contenders if other is not row)
    return next(filter(beats_all, contenders), contenders[0])


def sentence(preset: str, unit: str, rows: list[dict[str, Any]], values: dict[str, dict[str, float]],
             ours: Sequence[str] = OURS) -> str:
    """The leader (the first row) and each of our kernels' rate as a multiple of its, on the cases both ran;
    where the leader is ours, the best peer's (the closest to it) too."""
    first, cases = rows[0], len(values)
    text = (f"{preset} ({unit}): {first['impl']} leads, the best on {first['wins']} of {cases} case"
            + ("s" if cases > 1 else "") + (f" (it ran {first['measured']})" if first["measured"] < cases else ""))
    ratios = {r["impl"]: _ratio_to(values, r["impl"], first["impl"]) for r in rows[1:]}
    named = [(impl, impl) for impl in ratios if is_ours(impl, ours)]
    if is_ours(first["impl"], ours):
        peers = [impl for impl in ratios if not is_ours(impl, ours)]
        if peers:
            peer = max(peers, key=lambda impl: ratios[impl] or 0.0)
            named.insert(0, (f"{peer} (best peer)", peer))
    elif not any(r["ours"] for r in rows):
        return f"{text}; none of our kernels ({', '.join(ours)}) was measured."
    said = [f"{name} {sig3(ratios[impl], zeros=True)}×" if ratios[impl] else f"{name}: no case in common"
            for name, impl in named]
    return f"{text}" + (f"; against it, on the cases both ran: {', '.join(said)}." if said else ".")


def standing(run: Run, preset: str, ours: Sequence[str] = OURS) -> dict[str, Any] | None:
    """One heat map: rows are implementations, the ``leader`` first, then by the geometric mean of their rate over
    each case's best; columns are the cases, in chunks of CHUNK."""
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
    first = leader(rows, values)
    rows.remove(first)
    rows.insert(0, first)
    labels, shared = case_labels({cid: run.cases.get(cid, {}) for cid in values}, short=True)
    columns = [(cid, labels[cid]) for cid in values]
    unit = UNITS[metric]
    return {"preset": preset, "run": run.label, "unit": unit, "shared": ", ".join(shared), "rows": rows,
            "chunks": [columns[i:i + CHUNK] for i in range(0, len(columns), CHUNK)],
            "sentence": sentence(preset, unit, rows, values, ours)}


def overview(runs: Sequence[Run], presets: Sequence[str], ours: Sequence[str] = OURS) -> list[dict[str, Any]]:
    """A heat map and its sentence for each preset of each run that measured it."""
    return [s for preset in presets for run in runs if (s := standing(run, preset, ours))]
