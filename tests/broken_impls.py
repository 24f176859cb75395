"""Deliberately broken implementations for the fault tests.

Registered only in the pytest processes that load this file as a plugin (``-p tests.broken_impls``), which
the fault tests start themselves: they never appear in a normal run. Each misbehaves on one case of the
``cpu-bench`` grid (or all, where noted) and computes the right answer elsewhere.
"""

from __future__ import annotations

import os
import time

import torch

from impls import register
from impls.reference import attention_ref


def _correct(q, k, v, causal, scale):
    return lambda: attention_ref(q, k, v, causal=causal, scale=scale, upcast=False)


def _is_last_case(q, causal: bool) -> bool:  # cpu-bench's last case: causal, S=256
    return causal and q.shape[2] == 256


@register("broken-hang", family="broken", description="spins forever on one case, like a stuck autotuner")
def hang(q, k, v, *, causal, scale):
    while _is_last_case(q, causal):
        time.sleep(0.5)
    return _correct(q, k, v, causal, scale)


@register("broken-crash", family="broken", description="kills its process on one case, like a device fault")
def crash(q, k, v, *, causal, scale):
    if _is_last_case(q, causal):
        os.abort()
    return _correct(q, k, v, causal, scale)


@register("broken-alloc", family="broken", description="asks for an exabyte")
def alloc(q, k, v, *, causal, scale):
    workspace = torch.empty(1 << 60, dtype=torch.uint8, device=q.device)
    return lambda: workspace


@register("broken-raise", family="broken", description="raises in the timed call on causal cases")
def raise_mid_run(q, k, v, *, causal, scale):
    def run():
        if causal:
            raise RuntimeError("kernel exploded mid-run")
        return attention_ref(q, k, v, causal=causal, scale=scale, upcast=False)

    return run


@register("broken-oob", family="broken", devices=("cuda",), description="a Triton kernel that stores out of bounds")
def out_of_bounds(q, k, v, *, causal, scale):
    import triton
    import triton.language as tl

    @triton.jit
    def store_far_away(out_ptr):
        offsets = tl.arange(0, 128).to(tl.int64) + (1 << 40)  # a terabyte past the buffer
        tl.store(out_ptr + offsets, tl.zeros([128], dtype=tl.float32))

    out = torch.empty_like(q, dtype=torch.float32)

    def run():
        store_far_away[(1,)](out)
        return out.to(q.dtype)

    return run
