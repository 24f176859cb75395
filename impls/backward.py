"""The backward pass of the peers (``op="backward"``): autograd through each one's dense forward entry; and a
training step (``op="fwdbwd"``: forward, then backward, as one timed call) for every backward entry.

Each peer's backward entry runs the peer's forward on the inputs as leaves at prepare time (so its own saved
output and log-sum-exp, not the ``o`` and ``lse`` of the inputs) and keeps the graph; the timed call is the
backward alone, ``torch.autograd.grad`` over that graph with the inputs' ``do``. Its training step times the
forward and ``torch.autograd.grad`` together. Naive: standard attention in the input dtype; SDPA: each backend
(the forward chooses the kernel, the backward follows it); flex: compiled, GPU only (PyTorch has no flex backward
on CPU); flash-attn 2/3/4: their ``flash_attn_func``, GPU only, ``requires`` naming a missing package. Packed
documents (``cu_seqlens``) go through the peer's varlen forward entry where it has one (naive: per document;
sdpa: nested jagged tensors; flex: its document mask; flash-attn: ``flash_attn_varlen_func``); the others (SDPA's
entries per backend, which have none) refuse them.

Any other backward entry (ours: ``impls.triton_fa.backward``, ``impls.cutile``) gets its training step from
``forward_backward``: the ``forward=`` it registered, writing ``(o, lse)``, then the backward over them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import impls.flash_attn_pkg  # the forward entries, registered on import
import impls.flex
import impls.naive
import impls.sdpa
from impls._registry import REGISTRY, Impl, Prepared, Unsupported, derived, refusing, register
from impls.contract import Backward, ForwardBackward, Varlen

PEERS = ("naive", *impls.sdpa.BACKENDS, "flex", *impls.flash_attn_pkg.GENERATIONS)
GPU_ONLY = ("flex",)  # PyTorch 2.13: "FlexAttention does not support backward on CPU"
# What a forward's autograd node can refuse with at backward time (a backend without a backward for this input).
REFUSALS = (RuntimeError, NotImplementedError, ValueError, AssertionError, TypeError)


def _forward_on(name: str, leaves: tuple[torch.Tensor, ...], inputs: Backward | ForwardBackward, *, scale: float,
                **variants) -> Prepared:
    """Peer ``name``'s forward prepared on ``leaves`` (q, k, v): its dense entry, or over packed documents its
    varlen entry, each document attending to itself."""
    if inputs.packed:
        q, k, v = leaves
        packed = Varlen(q, k, v, inputs.cu_seqlens, inputs.cu_seqlens, causal=inputs.causal)
        return REGISTRY["varlen", name].prepare(packed, scale=scale, **variants)
    return REGISTRY["dense", name].prepare(*leaves, causal=inputs.causal, scale=scale, **variants)


def _autograd(name: str, inputs: Backward | ForwardBackward, *, scale: float, step: bool, **variants) -> Prepared:
    """Peer ``name``'s forward prepared on ``inputs.q, k, v`` as leaves; the call: their gradients under
    ``inputs.do``, through a graph kept from one forward run here, or (``step``) through the call's own forward."""
    leaves = tuple(t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    with torch.enable_grad():
        prepared = _forward_on(name, leaves, inputs, scale=scale, **variants)
        kept = prepared()
    if not kept.requires_grad:
        raise Unsupported(f"{name}: its forward keeps no autograd graph")

    def backward(out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(out, leaves, inputs.do, retain_graph=not step)

    def run_step() -> tuple[torch.Tensor, ...]:
        with torch.enable_grad():
            return backward(prepared())

    run: Callable[[], tuple[torch.Tensor, ...]] = run_step if step else lambda: backward(kept)
    with refusing(*REFUSALS):
        run()
    return Prepared(run, config={**prepared.config, "backward": "autograd"})


def _make(name: str) -> None:
    forward = REGISTRY["dense", name]
    devices = tuple(d for d in forward.devices if d == "cuda" or name not in GPU_ONLY)
    packed = ("packed",) if ("varlen", name) in REGISTRY else ()
    variants = (*(v for v in forward.variants if v in ("window", "softcap")), *packed)
    for op, step, timed in (("backward", False, "only the backward is timed"),
                            ("fwdbwd", True, "forward and backward timed together")):

        @register(name, op=op, family=forward.family, dtypes=forward.dtypes, devices=devices,
                  head_dims=forward.head_dims, requires=forward.requires,
                  variants=variants, description=f"autograd through the forward ({forward.description}); {timed}")
        def prepare(inputs: Backward | ForwardBackward, *, scale: float, step: bool = step, **variants) -> Prepared:
            return _autograd(name, inputs, scale=scale, step=step, **variants)


for _name in PEERS:
    _make(_name)


def forward_backward(backward: Impl) -> Callable[..., Prepared]:
    """The training step of ``backward``: its registered ``forward`` writes ``(o, lse)``, then the backward reads
    them, both in the timed call. Over packed documents the forward takes ``cu_seqlens=`` and ``max_seqlen=`` too
    (the backward declares ``"packed"`` for both)."""

    def prepare(inputs: ForwardBackward, *, scale: float, **variants) -> Prepared:
        if backward.forward is None:
            raise Unsupported(f"{backward.name}: its backward entry names no forward (forward=) that writes the "
                              f"output and log-sum-exp a training step's backward reads")
        q, k, v = inputs.q, inputs.k, inputs.v
        documents = {"cu_seqlens": inputs.cu_seqlens, "max_seqlen": inputs.max_seqlen} if inputs.packed else {}
        forward = backward.forward(q, k, v, causal=inputs.causal, scale=scale, **documents, **variants)
        forward = forward if isinstance(forward, Prepared) else Prepared(forward)
        o, lse = forward()
        again = forward()
        if again[0] is not o or again[1] is not lse:
            raise ValueError(f"{backward.name}: forward= must write (o, lse) into the same buffers each call, for "
                             f"the backward prepared on them to read")
        prepared = backward.prepare(inputs.backward(o, lse), scale=scale, **variants)

        def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            forward()
            return prepared()

        return Prepared(run, config={**forward.config, **prepared.config})

    return prepare


@derived
def training_steps() -> None:
    """A ``fwdbwd`` entry for every backward entry that has none of its own, declaring what the backward does."""
    for (op, name), impl in list(REGISTRY.items()):
        if op == "backward" and ("fwdbwd", name) not in REGISTRY:
            register(name, op="fwdbwd", family=impl.family, dtypes=impl.dtypes, devices=impl.devices,
                     head_dims=impl.head_dims, requires=impl.requires, variants=impl.variants,
                     description=f"{impl.description}; its forward first, timed together")(forward_backward(impl))
