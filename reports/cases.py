"""What tells the cases of a preset apart, as short labels: for table rows, heat-map columns and chart titles."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from reports.runs import Run


def length(n: int) -> str:
    """A token count the way people say it: 32768 -> 32K, 3000 -> 3000."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


PACKED_LENGTHS = ("random", "equal")  # a training case of these lengths packs documents: sq counts all their tokens


def packed(case: dict[str, Any]) -> bool:
    """Whether a case's tokens are documents packed in one batch (varlen, or a training op over them)."""
    op = case.get("op") or "dense"
    return op == "varlen" or (op in ("backward", "fwdbwd") and case.get("lengths") in PACKED_LENGTHS)


def case_parts(case: dict[str, Any], *, with_length: bool = True, with_batch: bool = True) -> list[str]:
    """What tells a case apart, in reading order: model, operation, shape, mask, heads, head dim, dtype, variants
    (an fp8 KV cache's last); empty strings where a case has no such part. Without ``with_length`` the shape loses
    its sequence (cache, token) length and keeps the batch as ``B=4`` (unless ``with_batch`` is off too): what the
    cases of one line chart share. Markdown tables label their rows with these parts; charts are grouped and
    titled by them."""
    op, sq, skv, batch = case.get("op") or "dense", case.get("sq", 0), case.get("skv", 0), case.get("batch", 1)
    mask = "causal" if case.get("causal") else "non-causal"
    spread = f"{case.get('lengths')} lengths"
    if op in ("paged", "mla"):
        sized = f"{batch} x {length(skv)}"
        shape = [spread, f"pages of {case.get('page_size')}", f"{sq} new token" + ("s" if sq > 1 else "")]
    elif packed(case):
        sized, shape = f"{length(sq)} tokens in {batch}", [spread, mask]
    elif op == "mixed":  # decoding sequences beside prefill chunks
        chunks = case.get("chunks", 0)
        steps = [f"{batch} x {length(skv)} decoding" if batch else "",
                 f"{chunks} x {length(sq)} prefill" if chunks else ""]
        sized = " + ".join(step for step in steps if step)
        shape = [spread if batch else "", f"pages of {case.get('page_size')}"]
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


COMPACT = [(re.compile(pattern), short) for pattern, short in (
    (r"^(\w+) lengths$", r"\1"), (r"^pages of (\d+)$", r"p\1"), (r"^(\d+) new tokens?$", r"+\1 tok"), (r" x ", "×"))]


def compact(part: str) -> str:
    """A case part in fewer letters, for a heat map's column: ``uniform``, ``p16``, ``+1 tok``, ``64×8K``."""
    for pattern, short in COMPACT:
        part = pattern.sub(short, part)
    return part


def case_labels(cases: dict[str, dict], short: bool = False) -> tuple[dict[str, str], list[str]]:
    """A label per case, its parts (``compact`` ones with ``short``) less those every case of the table shares;
    and those shared parts (the caption says them). A table of one case shares nothing."""
    parts = {cid: [compact(p) if short else p for p in case_parts(c)] for cid, c in cases.items()}
    first = next(iter(parts.values()))
    shared = [x for x in first if x and all(x in p for p in parts.values())] if len(parts) > 1 else []
    return {cid: ", ".join(x for x in p if x and x not in shared) or cid for cid, p in parts.items()}, shared


def chart_key(case: dict[str, Any], with_batch: bool = True) -> str:
    """What a case is, less its sequence (or cache) length: the cases of one line chart differ only there."""
    return ", ".join(p for p in case_parts(case, with_length=False, with_batch=with_batch) if p)


def chart_groups(runs: Sequence[Run], preset: str) -> dict[str, list[str]]:
    """The preset's cases (of every run) that a chart of one x axis, the sequence length, can show: those alike
    but for it, batch included, or whose batch shrinks as the length grows (the fa3 preset keeps B x S fixed). A
    group of one length makes no such chart: the report shows those by case."""
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
