"""Timing modes, settling, resting and sharding, on CPU: the plumbing, the fallbacks and what the report shows.
The GPU half (graph and kernel modes measuring) is tests/test_gpu_timing.py; the tuning cache tests/test_tuning.py."""

import argparse
import copy
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from impls import timing, tuning
from reports.build import load_run, render
from suite.isolation import child_env
from suite.plugin import rest_option
from suite.rest import AUTO_REST_S, HEAVIER, RestPolicy, rest

ROOT = Path(__file__).resolve().parent.parent


def suite_process(*args: str, **env: str) -> subprocess.CompletedProcess:
    """A short suite run (two rounds of about a millisecond) in a subprocess, its output captured."""
    cmd = [sys.executable, "-m", "pytest", "suite", "-q", "-p", "no:cacheprovider", "--rounds", "2", "--round-ms", "1",
           *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**child_env(), **env})


def run_suite(tmp_path: Path, *args: str, **env: str) -> dict:
    out = tmp_path / "bench.json"
    proc = suite_process(f"--benchmark-json={out}", *args, **env)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cpu_modes(tmp_path_factory) -> tuple[Path, dict]:
    """A CPU benchmark run asked for all three modes."""
    tmp = tmp_path_factory.mktemp("modes")
    grids = ("--grid", "cpu-bench", "--grid", "serving-cpu-bench", "--grid", "varlen-cpu-bench")
    modes = ("--timing", "eager", "--timing", "graph", "--timing", "kernel")
    data = run_suite(tmp, "--benchmark-only", "--impl", "naive", "--impl", "sdpa", *grids, *modes)
    path = tmp / "bench.json"
    return path, data


def test_on_cpu_graph_and_kernel_say_they_need_cuda_and_eager_runs(cpu_modes):
    _, data = cpu_modes
    timings = {b["extra_info"]["timing"] for b in data["benchmarks"]}
    assert timings == {"eager"}
    refused = [o for o in data["fmha"]["outcomes"] if o["status"] == "unsupported" and o.get("timing")]
    assert {o["timing"] for o in refused} == {"graph", "kernel"}
    assert all(o["message"].endswith("timing needs CUDA") for o in refused)
    assert {b["extra_info"]["op"] for b in data["benchmarks"]} == {"dense", "paged", "varlen"}


def test_every_benchmark_records_its_mode_and_its_rates(cpu_modes):
    _, data = cpu_modes
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        assert info["timing"] == info["measured_as"] == "eager"
        assert info["gbps"] > 0 and info["kv_bytes"] > 0 and info["flops"] > 0


def with_modes(data: dict) -> dict:
    """The CPU run as if graph and kernel had run too: graph 30% faster, one graph number a fallback."""
    out = copy.deepcopy(data)
    extra = []
    for i, bench in enumerate(data["benchmarks"]):
        for mode, factor in (("graph", 0.7), ("kernel", 0.6)):
            b = copy.deepcopy(bench)
            b["extra_info"]["timing"] = b["extra_info"]["measured_as"] = mode
            b["stats"]["median"] *= factor
            if mode == "graph" and i == 0:
                b["extra_info"]["measured_as"] = "eager"
                b["extra_info"]["fallback"] = "not capturable in a CUDA graph: a host sync"
            extra.append(b)
    out["benchmarks"] += extra
    return out


def test_report_shows_every_mode_host_overhead_and_fallbacks(cpu_modes, tmp_path):
    _, data = cpu_modes
    path = tmp_path / "modes.json"
    path.write_text(json.dumps(with_modes(data)))
    run = load_run(path)
    assert run.lead == "graph" and run.timings == ["eager", "graph", "kernel"]
    html = render([run])
    for words in ("eager ms", "graph ms", "kernel ms", "host overhead ms", "Ranked by <strong>graph</strong>",
                  "eager*", "not capturable in a CUDA graph"):
        assert words in html, words
    assert "graph timing needs CUDA" in html  # the refusals keep their own matrix rows


