"""The flash-attn package, whichever generation is importable (each is its own entry).

- ``flash-attn2``: ``flash_attn.flash_attn_func`` (FlashAttention-2, sm_80+)
- ``flash-attn3``: ``flash_attn_interface.flash_attn_func`` (FlashAttention-3, Hopper)
- ``flash-attn4``: ``flash_attn.cute.flash_attn_func`` (FlashAttention-4, CuTe DSL, sm_90/sm_100)

All take ``(B, S, H, D)`` tensors, do GQA natively (Hq a multiple of Hkv) and align causal masks
bottom-right, which is the contract's convention; the adapter only changes the layout (in prepare, outside
the timed call) and maps ``scale`` to ``softmax_scale``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from impls._registry import HALF, Prepared, Unsupported, probe, register

# entry name -> (module, attribute, what to install)
GENERATIONS: dict[str, tuple[str, str, str]] = {
    "flash-attn2": ("flash_attn", "flash_attn_func", "pip install flash-attn"),
    "flash-attn3": ("flash_attn_interface", "flash_attn_func", "build hopper/ of flash-attention"),
    "flash-attn4": ("flash_attn.cute", "flash_attn_func", "pip install flash-attn-4"),
}
# Errors through which flash-attn says "not this input" (head dim, dtype, architecture).
REFUSALS = (RuntimeError, ValueError, AssertionError, NotImplementedError, TypeError)


def load_function(module: str, attribute: str) -> Callable:
    return getattr(importlib.import_module(module), attribute)


def _requires(module: str, attribute: str, hint: str) -> Callable[[str], str | None]:
    def check(device: str) -> str | None:
        try:
            load_function(module, attribute)
        except (ImportError, AttributeError, OSError) as exc:
            return f"{module}.{attribute} not importable ({hint}): {type(exc).__name__}: {exc}"[:300]
        return None

    return check


def variant_kwargs(name: str, window: tuple[int, int] | None = None, softcap: float = 0.0) -> dict:
    """The contract's window and softcap as each generation takes them: ``window_size`` with -1 (FA2/FA3) or
    None (FA4) for an unbounded side, bottom-right like causal; ``softcap`` as is. Only what is used is passed."""
    kwargs: dict = {}
    if window is not None:
        kwargs["window_size"] = tuple(None if w < 0 else w for w in window) if name == "flash-attn4" else window
    if softcap:
        kwargs["softcap"] = softcap
    return kwargs


def _first_output(result):
    """FA3 and FA4 return ``(out, lse)`` (FA3 only in some versions); FA2 returns ``out``."""
    return result[0] if isinstance(result, tuple | list) else result


def _make(name: str, module: str, attribute: str, hint: str) -> None:
    @register(name, family="flash-attn", dtypes=HALF, devices=("cuda",), variants=("window", "softcap", "value_dim"),
              requires=_requires(module, attribute, hint), description=f"{module}.{attribute}")
    def prepare(q, k, v, *, causal: bool, scale: float, **variants):
        func = load_function(module, attribute)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # (B, S, H, D)
        kwargs = {"softmax_scale": scale, "causal": causal, **variant_kwargs(name, **variants)}

        def call() -> torch.Tensor:
            return _first_output(func(qt, kt, vt, **kwargs)).transpose(1, 2)

        return probe(call, *REFUSALS)


for _name, (_module, _attribute, _hint) in GENERATIONS.items():
    _make(_name, _module, _attribute, _hint)


# Serving, the way each generation's authors call it: FA2/FA3 decode through ``flash_attn_with_kvcache`` with a
# block table; FA4 through ``flash_attn_varlen_func`` with ``page_table`` / ``seqused_k``, its split heuristic
# (num_splits=0) and GQA packing. Varlen prefill through ``flash_attn_varlen_func`` everywhere.
FA4_DECODE_SETTINGS = {"num_splits": 0, "pack_gqa": True}
# An fp8 KV cache is not declared: FA2 has no fp8, FA3 runs fp8 only with q in fp8 too (descaled per batch and
# head, another contract than an fp8 cache under bf16 queries), FA4 4.0 none on sm_90; the registry refuses it.


# A mixed step (every sequence's new tokens packed, over the paged cache) through each generation's paged varlen call:
# FA2's flash_attn_varlen_func takes a block_table (its keys' offsets the cache lengths', pages of a multiple of 256:
# it refuses smaller ones with that reason), FA3's flash_attn_with_kvcache takes cu_seqlens_q with a page_table, and
# FA4's flash_attn_varlen_func a page_table with seqused_k.
MIXED_CALLS = {"flash-attn2": "flash_attn_varlen_func", "flash-attn3": "flash_attn_with_kvcache",
               "flash-attn4": "flash_attn_varlen_func"}


def _mixed_cache_kwargs(name: str, inputs) -> dict:
    """How each generation's call of ``MIXED_CALLS`` finds a mixed batch's keys: lengths and the block table."""
    if name == "flash-attn2":
        lengths = torch.tensor(inputs.seqlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cu_k = torch.nn.functional.pad(lengths, (1, 0)).to(inputs.q.device)
        return {"cu_seqlens_k": cu_k, "max_seqlen_k": inputs.max_seqlen, "block_table": inputs.block_table}
    if name == "flash-attn3":
        return {"cache_seqlens": inputs.cache_seqlens, "page_table": inputs.block_table}
    return {"max_seqlen_k": inputs.max_seqlen, "seqused_k": inputs.cache_seqlens, "page_table": inputs.block_table,
            **FA4_DECODE_SETTINGS}


def _fa4_probed(call: Callable[[], torch.Tensor], kwargs: dict) -> Prepared:
    """FA4's first call with its split heuristic, or without splits where it refuses them (FA4 4.0 on sm_90: "SplitKV
    not supported on SM 9.0"; its best there); ``kwargs`` are the call's, changed in place."""
    try:
        return Prepared(probe(call, *REFUSALS), config=dict(FA4_DECODE_SETTINGS))
    except Unsupported as exc:
        kwargs["num_splits"] = 1
        return Prepared(probe(call, *REFUSALS), config={**FA4_DECODE_SETTINGS, "num_splits": 1, "why": str(exc)[:120]})


