"""PyTorch FlexAttention (``torch.nn.attention.flex_attention``): the mask as a ``mask_mod``, turned into a
block mask in the prepare step (outside the timed call), GQA through ``enable_gqa``.

On a GPU the call is ``torch.compile``-d, as its authors recommend (eager flex materialises the scores); on
CPU it runs eagerly: the mask logic and the contract are the same, and compiling a kernel for every small case
of the CPU preset would cost more than the preset itself.

- dense: causal and sliding window bottom-right (query ``i`` sees keys ``j <= i + Skv - Sq``), softcap as a
  ``score_mod``;
- varlen: the packed batch as one sequence with a document mask (a query sees the keys of its own sequence,
  causal within it), so no padding is computed;
- paged decode: PyTorch's own recipe (``torch.nn.attention.experimental._paged_attention``): the cache as one
  physical sequence of pages, a block mask whose key blocks are pages (block size = page size) listing each
  sequence's pages by the block table, and a ``mask_mod`` that maps a physical slot back to its position in the
  sequence. Built directly from the block table here: the recipe's (batch, pages) inverse table is 4 GB at 256
  sequences of 32K tokens. Flex computes whole key blocks and masks scores, so the unused slots of a partial last
  page reach ``P @ V`` as ``0 * value``, NaN where a slot holds NaN (the contract allows it): it runs only where
  every length is a whole number of pages, and only compiled on a GPU (eager flex scores every page of the cache).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import torch

from impls._registry import Prepared, Unsupported, module_available, register
from impls.contract import NO_WINDOW

requires = module_available("torch.nn.attention.flex_attention", "PyTorch 2.5 or newer")


# Dynamo keeps one compiled graph per input shape (and per mask closure) of a function and, past its recompile
# limit (8), quietly runs the function eagerly from then on: for flex, scores materialised, 4-12 TFLOPS where its
# kernel makes 400. A run compiles flex once per case, so the 9th to 18th cases of the `models` preset ran eagerly.
# The limits go up to one graph per case of any run, and reaching them raises instead.
RECOMPILES = {"recompile_limit": 4096, "accumulated_recompile_limit": 4096, "fail_on_recompile_limit_hit": True}


def compile_per_case(fn: Callable, **options: Any) -> Callable:
    """``torch.compile(fn, dynamic=False)`` that compiles for every new case instead of falling back to eager."""
    config = torch._dynamo.config
    for name, value in RECOMPILES.items():
        if hasattr(config, name):  # the names of PyTorch 2.7 and newer
            setattr(config, name, max(getattr(config, name), value))
    return torch.compile(fn, dynamic=False, **options)


@functools.cache
def flex_function(device_type: str) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return compile_per_case(flex_attention) if device_type == "cuda" else flex_attention


def _prepared(q, k, v, mask_mod, *, scale: float, score_mod=None) -> Prepared:
    from torch.nn.attention.flex_attention import create_block_mask

    q_len, kv_len = q.shape[-2], k.shape[-2]
    block_mask = None if mask_mod is None else create_block_mask(
        mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=q.device)
    return _flex_call(q, k, v, block_mask, scale=scale, score_mod=score_mod)


def _flex_call(q, k, v, block_mask, *, scale: float, score_mod=None, kernel_options: dict | None = None) -> Prepared:
    """The call of flex over these tensors, compiled by a first call (on a GPU: outside any timed region)."""
    flex = flex_function(q.device.type)
    gqa = q.shape[1] != k.shape[1]

    def call() -> torch.Tensor:
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                    kernel_options=kernel_options)

    try:
        call()
    except (RuntimeError, NotImplementedError, torch._dynamo.exc.BackendCompilerFailed) as exc:
        raise Unsupported(compile_error(exc)) from exc
    return Prepared(call, config={"compiled": q.is_cuda, "block_size": getattr(block_mask, "BLOCK_SIZE", None),
                                  "full_blocks": getattr(block_mask, "full_kv_num_blocks", None) is not None,
                                  **({"kernel_options": kernel_options} if kernel_options else {})})


# lines torch adds to every compile error, which name no cause
_BOILERPLATE = ("Set TORCHDYNAMO_VERBOSE", "For even more developer context", "You can suppress this exception")
# a raise's last line: "module.SomeError: ..." or, as Triton's compiler prints it, "SomeError('...')"
_RAISED = re.compile(r"^[\w.]*(Error|Exception|Resources)(: |\()")


def compile_error(exc: Exception, limit: int = 300) -> str:
    """The reason a flex call failed, in one line: the last error raised in its message, where an inductor
    worker's traceback (``SubprocException``) puts the cause (out of shared memory, say), not its head, and not
    the hints torch appends to every error."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.strip().startswith(_BOILERPLATE)]
    raised = [line for line in lines if _RAISED.match(line)]
    cause = (raised or lines or [""])[-1]
    return f"{type(exc).__name__}: {cause}"[:limit]