def test_decode_ranks_by_bandwidth(cpu_modes, tmp_path):
    path, _ = cpu_modes
    html = render([load_run(path)])
    assert "geomean GB/s" in html and "geomean TFLOPS" in html  # serving-cpu-bench is decode
    assert "GB/s against cache length" in html and "dashed" not in html  # no HBM peak on CPU, no line


def test_settling_runs_the_call_for_the_time_asked_then_waits():
    from impls.timing import settle

    calls, syncs = [], []
    assert settle(lambda: calls.append(1), 0.25, 0.01, lambda: syncs.append(1)) == 25
    assert len(calls) == 25 and syncs == [1]  # queued calls, then one wait for all of them
    assert settle(lambda: calls.append(1), 0.25, 1.0, lambda: None) == 1  # a long call: once
    assert settle(lambda: calls.append(1), 0.0, 0.01, lambda: syncs.append(1)) == 0 and syncs == [1]


def test_settling_until_steady_goes_on_while_the_windows_move_and_stops_at_its_bound():
    from impls.timing import STEADY_WINDOW_S, settle_until_steady

    calls, windows = [], []

    def timed(window_times):
        times = iter(window_times)
        return lambda n: windows.append(n) or next(times)

    # 0.25 s of calls first (25 of 10 ms), then 50 ms windows of 5 calls: 0.052 -> 0.0535 (+2.9%: moving) -> 0.054
    # (+0.9%: steady).
    spent, steady = settle_until_steady(lambda: calls.append(1), 0.25, 2.0, 0.01, lambda: None,
                                        timed([0.052, 0.0535, 0.054]))
    assert steady and len(calls) == 25 and windows == [round(STEADY_WINDOW_S / 0.01)] * 3
    assert spent == pytest.approx(0.25 + 0.052 + 0.0535 + 0.054)
    # clocks that keep falling: stops at the bound, not steady
    spent, steady = settle_until_steady(lambda: None, 0.25, 0.4, 0.01, lambda: None,
                                        timed([0.05 * 1.03 ** i for i in range(10)]))
    assert not steady and 0.4 <= spent < 0.46


def test_cpu_benchmarks_do_not_settle_unless_asked(cpu_modes):
    _, data = cpu_modes
    assert {b["extra_info"]["settle_s"] for b in data["benchmarks"]} == {0.0}
    assert {b["extra_info"]["rest_s"] for b in data["benchmarks"]} == {0.0}


def test_auto_rest_pauses_only_after_a_benchmark_of_heavier_calls():
    auto = RestPolicy()
    assert auto.before(1e-3) == 0.0  # the first benchmark of a process: nothing ran before it
    assert auto.before(4e-3) == 0.0  # after a lighter one
    assert auto.before(1e-3) == AUTO_REST_S  # after calls four times as long (a 1 x 32K case, then 4 x 4K)
    assert auto.before(0.6e-3) == 0.0  # after calls less than HEAVIER times as long
    assert auto.before(0.6e-3 / HEAVIER) == AUTO_REST_S  # exactly HEAVIER times as long
    fixed = RestPolicy(0.25)
    assert [fixed.before(t) for t in (1e-3, 4e-3, 1e-3)] == [0.25] * 3
    assert [RestPolicy(0.0).before(t) for t in (4e-3, 1e-3)] == [0.0, 0.0]


def test_rest_ms_takes_milliseconds_or_auto():
    assert rest_option("auto") == "auto"
    assert rest_option("250") == 250.0
    with pytest.raises(argparse.ArgumentTypeError, match="milliseconds or 'auto', not 'soon'"):
        rest_option("soon")


def test_resting_leaves_the_device_idle_for_the_time_asked():
    cpu = torch.device("cpu")
    start = time.perf_counter()
    assert rest(0.05, cpu) == 0.05
    assert time.perf_counter() - start >= 0.05
    assert rest(0, cpu) == rest(-1, cpu) == 0.0


