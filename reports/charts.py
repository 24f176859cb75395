"""Charts as inline SVG from matplotlib: text is drawn as paths, so the report needs no fonts or network.

A line needs three points along its axis; fewer make grouped bars. Every implementation keeps one colour and one
marker across the report's charts, and an axis whose values span more than LOG_SPAN is logarithmic."""

from __future__ import annotations

import io
import re
import textwrap
from collections.abc import Callable, Iterable
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.legend_handler import HandlerTuple
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, NullLocator

from reports.cases import length
from reports.formatting import sig3

plt.rcParams.update({"svg.fonttype": "path", "svg.hashsalt": "fmha-bench", "font.size": 9})

LINE_POINTS = 3  # a series needs this many lengths to make a line; fewer are drawn as bars
LOG_SPAN = 30  # values spanning more than this factor get a logarithmic axis
COLOURS = [*plt.get_cmap("tab10").colors, "#000000", "#b8860b", "#008080", "#4b0082", "#800000", "#32cd32"]
MARKERS = "osD^vP*X<>phHd8"
LINE_STYLES = ["-", "--", ":", "-."]  # one per run, where a chart holds several
BAR_LABELS = 48  # a chart of up to this many bars writes each value beside its bar
CEILING_STYLES = ["--", ":", "-."]  # one per GPU where runs of several are charted together


class Style(NamedTuple):
    colour: tuple[float, ...] | str
    marker: str
    line: str


def styles(impls: Iterable[str], runs: Iterable[str] = ()) -> Callable[[str], Style]:
    """A style per chart label (``impl`` or ``impl @ run``): the colour and marker the implementation has in
    every chart, the line style its run has."""
    order = {impl: i for i, impl in enumerate(sorted(set(impls)))}
    run_order = {run: i for i, run in enumerate(dict.fromkeys(runs))}

    def style(label: str) -> Style:
        impl, _, run = label.partition(" @ ")
        i = order.get(impl, len(order))
        return Style(COLOURS[i % len(COLOURS)], MARKERS[i % len(MARKERS)],
                     LINE_STYLES[run_order.get(run, 0) % len(LINE_STYLES)])
    return style


def spans_orders(values: Iterable[float]) -> bool:
    positive = [v for v in values if v and v > 0]
    return bool(positive) and max(positive) / min(positive) > LOG_SPAN


def merged(series: dict[str, list[tuple[float, float]]]) -> list[tuple[list[str], list[tuple[float, float]]]]:
    """Series whose points are the same to three significant digits as one line, with all their labels: one
    would hide the other."""
    by_points: dict[tuple, tuple[list[str], list[tuple[float, float]]]] = {}
    for label, points in sorted(series.items()):
        key = tuple((x, float(f"{y:.3g}")) for x, y in points)
        by_points.setdefault(key, ([], points))[0].append(label)
    return list(by_points.values())


