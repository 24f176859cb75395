"""The report: built from real suite output, escaped, strict about its input, and clean in a browser."""

import dataclasses
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reports.build import ReportError, load_run, render, write_report
from suite.isolation import child_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """A real benchmark run of the suite (CPU, two implementations, tiny cases)."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    cmd = [sys.executable, "-m", "pytest", "suite", "--benchmark-only", "-q", "-p", "no:cacheprovider",
           "--impl", "naive", "--impl", "sdpa-math", "--grid", "cpu-bench", "--rounds", "2",
           "--round-ms", "1", f"--benchmark-json={out}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=child_env())
    return out


def test_report_has_every_section(results, tmp_path):
    html = write_report([results], tmp_path / "r.html").read_text()
    for marker in ('id="env-table"', 'class="leaderboard"', 'class="case"', 'class="matrix"', "<svg"):
        assert marker in html, marker
    assert "naive" in html and "sdpa-math" in html
    assert "<script" not in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "the report must not fetch anything"


def test_report_says_whether_calls_settled_before_timing(results, tmp_path):
    data = json.loads(results.read_text())
    html = write_report([results], tmp_path / "cpu.html").read_text()
    assert "--settle-ms" not in html  # a CPU run: no clocks to settle, nothing said
    for bench in data["benchmarks"]:
        bench["extra_info"]["gpu"] = {"name": "NVIDIA H200", "uuid": "GPU-0"}
    unsettled = tmp_path / "unsettled.json"
    unsettled.write_text(json.dumps(data))
    html = " ".join(write_report([unsettled], tmp_path / "u.html").read_text().split())
    assert "timed without settling first" in html
    for bench in data["benchmarks"]:
        bench["extra_info"]["settle_s"] = 0.25
    settled = tmp_path / "settled.json"
    settled.write_text(json.dumps(data))
    html = " ".join(write_report([settled], tmp_path / "s.html").read_text().split())
    assert "back to back for 250 ms" in html and "without settling" not in html
    assert "--rest-ms" not in html
    for bench in data["benchmarks"]:
        bench["extra_info"]["rest_s"] = 1.0
    rested = tmp_path / "rested.json"
    rested.write_text(json.dumps(data))
    html = " ".join(write_report([rested], tmp_path / "r.html").read_text().split())
    assert "Each benchmark began after 1000 ms with the GPU idle" in html
    assert "none started from the power state the case before it left" in html
    data["benchmarks"][0]["extra_info"]["rest_s"] = 0.0  # --rest-ms auto: a pause after heavier calls only
    rested.write_text(json.dumps(data))
    html = " ".join(write_report([rested], tmp_path / "r.html").read_text().split())
    count = len(data["benchmarks"])
    assert f"{count - 1} of the {count} benchmarks began after 1000 ms with the GPU idle" in html
    assert "pauses only after a benchmark of much longer calls" in html


def test_report_says_whether_the_gpu_benchmarks_found_their_inputs_in_the_l2(results, tmp_path):
    """A warm run (the default) says that inputs that fit in the L2 were read from there; a --cold-l2 run says
    they were evicted, and how many benchmarks stayed warm because their copies fit in it together."""
    data = json.loads(results.read_text())
    assert "L2 cache" not in write_report([results], tmp_path / "cpu.html").read_text()  # CPU: nothing said
    for bench in data["benchmarks"]:
        bench["extra_info"]["gpu"] = {"name": "NVIDIA H200", "uuid": "GPU-0"}
    path = tmp_path / "gpu.json"

    def report() -> str:
        path.write_text(json.dumps(data))
        return " ".join(write_report([path], tmp_path / "g.html").read_text().split())

    assert "inputs that fit in the L2 cache were read from there" in report()
    for bench in data["benchmarks"]:
        bench["extra_info"]["cold_l2"] = True
    html = report()
    assert "Every GPU benchmark found its inputs evicted from the L2 cache" in html and "read from there" not in html
    data["benchmarks"][0]["extra_info"]["cold_l2"] = False  # its copies fit in the L2 together
    count = len(data["benchmarks"])
    html = report()
    assert f"{count - 1} of the {count} GPU benchmarks found their inputs evicted" in html
    assert "the smallest steps' copies fit in it together" in html


def test_report_shows_the_energy_of_a_call_where_nvml_measured_it(results, tmp_path):
    data = json.loads(results.read_text())
    html = write_report([results], tmp_path / "cpu.html").read_text()
    assert "mJ / call" in html and "(700," not in html  # a CPU run: the column says nothing was measured
    for bench in data["benchmarks"]:
        bench["extra_info"]["energy"] = {"joules": 4.2, "calls": 2000, "joules_per_call": 0.0021,
                                         "avg_power_w": 700.0, "sm_clock_mhz": 1605}
        bench["extra_info"]["gpu"] = {"name": "NVIDIA H200", "uuid": "GPU-0"}
    measured = tmp_path / "energy.json"
    measured.write_text(json.dumps(data))
    html = write_report([measured], tmp_path / "e.html").read_text()
    assert "2.1 (700, 1605)" in html


def test_case_tables_show_what_decided_a_tuned_pick(results, tmp_path):
    # A settled tuner's pick carries its finalists' times in the config (impls.tuning.EVIDENCE); the case
    # table shows each one's settled time per call and the search's, fastest first, not a dict's repr.
    data = json.loads(results.read_text())
    finalists = [{"variant": "128x256:persistent:peeled", "search_us": 5412.3, "settled_us": 5398.1},
                 {"variant": "128x128:persistent:peeled", "search_us": 5390.0, "settled_us": 5571.6}]
    data["benchmarks"][0]["extra_info"]["config"] = {"tile_n": 256, "chosen": "tuning cache", "finalists": finalists}
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps(data))
    html = write_report([tuned], tmp_path / "t.html").read_text()
    assert ("tile_n=256, chosen=tuning cache, finalists=128x256:persistent:peeled 5398.1 us (5412.3); "
            "128x128:persistent:peeled 5571.6 us (5390.0)") in html
    assert "{&#39;variant&#39;" not in html and "{'variant'" not in html


def test_case_tables_show_the_sm_clock_each_benchmark_was_timed_at(results, tmp_path):
    data = json.loads(results.read_text())
    assert "SM MHz" not in write_report([results], tmp_path / "cpu.html").read_text()  # no NVML: no column
    for i, bench in enumerate(data["benchmarks"]):
        state = {"sm_clock_mhz": 1395 + i, "power_w": 690.0} if i else {"unavailable": "NVML not installed"}
        bench["extra_info"]["gpu"] = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-1", "state": state}
    clocked = tmp_path / "clocked.json"
    clocked.write_text(json.dumps(data))
    html = write_report([clocked], tmp_path / "c.html").read_text()
    assert "SM MHz</th>" in html
    cells = re.findall(r"<td>(\d{4}|–)</td><td>(?:–|\S+ \()", html)  # the clock cell, before the energy cell
    assert {"1396", "–"} <= set(cells)


def test_rounds_that_drifted_while_timed_are_flagged(results, tmp_path):
    from reports.build import DRIFT_FLAG, round_drift

    assert round_drift([1.0, 1.0, 1.04, 1.04, 1.1]) is None  # too few rounds to tell
    assert round_drift([1.0, 1.0, 1.0, 1.04, 1.04, 1.04]) == pytest.approx(0.04 / 1.02)
    assert round_drift([1.1, 1.0, 1.0, 1.0, 1.0, 1.0]) == 0.0  # one slow first round is not a trend
    data = json.loads(results.read_text())
    html = write_report([results], tmp_path / "plain.html").read_text()
    assert "Rounds that drifted" not in html  # two rounds each: nothing to flag
    drifting, steady = data["benchmarks"][0], data["benchmarks"][1]
    drifting["stats"]["data"] = [1.071, 1.082, 1.104, 1.112, 1.112, 1.107, 1.099]  # session 20, Mistral 4 x 4K
    steady["stats"]["data"] = [1.0, 1.01, 0.99, 1.0, 1.005, 0.995]
    edited = tmp_path / "drift.json"
    edited.write_text(json.dumps(data))
    run = load_run(edited)
    flagged = [m for m in run.measurements if m.drifted]
    assert [(m.impl, m.case) for m in flagged] == [(drifting["extra_info"]["impl"], drifting["extra_info"]["case"])]
    assert flagged[0].drift == pytest.approx((1.107 - 1.082) / 1.104) and flagged[0].drift > DRIFT_FLAG
    html = " ".join(write_report([edited], tmp_path / "d.html").read_text().split())
    assert "Rounds that drifted" in html and "drift +2.3%" in html and 'class="drift"' in html


def test_leaderboards_count_the_cases_near_each_cases_best_and_name_the_worst(results, tmp_path):
    from reports.build import leaderboard

    data = json.loads(results.read_text())
    lead = {b["extra_info"]["timing"] for b in data["benchmarks"]}
    first = data["benchmarks"][0]["extra_info"]["case"]
    for bench in data["benchmarks"]:  # equal everywhere but on one case, where naive reaches 5% of sdpa-math
        info = bench["extra_info"]
        info["tflops"] = (1.0 if info["impl"] == "naive" else 20.0) if info["case"] == first else 5.0
    edited = tmp_path / "board.json"
    edited.write_text(json.dumps(data))
    run = load_run(edited)
    assert lead == {run.lead}
    preset = next(p for p, ids in run.presets.items() if first in ids)
    rows = {row["impl"]: row for row in leaderboard(run, preset)}
    cases = rows["naive"]["cases"]
    assert cases > 1 and rows["sdpa-math"]["near_best"] == cases and rows["sdpa-math"]["worst"][0] == 1.0
    assert rows["naive"]["near_best"] == cases - 1 and rows["naive"]["worst"] == (0.05, first)
    html = " ".join(write_report([edited], tmp_path / "b.html").read_text().split())
    assert "within 10% of the case's best" in html and f"0.05 <code>{first}</code>" in html


def test_two_runs_side_by_side(results, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(results.read_text())
    html = write_report([results, other], tmp_path / "r.html").read_text()
    assert "(bench)" in html and "(other)" in html


def test_names_and_messages_from_the_json_are_escaped(results, tmp_path):
    data = json.loads(results.read_text())
    evil = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    data["benchmarks"][0]["extra_info"]["impl"] = evil
    data["fmha"]["outcomes"].append({"impl": evil, "case": data["fmha"]["presets"]["cpu-bench"][0],
                                     "status": "failed", "message": evil})
    data["fmha"]["unavailable"][evil] = evil
    path = tmp_path / "evil.json"
    path.write_text(json.dumps(data))
    html = render([load_run(path)])
    assert "<script>" not in html and "<img" not in html
    assert "&lt;script&gt;" in html


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ('{"benchmarks": [', "not valid JSON (truncated?)"),
        ("[]", "top level is not a JSON object"),
        ('{"machine_info": {}}', "no 'benchmarks' list"),
        ('{"benchmarks": []}', "no 'fmha' block"),
        ('{"benchmarks": [{"stats": {}, "extra_info": {}}], "fmha": {"outcomes": [], "unavailable": {}, '
         '"presets": {}, "cases": {}}}', "benchmark #0"),
    ],
)
def test_malformed_input_is_refused_with_the_file_and_the_problem(tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ReportError, match=re.escape(words)) as info:
        load_run(path)
    assert str(path) in str(info.value)


def test_cli_exit_code_and_message(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    proc = subprocess.run([sys.executable, "-m", "reports", str(bad), "-o", str(tmp_path / "r.html")],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "bad.json: not valid JSON" in proc.stderr


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.browser
def test_report_renders_in_headless_chromium(results, tmp_path):
    if os.environ.get("CI"):
        from playwright.sync_api import sync_playwright  # in CI a missing browser fails, never skips
    else:
        sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
        if not _chromium():
            pytest.skip("chromium not installed (apt-get install chromium)")
    report = write_report([results], tmp_path / "report.html")
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("requestfailed", lambda req: errors.append(f"request failed: {req.url}"))
        page.goto(report.as_uri())
        assert page.locator("table.leaderboard").count() >= 1
        assert page.locator("table.case").count() >= 2
        assert page.locator("table.matrix td.passed").count() >= 4
        assert page.locator("figure.chart svg").count() >= 1
        box = page.locator("figure.chart svg").first.bounding_box()
        assert box and box["width"] > 100 and box["height"] > 100
        shot = ROOT / "results" / "report-screenshot.png"
        shot.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert errors == []


def test_matrix_keeps_properties_apart_and_marks_every_status(results, tmp_path):
    data = json.loads(results.read_text())
    case = data["fmha"]["presets"]["cpu-bench"][0]
    data["fmha"]["outcomes"] += [
        {"impl": "naive", "case": case, "status": "passed", "message": "ok", "property": "nan-in-q"},
        {"impl": "naive", "case": case, "status": "differs", "message": "3 rows", "property": "nan-in-k"},
        {"impl": "slow", "case": case, "status": "timed out", "message": "timed out after 5 s"},
        {"impl": "big", "case": case, "status": "out of memory", "message": "out of memory (asked for 8 GiB)"},
    ]
    path = tmp_path / "statuses.json"
    path.write_text(json.dumps(data))
    html = render([load_run(path)])
    assert f"{case} · nan-in-q" in html and f"{case} · nan-in-k" in html
    for css in ("differs", "timed-out", "out-of-memory"):
        assert f'class="{css}"' in html
    assert "asked for 8 GiB" in html


def test_the_parts_of_one_run_are_published_as_one_file(results, tmp_path):
    """A device call runs the contenders and the rest as two parts: publish_results.py joins their JSONs."""
    data = json.loads(results.read_text())
    parts = []
    for impl in ("naive", "sdpa-math"):
        part = json.loads(json.dumps(data))
        part["benchmarks"] = [b for b in data["benchmarks"] if b["extra_info"]["impl"] == impl]
        part["fmha"]["impls"] = {impl: data["fmha"]["impls"][impl]}
        part["fmha"]["outcomes"] = [o for o in data["fmha"]["outcomes"] if o["impl"] == impl]
        parts.append(tmp_path / f"{impl}.json")
        parts[-1].write_text(json.dumps(part))
    assert all(json.loads(p.read_text())["benchmarks"] for p in parts)
    published = tmp_path / "published.json.gz"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "publish_results.py"), *map(str, parts), str(published)],
                   cwd=ROOT, check=True, capture_output=True, env=child_env())
    run = load_run(published)
    merged = json.loads(gzip.decompress(published.read_bytes()))
    assert len(merged["benchmarks"]) == len(data["benchmarks"])
    assert sorted(merged["fmha"]["impls"]) == ["naive", "sdpa-math"]
    assert len(merged["fmha"]["outcomes"]) == len(data["fmha"]["outcomes"])
    assert all("params" not in b for b in merged["benchmarks"])
    assert {"naive", "sdpa-math"} <= {m.impl for m in run.measurements}


@pytest.fixture(scope="module")
def serving_results(tmp_path_factory) -> Path:
    """A real benchmark run of decode over a paged cache and of the models twin (CPU, tiny cases)."""
    out = tmp_path_factory.mktemp("serving") / "serving.json"
    cmd = [sys.executable, "-m", "pytest", "suite", "--benchmark-only", "-q", "-p", "no:cacheprovider",
           "--impl", "naive", "--impl", "sdpa", "--grid", "serving-cpu-bench", "--grid", "models-cpu",
           "--rounds", "2", "--round-ms", "1", f"--benchmark-json={out}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=child_env())
    return out


def _section(html: str, preset: str) -> str:
    """The HTML of one preset's section of a report."""
    start = html.index(f'id="preset-{preset}"')
    end = html.find('<h2 id="', start)
    return html[start:end if end >= 0 else None]


