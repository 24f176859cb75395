"""The inputs of the backward pass and of a training step's forward and backward. See ``impls.contract``."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from impls.contract.dense import validate_attention_inputs
from impls.contract.serving import _check_tensor, _ServingInputs


class _Gradients(_ServingInputs):
    """Inputs whose call returns ``(dq, dk, dv)``."""

    def output_like(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.empty_like(self.q), torch.empty_like(self.k), torch.empty_like(self.v)


@dataclass
class Backward(_Gradients):
    """The backward pass of dense attention (``op="backward"``): the forward's inputs ``q (B, Hq, Sq, D)``,
    ``k, v (B, Hkv, Skv, D)``, its output ``o`` and upstream gradient ``do`` (both like q), and ``lse (B, Hq, Sq)``
    float32: the natural log-sum-exp of each row's scaled scores, ``+inf`` for a row that sees no key (flash-attn's
    convention), or None where no implementation that needs it runs (they declare ``needs=("lse",)``). The
    call returns ``(dq, dk, dv)`` shaped and typed like q, k, v; with GQA, dk and dv sum over each group's query
    heads. Causal is bottom-right, as in the forward."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    do: torch.Tensor
    lse: torch.Tensor | None = None
    causal: bool = False

    op = "backward"
    head_dim_tensors = ("q", "k", "v", "o", "do")

    def __post_init__(self) -> None:
        _check_training_inputs(self, ("o", "do"))
        if self.lse is not None:
            _check_tensor("lse", self.lse, 3, "(B, Hq, Sq)")
            if self.lse.shape != self.q.shape[:3] or self.lse.dtype != torch.float32:
                raise ValueError(f"lse must be float32 (B, Hq, Sq) = {tuple(self.q.shape[:3])}, got "
                                 f"{tuple(self.lse.shape)} {self.lse.dtype}")
            if self.lse.device != self.q.device:
                raise ValueError(f"lse must be on {self.q.device} with q, got {self.lse.device}")

    def in_kernel_layout(self):
        """As ``_ServingInputs.in_kernel_layout``, lse contiguous too."""
        laid_out = super().in_kernel_layout()
        if self.lse is not None and not self.lse.is_contiguous():
            laid_out = replace(laid_out, lse=self.lse.contiguous())
        return laid_out


def _check_training_inputs(inputs: Backward | ForwardBackward, like_q: tuple[str, ...]) -> None:
    """q, k, v as the forward takes them (one head dim for all three), and each of ``like_q`` shaped, typed and
    placed like q."""
    validate_attention_inputs(inputs.q, inputs.k, inputs.v)
    if inputs.v.shape != inputs.k.shape:
        raise ValueError(f"{inputs.op}: v must have k's shape {tuple(inputs.k.shape)} (no value head dim of its "
                         f"own), got {tuple(inputs.v.shape)}")
    q = inputs.q
    for name in like_q:
        t = getattr(inputs, name)
        _check_tensor(name, t, 4, "(B, Hq, Sq, D) like q")
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be shaped, typed and placed like q ({tuple(q.shape)} {q.dtype} on "
                             f"{q.device}), got {tuple(t.shape)} {t.dtype} on {t.device}")


@dataclass
class ForwardBackward(_Gradients):
    """A training step's attention (``op="fwdbwd"``): the forward over ``q, k, v`` (shaped as ``Backward``'s),
    then its backward under the upstream gradient ``do``; the call returns ``(dq, dk, dv)`` as ``Backward``'s
    does. The forward's output and lse are the step's own, made inside the call."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    causal: bool = False

    op = "fwdbwd"
    head_dim_tensors = ("q", "k", "v", "do")

    def __post_init__(self) -> None:
        _check_training_inputs(self, ("do",))

    def backward(self, o: torch.Tensor, lse: torch.Tensor | None) -> Backward:
        """The backward's inputs once the forward has made ``o`` and ``lse``."""
        return Backward(self.q, self.k, self.v, o, self.do, lse, causal=self.causal)
