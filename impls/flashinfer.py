"""FlashInfer (``flashinfer-python``), called the way its authors recommend for serving: plan once, run many.

- ``paged``: one new token per sequence through ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores on, the
  setting FlashInfer recommends for grouped-query heads); several (speculative decoding) through
  ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``. The block table becomes FlashInfer's CSR page
  list (``indptr``, ``indices``, ``last_page_len``) in prepare, as a server keeps it.
- ``varlen`` and dense: ``BatchPrefillWithRaggedKVCacheWrapper`` (dense is the equal-length batch).
- ``mixed``: ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True`` over the step's packed new tokens
  (``qo_indptr`` is ``cu_seqlens_q``), decoding sequences and prefill chunks in one plan and one run.
- ``mla``: ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` over the same page list, the batch's new tokens packed
  (``qo_indptr``), causal where a sequence has several.
- Every operation takes the window (left side, ``window_left``; FlashInfer has no right bound) and softcap
  (``logits_soft_cap``) where the call asks for them; paged decode takes an fp8 cache (``kv_data_type`` at
  planning, ``k_scale`` / ``v_scale`` at each run, as vLLM calls it). MLA takes no window or softcap; an fp8
  latent cache (``kv_data_type`` at planning, its one scale as ``ckv_scale`` and ``kpe_scale`` at each run) where
  FlashInfer has it: its FA3 backend on Hopper, bf16 queries, 512 + 64; elsewhere FlashInfer refuses, with its
  reason.

Planning (which also JIT-compiles the kernels on first use) happens in prepare; the timed call is ``run``.
FlashInfer aligns a causal mask bottom-right when a sequence has more keys than queries, as the contract does.
"""

from __future__ import annotations

import functools
import math

import torch

from impls._registry import HALF, Prepared, Unsupported, module_available, probe, refusing, register
from impls.contract import NO_WINDOW

LAYOUT = "NHD"  # (tokens, heads, head dim) within a page or a packed batch: the contract's paged layout
WORKSPACE_BYTES = 128 << 20  # FlashInfer's examples' float workspace (split-KV partial results)
# Errors through which FlashInfer says "not this input" (head dim, page size, dtype) or its JIT compile fails:
# at planning (``refusing``) as at the first call (``probe``), a refusal with the reason.
REFUSALS = (RuntimeError, ValueError, NotImplementedError, TypeError, AssertionError)

requires = module_available("flashinfer", "pip install flashinfer-python")
# FlashInfer's prefill kernels validate no head dim, and one that is not a multiple of 64 reads out of bounds
# (flashinfer-ai/flashinfer#4299). On an H200, 0.7.2.post1 at D=96 (Phi-3) JIT-compiled, then raised an illegal
# memory access that took the process's CUDA context with it: declared, so refused with the reason.
HEAD_DIMS = (64, 128, 256)


@functools.cache
def _workspace(device: torch.device) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def page_table_csr(block_table: torch.Tensor, seqlens: tuple[int, ...], page_size: int) -> tuple[torch.Tensor, ...]:
    """The block table as FlashInfer's page list: ``indptr (B+1,)``, ``indices`` (the used pages of every
    sequence, in order) and ``last_page_len (B,)`` (valid slots of each sequence's last page, 1..page_size)."""
    pages = [max(math.ceil(n / page_size), 1) for n in seqlens]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.cat([block_table[b, :p] for b, p in enumerate(pages)]).to(torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(seqlens, pages, strict=True)], dtype=torch.int32)
    device = block_table.device
    return indptr.to(device), indices.contiguous(), last.to(device)


def check_window(window: tuple[int, int], causal: bool) -> None:
    if window != NO_WINDOW and not causal and window[1] >= 0:
        raise Unsupported("a window with a right bound: FlashInfer's window has a left side only")


def _ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, *,
            causal: bool, scale: float, window_left: int = -1, softcap: float = 0.0):
    """A planned ragged prefill over packed (tokens, heads, D) tensors; returns the timed call."""
    import flashinfer

    with refusing(*REFUSALS):
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspace(q.device), LAYOUT)
        wrapper.plan(cu_q, cu_k, q.shape[1], k.shape[1], q.shape[2], causal=causal, sm_scale=scale,
                     window_left=window_left, logits_soft_cap=softcap or None, q_data_type=q.dtype,
                     kv_data_type=k.dtype)
    return lambda: wrapper.run(q, k, v)


