"""What real models ask of attention: sliding windows, softcap, head dims that are not powers of two."""

import dataclasses
import itertools

import pytest
import torch

import impls
from impls.contract import NO_WINDOW, UNBOUNDED, binding_window
from impls.reference import attention_ref, visible
from suite import metrics
from suite.cases import Case
from suite.checks import Oracle
from suite.presets import PRESETS
from tests.tiers import first_fast


@pytest.mark.parametrize(("sq", "skv", "causal", "window"), list(itertools.product(
    [1, 5, 64], [3, 64, 100], [True, False], [(-1, -1), (4, 0), (10, -1), (3, 7), (-1, 2)])))
def test_windowed_flops_count_the_reference_mask(sq, skv, causal, window):
    assert metrics.windowed_pairs(sq, skv, causal, window) == int(visible(sq, skv, causal=causal,
                                                                          window=window).sum())


def test_a_window_is_bottom_right_like_causal():
    seen = visible(3, 5, causal=True, window=(1, 0))
    assert seen.tolist() == [[False, True, True, False, False], [False, False, True, True, False],
                             [False, False, False, True, True]]


@pytest.mark.parametrize(("sq", "skv", "causal"), list(itertools.product([1, 4, 9], [1, 4, 9, 12], [True, False])))
def test_a_window_side_that_hides_no_key_is_dropped_and_one_that_does_is_kept(sq, skv, causal):
    for window in itertools.product(range(-1, 14), repeat=2):
        kept = binding_window(window, causal, sq, skv)
        assert torch.equal(visible(sq, skv, causal=causal, window=kept), visible(sq, skv, causal=causal, window=window))
        # what is kept is needed: unbounding either kept side would let some row see more
        for side in (0, 1):
            if kept[side] >= 0:
                wider = (-1, kept[1]) if side == 0 else (kept[0], -1)
                assert not torch.equal(visible(sq, skv, causal=causal, window=wider),
                                       visible(sq, skv, causal=causal, window=kept))
    assert binding_window((4096, 0), True, 4096, 4096) == NO_WINDOW  # Mistral-7B's window over a 4K prefill
    assert binding_window((4096, 0), True, 32768, 32768) == (4096, -1)


def test_softcap_bounds_the_scores():
    q = torch.full((1, 1, 1, 4), 10.0, dtype=torch.float64)
    k = torch.full((1, 1, 2, 4), 10.0, dtype=torch.float64)
    k[0, 0, 1] = -10.0
    v = torch.eye(2, 4, dtype=torch.float64)[None, None]
    capped = attention_ref(q, k, v, scale=1.0, softcap=5.0)  # scores +-400 capped to +-5
    expected = torch.softmax(torch.tensor([5 * torch.tanh(torch.tensor(80.0)), -5.0], dtype=torch.float64), 0)
    torch.testing.assert_close(capped[0, 0, 0, :2], expected)


def test_an_implementation_without_the_variant_refuses_with_the_reason():
    q, k, v = Case(1, 4, 2, 64, 64, 64).make_inputs("cpu")
    with pytest.raises(impls.Unsupported, match="sdpa: sliding window not supported"):
        impls.get("sdpa").prepare(q, k, v, causal=True, window=(16, 0))
    with pytest.raises(impls.Unsupported, match="sdpa: softcap not supported"):
        impls.get("sdpa").prepare(q, k, v, softcap=30.0)
    impls.get("sdpa").prepare(q, k, v, window=(-1, -1), softcap=0.0)  # the defaults are no variant


@pytest.mark.parametrize(("window", "softcap", "words"), [
    ((5,), 0.0, "window must be"), ((-2, 0), 0.0, "window must be"), ((1.5, 0), 0.0, "window must be"),
    (None, -1.0, "softcap must be"), (None, float("inf"), "softcap must be"),
])
def test_bad_variants_are_refused(window, softcap, words):
    q, k, v = Case(1, 4, 2, 8, 8, 64).make_inputs("cpu")
    with pytest.raises(ValueError, match=words):
        impls.get("naive").prepare(q, k, v, window=window, softcap=softcap)


