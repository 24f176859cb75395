"""Our cuTile backward and its training step's forward: the kernels compile for sm_90 without a GPU, at every head-dim
tile set, causal and not, with the fixed tiles in registers; their bodies, emulated on CPU, pass the oracle (the
forward: o and lse against the float64 reference; the whole training step through its registered entry); on a GPU
the compiled kernels do, on shapes the presets leave out."""

import dataclasses
import itertools
import os
from dataclasses import replace

import pytest
import torch

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from impls import get
from impls.backward import forward_backward
from impls.contract import Backward
from impls.cutile.backward import HEAD_DIMS, BackwardCall, ForwardCall, space, tiles
from impls.cutile.export import export_launch
from impls.cutile.launch import Launches
from impls.reference import attention_lse
from suite.cases import Case
from suite.checks import BackwardOracle, Oracle
from tests.cutile_helpers import sass
from tests.tiers import first_fast, only_fast

KERNELS = ("bwd_delta", "bwd_dkdv", "bwd_dq")


def meta_inputs(head_dim: int, causal: bool, *, q_len: int = 1000, kv_len: int = 1000) -> Backward:
    """Backward inputs on the meta device (shapes only): GQA 8:2, lengths that leave ragged tiles."""
    q = torch.empty((2, 8, q_len, head_dim), device="meta", dtype=torch.bfloat16)
    k = torch.empty((2, 2, kv_len, head_dim), device="meta", dtype=torch.bfloat16)
    lse = torch.empty(q.shape[:3], device="meta", dtype=torch.float32)
    return Backward(q, k, k.clone(), q.clone(), q.clone(), lse, causal)


def test_head_dims_share_three_tile_sets() -> None:
    # 64, padded 72-128 and padded 136-256: one compiled form each (with causal and not)
    assert HEAD_DIMS[0] == 64 and HEAD_DIMS[-1] == 256
    assert len({tiles(d) for d in HEAD_DIMS}) == 3


@pytest.mark.parametrize(("head_dim", "causal"), only_fast(
    itertools.product([64, 96, 128, 192, 256], [True, False]), [(64, True), (256, True)], unpack=True))
def test_sm90_kernels_compile_without_spilling(head_dim: int, causal: bool) -> None:
    """Each launch of a call (Sq = Skv = 1000: ragged key and query tiles) compiles for sm_90 with no stack, its
    products on the warpgroup MMA and its tiles loaded by TMA."""
    call = BackwardCall(meta_inputs(head_dim, causal), scale=head_dim ** -0.5)
    assert [kernel._pyfunc.__name__ for _, kernel, _ in call.launches] == list(KERNELS)
    for name, (_, kernel, arguments) in zip(KERNELS, call.launches, strict=True):
        usage = sass(export_launch(kernel, arguments, arch="sm_90"))
        assert usage["stack"] == 0 and usage["utmaldg"] > 0, (name, usage)
        assert name == "bwd_delta" or usage["hgmma"] > 0, (name, usage)


@pytest.mark.parametrize(("head_dim", "causal"), only_fast(
    itertools.product([64, 96, 128, 192, 256], [True, False]), [(64, True), (256, False)], unpack=True))
