"""Behaviour beyond accuracy: non-finite inputs, determinism, inputs in other memory layouts.

Non-finite inputs: the reference (float64) propagates NaN to exactly the query rows that see the poisoned
element. Every implementation's behaviour is recorded for the report's correctness matrix; our own kernels
(families ``triton`` and ``cutile``) must match the reference, others are recorded as they are.
"""

import dataclasses

import pytest
import torch

from impls import Impl
from impls.reference import attention_ref
from suite.cases import Case
from suite.presets import mixed, mla, paged, varlen
from suite.problem import Problem
from suite.recording import Recorder

OURS = {"triton", "cutile"}
POISONS = {  # name -> (tensor, index of the poisoned element in (B, H, S, D))
    "nan-in-q": ("q", (0, 1, 5, 3), float("nan")),
    "nan-in-k": ("k", (0, 0, 40, 0), float("nan")),
    "inf-in-v": ("v", (0, 1, 7, 2), float("inf")),
}


def nonfinite_rows(out: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(out).all(dim=-1)


@pytest.mark.cases(Case(1, 4, 2, 64, 96, 64, "fp16", True), Case(1, 4, 2, 64, 96, 64, "fp16", False))
@pytest.mark.parametrize("poison", list(POISONS))
# Triton's interpreter computes in NumPy, which warns of the NaN this test puts in on purpose.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning",
                            "ignore:invalid value encountered in:RuntimeWarning")
def test_nonfinite_inputs(impl: Impl, case: Case, problem: Problem, record: Recorder, poison: str) -> None:
    name, index, value = POISONS[poison]
    tensors = {"q": problem.q.clone(), "k": problem.k.clone(), "v": problem.v.clone()}
    tensors[name][index] = value
    with record.guard():
        out = impl.prepare(tensors["q"], tensors["k"], tensors["v"], causal=case.causal)()
    expected = nonfinite_rows(attention_ref(tensors["q"], tensors["k"], tensors["v"], causal=case.causal))
    got = nonfinite_rows(out)
    same = torch.equal(got.cpu(), expected.cpu())
    message = (f"{poison}: non-finite rows as the reference ({int(expected.sum())})" if same else
               f"{poison}: {int(got.sum())} non-finite rows, reference has {int(expected.sum())}")
    record("passed" if same else "differs", message, property=poison)
    if impl.family in OURS:
        assert same, message


@pytest.mark.cases(Case(2, 4, 2, 200, 200, 64, "fp16", True), Case(1, 4, 4, 130, 257, 128, "bf16", False),
                   mixed(("", 4, 2, 64), 2, 100, 1, 40))
def test_deterministic(impl: Impl, case: Case, problem: Problem, record: Recorder) -> None:
    if impl.family not in OURS:
        pytest.skip("determinism is required of our kernels only")
    repeats = 3 if problem.q.is_cuda else 1  # on CPU our kernels run in Triton's interpreter: one repeat tells
    with record.guard():
        prepared = problem.prepare(impl)
        first = prepared().clone()
        again = [prepared().clone() for _ in range(repeats)]
    assert all(torch.equal(first, other) for other in again), "outputs differ between runs on one input"


LAYOUTS = {  # name -> the same values in another layout
    # the head dim (the last) at a stride other than 1: the dim before it is the inner one
    "strided-head-dim": lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),
    # unit-stride head dims in rows twice as long (q, k and v sliced from a fused projection's output)
    "sliced-rows": lambda t: torch.cat([t, torch.full_like(t, float("nan"))], dim=-1)[..., :t.shape[-1]],
}
FAR = 2**30  # what the index tensors' neighbours hold: a kernel that reads one as an index reads far out of bounds
SMALL = ("", 4, 2, 64)  # Hkv 2: a cache's head dim strided by its kv heads


def interleaved(t: torch.Tensor) -> torch.Tensor:
    """An index tensor's values at stride 2 in every dim, ``FAR`` between them."""
    return torch.stack([t, torch.full_like(t, FAR)], dim=-1)[..., 0]


@pytest.mark.cases(Case(1, 4, 2, 64, 96, 64, "bf16", True), paged(SMALL, 3, 100, lengths="longtail"),
                   varlen(SMALL, 3, 300), mla(("", 4, 32, 8), 3, 100, page_size=16, lengths="longtail"),
                   mixed(SMALL, 2, 100, 1, 40, lengths="longtail"))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts(impl: Impl, case: Case, problem: Problem, record: Recorder, layout: str) -> None:
    """Inputs in another memory layout give what the contiguous ones give. A strided head dim (a transposed view,
    say) and a strided index tensor (block table, cache lengths, cu_seqlens; the serving cases take both layouts'
    with them interleaved with far-out indices) reach no implementation: the registry copies such a tensor when the
    call is prepared (``impls.contract.unit_head_stride``, ``PagedKV.in_kernel_layout``); kernels that addressed
    both as contiguous returned wrong numbers. Rows sliced from wider ones (NaN beside them) reach each
    implementation as they are."""
    change = LAYOUTS[layout]
    if case.op == "dense":
        inputs = tuple(change(t) for t in problem.inputs)
        tensors = inputs
    else:
        batch = problem.inputs
        inputs = dataclasses.replace(batch, **{n: change(getattr(batch, n)) for n in batch.head_dim_tensors},
                                     **{n: interleaved(getattr(batch, n)) for n in batch.index_tensors})
        tensors = tuple(getattr(inputs, n) for n in batch.head_dim_tensors + batch.index_tensors)
    assert not any(t.is_contiguous() for t in tensors)
    with record.guard():
        out = problem.prepare(impl, inputs)()
    result = problem.oracle.check(out)
    record("passed" if result.passed else "differs", f"{layout}: {result.message}", property=layout)
    assert result.passed, result.message