GATED = ("--benchmark-only", "--impl", "naive", "--grid", "cpu-bench", "-k", "full and s128x128")
# One thread a process: on a 2-core CI machine beside the other xdist worker, torch's threads waiting on each other
# made a 0.14 ms call take 14-22 ms, past the baseline's scale.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def saved_baseline(tmp_path_factory) -> Path:
    """One benchmark saved by pytest-benchmark (--benchmark-save) into a storage folder of its own."""
    tmp = tmp_path_factory.mktemp("gate")
    run_suite(tmp, *GATED, f"--benchmark-storage={tmp / 'storage'}", "--benchmark-save=base", **ONE_THREAD)
    return tmp / "storage"


@pytest.mark.parametrize(("baseline_scale", "regressed"), [(1e-4, True), (1e4, False)])
def test_a_saved_run_gates_regressions_through_pytest_benchmark(saved_baseline, tmp_path, baseline_scale, regressed):
    """The suite's medians feed pytest-benchmark's own --benchmark-compare-fail: a run slower than its saved baseline
    by more than the threshold fails, one faster passes (the baseline is scaled, so that the outcome does not rest on
    this machine's timing noise)."""
    storage = tmp_path / "storage"
    shutil.copytree(saved_baseline, storage)
    (saved,) = storage.glob("*/0001_base.json")
    data = json.loads(saved.read_text())
    assert len(data["benchmarks"]) == 1
    for bench in data["benchmarks"]:
        for field in ("min", "max", "mean", "median", "q1", "q3"):
            bench["stats"][field] *= baseline_scale
    saved.write_text(json.dumps(data))
    proc = suite_process(*GATED, f"--benchmark-storage={storage}", "--benchmark-compare=0001",
                         "--benchmark-compare-fail=median:5%", **ONE_THREAD)
    assert proc.returncode == (1 if regressed else 0), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("Performance has regressed" in proc.stdout + proc.stderr) == regressed


def test_graph_repeats_fill_about_a_millisecond():
    from impls.timing import graph_repeats

    assert graph_repeats(1e-5, 1) == 100
    assert graph_repeats(5e-3, 1) == 1
    assert graph_repeats(1e-7, 4) == 64  # capped at 256 calls per graph


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, dict]:
    """One run over two xdist workers: the serving twins' checks, and benchmarks (allowed on CPU by
    FMHA_XDIST_BENCHMARKS; on a GPU node a worker alone on its GPU times by itself)."""
    tmp = tmp_path_factory.mktemp("sharded")
    data = run_suite(tmp, "-k", "correctness or benchmark", "-n", "2", "--dist", "loadgroup", "--impl", "naive",
                     "--impl", "sdpa", "--grid", "serving-cpu", "--grid", "varlen-cpu", "--grid", "cpu-bench",
                     "--grid", "serving-cpu-bench", FMHA_XDIST_BENCHMARKS="1")
    return tmp, data


def serving_twins() -> list:
    from suite.presets import PRESETS

    return PRESETS["serving-cpu"] + PRESETS["varlen-cpu"]