def _make_serving(name: str, module: str, hint: str) -> None:
    fa4 = name == "flash-attn4"

    @register(name, op="paged", family="flash-attn", dtypes=HALF, devices=("cuda",), variants=("window", "softcap"),
              requires=_requires(module, "flash_attn_varlen_func" if fa4 else "flash_attn_with_kvcache", hint),
              description=f"{module}." + ("flash_attn_varlen_func with page_table, seqused_k, split heuristic "
                                          "and pack_gqa" if fa4 else "flash_attn_with_kvcache with the page table"))
    def prepare_paged(inputs, *, scale: float, **variants):
        common = {"softmax_scale": scale, "causal": True, **variant_kwargs(name, **variants)}
        if fa4:
            func = load_function(module, "flash_attn_varlen_func")
            kwargs = {**common, "seqused_k": inputs.cache_seqlens, "page_table": inputs.block_table,
                      **FA4_DECODE_SETTINGS}
        else:
            func = load_function(module, "flash_attn_with_kvcache")
            table = "page_table" if name == "flash-attn3" else "block_table"  # FA3's interface renamed it
            kwargs = {**common, "cache_seqlens": inputs.cache_seqlens, table: inputs.block_table}

        def call() -> torch.Tensor:
            return _first_output(func(inputs.q, inputs.k_cache, inputs.v_cache, **kwargs))

        return _fa4_probed(call, kwargs) if fa4 else probe(call, *REFUSALS)

    @register(name, op="mixed", family="flash-attn", dtypes=HALF, devices=("cuda",),
              requires=_requires(module, MIXED_CALLS[name], hint),
              description=f"{module}.{MIXED_CALLS[name]} with cu_seqlens_q and the block table, causal")
    def prepare_mixed(inputs, *, scale: float):
        func = load_function(module, MIXED_CALLS[name])
        kwargs = {"cu_seqlens_q": inputs.cu_seqlens_q, "max_seqlen_q": inputs.max_seqlen_q, "softmax_scale": scale,
                  "causal": True, **_mixed_cache_kwargs(name, inputs)}

        def call() -> torch.Tensor:
            return _first_output(func(inputs.q, inputs.k_cache, inputs.v_cache, **kwargs))

        return _fa4_probed(call, kwargs) if fa4 else probe(call, *REFUSALS)

    @register(name, op="varlen", family="flash-attn", dtypes=HALF, devices=("cuda",), variants=("window", "softcap"),
              requires=_requires(module, "flash_attn_varlen_func", hint),
              description=f"{module}.flash_attn_varlen_func")
    def prepare_varlen(inputs, *, scale: float, **variants):
        func = load_function(module, "flash_attn_varlen_func")
        kwargs = {"cu_seqlens_q": inputs.cu_seqlens_q, "cu_seqlens_k": inputs.cu_seqlens_k,
                  "max_seqlen_q": inputs.max_seqlen_q, "max_seqlen_k": inputs.max_seqlen_k,
                  "softmax_scale": scale, "causal": inputs.causal, **variant_kwargs(name, **variants)}

        def call() -> torch.Tensor:
            return _first_output(func(inputs.q, inputs.k, inputs.v, **kwargs))

        return probe(call, *REFUSALS)


