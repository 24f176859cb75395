"""Our cuTile kernels for the serving operations (``impls.contract``), registered as ``cutile``:

- ``paged``: split-KV decode over the paged cache with GQA packing (``decode.py``), then the combine; the key
  tile width, how pages are read (gathered row by row, or a page at a time with block loads) and the load
  latencies are tuned per decode shape class, with the split plan (``impls._plans.split_plan``: from the
  tile width, the batch's lengths, the programs per SM it aims at, ``AIMED_PLANS``, and the shortest chunk,
  ``PLAN_MIN_TILES``);
- ``varlen``: the dense kernel's query-tile work on each packed sequence (``kernel.fmha_varlen``), with the
  dense kernel's Hopper candidates, tuned per shape class: one block per query tile, or a persistent block per
  SM slot that runs the query tiles a host plan gave it (``impls._plans.varlen_work_plan``). A sliding window
  and softcap apply per sequence as in the dense kernel: key tiles outside the window are never visited, and the
  plan costs each query tile by the tiles its window shows.

Both are prepared the way the dense entry is: inputs validated and every launch's arguments made once, so
that the timed call only launches. Construction touches no GPU (the SM count is passed in), so the CPU tests
compile the very launches a GPU would run (``export.export_launch``).
"""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import asdict, dataclass, replace

import torch

from impls._plans import (
    AIMED_PLANS,
    NEAR_DECODE,
    PLAN_MIN_TILES,
    PROGRAMS_PER_SM,
    combine_plan,
    decode_shape_class,
    dependent_launch_available,
    fp16_dots,
    split_plan,
    variant_tags,
    varlen_work_plan,
)
from impls._registry import HALF, Prepared, Unsupported, heads_by_batch, length_class, parallel_class, register
from impls.contract import NO_WINDOW, UNBOUNDED, PagedKV, Varlen, window_bounds
from impls.cutile.config import (
    HEAD_DIMS,
    Variant,
    bind,
    device_sm_count,
    kernel_window,
    kernel_with_hints,
    needs_int64,
    tile_d,
)
from impls.cutile.launch import Launches, requires
from impls.cutile.spaces import search_space
from impls.cutile.tuner import TUNING, compiled_candidates, remembered, tuned
from impls.tuning import dense_tuner, fastest

# The Q tile, the accumulator and the partial outputs are TILE_D wide: a head dim below it (Phi-3's 96) reads zeros
# past its end (page loads pad, gathers are bounds-checked) and its output stores stop there.
DECODE_HEAD_DIMS = HEAD_DIMS
MAX_PACKED_ROWS = 128  # query heads per kv head x new tokens in one tile


@dataclass(frozen=True)
class DecodeVariant:
    """One compiled form of the decode kernel: key tile width, how a tile is read from the pages (``read``:
    "rows", "pages" or "indexed", decode.py's GATHER), how far ahead K and V loads are issued, and the blocks
    per SM asked of the compiler (``occupancy``; None: its own choice); the programs per SM its split plan
    aims at (``plan_programs``: the chunk length is a run-time argument, so every plan of a form runs the same
    compiled kernel) and the shortest chunk it allows, in key tiles (``plan_min_tiles``; None: SPLIT_MIN_TILES);
    and whether a split step launches under programmatic dependent launch (``pdl``, decode.py's
    PDL; None: where the step splits, on Hopper and later). The tuner tries split steps both ways
    (``plan_candidates``)."""

    tile_n: int
    read: str = "pages"
    k_latency: int = 3
    v_latency: int = 3
    occupancy: int | None = None
    plan_programs: int = PROGRAMS_PER_SM
    plan_min_tiles: int | None = None
    pdl: bool | None = None

    def split_kernel(self, int64: bool):
        """The split kernel of this form: 64-bit cache offsets or not, with its occupancy hint."""
        hints = (("occupancy", self.occupancy),) if self.occupancy else ()
        return kernel_with_hints("paged_decode_split" + ("_int64" if int64 else ""), hints, module="decode")

    def fits(self, page_size: int) -> bool:
        """Rows take any page size; block loads take tiles that hold whole pages or lie within one; an
        indexed load takes whole pages."""
        if self.read == "rows":
            return True
        return self.tile_n % page_size == 0 or (self.read == "pages" and page_size % self.tile_n == 0)

    @property
    def gather(self) -> int:
        from impls.cutile import decode

        return {"rows": decode.ROWS, "pages": decode.PAGES, "indexed": decode.INDEXED}[self.read]

    def describe(self) -> dict:
        return asdict(self)


