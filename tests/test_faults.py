"""One bad implementation must not cost the rest of the run: hangs, crashes, huge allocations, errors.

Each test starts a real suite run in a subprocess with the broken implementations of ``broken_impls.py``
loaded as a plugin, then reads the results JSON that run leaves behind.
"""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from reports.build import load_run
from suite.isolation import child_env, heartbeat_span, read_heartbeat
from tests.tiers import first_fast

ROOT = Path(__file__).resolve().parent.parent


def run_suite(tmp_path: Path, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    results = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "pytest", "suite", "-p", "tests.broken_impls", "-p", "no:cacheprovider",
           "--grid", os.environ.get("FMHA_FAULT_GRID", "cpu-bench"), "--rounds", "2", "--round-ms", "1",
           f"--benchmark-json={results}", *args]
    env = {**child_env(), "FMHA_ISOLATE_DIR": str(tmp_path / "isolate")}  # --isolate's children's files stay here
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert results.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(results.read_text())


def statuses(data: dict, impl: str) -> Counter:
    return Counter(o["status"] for o in data["fmha"]["outcomes"] if o["impl"] == impl)


@pytest.mark.slow
def test_a_hang_and_a_process_killing_fault_cost_only_their_case(tmp_path):
    """Under --isolate, in one run: a hang is ended by the case timeout, a crash kills only its child process;
    every number measured before and after survives."""
    proc, data = run_suite(tmp_path, "--benchmark-only", "--isolate", "--case-timeout", "4",
                           "--impl", "naive", "--impl", "broken-hang", "--impl", "broken-crash")
    assert statuses(data, "naive") == {"passed": 4}
    assert statuses(data, "broken-hang") == {"passed": 3, "timed out": 1}
    timed_out = next(o for o in data["fmha"]["outcomes"] if o["status"] == "timed out")
    assert timed_out["case"].startswith("fp32-causal-h2:2-s256x256-d64")  # the benchmark's id: case and mode
    assert "timed out after 4 s" in timed_out["message"]
    assert statuses(data, "broken-crash") == {"passed": 3, "failed": 1}
    died = next(o for o in data["fmha"]["outcomes"] if o["status"] == "failed")
    assert "process died" in died["message"]
    timed = Counter(b["extra_info"]["impl"] for b in data["benchmarks"])
    assert timed == {"naive": 4, "broken-hang": 3, "broken-crash": 3}
    assert load_run(tmp_path / "results.json").measurements
    assert proc.returncode == 1  # the timeout and the crash are failures of the run, reported, not hidden


def test_a_killed_run_leaves_a_valid_json_of_what_finished(tmp_path):
    proc, _data = run_suite(tmp_path, "--benchmark-only", "--impl", "naive", "--impl", "broken-crash")
    assert proc.returncode != 0  # the whole process died: no isolation here
    run = load_run(tmp_path / "results.json")
    assert len(run.measurements) >= 3  # the three cases before the last one, at least
    assert {m.impl for m in run.measurements} >= {"broken-crash"}


def test_out_of_memory_is_reported_with_the_bytes_and_the_run_goes_on(tmp_path):
    proc, data = run_suite(tmp_path, "-k", "correctness", "--impl", "broken-alloc", "--impl", "naive")
    assert proc.returncode == 0, proc.stdout[-2000:]
    ooms = [o for o in data["fmha"]["outcomes"] if o["impl"] == "broken-alloc"]
    assert len(ooms) == 4
    assert all(o["status"] == "out of memory" for o in ooms)
    assert all(f"asked for {1 << 60} bytes" in o["message"] for o in ooms)
    assert statuses(data, "naive") == {"passed": 4}


def test_an_error_mid_run_fails_that_case_only(tmp_path):
    proc, data = run_suite(tmp_path, "--benchmark-only", "--impl", "broken-raise", "--impl", "naive")
    assert proc.returncode == 1
    assert statuses(data, "broken-raise") == {"passed": 2, "failed": 2}
    failed = [o for o in data["fmha"]["outcomes"] if o["status"] == "failed"]
    assert all("kernel exploded mid-run" in o["message"] for o in failed)
    timed = Counter(b["extra_info"]["impl"] for b in data["benchmarks"])
    assert timed == {"naive": 4, "broken-raise": 2}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_side_fault_costs_only_that_implementation(tmp_path):
    _proc, data = run_suite(tmp_path, "-k", "correctness", "--isolate", "--impl", "broken-oob", "--impl", "naive")
    assert statuses(data, "naive") == {"passed": 4}
    bad = [o for o in data["fmha"]["outcomes"] if o["impl"] == "broken-oob"]
    assert bad and all(o["status"] == "failed" for o in bad)
    assert any("illegal memory access" in o["message"] or "process died" in o["message"] for o in bad)


@pytest.mark.slow
def test_a_worker_that_dies_under_xdist_costs_only_its_case(tmp_path):
    """pytest-xdist replaces a worker that died; the case is recorded as failed, is not run again (it would kill
    the replacement too), and the rest of the run stands. Here it is the last test of the run: a dead worker's
    requeued group once left the run waiting for ever."""
    proc, data = run_suite(tmp_path, "-k", "correctness", "-n", "2", "--dist", "loadgroup",
                           "--max-worker-restart", "1", "--impl", "naive", "--impl", "broken-crash")
    assert statuses(data, "naive") == {"passed": 4}
    crash = statuses(data, "broken-crash")
    assert crash == {"passed": 3, "failed": 1}
    died = [o for o in data["fmha"]["outcomes"] if o["status"] == "failed"]
    assert all(o["case"] == "fp32-causal-h2:2-s256x256-d64" and "worker process died" in o["message"] for o in died)
    assert proc.returncode == 1


