"""The report: built from real suite output, escaped, strict about its input, and clean in a browser."""

import dataclasses
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reports.build import ReportError, load_run, render, write_report
from suite.isolation import child_env

ROOT = Path(__file__).resolve().parent.parent


def bench_run(out: Path, impls: list[str], grids: list[str]) -> Path:
    """A real benchmark run of the suite on the CPU, of ``impls`` on the tiny cases of ``grids``, as ``out``."""
    cmd = [sys.executable, "-m", "pytest", "suite", "--benchmark-only", "-q", "-p", "no:cacheprovider",
           *(f"--impl={impl}" for impl in impls), *(f"--grid={grid}" for grid in grids), "--rounds", "2",
           "--round-ms", "1", f"--benchmark-json={out}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=child_env())
    return out


CPU_BENCH = (["naive", "sdpa-math"], ["cpu-bench"])  # two implementations on four dense cases
SERVING_BENCH = (["naive", "sdpa"], ["serving-cpu-bench", "models-cpu"])  # decode over a paged cache; models


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return bench_run(tmp_path_factory.mktemp("bench") / "bench.json", *CPU_BENCH)


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
    assert "mJ / call" not in html and "(700," not in html  # a CPU run: no column that nothing fills
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
    # table shows a short label, and folded under it the whole config and each finalist's settled time per call
    # and the search's, fastest first, not a dict's repr.
    data = json.loads(results.read_text())
    finalists = [{"variant": "128x128:persistent:peeled", "search_us": 5390.0, "settled_us": 5571.6},
                 {"variant": "128x256:persistent:peeled", "search_us": 5412.3, "settled_us": 5398.1}]
    data["benchmarks"][0]["extra_info"]["config"] = {"tile_m": 128, "tile_n": 256, "num_worker_warps": 8,
                                                     "chosen": "tuning cache", "finalists": finalists}
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps(data))
    html = write_report([tuned], tmp_path / "t.html").read_text()
    assert ('<details class="config"><summary>128×256 · 8 warps · tuned here</summary>'
            "<code>tile_m=128, tile_n=256, num_worker_warps=8, chosen=tuning cache</code>") in html
    rows = re.findall(r'<tr><td class="l"><code>([^<]+)</code></td><td>([^<]+)</td><td>([^<]+)</td></tr>', html)
    assert rows[:2] == [("128x256:persistent:peeled", "5398", "5412"), ("128x128:persistent:peeled", "5572", "5390")]
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
    cells = re.findall(r'<td class="sm">(\d{4}|–)</td>', html)
    assert {"1396", "–"} <= set(cells)


def test_rounds_that_drifted_while_timed_are_flagged(results, tmp_path):
    from reports.runs import DRIFT_FLAG, round_drift

    assert round_drift([1.0, 1.0, 1.04, 1.04, 1.1]) is None  # too few rounds to tell
    assert round_drift([1.0, 1.0, 1.0, 1.04, 1.04, 1.04]) == pytest.approx(0.04 / 1.02)
    assert round_drift([1.1, 1.0, 1.0, 1.0, 1.0, 1.0]) == 0.0  # one slow first round is not a trend
    data = json.loads(results.read_text())
    html = write_report([results], tmp_path / "plain.html").read_text()
    assert "Rounds that drifted" not in html  # two rounds each: nothing to flag
    drifting, steady = data["benchmarks"][0], data["benchmarks"][1]
    drifting["stats"]["data"] = [1.071, 1.082, 1.104, 1.112, 1.112, 1.107, 1.099]  # H200, Mistral 4 x 4K
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
    assert "within 10% of the case's best" in html and f"0.0500 <code>{first}</code>" in html


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
        ('{"benchmarks": [1,, 2], "fmha": {}}', "not valid JSON at line 1 column 19"),
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


