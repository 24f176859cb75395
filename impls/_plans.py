"""The serving operations' inputs, beside dense forward: decode over a paged KV cache, packed varlen prefill.

Each is one dataclass that carries its tensors and validates them once, at prepare time, with an error that
names the problem. Host copies of the lengths are taken then too, so that no adapter needs a device sync in
its timed call.

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

Varlen prefill (flash-attn's packed layout):
- ``q (total_q, Hq, D)``, ``k, v (total_k, Hkv, D)``;
- ``cu_seqlens_q, cu_seqlens_k (B+1,) int32``: sequence ``b`` is rows ``cu[b]:cu[b+1]``;
- ``causal`` per sequence, bottom-right like dense. Output ``(total_q, Hq, D)``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from impls._registry import Prepared, Unsupported, get
from impls._tuning import TuningCache, fastest
from impls._validate import NO_WINDOW, UNBOUNDED, binding_window, default_scale, unit_head_stride, validate_scale


def _check_tensor(name: str, t: torch.Tensor, dims: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")


def _check_index(name: str, t: torch.Tensor, dims: int, layout: str, device: torch.device) -> None:
    _check_tensor(name, t, dims, layout)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} with q, got {t.device}")


FP8_KV = torch.float8_e4m3fn  # the fp8 KV cache's storage dtype (e4m3: vLLM's and FlashInfer's "fp8")
FP8_QUERIES = (torch.float16, torch.bfloat16)  # the query (and output) dtypes over an fp8 cache
# Our decode kernels run the dots of bf16 queries over an fp8 cache in fp16 (``fp16_dots``; each kernel's module
# docstring says how): each query row is first multiplied by a power of two that puts its largest |q| in
# [2**F16_ROW_EXP, 2**(F16_ROW_EXP + 1)), below fp16's largest finite 65504 with room to spare, and 27 binary orders
# of magnitude above where fp16 leaves its normal range.
F16_ROW_EXP = 13


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_name: str, v_name: str,
               fp8_kv: bool = False) -> None:
    """``fp8_kv``: k and v may be FP8_KV under half-precision queries (paged decode)."""
    if k.shape != v.shape:
        raise ValueError(f"{k_name} and {v_name} must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    for name, t in (("q", q), (k_name, k), (v_name, v)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    quantized = fp8_kv and k.dtype == FP8_KV and v.dtype == FP8_KV
    if quantized and q.dtype not in FP8_QUERIES:
        raise TypeError(f"an fp8 {k_name}/{v_name} needs fp16 or bf16 q, got {q.dtype}")
    if not quantized and (q.dtype != k.dtype or q.dtype != v.dtype):
        also = f" (or {k_name} and {v_name} both {FP8_KV})" if fp8_kv else ""
        raise TypeError(f"q, {k_name} and {v_name} must share one dtype{also}, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, {k_name} and {v_name} must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dim of q ({q.shape[-1]}) and {k_name} ({k.shape[-1]}) differ")
    hq, hkv = q.shape[-2], k.shape[-2]
    if min(hq, hkv, q.shape[-1]) == 0:
        raise ValueError(f"empty tensor: q {tuple(q.shape)}, {k_name} {tuple(k.shape)}")
    if hq % hkv:
        raise ValueError(f"GQA ratio: query heads Hq={hq} must be a multiple of key/value heads Hkv={hkv}")


def _check_layouts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_name: str, v_name: str,
                   layouts: tuple[str, str], indices: dict[str, tuple[torch.Tensor, str]],
                   fp8_kv: bool = False) -> None:
    """Shapes, dtypes and devices of an operation's tensors; ``layouts`` are q's and k/v's, ``indices`` the
    int32 index tensors with theirs. The rank of each is read off its layout."""
    def rank(layout: str) -> int:
        return len([d for d in layout.strip("()").split(",") if d.strip()])

    q_layout, kv_layout = layouts
    for name, t, layout in (("q", q, q_layout), (k_name, k, kv_layout), (v_name, v, kv_layout)):
        _check_tensor(name, t, rank(layout), layout)
    _check_qkv(q, k, v, k_name, v_name, fp8_kv)
    for name, (t, layout) in indices.items():
        _check_index(name, t, rank(layout), layout, q.device)


class _ServingInputs:
    """What both operations' inputs share (each defines ``q``)."""

    q: torch.Tensor
    kv_fp8 = False  # K and V stored in fp8 (PagedKV's caches can be; varlen's k and v never are)
    head_dim_tensors: tuple[str, ...] = ("q",)  # the fields that hold a head dim: each operation names its own
    index_tensors: tuple[str, ...] = ()  # its int32 index fields

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    def scale(self, scale: float | None) -> float:
        return default_scale(self.head_dim) if scale is None else validate_scale(scale)

    def output_like(self) -> torch.Tensor:
        return torch.empty_like(self.q)

    def in_kernel_layout(self):
        """These inputs as kernels address them: the head dim (the last) of q, K and V at unit stride
        (``unit_head_stride``) and the index tensors contiguous (a kernel reads ``cache_seqlens + b``). A copy of
        each tensor that is not (made when a call is prepared, so out of its timed runs), the others as they are."""
        heads = [getattr(self, name) for name in self.head_dim_tensors]
        laid_out = dict(zip(self.head_dim_tensors, unit_head_stride(*heads), strict=True))
        laid_out |= {name: getattr(self, name).contiguous() for name in self.index_tensors}
        copies = {name: t for name, t in laid_out.items() if t is not getattr(self, name)}
        return replace(self, **copies) if copies else self


