"""What a run says at its end: a compact table per preset in the report's units, the implementations that ran and
those that could not, the report's path last; and which tests the fast tier keeps."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import impls
from reports.build import Measurement, Run
from suite.isolation import child_env
from suite.recording import RunState
from suite.summary import implementation_lines, number, preset_table
from tests.tiers import first_fast, only_fast

ROOT = Path(__file__).resolve().parent.parent


def measurement(impl: str, case: str, median_s: float, tflops: float) -> Measurement:
    return Measurement(impl=impl, family=impl, case=case, fields={}, median_s=median_s, iqr_s=0.0, stddev_s=0.0,
                       rounds=5, tflops=tflops, pct_of_peak=None, gbps=None, peak_memory_bytes=None,
                       max_error=None, config={})


def dense_case(sq: int, causal: bool) -> dict:
    return {"op": "dense", "batch": 1, "hq": 2, "hkv": 2, "sq": sq, "skv": sq, "d": 64, "dtype": "fp32",
            "causal": causal, "merit": "tflops"}


def test_a_preset_table_ranks_by_the_geomean_and_gives_each_case_in_ms():
    cases = {"a": dense_case(128, False), "b": dense_case(256, False)}
    run = Run(label="cpu", path="x.json", env={}, outcomes=[], unavailable={}, presets={"cpu-bench": ["a", "b"]},
              cases=cases, measurements=[measurement("slow", "a", 2e-3, 1.0), measurement("slow", "b", 4e-3, 1.0),
                                         measurement("fast", "a", 1e-3, 2.0), measurement("fast", "b", 2e-3, 8.0)])
    preset, lines = preset_table(run, "cpu-bench")
    assert preset == "cpu-bench"
    assert lines[0].startswith("TFLOPS (geomean), median ms per case; eager timing; every case dense")
    header, first, second = (line.split() for line in lines[1:])
    assert header[0] == "TFLOPS" and first == ["fast", "4", "1", "2"] and second == ["slow", "1", "2", "4"]
    assert number(None) == "-" and number(1234.5) == "1234" and number(0.012345) == "0.0123"


def test_the_implementation_lines_say_what_ran_and_why_the_others_could_not():
    naive, sdpa = impls.get("naive"), impls.get("sdpa")
    state = RunState(device=torch.device("cpu"), impls=[naive, sdpa], unavailable={"cutile": "runs on cuda only"})
    outcomes = [{"impl": "naive", "status": "passed"},
                {"impl": "sdpa", "status": "unsupported", "message": "sdpa: softcap not supported"}]
    assert implementation_lines(state, outcomes) == [
        "1 implementation ran: naive", "2 could not:", "  cutile: runs on cuda only",
        "  sdpa: unsupported on every case (sdpa: softcap not supported)"]


def test_a_benchmark_run_deselects_the_checks_and_ends_with_the_reports_path(tmp_path):
    report = tmp_path / "report.html"
    cmd = [sys.executable, "-m", "pytest", "suite", "--benchmark-only", "-p", "no:cacheprovider", "--impl", "naive",
           "--grid", "varlen-cpu-bench", "--rounds", "2", "--round-ms", "1", f"--benchmark-json={tmp_path / 'b.json'}",
           f"--report={report}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env())
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert report.exists() and lines[-1] == f"fmha-bench: report written to {report}"
    assert "deselected" in done.stdout and "SKIPPED" not in done.stdout and "Skipping" not in done.stdout
    assert "Name (time in us)" not in done.stdout  # pytest-benchmark's own table only with --benchmark-table
    assert "varlen-cpu-bench" in done.stdout and "1 implementation ran: naive" in done.stdout
    assert len(lines) < 60


def test_the_tier_helpers_mark_all_but_the_fast_parameters_slow():
    def slow(param) -> bool:
        return any(mark.name == "slow" for mark in getattr(param, "marks", ()))

    assert [slow(p) for p in first_fast([1, 2, 3])] == [False, True, True]
    assert [slow(p) for p in only_fast([(1, "a"), (2, "b")], [(2, "b")], unpack=True)] == [True, False]
    assert only_fast([(1, "a")], [], unpack=True)[0].values == (1, "a")
    assert first_fast([pytest.param(1, id="one"), pytest.param(2, id="two")])[1].id == "two"
