"""Charts as inline SVG from matplotlib: text is drawn as paths, so the report needs no fonts or network."""

from __future__ import annotations

import io
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

plt.rcParams.update({"svg.fonttype": "path", "svg.hashsalt": "fmha-bench", "font.size": 9})


MARKERS = "os^vD<>p*h"
LINE_STYLES = ["-", "--", ":"]


def line_chart(series: dict[str, list[tuple[float, float]]], *, xlabel: str, ylabel: str, title: str,
               logy: bool = False, hlines: list[tuple[float, str]] = ()) -> str:
    """One line per label, and each of ``hlines`` (value, label) as a dashed ceiling such as the HBM roofline
    of each GPU; returns an ``<svg>`` element ('' when there is nothing to draw)."""
    if not series:
        return ""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    colors = plt.get_cmap("tab20").colors
    for i, (label, points) in enumerate(sorted(series.items())):
        xs, ys = zip(*points, strict=True)
        style = LINE_STYLES[(i // len(colors)) % len(LINE_STYLES)]
        ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], markersize=3, linestyle=style,
                color=colors[i % len(colors)], label=label)
    _ceilings(ax.axhline, hlines)
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return _finish(fig, ax)


def dot_chart(rows: list[str], series: dict[str, dict[str, float]], *, xlabel: str, title: str,
              vlines: list[tuple[float, str]] = ()) -> str:
    """Cases that share no axis (one length each, such as the models preset's checkpoints): a row per case, a
    marker per label at its value, so that the implementations of a case read along one line; ``vlines`` as
    dashed ceilings. Returns an ``<svg>`` element ('' when there is nothing to draw)."""
    rows = [r for r in rows if any(r in values for values in series.values())]
    if not rows:
        return ""
    fig, ax = plt.subplots(figsize=(6.4, 0.9 + 0.24 * len(rows)))
    colors = plt.get_cmap("tab20").colors
    y = {row: i for i, row in enumerate(reversed(rows))}  # the first case on top
    for i, (label, values) in enumerate(sorted(series.items())):
        points = [(v, y[r]) for r, v in values.items() if r in y]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, ys, marker=MARKERS[i % len(MARKERS)], s=14, color=colors[i % len(colors)],
                       label=label, zorder=3)
    _ceilings(ax.axvline, vlines)
    ax.set_yticks(range(len(rows)), list(reversed(rows)), fontsize=7)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(left=0)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    return _finish(fig, ax)


CEILING_STYLES = ["--", ":", "-."]  # one per GPU where runs of several are charted together


def _ceilings(draw, lines: list[tuple[float, str]]) -> None:
    for j, (value, label) in enumerate(lines):
        draw(value, color="black", linestyle=CEILING_STYLES[j % len(CEILING_STYLES)], linewidth=1, label=label)


def _finish(fig, ax) -> str:
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg"):]  # drop the XML prolog and doctype: the element is inlined in HTML
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    return re.sub(r"<!--.*?-->", "", svg, flags=re.S)  # matplotlib echoes label text in comments