def decode_read_length(length: int, new_tokens: int, window_left: int = UNBOUNDED, align: int = 1) -> int:
    """Cache positions of one sequence that its new tokens see together, so a decode kernel reads: the whole
    cache, or with a sliding window of ``window_left`` keys the last ``window_left + new_tokens`` positions,
    from the first of them rounded down to a multiple of ``align`` (a kernel that reads whole tiles from the
    tile that holds it)."""
    return length - max(length - new_tokens - window_left, 0) // align * align


@dataclass
class PagedKV(_ServingInputs):
    """Decode over a paged KV cache (module doc). Construction validates and reads the lengths once."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    k_scale: float = 1.0  # an fp8 cache's dequantization scales (module doc); 1 for any other cache
    v_scale: float = 1.0
    seqlens: tuple[int, ...] = field(init=False)  # host copy of cache_seqlens

    op = "paged"
    head_dim_tensors = ("q", "k_cache", "v_cache")
    index_tensors = ("block_table", "cache_seqlens")

    def __post_init__(self) -> None:
        _check_layouts(self.q, self.k_cache, self.v_cache, "k_cache", "v_cache",
                       ("(B, Sq_new, Hq, D)", "(num_pages, page_size, Hkv, D)"),
                       {"block_table": (self.block_table, "(B, max_pages)"),
                        "cache_seqlens": (self.cache_seqlens, "(B,)")}, fp8_kv=True)
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite positive number, got {value!r}")
            if value != 1.0 and not self.kv_fp8:
                raise ValueError(f"{name} = {value} applies to an fp8 cache only; this one is {self.k_cache.dtype}")
        batch, sq = self.q.shape[:2]
        if sq == 0 or batch == 0:
            raise ValueError(f"empty q: {tuple(self.q.shape)}")
        if self.block_table.shape[0] != batch or self.cache_seqlens.shape[0] != batch:
            raise ValueError(f"batch size of q ({batch}), block_table ({self.block_table.shape[0]}) and "
                             f"cache_seqlens ({self.cache_seqlens.shape[0]}) differ")
        self.seqlens = tuple(int(n) for n in self.cache_seqlens.tolist())
        num_pages, page_size, max_pages = self.k_cache.shape[0], self.page_size, self.block_table.shape[1]
        table = self.block_table.cpu()
        for b, length in enumerate(self.seqlens):
            if length < sq:
                raise ValueError(f"cache_seqlens[{b}] = {length} is shorter than the {sq} new tokens of q")
            pages = math.ceil(length / page_size)
            if pages > max_pages:
                raise ValueError(f"cache_seqlens[{b}] = {length} needs {pages} pages of {page_size}, but "
                                 f"block_table has {max_pages} per sequence")
            used = table[b, :pages]
            bad = ((used < 0) | (used >= num_pages)).nonzero()
            if len(bad):
                i = int(bad[0, 0])
                raise ValueError(f"block_table[{b}, {i}] = {int(used[i])} is out of range: the cache has "
                                 f"{num_pages} pages")

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def kv_fp8(self) -> bool:
        """Whether the caches are fp8 (dequantized by ``k_scale`` and ``v_scale``)."""
        return self.k_cache.dtype == FP8_KV

    def dequantized(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values read from these caches, as ``dtype``: scaled where the caches are fp8."""
        if not self.kv_fp8:
            return k.to(dtype), v.to(dtype)
        return k.to(dtype) * self.k_scale, v.to(dtype) * self.v_scale

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens)

    def read_lengths(self, window_left: int = UNBOUNDED, align: int = 1) -> list[int]:
        """``decode_read_length`` of each sequence."""
        return [decode_read_length(n, self.q.shape[1], window_left, align) for n in self.seqlens]

    def window_left(self, window: tuple[int, int]) -> int:
        """A window's left side as the decode kernels take it: UNBOUNDED where it hides no key of these
        sequences (decode is causal: no right side)."""
        left, _ = binding_window(window, True, self.q.shape[1], self.max_seqlen)
        return UNBOUNDED if left < 0 else left


