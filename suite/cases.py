"""The cases: one definition of a problem (``Case``) and of its inputs, shared by correctness, benchmarks and
reports; the named presets of them are in ``suite.presets``."""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import asdict, dataclass, replace

import torch

from impls.contract import NO_WINDOW, decode_shaped

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
KV_DTYPES = {"fp8": torch.float8_e4m3fn}  # a paged case's KV cache in a dtype of its own ("": the case's dtype)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn: a per-tensor scale maps the cache's largest magnitude to it


OPS = ("dense", "paged", "varlen", "mla", "mixed", "backward", "fwdbwd")
TRAINING_OPS = ("backward", "fwdbwd")  # the forward's gradients: the backward alone, or a whole training step
PAGED_OPS = ("paged", "mla")  # the operations over a paged cache: decode steps, causal, with a page size
PAGE_SIZED_OPS = (*PAGED_OPS, "mixed")  # every operation over a paged cache (mixed: decode steps and prefill chunks)
LENGTHS = {  # how a serving case's sequence lengths are drawn (seeded by the case id)
    "fixed": "dense cases: every sequence Sq x Skv",
    "uniform": "paged: every sequence holds Skv tokens",
    "longtail": "paged: Skv x u^3, u uniform in (0, 1): mean Skv/4, a few long; the first sequence holds Skv",
    "random": "varlen, packed training: B lengths summing to the total, cut at B-1 uniform random points",
    "equal": "varlen, packed training: B lengths of total/B each (compares with the dense kernel)",
}
# A mixed step's parts, timed apart to price its one launch: the fields each resets (``Case.mixed_parts``; the
# report matches parts by them, ``reports.build.MIXED_PARTS``).
MIXED_PARTS = {"decode": {"chunks": 0, "sq": 1}, "prefill": {"batch": 0, "skv": 0, "lengths": "uniform"}}


