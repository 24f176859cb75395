"""The serving operations' inputs (paged decode, varlen prefill, mixed prefill and decode, MLA decode), each
validated once at prepare time, and their sequences in the dense layout. See ``impls.contract``."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from impls.contract.dense import UNBOUNDED, binding_window, default_scale, unit_head_stride, validate_scale


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


def _check_batch(q: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> int:
    """A paged batch's q ``(B, Sq_new, ...)`` against its index tensors: the new tokens per sequence."""
    batch, sq = q.shape[:2]
    if sq == 0 or batch == 0:
        raise ValueError(f"empty q: {tuple(q.shape)}")
    if block_table.shape[0] != batch or cache_seqlens.shape[0] != batch:
        raise ValueError(f"batch size of q ({batch}), block_table ({block_table.shape[0]}) and "
                         f"cache_seqlens ({cache_seqlens.shape[0]}) differ")
    return sq


def _checked_seqlens(cache_seqlens: torch.Tensor, block_table: torch.Tensor, sq: int | Sequence[int],
                     num_pages: int, page_size: int) -> tuple[int, ...]:
    """Host copies of a paged batch's lengths, each checked to hold its ``sq`` new tokens (one count for every
    sequence, or one each) and to find every page it uses in ``block_table`` and in the cache's ``num_pages``."""
    seqlens = tuple(int(n) for n in cache_seqlens.tolist())
    new_tokens = [sq] * len(seqlens) if isinstance(sq, int) else list(sq)
    max_pages, table = block_table.shape[1], block_table.cpu()
    for b, (length, new) in enumerate(zip(seqlens, new_tokens, strict=True)):
        if length < new:
            raise ValueError(f"cache_seqlens[{b}] = {length} is shorter than the {new} new tokens of q")
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
    return seqlens


def _check_fp8_scales(inputs, names: tuple[str, ...], cache_dtype: torch.dtype) -> None:
    """An fp8 cache's dequantization scales (the fields ``names`` of ``inputs``): finite and positive, and 1 where
    the cache (of ``cache_dtype``) is not fp8."""
    for name in names:
        value = getattr(inputs, name)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite positive number, got {value!r}")
        if value != 1.0 and cache_dtype != FP8_KV:
            raise ValueError(f"{name} = {value} applies to an fp8 cache only; this one is {cache_dtype}")