@dataclass
class Varlen(_ServingInputs):
    """Packed variable-length prefill (module doc). Construction validates and reads the offsets once."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    causal: bool = False
    offsets_q: tuple[int, ...] = field(init=False)  # host copies of the cu_seqlens
    offsets_k: tuple[int, ...] = field(init=False)

    op = "varlen"
    head_dim_tensors = ("q", "k", "v")
    index_tensors = ("cu_seqlens_q", "cu_seqlens_k")

    def __post_init__(self) -> None:
        _check_layouts(self.q, self.k, self.v, "k", "v", ("(total_q, Hq, D)", "(total_k, Hkv, D)"),
                       {"cu_seqlens_q": (self.cu_seqlens_q, "(B+1,)"), "cu_seqlens_k": (self.cu_seqlens_k, "(B+1,)")})
        if self.cu_seqlens_q.shape != self.cu_seqlens_k.shape or self.cu_seqlens_q.shape[0] < 2:
            raise ValueError(f"cu_seqlens_q {tuple(self.cu_seqlens_q.shape)} and cu_seqlens_k "
                             f"{tuple(self.cu_seqlens_k.shape)} must both be (B+1,) with B >= 1")
        self.offsets_q = tuple(int(n) for n in self.cu_seqlens_q.tolist())
        self.offsets_k = tuple(int(n) for n in self.cu_seqlens_k.tolist())
        for name, offsets, total in (("cu_seqlens_q", self.offsets_q, self.q.shape[0]),
                                     ("cu_seqlens_k", self.offsets_k, self.k.shape[0])):
            if offsets[0] != 0:
                raise ValueError(f"{name}[0] must be 0, got {offsets[0]}")
            drops = [i for i in range(1, len(offsets)) if offsets[i] < offsets[i - 1]]
            if drops:
                i = drops[0]
                raise ValueError(f"{name} must be non-decreasing: {name}[{i}] = {offsets[i]} < "
                                 f"{name}[{i - 1}] = {offsets[i - 1]}")
            if offsets[-1] != total:
                raise ValueError(f"{name}[-1] = {offsets[-1]} but the packed tensor has {total} rows")

    @property
    def batch(self) -> int:
        return len(self.offsets_q) - 1

    def seqlens_q(self) -> list[int]:
        return [b - a for a, b in itertools.pairwise(self.offsets_q)]

    def seqlens_k(self) -> list[int]:
        return [b - a for a, b in itertools.pairwise(self.offsets_k)]

    @property
    def max_seqlen_q(self) -> int:
        return max(self.seqlens_q())

    @property
    def max_seqlen_k(self) -> int:
        return max(self.seqlens_k())

    def binding_window(self, window: tuple[int, int]) -> tuple[int, int]:
        """``window`` with each side that hides no key of any sequence unbounded (``binding_window``): bottom-right
        in each sequence, a side that hides no key of the longest sequences hides none of the others."""
        return binding_window(window, self.causal, self.max_seqlen_q, self.max_seqlen_k)


def gather_sequence(inputs: PagedKV, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s keys and values, ``(Hkv, L, D)`` each, gathered from its pages."""
    length = inputs.seqlens[b]
    pages = inputs.block_table[b, : math.ceil(length / inputs.page_size)].long()
    k, v = (c[pages].flatten(0, 1)[:length].transpose(0, 1) for c in (inputs.k_cache, inputs.v_cache))
    return k, v


