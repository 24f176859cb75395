"""PyTorch ``scaled_dot_product_attention``: one entry per backend, plus PyTorch's own choice."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from impls._registry import Unsupported, probe, register

BACKENDS: dict[str, tuple[SDPBackend | None, tuple[str, ...]]] = {
    "sdpa": (None, ("cpu", "cuda")),
    "sdpa-math": (SDPBackend.MATH, ("cpu", "cuda")),
    "sdpa-flash": (SDPBackend.FLASH_ATTENTION, ("cpu", "cuda")),
    "sdpa-efficient": (SDPBackend.EFFICIENT_ATTENTION, ("cuda",)),
    "sdpa-cudnn": (SDPBackend.CUDNN_ATTENTION, ("cuda",)),
}


def _sdpa_kwargs(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> dict:
    kwargs: dict = {"scale": scale, "enable_gqa": q.shape[1] != k.shape[1]}
    if causal and q.shape[2] == k.shape[2]:
        kwargs["is_causal"] = True
    elif causal:  # the contract's bottom-right alignment; SDPA's is_causal is top-left
        kwargs["attn_mask"] = causal_lower_right(q.shape[2], k.shape[2])
    return kwargs


def refusal_reason(messages: list[str]) -> str:
    """PyTorch's warnings, minus its source locations, the bare "kernel not used because:" headers and the
    notes about the backends this entry switched off itself."""
    reasons = []
    for message in messages:
        text = " ".join(message.split("(Triggered internally at")[0].split())
        noise = text.endswith("because:") or text.endswith("has been runtime disabled.")
        if text and not noise and text not in reasons:
            reasons.append(text)
    return "; ".join(reasons)[:400]


def _make(name: str, backend: SDPBackend | None, devices: tuple[str, ...]) -> None:
    what = "PyTorch's own backend choice" if backend is None else f"backend {backend.name}"

    @register(name, family="sdpa", devices=devices, description=f"torch SDPA, {what}")
    def prepare(q, k, v, *, causal: bool, scale: float):
        kwargs = _sdpa_kwargs(q, k, causal, scale)
        if backend is None:
            def call():
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            def call():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, **kwargs)

        # PyTorch explains a refusal in warnings and raises a generic error: keep the explanation.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return probe(call, RuntimeError)
            except Unsupported as exc:
                raise Unsupported(refusal_reason([str(w.message) for w in caught]) or str(exc)) from exc


for _name, (_backend, _devices) in BACKENDS.items():
    _make(_name, _backend, _devices)
