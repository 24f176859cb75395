"""A training preset in the report: one section, leaderboard and heat map per mode (forward, backward, fwd+bwd),
and the three side by side with the step's time against its parts and the backward's peak memory."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from reports.build import load_run, write_report
from reports.runs import by_training_mode
from reports.training import dq_float32_bytes, training_modes
from suite.cases import Case
from tests.test_report import bench_run

SHAPES = (Case(1, 4, 2, 100, 100, 64, "fp16", True), Case(2, 2, 1, 40, 40, 128, "fp16", False))
MIB = 2**20


def fake_run(path: Path, medians: dict[tuple[str, str], float], peaks: dict[str, int]) -> Path:
    """A GPU run of each shape in the three modes: ``medians[impl, op]`` seconds on every shape, the backward's peak
    bytes ``peaks[impl]``."""
    benchmarks, cases = [], {}
    for shape in SHAPES:
        for (impl, op), median in medians.items():
            case = replace(shape, op=op)
            cases[case.id] = {**case.as_dict(), "preset": "train", "merit": "tflops"}
            info = {**case.as_dict(), "impl": impl, "family": impl, "case": case.id, "timing": "graph",
                    "measured_as": "graph", "tflops": 1 / median, "gpu": {"name": "NVIDIA H200", "uuid": "GPU-1"},
                    "peak_memory_bytes": peaks[impl] if op == "backward" else None}
            benchmarks.append({"name": f"test_benchmark[{impl}-{case.id}]", "extra_info": info,
                               "stats": {"median": median, "iqr": 0.0, "rounds": 5, "data": [median] * 5}})
    fmha = {"outcomes": [], "unavailable": {}, "presets": {"train": list(cases)}, "cases": cases, "device": "cuda"}
    path.write_text(json.dumps({"benchmarks": benchmarks, "fmha": fmha}))
    return path


MEDIANS = {("sdpa", "dense"): 1.0, ("sdpa", "backward"): 2.0, ("sdpa", "fwdbwd"): 3.3,
           ("triton", "dense"): 2.0, ("triton", "backward"): 1.0, ("triton", "fwdbwd"): 2.4}


def test_a_preset_of_training_modes_becomes_one_section_per_mode():
    cases = {"f": {"op": "dense"}, "b": {"op": "backward"}, "s": {"op": "fwdbwd"}, "p": {"op": "paged"}}
    split = by_training_mode({"train": ["f", "b", "s"], "bwd": ["b"], "blog": ["f"], "mixed": ["f", "p"]}, cases)
    assert split == {"train: forward": ["f"], "train: backward": ["b"], "train: fwd+bwd": ["s"], "bwd": ["b"],
                     "blog": ["f"], "mixed": ["f", "p"]}


def test_the_three_modes_side_by_side_with_the_step_against_its_parts_and_the_backward_memory(tmp_path):
    dq = dq_float32_bytes(SHAPES[0].as_dict())
    run = load_run(fake_run(tmp_path / "run.json", MEDIANS, {"sdpa": 10 * MIB, "triton": 10 * MIB + dq}))
    assert list(run.presets) == ["train: forward", "train: backward", "train: fwd+bwd"]
    assert training_modes(run, "train: backward") is None  # shown once, with the first mode
    table = training_modes(run, "train: forward")
    assert table["modes"] == ["forward", "backward", "fwd+bwd"] and table["preset"] == "train"
    rows = {(r["shape"], r["impl"]): r for r in table["rows"]}
    assert len(rows) == 4
    ours = next(r for (shape, impl), r in rows.items() if impl == "triton" and "h4:2" in shape)
    assert ours["tflops"] == {"forward": 0.5, "backward": 1.0, "fwd+bwd": pytest.approx(1 / 2.4)}
    assert ours["step_over_parts"] == pytest.approx(2.4 / 3.0)
    assert ours["within_bound"] is True and ours["bwd_mib"] == pytest.approx(10 + dq / MIB)
    peer = next(r for (_, impl), r in rows.items() if impl == "sdpa")
    assert peer["within_bound"] is None  # the bound is ours to keep
    over = load_run(fake_run(tmp_path / "over.json", MEDIANS, {"sdpa": 10 * MIB, "triton": 10 * MIB + 2 * dq}))
    assert {r["within_bound"] for r in training_modes(over, "train: forward")["rows"] if r["ours"]} == {False}


def test_the_report_ranks_each_mode_and_names_each_ones_leader(tmp_path):
    html = write_report([fake_run(tmp_path / "run.json", MEDIANS, {"sdpa": MIB, "triton": MIB})],
                        tmp_path / "r.html").read_text()
    text = " ".join(re.sub(r"<[^>]+>", " ", html).split())
    assert "Forward, backward and a training step side by side" in text
    assert "train: forward (TFLOPS): sdpa leads" in text
    assert "train: backward (TFLOPS): triton leads" in text and "train: fwd+bwd (TFLOPS): triton leads" in text
    assert html.count('class="leaderboard"') == 3 and html.count('class="training"') == 1


@pytest.mark.slow
def test_a_cpu_run_of_the_backward_preset_reports_every_mode(tmp_path):
    """The suite's own output: bwd-cpu in its three modes, naive and our Triton kernels (interpreted)."""
    results = bench_run(tmp_path / "bwd.json", ["naive", "triton"], ["bwd-cpu"])
    run = load_run(results)
    table = training_modes(run, "bwd-cpu: forward")
    assert table and table["modes"] == ["forward", "backward", "fwd+bwd"]
    measured = {(r["shape"], r["impl"]) for r in table["rows"] if len(r["tflops"]) == 3}
    assert len(measured) == 2 * 5  # both implementations, every shape, every mode
    assert not table["memory"]  # a CPU run measures no device memory
    html = write_report([results], tmp_path / "r.html").read_text()
    assert "bwd-cpu: fwd+bwd" in html
