"""tools/: every tool answers --help with its description and an example on any machine, and the campaign runner
runs a CPU preset in steps that merge into one results file."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
PYTHON_TOOLS = sorted(p.stem for p in TOOLS.glob("*.py") if p.stem != "__init__")
SHELL_TOOLS = sorted(p.name for p in TOOLS.glob("*.sh"))


def help_text(command: list[str]) -> str:
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("name", PYTHON_TOOLS)
def test_a_python_tool_prints_its_description_and_an_example(name: str) -> None:
    summary = ast.get_docstring(ast.parse((TOOLS / f"{name}.py").read_text())).splitlines()[0]
    text = " ".join(help_text([sys.executable, "-m", f"tools.{name}", "--help"]).split())
    assert f"usage: python -m tools.{name}" in text
    assert " ".join(summary.split()) in text  # argparse rewraps nothing in a raw description, but be safe
    assert f"python -m tools.{name} " in text.split("usage:", 1)[1].split("example", 1)[1]  # the epilog's example


@pytest.mark.parametrize("name", SHELL_TOOLS)
def test_a_shell_tool_prints_its_usage_and_an_example(name: str) -> None:
    text = help_text(["bash", str(TOOLS / name), "--help"])
    assert text.startswith(f"usage: tools/{name}")
    assert f"tools/{name}" in text.split("example", 1)[1]


def test_the_tools_are_the_documented_set() -> None:
    """A tool added without its --help test would be caught above; this catches one dropped by mistake."""
    assert {"campaign", "publish_results", "sweep", "where_time_goes"} <= set(PYTHON_TOOLS)
    assert set(SHELL_TOOLS) == {"ci_clean_clone.sh", "gpu_checks.sh"}


def test_the_tuner_probe_builds_a_variant_from_field_changes() -> None:
    pytest.importorskip("cuda.tile")
    from impls.cutile.spaces import HOPPER_WIDE
    from tools.tuner_probe import changed

    variant = changed(HOPPER_WIDE, "tile_n=256,persistent=1,k_latency=3")
    assert (variant.tile_n, variant.persistent, variant.k_latency) == (256, True, 3)
    assert variant.tile_m == HOPPER_WIDE.tile_m
    with pytest.raises(AttributeError):
        changed(HOPPER_WIDE, "no_such_field=1")


def test_the_sweep_names_every_candidate_once() -> None:
    """The sweep's candidates build without a GPU (only their calls need one), each under a name of its own."""
    pytest.importorskip("triton")
    pytest.importorskip("cuda.tile")
    from tools.sweep import cutile_candidates, triton_candidates

    for found in (list(cutile_candidates(128)), list(cutile_candidates(96, extras=False)), list(triton_candidates())):
        names = [name for name, _ in found]
        assert names and len(names) == len(set(names))
    assert any(name.startswith("cutile-1-") for name, _ in cutile_candidates(64))  # the ladder, with extras


def test_the_serving_probe_compares_a_key_at_each_value_or_other_tiles() -> None:
    pytest.importorskip("triton")
    from impls.triton_fa.paged import DECODE_SPACE
    from tools.serving_probe import comparison_spaces, values_arg

    assert values_arg("PDL") == ("PDL", {"off": False, "on": True})
    assert values_arg("PLAN_MIN_TILES=1,4") == ("PLAN_MIN_TILES", {"1": 1, "4": 4})
    spaces = comparison_spaces(values_arg("PLAN_MIN_TILES=1,4"), [])
    assert list(spaces) == ["PLAN_MIN_TILES 1", "PLAN_MIN_TILES 4"]
    assert all(len(space) == len(DECODE_SPACE) for space in spaces.values())
    assert {config["PLAN_MIN_TILES"] for config in spaces["PLAN_MIN_TILES 4"]} == {4}
    spaces = comparison_spaces(None, [(128, 8, 5)])
    assert spaces["space"] == DECODE_SPACE and {c["BLOCK_N"] for c in spaces["tiles"]} == {128}
    assert comparison_spaces(None, []) is None


def test_a_campaign_runs_in_steps_resumes_and_merges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four benchmarks in steps of at most three tests, then a correctness check: one merged file with each test
    once, which the report reads; run again, the campaign has nothing left to do; with no time, it says so."""
    from reports.build import load_run
    from tools import campaign

    monkeypatch.chdir(ROOT)
    out = tmp_path / "cpu.json"
    common = "suite --grid cpu-bench --impl naive -p no:cacheprovider -q"
    runs = ["--run", f"{common} -k benchmark", "--run", f"{common} -k 'correctness and full-h2:2-s128'"]
    assert campaign.main([str(out), "--step-tests", "3", *runs]) == 0
    states = [json.loads(p.read_text()) for p in sorted((tmp_path / "cpu.parts").glob("*.state.json"))]
    assert [s["status"] for s in states] == ["done", "done"]
    assert states[0]["steps"] >= 2  # resumed at least once, deselecting what had finished
    merged = json.loads(out.read_text())
    names = [b["name"] for b in merged["benchmarks"]]
    assert len(names) == len(set(names)) == 4
    phases = sorted(o["phase"] for o in merged["fmha"]["outcomes"])
    assert phases == ["benchmark"] * 4 + ["correctness"]
    assert len(load_run(out).measurements) == 4
    before = out.read_text()
    assert campaign.main([str(out), "--step-tests", "3", *runs]) == 0  # all done: no step runs
    assert out.read_text() == before
    other = tmp_path / "later.json"
    assert campaign.main([str(other), "--total-seconds", "0", *runs]) == campaign.EXIT_MORE
    assert not other.exists()


def test_first_call_cases_round_trip_through_their_text_form() -> None:
    from suite.presets import preset
    from tools.first_call import DEFAULT_CASES, case_text, parse_case

    for case in preset("models-cpu") + preset("serving-cpu") + preset("mla-cpu"):
        assert parse_case(case_text(case)) == case
    assert all(parse_case(text) for text in DEFAULT_CASES)
    with pytest.raises(Exception, match="FIELD=VALUE"):
        parse_case("batch=1,heads=2")


def test_first_call_checks_the_answer_and_summarises_picks_against_tunes() -> None:
    from tools.first_call import measure, parse_case, summary

    row = measure("naive", parse_case("batch=1,hq=2,hkv=1,sq=33,skv=40,d=64,causal=1"), False, 1)
    assert row["status"] == "ok" and row["correct"] and row["first_call_s"] >= 0
    lines = summary([{"impl": "triton", "preset": "blog", "pick_over_tuned": r} for r in (1.0, 1.08)])
    assert lines == ["triton blog: 2 cases, pick / tuned geomean 1.0392, worst 1.0800"]