def test_a_heartbeat_cut_short_by_a_kill_still_reads(tmp_path):
    """The heartbeat file of a stopped run ends in a torn line: the events before it still count."""
    path = tmp_path / "run.hb"
    events = [("start", "a", 10.0), ("finish", "a", 12.5), ("start", "b", 12.6), ("finish", "b", 15.0),
              ("start", "c", 15.1)]
    path.write_text("".join(json.dumps({"event": e, "nodeid": n, "t": t}) + "\n" for e, n, t in events)
                    + '{"event": "fin')
    assert heartbeat_span(path) == (2, 5.1)
    assert read_heartbeat(path) == ({"a", "b"}, "c", 15.1)
    assert heartbeat_span(tmp_path / "missing.hb") == (0, 0.0)


def test_inputs_that_outgrow_the_free_memory_are_reported_and_the_run_goes_on(tmp_path):
    """Out of memory while making a case's inputs (before any implementation runs) is that case's outcome for every
    implementation, not an error of the run (16 workers on an 80 GB H100 once made five errors at setup)."""
    proc, data = run_suite(tmp_path, "-k", "correctness", "-p", "tests.oom_inputs", "--impl", "naive",
                           "--impl", "sdpa-math")
    assert proc.returncode == 0, proc.stdout[-2000:]
    for impl in ("naive", "sdpa-math"):
        assert statuses(data, impl) == {"passed": 2, "out of memory": 2}
    ooms = [o for o in data["fmha"]["outcomes"] if o["status"] == "out of memory"]
    assert all("s256x256" in o["case"] and o["message"] == "out of memory (asked for 4.00 GiB) making the case's "
               "inputs" for o in ooms)


MISTYPED = [
    ("--grid=serving-cpu-twin", "pytest: --grid serving-cpu-twin: unknown preset; choose from ", "serving-cpu"),
    ("--impl=flash-atn4", "pytest: --impl: no implementation matches flash-atn4; known: ", "flash-attn4"),
    ("--timing=wall", "pytest: --timing wall: unknown timing mode; choose from ", "graph"),
]


@pytest.mark.parametrize(("option", "says", "known"), first_fast(MISTYPED, unpack=True))
def test_a_mistyped_selection_is_a_usage_error_naming_the_choices(option, says, known):
    """A typo in --impl, --grid or --timing stops the run before anything is collected, with pytest's usage exit
    status and the documented names, not argparse's usage of ``__main__.py`` or an internal error's traceback."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "suite", "-p", "no:cacheprovider", "-k", "correctness",
                           option], cwd=ROOT, capture_output=True, text=True, timeout=120, env=child_env())
    output = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, output[-2000:]
    assert says in output and known in output.split(says, 1)[1]
    assert "Traceback" not in output and "INTERNALERROR" not in output
    assert "__main__.py" not in output and "sanitize" not in output


def test_the_suite_runs_without_pytest_xdist(tmp_path):
    """Every case has an ``xdist_group`` marker for ``--dist loadgroup``; with xdist switched off (or not
    installed) the strict marker check must not refuse the run."""
    proc, data = run_suite(tmp_path, "-p", "no:xdist", "-k", "correctness", "--impl", "naive")
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "INTERNALERROR" not in proc.stdout + proc.stderr
    assert statuses(data, "naive") == {"passed": 4}


def test_where_time_goes_finds_what_bounded_a_sharded_pass(tmp_path):
    """A heartbeat file (each test's start and finish with its worker) gives the pass's span, the workers busy to
    its end, the heaviest groups and the tests cut off by its end."""
    heartbeat = tmp_path / "pass.hb"
    events = [("start", "t::a[1]@slow", 0.0, "gw0"), ("finish", "t::a[1]@slow", 30.0, "gw0"),
              ("start", "t::a[2]@slow", 30.0, "gw0"), ("finish", "t::a[2]@slow", 50.0, "gw0"),
              ("start", "t::b[1]@fast", 0.0, "gw1"), ("finish", "t::b[1]@fast", 5.0, "gw1"),
              ("start", "t::b[2]@fast", 5.0, "gw1")]  # cut off
    heartbeat.write_text("".join(json.dumps({"event": e, "nodeid": n, "t": 1000 + t, "worker": w}) + "\n"
                                 for e, n, t, w in events))
    out = subprocess.run([sys.executable, "tools/where_time_goes.py", "--heartbeat", str(heartbeat)], cwd=ROOT,
                         capture_output=True, text=True, check=True, env=child_env()).stdout
    assert "3 tests finished in 50 s on 2 workers: 55 s of tests, 28 s a worker" in out, out
    assert "busy to the end: gw0 50 s, gw1 5 s" in out and "heaviest groups: slow 50 s, fast 5 s" in out
    assert "still running at the end: t::b[2]@fast (on gw1 from 5 s)" in out
