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
               logy: bool = False, hline: tuple[float, str] | None = None) -> str:
    """One line per label, and ``hline`` (value, label) as a dashed ceiling such as the HBM roofline;
    returns an ``<svg>`` element ('' when there is nothing to draw)."""
    if not series:
        return ""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    colors = plt.get_cmap("tab20").colors
    for i, (label, points) in enumerate(sorted(series.items())):
        xs, ys = zip(*points, strict=True)
        style = LINE_STYLES[(i // len(colors)) % len(LINE_STYLES)]
        ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], markersize=3, linestyle=style,
                color=colors[i % len(colors)], label=label)
    if hline:
        ax.axhline(hline[0], color="black", linestyle="--", linewidth=1, label=hline[1])
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg"):]  # drop the XML prolog and doctype: the element is inlined in HTML
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    return re.sub(r"<!--.*?-->", "", svg, flags=re.S)  # matplotlib echoes label text in comments
