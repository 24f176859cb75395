"""Attention the way eager PyTorch writes it, in chunks of query rows so that memory stays bounded.

``attention_ref(..., upcast=True)`` is the oracle: every operation in float64. ``upcast=False`` is standard
attention in the input dtype (matmuls in the input dtype, softmax in float32, probabilities cast back for
``P @ V``), i.e. flash-attention's ``attention_ref`` without upcast: its error against the oracle is the
yardstick of the suite's tolerance rule.

Conventions of the contract, which every implementation is checked against:
- GQA: query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
- Causal with ``Sq != Skv`` is aligned bottom-right: query ``i`` sees keys ``j <= i + (Skv - Sq)``.
- A query row that sees no key (causal with ``Sq > Skv``) outputs zeros, as flash-attn does.
- A sliding window ``(left, right)`` (``-1``: unbounded on that side), aligned bottom-right like causal: query
  ``i`` at key position ``p = i + Skv - Sq`` sees keys ``p - left <= j <= p + right``; causal caps ``right``
  at 0. flash-attn's ``window_size``.
- Softcap ``c > 0``: each scaled score ``s`` becomes ``c * tanh(s / c)`` before the softmax (Gemma 2, Grok).
"""

from __future__ import annotations

import torch

from impls.contract import NO_WINDOW, sequences, validate_attention_inputs


def causal_visible(sq: int, skv: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``(Sq, Skv)`` matrix: True where query ``i`` may see key ``j`` (bottom-right aligned)."""
    return visible(sq, skv, causal=True, device=device)


def visible(sq: int, skv: int, *, causal: bool, window: tuple[int, int] = NO_WINDOW,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``(Sq, Skv)`` matrix of the keys each query sees: causal and a window, both bottom-right."""
    position = torch.arange(sq, device=device)[:, None] + (skv - sq)
    cols = torch.arange(skv, device=device)[None, :]
    left, right = window
    if causal:  # a causal window ends at the query's own position
        right = 0
    seen = torch.ones(sq, skv, dtype=torch.bool, device=device)
    if right >= 0:
        seen &= cols <= position + right
    if left >= 0:
        seen &= cols >= position - left
    return seen


def score_bytes(q: torch.Tensor, k: torch.Tensor, rows: int | None = None) -> int:
    """Bytes that the score matrices of ``rows`` query rows take (input dtype + float32 softmax + probs)."""
    b, hq, sq, _ = q.shape
    rows = sq if rows is None else rows
    return b * hq * rows * k.shape[2] * (2 * q.element_size() + 4)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    upcast: bool = True,
    chunk_bytes: int | None = 1 << 30,
    window: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Standard attention; ``chunk_bytes=None`` materialises all ``Sq x Skv`` scores at once."""
    scale = validate_attention_inputs(q, k, v, scale)
    out_dtype = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    sq, skv = q.shape[2], k.shape[2]
    softmax_dtype = torch.float64 if upcast else torch.float32
    rows = sq if chunk_bytes is None else max(1, min(sq, chunk_bytes // max(1, score_bytes(q, k, 1))))
    masked = causal or tuple(window) != NO_WINDOW
    seen = visible(sq, skv, causal=causal, window=tuple(window), device=q.device) if masked else None
    out = torch.empty((*q.shape[:3], v.shape[-1]), dtype=out_dtype, device=q.device)
    for start in range(0, sq, rows):
        stop = min(sq, start + rows)
        scores = torch.matmul(q[:, :, start:stop], k.transpose(-1, -2)) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if seen is not None:
            scores = scores.masked_fill(~seen[start:stop], float("-inf"))
        probs = torch.softmax(scores.to(softmax_dtype), dim=-1)
        if seen is not None:
            # Rows that see no key: softmax of all -inf is NaN; the contract says zeros.
            probs = probs.masked_fill(~seen[start:stop].any(dim=-1, keepdim=True), 0.0)
        out[:, :, start:stop] = torch.matmul(probs.to(v.dtype), v).to(out_dtype)
    return out


def serving_attention_ref(inputs, *, scale: float | None = None, upcast: bool = True,
                          indices: list[int] | None = None, window: tuple[int, int] = NO_WINDOW,
                          softcap: float = 0.0) -> dict[int, torch.Tensor]:
    """The dense reference per sequence of a paged-decode, MLA-decode, varlen or mixed batch (``impls.contract``;
    MLA as one kv head of latent and rotary keys, ``mla_sequence``): sequence ``b`` -> its output
    ``(1, Hq, Sq, D)``. ``indices`` picks sequences (all by default); a window and softcap apply within each
    sequence, bottom-right like its causal mask."""
    scale = inputs.scale(scale)

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        if 0 in (q.shape[2], k.shape[2]):  # a varlen sequence with no rows, or rows that see no key: zeros
            return q.new_zeros((*q.shape[:3], v.shape[-1]))
        # k and v of an fp8 cache come dequantized as float64 for the oracle: q joins them, the output is q's dtype
        return attention_ref(q.to(k.dtype), k, v, causal=causal, scale=scale, upcast=upcast, window=window,
                             softcap=softcap).to(q.dtype)

    # An fp8 cache is dequantized exactly in float64 for the oracle, and into q's dtype for the naive yardstick
    kv_dtype = torch.float64 if upcast else None
    return {b: reference(q, k, v, causal) for b, q, k, v, causal in sequences(inputs, indices, kv_dtype)}


def attention_lse(q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, scale: float | None = None,
                  window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0) -> torch.Tensor:
    """The forward's log-sum-exp ``(B, Hq, Sq)`` float32: natural log over each row's scaled (softcapped) scores,
    the scores in q's dtype as ``attention_ref(upcast=False)`` makes them (a kernel's lse matches its own scores:
    an exact one leaves its probabilities' rows summing off 1); ``+inf`` where a row sees no key. The sum is in
    float64, rounded once: float32 ``logsumexp`` on CPU came out 5e-5 apart between two processes on the same
    inputs."""
    scale = validate_attention_inputs(q, k, k, scale)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).double() * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if causal or tuple(window) != NO_WINDOW:
        scores = scores.masked_fill(~visible(q.shape[2], k.shape[2], causal=causal, window=tuple(window),
                                             device=q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return lse.masked_fill(lse == float("-inf"), float("inf")).float()


def attention_grads_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *,
                        causal: bool = False, scale: float | None = None, upcast: bool = True,
                        window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``attention_ref`` under the upstream gradient ``do``, by autograd: every operation in
    float64 (``upcast``, the oracle) or as standard attention in the input dtype (the naive yardstick). Each
    gradient comes back in its input's dtype; with GQA, dk and dv sum over each group's query heads."""
    dtype = torch.float64 if upcast else q.dtype
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out = attention_ref(*leaves, causal=causal, scale=scale, upcast=False, window=window, softcap=softcap)
        grads = torch.autograd.grad(out, leaves, do.to(dtype))
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))