def test_a_line_chart_holds_only_cases_that_differ_in_length(serving_results):
    from reports.build import case_parts, chart_groups, chart_key

    run = load_run(serving_results)
    models = chart_groups([run], "models-cpu")  # one length a model: nothing to draw a line through
    assert models and all(len({run.cases[c]["skv"] for c in ids}) == 1 for ids in models.values())
    base = {"op": "dense", "causal": True, "hq": 32, "hkv": 8, "d": 128, "dtype": "bf16", "model": "m",
            "window": [-1, -1], "softcap": 0.0, "dv": 0, "lengths": "fixed"}
    cases = {  # the models preset's Llama-3 and Mistral (its window) at 4 x 4K: one length, two lines
        "a-4k": {**base, "batch": 4, "sq": 4096, "skv": 4096},
        "a-8k": {**base, "batch": 4, "sq": 8192, "skv": 8192},
        "w-4k": {**base, "batch": 4, "sq": 4096, "skv": 4096, "window": [4096, 0]},
        "w-8k": {**base, "batch": 4, "sq": 8192, "skv": 8192, "window": [4096, 0]},
        "fa3-1k": {**base, "batch": 16, "sq": 1024, "skv": 1024, "model": "fa3"},  # B x S fixed: one line
        "fa3-2k": {**base, "batch": 8, "sq": 2048, "skv": 2048, "model": "fa3"},
        "b1-32k": {**base, "batch": 1, "sq": 32768, "skv": 32768},  # another batch, B x S not the same: alone
    }
    groups = chart_groups([dataclasses.replace(run, presets={"p": list(cases)}, cases=cases)], "p")
    assert sorted(map(sorted, groups.values())) == [["a-4k", "a-8k"], ["b1-32k"], ["fa3-1k", "fa3-2k"],
                                                     ["w-4k", "w-8k"]]
    assert "window 4096:0" in chart_key(cases["w-4k"]) and "B x Skv = 16384" in " ".join(groups)
    # a chart is titled by the parts that label the case's row in a markdown table, less the length
    paged = {**base, "op": "paged", "batch": 16, "sq": 4, "skv": 32768, "lengths": "uniform", "page_size": 64}
    assert case_parts(paged)[2] == "16 x 32K" and "32K" not in chart_key(paged)
    assert chart_key(paged) == "m, paged, B=16, uniform lengths, pages of 64, 4 new tokens, h32:8, D 128, bf16"
    assert chart_key({**paged, "kv_dtype": "fp8"}) == chart_key(paged) + ", fp8 KV cache"  # its own line and row
    assert "Sq 1," in chart_key({**base, "sq": 1, "skv": 4096}) and "Sq" not in chart_key(cases["a-4k"])