def line_chart(series: dict[str, list[tuple[float, float]]], *, xlabel: str, ylabel: str, title: str,
               style: Callable[[str], Style], hlines: list[tuple[float, str]] = ()) -> str:
    """One line per label (x: a length, on a log2 axis labelled 1K, 2K, ...), hollow markers so that points
    drawn over one another stay visible, and each of ``hlines`` (value, label) as a ceiling such as the HBM
    roofline of each GPU; returns an ``<svg>`` element ('' when there is nothing to draw)."""
    if not series:
        return ""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    lines = merged(series)
    for i, (labels, points) in enumerate(lines):
        xs, ys = zip(*points, strict=True)
        s = style(labels[0])
        width = 1.2 + 1.4 * (len(lines) - 1 - i) / max(1, len(lines) - 1)  # the first drawn widest: it shows
        ax.plot(xs, ys, marker=s.marker, markersize=6, markerfacecolor="none", markeredgewidth=1.3,  # under
                linestyle=s.line, linewidth=width, color=s.colour, label=textwrap.fill(", ".join(labels), 36))
    _ceilings(ax.axhline, hlines)
    xs = sorted({x for points in series.values() for x, _ in points})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(xs))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([length(int(x)) for x in xs])
    ys = [y for points in series.values() for _, y in points]
    if spans_orders(ys):
        ax.set_yscale("log")
    else:  # no "+6.4e1" offset; values a hair apart drawn flat, not stretched over the whole axis
        ax.ticklabel_format(axis="y", useOffset=False)
        if max(ys) - min(ys) < 0.05 * max(ys):
            ax.set_ylim(min(ys) * 0.9, max(ys) * 1.1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    return _finish(fig, ax)


def bar_chart(groups: list[str], series: dict[str, dict[str, float]], *, xlabel: str, title: str,
              style: Callable[[str], Style], vlines: list[tuple[float, str]] = (),
              names: dict[str, str] | None = None) -> str:
    """Grouped horizontal bars: a group per case (``groups``, labelled by ``names``), a bar per label measured
    on it, its colour and marker, and its value written beside it while the chart has few bars; ``vlines`` as
    ceilings. Returns an ``<svg>`` element ('' when there is nothing to draw)."""
    groups = [g for g in groups if any(g in values for values in series.values())]
    if not groups:
        return ""
    labels = sorted(series)
    bars = [[(label, series[label][g]) for label in labels if g in series[label]] for g in groups]
    count = sum(map(len, bars))
    fig, ax = plt.subplots(figsize=(6.4, 0.8 + 0.14 * count + 0.12 * len(groups)))
    log = spans_orders(v for group in bars for _, v in group)
    y, ticks = 0.0, []
    for name, group in zip(groups, bars, strict=True):
        top = y
        for label, value in group:
            s = style(label)
            ax.barh(y, value, height=0.8, color=s.colour, alpha=0.85)
            ax.plot([value], [y], marker=s.marker, color=s.colour, markeredgecolor="black", markersize=4,
                    markeredgewidth=0.5, linestyle="none")
            if count <= BAR_LABELS:
                ax.annotate(sig3(value), (value, y), xytext=(5, 0), textcoords="offset points", va="center",
                            fontsize=6)
            y += 1
        ticks.append(((top + y - 1) / 2, (names or {}).get(name, name)))
        y += 0.8  # a gap between cases
    _ceilings(ax.axvline, vlines)
    ax.set_yticks([t for t, _ in ticks], [n for _, n in ticks], fontsize=7)
    ax.set_ylim(y - 0.4, -0.8)  # the first case on top
    drawn = [v for group in bars for _, v in group] + [value for value, _ in vlines]
    if log:  # room on the right for the values written beside the bars
        ax.set_xscale("log")
        ax.set_xlim(min(drawn) / 2, max(drawn) * 2.5)
    else:
        ax.set_xlim(0, max(drawn) * 1.18)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    handles = [(Patch(color=style(label).colour, alpha=0.85),
                Line2D([], [], marker=style(label).marker, color=style(label).colour, markeredgecolor="black",
                       linestyle="none", markersize=4)) for label in labels]
    return _finish(fig, ax, (handles, labels))


def _ceilings(draw, lines: list[tuple[float, str]]) -> None:
    for j, (value, label) in enumerate(lines):
        draw(value, color="black", linestyle=CEILING_STYLES[j % len(CEILING_STYLES)], linewidth=1, label=label)


def _finish(fig, ax, legend: tuple[list, list[str]] | None = None) -> str:
    ax.grid(True, alpha=0.3)
    where = {"fontsize": 7, "loc": "center left", "bbox_to_anchor": (1.01, 0.5), "frameon": False}
    if legend:
        ceilings = ax.get_legend_handles_labels()
        ax.legend([*legend[0], *ceilings[0]], [*legend[1], *ceilings[1]],
                  handler_map={tuple: HandlerTuple(ndivide=None, pad=0)}, **where)
    else:
        ax.legend(**where)
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg"):]  # drop the XML prolog and doctype: the element is inlined in HTML
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    return re.sub(r"<!--.*?-->", "", svg, flags=re.S)  # matplotlib echoes label text in comments
