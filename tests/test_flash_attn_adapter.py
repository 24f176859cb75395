"""The flash-attn adapter's layout and argument mapping, against a fake module (no GPU, no package)."""

import sys
import types

import pytest
import torch

import impls
import impls._registry
from impls import Unsupported
from impls.flash_attn_pkg import GENERATIONS
from impls.reference import attention_ref
from suite.checks import Oracle
from suite.presets import mla


@pytest.fixture(params=list(GENERATIONS))
def fake_flash(request, monkeypatch):
    """Install a fake module for one generation; its function checks the (B, S, H, D) layout it gets."""
    name = request.param
    module, attribute, _ = GENERATIONS[name]
    seen = {}

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, **kwargs):
        seen.update(shape=tuple(q.shape), kv_shape=tuple(k.shape), scale=softmax_scale, causal=causal)
        out = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                            scale=softmax_scale, upcast=False).transpose(1, 2)
        return (out, None) if name != "flash-attn2" else out  # FA3/FA4 return (out, lse)

    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    setattr(sys.modules[module], attribute, flash_attn_func)
    impl = impls.get(name)
    monkeypatch.setattr(type(impl), "availability", lambda self, device: None)
    return impl, seen


def test_layout_and_arguments_are_mapped(fake_flash):
    impl, seen = fake_flash
    q, k, v = torch.randn(2, 8, 5, 16).half(), torch.randn(2, 2, 7, 16).half(), torch.randn(2, 2, 7, 16).half()
    out = impl(q, k, v, causal=True, scale=0.3)
    assert seen == {"shape": (2, 5, 8, 16), "kv_shape": (2, 7, 2, 16), "scale": 0.3, "causal": True}
    assert out.shape == q.shape
    torch.testing.assert_close(out, attention_ref(q, k, v, causal=True, scale=0.3, upcast=False))


def test_missing_package_is_a_reason_not_a_crash():
    reason = impls.get("flash-attn3").requires("cuda")
    if reason is None:
        pytest.skip("flash_attn_interface is installed here")
    assert "flash_attn_interface.flash_attn_func not importable" in reason


def fa3_mla_reference(q, k_cache, v_cache, *, qv, page_table, cache_seqlens, softmax_scale, causal, **kwargs):
    """FA3's flash_attn_with_kvcache with qv, from the arguments alone: scores q . k + qv . v over each sequence's
    pages, bottom-right causal, values v; a wrong layout or a swapped part changes the result or fails a shape."""
    batch, new, heads, rope = q.shape
    num_pages, page_size, kv_heads, latent = v_cache.shape
    assert k_cache.shape == (num_pages, page_size, kv_heads, rope) and kv_heads == 1
    assert qv.shape == (batch, new, heads, latent) and page_table.dtype == torch.int32
    out = torch.empty_like(qv)
    for b, length in enumerate(cache_seqlens.tolist()):
        pages = page_table[b, :-(-length // page_size)]
        k, v = (c[pages].reshape(-1, c.shape[-1])[:length].float() for c in (k_cache, v_cache))
        scores = (q[b].float() @ k.T + qv[b].float() @ v.T) * softmax_scale  # (new, heads, length)
        if causal:
            visible = torch.arange(length)[None, :] <= torch.arange(length - new, length)[:, None]
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[b] = (scores.softmax(-1) @ v).to(out.dtype)
    return out, None


@pytest.fixture
def fake_fa3_mla(monkeypatch):
    """flash_attn_interface with a flash_attn_with_kvcache that computes MLA from what it is given."""
    seen = {}

    def flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs):
        seen.update(q=tuple(q.shape), k_cache=tuple(k_cache.shape), v_cache=tuple(v_cache.shape), **kwargs)
        return fa3_mla_reference(q, k_cache, v_cache, **kwargs)

    module = types.ModuleType("flash_attn_interface")
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
    monkeypatch.setattr(impls._registry.Impl, "availability", lambda self, device: None)
    return impls.get("flash-attn3", "mla"), seen


def test_fa3_mla_passes_rope_as_q_k_and_latent_as_qv_v(fake_fa3_mla):
    impl, seen = fake_fa3_mla
    inputs = mla(("", 4, 32, 8), 3, 100, sq=2, page_size=16, lengths="longtail").make_inputs("cpu")
    out = impl.prepare(inputs, scale=0.2)()
    assert (seen["q"], seen["k_cache"], seen["v_cache"]) == ((3, 2, 4, 8), (*inputs.ckv.shape[:2], 1, 8),
                                                             (*inputs.ckv.shape[:2], 1, 32))
    assert seen["qv"] is inputs.q_nope and seen["page_table"] is inputs.block_table
    assert seen["cache_seqlens"] is inputs.cache_seqlens and seen["softmax_scale"] == 0.2 and seen["causal"]
    assert out.shape == inputs.q_nope.shape and Oracle.serving(inputs, scale=0.2).check(out).passed


def test_fa3_mla_default_scale_is_the_contracts(fake_fa3_mla):
    impl, seen = fake_fa3_mla
    impl.prepare(mla(("", 4, 32, 8), 1, 20, page_size=16).make_inputs("cpu"))
    assert seen["softmax_scale"] == pytest.approx((32 + 8) ** -0.5)


@pytest.mark.parametrize(("name", "model", "kv_dtype", "words"), [
    ("flash-attn3", ("", 4, 32, 128), "", "rotary part of 128: flash-attn 3 takes qv .* q/k head dim up to 64"),
    ("flash-attn3", ("", 4, 32, 8), "fp8", "fp8 .* KV cache not supported"),
    ("flash-attn2", ("", 4, 32, 8), "", "flash-attn 2 supports head dims up to 256.*MLA's scores are 40 wide"),
    ("flash-attn4", ("", 4, 32, 8), "", "flash-attn 4 .* takes no qv"),
])
def test_mla_refusals_name_the_reason(fake_fa3_mla, name, model, kv_dtype, words):
    inputs = mla(model, 1, 20, page_size=16, kv_dtype=kv_dtype).make_inputs("cpu")
    with pytest.raises(Unsupported, match=words):
        impls.get(name, "mla").prepare(inputs)


def test_mla_entries_are_cuda_only_and_name_a_missing_package():
    for name in GENERATIONS:
        impl = impls.get(name, "mla")
        assert impl.devices == ("cuda",) and impl.family == "flash-attn"
    reason = impls.get("flash-attn3", "mla").requires("cuda")
    if reason is not None:
        assert "flash_attn_interface.flash_attn_with_kvcache not importable" in reason


def test_fa3_paged_decode_passes_its_page_table_by_fa3s_keyword(fake_fa3_mla):
    """FA3's flash_attn_with_kvcache takes ``page_table`` (FA2's ``block_table``): a wrong keyword is a TypeError."""
    from suite.presets import paged

    seen = {}

    def flash_attn_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table, softmax_scale, causal, **kwargs):
        seen.update(page_table=page_table, causal=causal)
        return torch.zeros_like(q)

    sys.modules["flash_attn_interface"].flash_attn_with_kvcache = flash_attn_with_kvcache
    inputs = paged(("", 4, 2, 16), 2, 40, page_size=16).make_inputs("cpu")
    impls.get("flash-attn3", "paged").prepare(inputs, scale=0.25)()
    assert seen["page_table"] is inputs.block_table and seen["causal"]