# Dense calls shaped like decode: a few new tokens against a longer cache, causal (bottom-right) or one token. Our
# dense entries can hand them to our split-KV decode kernel (their paged operation) over the dense cache seen as
# pages: page n of the view is the P rows that start n * P rows into the cache, so each sequence's block table lists
# its own pages in order and nothing is copied; they time it against their dense kernel (``decode_route``). Session
# 4 (H200, the `decode` preset: B=4, Hq=32, Hkv=8, D=128) had the dense kernels, one block per (batch, head)
# streaming its whole cache, at 1.5-1.7 TB/s where cuDNN read 3.8-4.0.
DENSE_DECODE_MAX_NEW = 16  # new tokens, as the paged operation takes them (speculative decoding verifies up to 16)
# The view's page: the largest of these that cuts every cache into whole pages, else the whole cache (one page a
# sequence: any length runs, though only kernels that take any page size read it well, Triton's; cuTile's page loads
# need pages of whole tiles, so it gathers rows, and its route is then timed against its dense kernel like any other).
DENSE_PAGE_SIZES = (256, 128, 64, 32, 16)
DENSE_DECODE_ENV = "FMHA_DENSE_DECODE"  # "0": dense entries run their dense kernel on decode shapes too


def decode_shaped(sq: int, skv: int, causal: bool) -> bool:
    """Whether a dense call of ``sq`` queries over ``skv`` keys is a decode step: at most DENSE_DECODE_MAX_NEW new
    tokens, the last ``sq`` positions of the cache, each seeing the keys up to its own (causal, bottom-right, or a
    single token, which sees them all either way)."""
    return sq <= DENSE_DECODE_MAX_NEW and sq < skv and (causal or sq == 1)


def dense_as_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> PagedKV | None:
    """A decode-shaped dense call (``decode_shaped``; q ``(B, Hq, Sq, D)``, k and v ``(B, Hkv, Skv, D)``, head
    dims at unit stride) as paged decode over views of the same memory: q as ``(B, Sq, Hq, D)``, each cache as
    ``(num_pages, P, Hkv, D)`` with P the largest of DENSE_PAGE_SIZES that divides Skv (else Skv: a page a
    sequence), a block table of each sequence's pages and every length Skv. None where the call is not
    decode-shaped, or k and v are laid out apart, or no page size cuts the caches: a sequence's rows must start a
    whole number of pages apart (the contract's layout and flash-attn's (B, Skv, Hkv, D) both do)."""
    batch, _, sq, head_dim = q.shape
    kv_heads, skv = k.shape[1], k.shape[2]
    step_b, step_h, step_s, _ = k.stride()
    if (not decode_shaped(sq, skv, causal) or v.shape != k.shape or v.stride() != k.stride() or step_s <= 0
            or min(k.stride()) < 0):
        return None
    fits = [p for p in (*DENSE_PAGE_SIZES, skv) if skv % p == 0 and (batch == 1 or step_b % (p * step_s) == 0)]
    if not fits:
        return None
    page = fits[0]
    per_sequence = skv // page
    sequence_step = step_b // (page * step_s) if batch > 1 else 0  # pages from one sequence's first to the next's
    size = ((batch - 1) * sequence_step + per_sequence, page, kv_heads, head_dim)
    k_pages, v_pages = (t.as_strided(size, (page * step_s, step_s, step_h, 1)) for t in (k, v))
    table = torch.arange(batch)[:, None] * sequence_step + torch.arange(per_sequence)[None, :]
    return PagedKV(q.transpose(1, 2), k_pages, v_pages, table.to(device=q.device, dtype=torch.int32),
                   torch.full((batch,), skv, dtype=torch.int32, device=q.device))


