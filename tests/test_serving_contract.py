"""The serving operations' contract and cases, and the oracle's grip on them.

PagedKV and Varlen validation, uneven varlen batches, the fp8 cache (its errors, its bf16 twin, its scales), the
generated cases' ids, lengths, scattered pages and metrics; an implementation that reads past a sequence's length
or an fp8 cache without its scales fails the check.
"""

import dataclasses
import math

import pytest
import torch

import impls
from impls import Prepared, register, unregister
from impls.contract import Varlen
from suite import metrics
from suite.cases import Case
from suite.checks import Oracle
from suite.presets import PRESETS, UNEVEN_VARLEN, paged, uneven_varlen, varlen
from tests.serving_helpers import TINY, fp8_inputs, paged_inputs
from tests.tiers import first_fast


def varlen_inputs(**changes) -> Varlen:
    inputs = varlen(TINY, 3, 300).make_inputs("cpu")
    return dataclasses.replace(inputs, **changes) if changes else inputs


@pytest.mark.parametrize(("change", "words"), [
    (lambda x: {"block_table": x.block_table.clone().index_fill_(1, torch.tensor([0]), 10_000)}, "out of range"),
    (lambda x: {"block_table": x.block_table[:, :2]}, "needs 7 pages of 16"),
    (lambda x: {"cache_seqlens": torch.zeros_like(x.cache_seqlens)}, "shorter than the 1 new tokens"),
    (lambda x: {"cache_seqlens": x.cache_seqlens.long()}, "cache_seqlens must be int32"),
    (lambda x: {"k_cache": x.k_cache[:, :, :1].expand(-1, -1, 3, -1), "v_cache": x.v_cache[:, :, :1].expand(
        -1, -1, 3, -1)}, "GQA ratio"),
    (lambda x: {"v_cache": x.v_cache[:, :8]}, "same shape"),
    (lambda x: {"v_cache": x.v_cache.float()}, "share one dtype"),
    (lambda x: {"k_cache": x.k_cache.to(torch.float8_e4m3fn)}, "share one dtype"),  # K fp8, V not
    (lambda x: {"k_scale": 0.5}, "applies to an fp8 cache only"),
])
def test_paged_input_errors_name_the_problem(change, words):
    base = paged_inputs()
    with pytest.raises((ValueError, TypeError), match=words):
        dataclasses.replace(base, **change(base))


@pytest.mark.parametrize(("change", "words"), [
    (lambda x: {"cu_seqlens_q": torch.tensor([0, 200, 100, 300], dtype=torch.int32)}, "non-decreasing"),
    (lambda x: {"cu_seqlens_k": torch.tensor([0, 10, 20, 30], dtype=torch.int32)}, "packed tensor has 300 rows"),
    (lambda x: {"cu_seqlens_q": torch.tensor([5, 10, 20, 300], dtype=torch.int32)}, "must be 0"),
    (lambda x: {"q": x.q[None]}, "3-D"),
])
def test_varlen_input_errors_name_the_problem(change, words):
    base = varlen_inputs()
    with pytest.raises((ValueError, TypeError), match=words):
        dataclasses.replace(base, **change(base))


@pytest.mark.parametrize("name", [impl.name for impl in impls.select() if impl.op == "varlen"])
@pytest.mark.parametrize(("lengths_q", "lengths_k", "causal"), first_fast(UNEVEN_VARLEN, unpack=True))
def test_uneven_varlen_batches_pass_or_are_refused_with_a_reason(name, lengths_q, lengths_k, causal):
    """Sequences with no queries or no keys, more keys than queries: what runs here matches the oracle (rows
    that see no key are zeros), what cannot run says why."""
    impl = impls.get(name, "varlen")
    reason = impl.availability("cpu")
    if reason:
        pytest.skip(reason)
    inputs = uneven_varlen(lengths_q, lengths_k, causal, "cpu", heads=(4, 2), head_dim=64)
    try:
        prepared = impl.prepare(inputs)
    except impls.Unsupported as exc:
        assert str(exc), "a refusal names its reason"
        pytest.skip(f"refused: {exc}")
    result = Oracle.serving(inputs).check(prepared())
    assert result.passed, result.message


def test_an_implementation_of_one_operation_refuses_another():
    with pytest.raises(TypeError, match="runs the 'paged' operation, got Varlen"):
        impls.get("naive", "paged").prepare(varlen_inputs())


@pytest.mark.parametrize(("change", "words"), [
    (lambda x: {"q": x.q.float()}, "needs fp16 or bf16 q"),
    (lambda x: {"v_scale": 0.0}, "finite positive"),
    (lambda x: {"k_scale": float("nan")}, "finite positive"),
])
def test_fp8_cache_errors_name_the_problem(change, words):
    base = fp8_inputs()
    with pytest.raises((ValueError, TypeError), match=words):
        dataclasses.replace(base, **change(base))


def test_an_fp8_case_is_its_bf16_twin_quantized_per_tensor():
    """The fp8 cache holds the bf16 twin's draw (lengths and values) over its own scale (largest magnitude at fp8's
    448), and half the bytes to read."""
    wide, narrow = (paged(TINY, 3, 100, lengths="longtail", kv_dtype=kv) for kv in ("", "fp8"))
    assert narrow.id == wide.id.replace("-d64-", "-d64-kvfp8-")
    inputs = fp8_inputs()
    assert inputs.kv_fp8 and inputs.k_cache.dtype == torch.float8_e4m3fn and inputs.q.dtype == torch.bfloat16
    stored = inputs.k_cache.float()
    assert 224 < stored[torch.isfinite(stored)].abs().max() <= 448  # the top of fp8's range (its largest may be NaN'd)
    assert inputs.k_scale != inputs.v_scale  # one scale per tensor
    assert narrow.seqlens() == wide.seqlens() and metrics.kv_bytes(narrow) * 2 == metrics.kv_bytes(wide)
    twin = wide.make_inputs("cpu")
    used = torch.isfinite(twin.k_cache)
    dequantized = inputs.k_cache.float()[used] * inputs.k_scale
    assert torch.allclose(dequantized, twin.k_cache.float()[used], rtol=2**-3, atol=inputs.k_scale * 2**-6)
    with pytest.raises(ValueError, match="kv_dtype"):
        Case(1, 4, 2, 64, 64, 64, "bf16", True, kv_dtype="fp8")  # dense attention has no cache to quantize


