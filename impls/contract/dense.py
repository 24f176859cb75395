"""The dense contract: input checks that name the problem, the scale, sliding windows, and which dense calls are
decode steps. See ``impls.contract``."""


from __future__ import annotations

import math

import torch


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def validate_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> float:
    """Check the contract's shapes, dtypes and devices; return the softmax scale to use.

    Raises ``TypeError`` for a wrong type or dtype and ``ValueError`` for a wrong shape, device or scale,
    with the offending argument named in the message.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "(B, Hq, Sq, D)" if name == "q" else "(B, Hkv, Skv, D)"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if k.shape[:3] != v.shape[:3]:  # the head dim of v may differ (DeepSeek's MLA prefill: Dqk 192, Dv 128)
        raise ValueError(f"k and v must have the same shape (B, Hkv, Skv; only the head dim may differ), got "
                         f"k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    (b, hq, sq, d), (bk, hkv, skv, dk) = q.shape, k.shape
    if b != bk:
        raise ValueError(f"batch size of q ({b}) and k/v ({bk}) differ")
    if d != dk:
        raise ValueError(f"head dim of q ({d}) and k/v ({dk}) differ")
    if min(b, hq, hkv, d, v.shape[-1]) == 0:
        raise ValueError(f"empty tensor: q {tuple(q.shape)}, k/v {tuple(k.shape)}")
    if sq == 0 or skv == 0:
        raise ValueError(f"empty sequence: Sq={sq}, Skv={skv} (both must be at least 1)")
    if hq % hkv != 0:
        raise ValueError(
            f"GQA ratio: query heads Hq={hq} must be a multiple of key/value heads Hkv={hkv}"
        )
    return default_scale(d) if scale is None else validate_scale(scale)


def unit_head_stride(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor with its head dim (the last) at unit stride, as kernels address it: a copy where it is
    strided, else the tensor itself."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def validate_scale(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


NO_WINDOW = (-1, -1)  # window=(left, right) with both sides unbounded: no sliding window
UNBOUNDED = 1 << 30  # what a kernel is given for an unbounded (-1) window side: more keys than any sequence has


def window_bounds(window: tuple[int, int], causal: bool) -> tuple[int, int]:
    """``(left, right)`` as our kernels take them: an unbounded side as UNBOUNDED keys, right 0 when causal."""
    left, right = (UNBOUNDED if w < 0 else w for w in window)
    return left, 0 if causal else right


def binding_window(window: tuple[int, int], causal: bool, q_len: int, kv_len: int) -> tuple[int, int]:
    """``window`` with each side that hides no key unbounded (-1), so NO_WINDOW where it hides none: a kernel
    then runs without the window's masks and loops (flash-attn drops such a side too). Mistral-7B's window of
    4096 over a 4K prefill is the common case. Bottom-right aligned: the last query row sits at key position
    kv_len - 1 and the first at kv_len - q_len, so the left side hides a key iff left < kv_len - 1, and the right
    side (not causal; causal already hides everything right of a row) iff right < q_len - 1."""
    left, right = window
    left = left if 0 <= left < kv_len - 1 else -1
    right = right if not causal and 0 <= right < q_len - 1 else -1
    return left, right


def validate_variants(window: tuple[int, int] | None, softcap: float) -> tuple[tuple[int, int], float]:
    """The model variants: ``window=(left, right)`` of ints >= -1 (-1: unbounded), ``softcap >= 0``."""
    window = NO_WINDOW if window is None else window
    if (not isinstance(window, tuple | list) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
        raise ValueError(f"window must be (left, right) with ints >= -1 (-1: unbounded), got {window!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, int | float) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    return (int(window[0]), int(window[1])), float(softcap)


# A dense call shaped like decode: a few new tokens at the end of a longer cache, causal (bottom-right) or one token.
# Such a step reads its whole cache for little compute, so it is bound by the bytes it reads, like paged decode.
DENSE_DECODE_MAX_NEW = 16  # new tokens, as the paged operation takes them (speculative decoding verifies up to 16)


def decode_shaped(sq: int, skv: int, causal: bool) -> bool:
    """Whether a dense call of ``sq`` queries over ``skv`` keys is a decode step: at most DENSE_DECODE_MAX_NEW new
    tokens, the last ``sq`` positions of the cache, each seeing the keys up to its own (causal, bottom-right, or a
    single token, which sees them all either way)."""
    return sq <= DENSE_DECODE_MAX_NEW and sq < skv and (causal or sq == 1)