def decode_route(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                 dense: Callable[[], Prepared], tuning: TuningCache, window: tuple[int, int] = NO_WINDOW,
                 softcap: float = 0.0) -> Prepared:
    """This dense call through ``name``'s paged decode (``dense_as_paged``, its output in the dense layout) or
    through ``dense()``, the entry's dense kernel: whichever is faster for the decode's shape class, timed once on an
    idle GPU and kept in ``tuning`` (the family's cache); the decode where nothing is timed (the interpreter, a shared
    GPU). Not a decode step, or DENSE_DECODE_ENV "0": ``dense()``. A step the decode refuses: ``dense()``, its config
    saying why. Session 61 (H200, the `decode` preset, one machine): the decode took 1 x 32K from 308 to 136 us
    (cuTile) and 346 to 130 (Triton), but 16 x 1K from 13.3 to 16.5 and 15.4 to 17.4."""
    paged = dense_as_paged(q, k, v, causal) if os.environ.get(DENSE_DECODE_ENV, "1") != "0" else None
    if paged is None:
        return dense()
    try:
        decode = get(name, "paged").prepare(paged, scale=scale, window=window, softcap=softcap)
    except Unsupported as exc:
        return dense().with_config(decode_route=f"split-KV decode refused: {exc}")
    routed = Prepared(lambda: decode.run().transpose(1, 2), config={
        "route": f"split-KV decode over the cache as pages of {paged.page_size}", **decode.config})
    if not timed_here(q):  # the interpreter: nothing to time
        return routed
    dense_kernel = functools.cache(dense)  # prepared once, whether timed, compiled or chosen
    shape = ("dense decode", *decode_shape_class(paged, paged.window_left(window), softcap))
    entry, source = tuning.lookup(tuning.key(q.device, shape),
                                  lambda: {"route": fastest([("decode", routed), ("dense", dense_kernel())])},
                                  lambda: {"route": "decode"}, dense_kernel)
    if entry["route"] == "dense":
        return dense_kernel().with_config(route="dense kernel (faster than the split-KV decode here)",
                                          route_chosen=source)
    return routed.with_config(route_chosen=source)


def timed_here(q: torch.Tensor) -> bool:
    """Whether the route of a call on q's device can be timed (on a GPU)."""
    return q.is_cuda


def fp16_dots(inputs: PagedKV) -> bool:
    """Whether our decode kernels run this batch's dots in fp16 (their F16_DOT): bf16 queries over an fp8 cache,
    since e4m3 widens to fp16 in one instruction per two elements and to bf16 only through a second conversion."""
    return inputs.kv_fp8 and inputs.q.dtype == torch.bfloat16