def test_cases_of_one_length_each_are_charted_by_case(serving_results, tmp_path):
    html = write_report([serving_results], tmp_path / "r.html").read_text()
    models = _section(html, "models-cpu")
    assert "TFLOPS by case" in models and "against sequence length" not in models and "<svg" in models
    assert "by case" not in _section(html, "serving-cpu-bench")


def test_decode_charts_bandwidth_and_each_gpus_roofline_in_a_report_of_several_runs(results, serving_results,
                                                                                   tmp_path):
    """Decode ranks by GB/s whichever run comes first, and each GPU's HBM line is drawn (session 29: a report
    whose first run had no decode charted the serving preset in TFLOPS, without the roofline)."""
    html = write_report([results, serving_results], tmp_path / "r.html").read_text()
    assert "GB/s against cache length" in _section(html, "serving-cpu-bench")
    data = json.loads(serving_results.read_text())
    paths = []
    for gpu, peak_gbps in (("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H200", 4800.0)):
        for bench in data["benchmarks"]:
            if bench["extra_info"].get("gbps"):
                bench["extra_info"]["pct_of_hbm"] = 100 * bench["extra_info"]["gbps"] / peak_gbps
        data["machine_info"]["fmha"]["gpu"] = gpu
        paths.append(tmp_path / f"{gpu.split()[1]}.json")
        paths[-1].write_text(json.dumps(data))
    serving = " ".join(_section(write_report([results, *paths], tmp_path / "g.html").read_text(),
                                "serving-cpu-bench").split())
    assert "HBM peak 3.35 TB/s (NVIDIA H100 80GB HBM3, datasheet); HBM peak 4.80 TB/s (NVIDIA H200" in serving


