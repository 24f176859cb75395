"""PyTorch ``scaled_dot_product_attention``: one entry per backend, plus PyTorch's own choice."""

from __future__ import annotations

import itertools
import logging
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from impls._registry import Unsupported, probe, register
from impls.contract import NO_WINDOW, gather_sequence

BACKENDS: dict[str, tuple[SDPBackend | None, tuple[str, ...]]] = {
    "sdpa": (None, ("cpu", "cuda")),
    "sdpa-math": (SDPBackend.MATH, ("cpu", "cuda")),
    "sdpa-flash": (SDPBackend.FLASH_ATTENTION, ("cpu", "cuda")),
    "sdpa-efficient": (SDPBackend.EFFICIENT_ATTENTION, ("cuda",)),
    "sdpa-cudnn": (SDPBackend.CUDNN_ATTENTION, ("cuda",)),
}


def _sdpa_kwargs(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> dict:
    return _shaped_kwargs(q.shape[1] != k.shape[1], q.shape[2], k.shape[2], causal, scale)


def _shaped_kwargs(gqa: bool, sq: int, skv: int, causal: bool, scale: float) -> dict:
    """SDPA's keywords for ``sq`` queries over ``skv`` keys."""
    kwargs: dict = {"scale": scale, "enable_gqa": gqa}
    if causal and sq == skv:
        kwargs["is_causal"] = True
    elif causal:  # the contract's bottom-right alignment; SDPA's is_causal is top-left
        # imported here: its module imports torch._dynamo, 1.2 s of every process's start where no case needs it
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(sq, skv)
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


def probe_with_reasons(call):
    """``probe``, keeping PyTorch's explanation: it explains a refusal in warnings (and, for nested tensors, in
    log lines) and raises a generic error."""
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("torch.nested._internal.sdpa")
    logger.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return probe(call, RuntimeError, NotImplementedError)
        except Unsupported as exc:
            reasons = refusal_reason([str(w.message) for w in caught] + logged)
            raise Unsupported(reasons or str(exc)) from exc
        finally:
            logger.removeHandler(handler)


def _leaves_unseen_rows_undefined(backend: SDPBackend | None, q: torch.Tensor) -> bool:
    """Where a bottom-right causal mask hides every key from some rows, these backends return garbage for them:
    cuDNN at 16 bits, and at float32 on CUDA the memory-efficient kernel, which PyTorch's own choice then takes."""
    if backend is SDPBackend.CUDNN_ATTENTION:
        return True
    return q.is_cuda and q.dtype == torch.float32 and backend in (None, SDPBackend.EFFICIENT_ATTENTION)


def _make(name: str, backend: SDPBackend | None, devices: tuple[str, ...]) -> None:
    what = "PyTorch's own backend choice" if backend is None else f"backend {backend.name}"

    @register(name, family="sdpa", devices=devices, variants=("value_dim",), description=f"torch SDPA, {what}")
    def prepare(q, k, v, *, causal: bool, scale: float):
        if causal and q.shape[2] > k.shape[2] and _leaves_unseen_rows_undefined(backend, q):
            # It runs, but the rows that see no key come out as garbage, not zeros (max error ~1-3 on an H200,
            # torch 2.11): a limitation of the backend, so a refusal with the reason rather than a failure.
            raise Unsupported(f"causal with more queries than keys: {what} leaves the rows that see no key "
                              "undefined")
        kwargs = _sdpa_kwargs(q, k, causal, scale)
        if backend is None:
            def call():
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            def call():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, **kwargs)

        return probe_with_reasons(call)


for _name, (_backend, _devices) in BACKENDS.items():
    _make(_name, _backend, _devices)


# Serving with SDPA: what every PyTorch user has without a serving kernel.

@register("sdpa", op="paged", family="sdpa", variants=("window", "kv_fp8"),
          description="pages gathered into a padded contiguous cache inside the timed call (an fp8 cache "
                      "dequantized there too), then torch SDPA with a length and causal mask (and a window's)")
def sdpa_paged(inputs, *, scale: float, window: tuple[int, int] = NO_WINDOW):
    hq = inputs.q.shape[2]
    slots, valid, mask = padded_slots(inputs, window)
    keep = valid[:, :, None, None]
    flat_k, flat_v = inputs.k_cache.flatten(0, 1), inputs.v_cache.flatten(0, 1)
    q = inputs.q.transpose(1, 2)

    def call() -> torch.Tensor:
        # Unused slots may hold anything, NaN included: zero them, or 0 * NaN reaches the output.
        k, v = (torch.where(keep, gathered, 0).transpose(1, 2)
                for gathered in inputs.dequantized(flat_k[slots], flat_v[slots], q.dtype))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != k.shape[1])
        return o.transpose(1, 2)

    return probe(call, RuntimeError)


