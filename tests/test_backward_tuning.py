"""Where our Triton backward's tiles come from (``TuningCache.lookup``): this machine's tune, the shipped pick, the
nearest shipped class, the fixed tiles; and what ``FMHA_TUNING=tune`` times. On CPU the interpreter runs the
kernels, with the GPU's name and the timing faked, and every config the lookup gives passes the oracle."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from impls import get, tuning
from impls.triton_fa import backward
from impls.triton_fa.config import TUNING
from impls.tune import export
from suite.cases import Case
from suite.checks import BackwardOracle

H200 = SimpleNamespace(name="NVIDIA H200", major=9, minor=0)
# Non-causal fp16 at head dim 64: its nearest shipped class (fa3-bwd's 2K) runs a dq tile of 128 x 64 over 8 warps,
# unlike the fixed tiles.
CASE = Case(1, 2, 2, 40, 40, 64, "fp16", False, op="backward")
NEAREST_DQ = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


@pytest.fixture
def on_gpu(tmp_path, monkeypatch):
    """The backward as it prepares on an H200 (the interpreter still runs it), with an empty tuning cache."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H200)
    monkeypatch.setattr(backward, "timed_here", lambda q: True)
    monkeypatch.setenv("FMHA_TUNING_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FMHA_TUNING", "on")
    monkeypatch.delenv("FMHA_GPU_SHARED", raising=False)


@pytest.fixture(scope="module")
def inputs():
    return CASE.make_inputs("cpu")


def prepared_config(inputs) -> dict:
    """The prepared call's config, once its gradients pass the oracle."""
    prepared = get("triton", "backward").prepare(inputs)
    result = BackwardOracle(inputs).check(prepared())
    assert result.passed, result.message
    return prepared.config


def case_key() -> str:
    return TUNING.key("cuda", backward.shape_class(torch.float16, CASE.d, CASE.causal, CASE.window, 0.0, False, 1,
                                                   CASE.sq, CASE.skv))


def test_the_interpreter_runs_the_fixed_tiles_and_says_so(inputs):
    config = prepared_config(inputs)
    dkdv, dq, _ = backward.tiles(CASE.d, torch.float16)
    assert config == {"dkdv": {**dkdv, "HEAD_SPLITS": 1}, "dq": dq, "chosen": "fixed (interpreter)"}


def test_the_tiles_come_from_the_cache_then_the_table_then_the_nearest_class_then_the_fixed_tiles(
        inputs, on_gpu, tmp_path, monkeypatch):
    config = prepared_config(inputs)  # the shipped H200 table has fa3-bwd's classes, not this one's length
    assert config["chosen"] == f"{tuning.NEAREST} (NVIDIA H200)" and config["dq"] == NEAREST_DQ
    dkdv_space, dq_space = backward.search_space(CASE.d, torch.float16)
    own = {"dkdv": dkdv_space[3], "dq": dq_space[4]}
    folder = tmp_path / "tuned"
    folder.mkdir()
    (folder / "nvidia-h200.json").write_text(json.dumps({"gpu": "NVIDIA H200", "capability": "9.0", "picks": [
        {"shape": json.loads(case_key())["shape"], "config": own, "tuned_with": {}}]}))
    monkeypatch.setattr(TUNING, "tables", tuning.ShippedTables(folder))
    config = prepared_config(inputs)
    assert config["chosen"] == "shipped (NVIDIA H200)" and config["dq"] == own["dq"]
    assert config["dkdv"] == {**own["dkdv"], "HEAD_SPLITS": 1}
    monkeypatch.setattr(TUNING, "tables", None)  # no table for this GPU: the fixed tiles
    dkdv, dq, _ = backward.tiles(CASE.d, torch.float16)
    assert prepared_config(inputs) == {"dkdv": {**dkdv, "HEAD_SPLITS": 1}, "dq": dq, "chosen": tuning.FIXED}
    TUNING.put(case_key(), {"dkdv": dkdv_space[1], "dq": dq_space[0]})  # tuned here earlier: before any table
    config = prepared_config(inputs)
    assert config["chosen"] == tuning.CACHED and config["dq"] == dq_space[0]


def test_tuning_times_each_kernel_alone_and_stores_an_exportable_pick(inputs, on_gpu, tmp_path, monkeypatch):
    """``FMHA_TUNING=tune``: the dk/dv candidates, then the dq candidates, each kernel's calls timed apart (here
    each run once and the last taken); the pick is stored, read back by the next call, and exported as a table."""
    monkeypatch.setenv("FMHA_TUNING", "tune")
    timed = []

    def last_candidate(candidates):
        for _, call in candidates:
            call()
        timed.append([config for config, _ in candidates])
        return candidates[-1][0]

    monkeypatch.setattr(backward, "fastest", last_candidate)
    dkdv_space, dq_space = backward.search_space(CASE.d, torch.float16)
    config = prepared_config(inputs)
    assert timed == [dkdv_space, dq_space]
    assert config == {"dkdv": {**dkdv_space[-1], "HEAD_SPLITS": 1}, "dq": dq_space[-1], "chosen": tuning.TUNED}
    monkeypatch.setenv("FMHA_TUNING", "on")
    assert prepared_config(inputs)["chosen"] == tuning.CACHED and len(timed) == 2
    assert export(TUNING.path, tmp_path / "tables", source=None) == {"nvidia-h200.json": 1}
    assert tuning.ShippedTables(tmp_path / "tables").pick(case_key()) == (
        {"dkdv": dkdv_space[-1], "dq": dq_space[-1]}, "shipped (NVIDIA H200)")


def test_float32_and_head_dim_256_have_the_fixed_tiles_as_their_only_candidates():
    for head_dim, dtype in ((64, torch.float32), (256, torch.bfloat16)):
        dkdv, dq, _ = backward.tiles(head_dim, dtype)
        assert backward.search_space(head_dim, dtype) == ([dkdv], [dq])


def test_the_gpu_tiles_are_among_the_candidates():
    dkdv_space, dq_space = backward.DKDV_SPACE, backward.DQ_SPACE
    for dkdv, dq, _ in (backward.GPU_TILES[64], backward.GPU_TILES[128]):
        assert dkdv in dkdv_space and dq in dq_space