def dependent_launch_available(device: torch.device) -> bool:
    """Whether ``device`` runs programmatic dependent launch (Hopper and later): our decode kernels launch their
    split steps that way there (each kernel waits for the grid before it; the combine's launch overlaps the split
    kernel's last wave)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def sequences(inputs: PagedKV | Varlen, indices: list[int] | None = None, kv_dtype: torch.dtype | None = None):
    """Per sequence: (index, q (1, Hq, Sq, D), k, v (1, Hkv, Skv, D), causal) in the dense contract's layout. An
    fp8 cache's keys and values come dequantized, as ``kv_dtype`` (default q's)."""
    batch = inputs.q.shape[0] if isinstance(inputs, PagedKV) else inputs.batch
    for b in range(batch) if indices is None else indices:
        if isinstance(inputs, PagedKV):
            k, v = gather_sequence(inputs, b)
            if inputs.kv_fp8:
                k, v = inputs.dequantized(k, v, kv_dtype or inputs.q.dtype)
            yield b, inputs.q[b].transpose(0, 1)[None], k[None], v[None], True
        else:
            (q0, q1), (k0, k1) = inputs.offsets_q[b:b + 2], inputs.offsets_k[b:b + 2]
            q, k, v = (t.transpose(0, 1)[None] for t in (inputs.q[q0:q1], inputs.k[k0:k1], inputs.v[k0:k1]))
            yield b, q, k, v, inputs.causal


def scatter_sequence(out: torch.Tensor, inputs: PagedKV | Varlen, b: int, o: torch.Tensor) -> None:
    """Write sequence ``b``'s output ``o (1, Hq, Sq, D)`` into the operation's output layout."""
    if isinstance(inputs, PagedKV):
        out[b] = o[0].transpose(0, 1)
    else:
        out[inputs.offsets_q[b]:inputs.offsets_q[b + 1]] = o[0].transpose(0, 1)


# Split-KV decode plans, shared by our Triton and cuTile kernels. A chunk of the cache is at least
# SPLIT_MIN_TILES key tiles: shorter ones cost more in the combine than they add in parallelism. Chunks are
# sized so that every SM gets PROGRAMS_PER_SM blocks' worth of the batch's keys: by total tokens, not by the
# longest sequence, so a long-tailed batch splits its long sequences finely and leaves its short ones whole.
SPLIT_MIN_TILES = 4
PROGRAMS_PER_SM = 4
# The shortest chunks the tuners' plans allow (None: SPLIT_MIN_TILES). On a short step a program's tiles are a
# chain of dependent loads (table, then K and V), and the step takes about as long as that chain however little
# it reads; one-tile chunks cut it to one link. Session 60 (H200, serving_probe.py --min-tiles, the fastest Triton
# config on plans of chunks of at least 4 / 2 / 1 tiles, alternating, us a step): 8B 1 x 512 7.49 / 5.59 / 4.95,
# 1 x 2K 8.24 / 7.51 / 7.37; the 70B slice's 1 x 512 7.60 / 5.78 / 4.70, 1 x 2K 8.11 / 6.24 / 5.20, 1 x 8K
# 8.68 / 6.28 / 5.67, 16 x 512 8.33 / 6.48 / 6.41, 64 x 512 10.25 / 9.27 / 9.28; 8B 16 x 512 and 16 x 2K level
# (unsplit). Where the batch fills the GPU both cut alike, so the tuner times them once.
PLAN_MIN_TILES = (None, 1)
# The programs per SM that the tuners' plans aim at (each kernel form is timed with each; several often cut
# alike): a batch whose plan at PROGRAMS_PER_SM lands just past a wave, or splits where one chunk a sequence
# would do, can take fewer or more chunks without another compiled kernel. Session 30 (H200, serving_probe.py
# --plans, cuTile): a plan aimed at 1 was slower than the best of these on 6 of 7 cases (by 4-18%), and
# 0.9% faster at 8B 16 x 32K.
AIMED_PLANS = (2, PROGRAMS_PER_SM, 8)
UNSPLIT_SLACK = 1.25  # a batch whose longest sequence is at most this many target chunks runs unsplit


def split_plan(lengths: list[int] | tuple[int, ...], kv_heads: int, block_n: int, sm_count: int,
               min_tiles: int | None = None, programs_per_sm: int = PROGRAMS_PER_SM,
               fit: bool = False) -> tuple[int, int]:
    """(num_splits, split_len): the longest sequence cut into equal chunks of whole key tiles, at least
    ``min_tiles`` long, about as long as the batch's tiles (over every kv head) shared among ``programs_per_sm``
    programs per SM (the target; a tuner may try several).

    A batch whose longest sequence is at most UNSPLIT_SLACK targets long runs unsplit, and the chunks are equal.
    Session 8 (H200, Nsight Compute, 8B 64 x 8K): cutting at the target length left each sequence 62 tiles and
    a sliver of 2, so half the programs carried 3% of the keys and every row paid a combine; unsplit, like
    FlashInfer's plan, it read 4.22 TB/s instead of 4.10. A long-tailed batch keeps the count rounded up: its
    longest sequences are the critical path (with one split fewer, 8B 64 x 8K long-tailed fell 10%).

    ``fit``: the shortest chunk whose programs that hold keys all fit in ``programs_per_sm`` x ``sm_count``
    slots at once (``fitted_chunk``), so the launch is whole waves with no tail."""
    min_tiles = SPLIT_MIN_TILES if min_tiles is None else min_tiles
    tiles = [-(-n // block_n) for n in lengths]
    longest = max(tiles)
    if fit:
        chunk = fitted_chunk(tiles, kv_heads, programs_per_sm * sm_count, min_tiles)
        return -(-longest // chunk), chunk * block_n
    target = max(min_tiles, -(-kv_heads * sum(tiles) // (programs_per_sm * sm_count)))
    splits = 1 if longest <= UNSPLIT_SLACK * target else min(-(-longest // target), longest // min_tiles)
    chunk = -(-longest // splits)
    return -(-longest // chunk), chunk * block_n


def fitted_chunk(tiles: list[int], kv_heads: int, slots: int, min_tiles: int) -> int:
    """The shortest chunk, in key tiles and at least ``min_tiles``, that cuts these sequences into at most
    ``slots`` programs over ``kv_heads`` kv heads (the longest sequence whole where even that is more). The
    count falls as the chunk grows, so a bisection finds it, as FlashInfer's decode plan sizes its chunks to the
    grid that fits the GPU at once."""
    longest = max(tiles)

    def programs(chunk: int) -> int:
        return kv_heads * sum(-(-t // chunk) for t in tiles)

    low, high = min(min_tiles, longest), longest
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if programs(mid) <= slots else (mid + 1, high)
    return low


COMBINE_STEP_ELEMENTS = 4096  # partial-output elements a combine program merges per step: 16 KB of fp32
COMBINE_MIN_TILE_D = 16


def combine_plan(num_splits: int, head_dim: int) -> tuple[int, int]:
    """How the combine cuts one row's merge: ``(tile_d, chunks)``, a program per ``tile_d`` slice of the head
    dim that merges ``chunks`` chunks per step.

    A step's loads are dependent round trips to memory (about a microsecond each), so the merge should take as
    few steps as it can: with many chunks (a long cache at batch 1: hundreds) the head-dim slice narrows until
    all of them fit in one step, and the row is merged by ``head_dim / tile_d`` programs instead of one."""
    chunks = 1 << max(num_splits - 1, 0).bit_length()
    tile_d = max(COMBINE_MIN_TILE_D, min(head_dim, COMBINE_STEP_ELEMENTS // chunks))
    return tile_d, min(chunks, COMBINE_STEP_ELEMENTS // tile_d)


def decode_shape_class(inputs: PagedKV, window_left: int = UNBOUNDED, softcap: float = 0.0) -> tuple:
    """What a decode autotuner's choice depends on: dtype, head dim, heads, new tokens, page size, and the
    batch, longest length read and spread of those lengths in powers of two; whether a window or softcap is
    compiled in, and an fp8 cache."""
    batch, sq, hq, head_dim = inputs.q.shape
    hkv, lengths = inputs.k_cache.shape[2], inputs.read_lengths(window_left)
    spread = round(math.log2(max(lengths) * len(lengths) / sum(lengths)))
    pow2 = [1 << (n - 1).bit_length() for n in (batch, max(lengths))]
    return ("paged", inputs.q.dtype, head_dim, hkv, hq // hkv, sq, inputs.page_size, *pow2, spread,
            *variant_tags(window_left < UNBOUNDED, softcap), *(("kv_fp8",) if inputs.kv_fp8 else ()))


def variant_tags(window: bool, softcap: float) -> tuple[str, ...]:
    """The model variants a call compiles in, as a serving tuner's shape class names them."""
    return ("window",) * window + ("softcap",) * (softcap > 0)


