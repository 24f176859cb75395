"""The backward pass of the peers (``op="backward"``): autograd through each one's dense forward entry.

Each entry's prepare step runs the peer's forward on the inputs as leaves (so its own saved output and
log-sum-exp, not the ``o`` and ``lse`` of the inputs) and keeps the graph; the timed call is the backward alone,
``torch.autograd.grad`` over that graph with the inputs' ``do``. Naive: standard attention in the input dtype;
SDPA: each backend (the forward chooses the kernel, the backward follows it); flex: compiled, GPU only (PyTorch
has no flex backward on CPU); flash-attn 2/3/4: their ``flash_attn_func``, GPU only, ``requires`` naming a missing
package. Our own kernels are ``impls.triton_fa.backward`` and ``impls.cutile.backward``.
"""

from __future__ import annotations

import torch

import impls.flash_attn_pkg  # the forward entries, registered on import
import impls.flex
import impls.naive
import impls.sdpa
from impls._registry import REGISTRY, Impl, Prepared, Unsupported, refusing, register
from impls.contract import Backward

PEERS = ("naive", *impls.sdpa.BACKENDS, "flex", *impls.flash_attn_pkg.GENERATIONS)
GPU_ONLY = ("flex",)  # PyTorch 2.13: "FlexAttention does not support backward on CPU"
# What a forward's autograd node can refuse with at backward time (a backend without a backward for this input).
REFUSALS = (RuntimeError, NotImplementedError, ValueError, AssertionError, TypeError)


def autograd_backward(forward: Impl, inputs: Backward, *, scale: float, **variants) -> Prepared:
    """``forward`` run once on ``inputs.q, k, v`` as leaves, its graph kept; the call: their gradients under
    ``inputs.do``."""
    leaves = tuple(t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    with torch.enable_grad():
        prepared = forward.prepare(*leaves, causal=inputs.causal, scale=scale, **variants)
        out = prepared()
    if not out.requires_grad:
        raise Unsupported(f"{forward.name}: its forward keeps no autograd graph")

    def run() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(out, leaves, inputs.do, retain_graph=True)

    with refusing(*REFUSALS):
        run()
    return Prepared(run, config={**prepared.config, "backward": "autograd"})


def _make(name: str) -> None:
    forward = REGISTRY["dense", name]

    devices = tuple(d for d in forward.devices if d == "cuda" or name not in GPU_ONLY)

    @register(name, op="backward", family=forward.family, dtypes=forward.dtypes, devices=devices,
              head_dims=forward.head_dims, requires=forward.requires,
              variants=tuple(v for v in forward.variants if v in ("window", "softcap")),
              description=f"autograd through the forward ({forward.description}); only the backward is timed")
    def prepare(inputs: Backward, *, scale: float, **variants) -> Prepared:
        return autograd_backward(forward, inputs, scale=scale, **variants)


for _name in PEERS:
    _make(_name)
