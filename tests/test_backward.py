"""The backward operation and the training step (fwdbwd): their contracts' errors, the oracle, their FLOPs, the
derived fwdbwd entries and our Triton kernels (interpreter on CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from impls import Prepared, Unsupported, get, register, unregister
from impls.backward import training_steps
from impls.contract import Backward, ForwardBackward
from suite import metrics
from suite.cases import Case
from suite.checks import BackwardOracle
from tests.tiers import slow

# Odd lengths, Sq > Skv (rows that see no key), GQA 3:1 and a head dim padded to 128.
ODD = Case(1, 3, 1, 47, 33, 80, "fp32", True, op="backward")


@pytest.fixture(scope="module")
def odd() -> Backward:
    return ODD.make_inputs("cpu")


def test_inputs_are_the_forward_of_the_dense_twin(odd: Backward) -> None:
    q, k, v = replace(ODD, op="dense").make_inputs("cpu")
    assert torch.equal(odd.q, q) and torch.equal(odd.k, k) and torch.equal(odd.v, v)
    assert odd.lse.dtype == torch.float32 and odd.lse.shape == q.shape[:3]
    assert torch.isinf(odd.lse[:, :, :47 - 33]).all()  # rows that see no key: +inf, as flash-attn writes them


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"do": "half"}, ValueError, "do must be shaped, typed and placed like q"),
    ({"do": "short"}, ValueError, "do must be shaped"),
    ({"o": "short"}, ValueError, "o must be shaped"),
    ({"lse": "short"}, ValueError, r"lse must be float32 \(B, Hq, Sq\)"),
    ({"lse": "half"}, ValueError, "lse must be float32"),
    ({"lse": "4d"}, ValueError, "lse must be 3-D"),
    ({"v": "wide"}, ValueError, "v must have k's shape"),
])
def test_contract_names_the_problem(odd: Backward, change: dict, error: type, match: str) -> None:
    (name, how), = change.items()
    t = getattr(odd, name)
    bad = {"half": lambda: t.half(), "short": lambda: t[..., :-1, :] if t.dim() == 4 else t[..., :-1],
           "4d": lambda: t[..., None], "wide": lambda: torch.cat([t, t], dim=-1)}[how]()
    with pytest.raises(error, match=match):
        replace(odd, **{name: bad})


def test_an_implementation_that_needs_lse_refuses_inputs_without_one(odd: Backward) -> None:
    triton = get("triton", "backward")
    assert triton.needs == ("lse",)
    with pytest.raises(ValueError, match="triton needs lse"):
        triton.prepare(replace(odd, lse=None))
    get("naive", "backward").prepare(replace(odd, lse=None))  # autograd needs none


def test_triton_backward_passes_the_oracle(odd: Backward) -> None:
    oracle = BackwardOracle(odd)
    result = oracle.check(get("triton", "backward").prepare(odd)())
    assert result.passed, result.message


# Tiles of 16 and 32 over odd lengths: key tiles wholly seen, cut by the causal diagonal or a window's left edge, and
# ragged at both ends, so the kernels' masked and mask-free loops all run (the one-tile default runs one of them);
# each GQA group of 2 split over two dk/dv programs that add their sums.
@pytest.mark.parametrize("split", [True, False], ids=["split", "one-loop"])
@pytest.mark.parametrize("case", [
    Case(1, 2, 1, 90, 110, 64, "fp32", True, op="backward", window=(40, -1)),
    slow(Case(1, 4, 2, 110, 90, 32, "fp32", False, op="backward", window=(-1, 24))),
    slow(Case(1, 4, 2, 70, 70, 32, "fp32", False, op="backward")),
], ids=lambda c: c.id if isinstance(c, Case) else c)
def test_the_masked_and_mask_free_loops_cover_every_tile(case: Case, split: bool, monkeypatch) -> None:
    from impls.triton_fa import backward
    small = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    other = {**small, "BLOCK_M": 32, "BLOCK_N": 16}
    monkeypatch.setattr(backward, "tiles", lambda *_: ({**small, "SPLIT": split, "HEAD_SPLITS": 2}, other, other))
    for op in ("backward", "fwdbwd"):  # the case's lse, and the step's own forward over the same loops
        inputs = replace(case, op=op).make_inputs("cpu")
        result = BackwardOracle(inputs, **case.variants).check(get("triton", op).prepare(inputs, **case.variants)())
        assert result.passed, f"{op}: {result.message}"


def test_the_oracle_fails_a_wrong_gradient_and_nan(odd: Backward) -> None:
    oracle = BackwardOracle(odd)
    dq, dk, dv = get("naive", "backward").prepare(odd)()
    assert oracle.check((dq, dk, dv)).passed
    assert not oracle.check((dq, dk * 1.01, dv)).passed
    assert not oracle.check((dq, dk, dv * 0.99)).passed
    nan = dq.clone()
    nan[0, 0, -1, 0] = float("nan")
    assert "NaN" in oracle.check((nan, dk, dv)).message
    assert "not (dq, dk, dv)" in oracle.check(dq).message


def test_backward_flops_are_two_and_a_half_forwards() -> None:
    for causal in (False, True):  # causal halves them as it does the forward's
        case = replace(ODD, causal=causal, sq=128, skv=128)
        assert metrics.flops(case) == 5 * metrics.flops(replace(case, op="dense")) // 2
    full = Case(2, 4, 4, 128, 128, 64, op="backward")
    assert metrics.flops(full) == 5 * 4 * 2 * 4 * 128 * 128 * 64 // 2


@pytest.mark.parametrize("case", [slow(c) for c in (
    Case(2, 4, 4, 1, 77, 64, "bf16", True, op="backward"),  # one query row over many keys
    Case(1, 2, 1, 90, 90, 256, "bf16", False, op="backward"),  # the largest head dim
    Case(1, 4, 2, 129, 200, 96, "fp16", True, op="backward"),  # a padded head dim, ragged tiles on both sides
)], ids=lambda c: c.id)
def test_triton_backward_on_more_shapes(case: Case) -> None:
    inputs = case.make_inputs("cpu")
    result = BackwardOracle(inputs).check(get("triton", "backward").prepare(inputs)())
    assert result.passed, result.message


COMPILE_BACKWARD = """
import json, torch
from impls.sass import sass_summary
from impls.triton_fa.aot import compile_for
from impls.triton_fa.backward import bwd_dkdv, bwd_dq, block_d, fwd_lse, tiles
for d, packed in ((64, False), (128, False), (256, False), (128, True)):
    dkdv, dq, forward = tiles(d, torch.bfloat16)
    for fn, t in ((bwd_dkdv, dkdv), (bwd_dq, dq), (fwd_lse, forward)):
        meta = {"HEAD_DIM": d, "BLOCK_D": block_d(d), "SOFTCAP": 0.0, "DOT_FP32": False, "LOG2": True, "PACKED": packed,
                "LEFT": False, "RIGHT": True, **{k: v for k, v in t.items() if k.isupper()},
                **({"HEAD_SPLITS": 1} if fn is bwd_dkdv else {})}
        pointers = {n: {"LSE": "fp32", "Delta": "fp32", "CuSeqlens": "i32"}.get(n, "bf16") for n in fn.arg_names
                    if n[0].isupper() and n not in meta}
        cubin = compile_for(fn, 90, meta, pointers, t["num_warps"], t["num_stages"]).asm["cubin"]
        print(json.dumps({"d": d, "packed": packed, "kernel": fn.__name__, **sass_summary(cubin)}))