@dataclass(frozen=True)
class Case:
    """One problem of the grid. Dense forward by default; ``op`` names a serving operation:

    - ``paged``: decode over a paged KV cache. ``batch`` sequences, ``sq`` new tokens each (Sq_new), ``skv``
      the longest cache length, ``lengths`` how the lengths are drawn, ``page_size`` tokens per page.
    - ``varlen``: packed prefill of ``batch`` sequences of ``lengths`` lengths, ``sq == skv`` tokens in all.
    - ``mla``: MLA decode as ``paged``, over one latent head (``hkv`` 1): ``d`` is the scores' width (latent and
      rotary parts), ``dv`` the latent one (values and output): DeepSeek-V3's 576 and 512.
    - ``mixed``: one serving step of ``batch`` decoding sequences (one new token each; cache lengths as
      ``paged``'s: ``skv`` the longest, ``lengths`` their draw) beside ``chunks`` prefill chunks of ``sq`` new tokens,
      chunk ``c`` the ``c + 1``-th of its prompt (``c * sq`` tokens already cached), over pages of ``page_size``.
    - ``backward``: the backward pass of the dense case of the same shape (``impls.contract.Backward``); with
      ``lengths`` random or equal, of the varlen case's documents packed with cu_seqlens (``packed``).
    - ``fwdbwd``: its forward and backward as a training step runs them (``impls.contract.ForwardBackward``).
    """

    batch: int
    hq: int
    hkv: int
    sq: int
    skv: int
    d: int
    dtype: str = "fp16"
    causal: bool = False
    op: str = "dense"
    page_size: int = 0
    lengths: str = "fixed"
    model: str = ""  # the checkpoint whose attention shape this is, shown in the id
    window: tuple[int, int] = NO_WINDOW  # sliding window (left, right), bottom-right; -1: unbounded
    softcap: float = 0.0  # scores become softcap * tanh(scores / softcap)
    dv: int = 0  # the value (and output) head dim where it differs from d, as in MLA prefill; 0: d (dense only)
    kv_dtype: str = ""  # paged, mla: "fp8", a cache quantized per tensor (impls.contract); "": dtype's
    chunks: int = 0  # mixed: prefill chunks beside the batch's decoding sequences

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.hq % self.hkv:
            raise ValueError(f"GQA ratio: hq={self.hq} is not a multiple of hkv={self.hkv}")
        if self.op not in OPS:
            raise ValueError(f"op {self.op!r} is not one of {', '.join(OPS)}")
        allowed = {"dense": ("fixed",), "paged": ("uniform", "longtail"), "varlen": ("random", "equal"),
                   "mla": ("uniform", "longtail"), "mixed": ("uniform", "longtail"),
                   "backward": ("fixed", "random", "equal"), "fwdbwd": ("fixed", "random", "equal")}[self.op]
        if self.lengths not in allowed:
            raise ValueError(f"lengths {self.lengths!r} do not apply to {self.op}: {', '.join(allowed)}")
        if (self.op in PAGE_SIZED_OPS) != (self.page_size > 0):
            raise ValueError(f"page_size {self.page_size} for op {self.op}: paged cases need one, others none")
        if self.op in PAGE_SIZED_OPS and not self.causal:
            raise ValueError("paged decode is causal: the new tokens are the last positions of each sequence")
        if self.op == "mla" and (self.hkv != 1 or not 0 < self.dv < self.d):
            raise ValueError(f"mla: one latent head (hkv 1, got {self.hkv}) and a latent width dv below the score "
                             f"width d (got dv {self.dv}, d {self.d})")
        if self.op not in ("dense", "mla") and self.dv:  # backward included
            raise ValueError("a value head dim of its own is a dense-attention variant here")
        if self.kv_dtype and (self.op not in PAGED_OPS or self.kv_dtype not in KV_DTYPES or self.dtype == "fp32"):
            raise ValueError(f"kv_dtype {self.kv_dtype!r}: a paged case's cache may be {', '.join(KV_DTYPES)} "
                             f"under fp16/bf16 queries, got op {self.op}, dtype {self.dtype}")
        if self.chunks < 0 or (self.chunks and self.op != "mixed"):
            raise ValueError(f"chunks {self.chunks}: prefill chunks belong to mixed cases")
        if self.op == "mixed" and (self.batch + self.chunks == 0 or (self.batch and self.skv < 1)
                                   or (self.chunks and self.sq < 1)):
            raise ValueError(f"mixed: {self.batch} decoding sequences of up to {self.skv} cached tokens and "
                             f"{self.chunks} prefill chunks of {self.sq} new tokens: at least one sequence, none empty")
        if self.forward_op == "varlen" and (self.sq != self.skv or self.sq < self.batch):
            raise ValueError(f"{self.op}: {self.batch} packed sequences need sq == skv >= batch tokens in all")

    @property
    def packed(self) -> bool:
        """A training op over documents packed as varlen's (``lengths`` random or equal), each attending to itself."""
        return self.op in TRAINING_OPS and self.lengths != "fixed"

    @property
    def forward_op(self) -> str:
        """The forward operation of this case's shape: a training op's own forward (varlen where ``packed``)."""
        if self.op in TRAINING_OPS:
            return "varlen" if self.packed else "dense"
        return self.op

    @property
    def id(self) -> str:
        """Dense ``fp16-causal-h8:2-s300x300-d128`` (``-b4`` appended when batch > 1); serving
        ``paged-bf16-h32:8-q1-kv4096-uniform-p16-d128-b64`` and ``varlen-bf16-causal-h32:8-t16384-random-d128-b8``;
        training ops prefix their forward's with ``bwd-`` or ``fwdbwd-``; a model's name goes first."""
        mask = "causal" if self.causal else "full"
        tail = f"-b{self.batch}" if self.batch != 1 else ""
        heads = f"h{self.hq}:{self.hkv}"
        variants = (f"-dv{self.dv}" if self.dv else "") + (
            f"-w{self.window[0]}:{self.window[1]}" if self.window != NO_WINDOW else "") + (
            f"-cap{self.softcap:g}" if self.softcap else "") + (f"-kv{self.kv_dtype}" if self.kv_dtype else "")
        if self.op == "mixed":
            decode = f"-dec{self.batch}xkv{self.skv}-{self.lengths}" if self.batch else ""
            prefill = f"-pre{self.chunks}x{self.sq}" if self.chunks else ""
            body = f"mixed-{self.dtype}-{heads}{decode}{prefill}-p{self.page_size}-d{self.d}"
        elif self.op == "mla":
            body = (f"mla-{self.dtype}-h{self.hq}-q{self.sq}-kv{self.skv}-{self.lengths}-p{self.page_size}"
                    f"-d{self.dv}+{self.d - self.dv}{f'-kv{self.kv_dtype}' if self.kv_dtype else ''}{tail}")
        elif self.op == "paged":
            body = (f"paged-{self.dtype}-{heads}-q{self.sq}-kv{self.skv}-{self.lengths}-p{self.page_size}"
                    f"-d{self.d}{variants}{tail}")
        elif self.forward_op == "varlen":
            body = f"varlen-{self.dtype}-{mask}-{heads}-t{self.sq}-{self.lengths}-d{self.d}{variants}{tail}"
        else:
            body = f"{self.dtype}-{mask}-{heads}-s{self.sq}x{self.skv}-d{self.d}{variants}{tail}"
        body = {"backward": f"bwd-{body}", "fwdbwd": f"fwdbwd-{body}"}.get(self.op, body)
        return f"{self.model}-{body}" if self.model else body

    @property
    def variants(self) -> dict:
        """The window and softcap keywords to pass, where the case uses them."""
        return ({"window": self.window} if self.window != NO_WINDOW else {}) | (
            {"softcap": self.softcap} if self.softcap else {})

    @property
    def value_dim(self) -> int:
        """The head dim of v and of the output."""
        return self.dv or self.d

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def seed(self) -> int:
        """The case's random draw (lengths and data), from its id; an fp8 cache's case draws what its 16-bit twin
        draws, so that the two compare on the same batch."""
        return zlib.crc32((replace(self, kv_dtype="") if self.kv_dtype else self).id.encode())

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The dtype K and V are stored in."""
        return KV_DTYPES[self.kv_dtype] if self.kv_dtype else self.torch_dtype

    @property
    def gqa_ratio(self) -> int:
        return self.hq // self.hkv

    @property
    def merit(self) -> str:
        """What this case ranks by: ``gbps`` where it is a decode step and so bound by the KV bytes it reads (paged,
        or dense and decode-shaped, ``impls.contract.decode_shaped``: our dense entries run it as decode), else
        ``tflops``; a mixed step by whichever of its bytes and FLOPs bounds it (``suite.metrics.memory_bound``).
        Results files record it per case, and the report reads it from there."""
        if self.op == "mixed":
            from suite.metrics import memory_bound  # suite.metrics imports this module

            return "gbps" if memory_bound(self) else "tflops"
        decode = self.op in PAGED_OPS or (self.op == "dense" and decode_shaped(self.sq, self.skv, self.causal))
        return "gbps" if decode else "tflops"

    def as_dict(self) -> dict:
        return asdict(self)

    def seqlens(self) -> list[int]:
        """Per-sequence lengths: the cache lengths (paged; mixed: the decoding sequences', then the chunks'), the
        sequence lengths (varlen, packed training), Skv (dense)."""
        if self.packed:  # the documents of its varlen forward, which draws its inputs
            return replace(self, op="varlen").seqlens()
        gen = torch.Generator().manual_seed(self.seed)
        if self.op == "mixed":
            decode = replace(self, op="paged", sq=1, chunks=0).seqlens() if self.batch else []
            return decode + [(c + 1) * self.sq for c in range(self.chunks)]
        if self.lengths == "longtail":
            u = torch.rand(self.batch, generator=gen, dtype=torch.float64)
            u[0] = 1.0
            return [max(self.sq, round(self.skv * float(x) ** 3)) for x in u]
        if self.lengths == "random":
            cuts = (torch.randperm(self.sq - 1, generator=gen)[: self.batch - 1] + 1).sort().values.tolist()
            bounds = [0, *cuts, self.sq]
            return [b - a for a, b in itertools.pairwise(bounds)]
        if self.lengths == "equal":
            return [self.sq // self.batch + (i < self.sq % self.batch) for i in range(self.batch)]
        return [self.skv] * self.batch

    def mixed_parts(self) -> dict[str, Case]:
        """A mixed step's decode part (its decoding sequences alone) and prefill part (its chunks alone), where it has
        both; else none. The parts hold the whole's sequences, same lengths (the decoding ones are drawn from the
        paged case's seed, which no chunk field enters; a chunk's are fixed); values and page placement are each
        case's own draw, which the time does not depend on."""
        if self.op != "mixed" or not (self.batch and self.chunks):
            return {}
        return {part: replace(self, **fields) for part, fields in MIXED_PARTS.items()}

    def new_tokens(self) -> list[int]:
        """A mixed case's new tokens per sequence, in ``seqlens``' order: one per decoding sequence, then the
        chunks'."""
        return [1] * self.batch + [self.sq] * self.chunks

    def make_inputs(self, device: str | torch.device):
        """Random normal inputs; the seed comes from the case, so every case draws fresh data.

        Dense: ``(q, k, v)``. Paged: a ``PagedKV`` whose pages are scattered at random over a cache with spare
        pages, every slot no sequence uses (past a length, spare pages, table entries past a sequence's
        last page) holding NaN: a kernel that reads one fails the check; an fp8 cache is the same draw
        quantized per tensor (scale: its largest magnitude over ``FP8_MAX``), as a server's calibration makes it.
        Varlen: a ``Varlen``. Mixed: a ``MixedBatch`` over pages laid out as the paged case's.
        """
        gen = torch.Generator(device=device).manual_seed(self.seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(self.torch_dtype)

        if self.op == "paged":
            return self._paged_inputs(randn, device)
        if self.op == "mla":
            return self._mla_inputs(randn, device)
        if self.op == "mixed":
            return self._mixed_inputs(randn, device)
        if self.op in TRAINING_OPS:
            return self._training_inputs(randn, device)
        if self.op == "varlen":
            from impls.contract import Varlen

            total, lengths = self.sq, self.seqlens()
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
            return Varlen(randn(total, self.hq, self.d), randn(total, self.hkv, self.d),
                          randn(total, self.hkv, self.d), cu, cu.clone(), causal=self.causal)
        shapes = [(self.batch, self.hq, self.sq, self.d), (self.batch, self.hkv, self.skv, self.d),
                  (self.batch, self.hkv, self.skv, self.value_dim)]
        return tuple(randn(*s) for s in shapes)

    def _training_inputs(self, randn, device):
        """The forward's draw (dense, or varlen's packed documents) and a random ``do``; the backward alone gets its
        forward's ``o`` and ``lse`` too (standard attention in the case's dtype per sequence, made here, so outside
        any timed region)."""
        from impls.contract import ForwardBackward

        forward = replace(self, op=self.forward_op).make_inputs(device)
        if self.packed:
            q, k, v, cu_seqlens = forward.q, forward.k, forward.v, forward.cu_seqlens_q
        else:
            (q, k, v), cu_seqlens = forward, None
        step = ForwardBackward(q, k, v, randn(*q.shape), causal=self.causal, cu_seqlens=cu_seqlens)
        return step if self.op == "fwdbwd" else with_forward(step, **self.variants)

    def _paged_inputs(self, randn, device):
        from impls.contract import PagedKV

        layout = self._page_layout()
        k_cache, v_cache = (randn(layout.num_pages, self.page_size, self.hkv, self.d) for _ in range(2))
        scales = {}
        if self.kv_dtype:
            (k_cache, scales["k_scale"]), (v_cache, scales["v_scale"]) = (
                quantized(c, self.kv_torch_dtype) for c in (k_cache, v_cache))
        for cache in (k_cache, v_cache):
            layout.fill_unused(cache)
        q = randn(self.batch, self.sq, self.hq, self.d)
        return PagedKV(q, k_cache, v_cache, *layout.index_tensors(device), **scales)

    def _mixed_inputs(self, randn, device):
        from impls.contract import MixedBatch

        layout = self._page_layout()
        k_cache, v_cache = (randn(layout.num_pages, self.page_size, self.hkv, self.d) for _ in range(2))
        for cache in (k_cache, v_cache):
            layout.fill_unused(cache)
        new = self.new_tokens()
        cu_q = torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32, device=device)
        return MixedBatch(randn(sum(new), self.hq, self.d), k_cache, v_cache, *layout.index_tensors(device), cu_q)

    def _mla_inputs(self, randn, device):
        from impls.contract import MLADecode

        layout, rope = self._page_layout(), self.d - self.dv
        ckv, kpe = (randn(layout.num_pages, self.page_size, width) for width in (self.dv, rope))
        scales = {}
        if self.kv_dtype:  # one scale for both caches: the largest magnitude of either at fp8's largest
            scales["kv_scale"] = max(float(c.abs().max()) for c in (ckv, kpe)) / FP8_MAX
            ckv, kpe = (quantized(c, self.kv_torch_dtype, scales["kv_scale"])[0] for c in (ckv, kpe))
        for cache in (ckv, kpe):
            layout.fill_unused(cache)
        q_nope, q_pe = (randn(self.batch, self.sq, self.hq, width) for width in (self.dv, rope))
        return MLADecode(q_nope, q_pe, ckv, kpe, *layout.index_tensors(device), **scales)

    def _page_layout(self) -> PageLayout:
        """Where a paged case's sequences live: their pages scattered at random over a cache with spare pages."""
        lengths, page = self.seqlens(), self.page_size
        pages_per_seq = [math.ceil(n / page) for n in lengths]
        used, spare = sum(pages_per_seq), max(2, len(lengths) // 4)
        num_pages = used + spare
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(self.batch + page))
        nan_page = int(order[used])  # a spare page: table entries past a sequence's pages point at it
        table = torch.full((len(lengths), max(pages_per_seq) + 1), nan_page, dtype=torch.int32)
        start = 0
        for b, n in enumerate(pages_per_seq):
            table[b, :n] = order[start:start + n]
            start += n
        tails = [(int(table[b, pages_per_seq[b] - 1]), n % page) for b, n in enumerate(lengths) if n % page]
        return PageLayout(lengths, num_pages, table, order[used:], tails)