@register("flashinfer", family="flashinfer", dtypes=HALF, devices=("cuda",), head_dims=HEAD_DIMS, requires=requires,
          variants=("window", "softcap"),
          description="flashinfer.BatchPrefillWithRaggedKVCacheWrapper over the equal-length batch")
def prepare_dense(q, k, v, *, causal: bool, scale: float, window: tuple[int, int] = NO_WINDOW,
                  softcap: float = 0.0) -> Prepared:
    check_window(window, causal)
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    packed = [t.transpose(1, 2).reshape(-1, t.shape[1], head_dim) for t in (q, k, v)]  # (B*S, H, D)
    cu_q, cu_k = (torch.arange(batch + 1, dtype=torch.int32, device=q.device) * n for n in (q_len, kv_len))
    run = _ragged(*packed, cu_q, cu_k, causal=causal, scale=scale, window_left=window[0], softcap=softcap)

    def call() -> torch.Tensor:
        return run().view(batch, q_len, heads, head_dim).transpose(1, 2)

    return Prepared(probe(call, *REFUSALS), config={"layout": LAYOUT})


@register("flashinfer", op="varlen", family="flashinfer", dtypes=HALF, devices=("cuda",), head_dims=HEAD_DIMS,
          requires=requires, variants=("window", "softcap"),
          description="flashinfer.BatchPrefillWithRaggedKVCacheWrapper")
def prepare_varlen(inputs, *, scale: float, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0) -> Prepared:
    check_window(window, inputs.causal)
    run = _ragged(inputs.q, inputs.k, inputs.v, inputs.cu_seqlens_q, inputs.cu_seqlens_k, causal=inputs.causal,
                  scale=scale, window_left=window[0], softcap=softcap)
    return Prepared(probe(run, *REFUSALS), config={"layout": LAYOUT})


@register("flashinfer", op="paged", family="flashinfer", dtypes=HALF, devices=("cuda",), head_dims=HEAD_DIMS,
          requires=requires, variants=("window", "softcap", "kv_fp8"),
          description="flashinfer.BatchDecodeWithPagedKVCacheWrapper (tensor cores) for one new token, "
                      "BatchPrefillWithPagedKVCacheWrapper (causal) for several")
def prepare_paged(inputs, *, scale: float, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0) -> Prepared:
    import flashinfer

    batch, new, heads, head_dim = inputs.q.shape
    kv_heads = inputs.k_cache.shape[2]
    indptr, indices, last = page_table_csr(inputs.block_table, inputs.seqlens, inputs.page_size)
    dtypes = {"q_data_type": inputs.q.dtype, "kv_data_type": inputs.k_cache.dtype}
    options = {"sm_scale": scale, "window_left": window[0], "logits_soft_cap": softcap or None, **dtypes}
    cache = (inputs.k_cache, inputs.v_cache)
    scales = {"k_scale": inputs.k_scale, "v_scale": inputs.v_scale} if inputs.kv_fp8 else {}
    workspace = _workspace(inputs.q.device)
    with refusing(*REFUSALS):
        if new == 1:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, LAYOUT, use_tensor_cores=True)
            wrapper.plan(indptr, indices, last, heads, kv_heads, head_dim, inputs.page_size, **options)
            q = inputs.q.view(batch, heads, head_dim)
            config = {"wrapper": "BatchDecodeWithPagedKVCacheWrapper", "use_tensor_cores": True}
        else:
            qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=inputs.q.device) * new
            wrapper = _paged_prefill(inputs, qo_indptr, (indptr, indices, last), options)
            q = inputs.q.reshape(batch * new, heads, head_dim)
            config = {"wrapper": "BatchPrefillWithPagedKVCacheWrapper", "causal": True}

    def call() -> torch.Tensor:
        return wrapper.run(q, cache, **scales).view(batch, new, heads, head_dim)

    return Prepared(probe(call, *REFUSALS), config={"layout": LAYOUT, **config})