def test_an_fp8_cache_read_without_its_scales_fails_the_check():
    """The oracle dequantizes: an implementation that takes the stored values for the keys and values fails,
    one that scales them passes, and one that declares no fp8 cache refuses it with the reason."""
    @register("unscaled", op="paged", family="toy", devices=("cpu",), variants=("kv_fp8",))
    def unscaled(inputs, *, scale):
        plain = dataclasses.replace(inputs, k_cache=inputs.k_cache.to(inputs.q.dtype),
                                    v_cache=inputs.v_cache.to(inputs.q.dtype), k_scale=1.0, v_scale=1.0)
        return impls.get("naive", "paged").prepare(plain, scale=scale).run

    try:
        inputs = fp8_inputs()
        oracle = Oracle.serving(inputs)
        assert not oracle.check(impls.get("unscaled", "paged").prepare(inputs)()).passed
        assert oracle.check(impls.get("naive", "paged").prepare(inputs)()).passed
        with pytest.raises(impls.Unsupported, match="fp8"):
            impls.get("flash-attn4", "paged").prepare(inputs)
    finally:
        unregister("unscaled", "paged")


def test_case_ids_and_lengths():
    case = paged(("llama3-8b", 32, 8, 128), 16, 32768, lengths="longtail")
    assert case.id == "llama3-8b-paged-bf16-h32:8-q1-kv32768-longtail-p16-d128-b16"
    lengths = case.seqlens()
    assert lengths[0] == 32768 and all(1 <= n <= 32768 for n in lengths) and len(set(lengths)) > 8
    assert case.seqlens() == lengths  # seeded by the case
    mixed = varlen(("llama3-8b", 32, 8, 128), 16, 65536)
    assert sum(mixed.seqlens()) == 65536 and len(mixed.seqlens()) == 16
    assert varlen(TINY, 4, 256, lengths="equal").seqlens() == [64] * 4
    with pytest.raises(ValueError, match="do not apply to paged"):
        Case(1, 4, 2, 1, 64, 64, "bf16", True, op="paged", page_size=16, lengths="random")


def test_unused_cache_slots_hold_nan_and_the_pages_are_scattered():
    inputs = paged_inputs()
    page = inputs.page_size
    used = [math.ceil(n / page) for n in inputs.seqlens]
    table = inputs.block_table
    assert not torch.equal(table[0, : used[0]], torch.arange(used[0], dtype=torch.int32))  # not in order
    for b, n in enumerate(inputs.seqlens):
        pages = table[b, : used[b]].long()
        slots = inputs.k_cache[pages].flatten(0, 1)
        assert torch.isfinite(slots[:n]).all() and torch.isnan(slots[n:]).all()
        assert torch.isnan(inputs.v_cache[table[b, used[b]:].long()]).all()  # entries past the last page


def test_an_implementation_that_reads_past_a_length_fails_the_check():
    """Reading a whole last page (NaN past the length) must be caught, not averaged away."""
    @register("reads-whole-pages", op="paged", family="toy", devices=("cpu",))
    def whole_pages(inputs, *, scale):
        padded = dataclasses.replace(inputs, cache_seqlens=torch.tensor(
            [math.ceil(n / inputs.page_size) * inputs.page_size for n in inputs.seqlens], dtype=torch.int32))
        out = impls.get("naive", "paged").prepare(padded, scale=scale)
        return Prepared(out.run)

    try:
        inputs = paged_inputs()
        result = Oracle.serving(inputs).check(impls.get("reads-whole-pages", "paged").prepare(inputs)())
        assert not result.passed and "NaN" in result.message
    finally:
        unregister("reads-whole-pages", "paged")


def test_serving_metrics_count_each_sequence():
    case = paged(TINY, 3, 100, lengths="longtail")
    tokens = sum(case.seqlens())
    assert metrics.kv_bytes(case) == 2 * tokens * 2 * 64 * 2
    assert metrics.flops(case) == 4 * 4 * 64 * tokens  # one new token sees its whole sequence
    v = varlen(TINY, 3, 300, causal=False)
    assert metrics.flops(v) == 4 * 4 * 64 * sum(n * n for n in v.seqlens())


@pytest.mark.parametrize("name", ["serving-cpu", "varlen-cpu"])
def test_the_cpu_twins_cover_gqa_mqa_several_tokens_and_ragged_pages(name):
    grid = PRESETS[name]
    assert {c.hq // c.hkv for c in grid} >= ({1, 2, 4} if name == "serving-cpu" else {2, 4})
    if name == "serving-cpu":
        assert any(c.sq > 1 for c in grid) and any(c.skv % c.page_size for c in grid)
        assert {c.page_size for c in grid} >= {16, 32}


def test_dense_decode_steps_rank_by_bandwidth():
    """A decode-shaped dense case ranks by GB/s, as paged decode does; prefill, and a step of several queries
    that see the whole cache, by TFLOPS."""
    assert {c.merit for c in PRESETS["decode"]} == {"gbps"}
    assert Case(1, 8, 2, 4, 256, 64, "fp16", False).merit == "tflops"
    assert {c.merit for c in PRESETS["blog"]} == {"tflops"}