"""


@pytest.mark.slow
def test_the_gpu_tiles_compile_for_hopper_without_spilling_in_their_loops() -> None:
    """The bf16 tiles ``tiles`` picks, compiled for sm_90 without a GPU, dense and (head dim 128) over packed
    documents: no local memory touched inside the loops (head dim 256's dk/dv keeps 32 bytes of stack outside
    them), warpgroup MMA except in that dk/dv, whose tile of 16 query rows is below a warpgroup MMA's 64. The one
    exception is the dk/dv tile the H200 sweep picked at head dim 128 (timed under Triton 3.6, fastest there): the
    Triton of this machine spills in its loops, and the bound catches a change that makes that worse."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_BACKWARD], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 12
    for r in results:
        swept = (r["d"], r["kernel"]) == (128, "bwd_dkdv")
        assert r["loop_spills"] <= (SWEPT_DKDV_LOOP_SPILLS if swept else 0) and r["stack"] <= (512 if swept else 32), r
        assert r["hgmma"] > 0 or (r["d"], r["kernel"]) == (256, "bwd_dkdv"), r


SWEPT_DKDV_LOOP_SPILLS = 96  # Triton 3.9: 78-80 spill instructions in the loops of 64 x 128, 8 warps, 3 stages


# Bottom-right windows with softcap: a window on both sides over Sq < Skv (fp32), and Gemma-2's causal window with
# a cap of 20 (fp16); the slow tier adds Sq > Skv, GQA 4:1 and a padded head dim.
VARIANT_CASES = [
    Case(1, 2, 2, 50, 70, 64, "fp32", False, op="backward", window=(10, 7), softcap=5.0),
    Case(1, 2, 1, 90, 90, 64, "fp16", True, op="backward", window=(32, -1), softcap=20.0),
    slow(Case(1, 4, 1, 80, 45, 96, "bf16", True, op="backward", window=(16, -1), softcap=30.0)),
    slow(Case(2, 2, 2, 64, 64, 64, "fp32", False, op="backward", window=(-1, 8))),
]