# Persistent varlen prefill: the host plans which block runs which query tiles, once, when the call is prepared
# (as FlashInfer's plan() does), and the kernel follows the plan. A work item is one query tile of one
# (sequence, head); its cost is counted in key tiles, plus PLAN_ITEM_OVERHEAD_TILES for what every item pays
# whatever its length (the Q load, the accumulator's start and the output's store).
PLAN_ITEM_OVERHEAD_TILES = 1


@dataclass(frozen=True)
class WorkPlan:
    """Block ``b`` of a persistent launch runs ``items[starts[b]:starts[b + 1]]`` in order; an item is
    ``(sequence * max_tiles + query_tile) * heads + head`` (``encode_item``)."""

    starts: tuple[int, ...]
    items: tuple[int, ...]
    max_tiles: int
    heads: int

    @property
    def blocks(self) -> int:
        return len(self.starts) - 1

    def decode(self, item: int) -> tuple[int, int, int]:
        """(sequence, query tile, head) of an item, as the kernel decodes it."""
        rest, head = divmod(item, self.heads)
        sequence, tile = divmod(rest, self.max_tiles)
        return sequence, tile, head


def query_tile_cost(tile: int, len_q: int, len_k: int, tile_m: int, tile_n: int, causal: bool,
                    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)) -> int:
    """Key tiles query tile ``tile`` of a (len_q, len_k) sequence visits, plus the per-item overhead: the tiles
    from the one holding the first key some row sees to the one holding the last (bottom-right: row i sits at key
    position i + len_k - len_q; causal, it sees no key after it; ``window``: the kernels' (left, right) bounds,
    ``window_bounds``), as the kernel's ``key_tiles`` counts them."""
    first_row = tile * tile_m + len_k - len_q
    left, right = window
    end = min(len_k, first_row + tile_m + (0 if causal else right))
    start = max(first_row - left, 0)
    return max(-(-end // tile_n) - start // tile_n, 0) + PLAN_ITEM_OVERHEAD_TILES


def varlen_work_plan(seqlens_q: list[int], seqlens_k: list[int], heads: int, tile_m: int, tile_n: int,
                     causal: bool, slots: int, window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)) -> WorkPlan:
    """Share a packed batch's query tiles among at most ``slots`` persistent blocks, longest processing time
    first: units of work, heaviest first, each to the block with the least work so far.

    A unit is one query tile, or, causal, a mirror pair of one (sequence, head)'s tiles (its heaviest remaining
    and its lightest: every pair of a sequence costs the same, the dense kernel's ``paired`` share), heavy tile
    first. Units of equal cost keep the order sequence, head, pair, so that the blocks running at once share few
    heads' K/V, as in the dense kernel. Sequences without query rows give no work. ``window``: the kernels'
    (left, right) bounds, which make the tiles past a sequence's first window all cost the same.

    Equal pairs leave a last round: 768 pairs on 132 blocks give the busiest block 6 against a mean of 5.82, 3%
    of the launch idle (``split_tail``). So the trailing pairs, in that order, are split into their tiles where
    that shortens the busiest block's work: their light tiles fill the last round."""
    max_tiles = max(-(-n // tile_m) for n in seqlens_q)
    units = []  # (cost, items)
    for sequence, (len_q, len_k) in enumerate(zip(seqlens_q, seqlens_k, strict=True)):
        tiles = -(-len_q // tile_m)
        cost = [query_tile_cost(t, len_q, len_k, tile_m, tile_n, causal, window) for t in range(tiles)]
        if causal:  # mirror pairs, heavy tile first; an odd count's middle tile alone
            groups = [sorted({tiles - 1 - i, i}, reverse=True) for i in range((tiles + 1) // 2)]
        else:
            groups = [[t] for t in range(tiles)]
        for head in range(heads):
            for group in groups:
                units.append([(cost[t], (sequence * max_tiles + t) * heads + head) for t in group])
    shares = split_tail(units, max(min(slots, len(units)), 1))
    starts = (0, *itertools.accumulate(len(share) for share in shares))
    return WorkPlan(starts, tuple(itertools.chain.from_iterable(shares)), max_tiles, heads)


# split_tail's tries: the share of the trailing units split into their items, smallest first; a try is kept
# where its busiest block has at most SPLIT_TAIL_SLACK more work than the best try's.
SPLIT_TAIL_SHARES = (0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1)
SPLIT_TAIL_SLACK = 1.002


def split_tail(units: list[list[tuple[int, int]]], blocks: int) -> list[list[int]]:
    """Each block's items: ``units`` (each a list of (cost, item) run together) shared longest processing time
    first (``longest_first``), with the trailing units split into their items. Of ``SPLIT_TAIL_SHARES`` the
    smallest share whose busiest block is within ``SPLIT_TAIL_SLACK`` of the best: a split unit's items may
    run on different blocks, the heavy one early and the light one late, where it fills a round that whole units
    leave part empty. Simulated, causal: GPT-2 1 x 32K (768 pairs of 256-row tiles, 132 blocks) 0.970 -> 0.997 of
    a perfect share, Phi-3 1 x 32K (4,096 pairs) 0.970 -> 1.000, four 4K sequences of 16 heads 0.970 -> 0.995."""
    fractions = SPLIT_TAIL_SHARES if any(len(unit) > 1 for unit in units) else (0,)
    tries = []
    for fraction in fractions:
        keep = len(units) - round(fraction * len(units))
        tries.append(longest_first(units[:keep] + [[item] for unit in units[keep:] for item in unit], blocks))
    best = min(busiest for busiest, _ in tries)
    return next(shares for busiest, shares in tries if busiest <= best * SPLIT_TAIL_SLACK)


def longest_first(units: list[list[tuple[int, int]]], blocks: int) -> tuple[int, list[list[int]]]:
    """(the busiest block's work, each block's items): units heaviest first (a stable sort: equal costs keep their
    order), each to the block with the least work so far."""
    costed = sorted(((sum(cost for cost, _ in unit), unit) for unit in units), key=lambda pair: -pair[0])
    load = [(0, block) for block in range(blocks)]  # a heap of (work so far, block)
    shares: list[list[int]] = [[] for _ in range(blocks)]
    for cost, unit in costed:
        work, block = heapq.heappop(load)
        shares[block].extend(item for _, item in unit)
        heapq.heappush(load, (work + cost, block))
    return max(work for work, _ in load), shares
