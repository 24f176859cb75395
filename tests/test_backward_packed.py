"""The training ops over documents packed with cu_seqlens: their contract's errors, the variant that admits them,
the oracle per document, their cases, FLOPs and presets, and our Triton kernels (interpreter on CPU)."""

from __future__ import annotations

import itertools
import sys
import types
from dataclasses import replace

import pytest
import torch

from impls import Impl, Unsupported, get
from impls.contract import Backward, ForwardBackward
from impls.flash_attn_pkg import GENERATIONS
from impls.reference import attention_ref
from reports.cases import case_parts
from reports.runs import by_training_mode
from reports.training import dq_float32_bytes
from suite import metrics
from suite.cases import Case, with_forward
from suite.checks import BackwardOracle
from suite.presets import preset
from tests.tiers import slow

# Odd lengths with a document of one row, GQA 3:1 and a head dim padded to 128; the longest spans two query tiles.
ODD_LENGTHS = (37, 1, 70, 9)


def packed_step(lengths: tuple[int, ...], hq: int = 3, hkv: int = 1, d: int = 80, dtype: torch.dtype = torch.float32,
                causal: bool = True) -> ForwardBackward:
    gen = torch.Generator().manual_seed(sum(lengths) * hq + d)
    total = sum(lengths)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return ForwardBackward(randn(total, hq, d), randn(total, hkv, d), randn(total, hkv, d), randn(total, hq, d),
                           causal=causal, cu_seqlens=cu_seqlens)


@pytest.fixture(scope="module")
def odd() -> Backward:
    return with_forward(packed_step(ODD_LENGTHS))


def test_packed_inputs_read_their_documents(odd: Backward) -> None:
    assert odd.packed and odd.batch == 4 and odd.seqlens() == list(ODD_LENGTHS) and odd.max_seqlen == 70
    assert odd.lse.shape == (sum(ODD_LENGTHS), 3)  # one per row of q, in its order
    assert odd.document(odd.q, 2).shape == (1, 3, 70, 80)
    assert torch.equal(odd.document(odd.k, 1)[0, :, 0], odd.k[37])


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"cu_seqlens": [1, 38, 38, 108, 117]}, ValueError, r"cu_seqlens\[0\] must be 0"),
    ({"cu_seqlens": [0, 38, 37, 108, 117]}, ValueError, "cu_seqlens must be non-decreasing"),
    ({"cu_seqlens": [0, 38, 39, 108, 116]}, ValueError, r"cu_seqlens\[-1\] = 116 but the packed tensor has 117"),
    ({"cu_seqlens": [0]}, ValueError, "cu_seqlens must be \\(B\\+1,\\) with B >= 1"),
    ({"cu_seqlens": "int64"}, TypeError, "cu_seqlens must be int32"),
    ({"k": "short"}, ValueError, "packed q and k must hold the same rows"),
    ({"do": "dense"}, ValueError, "do must be 3-D"),
    ({"o": "short"}, ValueError, "o must be shaped, typed and placed like q"),
    ({"lse": "heads first"}, ValueError, r"lse must be float32 \(total, Hq\)"),
])
def test_the_packed_contract_names_the_problem(odd: Backward, change: dict, error: type, match: str) -> None:
    (name, how), = change.items()
    t = getattr(odd, name)
    if isinstance(how, list):
        bad = torch.tensor(how, dtype=torch.int32)
    else:
        bad = {"int64": lambda: t.long(), "short": lambda: t[:-1], "dense": lambda: t[None],
               "heads first": lambda: t.T.contiguous()}[how]()
    with pytest.raises(error, match=match):
        replace(odd, **{name: bad, **({"v": bad} if name == "k" else {})})


@pytest.mark.parametrize("op", ["backward", "fwdbwd"])
def test_implementations_that_do_not_declare_packed_documents_refuse_them(odd: Backward, op: str) -> None:
    """SDPA's backends (no varlen entry of their own) and our cuTile backward (dense only) say why."""
    inputs = odd if op == "backward" else packed_step(ODD_LENGTHS)
    for name in ("sdpa-math", "cutile"):
        assert "packed" not in get(name, op).variants
        with pytest.raises(Unsupported, match=rf"{name}: packed documents \(cu_seqlens\) not supported in {op}"):
            get(name, op).prepare(inputs)
    assert "packed" in get("triton", op).variants and "packed" in get("naive", op).variants


# The odd batch's backward, and a small one's training step (its forward too: documents of one and two tiles), run
# by default; the slow tier adds both modes of each, fp16 without a mask and bf16 at head dim 128.
PACKED_CASES = [
    ("backward", ODD_LENGTHS, {}),
    ("fwdbwd", (20, 1, 70), {"hq": 2, "d": 32}),
    *(slow((op, lengths, options), unpack=True) for op, lengths, options in (
        ("fwdbwd", ODD_LENGTHS, {}),
        ("backward", (20, 1, 70), {"hq": 2, "d": 32}),
        *((op, (64, 65, 2), {"hq": 4, "hkv": 2, "d": 64, "dtype": torch.float16, "causal": False})
          for op in ("backward", "fwdbwd")),
        *((op, (1, 130, 50), {"hq": 2, "hkv": 2, "d": 128, "dtype": torch.bfloat16}) for op in ("backward", "fwdbwd")),
    )),
]


@pytest.mark.parametrize(("op", "lengths", "options"), PACKED_CASES)
def test_triton_over_packed_documents_passes_the_oracle(op: str, lengths: tuple[int, ...], options: dict) -> None:
    step = packed_step(lengths, **options)
    inputs = step if op == "fwdbwd" else with_forward(step)
    result = BackwardOracle(inputs).check(get("triton", op).prepare(inputs)())
    assert result.passed, result.message