def test_the_ladder_section_needs_a_step_of_the_ladder(results):
    from reports.blog import BLOG_SEQLENS
    from reports.build import Measurement, ladder

    run = load_run(results)
    cases = {f"blog-{s}": {"sq": s, "skv": s} for s in BLOG_SEQLENS}

    def measured(*impls: str):
        return [Measurement(impl=impl, family="cutile", case=cid, fields={}, median_s=1e-3, iqr_s=0.0, stddev_s=0.0,
                            rounds=3, tflops=100.0, pct_of_peak=None, gbps=None, peak_memory_bytes=None,
                            max_error=0.0, config={}) for impl in impls for cid in cases]

    def blog_run(*impls: str):
        return dataclasses.replace(run, measurements=measured(*impls), presets={"blog": list(cases)}, cases=cases,
                                   modes={}, by_case={})

    assert ladder(blog_run("cutile")) is None  # the autotuned kernel alone (a prefill run): no ladder
    steps = ladder(blog_run("cutile", "cutile-1-baseline"))
    assert steps and steps["here"]["cutile-1-baseline"][BLOG_SEQLENS[0]] == 100.0


def test_a_preset_of_decode_and_prefill_cases_becomes_two_sections():
    from reports.build import by_figure_of_merit

    cases = {"d1": {"op": "paged"}, "d2": {"op": "paged"}, "p1": {"op": "varlen"}, "x": {"op": "dense"}}
    split = by_figure_of_merit({"models-serving": ["d1", "p1", "d2"], "blog": ["x"], "serving": ["d1", "d2"]}, cases)
    assert split == {"models-serving: decode": ["d1", "d2"], "models-serving: prefill": ["p1"], "blog": ["x"],
                     "serving": ["d1", "d2"]}