@pytest.mark.parametrize("variants", [{"window": (16, 0)}, {"softcap": 2.0}])
def test_the_oracle_fails_an_output_that_ignores_the_variant(variants):
    case = Case(1, 4, 2, 128, 128, 64, "fp16", True)
    q, k, v = case.make_inputs("cpu")
    plain = impls.get("naive").prepare(q, k, v, causal=True)()
    assert not Oracle.dense(q, k, v, causal=True, **variants).check(plain).passed


def test_models_presets_name_the_model_and_hold_its_variants():
    ids = [c.id for c in PRESETS["models"]]
    assert "gemma2-9b-local-bf16-causal-h16:8-s4096x4096-d256-w4096:0-cap50-b4" in ids
    assert "phi3-mini-bf16-causal-h32:32-s32768x32768-d96" in ids
    twins = {c.model: c for c in PRESETS["models-cpu"]}
    assert set(twins) == {c.model for c in PRESETS["models"]}
    assert twins["gemma2-9b-local"].window[0] < 96 and twins["gemma2-9b-local"].softcap == 50.0
    assert twins["qwen2.5-7b"].gqa_ratio == 7 and twins["phi3-mini"].d == 96


def test_a_value_head_dim_of_its_own_reaches_only_the_implementations_that_declare_it():
    # DeepSeek's MLA prefill: queries and keys of 192, values (and the output) of 128, here at toy size.
    case = Case(1, 4, 2, 48, 80, 48, "fp32", True, dv=32)
    q, k, v = case.make_inputs("cpu")
    assert v.shape == (1, 2, 80, 32) and case.id.endswith("-d48-dv32")
    oracle = Oracle.dense(q, k, v, causal=True)
    for name in ("naive", "sdpa", "flex", "triton"):  # triton: under its interpreter here
        result = oracle.check(impls.get(name)(q, k, v, causal=True))
        assert result.passed, f"{name}: {result.message}"
    assert not oracle.check(impls.get("naive")(q, k, v, causal=False)).passed
    with pytest.raises(impls.Unsupported, match="cutile-5-remap: value head dim 32 other than the query/key head"):
        impls.get("cutile-5-remap").prepare(q, k, v, causal=True)
    # The two products count their own widths: Q K^T over 48, P V over 32.
    pairs = metrics.visible_pairs(48, 80, True)
    assert metrics.flops(case) == 2 * 4 * (48 + 32) * pairs
    assert metrics.kv_bytes(case) == 80 * 2 * (48 + 32) * 4


def test_a_value_head_dim_outside_the_declared_head_dims_is_refused_by_the_registry():
    q, k, _ = Case(1, 2, 2, 16, 16, 32, "fp32").make_inputs("cpu")
    for name, dv in (("triton", 20), ("triton-tma", 48)):  # any multiple of 8; powers of two only
        with pytest.raises(impls.Unsupported, match=f"{name}: value head dim {dv} not supported"):
            impls.get(name).prepare(q, k, torch.randn(1, 2, 16, dv))


def test_the_models_preset_has_mla_and_its_cpu_twin_too():
    mla = [c for c in PRESETS["models"] + PRESETS["models-cpu"] if c.model == "deepseek-v3-mla-tp8"]
    assert len(mla) == 3 and all((c.d, c.dv) == (192, 128) for c in mla)


# The serving operations take the same variants: a window bounds what decode reads, softcap caps its scores.
SERVING_VARIANTS = [{"window": (20, 0)}, {"softcap": 2.0}, {"window": (50, 0), "softcap": 3.0}]