@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: c.id)
def test_triton_backward_with_a_window_and_softcap_passes_the_oracle(case: Case) -> None:
    inputs = case.make_inputs("cpu")
    result = BackwardOracle(inputs, **case.variants).check(get("triton", "backward").prepare(inputs, **case.variants)())
    assert result.passed, result.message


def test_the_window_and_softcap_change_the_gradients_the_oracle_holds_the_kernel_to() -> None:
    """Without them the kernel's gradients of a windowed, capped case fail: the variants reach it."""
    case = VARIANT_CASES[0]
    inputs = case.make_inputs("cpu")
    plain = get("triton", "backward").prepare(inputs)()
    assert not BackwardOracle(inputs, **case.variants).check(plain).passed


def test_a_training_step_passes_the_oracle_and_runs_its_forward_in_the_call() -> None:
    """Ours (its forward= writing o and lse) and a peer's (autograd through its forward): the gradients pass, and a
    change to q between calls moves them: the call runs the forward on the inputs it finds."""
    case = replace(VARIANT_CASES[1], op="fwdbwd", sq=40, skv=40)
    inputs = case.make_inputs("cpu")
    assert isinstance(inputs, ForwardBackward)
    oracle = BackwardOracle(inputs, **case.variants)
    for name in ("triton", "naive"):
        step = get(name, "fwdbwd").prepare(inputs, **case.variants)
        result = oracle.check(step())
        assert result.passed, f"{name}: {result.message}"
        dq = step()[0].clone()
        inputs.q.mul_(2)
        try:
            assert not torch.equal(step()[0], dq), name
        finally:
            inputs.q.div_(2)


def test_every_backward_entry_gets_a_training_step() -> None:
    """A backward registered by any module (a new kernel family's, say) gets its fwdbwd entry; one that names no
    forward= is refused with the reason, and a forward= that writes fresh buffers each call is an error."""
    from impls._registry import REGISTRY

    assert {name for op, name in REGISTRY if op == "backward"} == {name for op, name in REGISTRY if op == "fwdbwd"}
    inputs = replace(ODD, op="fwdbwd").make_inputs("cpu")
    naive = get("naive", "backward")

    def fresh(q, k, v, *, causal: bool, scale: float) -> Prepared:
        return Prepared(lambda: (q.clone(), torch.zeros(q.shape[:3])))

    try:
        for name, forward in (("no-forward", None), ("fresh-buffers", fresh)):
            register(name, op="backward", family="naive", needs=("lse",), forward=forward)(naive.prepare_fn)
        training_steps()
        with pytest.raises(Unsupported, match="no-forward: its backward entry names no forward"):
            get("no-forward", "fwdbwd").prepare(inputs)
        with pytest.raises(ValueError, match=r"must write \(o, lse\) into the same buffers each call"):
            get("fresh-buffers", "fwdbwd").prepare(inputs)
    finally:
        for name in ("no-forward", "fresh-buffers"):
            unregister(name, "backward")
            unregister(name, "fwdbwd")


@pytest.mark.parametrize(("change", "match"), [
    ({"do": "half"}, "do must be shaped, typed and placed like q"),
    ({"do": "short"}, "do must be shaped"),
    ({"v": "wide"}, "fwdbwd: v must have k's shape"),
])
def test_the_training_step_contract_names_the_problem(change: dict, match: str) -> None:
    inputs = replace(ODD, op="fwdbwd").make_inputs("cpu")
    (name, how), = change.items()
    t = getattr(inputs, name)
    bad = {"half": t.half(), "short": t[..., :-1, :], "wide": torch.cat([t, t], dim=-1)}[how]
    with pytest.raises(ValueError, match=match):
        replace(inputs, **{name: bad})


def test_a_training_step_counts_its_forward_and_backward() -> None:
    for causal in (False, True):
        case = replace(ODD, op="fwdbwd", causal=causal, sq=128, skv=128)
        forward, backward = (metrics.flops(replace(case, op=op)) for op in ("dense", "backward"))
        assert metrics.flops(case) == 7 * forward // 2 == forward + backward
        assert metrics.min_bytes(case) == sum(metrics.min_bytes(replace(case, op=op)) for op in ("dense", "backward"))
    assert replace(ODD, op="fwdbwd").id == "fwdbwd-" + replace(ODD, op="dense").id