# Page loads of 64 and 128 keys over whole pages (H200: 3.9 TB/s against 1.4 for row gathers, which stay for page
# sizes no page form fits); two blocks per SM lift the 64-key load by 10-40%; 128-key loads issued 2 tiles ahead
# lead some 70B-slice steps. See docs/design.md#cutile-serving for the forms measured and left out.
DECODE_SPACE = [DecodeVariant(64, "pages", occupancy=2), DecodeVariant(64, "pages"), DecodeVariant(128, "pages"),
                DecodeVariant(128, "pages", k_latency=2, v_latency=2), DecodeVariant(128, "indexed")]
# A 128-key tile of a head dim of 64 holds the bytes of a 64-key tile of 128, whose pipeline fits twice on an SM
# (H200, GPT-2 64 x 8K: 3.94 TB/s against the space's best 2.83).
NARROW_HEAD_SPACE = [DecodeVariant(128, "pages", occupancy=2)]
NARROW_HEAD_DIM = 64  # head dims up to this (as tiles) add NARROW_HEAD_SPACE
ROWS_FALLBACK = DecodeVariant(64, "rows", 2, 2)
# The combine is a small reduction per row; left to itself the compiler gave it 255 registers and about two blocks
# per SM (H200: 54 us for a 70B slice at batch 256, Triton's combine 3.3). 16 blocks per SM give 31 registers.
COMBINE_OCCUPANCY = 16


def chunks_of(variant: DecodeVariant, inputs: PagedKV, sm_count: int,
              window_left: int = UNBOUNDED) -> tuple[int, int]:
    """(num_splits, split_len): how ``variant``'s split plan cuts what it reads of these caches
    (``impls._plans.split_plan``; a window's from the tile that holds its first position)."""
    return split_plan(inputs.read_lengths(window_left, variant.tile_n), inputs.k_cache.shape[2], variant.tile_n,
                      sm_count, min_tiles=variant.plan_min_tiles, programs_per_sm=variant.plan_programs)


def word_view_fits(k_cache: torch.Tensor, v_cache: torch.Tensor, width: int) -> bool:
    """Whether page loads can read these caches through 32-bit word views with 32-bit indexing (decode.py's
    WORD_PAGES): 16-bit elements, a head dim that fills the tile (no padded columns: the word view cannot
    pad half a word) and fewer than 2**31 words."""
    return all(c.element_size() == 2 and c.shape[-1] == width and c.is_contiguous() and c.numel() // 2 < 2**31
               for c in (k_cache, v_cache))


def cache_reading(k_cache: torch.Tensor, v_cache: torch.Tensor, width: int) -> tuple[bool, bool]:
    """How page loads read these caches: (they need 64-bit indexing, they are read through 32-bit word views
    instead). The one decision ``DecodeCall`` and ``decode_space_for`` share."""
    int64 = needs_int64(k_cache, v_cache)
    return int64, int64 and word_view_fits(k_cache, v_cache, width)


def cache_operands(variant: DecodeVariant, k_cache: torch.Tensor, v_cache: torch.Tensor, width: int
                   ) -> tuple[torch.Tensor, torch.Tensor, int, bool, str]:
    """The caches as ``variant``'s key tiles read them (``cache_reading``): (k, v, as passed to the kernel, its
    GATHER, whether it indexes them in 64 bits, how they are read, for the config). Page loads of caches that need
    64-bit offsets go through 32-bit word views where those fit."""
    gather, (int64, words) = variant.gather, cache_reading(k_cache, v_cache, width)
    if words and variant.read == "pages":
        from impls.cutile import decode

        return k_cache.view(torch.int32), v_cache.view(torch.int32), decode.WORD_PAGES, False, "32-bit word views"
    return k_cache, v_cache, gather, int64, "64-bit" if int64 else "32-bit"


