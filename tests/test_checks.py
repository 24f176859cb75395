import torch

from suite.cases import Case
from suite.checks import MAX_CHECKED_HEADS, Oracle, sampled_heads


def problem(causal=False):
    case = Case(1, 4, 2, 64, 80, 32, "fp16", causal)
    q, k, v = case.make_inputs("cpu")
    return q, k, v, Oracle.dense(q, k, v, causal=causal)


def test_naive_output_passes_and_a_wrong_one_fails():
    from impls.reference import attention_ref

    q, k, v, oracle = problem(causal=True)
    good = attention_ref(q, k, v, causal=True, upcast=False)
    assert oracle.check(good).passed
    wrong = good.clone()
    wrong[0, 3, 10, 5] += 0.05  # one element, one head
    result = oracle.check(wrong)
    assert not result.passed and "exceeds tolerance" in result.message
    non_causal = attention_ref(q, k, v, causal=False, upcast=False)
    assert not oracle.check(non_causal).passed


def test_nan_never_passes_and_shape_is_checked():
    q, _, _, oracle = problem()
    out = torch.zeros_like(q)
    out[0, 0, 3, 0] = float("nan")
    assert "NaN or Inf" in oracle.check(out).message
    assert "expected" in oracle.check(out[:, :, :10]).message
    assert "expected" in oracle.check(out.float()).message


def test_large_cases_sample_heads_including_first_and_last():
    heads = sampled_heads(4, 32, 1 << 28)
    assert len(heads) == MAX_CHECKED_HEADS
    assert heads[0] == (0, 0) and heads[-1] == (3, 31)
    assert len(sampled_heads(1, 4, 64 * 64)) == 4
