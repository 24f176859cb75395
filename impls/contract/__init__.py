"""The contract every implementation is held to: its inputs, their validation and the rules of their shapes.

Dense forward takes ``q (B, Hq, Sq, D)``, ``k, v (B, Hkv, Skv, D)`` (``validate_attention_inputs``); a sliding
window ``(left, right)`` (-1: unbounded) and softcap are its model variants (``validate_variants``). Beside dense
forward there are the serving operations, each one dataclass that carries its tensors and validates them once,
at prepare time, with an error that names the problem. Host copies of the lengths are taken then too, so that no
adapter needs a device sync in its timed call.

Paged decode (the layout of vLLM, FlashInfer and flash-attn):
- ``q (B, Sq_new, Hq, D)``: the new tokens, which are the last ``Sq_new`` positions of each sequence;
- ``k_cache, v_cache (num_pages, page_size, Hkv, D)``;
- ``block_table (B, max_pages) int32``: page ``block_table[b, i]`` holds positions ``i*page_size ...`` of
  sequence ``b``; entries past a sequence's last page are never read and may hold anything;
- ``cache_seqlens (B,) int32``: each sequence's length, the new tokens included.
Attention is causal within each sequence, bottom-right: new token ``i`` sees positions ``<= L - Sq_new + i``.
Output ``(B, Sq_new, Hq, D)``. Page slots past a sequence's length may hold anything, NaN included.

An fp8 KV cache (vLLM's ``kv_cache_dtype="fp8"``, FlashInfer's ``kv_data_type``): the caches may be
``float8_e4m3fn`` under fp16/bf16 queries, each with a per-tensor scale (``k_scale``, ``v_scale``, host floats):
the key at a slot is ``k_scale * k_cache[slot]`` (dequantized), and so for values. The output stays q's dtype.
Implementations declare it (``variants=("kv_fp8",)``); the others refuse such a batch with the reason.

MLA decode (DeepSeek-V3/R1's and Kimi-K2's multi-head latent attention in the absorbed form, FlashInfer's layout):
- ``q_nope (B, Sq_new, H, latent)`` and ``q_pe (B, Sq_new, H, rope)``: each query head's latent and rotary parts;
- ``ckv (num_pages, page_size, latent)`` and ``kpe (num_pages, page_size, rope)``: one latent row and one rotary
  row per token, shared by all H heads (DeepSeek-V3: 512 + 64);
- ``block_table`` and ``cache_seqlens`` as paged decode's, causal bottom-right alike.
The scores are ``q_nope . ckv + q_pe . kpe`` (default scale ``1 / sqrt(latent + rope)``), the values the latent
rows: output ``(B, Sq_new, H, latent)``. Slots past a sequence's length may hold anything, NaN included.
An fp8 latent cache (FlashMLA's and FlashInfer's): ``ckv`` and ``kpe`` both ``float8_e4m3fn`` under fp16/bf16
queries, with one per-tensor scale ``kv_scale`` for both (a row is ``kv_scale * ckv[slot]``, key and value alike,
as vLLM keeps one scale for the latent cache); declared and refused as paged decode's (``"kv_fp8"``).

Varlen prefill (flash-attn's packed layout):
- ``q (total_q, Hq, D)``, ``k, v (total_k, Hkv, D)``;
- ``cu_seqlens_q, cu_seqlens_k (B+1,) int32``: sequence ``b`` is rows ``cu[b]:cu[b+1]``;
- ``causal`` per sequence, bottom-right like dense. Output ``(total_q, Hq, D)``.

Mixed prefill and decode (vLLM V1's unified attention, FlashInfer's paged prefill, flash-attn's varlen call with a
page table): one step of a server that runs decoding sequences and prefill chunks together.
- ``q (total_q, Hq, D)``: every sequence's new tokens, packed; ``cu_seqlens_q (B+1,) int32``: sequence ``b``'s are
  rows ``cu[b]:cu[b+1]``, at least one (a decode step has one, a prefill chunk up to thousands);
- ``k_cache, v_cache``, ``block_table`` and ``cache_seqlens`` as paged decode's: each sequence's cache holds its
  new tokens as its last ``q_len`` positions.
Causal within each sequence, bottom-right: new token ``i`` of ``q_len`` sees positions ``<= L - q_len + i``.
Output ``(total_q, Hq, D)``. Page slots past a sequence's length may hold anything, NaN included.

The backward pass of dense attention (``Backward``): the forward's inputs, output, log-sum-exp and the upstream
gradient in; ``(dq, dk, dv)`` out. A training step's forward and backward (``ForwardBackward``): the forward's
inputs and the upstream gradient in, the same gradients out. Either may hold documents packed as varlen's rows
with one ``cu_seqlens`` for q and k (each document attends to itself), implementations that declare ``"packed"``.
"""

from impls.contract.backward import Backward, ForwardBackward
from impls.contract.dense import (
    DENSE_DECODE_MAX_NEW,
    NO_WINDOW,
    UNBOUNDED,
    binding_window,
    decode_shaped,
    default_scale,
    unit_head_stride,
    validate_attention_inputs,
    validate_scale,
    validate_variants,
    window_bounds,
)
from impls.contract.serving import (
    FP8_KV,
    FP8_QUERIES,
    MLA_LAYOUTS,
    MixedBatch,
    MLADecode,
    PagedKV,
    Varlen,
    decode_read_length,
    gather_rows,
    gather_sequence,
    mla_sequence,
    scatter_sequence,
    sequences,
)

__all__ = [
    "DENSE_DECODE_MAX_NEW", "FP8_KV", "FP8_QUERIES", "MLA_LAYOUTS", "NO_WINDOW", "UNBOUNDED", "Backward",
    "ForwardBackward", "MLADecode", "MixedBatch", "PagedKV", "Varlen", "binding_window", "decode_read_length",
    "decode_shaped", "default_scale", "gather_rows", "gather_sequence", "mla_sequence", "scatter_sequence",
    "sequences", "unit_head_stride", "validate_attention_inputs", "validate_scale", "validate_variants",
    "window_bounds",
]
