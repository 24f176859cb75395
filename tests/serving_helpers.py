"""Serving inputs the serving test modules share: the CPU paged twin with a bf16 or an fp8 cache, and the fp8
twin's queries at extreme magnitudes (which tests/test_gpu_candidates.py also runs through cuTile's decode)."""

import dataclasses

import torch

from impls.contract import PagedKV
from suite.presets import paged

TINY = ("", 4, 2, 64)


def paged_inputs(**changes) -> PagedKV:
    inputs = paged(TINY, 3, 100, lengths="longtail").make_inputs("cpu")
    return dataclasses.replace(inputs, **changes) if changes else inputs


def fp8_inputs(**changes) -> PagedKV:
    inputs = paged(TINY, 3, 100, lengths="longtail", kv_dtype="fp8").make_inputs("cpu")
    return dataclasses.replace(inputs, **changes) if changes else inputs


# Query magnitudes far outside fp16's range: 2**40 would overflow it, 2**-60 flush to zero. The fp16 dots of bf16
# queries over an fp8 cache (F16_DOT) must keep both.
EXTREME_MAGNITUDES = (2.0**40, 2.0**-60)


def extreme_fp8_inputs(device: str, magnitude: float) -> tuple[PagedKV, float]:
    """The fp8 twin (ragged pages, NaN in unused slots) with its query heads multiplied by ``magnitude``, but for
    one all-zero head, and the score scale that gives the twin's own scores back (its softmax is the same)."""
    inputs = paged(TINY, 3, 100, lengths="longtail", kv_dtype="fp8").make_inputs(device)
    rows = torch.tensor([magnitude, magnitude, 0.0, magnitude], device=device, dtype=inputs.q.dtype)
    return dataclasses.replace(inputs, q=inputs.q * rows[None, None, :, None]), inputs.head_dim ** -0.5 / magnitude
