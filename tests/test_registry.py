import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import impls
from impls import Prepared, Unsupported, register, select, unregister

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def toy():
    """A throwaway implementation registered for one test only; its setup counts its calls."""
    calls = {"prepare": 0, "run": 0}

    @register("toy-impl", family="toy", dtypes=(torch.float32,), head_dims=(16,), devices=("cpu",))
    def toy_impl(q, k, v, *, causal, scale):
        calls["prepare"] += 1
        if causal:
            raise Unsupported("no causal here")

        def run():
            calls["run"] += 1
            return torch.zeros_like(q)

        return Prepared(run, config={"tile": 1})

    yield impls.get("toy-impl"), calls
    unregister("toy-impl")


def inputs(dtype=torch.float32, d=16):
    q = torch.randn(1, 2, 4, d, dtype=dtype)
    return q, torch.randn(1, 1, 4, d, dtype=dtype), torch.randn(1, 1, 4, d, dtype=dtype)


def test_prepare_runs_setup_once_outside_the_timed_call(toy):
    impl, calls = toy
    prepared = impl.prepare(*inputs())
    assert calls == {"prepare": 1, "run": 0}
    for _ in range(3):
        prepared()
    assert calls == {"prepare": 1, "run": 3}
    assert prepared.config == {"tile": 1}


def test_declared_capabilities_are_checked_before_prepare(toy):
    impl, calls = toy
    with pytest.raises(Unsupported, match="dtype float16 not supported"):
        impl.prepare(*inputs(torch.float16))
    with pytest.raises(Unsupported, match="head dim 32 not supported"):
        impl.prepare(*inputs(d=32))
    with pytest.raises(Unsupported, match="no causal here"):
        impl.prepare(*inputs(), causal=True)
    assert impl.availability("cuda").startswith("runs on cpu only")
    assert calls["prepare"] == 1  # only the causal call reached the prepare function


def test_select_globs_and_unknown_names(toy):
    assert {i.name for i in select(["sdpa-*"])} >= {"sdpa-math", "sdpa-flash", "sdpa-cudnn"}
    assert [i.name for i in select(["toy-*"])] == ["toy-impl"]
    with pytest.raises(ValueError, match="no implementation matches nope"):
        select(["nope"])


def test_double_registration_is_refused(toy):
    with pytest.raises(ValueError, match="registered twice"):
        register("toy-impl", family="toy")(lambda q, k, v, *, causal, scale: None)


def test_every_family_is_registered():
    families = {i.family for i in select()}
    assert {"naive", "sdpa", "flash-attn", "triton", "cutile"} <= families
    names = {i.name for i in select()}
    assert {"cutile-1-baseline", "cutile-2-large-tiles", "cutile-3-fast-math", "cutile-4-loop-split",
            "cutile-5-remap", "cutile", "triton", "flash-attn2", "flash-attn3", "flash-attn4"} <= names


def test_cutile_says_why_it_cannot_run_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert impls.get("cutile").availability("cpu") == "runs on cuda only, this run is on cpu (no CUDA device here)"
    assert impls.get("cutile").availability("cuda") == "no CUDA device"


def test_naive_declines_what_does_not_fit(monkeypatch):
    import impls.naive as naive

    monkeypatch.setattr(naive, "free_memory_bytes", lambda device: 1000)
    with pytest.raises(Unsupported, match=r"needs .* GiB for the 4x4 score matrices \(\d+ bytes\)"):
        impls.get("naive").prepare(*inputs())


def test_sdpa_refusal_keeps_pytorchs_reason_only():
    from impls.sdpa import refusal_reason

    reason = refusal_reason([
        "Memory efficient kernel not used because: (Triggered internally at sdp_utils.cpp:986.)",
        "For dense input, both fused kernels require query, key and value to have the same num_heads. "
        "(Triggered internally at sdp_utils.cpp:100.)",
        "Flash attention has been runtime disabled. (Triggered internally at sdp_utils.cpp:1.)",
    ])
    assert reason == "For dense input, both fused kernels require query, key and value to have the same num_heads."


def test_length_class_keeps_the_lengths_of_a_preset_apart():
    from impls._registry import length_class

    # the blog's 2K, 4K and 8K each tune on their own (their best cuTile blocks differ); 16K-64K too
    assert [length_class(n) for n in (100, 512, 1025, 2048, 4000, 8192, 16384, 32768, 65536, 131072)] == [
        128, 1024, 2048, 2048, 4096, 8192, 16384, 32768, 65536, 524288]


def test_parallel_class_buckets_batch_times_heads_in_powers_of_four():
    from impls._registry import parallel_class

    assert [parallel_class(n) for n in (1, 3, 8, 16, 17, 128, 1024, 4096)] == [1, 4, 16, 16, 64, 256, 1024, 1024]


def test_checks_group_by_implementation_and_compiled_form():
    from impls import get
    from suite.cases import Case
    from suite.plugin import check_group

    naive = get("naive")
    base = Case(2, 8, 2, 300, 300, 128, "fp16", True)
    same_kernel = Case(4, 8, 8, 1000, 1000, 128, "fp16", True)
    others = [Case(2, 8, 2, 300, 300, 64, "fp16", True), Case(2, 8, 2, 300, 300, 128, "bf16", True),
              Case(2, 8, 2, 300, 300, 128, "fp16", False)]
    assert check_group(naive, base) == check_group(naive, same_kernel)
    assert len({check_group(naive, c) for c in [base, *others]}) == 4