def test_a_case_ranks_by_the_merit_its_run_recorded():
    """A dense decode step recorded as ``gbps`` (session 61 on) ranks by GB/s; a file from before, which records
    none, ranks paged decode by GB/s and the rest by TFLOPS."""
    from reports.build import figure_of_merit

    assert figure_of_merit([{"op": "dense", "merit": "gbps"}] * 2) == "gbps"
    assert figure_of_merit([{"op": "dense", "merit": "gbps"}, {"op": "dense", "merit": "tflops"}]) == "tflops"
    assert figure_of_merit([{"op": "paged"}]) == "gbps" and figure_of_merit([{"op": "dense", "sq": 1}]) == "tflops"
    assert figure_of_merit([]) == "tflops"


def test_a_markdown_table_bolds_each_cases_best_and_sets_ours_against_the_rest(serving_results):
    from reports.markdown import _cell, table

    run = load_run(serving_results)
    text = table(run, "serving-cpu-bench", ours=["sdpa"])
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    case_ids = [cid for cid in run.presets["serving-cpu-bench"] if run.by_case.get(cid)]
    assert len(rows) == len(case_ids) > 1 and "GB/s (eager timing" in text
    header = text.splitlines()[2].strip("| ").split(" | ")
    assert header[-1] == "ours / best peer" and set(header[1:-1]) == {"naive", "sdpa"}
    for row, cid in zip(rows, case_ids, strict=True):
        cells = row.strip("| ").split(" | ")
        gbps = {impl: run.by_case[cid][impl].gbps for impl in header[1:-1]}
        assert [c for c in cells if c.startswith("**")] == [f"**{_cell(max(gbps.values()))}**"]
        sdpa, naive = run.by_case[cid]["sdpa"], run.by_case[cid]["naive"]
        assert cells[-1] == f"{gbps['sdpa'] / gbps['naive']:.3f}" + (" (tie)" if sdpa.ties(naive) else "")
    one = table(run, "serving-cpu-bench", impls=["naive"], cases=[case_ids[0]])
    assert "sdpa" not in one and one.count("\n| ") == 2  # the header and one row
    with pytest.raises(ReportError, match="no preset 'blog'"):
        table(run, "blog")
    with pytest.raises(ReportError, match=r"no measured case matching nothing-\*"):
        table(run, "serving-cpu-bench", cases=["nothing-*"])
    with pytest.raises(ReportError, match="no implementation matching flash-attn4"):
        table(run, "serving-cpu-bench", impls=["flash-attn4"])