def with_forward(step, **variants):
    """The ``Backward`` of a training step's inputs (``ForwardBackward``): its forward's ``o`` and ``lse`` made by
    standard attention in the inputs' dtype, per document where they are packed; ``variants``: window, softcap."""
    from impls.reference import attention_lse, attention_ref

    q, k, v = step.q, step.k, step.v
    options = {"causal": step.causal, **variants}
    if not step.packed:
        return step.backward(attention_ref(q, k, v, upcast=False, **options), attention_lse(q, k, **options))
    o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for b in range(step.batch):  # each document's rows: views into the packed o and lse
        qd, kd, vd = (step.document(t, b) for t in (q, k, v))
        step.document(o, b)[:] = attention_ref(qd, kd, vd, upcast=False, **options)
        step.document(lse[..., None], b)[:] = attention_lse(qd, kd, **options)[..., None]
    return step.backward(o, lse)


@dataclass(frozen=True)
class PageLayout:
    """A paged case's pages: the block table (on the host), the spare pages and the (page, first unused slot) of
    each sequence's ragged last page."""

    lengths: list[int]
    num_pages: int
    table: torch.Tensor
    spare: torch.Tensor
    tails: list[tuple[int, int]]

    def fill_unused(self, cache: torch.Tensor) -> None:
        """NaN in every slot of ``cache (num_pages, page_size, ...)`` that no sequence uses."""
        cache[self.spare.to(cache.device)] = float("nan")
        for page, first in self.tails:
            cache[page, first:] = float("nan")

    def index_tensors(self, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``block_table`` and ``cache_seqlens`` on ``device``."""
        return self.table.to(device), torch.tensor(self.lengths, dtype=torch.int32, device=device)


def quantized(cache: torch.Tensor, dtype: torch.dtype, scale: float | None = None) -> tuple[torch.Tensor, float]:
    """``cache`` in fp8 with one scale for the tensor (by default its largest magnitude over ``FP8_MAX``): (stored,
    scale), ``stored * scale`` close to ``cache``."""
    scale = float(cache.abs().max()) / FP8_MAX if scale is None else scale
    return (cache.float() / scale).to(dtype), scale