def _paged_prefill(inputs, qo_indptr: torch.Tensor, pages: tuple[torch.Tensor, ...], options: dict):
    """A planned ``BatchPrefillWithPagedKVCacheWrapper``, causal (bottom-right), for the packed new tokens
    ``qo_indptr`` over the page list ``pages`` (``page_table_csr``); ``options``: scale, variants and dtypes."""
    import flashinfer

    heads, head_dim = inputs.q.shape[-2:]
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(inputs.q.device), LAYOUT)
    wrapper.plan(qo_indptr, *pages, heads, inputs.k_cache.shape[2], head_dim, inputs.page_size, causal=True,
                 **options)
    return wrapper


@register("flashinfer", op="mixed", family="flashinfer", dtypes=HALF, devices=("cuda",), head_dims=HEAD_DIMS,
          requires=requires, description="flashinfer.BatchPrefillWithPagedKVCacheWrapper (causal) over the packed "
                                         "new tokens of every sequence, decoding or prefilling")
def prepare_mixed(inputs, *, scale: float) -> Prepared:
    pages = page_table_csr(inputs.block_table, inputs.seqlens, inputs.page_size)
    options = {"sm_scale": scale, "q_data_type": inputs.q.dtype, "kv_data_type": inputs.k_cache.dtype}
    with refusing(*REFUSALS):
        wrapper = _paged_prefill(inputs, inputs.cu_seqlens_q, pages, options)
    cache = (inputs.k_cache, inputs.v_cache)

    def call() -> torch.Tensor:
        return wrapper.run(inputs.q, cache)

    return Prepared(probe(call, *REFUSALS), config={"layout": LAYOUT, "wrapper": "BatchPrefillWithPagedKVCacheWrapper",
                                                    "causal": True})


# FlashInfer's MLA kernels are instantiated for DeepSeek's widths only (a latent of 512, a rotary part of 64).
MLA_WIDTHS = (512, 64)


@register("flashinfer", op="mla", family="flashinfer", dtypes=HALF, devices=("cuda",), requires=requires,
          variants=("kv_fp8",),
          description="flashinfer.mla.BatchMLAPagedAttentionWrapper (causal where a step has several new tokens; "
                      "an fp8 latent cache with its scale)")
def prepare_mla(inputs, *, scale: float) -> Prepared:
    import flashinfer

    batch, new, heads, latent = inputs.q_nope.shape
    if (latent, inputs.rope_dim) != MLA_WIDTHS:
        raise Unsupported(f"a latent of {latent} and a rotary part of {inputs.rope_dim}: FlashInfer's MLA kernels "
                          f"take {MLA_WIDTHS[0]} and {MLA_WIDTHS[1]} only")
    indptr, indices, _ = page_table_csr(inputs.block_table, inputs.seqlens, inputs.page_size)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=inputs.q.device) * new
    q_nope, q_pe = (t.reshape(batch * new, heads, t.shape[-1]) for t in (inputs.q_nope, inputs.q_pe))
    out = torch.empty_like(q_nope)
    with refusing(*REFUSALS):
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(_workspace(inputs.q.device))
        wrapper.plan(qo_indptr, indptr, indices, inputs.cache_seqlens, heads, latent, inputs.rope_dim,
                     inputs.page_size, new > 1, scale, inputs.q.dtype, inputs.ckv.dtype)

    # One scale for both caches (the contract's); the keywords exist only from the FlashInfer that reads fp8 MLA
    # caches, and an older one refuses them (TypeError), with its reason.
    scales = {"ckv_scale": inputs.kv_scale, "kpe_scale": inputs.kv_scale} if inputs.kv_fp8 else {}

    def call() -> torch.Tensor:
        return wrapper.run(q_nope, q_pe, inputs.ckv, inputs.kpe, out=out, **scales).view(batch, new, heads, latent)

    return Prepared(probe(call, *REFUSALS), config={"wrapper": "BatchMLAPagedAttentionWrapper", "causal": new > 1})