for _name, (_module, _attribute, _hint) in GENERATIONS.items():
    _make_serving(_name, _module, _hint)


# MLA decode in its absorbed form. FA3's flash_attn_with_kvcache reads it as its authors benchmark it
# (hopper/benchmark_mla_decode.py): the rotary part as q / k (head dim 64), the latent as qv / v (value head dim
# 512) over one kv head, so scores are q_pe . kpe + q_nope . ckv and the values the latent rows; it refuses a q/k head
# dim over 64 or a value head dim over 512 beside a qv. FA2 and FA4 take no qv, so MLA's scores would be one 576-wide
# head dim, past both generations' 256; their entries refuse with that reason. No fp8 cache: FA3 wants k, v and qv in
# q's dtype (its fp8 path is fp8 queries with per-head descales, not an fp8 cache under bf16 queries).
FA3_MLA_WIDTHS = (512, 64)  # the widest latent and rotary part FA3's qv path takes
MLA_REFUSALS = {
    "flash-attn2": "flash-attn 2 supports head dims up to 256, one for q/k and v alike, and takes no qv",
    "flash-attn4": "flash-attn 4 (flash_attn.cute) supports head dims up to 256 and takes no qv",
}


def _mla_refusal(inputs) -> str | None:
    """Why FA3's qv path cannot take these widths, or None."""
    latent, rope = inputs.latent_dim, inputs.rope_dim
    if latent > FA3_MLA_WIDTHS[0] or rope > FA3_MLA_WIDTHS[1]:
        return (f"a latent of {latent} and a rotary part of {rope}: flash-attn 3 takes qv with a value head dim up to "
                f"{FA3_MLA_WIDTHS[0]} beside a q/k head dim up to {FA3_MLA_WIDTHS[1]}")
    return None


def _make_mla(name: str, module: str, hint: str) -> None:
    fa3 = name == "flash-attn3"
    attribute = "flash_attn_with_kvcache" if name != "flash-attn4" else "flash_attn_varlen_func"

    @register(name, op="mla", family="flash-attn", dtypes=HALF, devices=("cuda",),
              requires=_requires(module, attribute, hint),
              description=(f"{module}.flash_attn_with_kvcache: q_pe / kpe as q / k, q_nope / ckv as qv / v, "
                           "page_table, causal" if fa3 else f"refuses MLA: {MLA_REFUSALS.get(name)}"))
    def prepare_mla(inputs, *, scale: float) -> Callable[[], torch.Tensor]:
        if not fa3:
            raise Unsupported(f"{MLA_REFUSALS[name]}: MLA's scores are {inputs.head_dim} wide over "
                              f"{inputs.latent_dim}-wide values")
        reason = _mla_refusal(inputs)
        if reason:
            raise Unsupported(reason)
        func = load_function(module, attribute)
        # One kv head: the caches' (num_pages, page_size, width) as FA3's (num_pages, page_size, 1, width), views.
        k_cache, v_cache = inputs.kpe.unsqueeze(2), inputs.ckv.unsqueeze(2)
        kwargs = {"qv": inputs.q_nope, "page_table": inputs.block_table, "cache_seqlens": inputs.cache_seqlens,
                  "softmax_scale": scale, "causal": True}

        def call() -> torch.Tensor:
            return _first_output(func(inputs.q_pe, k_cache, v_cache, **kwargs))

        return probe(call, *REFUSALS)


for _name, (_module, _attribute, _hint) in GENERATIONS.items():
    _make_mla(_name, _module, _hint)