def _zero_empty_rows(out: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """Causal with Sq > Skv: the first Sq - Skv rows see no key; the contract writes them as zeros."""
    empty = q_len - kv_len
    if empty > 0:
        out[..., :empty, :] = 0
    return out


def _within(kv_idx, position, left: int, right: int):
    """Keys a query at key position ``position`` sees: at most ``right`` after it and ``left`` before it (-1:
    unbounded), bottom-right like impls.reference.visible."""
    seen = (kv_idx <= position + right) if right >= 0 else (kv_idx >= 0)
    return seen & (kv_idx >= position - left) if left >= 0 else seen


def _softcap_mod(softcap: float):
    """The score_mod of a softcap, or None without one."""
    def capped(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return capped if softcap else None


@register("flex", family="sdpa", requires=requires, variants=("window", "softcap", "value_dim"),
          description="torch FlexAttention, compiled on a GPU; causal and window as a mask_mod and a block mask, "
                      "softcap as a score_mod")
def flex_dense(q, k, v, *, causal: bool, scale: float, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0):
    q_len, kv_len = q.shape[2], k.shape[2]
    offset = kv_len - q_len
    left, right = window
    right = 0 if causal else right

    def visible(b, h, q_idx, kv_idx):
        return _within(kv_idx, q_idx + offset, left, right)

    masked = causal or window != NO_WINDOW
    prepared = _prepared(q, k, v, visible if masked else None, scale=scale, score_mod=_softcap_mod(softcap))
    if masked and q_len > kv_len:
        return Prepared(lambda: _zero_empty_rows(prepared(), q_len, kv_len), prepared.config)
    return prepared


@register("flex", op="varlen", family="sdpa", requires=requires, variants=("window", "softcap"),
          description="torch FlexAttention over the packed batch with a document mask (no padding computed)")
def flex_varlen(inputs, *, scale: float, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0):
    device = inputs.q.device
    lengths_q = torch.tensor(inputs.seqlens_q(), device=device)
    lengths_k = torch.tensor(inputs.seqlens_k(), device=device)
    doc_q = torch.repeat_interleave(torch.arange(inputs.batch, device=device), lengths_q)
    doc_k = torch.repeat_interleave(torch.arange(inputs.batch, device=device), lengths_k)
    start_q, start_k = inputs.cu_seqlens_q[:-1].long(), inputs.cu_seqlens_k[:-1].long()
    offset = lengths_k - lengths_q  # bottom-right alignment within each sequence
    causal = inputs.causal
    if causal and bool((offset < 0).any()):
        raise Unsupported("a sequence with more queries than keys: its first rows see no key")
    left, right = window
    right = 0 if causal else right

    def document(b, h, q_idx, kv_idx):
        same = doc_q[q_idx] == doc_k[kv_idx]
        if not causal and window == NO_WINDOW:
            return same
        seq = doc_q[q_idx]
        return same & _within(kv_idx - start_k[seq], q_idx - start_q[seq] + offset[seq], left, right)

    q, k, v = (t.transpose(0, 1)[None] for t in (inputs.q, inputs.k, inputs.v))  # (1, H, total, D)
    prepared = _prepared(q, k, v, document, scale=scale, score_mod=_softcap_mod(softcap))
    return Prepared(lambda: prepared()[0].transpose(0, 1), prepared.config)


def physical_cache(inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches ``(num_pages, page_size, Hkv, D)`` as the one physical sequence flex reads,
    ``(1, Hkv, num_pages * page_size, D)`` (views, no copy)."""
    return tuple(c.flatten(0, 1).transpose(0, 1)[None] for c in (inputs.k_cache, inputs.v_cache))


def decode_splits(batch: int, kv_heads: int, sms: int) -> int:
    """SPLIT_KV as torch 2.11's flex decoding picks it (``get_split_k``): two programs an SM over the batch's kv
    heads, at least one."""
    return max(sms // max(batch * kv_heads, 1) * 2, 1)


def full_blocks_split_well(visible: list[int], slots: int, kv_heads: int, sms: int) -> bool:
    """Whether flex's decoding kernel keeps all its programs busy over a paged cache whose mask has full blocks;
    ``visible``: the keys each sequence's new tokens see (its length, or a window's span).

    With full blocks, torch 2.11's ``flex_decode`` template cuts each sequence's list of pages into SPLIT_KV ranges
    as long as if the list held the whole physical cache (``slots`` long, every sequence's pages), not its own
    pages (a TODO there). SPLIT_KV is ``decode_splits``. A sequence
    then covers only the ranges its own list reaches, and with many sequences in the cache one program streams all
    of it. Full blocks pay where every sequence still covers every range: one split (the kv heads fill the SMs) or
    one sequence filling the cache.

    Raising SPLIT_KV instead, so that every sequence covers as many ranges as ``decode_splits`` aims at, lost
    (H200): the 70B slice's 16 x 32K at SPLIT_KV 257 read 1018 GB/s and
    8B 16 x 8K at 33 read 1095, against 1160 and 1109 with partial blocks. This choice ran within 0.3% of the
    faster of full and partial blocks on four cases.
    """
    splits = decode_splits(len(visible), kv_heads, sms)
    per_split = -(-slots // splits)
    return all(-(-n // per_split) >= splits for n in visible)


def paged_kernel_options(group: int, page: int) -> dict | None:
    """flex's kernel options for a paged decode with ``group`` query heads a kv head: none where its decoding
    kernel runs (it packs a power-of-two group), else key tiles of at most a page for its main kernel, whose own
    (64 or 128 keys) must divide a key block and so refuse pages of 16 (Qwen2.5-7B's group of 7)."""
    return None if group & (group - 1) == 0 else {"BLOCK_N": min(page, 64)}


def paged_block_mask(inputs, window_left: int, *, full_blocks: bool = False, listed_only: bool = False):
    """The block mask of a paged decode over the physical cache ``(1, Hkv, num_pages * page_size, D)``: per sequence,
    its pages as key blocks. Refuses a page that the table places at two positions.

    ``full_blocks``: the pages every new token sees whole listed as full blocks (no mask_mod), the rest as partial
    (the causal edge, a window's far edge). Off, every page is partial, masked by the mask_mod: flex's decoding
    kernel then splits each sequence's own pages over its programs, where with full blocks it may leave them to one
    (``full_blocks_split_well``).

    ``listed_only``: the mask_mod is asked only of the pages the block lists give each sequence (compiled flex, which
    skips the others), so it maps a slot to its position and no more. Otherwise (eager flex asks of every slot) it
    also checks that the page is the sequence's own, a second lookup per slot."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, sq = inputs.q.shape[:2]
    page, num_pages = inputs.page_size, inputs.k_cache.shape[0]
    device = inputs.q.device
    lengths = inputs.cache_seqlens.long()
    pages = -(-lengths // page)
    table = inputs.block_table.long()
    index = torch.arange(table.shape[1], device=device)[None, :]  # (1, max_pages): a page's place in its sequence
    listed = index < pages[:, None]
    listed_pages, places = table[listed], index.expand_as(table)[listed]
    logical = torch.full((num_pages,), -1, dtype=torch.long, device=device)  # a physical page's place, -1: none
    logical[listed_pages] = places
    if not bool((logical[listed_pages] == places).all()):
        raise Unsupported("a page stands at two positions of the block table: the mask maps each physical page "
                          "back to one position")

    first_query = (lengths - sq)[:, None]  # the position of the first new token; the last is at lengths - 1
    start, end = index * page, (index + 1) * page - 1  # a page's first and last positions
    seen_by_all = listed & (end <= first_query)
    seen_by_any = listed.clone()
    if window_left >= 0:
        seen_by_all &= start >= lengths[:, None] - 1 - window_left
        seen_by_any &= end >= first_query - window_left

    def blocks(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(count, indices) of the kept pages of each sequence, their physical numbers first in each row, then 0
        (a table entry past a sequence's pages may hold anything), the rows as long as the cache's page count
        (BlockMask builds its dense form from them)."""
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
        count = keep.sum(1)
        kept = torch.where(index < count[:, None], table.gather(1, order), 0)
        indices = torch.zeros((batch, 1, 1, num_pages), dtype=torch.int32, device=device)
        indices[..., :table.shape[1]] = kept.to(torch.int32)[:, None, None]
        return count.to(torch.int32)[:, None, None], indices

    def visible(b, h, q_idx, kv_idx):
        physical = kv_idx // page
        place = logical[physical]
        position = place * page + kv_idx % page
        seen = _within(position, q_idx + lengths[b] - sq, window_left, 0)
        if listed_only:
            return seen
        return seen & (place >= 0) & (table[b, place.clamp(min=0)] == physical)  # the sequence's own page

    full = blocks(seen_by_all) if full_blocks else (None, None)
    return BlockMask.from_kv_blocks(*blocks(seen_by_any & ~seen_by_all if full_blocks else seen_by_any), *full,
                                    BLOCK_SIZE=(128, page), mask_mod=visible, seq_lengths=(sq, num_pages * page))


@register("flex", op="paged", family="sdpa", requires=requires, devices=("cuda",), variants=("window", "softcap"),
          description="torch FlexAttention, compiled, over the paged cache with a paged block mask (key block = "
                      "page, PyTorch's paged-attention recipe); whole pages only")
def flex_paged(inputs, *, scale: float, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0):
    page = inputs.page_size
    ragged = next(((b, n) for b, n in enumerate(inputs.seqlens) if n % page), None)
    if ragged:
        raise Unsupported(f"cache_seqlens[{ragged[0]}] = {ragged[1]} ends inside a page of {page}: flex computes "
                          "whole pages, so the unused slots past a length reach P @ V as 0 x value, NaN where a "
                          "slot holds NaN (the contract allows it)")
    # H200, Llama-3-70B's slice 16 x 32K: 3.2 ms with full blocks, 0.26 ms without; 8B 64 x 8K (one split):
    # 0.95 ms with, 1.14 ms without, where the mask_mod runs on every page
    q = inputs.q
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    sq, left = q.shape[1], window[0]
    visible = [n if left < 0 else min(n, left + sq) for n in inputs.seqlens]  # a window lists only its span's pages
    full = full_blocks_split_well(visible, inputs.k_cache.shape[0] * page, inputs.k_cache.shape[2], sms)
    return paged_call(inputs, scale=scale, window_left=left, softcap=softcap, full_blocks=full)


def paged_call(inputs, *, scale: float, full_blocks: bool, window_left: int = -1, softcap: float = 0.0,
               **options) -> Prepared:
    """flex over the physical cache with the paged block mask (``full_blocks`` or not; the lean mask_mod of the
    compiled call, which asks it only of listed pages) and ``paged_kernel_options``, ``options`` over them: the
    entry's call, and ``scripts/flex_paged_probe.py``'s forms."""
    q = inputs.q.transpose(1, 2)  # (B, Hq, Sq, D) against the cache as one batch
    k, v = physical_cache(inputs)
    mask = paged_block_mask(inputs, window_left, full_blocks=full_blocks, listed_only=True)
    kernel_options = (paged_kernel_options(q.shape[1] // k.shape[1], inputs.page_size) or {}) | options
    prepared = _flex_call(q, k, v, mask, scale=scale, score_mod=_softcap_mod(softcap),
                          kernel_options=kernel_options or None)
    return Prepared(lambda: prepared().transpose(1, 2), prepared.config)
