"""The NVIDIA blog's ladder on B200 (Tables 1-6: B=4, H=32, D=128, fp16, causal), kept labelled as the blog's,
and the notes that say where the local GPU behaves differently."""

from __future__ import annotations

import itertools

BLOG_SEQLENS = [1024, 2048, 4096, 8192, 16384]
BLOG_LADDER: dict[str, list[float]] = {  # TFLOPS on an NVIDIA B200, from the blog's tables
    "cutile-1-baseline": [330, 441, 511, 546, 566],
    "cutile-2-large-tiles": [187, 268, 347, 415, 463],
    "cutile-3-fast-math": [322, 436, 524, 585, 620],
    "cutile-4-loop-split": [373, 552, 684, 770, 813],
    "cutile-5-remap": [377, 560, 696, 781, 835],
    "cutile": [548, 708, 817, 887, 918],
}
SAME_DIRECTION_SLACK = 0.02  # changes within 2% count as "no change"


def ladder_notes(here: dict[str, dict[int, float | None]]) -> list[str]:
    """Compare each step's change over the step before, here and on the blog's B200."""
    notes = []
    steps = list(BLOG_LADDER)
    for prev, step in itertools.pairwise(steps):
        changes_here = [here[step][s] / here[prev][s] - 1 for s in BLOG_SEQLENS
                        if here.get(step, {}).get(s) and here.get(prev, {}).get(s)]
        if not changes_here:
            continue
        blog = [b / a - 1 for a, b in zip(BLOG_LADDER[prev], BLOG_LADDER[step], strict=True)]
        lo, hi = min(changes_here), max(changes_here)
        blo, bhi = min(blog), max(blog)
        verdict = _direction(lo, hi) == _direction(blo, bhi)
        text = (f"{step} vs {prev}: {lo:+.0%} to {hi:+.0%} here, {blo:+.0%} to {bhi:+.0%} on the blog's B200")
        notes.append(text + ("" if verdict else " — behaves differently here"))
    return notes


def _direction(lo: float, hi: float) -> str:
    if lo > SAME_DIRECTION_SLACK:
        return "up"
    if hi < -SAME_DIRECTION_SLACK:
        return "down"
    return "flat"
