"""Markdown tables of a run: for READMEs and pull requests, and documents whose tables are made from results files."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reports.build import write_report
from reports.runs import ReportError, load_run
from suite.isolation import child_env
from tests.test_report import CPU_BENCH, ROOT, SERVING_BENCH, _section, bench_run


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return bench_run(tmp_path_factory.mktemp("bench") / "bench.json", *CPU_BENCH)


@pytest.fixture(scope="module")
def serving_results(tmp_path_factory) -> Path:
    return bench_run(tmp_path_factory.mktemp("serving") / "serving.json", *SERVING_BENCH)


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


def with_mixed_steps(serving_results: Path, tmp_path: Path) -> Path:
    """The serving run with ``serving-mixed-cpu``'s first step, its two parts (ranked by another figure of merit
    than the step: the preset splits in two sections) and a step whose parts are missing, every benchmark a copy of
    one measured case's with the median set (and the figures of merit with it): sdpa 1 ms a part and 1.5 the
    step, naive 1.2 and 3."""
    from suite.presets import PRESETS

    data = json.loads(serving_results.read_text())
    fmha, template = data["fmha"], data["benchmarks"][:2]
    step, lone = (c for c in PRESETS["serving-mixed-cpu"] if c.mixed_parts())
    cases = {step: "gbps", step.mixed_parts()["decode"]: "gbps", step.mixed_parts()["prefill"]: "tflops", lone: "gbps"}
    for case, merit in cases.items():
        params = json.loads(json.dumps(case.as_dict()))  # as a run stores it: tuples as lists
        fmha["cases"][case.id] = {**params, "preset": "serving-mixed-cpu", "merit": merit}
        for bench in template:
            copy = json.loads(json.dumps(bench))
            impl = copy["extra_info"]["impl"]
            copy["extra_info"]["case"] = case.id
            whole = case.batch and case.chunks
            # sdpa leads every part too, so the leaderboard's order (the table's) does not rest on a tie
            median = {"sdpa": 1.5e-3}.get(impl, 3e-3) if whole else {"sdpa": 1e-3}.get(impl, 1.2e-3)
            copy["stats"]["median"] = median
            # the figures of merit (what the leaderboard ranks) follow the median, not the template's own timing
            copy["extra_info"].update(gbps=1e-3 / median, tflops=1e-3 / median)
            data["benchmarks"].append(copy)
    fmha["presets"]["serving-mixed-cpu"] = [c.id for c in cases]
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(data))
    return path


def test_a_mixed_step_is_set_against_its_parts_timed_apart(serving_results, tmp_path):
    """Each mixed step measured beside both its parts gets, per implementation timed on all three, the three times
    and the step's over the parts' sum (bold where at most 1): once, in the first section of its split preset, and
    as a markdown table (``--parts``); a step whose parts were not measured gets none."""
    from reports.__main__ import markdown
    from reports.build import step_parts
    from reports.markdown import parts_table, render_block

    path = with_mixed_steps(serving_results, tmp_path)
    run = load_run(path)
    first, second = "serving-mixed-cpu: decode", "serving-mixed-cpu: prefill"
    assert first in run.presets and second in run.presets and step_parts(run, second) == []
    rows = step_parts(run, first)
    assert [row["case"] for row in rows] == [run.presets[first][0]] and rows[0]["prefill"] in run.presets[second]
    assert {impl: t["ratio"] for impl, t in rows[0]["times"].items()} == pytest.approx({"sdpa": 0.75, "naive": 1.25})
    html = write_report([path], tmp_path / "r.html").read_text()
    section = _section(html, first)
    assert "A mixed step against its parts" in section and "A mixed step" not in _section(html, second)
    assert "<strong>0.75</strong>" in section and "<td>1.25</td>" in section
    text = parts_table(run, first)
    lines = [line for line in text.splitlines() if line.startswith("| ") and "implementation" not in line]
    assert [line.split(" | ")[1:] for line in lines] == [["sdpa", "1.5", "1", "1", "**0.75** |"],
                                                        ["naive", "3", "1.2", "1.2", "1.25 |"]]
    assert "naive" not in parts_table(run, first, impls=["sdpa"]) and text in markdown([path], [])
    with pytest.raises(ReportError, match="no mixed step"):
        parts_table(run, second)
    with pytest.raises(ReportError, match="--ours does not apply to --parts"):
        render_block("mixed.json --preset x --parts --ours sdpa", tmp_path, {})


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
    """tools/ab_summary.py: each implementation's figure in every run given (GB/s for decode, TFLOPS for
    prefill) and, per pass, ours over the best other implementation."""
    run = load_run(serving_results)
    second = tmp_path / "second.json"
    shutil.copy(serving_results, second)  # a second pass that measured the same
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "ab_summary.py"), "--ours", "naive",
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


def test_cli_names_an_unknown_implementation_and_the_ones_there_are(results):
    """`--ours nosuch` (or `--baseline nosuch`) is an error that names the unknown name and the run's own names,
    not an empty column, nor speedups quietly against another implementation."""
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "reports", str(results), *args], cwd=ROOT, capture_output=True,
                              text=True)

    for args, option in ((("--markdown", "--ours", "nosuch"), "--ours"), (("--baseline", "nosuch"), "--baseline")):
        refused = cli(*args)
        assert refused.returncode == 2 and refused.stdout == ""
        assert f"{option} nosuch" in refused.stderr and "available: naive, sdpa-math" in refused.stderr
    assert cli("--markdown", "--ours", "sdpa*").returncode == 0  # a glob that matches is fine
