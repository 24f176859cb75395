"""Behaviour beyond accuracy: non-finite inputs, determinism.

Non-finite inputs: the reference (float64) propagates NaN to exactly the query rows that see the poisoned
element. Every implementation's behaviour is recorded for the report's correctness matrix; our own kernels
(families ``triton`` and ``cutile``) must match the reference, others are recorded as they are.
"""

import pytest
import torch

from impls import Impl
from impls._reference import attention_ref
from suite.cases import Case
from suite.plugin import Problem, Recorder

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


@pytest.mark.cases(Case(2, 4, 2, 200, 200, 64, "fp16", True), Case(1, 4, 4, 130, 257, 128, "bf16", False))
def test_deterministic(impl: Impl, case: Case, problem: Problem, record: Recorder) -> None:
    if impl.family not in OURS:
        pytest.skip("determinism is required of our kernels only")
    repeats = 3 if problem.q.is_cuda else 1  # on CPU our kernels run in Triton's interpreter: one repeat tells
    with record.guard():
        prepared = problem.prepare(impl)
        first = prepared().clone()
        again = [prepared().clone() for _ in range(repeats)]
    assert all(torch.equal(first, other) for other in again), "outputs differ between runs on one input"
