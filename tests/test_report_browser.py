"""The report as a reader sees it: a CPU run of the suite and a published GPU run, rendered in headless Chromium."""

import os
import re
import shutil
from pathlib import Path

import pytest

from reports.build import write_report
from tests.test_report import ROOT, bench_run

pytestmark = pytest.mark.browser

GPU_RUN = ROOT / "docs" / "results" / "prefill-blog-fa3-h200.json.gz"  # the blog's ladder and fa3, on an H200
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NUMBER = re.compile(r"-?\d[\d.]*(?:e[+-]?\d+)?")


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM and not os.environ.get("CI"):
        pytest.skip("chromium not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright  # where a browser exists (and in CI) the test runs

    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"])
        yield launched
        launched.close()


def open_report(browser, report: Path, errors: list[str]):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("requestfailed", lambda req: errors.append(f"request failed: {req.url}"))
    page.goto(report.as_uri())
    return page


def significant_digits(token: str) -> int:
    return len(token.split("e")[0].lstrip("-").replace(".", "").lstrip("0"))


def columns_no_row_fills(page) -> list[str]:
    """The headers of the case tables' columns in which every row's cell is empty or a dash (text content: most
    tables are folded)."""
    return page.evaluate("""() => [...document.querySelectorAll('table.case')].flatMap(table => {
        const rows = [...table.rows];
        return [...rows[0].cells].map((th, i) => rows.slice(1).every(r => ['', '–'].includes(
            r.cells[i].textContent.trim())) ? th.textContent : null).filter(x => x);
    })""")


def column(page, header: str) -> list[str]:
    """The cells of every case table's column headed ``header``."""
    return page.evaluate("""header => [...document.querySelectorAll('table.case')].flatMap(table => {
        const i = [...table.rows[0].cells].findIndex(th => th.textContent.trim() === header);
        return i < 0 ? [] : [...table.rows].slice(1).map(r => r.cells[i].textContent.trim());
    })""", header)


def precedes(page, first: str, then: str) -> bool:
    return page.evaluate(f"""() => !!(document.querySelector('{first}').compareDocumentPosition(
        document.querySelector('{then}')) & Node.DOCUMENT_POSITION_FOLLOWING)""")


def assert_charts_fit_their_data(page) -> None:
    """A line only through three points or more; every chart drawn at a readable size."""
    points = [int(p) for p in page.locator("figure.chart[data-kind=line]").evaluate_all(
        "figures => figures.map(f => f.dataset.points)")]
    assert all(p >= 3 for p in points), points
    for box in (svg.bounding_box() for svg in page.locator("figure.chart svg").all()):
        assert box and box["width"] > 100 and box["height"] > 100


def test_a_cpu_report_puts_the_answer_first_and_says_what_its_numbers_are_for(browser, tmp_path_factory):
    run = bench_run(tmp_path_factory.mktemp("cpu") / "cpu.json", ["naive", "sdpa-math", "triton"], ["cpu-bench"])
    report = write_report([run], tmp_path_factory.mktemp("html") / "report.html")
    errors: list[str] = []
    page = open_report(browser, report, errors)
    assert page.locator("table.leaderboard").count() >= 1
    assert page.locator("table.case").count() >= 2
    assert page.locator("table.matrix td.passed").count() >= 4
    # The answer first: the CPU notice, then the overview, and the environment after every result.
    assert page.evaluate("() => document.querySelector('h2').id") == "overview"
    notice = page.locator("#cpu-notice").inner_text()
    assert "check the pipeline" in notice and "not for comparing kernels" in notice
    assert precedes(page, "#cpu-notice", "#overview") and precedes(page, "#overview", "#environment")
    assert precedes(page, "table.case", "#environment") and precedes(page, "table.matrix", "#environment")
    # The heat map: a row per implementation, a cell per case and the geomean, the best of each case starred.
    heat = page.locator("table.heatmap td.heat")
    assert heat.count() == 3 * (4 + 1) and page.locator("table.heatmap td.win").count() >= 4
    assert all(c != "rgba(0, 0, 0, 0)" for c in heat.evaluate_all(
        "cells => cells.map(c => getComputedStyle(c).backgroundColor)"))
    assert page.locator("table.heatmap tr.ours td").first.inner_text() == "triton"
    verdict = page.locator("p.verdict").inner_text()
    assert "leads" in verdict and re.search(r"triton \d[\d.e-]*×", verdict), verdict
    # On the CPU: no column that no row fills, no word of CUDA events, three significant digits.
    assert columns_no_row_fills(page) == []
    headers = " ".join(page.locator("table.case th").all_inner_texts())
    for empty in ("% of peak", "% of HBM", "peak MiB", "mJ / call", "kernels (one call)"):
        assert empty not in headers
    text = page.inner_text("body")
    assert "CUDA events" not in text and "wall-clock" in text
    assert not re.search(r"\b0\.000\d|\b0\.00×|cpu –|x86_64", text)
    rates = [*heat.all_inner_texts(), *page.locator("table.leaderboard td:nth-child(3)").all_inner_texts(),
             *page.locator("table.case td:nth-child(4), table.case td:nth-child(5)").all_inner_texts()]
    tokens = [t for cell in rates for t in NUMBER.findall(cell.replace("★", ""))]
    assert len(tokens) > 30 and all(significant_digits(t) >= 3 for t in tokens), tokens
    # Two lengths a shape: bars, no line.
    assert page.locator("figure.chart[data-kind=line]").count() == 0
    assert page.locator("figure.chart[data-kind=bars]").count() >= 1
    assert_charts_fit_their_data(page)
    shot = ROOT / "results" / "report-screenshot.png"
    shot.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    assert errors == []


def test_a_gpu_report_labels_configs_and_kernels_short_and_keeps_the_whole_underneath(browser, tmp_path):
    report = write_report([GPU_RUN], tmp_path / "gpu.html")
    errors: list[str] = []
    page = open_report(browser, report, errors)
    assert page.evaluate("() => document.querySelector('h2').id") == "overview"
    assert page.locator("#cpu-notice").count() == 0 and "CUDA-graph replays" in page.inner_text("body")
    assert page.locator("table.heatmap").count() >= 2  # the blog and fa3 presets
    # Configs: a short label whose last word says how it was chosen; the whole config and the finalists folded.
    labels = page.locator("td.cfg details.config > summary").all_inner_texts()
    assert labels and all(len(label) <= 60 for label in labels), max(labels, key=len)
    assert any(label.endswith("tuned here") for label in labels) and any(label.endswith("fixed") for label in labels)
    tuned = page.locator("td.cfg details.config").filter(has=page.locator("table.finalists")).first
    assert not tuned.locator("table.finalists").is_visible()
    tuned.locator("summary").click()
    assert tuned.locator("table.finalists").is_visible() and tuned.locator("table.finalists tr").count() >= 3
    assert "tile_m=" in tuned.locator("code").first.inner_text()
    kernels = page.locator("td.cfg details.kernels > summary").all_inner_texts()
    assert kernels and all(len(k) <= 60 for k in kernels), max(kernels, key=len)
    # The speedup column against each case's best peer, never blank; the environment filled, the CPU named.
    speedups = column(page, "speedup vs best peer")
    assert len(speedups) == page.evaluate(
        "() => [...document.querySelectorAll('table.case')].reduce((n, t) => n + t.rows.length - 1, 0)")
    assert all(re.fullmatch(r"\d[\d.e-]*×vs \S+", s) for s in speedups), speedups
    env = dict(zip(page.locator("#env-table td:first-child").all_inner_texts(),
                   page.locator("#env-table td:nth-child(2)").all_inner_texts(), strict=True))
    assert "Xeon" in env["host CPU"] and env["GPU"] == "NVIDIA H200"
    assert not {"–", "n/a", ""} & set(env.values())
    assert columns_no_row_fills(page) == []
    assert page.locator("figure.chart[data-kind=line]").count() >= 1  # five lengths of the blog's shape
    assert_charts_fit_their_data(page)
    assert errors == []