def padded_slots(inputs, window: tuple[int, int] = NO_WINDOW) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Metadata a server builds once per step for a paged batch padded to its longest sequence: the flat cache slot
    of position t of sequence b ``(B, Lmax)`` (0 past its length), whether it is one of its positions, and the
    attention mask ``(B, 1, Sq, Lmax)``: causal bottom-right, within the length and the window."""
    batch, sq = inputs.q.shape[:2]
    page, device = inputs.page_size, inputs.q.device
    positions = torch.arange(inputs.max_seqlen, device=device)
    table = inputs.block_table.long()
    slots = table.gather(1, (positions // page).expand(batch, -1).clamp(max=table.shape[1] - 1)) * page
    slots = slots + positions % page
    lengths = inputs.cache_seqlens.long()[:, None]
    valid = positions[None, :] < lengths  # (B, Lmax)
    slots = torch.where(valid, slots, 0)
    new_pos = lengths - sq + torch.arange(sq, device=device)[None, :]  # (B, Sq): position of each new token
    visible = (positions[None, None, :] <= new_pos[:, :, None]) & valid[:, None, :]  # (B, Sq, Lmax)
    if window[0] >= 0:
        visible &= positions[None, None, :] >= new_pos[:, :, None] - window[0]
    return slots, valid, visible[:, None]


@register("sdpa", op="mla", family="sdpa", variants=("kv_fp8",),
          description="each sequence's latent and rotary rows gathered into a padded cache inside the timed call "
                      "(an fp8 cache dequantized there too), then torch SDPA with one kv head shared by every query "
                      "head (scores latent + rotary wide, values the latent rows) and a length and causal mask")
def sdpa_mla(inputs, *, scale: float):
    slots, valid, mask = padded_slots(inputs)
    keep = valid[:, :, None]
    flat_ckv, flat_kpe = inputs.ckv.flatten(0, 1), inputs.kpe.flatten(0, 1)

    def call() -> torch.Tensor:
        # Unused slots may hold anything, NaN included: zero them, or 0 * NaN reaches the output.
        ckv, kpe = (torch.where(keep, inputs.dequantized(flat[slots], inputs.q.dtype), 0)
                    for flat in (flat_ckv, flat_kpe))  # (B, Lmax, width)
        q = torch.cat([inputs.q_nope, inputs.q_pe], dim=-1).transpose(1, 2)  # (B, H, Sq, latent + rope)
        k = torch.cat([ckv, kpe], dim=-1)[:, None]
        o = F.scaled_dot_product_attention(q, k, ckv[:, None], attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(1, 2)

    return probe(call, RuntimeError)


@register("sdpa", op="mixed", family="sdpa",
          description="per sequence: its pages gathered inside the timed call, then torch SDPA (GQA, a bottom-right "
                      "causal mask where the sequence has more than one new token)")
def sdpa_mixed(inputs, *, scale: float):
    out = inputs.output_like()
    rows = list(itertools.pairwise(inputs.offsets_q))
    queries = [inputs.q[start:stop].transpose(0, 1)[None] for start, stop in rows]  # (1, Hq, q_len, D) views
    gqa = inputs.q.shape[1] != inputs.k_cache.shape[2]
    kwargs = [_shaped_kwargs(gqa, new, length, new > 1, scale)  # one new token sees its whole cache: no mask
              for new, length in zip(inputs.seqlens_q(), inputs.seqlens, strict=True)]

    def call() -> torch.Tensor:
        for b, (q, (start, stop)) in enumerate(zip(queries, rows, strict=True)):
            k, v = gather_sequence(inputs, b)
            o = F.scaled_dot_product_attention(q, k[None], v[None], **kwargs[b])
            out[start:stop] = o[0].transpose(0, 1)
        return out

    return probe_with_reasons(call)


@register("sdpa", op="varlen", family="sdpa",
          description="torch SDPA on nested jagged tensors built from the packed batch (no padding); nested SDPA "
                      "has no GQA, so K/V heads are repeated inside the timed call")
def sdpa_varlen(inputs, *, scale: float):
    offsets_q, offsets_k = inputs.cu_seqlens_q.long(), inputs.cu_seqlens_k.long()
    if inputs.causal and inputs.offsets_q != inputs.offsets_k:
        raise Unsupported("nested-tensor SDPA aligns causal masks top-left: only Sq == Skv per sequence")
    hq, hkv = inputs.q.shape[1], inputs.k.shape[1]

    def nested(t: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(t, offsets, max_seqlen=max_len).transpose(1, 2)

    def call() -> torch.Tensor:
        q = nested(inputs.q, offsets_q, inputs.max_seqlen_q)
        k, v = (nested(t.repeat_interleave(hq // hkv, dim=1) if hq != hkv else t, offsets_k, inputs.max_seqlen_k)
                for t in (inputs.k, inputs.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=inputs.causal, scale=scale)
        return o.transpose(1, 2).values()

    return probe_with_reasons(call)