def serving_cases() -> list[Case]:
    """Paged decode (long-tailed lengths, one and four new tokens, a head dim that is not a power of two) and
    a packed prefill: every window above ends inside some sequence."""
    from suite.presets import paged, varlen

    return [paged(("", 4, 2, 64), 3, 100, lengths="longtail"), paged(("", 8, 1, 96), 2, 77, sq=4, dtype="fp16"),
            paged(("", 4, 1, 64), 1, 300), varlen(("", 4, 2, 64), 3, 300)]


@pytest.mark.parametrize("variants", SERVING_VARIANTS, ids=str)
@pytest.mark.parametrize("case", first_fast(serving_cases()), ids=lambda c: c.id)
@pytest.mark.parametrize("name", ["naive", "triton"])
def test_serving_operations_apply_the_variants_and_the_oracle_sees_it(name, case, variants):
    """Our Triton decode (split into chunks of the window under the interpreter) and varlen kernels, and naive,
    pass with each variant; the same output fails the oracle of the plain problem, so the variant mattered."""
    inputs = case.make_inputs("cpu")
    out = impls.get(name, case.op).prepare(inputs, **variants)()
    check = Oracle.serving(inputs, **variants).check(out)
    assert check.passed, check.message
    assert not Oracle.serving(inputs).check(out).passed


def test_a_windowed_decode_reads_only_the_window():
    from suite.presets import paged

    case = paged(("", 4, 2, 64), 3, 100, lengths="longtail", window=(20, 0))
    inputs = case.make_inputs("cpu")
    assert inputs.read_lengths(inputs.window_left(case.window)) == [min(n, 21) for n in inputs.seqlens]
    assert inputs.read_lengths(inputs.window_left(case.window), align=16) == [
        n - (n - 21) // 16 * 16 if n > 21 else n for n in inputs.seqlens]
    plain = dataclasses.replace(case, window=NO_WINDOW)
    assert metrics.kv_bytes(case) == sum(min(n, 21) for n in case.seqlens()) * 2 * 64 * 2 * 2
    assert metrics.kv_bytes(plain) == sum(plain.seqlens()) * 2 * 64 * 2 * 2  # its own lengths: the id seeds them
    assert metrics.flops(case) == 2 * 4 * 128 * sum(min(n, 21) for n in case.seqlens())
    # a window that reaches the first position of every sequence hides nothing: the kernels run without it
    assert inputs.window_left((200, 0)) == UNBOUNDED and inputs.window_left((20, 0)) == 20


def test_serving_implementations_without_a_variant_refuse_with_the_reason():
    from suite.presets import paged, varlen

    decode = paged(("", 4, 2, 64), 2, 64).make_inputs("cpu")
    with pytest.raises(impls.Unsupported, match="sdpa: softcap not supported in paged attention"):
        impls.get("sdpa", "paged").prepare(decode, softcap=30.0)
    packed = varlen(("", 4, 2, 64), 2, 128).make_inputs("cpu")
    with pytest.raises(impls.Unsupported, match="sdpa: sliding window not supported in varlen attention"):
        impls.get("sdpa", "varlen").prepare(packed, window=(16, 0))
    with pytest.raises(ValueError, match="window must be"):
        impls.get("naive", "paged").prepare(decode, window=(16,))


def test_the_models_serving_presets_hold_each_models_variants():
    cases = PRESETS["models-serving"]
    assert {c.op for c in cases} == {"paged", "varlen"}
    local = [c for c in cases if c.model == "gemma2-9b-local"]
    assert local and all(c.window == (4096, 0) and c.softcap == 50.0 and c.d == 256 for c in local)
    assert any(c.skv > 4096 + 1 for c in local if c.op == "paged")  # the window binds: less is read
    twins = PRESETS["models-serving-cpu"]
    assert {c.model for c in twins} == {c.model for c in cases}
    assert all(c.window[0] < min(c.seqlens()) for c in twins if c.window != NO_WINDOW and c.op == "paged")
    with pytest.raises(ValueError, match="value head dim"):
        Case(2, 4, 2, 1, 64, 64, "bf16", True, op="paged", page_size=16, lengths="uniform", dv=32)
