import math

import pytest
import torch

from impls import default_scale, validate_attention_inputs


def qkv(q_shape=(1, 4, 8, 16), kv_shape=(1, 2, 8, 16), dtype=torch.float32):
    return torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)


def test_valid_inputs_return_default_scale():
    assert validate_attention_inputs(*qkv()) == pytest.approx(default_scale(16))
    assert validate_attention_inputs(*qkv(), scale=0.5) == 0.5


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
        (lambda q, k, v: (q, k[..., 0], v), ValueError, "k must be 4-D"),
        (lambda q, k, v: (q, k, v[:, :, :4]), ValueError, "k and v must have the same shape"),
        (lambda q, k, v: (q, k[:, :, :, :8], v[:, :, :, :8]), ValueError, "head dim"),
        (lambda q, k, v: (torch.cat([q, q]), k, v), ValueError, "batch size"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, "GQA ratio"),
        (lambda q, k, v: (q.half(), k, v), TypeError, "one dtype"),
        (lambda q, k, v: (q.to(torch.int32), k, v), TypeError, "floating-point"),
        (lambda q, k, v: (q.numpy(), k, v), TypeError, "torch.Tensor"),
        (lambda q, k, v: (q[:, :, :0], k, v), ValueError, "empty sequence"),
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), ValueError, "empty sequence"),
        (lambda q, k, v: (q, k.to("meta"), v.to("meta")), ValueError, "one device"),
    ],
)
def test_each_bad_input_has_a_clear_error(change, error, words):
    with pytest.raises(error, match=words):
        validate_attention_inputs(*change(*qkv()))


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan])
def test_non_finite_scale(scale):
    with pytest.raises(ValueError, match="scale must be finite"):
        validate_attention_inputs(*qkv(), scale=scale)


def test_scale_must_be_a_number():
    with pytest.raises(TypeError, match="scale must be a real number"):
        validate_attention_inputs(*qkv(), scale="0.1")