def test_a_ratio_the_run_cannot_order_is_marked_a_tie(serving_results):
    """Medians closer than the wider interquartile range of the two are a tie, in the table's last column too."""
    from dataclasses import replace

    from reports.markdown import _ours_over_peers

    run = load_run(serving_results)
    m = next(iter(run.by_case.values()))["sdpa"]
    ours, peer = replace(m, median_s=1.000, iqr_s=0.002), replace(m, median_s=1.001, iqr_s=0.0005)
    assert ours.ties(peer) and peer.ties(ours)
    assert not replace(ours, iqr_s=0.0005).ties(peer)  # 0.1% apart, each within 0.05%: ordered
    measured, value = {"a": ours, "b": peer}, {"a": 1 / 1.000, "b": 1 / 1.001}
    assert _ours_over_peers(measured, value, ["a"], ["b"]) == "1.001 (tie)"
    measured["a"] = replace(ours, iqr_s=0.0005)
    assert _ours_over_peers(measured, value, ["a"], ["b"]) == "1.001"
    assert _ours_over_peers(measured, {"a": 1.0, "b": None}, ["a"], ["b"]) == "-"


def test_a_table_says_when_its_numbers_were_timed_with_a_cold_l2(serving_results, tmp_path):
    """Warm (the default) says nothing; all cold says so; cold but for the cases whose copies fit in the L2
    together says how many stayed warm."""
    from reports.markdown import table

    data = json.loads(serving_results.read_text())
    run = load_run(serving_results)
    cases = [cid for cid in run.presets["serving-cpu-bench"] if run.by_case.get(cid)]

    def caption(cold: set[str]) -> str:
        for bench in data["benchmarks"]:
            bench["extra_info"]["cold_l2"] = bench["extra_info"]["case"] in cold
        path = tmp_path / "cold.json"
        path.write_text(json.dumps(data))
        return table(load_run(path), "serving-cpu-bench").splitlines()[0]

    assert "L2" not in caption(set())
    assert "(eager timing, cold L2, " in caption(set(cases))
    assert "cold L2 but for 1 case whose input copies fit in it together" in caption(set(cases[1:]))