class DecodeCall(Launches):
    """One decode step with ``variant``: the split launch, and the combine where a sequence has more than one
    chunk."""

    def __init__(self, variant: DecodeVariant, inputs: PagedKV, *, scale: float, sm_count: int,
                 window_left: int = UNBOUNDED, softcap: float = 0.0, f16_dot: bool | None = None) -> None:
        """``f16_dot``: the dots of bf16 queries over an fp8 cache in fp16 (decode.py's F16_DOT); by default
        wherever that applies (``impls._plans.fp16_dots``; False is the bf16 form, kept for
        scripts/serving_probe.py's comparison). Both launches run under programmatic dependent launch (decode.py's
        PDL) as the variant says (``DecodeVariant.pdl``)."""
        self.variant, self.out = variant, inputs.output_like()
        q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
        batch, sq, hq, head_dim = q.shape
        hkv = k_cache.shape[2]
        group, width = hq // hkv, tile_d(head_dim)
        tile_m = max(16, 1 << (group * sq - 1).bit_length())
        self.num_splits, self.split_len = chunks_of(variant, inputs, sm_count, window_left)
        split = self.num_splits > 1
        pdl = variant.pdl  # None: where the step splits, on Hopper and later
        self.dependent_launch = split and dependent_launch_available(q.device) if pdl is None else pdl
        parts = (batch * hkv, self.num_splits, tile_m) if split else (1, 1, 1)  # unused without a split
        self.part = torch.empty((*parts, width if split else 1), dtype=torch.float32, device=q.device)
        self.lse = torch.empty(parts, dtype=torch.float32, device=q.device)
        k_cache, v_cache, gather, int64, self.cache_indexing = cache_operands(variant, k_cache, v_cache, width)
        kernel = variant.split_kernel(int64)
        tiles = (group, sq, tile_m)
        self.launches = [((self.num_splits, *heads_by_batch(hkv, batch, "kv heads")), kernel, (
            q, k_cache, v_cache, inputs.block_table, inputs.cache_seqlens, self.part, self.lse, self.out,
            scale * inputs.k_scale, hkv, self.split_len, window_left, inputs.v_scale, *tiles, variant.tile_n, width,
            inputs.page_size, gather, split, variant.k_latency, variant.v_latency, window_left < UNBOUNDED, softcap,
            fp16_dots(inputs) if f16_dot is None else f16_dot, self.dependent_launch))]
        if split:
            slice_d, chunks = combine_plan(self.num_splits, width)
            combine = kernel_with_hints("paged_decode_combine", (("occupancy", COMBINE_OCCUPANCY),), module="decode")
            self.launches.append(((batch * hkv, group * sq, width // slice_d), combine, (
                self.part, self.lse, inputs.cache_seqlens, self.out, hkv, self.split_len, window_left, group, sq,
                slice_d, chunks, variant.tile_n, self.dependent_launch)))

    def prepared(self, **config) -> Prepared:
        return super().prepared(num_splits=self.num_splits, split_len=self.split_len,
                                cache_indexing=self.cache_indexing, PDL=self.dependent_launch, **config)


def decode_space(page_size: int, huge: bool = False, words: bool = False,
                 head_dim: int = 128) -> list[DecodeVariant]:
    """The candidates for this page size and head dim. ``huge``: a cache of 2**31 elements or more. Read through 32-bit
    word views (``words``: ``word_view_fits``), page loads keep 32-bit indexing and TMA, so the page-load forms
    are tried. Otherwise such a cache needs 64-bit offsets, where tiles of eight joined pages compiled for minutes,
    so only the smallest page-load tile is tried."""
    narrow = NARROW_HEAD_SPACE if tile_d(head_dim) <= NARROW_HEAD_DIM else []
    space = [variant for variant in DECODE_SPACE + narrow if variant.fits(page_size)]
    if huge:
        space = [variant for variant in space if variant.read == "pages" and (words or variant.tile_n == 64)]
    return space or [ROWS_FALLBACK]


def decode_space_for(inputs: PagedKV) -> list[DecodeVariant]:
    """``decode_space`` for these caches: their page size and head dim, and whether they need 64-bit indexing or
    fit word views (as ``DecodeCall`` will read them)."""
    huge, words = cache_reading(inputs.k_cache, inputs.v_cache, tile_d(inputs.head_dim))
    return decode_space(inputs.page_size, huge=huge, words=words, head_dim=inputs.head_dim)


PLAN_FIELDS = ("plan_programs", "plan_min_tiles", "pdl")  # a decode form's plan: made for each step


def form(config: dict) -> dict:
    """A decode config without its plan."""
    return {name: value for name, value in config.items() if name not in PLAN_FIELDS}