def test_xdist_workers_results_merge_into_one_file(sharded):
    tmp_path, data = sharded
    twins = {case.id for case in serving_twins()}
    checks = [o for o in data["fmha"]["outcomes"] if o["phase"] == "correctness" and o["case"] in twins]
    statuses = [(o["impl"], o["case"], o["status"]) for o in checks]
    causal_varlen = sum(c.op == "varlen" and c.causal for c in serving_twins())  # nested SDPA: no causal
    passed = 2 * len(twins) - causal_varlen
    assert len({c for _, c, _ in statuses}) == len(twins) and {i for i, _, _ in statuses} == {"naive", "sdpa"}
    assert sorted(s for _, _, s in statuses) == ["passed"] * passed + ["unsupported"] * causal_varlen
    assert not list(tmp_path.glob("bench.gw*.json"))  # the workers' files are merged away
    # Every check that ran keeps the wall time of its steps, which tools/where_time_goes.py adds up.
    timed = [o["seconds"] for o in checks if o["status"] == "passed"]
    assert len(timed) == passed and all(set(t) == {"prepare", "oracle", "check"} for t in timed)
    assert all(v >= 0 for t in timed for v in t.values()) and sum(t["oracle"] for t in timed) > 0
    summary = subprocess.run([sys.executable, "tools/where_time_goes.py", str(tmp_path / "bench.json")], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    checked = sum(o["phase"] == "correctness" and o["status"] == "passed" for o in data["fmha"]["outcomes"])
    assert any(line.split()[:2] == ["all", str(checked)] for line in summary.splitlines() if line.strip()), summary


W2 = {"PYTEST_XDIST_WORKER_COUNT": "2"}
W3 = {"PYTEST_XDIST_WORKER_COUNT": "3"}


@pytest.mark.parametrize(("environ", "expected", "flag"), [
    ({"PYTEST_XDIST_WORKER": "gw1", "CUDA_VISIBLE_DEVICES": "3,5", **W2}, "5", "FMHA_GPU_EXCLUSIVE"),
    # more workers than GPUs: round robin, each GPU shared
    ({"PYTEST_XDIST_WORKER": "gw2", "CUDA_VISIBLE_DEVICES": "3,5", **W3}, "3", "FMHA_GPU_SHARED"),
    ({"CUDA_VISIBLE_DEVICES": "3,5"}, None, None),  # not a worker
    ({"PYTEST_XDIST_WORKER": "gw0", "CUDA_VISIBLE_DEVICES": ""}, None, None),  # no GPU
    # not pinned: every worker on the first GPU
    ({"PYTEST_XDIST_WORKER": "gw0", "CUDA_VISIBLE_DEVICES": "0,1", "FMHA_NO_PIN": "1", **W2}, None, "FMHA_GPU_SHARED"),
    ({"PYTEST_XDIST_WORKER": "gw0", "CUDA_VISIBLE_DEVICES": "0,1", "FMHA_NO_PIN": "1"}, None, "FMHA_GPU_EXCLUSIVE"),
])
def test_each_xdist_worker_is_pinned_to_one_gpu(environ, expected, flag):
    from suite.sharding import pin_worker_to_gpu

    before = dict(environ)
    assert pin_worker_to_gpu(environ) == expected
    assert environ["CUDA_VISIBLE_DEVICES"] == (expected if expected else before["CUDA_VISIBLE_DEVICES"])
    flags = {"FMHA_GPU_EXCLUSIVE", "FMHA_GPU_SHARED"}
    assert flags & set(environ) == ({flag} if flag else set())


def test_sharded_benchmarks_merge_into_one_file(sharded):
    """Two workers time their groups of cases; every case's implementations stay on one worker."""
    _, data = sharded
    from suite.presets import PRESETS

    benchmarks = [b["extra_info"] for b in data["benchmarks"]]
    # every case x 2 implementations, less nested SDPA on the causal varlen twins
    cases = serving_twins() + PRESETS["cpu-bench"] + PRESETS["serving-cpu-bench"]
    expected = 2 * len(cases) - sum(c.op == "varlen" and c.causal for c in cases)
    assert len(benchmarks) == expected and {b["worker"] for b in benchmarks} == {"gw0", "gw1"}
    for case in {b["case"] for b in benchmarks}:
        assert len({b["worker"] for b in benchmarks if b["case"] == case}) == 1


def as_fleet(data: dict, slow_gpu: int = 2, gpus: int = 4) -> dict:
    """The CPU run as if every benchmark had run on each of ``gpus`` GPUs, one of them 10% slower."""
    out = copy.deepcopy(data)
    out["benchmarks"] = []
    for bench in data["benchmarks"]:
        for g in range(gpus):
            b = copy.deepcopy(bench)
            b["stats"]["median"] *= 1.10 if g == slow_gpu else 1.0 + 0.002 * g
            b["extra_info"]["gpu"] = {"name": "NVIDIA H200", "uuid": f"GPU-0000000{g}-aaaa", "state": {
                "sm_clock_mhz": 1500 if g == slow_gpu else 1980, "mem_clock_mhz": 3201, "power_limit_w": 700.0,
                "power_w": 650.0, "temperature_c": 85 if g == slow_gpu else 60,
                "throttle": ["sw power cap"] if g == slow_gpu else []}}
            out["benchmarks"].append(b)
    return out


def test_fleet_section_flags_the_gpu_outside_the_pack(cpu_modes, tmp_path):
    _, data = cpu_modes
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(as_fleet(data)))
    from reports.build import fleet

    summary = fleet(load_run(path))
    flagged = [g for g in summary["gpus"] if g["flagged"]]
    assert len(summary["gpus"]) == 4 and [g["gpu"] for g in flagged] == ["NVIDIA H200 00000002"]
    assert flagged[0]["throttle"] == ["sw power cap"] and flagged[0]["min_sm_clock_mhz"] == 1500
    assert all(r["spread"] == pytest.approx(1.10 / 1.0) for r in summary["spreads"])
    html = render([load_run(path)])
    assert 'id="fleet"' in html and 'class="flagged"' in html and "sw power cap" in html


