"""The flash-attn adapter's layout and argument mapping, against a fake module (no GPU, no package)."""

import sys
import types

import pytest
import torch

import impls
from impls.flash_attn_pkg import GENERATIONS
from impls.reference import attention_ref


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
