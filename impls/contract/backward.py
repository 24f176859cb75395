"""The backward pass's inputs. See ``impls.contract``."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from impls.contract.dense import validate_attention_inputs
from impls.contract.serving import _check_tensor, _ServingInputs


@dataclass
class Backward(_ServingInputs):
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
        validate_attention_inputs(self.q, self.k, self.v)
        if self.v.shape != self.k.shape:
            raise ValueError(f"backward: v must have k's shape {tuple(self.k.shape)} (no value head dim of its "
                             f"own), got {tuple(self.v.shape)}")
        for name in ("o", "do"):
            t = getattr(self, name)
            _check_tensor(name, t, 4, "(B, Hq, Sq, D) like q")
            if t.shape != self.q.shape or t.dtype != self.q.dtype or t.device != self.q.device:
                raise ValueError(f"{name} must be shaped, typed and placed like q ({tuple(self.q.shape)} "
                                 f"{self.q.dtype} on {self.q.device}), got {tuple(t.shape)} {t.dtype} on {t.device}")
        if self.lse is not None:
            _check_tensor("lse", self.lse, 3, "(B, Hq, Sq)")
            if self.lse.shape != self.q.shape[:3] or self.lse.dtype != torch.float32:
                raise ValueError(f"lse must be float32 (B, Hq, Sq) = {tuple(self.q.shape[:3])}, got "
                                 f"{tuple(self.lse.shape)} {self.lse.dtype}")
            if self.lse.device != self.q.device:
                raise ValueError(f"lse must be on {self.q.device} with q, got {self.lse.device}")

    def output_like(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.empty_like(self.q), torch.empty_like(self.k), torch.empty_like(self.v)

    def in_kernel_layout(self):
        """As ``_ServingInputs.in_kernel_layout``, lse contiguous too."""
        laid_out = super().in_kernel_layout()
        if self.lse is not None and not self.lse.is_contiguous():
            laid_out = replace(laid_out, lse=self.lse.contiguous())
        return laid_out