def test_no_fleet_section_for_one_gpu(cpu_modes):
    path, _ = cpu_modes
    from reports.build import fleet

    assert fleet(load_run(path)) is None


def test_telemetry_reads_nvml_and_says_why_when_it_cannot(monkeypatch):
    import types

    from suite import telemetry

    telemetry._nvml.cache_clear()
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert "unavailable" in telemetry.gpu_state("GPU-1")
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, NVML_CLOCK_SM=0, NVML_CLOCK_MEM=1, NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x4 | 0x40,
        nvmlDeviceGetClockInfo=lambda h, which: 1980 if which == 0 else 3201,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000, nvmlDeviceGetPowerUsage=lambda h: 650_000,
        nvmlDeviceGetTemperature=lambda h, sensor: 61)
    telemetry._nvml.cache_clear()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    state = telemetry.gpu_state("1234")
    assert state == {"sm_clock_mhz": 1980, "mem_clock_mhz": 3201, "power_limit_w": 700.0, "power_w": 650.0,
                     "temperature_c": 61, "throttle": ["sw power cap", "hw thermal slowdown"]}
    telemetry._nvml.cache_clear()


def test_energy_meter_reads_the_counter_across_the_block_and_says_why_when_it_cannot(monkeypatch):
    import types

    from suite import telemetry

    telemetry._nvml.cache_clear()
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    with telemetry.energy_during("GPU-1") as reading:
        pass
    assert set(reading) == {"unavailable"}
    counter = iter([1_000_000, 1_006_300])  # millijoules: 6.3 J drawn inside the block
    synced = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
        nvmlDeviceGetTotalEnergyConsumption=lambda h: next(counter))
    telemetry._nvml.cache_clear()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(telemetry, "gpu_state", lambda uuid: {"sm_clock_mhz": 1605})
    with telemetry.energy_during("1234", sync=lambda: synced.append(True)) as reading:
        assert reading == {}  # filled when the block ends
        time.sleep(0.01)
    assert synced == [True]
    assert reading["joules"] == pytest.approx(6.3) and reading["seconds"] >= 0.01
    assert reading["avg_power_w"] == pytest.approx(6.3 / reading["seconds"])
    assert reading["state"] == {"sm_clock_mhz": 1605}
    telemetry._nvml.cache_clear()