def plan_candidates(forms: list[DecodeVariant], inputs: PagedKV, *, scale: float, sm_count: int,
                    window_left: int = UNBOUNDED, softcap: float = 0.0) -> list[DecodeCall]:
    """The decode tuner's candidates: each kernel form with each aimed split plan (``AIMED_PLANS``, each with the
    shortest chunks of ``PLAN_MIN_TILES``), one call per form and chunk length (plans that cut the batch alike are
    timed once), and where that splits on a GPU that has programmatic dependent launch, with it and without
    (``DecodeVariant.pdl``). PDL gained 6-10% on short split steps but cost up to 13% on split steps of 256 programs
    at two a SM (H200, the 70B slice's 1 x 128K: 2534 -> 2243 GB/s), so the tuner decides."""
    distinct: dict[tuple, DecodeVariant] = {}
    for form in forms:
        for programs, min_tiles in itertools.product(AIMED_PLANS, PLAN_MIN_TILES):
            variant = replace(form, plan_programs=programs, plan_min_tiles=min_tiles)
            distinct.setdefault((form, chunks_of(variant, inputs, sm_count, window_left)), variant)
    both_ways = dependent_launch_available(inputs.q.device)
    variants = [replace(variant, pdl=pdl) for (_, (splits, _)), variant in distinct.items()
                for pdl in ((False, True) if both_ways and splits > 1 else (None,))]
    return [DecodeCall(variant, inputs, scale=scale, sm_count=sm_count, window_left=window_left, softcap=softcap)
            for variant in variants]


@register("cutile", op="paged", family="cutile", dtypes=HALF, devices=("cuda",), head_dims=DECODE_HEAD_DIMS,
          requires=requires, variants=("window", "softcap", "kv_fp8"),
          description="our cuTile split-KV decode: all query heads of a kv head in one tile (K/V read once), "
                      "pages gathered by row or loaded a page at a time, chunks merged by log-sum-exp (a sliding "
                      "window bounds what is read; an fp8 cache loaded as stored, widened after each load); "
                      "autotuned")
def prepare_paged(inputs: PagedKV, *, scale: float, window: tuple[int, int] = NO_WINDOW,
                  softcap: float = 0.0) -> Prepared:
    batch, sq, hq, _ = inputs.q.shape
    heads_by_batch(inputs.k_cache.shape[2], batch, "kv heads")  # refused before tuning: each has a grid axis
    window_left = inputs.window_left(window)
    rows = hq // inputs.k_cache.shape[2] * sq
    if rows > MAX_PACKED_ROWS:
        raise Unsupported(f"{hq // inputs.k_cache.shape[2]} query heads per kv head x {sq} new tokens = {rows} "
                          f"rows: this kernel packs at most {MAX_PACKED_ROWS} in one tile")
    sm_count = device_sm_count(inputs.q.device.index)

    def candidates(forms: list[DecodeVariant]) -> list[DecodeCall]:
        return plan_candidates(forms, inputs, scale=scale, sm_count=sm_count, window_left=window_left, softcap=softcap)

    def compiled() -> list[DecodeCall]:
        return compiled_candidates(candidates(decode_space_for(inputs)))

    def search() -> dict:
        return fastest((call.variant, call) for call in compiled()).describe()

    def first() -> dict:  # on a shared GPU: the first form's first plan, untimed
        return candidates(decode_space_for(inputs)[:1])[0].variant.describe()

    @functools.cache
    def forms() -> list[dict]:  # built once, and only where a shipped pick is looked at
        return [form(f.describe()) for f in decode_space_for(inputs)]

    def valid(config: dict) -> bool:  # a shipped pick's form is one of this step's (its plan is the step's own)
        return form(config) in forms()

    key = TUNING.key(inputs.q.device, decode_shape_class(inputs, window_left, softcap))
    picked = remembered(key, search, DecodeVariant, first, compiled, NEAR_DECODE, valid)
    return DecodeCall(picked.choice, inputs, scale=scale, sm_count=sm_count, window_left=window_left,
                      softcap=softcap).prepared(**picked.provenance())


VARLEN_STORES = ("plain", "tma")