def _dequantized(rows: torch.Tensor, fp8: bool, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache, as ``dtype``: multiplied by the cache's ``scale`` where it is ``fp8``."""
    return rows.to(dtype) * scale if fp8 else rows.to(dtype)


def _checked_offsets(name: str, cu_seqlens: torch.Tensor, total: int) -> tuple[int, ...]:
    """Host copy of a packed batch's offsets ``cu_seqlens (B+1,)``, checked to start at 0, never to decrease and
    to end at the packed tensor's ``total`` rows."""
    offsets = tuple(int(n) for n in cu_seqlens.tolist())
    if offsets[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {offsets[0]}")
    drops = [i for i in range(1, len(offsets)) if offsets[i] < offsets[i - 1]]
    if drops:
        i = drops[0]
        raise ValueError(f"{name} must be non-decreasing: {name}[{i}] = {offsets[i]} < "
                         f"{name}[{i - 1}] = {offsets[i - 1]}")
    if offsets[-1] != total:
        raise ValueError(f"{name}[-1] = {offsets[-1]} but the packed tensor has {total} rows")
    return offsets


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


class _PagedCache:
    """What the operations over a paged K/V cache share (each defines the caches and ``seqlens``)."""

    k_cache: torch.Tensor
    seqlens: tuple[int, ...]

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens)


@dataclass
class PagedKV(_PagedCache, _ServingInputs):
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
        _check_fp8_scales(self, ("k_scale", "v_scale"), self.k_cache.dtype)
        sq = _check_batch(self.q, self.block_table, self.cache_seqlens)
        self.seqlens = _checked_seqlens(self.cache_seqlens, self.block_table, sq, *self.k_cache.shape[:2])

    @property
    def kv_fp8(self) -> bool:
        """Whether the caches are fp8 (dequantized by ``k_scale`` and ``v_scale``)."""
        return self.k_cache.dtype == FP8_KV

    def dequantized(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values read from these caches, as ``dtype``: scaled where the caches are fp8."""
        return _dequantized(k, self.kv_fp8, self.k_scale, dtype), _dequantized(v, self.kv_fp8, self.v_scale, dtype)

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
        self.offsets_q = _checked_offsets("cu_seqlens_q", self.cu_seqlens_q, self.q.shape[0])
        self.offsets_k = _checked_offsets("cu_seqlens_k", self.cu_seqlens_k, self.k.shape[0])

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


@dataclass
class MixedBatch(_PagedCache, _ServingInputs):
    """Prefill chunks and decode steps in one batch over a paged KV cache (module doc). Construction validates and
    reads the offsets and lengths once."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    offsets_q: tuple[int, ...] = field(init=False)  # host copies of cu_seqlens_q and cache_seqlens
    seqlens: tuple[int, ...] = field(init=False)

    op = "mixed"
    head_dim_tensors = ("q", "k_cache", "v_cache")
    index_tensors = ("block_table", "cache_seqlens", "cu_seqlens_q")

    def __post_init__(self) -> None:
        _check_layouts(self.q, self.k_cache, self.v_cache, "k_cache", "v_cache",
                       ("(total_q, Hq, D)", "(num_pages, page_size, Hkv, D)"),
                       {"block_table": (self.block_table, "(B, max_pages)"),
                        "cache_seqlens": (self.cache_seqlens, "(B,)"), "cu_seqlens_q": (self.cu_seqlens_q, "(B+1,)")})
        batch = self.cache_seqlens.shape[0]
        if batch == 0 or self.block_table.shape[0] != batch or self.cu_seqlens_q.shape[0] != batch + 1:
            raise ValueError(f"a batch of B >= 1 sequences needs cache_seqlens (B,), block_table (B, max_pages) and "
                             f"cu_seqlens_q (B+1,): got {tuple(self.cache_seqlens.shape)}, "
                             f"{tuple(self.block_table.shape)} and {tuple(self.cu_seqlens_q.shape)}")
        self.offsets_q = _checked_offsets("cu_seqlens_q", self.cu_seqlens_q, self.q.shape[0])
        empty = [b for b, n in enumerate(self.seqlens_q()) if n == 0]
        if empty:
            raise ValueError(f"sequence {empty[0]} has no new tokens (cu_seqlens_q[{empty[0]}] == "
                             f"cu_seqlens_q[{empty[0] + 1}]): each sequence of a step has at least one")
        self.seqlens = _checked_seqlens(self.cache_seqlens, self.block_table, self.seqlens_q(),
                                        *self.k_cache.shape[:2])

    @property
    def batch(self) -> int:
        return len(self.offsets_q) - 1

    def seqlens_q(self) -> list[int]:
        """New tokens of each sequence: the last ones of its cache."""
        return [b - a for a, b in itertools.pairwise(self.offsets_q)]

    @property
    def max_seqlen_q(self) -> int:
        return max(self.seqlens_q())


MLA_LAYOUTS = {"q_nope": "(B, Sq_new, H, latent)", "q_pe": "(B, Sq_new, H, rope)",
               "ckv": "(num_pages, page_size, latent)", "kpe": "(num_pages, page_size, rope)"}


@dataclass
class MLADecode(_ServingInputs):
    """MLA decode over a paged latent cache (module doc). Construction validates and reads the lengths once."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    ckv: torch.Tensor
    kpe: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    kv_scale: float = 1.0  # an fp8 cache's one dequantization scale, latent and rotary rows alike (module doc)
    seqlens: tuple[int, ...] = field(init=False)  # host copy of cache_seqlens

    op = "mla"
    head_dim_tensors = ("q_nope", "q_pe", "ckv", "kpe")
    index_tensors = ("block_table", "cache_seqlens")

    def __post_init__(self) -> None:
        for name, layout in MLA_LAYOUTS.items():
            t = getattr(self, name)
            _check_tensor(name, t, layout.count(",") + 1, layout)
            if not t.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        tensors = [getattr(self, name) for name in MLA_LAYOUTS]
        queries, caches = {t.dtype for t in tensors[:2]}, {t.dtype for t in tensors[2:]}
        if caches == {FP8_KV} and len(queries) == 1 and not queries <= set(FP8_QUERIES):
            raise TypeError(f"an fp8 ckv/kpe needs fp16 or bf16 q_nope and q_pe, got {self.q_nope.dtype}")
        if len(queries | caches) > 1 and not (caches == {FP8_KV} and len(queries) == 1):
            raise TypeError(f"q_nope, q_pe, ckv and kpe must share one dtype (or ckv and kpe both {FP8_KV}), got "
                            f"{', '.join(str(t.dtype) for t in tensors)}")
        _check_fp8_scales(self, ("kv_scale",), self.ckv.dtype)
        if len({t.device for t in tensors}) > 1:
            raise ValueError(f"q_nope, q_pe, ckv and kpe must be on one device, got "
                             f"{', '.join(str(t.device) for t in tensors)}")
        _check_index("block_table", self.block_table, 2, "(B, max_pages)", self.q.device)
        _check_index("cache_seqlens", self.cache_seqlens, 1, "(B,)", self.q.device)
        if self.q_pe.shape[:3] != self.q_nope.shape[:3]:
            raise ValueError(f"q_nope {tuple(self.q_nope.shape)} and q_pe {tuple(self.q_pe.shape)} must agree in "
                             "(B, Sq_new, H)")
        if self.kpe.shape[:2] != self.ckv.shape[:2]:
            raise ValueError(f"ckv {tuple(self.ckv.shape)} and kpe {tuple(self.kpe.shape)} must agree in "
                             "(num_pages, page_size)")
        for part, q, cache, c_name in (("latent", self.q_nope, self.ckv, "ckv"), ("rope", self.q_pe, self.kpe, "kpe")):
            if q.shape[-1] != cache.shape[-1]:
                raise ValueError(f"{part} width of q_{'nope' if part == 'latent' else 'pe'} ({q.shape[-1]}) and "
                                 f"{c_name} ({cache.shape[-1]}) differ")
        if min(self.q.shape[2], self.latent_dim, self.rope_dim, *self.ckv.shape[:2]) == 0:
            raise ValueError(f"empty tensor: q_nope {tuple(self.q_nope.shape)}, q_pe {tuple(self.q_pe.shape)}, "
                             f"ckv {tuple(self.ckv.shape)}")
        sq = _check_batch(self.q, self.block_table, self.cache_seqlens)
        self.seqlens = _checked_seqlens(self.cache_seqlens, self.block_table, sq, *self.ckv.shape[:2])

    @property
    def q(self) -> torch.Tensor:
        """The query tensor whose shape and dtype the output takes: ``q_nope``."""
        return self.q_nope

    @property
    def latent_dim(self) -> int:
        return self.ckv.shape[-1]

    @property
    def rope_dim(self) -> int:
        return self.kpe.shape[-1]

    @property
    def head_dim(self) -> int:
        """The width of the scores' dot, latent and rotary parts together (the default scale's)."""
        return self.latent_dim + self.rope_dim

    @property
    def page_size(self) -> int:
        return self.ckv.shape[1]

    @property
    def kv_fp8(self) -> bool:
        """Whether the latent and rotary caches are fp8 (dequantized by ``kv_scale``)."""
        return self.ckv.dtype == FP8_KV

    def dequantized(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Latent or rotary rows read from these caches, as ``dtype``: scaled where the caches are fp8."""
        return _dequantized(rows, self.kv_fp8, self.kv_scale, dtype)

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens)


