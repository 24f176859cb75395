"""The inputs of the backward pass and of a training step's forward and backward. See ``impls.contract``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch

from impls.contract.dense import validate_attention_inputs
from impls.contract.serving import _check_layouts, _check_tensor, _checked_offsets, _ServingInputs


class _Gradients(_ServingInputs):
    """Inputs whose call returns ``(dq, dk, dv)``: dense ``(B, H, S, D)`` tensors, or documents packed as
    ``(total, H, D)`` rows with ``cu_seqlens (B+1,) int32`` (document ``b`` is rows ``cu[b]:cu[b+1]`` of q, k, v and
    every tensor like q; each attends to itself only, causal within it)."""

    q: torch.Tensor
    k: torch.Tensor
    cu_seqlens: torch.Tensor | None
    offsets: tuple[int, ...]  # host copy of cu_seqlens (packed), else ()

    def output_like(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.empty_like(self.q), torch.empty_like(self.k), torch.empty_like(self.v)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def index_tensors(self) -> tuple[str, ...]:
        return ("cu_seqlens",) if self.packed else ()

    @property
    def batch(self) -> int:
        """Documents (packed) or sequences (dense)."""
        return len(self.offsets) - 1 if self.packed else self.q.shape[0]

    def seqlens(self) -> list[int]:
        """Each document's (or dense sequence's) length."""
        if self.packed:
            return [b - a for a, b in itertools.pairwise(self.offsets)]
        return [self.q.shape[2]] * self.batch

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens())

    def document(self, t: torch.Tensor, b: int) -> torch.Tensor:
        """Document ``b``'s rows of a packed ``t (total, H, ...)`` as the dense layout's ``(1, H, L, ...)`` (a view)."""
        return t[self.offsets[b]:self.offsets[b + 1]].transpose(0, 1)[None]


def _check_training_inputs(inputs: Backward | ForwardBackward, like_q: tuple[str, ...]) -> None:
    """q, k, v as the forward takes them (one head dim for all three; packed: the same rows, split by valid
    offsets), and each of ``like_q`` shaped, typed and placed like q."""
    q, k, v = inputs.q, inputs.k, inputs.v
    if inputs.cu_seqlens is None:
        validate_attention_inputs(q, k, v)
        rank, layout = 4, "(B, Hq, Sq, D) like q"
    else:
        _check_layouts(q, k, v, "k", "v", ("(total, Hq, D)", "(total, Hkv, D)"),
                       {"cu_seqlens": (inputs.cu_seqlens, "(B+1,)")})
        if inputs.cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be (B+1,) with B >= 1, got {tuple(inputs.cu_seqlens.shape)}")
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"packed q and k must hold the same rows (each document attends to itself), got "
                             f"{q.shape[0]} and {k.shape[0]}")
        inputs.offsets = _checked_offsets("cu_seqlens", inputs.cu_seqlens, q.shape[0])
        rank, layout = 3, "(total, Hq, D) like q"
    if v.shape != k.shape:
        raise ValueError(f"{inputs.op}: v must have k's shape {tuple(k.shape)} (no value head dim of its "
                         f"own), got {tuple(v.shape)}")
    for name in like_q:
        t = getattr(inputs, name)
        _check_tensor(name, t, rank, layout)
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be shaped, typed and placed like q ({tuple(q.shape)} {q.dtype} on "
                             f"{q.device}), got {tuple(t.shape)} {t.dtype} on {t.device}")


@dataclass
class Backward(_Gradients):
    """The backward pass of attention (``op="backward"``): the forward's inputs ``q (B, Hq, Sq, D)``,
    ``k, v (B, Hkv, Skv, D)``, its output ``o`` and upstream gradient ``do`` (both like q), and ``lse (B, Hq, Sq)``
    float32: the natural log-sum-exp of each row's scaled scores, ``+inf`` for a row that sees no key (flash-attn's
    convention), or None where no implementation that needs it runs (they declare ``needs=("lse",)``). The
    call returns ``(dq, dk, dv)`` shaped and typed like q, k, v; with GQA, dk and dv sum over each group's query
    heads. Causal is bottom-right, as in the forward. Packed documents (``cu_seqlens``, ``_Gradients``): q, o, do
    ``(total, Hq, D)``, k, v ``(total, Hkv, D)`` and lse ``(total, Hq)``, one value per row of q in q's order."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    do: torch.Tensor
    lse: torch.Tensor | None = None
    causal: bool = False
    cu_seqlens: torch.Tensor | None = None
    offsets: tuple[int, ...] = field(init=False, default=())

    op = "backward"
    head_dim_tensors = ("q", "k", "v", "o", "do")

    def __post_init__(self) -> None:
        _check_training_inputs(self, ("o", "do"))
        if self.lse is not None:
            rows = tuple(self.q.shape[:-1])
            layout = "(total, Hq)" if self.packed else "(B, Hq, Sq)"
            _check_tensor("lse", self.lse, len(rows), layout)
            if self.lse.shape != rows or self.lse.dtype != torch.float32:
                raise ValueError(f"lse must be float32 {layout} = {rows}, got {tuple(self.lse.shape)} "
                                 f"{self.lse.dtype}")
            if self.lse.device != self.q.device:
                raise ValueError(f"lse must be on {self.q.device} with q, got {self.lse.device}")

    def in_kernel_layout(self):
        """As ``_ServingInputs.in_kernel_layout``, lse contiguous too."""
        laid_out = super().in_kernel_layout()
        if self.lse is not None and not self.lse.is_contiguous():
            laid_out = replace(laid_out, lse=self.lse.contiguous())
        return laid_out


@dataclass
class ForwardBackward(_Gradients):
    """A training step's attention (``op="fwdbwd"``): the forward over ``q, k, v`` (shaped as ``Backward``'s, dense
    or packed), then its backward under the upstream gradient ``do``; the call returns ``(dq, dk, dv)`` as
    ``Backward``'s does. The forward's output and lse are the step's own, made inside the call."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    causal: bool = False
    cu_seqlens: torch.Tensor | None = None
    offsets: tuple[int, ...] = field(init=False, default=())

    op = "fwdbwd"
    head_dim_tensors = ("q", "k", "v", "do")

    def __post_init__(self) -> None:
        _check_training_inputs(self, ("do",))

    def backward(self, o: torch.Tensor, lse: torch.Tensor | None) -> Backward:
        """The backward's inputs once the forward has made ``o`` and ``lse``."""
        return Backward(self.q, self.k, self.v, o, self.do, lse, causal=self.causal, cu_seqlens=self.cu_seqlens)