def varlen_output_store() -> str:
    """How the varlen kernel stores its output, from FMHA_VARLEN_STORE: "plain" (the default), bounds-checked
    vector stores, or "tma", a tensor map of the sequence's rows that each block makes at run time. The default is
    plain because compute-sanitizer memcheck finds the write of that run-time tensor map outside every allocation
    on an H200 (its workspace is cuTile's, not ours to size); the plain store costs nothing on the tuner's picks."""
    store = os.environ.get("FMHA_VARLEN_STORE", VARLEN_STORES[0])
    if store not in VARLEN_STORES:
        raise ValueError(f"FMHA_VARLEN_STORE={store!r}: expected one of {', '.join(VARLEN_STORES)}")
    return store


class VarlenCall(Launches):
    """One packed prefill with a dense ``variant``: the kernel reads the packed tensors through (1, H, total, D)
    views. One block per query tile of the longest sequence and (sequence, head), or, persistent, one block per
    SM slot running the query tiles the host planned for it (``impls._plans.varlen_work_plan``, made here, so
    that a timed call only launches). ``window`` and ``softcap`` as the dense entry takes them, applied in each
    sequence. Construction touches no GPU where ``sm_count`` is given."""

    def __init__(self, variant: Variant, inputs: Varlen, *, scale: float, out: torch.Tensor | None = None,
                 sm_count: int | None = None, store: str | None = None, window: tuple[int, int] = NO_WINDOW,
                 softcap: float = 0.0) -> None:
        if variant.defer_pv:
            raise ValueError(f"{variant.label()}: defer_pv runs in the dense kernel only (its empty loop's drain reads "
                             "the tile past the keys, zeros in a dense array but the next sequence's rows in a "
                             "packed one)")
        self.variant = variant = varlen_resolved(variant, inputs, window)
        self.out = inputs.output_like() if out is None else out
        q, k, v, o = (t.transpose(0, 1)[None] for t in (inputs.q, inputs.k, inputs.v, self.out))
        heads = inputs.q.shape[1]
        bounds = window_bounds(window, inputs.causal)  # per sequence, bottom-right, as the dense kernel's
        # one call's constants, the diagonal's aside: the sequences' lengths differ (varlen_resolved decided it)
        constants = replace(variant, peel_diagonal=False).constants(
            head_dim=inputs.head_dim, causal=inputs.causal, kv_len=inputs.max_seqlen_k,
            itemsize=inputs.q.element_size(), value_dim=inputs.v.shape[-1],
            window=kernel_window(window, inputs.causal), softcap=softcap)
        constants["DIAGONAL_TILES"] = variant.peeled_tiles() if variant.peel_diagonal else 0
        self.store = store or varlen_output_store()
        self.plan = None
        if variant.persistent:
            slots = variant.resident_blocks(sm_count or device_sm_count(inputs.q.device.index))
            self.plan = varlen_work_plan(inputs.seqlens_q(), inputs.seqlens_k(), heads, variant.tile_m,
                                         variant.tile_n, inputs.causal, slots, bounds)
            grid = (self.plan.blocks, 1, 1)
            work = [torch.tensor(part, dtype=torch.int32, device=inputs.q.device)
                    for part in (self.plan.starts, self.plan.items or (0,))]  # no rows at all: nothing read
        else:
            grid = (-(-inputs.max_seqlen_q // variant.tile_m), *heads_by_batch(heads, inputs.batch))
            work = [inputs.cu_seqlens_q[:1]] * 2  # placeholders: the kernel reads them only when persistent
        kernel = variant.kernel(int64=needs_int64(inputs.q, inputs.k, inputs.v), base="fmha_varlen")
        self.launches = [(grid, kernel, bind(
            "fmha_varlen", Q=q, K=k, V=v, Out=o, CuSeqlensQ=inputs.cu_seqlens_q, CuSeqlensK=inputs.cu_seqlens_k,
            WorkStarts=work[0], WorkItems=work[1], qk_scale=scale, window_left=bounds[0], window_right=bounds[1],
            num_heads=heads, group=heads // inputs.k.shape[1],
            max_tiles=self.plan.max_tiles if self.plan else 0, OUT_TMA=self.store == "tma", **constants))]

    def schedule(self) -> dict:
        """How the work is shared and the output stored, for the benchmark's config."""
        share = ("one block per query tile" if self.plan is None
                 else f"host plan: {len(self.plan.items)} query tiles over {self.plan.blocks} blocks")
        return {"schedule": share, "output_store": self.store}


def varlen_space(capability: tuple[int, int], head_dim: int, causal: bool, window: bool = False) -> list[Variant]:
    """The dense search space's forms with one block per query tile, and its persistent forms with a fixed
    share, which here run the host's plan (``varlen_work_plan``: its own order and balance, so the dense share's
    ``paired``, ``planned`` and ``dynamic`` flags mean nothing here and are dropped: a planned twin is its paired
    candidate again). Not the two-launch forms, nor the deferred
    P V (``Variant.defer_pv``: dense only). The peeled forms stay (a packed batch runs them where
    ``varlen_resolved`` keeps their peel), the 128x256 one, its diagonal peeled in 128-key tiles, only with a
    window (H100: 10% ahead on Mistral-7B's windowed 64K, 3-12% slower on most batches without a window)."""
    space = []
    for variant in search_space(capability, head_dim, causal=causal, window=window):
        if variant.two_launch or variant.dynamic or variant.defer_pv or (
                variant.peel_diagonal and variant.tile_n > variant.tile_m and not window):
            continue
        planned = replace(variant, paired=False, planned=False)
        if planned not in space:
            space.append(planned)
    return space


def varlen_resolved(variant: Variant, inputs: Varlen, window: tuple[int, int] = NO_WINDOW) -> Variant:
    """The form a packed batch runs: a peeled diagonal kept where every sequence's would be peeled in a dense call
    of its offset (keys less queries) and whole query tiles (``Variant.peel_refusal``), else the masked loop. A
    sequence's ragged last query tile needs no mask past the causal one: none of its rows sees a key past the
    sequence's end, and the rows past its end are never stored."""
    if not variant.peel_diagonal:
        return variant
    whole = variant.tile_m  # a stand-in query length of whole tiles
    kernel_bounds = kernel_window(window, inputs.causal)
    for offset in sorted({k - q for q, k in zip(inputs.seqlens_q(), inputs.seqlens_k(), strict=True)}):
        if variant.peel_refusal(causal=inputs.causal, q_len=whole, kv_len=whole + offset, window=kernel_bounds):
            return replace(variant, peel_diagonal=False)
    return variant


def varlen_candidates(capability: tuple[int, int], inputs: Varlen, window: tuple[int, int] = NO_WINDOW
                      ) -> list[Variant]:
    """``varlen_space`` as this packed batch runs it (``varlen_resolved``; a peel it refuses is then its twin's
    double, kept once)."""
    space = varlen_space(capability, inputs.head_dim, inputs.causal, window=window != NO_WINDOW)
    return list(dict.fromkeys(varlen_resolved(variant, inputs, window) for variant in space))


@register("cutile", op="varlen", family="cutile", dtypes=HALF, devices=("cuda",), head_dims=HEAD_DIMS,
          requires=requires, variants=("window", "softcap"),
          description="our cuTile kernel on each packed sequence (read at its row offset in the packed tensors), "
                      "one block per query tile or persistent blocks on a host plan (heaviest work first, mirror "
                      "pairs of causal tiles; a sliding window's unseen key tiles are never visited), autotuned")
def prepare_varlen(inputs: Varlen, *, scale: float, window: tuple[int, int] = NO_WINDOW,
                   softcap: float = 0.0) -> Prepared:
    heads, head_dim, store = inputs.q.shape[1], inputs.head_dim, varlen_output_store()
    heads_by_batch(heads, inputs.batch)  # refused before tuning: the one-block-per-tile candidates' grid axes
    window = inputs.binding_window(window)
    variants = {"window": window, "softcap": softcap}
    space = varlen_candidates(torch.cuda.get_device_capability(inputs.q.device), inputs, window)
    shape = ("varlen", inputs.q.dtype, head_dim, inputs.causal, heads // inputs.k.shape[1],
             length_class(inputs.max_seqlen_q), length_class(inputs.max_seqlen_k), parallel_class(inputs.batch * heads),
             store,  # picks made with one output store are not reused with the other
             *variant_tags(window != NO_WINDOW, softcap),
             *("peeled",) * any(v.peel_diagonal for v in space))  # batches that can peel tune apart
    out = inputs.output_like()
    picked = tuned(shape, inputs.q.device, space, lambda candidate: VarlenCall(
        candidate, inputs, scale=scale, out=out, store=store, **variants))
    call = VarlenCall(picked.choice, inputs, scale=scale, store=store, **variants)
    return call.prepared(**picked.provenance(), tuner=dense_tuner(), **call.schedule())