def test_sm90_training_forward_compiles_without_spilling(head_dim: int, causal: bool) -> None:
    # the forward a training step runs first, on the dq kernel's tiles, ragged query and key tiles
    inputs = meta_inputs(head_dim, causal)
    (_, kernel, arguments), = ForwardCall(inputs.q, inputs.k, inputs.v, causal=causal, scale=0.1).launches
    usage = sass(export_launch(kernel, arguments, arch="sm_90"))
    assert usage["stack"] == 0 and usage["utmaldg"] > 0 and usage["hgmma"] > 0, usage


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_candidates_compile_without_spilling(head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # every candidate of the space (the fixed tiles are the first, test_sm90_kernels_compile_without_spilling)
    import impls.cutile.backward as backward

    for candidate in space(head_dim)[1:]:
        monkeypatch.setattr(backward, "tiles", lambda _, chosen=candidate: chosen)
        for causal in (True, False):
            call = BackwardCall(meta_inputs(head_dim, causal), scale=head_dim ** -0.5)
            for _, kernel, arguments in call.launches[1:]:
                usage = sass(export_launch(kernel, arguments, arch="sm_90"))
                assert usage["stack"] == 0 and usage["hgmma"] > 0, (candidate, causal, usage)


@pytest.mark.parametrize(("arch", "head_dim"), only_fast(
    itertools.product(["sm_80", "sm_100", "sm_120"], [64, 128, 256]), [("sm_100", 128)], unpack=True))
def test_kernels_compile_for_the_other_architectures(arch: str, head_dim: int) -> None:
    # the registration is not limited to Hopper: each launch compiles wherever the forward does
    call = BackwardCall(meta_inputs(head_dim, True), scale=head_dim ** -0.5)
    for _, kernel, arguments in call.launches:
        assert export_launch(kernel, arguments, arch=arch)[:4] == b"\x7fELF"


def test_launch_grids_cover_keys_and_queries() -> None:
    # dk/dv: one block per key tile of each kv head; dq and delta: one per query tile of each query head
    inputs = meta_inputs(128, True, q_len=300, kv_len=1000)
    t = tiles(128)
    grids = [grid for grid, _, _ in BackwardCall(inputs, scale=0.1).launches]
    assert grids == [(5, 8, 2), (-(-1000 // t.dkdv_n), 2, 2), (-(-300 // t.dq_m), 8, 2)]


# Odd lengths on both sides, Sq > Skv (rows that see no key), GQA and MQA, every head-dim tile set.
CASES = [
    Case(1, 4, 1, 70, 130, 64, "fp16", True, op="backward"),  # MQA, Sq < Skv
    Case(1, 8, 1, 300, 130, 192, "bf16", True, op="backward"),  # Sq > Skv: rows that see no key; padded to 256
    Case(2, 2, 1, 40, 40, 128, "fp16", False, op="backward"),
    Case(2, 4, 4, 1, 77, 64, "bf16", True, op="backward"),
    Case(1, 2, 1, 90, 90, 256, "bf16", False, op="backward"),
    Case(1, 4, 2, 129, 200, 96, "fp16", True, op="backward"),
    Case(1, 4, 2, 256, 256, 128, "bf16", True, op="backward"),  # whole tiles: the mask-free loops
    Case(1, 2, 1, 200, 333, 256, "bf16", True, op="backward"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", [*CASES, Case(2, 4, 2, 1024, 1024, 128, "bf16", True, op="backward")],
                         ids=lambda c: c.id)
def test_gradients_pass_the_oracle(case: Case) -> None:
    inputs = case.make_inputs("cuda")
    result = BackwardOracle(inputs).check(get("cutile", "backward").prepare(inputs)())
    assert result.passed, result.message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_training_steps_pass_the_oracle(case: Case) -> None:
    inputs = replace(case, op="fwdbwd").make_inputs("cuda")
    result = BackwardOracle(inputs).check(get("cutile", "fwdbwd").prepare(inputs)())
    assert result.passed, result.message


def emulator():
    """The four kernels' bodies and their helpers, with torch standing in for cuTile (tests/cutile_emulator.py)."""
    from impls.cutile import backward_kernels, kernel
    from tests.cutile_emulator import Emulator

    return Emulator([(kernel, ("load_rows", "store_rows", "key_tiles", "mask_scores", "softmax_step", "finite")),
                     (backward_kernels, ("fwd_lse", "fold_key_tile", "bwd_delta", "bwd_dkdv", "bwd_dq", "query_tiles",
                                         "add_query_tile", "add_key_tile", "query_tile", "load_row_values"))])


def emulated(inputs: Backward) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of the three kernels' bodies run block by block."""
    return emulated_launches(BackwardCall(inputs, scale=inputs.q.shape[-1] ** -0.5))


def emulated_launches(call: Launches) -> tuple[torch.Tensor, ...]:
    """A prepared call's launches, each run block by block on the emulator; what the call returns."""
    stand_in = emulator()
    for launch in call.launches:
        stand_in.launch(*launch)
    return call.out


@pytest.mark.parametrize("case", first_fast(CASES, fast=2), ids=lambda c: c.id)
def test_kernels_pass_the_oracle_when_emulated_on_cpu(case: Case) -> None:
    """The kernels' tile bounds, causal skips and masks, GQA walk and scaling, emulated: gradients within the
    oracle's tolerance."""
    inputs = case.make_inputs("cpu")
    result = BackwardOracle(inputs).check(emulated(inputs))
    assert result.passed, result.message


LSE_TOLERANCE = 1e-4  # float32 sums of exact products of half inputs (about 1e-6 here); one in log2 units: x 1.44


@pytest.mark.parametrize("case", first_fast([*CASES, Case(1, 2, 1, 128, 128, 64, "fp16", False, op="backward")],
                                             fast=2), ids=lambda c: c.id)  # the last: no masked loop at all
def test_training_forward_writes_the_reference_o_and_lse_when_emulated_on_cpu(case: Case) -> None:
    """o within the forward's oracle; lse, natural-log, against float64's: +inf exactly where a row sees no key
    (Sq > Skv, causal), and close elsewhere."""
    inputs = case.make_inputs("cpu")
    q, k, v, scale = inputs.q, inputs.k, inputs.v, inputs.q.shape[-1] ** -0.5
    o, lse = emulated_launches(ForwardCall(q, k, v, causal=case.causal, scale=scale))
    result = Oracle.dense(q, k, v, causal=case.causal, scale=scale).check(o)
    assert result.passed, result.message
    exact = attention_lse(q.double(), k.double(), causal=case.causal, scale=scale)
    unseen = exact == torch.inf
    assert torch.equal(lse == torch.inf, unseen)
    assert (lse - exact)[~unseen].abs().max() < LSE_TOLERANCE


@pytest.mark.parametrize("case", first_fast([Case(1, 4, 2, 50, 70, 64, "fp16", True, op="backward"), *CASES[:2],
                                              CASES[5]]), ids=lambda c: c.id)
def test_training_step_passes_the_oracle_when_emulated_on_cpu(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The training step of the registered backward (its forward=, then the backward, as ``fwdbwd`` runs them), every
    launch emulated: the gradients pass, and the call runs the forward on the inputs it finds."""
    monkeypatch.setattr(Launches, "__call__", emulated_launches)
    inputs = replace(case, op="fwdbwd").make_inputs("cpu")
    on_cpu = dataclasses.replace(get("cutile", "backward"), devices=("cpu",))
    step = forward_backward(on_cpu)(inputs, scale=inputs.q.shape[-1] ** -0.5)
    result = BackwardOracle(inputs).check(step())
    assert result.passed, result.message
    dq = step()[0].clone()
    inputs.q.mul_(2)
    assert not torch.equal(step()[0], dq)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_candidates_pass_the_oracle_when_emulated_on_cpu(head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import impls.cutile.backward as backward

    inputs = Case(1, 4, 2, 150, 170, head_dim, "bf16", True, op="backward").make_inputs("cpu")
    oracle = BackwardOracle(inputs)
    for candidate in space(head_dim)[1:]:
        monkeypatch.setattr(backward, "tiles", lambda _, chosen=candidate: chosen)
        result = oracle.check(emulated(inputs))
        assert result.passed, (candidate, result.message)