def with_fp8_twins(serving_results: Path, tmp_path: Path, ratio: float) -> tuple[Path, list[str]]:
    """The serving run with an fp8-cache twin of each ``serving-cpu-bench`` case, every benchmark of the twin
    ``ratio`` times its original's median, but naive's on the first twin left out (measured on one side only)."""
    data = json.loads(serving_results.read_text())
    fmha = data["fmha"]
    originals = list(fmha["presets"]["serving-cpu-bench"])
    twins = {cid: f"{cid}-kvfp8" for cid in originals}
    for cid, twin in twins.items():
        fmha["cases"][twin] = {**fmha["cases"][cid], "kv_dtype": "fp8"}
    fmha["presets"]["serving-cpu-bench"] = originals + list(twins.values())
    for bench in list(data["benchmarks"]):
        cid, impl = bench["extra_info"]["case"], bench["extra_info"]["impl"]
        if cid in twins and not (cid == originals[0] and impl == "naive"):
            copy = json.loads(json.dumps(bench))
            copy["extra_info"]["case"], copy["stats"]["median"] = twins[cid], bench["stats"]["median"] * ratio
            data["benchmarks"].append(copy)
    path = tmp_path / "twins.json"
    path.write_text(json.dumps(data))
    return path, list(twins.values())


def test_a_quantized_cache_is_set_against_its_16_bit_twin(serving_results, tmp_path):
    """Each fp8-cache case measured beside its twin (the same case over the case's dtype) gets, per implementation
    timed on both, its step time over the twin's: in the report's preset section and as a markdown table
    (``--twins``); a case whose twin was not measured, or an implementation timed on one side only, gets none."""
    from reports.__main__ import markdown
    from reports.build import cache_twins, leaderboard
    from reports.markdown import render_block, twins_table

    path, twins = with_fp8_twins(serving_results, tmp_path, 0.6)
    run = load_run(path)
    rows = cache_twins(run, "serving-cpu-bench")
    assert [row["case"] for row in rows] == twins and all(row["kv_dtype"] == "fp8" for row in rows)
    assert set(rows[0]["ratios"]) == {"sdpa"} and set(rows[1]["ratios"]) == {"naive", "sdpa"}
    assert all(ratio == pytest.approx(0.6) for row in rows for ratio in row["ratios"].values())
    assert cache_twins(dataclasses.replace(run, presets={"p": twins}), "p") == []  # no twin in the preset
    html = _section(write_report([path], tmp_path / "r.html").read_text(), "serving-cpu-bench")
    assert "A quantized KV cache against its 16-bit twin" in html and html.count("<td>0.60</td>") == 3
    text = twins_table(run, "serving-cpu-bench")
    assert "time of a step over the fp8 cache / the same step over a bf16 one" in text
    columns = [b["impl"] for b in leaderboard(run, "serving-cpu-bench")]  # the leaderboard's order
    assert text.splitlines()[2] == "| " + " | ".join(["case", *columns]) + " |" and set(columns) == {"naive", "sdpa"}
    cells = [dict(zip(columns, line.strip(" |").split(" | ")[1:], strict=True)) for line in text.splitlines()
             if "| 4 x " in line]
    assert cells == [{"naive": "-", "sdpa": "0.60"}, {"naive": "0.60", "sdpa": "0.60"}]
    assert "naive" not in twins_table(run, "serving-cpu-bench", impls=["sdpa"])
    printed = markdown([path], [])  # `python -m reports --markdown`: right after the preset's own table
    assert text in printed and printed.index(text) > printed.index("`serving-cpu-bench`, GB/s")
    with pytest.raises(ReportError, match="no quantized-cache case"):
        twins_table(load_run(serving_results), "serving-cpu-bench")
    with pytest.raises(ReportError, match="--ours does not apply to --twins"):
        render_block("twins.json --preset serving-cpu-bench --twins --ours sdpa", tmp_path, {})