@pytest.mark.slow
def test_triton_over_packed_documents_with_a_window_and_softcap_passes_the_oracle() -> None:
    variants = {"window": (16, -1), "softcap": 20.0}
    inputs = with_forward(packed_step((40, 3, 90), hq=4, hkv=2, d=64, dtype=torch.float16), **variants)
    result = BackwardOracle(inputs, **variants).check(get("triton", "backward").prepare(inputs, **variants)())
    assert result.passed, result.message


def test_the_oracle_holds_each_document_to_its_own_gradients(odd: Backward) -> None:
    """The naive peer passes; a wrong row in one document fails, and so do the gradients of attention across the
    documents' boundaries (the same rows as one document)."""
    oracle = BackwardOracle(odd)
    assert oracle.sampled == 4  # every (document, kv head) pair of a small batch, the one-row document included
    dq, dk, dv = get("naive", "backward").prepare(odd)()
    assert oracle.check((dq, dk, dv)).passed, oracle.check((dq, dk, dv)).message
    one_row = dq.clone()
    one_row[37] += 1e-3  # its dq is 0: one row that sees only its own key
    assert not oracle.check((one_row, dk, dv)).passed
    last = dv.clone()
    last[-1] += 1e-3
    assert not oracle.check((dq, dk, last)).passed
    whole = replace(odd, cu_seqlens=torch.tensor([0, sum(ODD_LENGTHS)], dtype=torch.int32))
    assert not oracle.check(get("naive", "backward").prepare(whole)()).passed


def test_packed_cases_their_ids_flops_and_presets() -> None:
    case = Case(4, 4, 2, 150, 150, 64, "fp16", True, op="backward", lengths="random")
    assert case.packed and case.forward_op == "varlen"
    assert case.id == "bwd-" + replace(case, op="varlen").id == "bwd-varlen-fp16-causal-h4:2-t150-random-d64-b4"
    inputs = case.make_inputs("cpu")
    assert isinstance(inputs, Backward) and inputs.seqlens() == case.seqlens() and inputs.lse.shape == (150, 4)
    step = replace(case, op="fwdbwd")
    assert torch.equal(step.make_inputs("cpu").do, Case.make_inputs(step, "cpu").do)
    forward = metrics.flops(replace(case, op="varlen"))  # visible pairs of each document
    assert metrics.flops(case) == 5 * forward // 2 and metrics.flops(step) == 7 * forward // 2
    assert metrics.min_bytes(step) == metrics.min_bytes(case) + metrics.min_bytes(replace(case, op="varlen"))
    with pytest.raises(ValueError, match="backward: 4 packed sequences need sq == skv"):
        replace(case, skv=200)
    assert dq_float32_bytes(case.as_dict()) == 150 * 4 * 64 * 4  # the report's memory bound: one dq of the tokens
    assert case_parts(case.as_dict())[1:4] == ["backward", "150 tokens in 4", "random lengths"]
    for name, model in (("train", "llama3-8b"), ("bwd-cpu", "")):
        cases = preset(name)
        packed = [c for c in cases if c.packed]
        assert {c.op for c in packed} == {"backward", "fwdbwd"} and all(c.model == model for c in packed), name
        split = by_training_mode({name: [c.id for c in cases]}, {c.id: c.as_dict() for c in cases})
        assert list(split) == [f"{name}: {mode}" for mode in ("forward", "backward", "fwd+bwd")]


@pytest.mark.parametrize("name", list(GENERATIONS))
def test_flash_attn_runs_packed_documents_through_its_varlen_function(name: str, monkeypatch) -> None:
    """Autograd through each generation's ``flash_attn_varlen_func`` (a fake module here: standard attention per
    document), called with the documents' offsets and longest length."""
    module, _, _ = GENERATIONS[name]
    seen = {}

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=False, **kwargs):
        seen.update(offsets=(cu_seqlens_q.tolist(), cu_seqlens_k.tolist()), longest=(max_seqlen_q, max_seqlen_k))
        bounds = itertools.pairwise(cu_seqlens_q.tolist())
        out = torch.cat([attention_ref(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), causal=causal,
                                       scale=softmax_scale, upcast=False)[0].transpose(0, 1) for a, b in bounds])
        return out if name == "flash-attn2" else (out, None)  # FA3/FA4 return (out, lse)

    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    sys.modules[module].flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setattr(Impl, "availability", lambda self, device: None)
    inputs = with_forward(packed_step((9, 1, 20), hq=4, hkv=2, d=16, dtype=torch.float16))
    assert "packed" in get(name, "backward").variants
    result = BackwardOracle(inputs).check(get(name, "backward").prepare(inputs)())
    assert result.passed, result.message
    assert seen == {"offsets": ([0, 9, 10, 30],) * 2, "longest": (20, 20)}


def test_packed_documents_of_equal_lengths_get_the_dense_kernels_gradients() -> None:
    """The packed switch changes only where rows are: documents of one length, laid out as a dense batch, come out
    of the dense kernels with the same gradients, to the bit."""
    packed = with_forward(packed_step((40, 40), hq=2, d=32))

    def dense(t: torch.Tensor) -> torch.Tensor:  # (B * L, H, ...) -> (B, H, L, ...)
        return t.unflatten(0, (2, 40)).transpose(1, 2).contiguous()

    batch = Backward(*(dense(t) for t in (packed.q, packed.k, packed.v, packed.o, packed.do, packed.lse)),
                     causal=True)
    triton = get("triton", "backward")
    for grad, expected in zip(triton.prepare(packed)(), triton.prepare(batch)(), strict=True):
        assert torch.equal(dense(grad), expected)