def test_benchmark_json_is_a_path_whichever_pytest_benchmark_keeps_it(tmp_path):
    # pytest-benchmark 5.3 keeps --benchmark-json as a path, 5.2.3 (the GPU image's own) as the file it opened:
    # the plugin's checkpoints and merges take the path from either (a file object once stopped a GPU run).
    from suite.recording import benchmark_json

    class Config:
        def __init__(self, value) -> None:
            self.value = value

        def getoption(self, name: str, default=None):
            return self.value

    target = tmp_path / "bench.json"
    with open(target, "wb") as handle:
        assert benchmark_json(Config(handle)) == target
    assert benchmark_json(Config(str(target))) == target == benchmark_json(Config(target))
    assert benchmark_json(Config(None)) is None


def test_more_sequences_than_a_grid_axis_holds_are_refused_with_the_limit_named():
    """Our kernels give heads and sequences a launch grid axis each (so that batch x heads may pass 65535: that runs,
    tests/test_gpu_candidates.py), and CUDA caps each at 65535 ("invalid argument" past it). Each of our entries
    refuses more sequences than that with the limit named, before it compiles or launches anything (cuTile's
    prepare functions are called directly: on CPU the registry refuses them for the device first)."""
    from impls._registry import GRID_AXIS_MAX
    from impls.contract import PagedKV, Varlen

    batch, heads, d = GRID_AXIS_MAX + 1, 1, 16
    zeros = functools.partial(torch.zeros, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    dense = [zeros(batch, heads, 1, d) for _ in range(3)]
    index = functools.partial(torch.arange, dtype=torch.int32, device=dense[0].device)
    paged = PagedKV(zeros(batch, 1, heads, d), zeros(batch, 1, heads, d), zeros(batch, 1, heads, d),  # pages of 1
                    index(batch)[:, None], torch.ones_like(index(batch)))
    rows = zeros(batch, heads, d)
    cu = index(batch + 1)
    packed = Varlen(rows, rows, rows, cu, cu, causal=True)
    calls = [lambda: impls.get("triton").prepare(*dense),
             lambda: impls.get("triton", "paged").prepare(paged),
             lambda: impls.get("triton", "varlen").prepare(packed),
             lambda: impls.get("cutile").prepare_fn(*dense, causal=False, scale=0.25),
             lambda: impls.get("cutile-1-baseline").prepare_fn(*dense, causal=False, scale=0.25),
             lambda: impls.get("cutile", "paged").prepare_fn(paged, scale=0.25),
             lambda: impls.get("cutile", "varlen").prepare_fn(packed, scale=0.25)]
    for call in calls:
        with pytest.raises(Unsupported, match=f"sequences = {batch}: .* caps at {GRID_AXIS_MAX}"):
            call()


def test_grid_axes_of_heads_and_sequences():
    from impls._registry import GRID_AXIS_MAX, heads_by_batch

    assert heads_by_batch(32, 4096) == (32, 4096)  # 131072 programs, neither axis past the cap
    with pytest.raises(Unsupported, match=f"kv heads = {GRID_AXIS_MAX + 1}: .* caps at {GRID_AXIS_MAX}"):
        heads_by_batch(GRID_AXIS_MAX + 1, 1, "kv heads")


def test_an_operation_that_cannot_run_here_leaves_its_siblings_running():
    """flex's paged entry needs a GPU, its dense and varlen ones do not: on CPU only the paged one is left out of
    the run, and the summary names it by its operation."""
    from suite.plugin import unavailable_by_name

    if torch.cuda.is_available():
        pytest.skip("every operation runs here")
    selected = select(["flex", "cutile"])
    reasons = {(i.op, i.name): r for i in selected if (r := i.availability("cpu"))}
    unavailable = unavailable_by_name(selected, reasons)
    assert set(unavailable) == {"flex (paged)", "flex (backward)", "flex (fwdbwd)", "cutile"}
    assert {i.op for i in selected if i.name == "flex" and (i.op, i.name) not in reasons} == {"dense", "varlen"}


def test_list_impls_prints_the_registry_and_runs_nothing():
    """``pytest --list-impls``: one row an operation and implementation, with whether it runs here or why not."""
    from suite.isolation import child_env

    done = subprocess.run([sys.executable, "-m", "pytest", "--list-impls", "--impl", "flex", "--impl", "naive",
                           "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert rows[0][:4] == ["operation", "implementation", "family", "variants"]
    listed = {(row[0], row[1]): " ".join(row[4:]) for row in rows[1:]}
    pairs = {(op, name) for op in ("dense", "paged", "varlen", "backward", "fwdbwd") for name in ("flex", "naive")}
    assert set(listed) == pairs | {("mla", "naive"), ("mixed", "naive")}
    assert listed["dense", "naive"] == "runs"
    if not torch.cuda.is_available():
        assert listed["paged", "flex"].startswith("runs on cuda only")
    assert "passed" not in done.stdout and "collected" not in done.stdout


def _collected(*args: str) -> list[str]:
    from suite.isolation import child_env

    done = subprocess.run([sys.executable, "-m", "pytest", "suite", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "tests.study_impl", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_a_study_runs_in_its_own_preset_unless_named() -> None:
    from suite.presets import preset

    study_cases = {c.id for c in preset("cpu-bench")}
    ids = _collected("--benchmark-only", "--grid", "cpu", "--grid", "cpu-bench")
    ran = {i.split("[study-naive-", 1)[1].rsplit("-", 1)[0] for i in ids if "[study-naive-" in i}
    assert ran == study_cases  # none of cpu's cases, every one of cpu-bench's
    named = _collected("--benchmark-only", "--grid", "cpu", "--impl", "study*")
    assert named and all("[study-naive-" in i for i in named)