def test_dist_each_runs_every_benchmark_on_every_worker(tmp_path):
    """The fleet check's run: with one worker per GPU, --dist each times every case on every GPU."""
    data = run_suite(tmp_path, "-k", "benchmark", "-n", "2", "--dist", "each", "--impl", "naive", "--grid",
                     "cpu-bench", FMHA_XDIST_BENCHMARKS="1")
    workers = [b["extra_info"]["worker"] for b in data["benchmarks"]]
    assert sorted(workers) == ["gw0"] * 4 + ["gw1"] * 4


def test_settling_a_tuner_is_nothing_off_cuda():
    from impls.timing import settle_gpu

    start = time.perf_counter()
    settle_gpu(torch.device("cpu"), seconds=10.0)
    assert time.perf_counter() - start < 1.0


def test_settled_times_settle_each_call_on_itself_and_alternate_the_order(monkeypatch):
    # Each call is timed right after its own settling (whose length comes from one timed replay, the 9.0s);
    # pass 2 runs the calls in reverse; a call's time is the mean of its passes' medians, per call (a replay
    # holds 2 calls). a: medians 2.0 and 3.0 -> 1.0 and 1.5 per call; b: 1.0 (a 9.0 outlier) and 5.0 -> 0.5, 2.5.
    events = []
    clock = {"a": iter([9.0, 2.0, 2.2, 2.0, 9.0, 3.0, 3.0, 3.0]), "b": iter([9.0, 1.0, 9.0, 1.0, 9.0, 5.0, 5.2, 5.0])}
    monkeypatch.setattr(timing, "graph_replay", lambda call, replay_ms: (call, 2))
    monkeypatch.setattr(timing, "settle", lambda target, seconds, per_call, sync: events.append(target))
    monkeypatch.setattr(timing, "_event_ms", lambda replay: next(clock[replay]))
    assert timing.settled_times(["a", "b"], rounds=3) == pytest.approx([1.25, 1.5])
    assert events == ["a", "b", "b", "a"]
    monkeypatch.setattr(tuning, "settled_times", lambda calls, **timing: [3.0, 1.0, 2.0])
    assert tuning.settled_ranking([("x", None), ("y", None), ("z", None)]) == [("y", 1.0), ("z", 2.0), ("x", 3.0)]


def test_device_time_is_the_union_of_kernel_spans():
    """Kernel time counts a stretch where kernels overlap once (programmatic dependent launch starts a kernel
    before the one it waits on ends), and leaves out the gaps between them."""
    from impls.timing import DeviceSpan, busy_seconds

    def spans(*pairs: tuple[float, float]) -> list[DeviceSpan]:
        return [DeviceSpan(f"k{i}", start, end) for i, (start, end) in enumerate(pairs)]

    assert busy_seconds([]) == 0
    assert busy_seconds(spans((0, 2), (3, 4))) == pytest.approx(3)  # in turn, a gap between: the sum
    assert busy_seconds(spans((3, 6), (0, 4))) == pytest.approx(6)  # overlapping, listed out of order
    assert busy_seconds(spans((0, 10), (2, 3), (4, 12))) == pytest.approx(12)  # nested, then reaching past
    assert DeviceSpan("k", 1.5, 4).seconds == pytest.approx(2.5)


def test_a_rotation_too_small_to_evict_the_l2_is_not_called_cold(monkeypatch):
    """--cold-l2 in graph mode rotates over at most MAX_INPUT_COPIES copies: for the smallest calls they all fit in
    the L2 together, so those times are warm ones, and the record must not call them cold."""
    monkeypatch.setattr(timing, "l2_bytes", lambda device: 60 << 20)
    device = torch.device("cpu")
    mib = 1 << 20
    copies = timing.copies_for_cold_l2(2 * mib, device)
    assert copies == 61 and timing.rotation_evicts(2 * mib, copies, device)
    tiny = timing.copies_for_cold_l2(mib // 4, device)
    assert tiny == timing.MAX_INPUT_COPIES and not timing.rotation_evicts(mib // 4, tiny, device)
    assert not timing.rotation_evicts(200 * mib, 1, device)  # one copy: nothing rotates