def test_a_file_that_is_not_a_run_is_named_so_apart_from_a_truncated_one(results, tmp_path):
    """A README given by mistake is "not a JSON run file"; a gzip or JSON cut short says it was truncated."""
    readme = tmp_path / "README.md"
    readme.write_text("# fmha-bench\n\nFlash attention, side by side.\n")
    with pytest.raises(ReportError, match=r"README\.md is not a JSON run file") as info:
        load_run(readme)
    assert "truncated" not in str(info.value) and str(readme) in str(info.value)
    binary = tmp_path / "report.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ReportError, match=r"report\.png is not a JSON run file"):
        load_run(binary)
    whole = gzip.compress(results.read_bytes())
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ReportError, match="a truncated or damaged gzip file"):
        load_run(cut)
    cut.write_bytes(gzip.compress(results.read_bytes()[:-100]))
    with pytest.raises(ReportError, match=re.escape("not valid JSON (truncated?)")):
        load_run(cut)


def test_cli_exit_code_and_message(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    proc = subprocess.run([sys.executable, "-m", "reports", str(bad), "-o", str(tmp_path / "r.html")],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "bad.json: not valid JSON" in proc.stderr
    readme = subprocess.run([sys.executable, "-m", "reports", str(ROOT / "README.md")], cwd=ROOT,
                            capture_output=True, text=True)
    assert readme.returncode == 2 and "README.md is not a JSON run file" in readme.stderr


def test_cli_help_is_plain_text():
    """No reST markup (double backticks) in ``--help``: it is read in a terminal."""
    proc = subprocess.run([sys.executable, "-m", "reports", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "--baseline NAME" in proc.stdout and "best other implementation" in proc.stdout
    assert "``" not in proc.stdout and "`" not in proc.stdout


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
    """A run made in two parts (the contenders, then the rest): publish_results.py joins their JSONs."""
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
    subprocess.run([sys.executable, str(ROOT / "tools" / "publish_results.py"), *map(str, parts), str(published)],
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
    return bench_run(tmp_path_factory.mktemp("serving") / "serving.json", *SERVING_BENCH)


def _section(html: str, preset: str) -> str:
    """The HTML of one preset's section of a report."""
    start = html.index(f'id="preset-{preset}"')
    end = html.find('<h2 id="', start)
    return html[start:end if end >= 0 else None]


def test_a_line_chart_holds_only_cases_that_differ_in_length(serving_results):
    from reports.cases import case_parts, chart_groups, chart_key

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
    """Decode ranks by GB/s whichever run comes first, and each GPU's HBM line is drawn (a report whose first run
    had no decode once charted the serving preset in TFLOPS, without the roofline)."""
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
    from reports.runs import by_figure_of_merit

    cases = {"d1": {"op": "paged"}, "d2": {"op": "paged"}, "p1": {"op": "varlen"}, "x": {"op": "dense"}}
    split = by_figure_of_merit({"models-serving": ["d1", "p1", "d2"], "blog": ["x"], "serving": ["d1", "d2"]}, cases)
    assert split == {"models-serving: decode": ["d1", "d2"], "models-serving: prefill": ["p1"], "blog": ["x"],
                     "serving": ["d1", "d2"]}


def test_a_case_ranks_by_the_merit_its_run_recorded():
    """A dense decode step recorded as ``gbps`` ranks by GB/s; an older file, which records none, ranks paged
    decode by GB/s and the rest by TFLOPS."""
    from reports.runs import figure_of_merit

    assert figure_of_merit([{"op": "dense", "merit": "gbps"}] * 2) == "gbps"
    assert figure_of_merit([{"op": "dense", "merit": "gbps"}, {"op": "dense", "merit": "tflops"}]) == "tflops"
    assert figure_of_merit([{"op": "paged"}]) == "gbps" and figure_of_merit([{"op": "dense", "sq": 1}]) == "tflops"
    assert figure_of_merit([]) == "tflops"


def test_the_overview_comes_first_a_heat_map_and_a_sentence_per_preset(serving_results, tmp_path):
    """The answer first: a heat map of each implementation's rate over each case's best and a sentence naming the
    leader, per preset, before any detail; the environment after the results."""
    from reports.overview import standing

    html = write_report([serving_results], tmp_path / "r.html").read_text()
    order = [html.index(marker) for marker in ('id="overview"', 'id="method"', 'id="preset-', 'id="correctness"',
                                               'id="environment"')]
    assert order == sorted(order)
    overview = html[order[0]:order[1]]
    assert overview.count('class="heatmap"') >= 2 and overview.count('class="verdict"') == 2
    run = load_run(serving_results)
    board = standing(run, "serving-cpu-bench")
    assert board["unit"] == "GB/s" and {r["impl"] for r in board["rows"]} == {"naive", "sdpa"}
    cases = [cid for chunk in board["chunks"] for cid, _ in chunk]
    for cid in cases:
        cells = [r["cells"][cid] for r in board["rows"] if cid in r["cells"]]
        assert max(c["ratio"] for c in cells) == 1.0 and sum(c["win"] for c in cells) == 1
    leader = board["rows"][0]["impl"]
    assert board["sentence"].startswith(f"serving-cpu-bench (GB/s): {leader} leads, the best on ")
    assert "none of our kernels (cutile*, triton*) was measured" in board["sentence"]
    mine = standing(run, "serving-cpu-bench", ours=["naive"])["sentence"]
    other = "sdpa" if leader == "naive" else "naive"
    assert re.search(rf"against it, on the cases both ran: {other}( \(best peer\))? \d[\d.e-]*×\.$", mine), mine


def test_speedups_are_against_the_best_peer_or_the_baseline_where_the_case_has_it(serving_results):
    from reports.build import case_table

    run = load_run(serving_results)
    cid = next(c for c, per_impl in run.by_case.items() if {"naive", "sdpa"} <= set(per_impl))
    naive, sdpa = run.by_case[cid]["naive"], run.by_case[cid]["sdpa"]
    rows = {r["impl"]: r for r in case_table(run, cid, None)}  # each against the other: its best peer
    assert rows["naive"]["speedup"] == pytest.approx(sdpa.median_s / naive.median_s)
    assert rows["sdpa"]["speedup"] == pytest.approx(naive.median_s / sdpa.median_s)
    assert rows["naive"]["speedup_vs"] == "sdpa" and rows["sdpa"]["speedup_vs"] == "naive"
    rows = {r["impl"]: r for r in case_table(run, cid, "sdpa")}
    assert rows["sdpa"]["speedup"] == 1.0 and rows["sdpa"]["speedup_vs"] is None
    assert rows["naive"]["speedup"] == pytest.approx(sdpa.median_s / naive.median_s)
    rows = case_table(run, cid, "flash-attn4")  # not in this run: the best peer stands in, and says so
    assert all(r["speedup"] and r["speedup_vs"] in {"naive", "sdpa"} for r in rows)


def test_a_line_needs_three_lengths_fewer_make_bars(serving_results, tmp_path):
    """The serving cases come in two cache lengths: grouped bars. A third length of the same shape makes a line."""
    html = _section(write_report([serving_results], tmp_path / "two.html").read_text(), "serving-cpu-bench")
    assert 'data-kind="bars" data-points="2"' in html and 'data-kind="line"' not in html
    data = json.loads(serving_results.read_text())
    fmha, first = data["fmha"], data["fmha"]["presets"]["serving-cpu-bench"][0]
    longer = {**fmha["cases"][first], "skv": 4 * max(fmha["cases"][c]["skv"] for c in fmha["presets"]
                                                      ["serving-cpu-bench"])}
    fmha["cases"]["longer"], fmha["presets"]["serving-cpu-bench"] = longer, [*fmha["presets"]["serving-cpu-bench"],
                                                                            "longer"]
    for bench in [b for b in data["benchmarks"] if b["extra_info"]["case"] == first]:
        data["benchmarks"].append({**bench, "extra_info": {**bench["extra_info"], "case": "longer"}})
    three = tmp_path / "three.json"
    three.write_text(json.dumps(data))
    html = _section(write_report([three], tmp_path / "three.html").read_text(), "serving-cpu-bench")
    assert 'data-kind="line" data-points="3"' in html and 'data-kind="bars"' not in html