def gather_sequence(inputs: PagedKV | MixedBatch, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s keys and values, ``(Hkv, L, D)`` each, gathered from its pages."""
    k, v = (gather_rows(inputs, c, b).transpose(0, 1) for c in (inputs.k_cache, inputs.v_cache))
    return k, v


def gather_rows(inputs: PagedKV | MixedBatch | MLADecode, cache: torch.Tensor, b: int) -> torch.Tensor:
    """Sequence ``b``'s rows of a paged ``cache (num_pages, page_size, ...)``, ``(L, ...)`` in position order."""
    length = inputs.seqlens[b]
    pages = inputs.block_table[b, : math.ceil(length / inputs.page_size)].long()
    return cache[pages].flatten(0, 1)[:length]


def sequences(inputs: PagedKV | Varlen | MixedBatch | MLADecode, indices: list[int] | None = None,
              kv_dtype: torch.dtype | None = None):
    """Per sequence: (index, q (1, Hq, Sq, D), k, v (1, Hkv, Skv, D), causal) in the dense contract's layout. An
    fp8 cache's keys and values come dequantized, as ``kv_dtype`` (default q's). MLA: one kv head whose keys are
    the latent and rotary rows side by side, the queries likewise, the values the latent rows (``mla_sequence``)."""
    batch = inputs.batch if isinstance(inputs, Varlen | MixedBatch) else inputs.q.shape[0]
    for b in range(batch) if indices is None else indices:
        if isinstance(inputs, MLADecode):
            yield b, *mla_sequence(inputs, b, kv_dtype), True
        elif isinstance(inputs, MixedBatch):
            k, v = gather_sequence(inputs, b)
            yield b, inputs.q[inputs.offsets_q[b]:inputs.offsets_q[b + 1]].transpose(0, 1)[None], k[None], v[None], True
        elif isinstance(inputs, PagedKV):
            k, v = gather_sequence(inputs, b)
            if inputs.kv_fp8:
                k, v = inputs.dequantized(k, v, kv_dtype or inputs.q.dtype)
            yield b, inputs.q[b].transpose(0, 1)[None], k[None], v[None], True
        else:
            (q0, q1), (k0, k1) = inputs.offsets_q[b:b + 2], inputs.offsets_k[b:b + 2]
            q, k, v = (t.transpose(0, 1)[None] for t in (inputs.q[q0:q1], inputs.k[k0:k1], inputs.v[k0:k1]))
            yield b, q, k, v, inputs.causal


def mla_sequence(inputs: MLADecode, b: int, kv_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence ``b`` of an MLA batch as dense attention with one kv head: q ``(1, H, Sq, latent + rope)``, k
    ``(1, 1, L, latent + rope)`` and v ``(1, 1, L, latent)``; the cache's rows as ``kv_dtype`` (default q's),
    dequantized where they are fp8."""
    q = torch.cat([inputs.q_nope[b], inputs.q_pe[b]], dim=-1).transpose(0, 1)[None]
    ckv, kpe = (inputs.dequantized(gather_rows(inputs, cache, b), kv_dtype or inputs.q.dtype)
                for cache in (inputs.ckv, inputs.kpe))
    k = torch.cat([ckv, kpe], dim=-1)
    return q, k[None, None], ckv[None, None]


def scatter_sequence(out: torch.Tensor, inputs: PagedKV | Varlen | MixedBatch | MLADecode, b: int,
                     o: torch.Tensor) -> None:
    """Write sequence ``b``'s output ``o (1, Hq, Sq, D)`` into the operation's output layout."""
    if isinstance(inputs, PagedKV | MLADecode):
        out[b] = o[0].transpose(0, 1)
    else:
        out[inputs.offsets_q[b]:inputs.offsets_q[b + 1]] = o[0].transpose(0, 1)
