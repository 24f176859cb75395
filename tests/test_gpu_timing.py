"""The timing modes measuring on a GPU (skipped without one): graph replays per call, kernel time from the
profiler, and a call that cannot be captured falling back with its reason."""

import pytest
import torch

from impls.timing import GraphCaptureError, GraphTarget, cuda_clock, profile_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def matmul_call():
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
    return lambda: a @ a


def test_graph_replays_are_timed_per_call():
    call = matmul_call()
    graph = GraphTarget([call], repeats=8)
    assert graph.calls_per_replay == 8
    graph()
    torch.testing.assert_close(graph.outputs[0], call())
    start = cuda_clock()
    graph()
    whole = cuda_clock() - start
    with cuda_clock.per_call(graph.calls_per_replay):
        start = cuda_clock()
        graph()
        per_call = cuda_clock() - start
    assert per_call == pytest.approx(whole / 8, rel=0.3)


def test_a_graph_keeps_the_memory_its_calls_use():
    """A graph over calls on copies of the inputs (--cold-l2) keeps the calls, and with them their inputs, alive:
    once dropped, their memory went back to the allocator while replays still read and wrote it."""
    import gc
    import weakref

    def on_own_input(value: float):
        x = torch.full((1 << 20,), value, device="cuda")
        return lambda: x * 2

    calls = [on_own_input(float(i)) for i in range(4)]
    alive = [weakref.ref(call) for call in calls]
    graph = GraphTarget(calls, repeats=2)
    del calls
    gc.collect()
    torch.cuda.empty_cache()
    junk = torch.full((1 << 23,), -1.0, device="cuda")  # would take memory the calls' inputs gave back
    graph()
    torch.cuda.synchronize()
    assert all(ref() is not None for ref in alive) and junk.min() == -1
    assert [float(out[0]) for out in graph.outputs] == [0.0, 2.0, 4.0, 6.0]


def test_kernel_profile_names_the_kernels_and_their_time():
    profile = profile_kernels(matmul_call(), calls=4)
    assert profile.kernels and all(k["launches"] >= 1 for k in profile.kernels.values())
    assert 0 < profile.seconds_per_call < 0.1
    summed = sum(k["seconds"] for k in profile.kernels.values())
    assert profile.seconds_per_call == pytest.approx(summed, rel=0.01)  # one stream, in turn: the union is the sum


def test_kernels_that_overlap_count_once():
    """Two spin kernels on two streams run side by side: a call's device time is one of them, not both (as a
    combine kernel launched early under programmatic dependent launch overlaps the split kernel it waits on)."""
    side = torch.cuda.Stream()

    def two_streams():
        side.wait_stream(torch.cuda.current_stream())
        torch.cuda._sleep(2_000_000)
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)
        torch.cuda.current_stream().wait_stream(side)

    profile = profile_kernels(two_streams, calls=2)
    summed = sum(k["seconds"] for k in profile.kernels.values())
    assert profile.kernels and profile.seconds_per_call < 0.75 * summed
    with cuda_clock.kernel_time():
        start = cuda_clock()
        two_streams()
        overlapped = cuda_clock() - start
    assert overlapped < 0.75 * summed


def test_kernel_mode_clock_advances_by_device_time_only():
    call = matmul_call()
    with cuda_clock.kernel_time():
        start = cuda_clock()
        for _ in range(5):
            call()
        busy = cuda_clock() - start
        start = cuda_clock()
        torch.cuda._sleep(1_000_000)  # a spin kernel: device time too
        slept = cuda_clock() - start
    assert 0 < busy < 0.1 and slept > 0


def test_a_host_sync_cannot_be_captured_and_says_why():
    a = torch.randn(64, device="cuda")
    stream = torch.cuda.current_stream()
    with pytest.raises(GraphCaptureError):
        GraphTarget([lambda: a * float(a.sum())], repeats=1)  # .item()-like sync inside the call
    # and the process measures on: the same stream, random inputs drawn (a failed capture broke both once)
    assert torch.cuda.current_stream() == stream
    assert torch.randn(64, device="cuda").isfinite().all()


def test_the_tuners_graph_time_of_an_uncapturable_call_falls_back_and_leaves_the_process_sound():
    from impls.timing import graph_ms

    a = torch.randn(64, device="cuda")
    stream = torch.cuda.current_stream()
    assert graph_ms(lambda: a * float(a.sum()), warmup=1, repeats=2) > 0  # timed back to back instead
    assert torch.cuda.current_stream() == stream
    assert torch.randn(64, device="cuda").isfinite().all()


def test_tuners_settle_the_gpu_for_the_time_asked():
    from impls.timing import settle_gpu

    start = cuda_clock()
    settle_gpu(torch.device("cuda"), seconds=0.1)
    assert cuda_clock() - start >= 0.09  # device time between the events: the load ran and was waited for


def test_settling_until_steady_times_real_windows_within_its_bound():
    from impls.timing import mean_ms, settle_until_steady

    call = matmul_call()
    per_call_s = mean_ms(call) / 1e3
    spent, steady = settle_until_steady(call, 0.1, 1.0, per_call_s, torch.cuda.synchronize)
    assert 0.1 <= spent <= 1.2  # the bound holds (the last window may run past it)
    assert isinstance(steady, bool)


def test_sustained_tuner_picks_the_cheaper_call():
    from impls.tuning import sustained_fastest

    small, large = (torch.randn(n, n, device="cuda", dtype=torch.float16) for n in (1024, 4096))
    assert sustained_fastest([("large", lambda: large @ large), ("small", lambda: small @ small)], rounds=3) == "small"


def test_settled_tuner_picks_the_cheaper_call():
    from impls.tuning import settled_ranking

    small, large = (torch.randn(n, n, device="cuda", dtype=torch.float16) for n in (1024, 4096))
    ranking = settled_ranking([("large", lambda: large @ large), ("small", lambda: small @ small)], seconds=0.05,
                              rounds=3)
    assert ranking[0][0] == "small"


def test_energy_of_sustained_work_is_a_plausible_power():
    from suite.telemetry import energy_during

    call = matmul_call()
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    with energy_during(uuid, torch.cuda.synchronize) as reading:
        start = cuda_clock()
        while cuda_clock() - start < 1.0:  # 1 s of device time: NVML's counter moves in steps of about 0.1 s
            for _ in range(50):
                call()
    if "unavailable" in reading:
        pytest.skip(f"NVML: {reading['unavailable']}")
    limit = reading["state"]["power_limit_w"]
    assert reading["seconds"] >= 1.0 and 50 < reading["avg_power_w"] < 1.2 * limit