def test_case_labels_leave_to_the_caption_what_every_case_shares():
    from reports.markdown import case_labels

    base = {"op": "paged", "batch": 64, "hq": 32, "hkv": 8, "sq": 1, "skv": 8192, "d": 128, "dtype": "bf16",
            "page_size": 16, "lengths": "uniform", "model": "llama3-8b", "window": [-1, -1], "softcap": 0.0}
    labels, shared = case_labels({"a": base, "b": {**base, "skv": 32768, "page_size": 64, "sq": 4}})
    assert labels == {"a": "64 x 8K, pages of 16, 1 new token", "b": "64 x 32K, pages of 64, 4 new tokens"}
    assert shared == ["llama3-8b", "paged", "uniform lengths", "h32:8", "D 128", "bf16"]
    alone, nothing = case_labels({"a": base})
    assert nothing == [] and alone["a"].startswith("llama3-8b, paged, 64 x 8K")


def test_a_documents_results_tables_are_rewritten_from_their_files_and_checked(serving_results, tmp_path):
    from reports.markdown import main, stale_blocks

    shutil.copy(serving_results, tmp_path / "run.json")
    doc = tmp_path / "doc.md"
    doc.write_text("Intro.\n\n<!-- results: run.json --preset models-cpu --impl sdpa -->\nold numbers\n"
                   "<!-- /results -->\n\nOutro.\n")
    assert stale_blocks(doc) == ["run.json --preset models-cpu --impl sdpa"]
    assert main([str(doc), "--check"]) == 1 and "old numbers" in doc.read_text()
    assert main([str(doc)]) == 0
    text = doc.read_text()
    assert "old numbers" not in text and "`models-cpu`, TFLOPS" in text and "naive" not in text
    assert text.startswith("Intro.") and text.endswith("<!-- /results -->\n\nOutro.\n")
    assert stale_blocks(doc) == [] and main([str(doc), "--check"]) == 0
    doc.write_text(text.replace("--impl sdpa", "--impl sdpa --bogus"))
    assert main([str(doc), "--check"]) == 2


@pytest.mark.parametrize("document", ["README.md", "docs/results.md"])
def test_published_tables_are_the_numbers_of_the_published_results(document):
    """Every results table of the README and of docs/results.md is what its file in docs/results/ gives now:
    `python -m reports.markdown README.md docs/results.md` rewrites them."""
    from reports.markdown import BLOCK, stale_blocks

    path = ROOT / document
    assert BLOCK.search(path.read_text()), f"{document} has no results table"
    assert stale_blocks(path) == []


def test_cli_prints_markdown_tables_and_refuses_options_it_would_ignore(results, tmp_path):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "reports", str(results), *args], cwd=ROOT, capture_output=True,
                              text=True)

    printed = cli("--markdown", "--ours", "naive")
    assert printed.returncode == 0 and "`cpu-bench`, TFLOPS" in printed.stdout
    assert "| ours / best peer |" in printed.stdout and not (tmp_path / "r.html").exists()
    written = cli("--markdown", "-o", str(tmp_path / "t.md"))
    assert written.returncode == 0 and (tmp_path / "t.md").read_text().startswith("`cpu-bench`")
    for args, words in ((("--ours", "naive"), "--ours applies to --markdown"),
                        (("--markdown", "--baseline", "naive"), "--baseline applies to the HTML report")):
        refused = cli(*args)
        assert refused.returncode == 2 and words in refused.stderr


def test_alternating_runs_are_summarised_case_by_case(serving_results, tmp_path):
    """scripts/ab_summary.py: each implementation's figure in every run given (GB/s for decode, TFLOPS for
    prefill) and, per pass, ours over the best other implementation."""
    run = load_run(serving_results)
    second = tmp_path / "second.json"
    shutil.copy(serving_results, second)  # a second pass that measured the same
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_summary.py"), "--ours", "naive",
                           str(serving_results), str(second)], cwd=ROOT, check=True, capture_output=True, text=True,
                          env=child_env())
    lines = proc.stdout.splitlines()
    for cid, per_impl in run.by_case.items():
        merit = "gbps" if run.cases[cid]["op"] == "paged" else "tflops"
        naive = getattr(per_impl["naive"], merit)
        (row,) = [line for line in lines if line.startswith(cid + " ") and " naive " in line and "median" in line]
        assert row.split()[2:4] == [f"{naive:.1f}"] * 2 and row.endswith(merit)
        ratios = [line.split(": ")[-1] for line in lines if line.startswith(cid + " ") and "per pass" in line]
        if "sdpa" in per_impl:  # sdpa refuses the window and softcap of some models' cases: no pair there
            sdpa = getattr(per_impl["sdpa"], merit)
            assert ratios == [f"{naive / sdpa:.3f} {naive / sdpa:.3f}"]
        else:
            assert ratios == []
    assert any("sdpa" in per_impl for per_impl in run.by_case.values())
