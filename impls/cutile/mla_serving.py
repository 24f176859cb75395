"""Our cuTile MLA decode (``mla.py``'s kernel, then the paged decode's combine), registered as ``cutile``'s ``mla``
entry: one fixed form, its launches' arguments made once so that the timed call only launches. Construction
touches no GPU where the SM count is given, so the CPU tests compile the very launches a GPU would run
(``export.export_launch``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from impls._plans import PROGRAMS_PER_SM, combine_plan, split_plan, split_work_list
from impls._registry import HALF, Prepared, Unsupported, register
from impls.contract import UNBOUNDED, MLADecode
from impls.cutile.config import device_sm_count, kernel_with_hints, needs_int64, tile_d
from impls.cutile.launch import Launches, requires
from impls.cutile.serving import COMBINE_OCCUPANCY


@dataclass(frozen=True)
class MLAVariant:
    """The kernel's one form: key tile width, how a tile is read from the pages (``read``: "pages" or "rows", the
    kernel's GATHER), how far ahead its loads are issued, the programs per SM its split plan aims at, and the
    compiler's worker warps (``num_worker_warps``)."""

    tile_n: int = 64
    read: str = "pages"
    latency: int = 2
    plan_programs: int = PROGRAMS_PER_SM
    worker_warps: int = 8

    def fits(self, page_size: int) -> bool:
        """Block loads take tiles that hold whole pages or lie within one."""
        return self.read == "rows" or self.tile_n % page_size == 0 or page_size % self.tile_n == 0

    def describe(self) -> dict:
        return asdict(self)


# One fixed form until a tuner. 64 keys a tile: the rows of a warpgroup MMA with the keys as the products' rows
# (mla.py's docstring, 3), a page of 64 a load, on TMA; 8 worker warps, two warpgroups, hold the 512 x rows fp32
# accumulator. Compiled for sm_90 at 512 + 64 (cuda-tile 1.7.0, tileiras 13.4) this is the one form measured with
# no stack at 16 and 32 rows, bf16 and fp8 (docs/design.md, "MLA decode": 32 keys or 4 worker warps spill). Row
# gathers only where no block load fits the page size (H200, paged decode: 1.4 TB/s at most), in 32-key tiles over 4
# worker warps: gathered through registers the tile is not on HGMMA whole, and 64 keys or 8 warps spilled more.
MLA_FORM = MLAVariant()
ROWS_FORM = MLAVariant(tile_n=32, read="rows", worker_warps=4)
# Query heads x new tokens in one tile, the products' columns: DeepSeek-V3's 16 heads per GPU of 8 with a draft
# token. More rows are refused (not compiled: 64 would double the accumulator).
MAX_ROWS = 32


class MLACall(Launches):
    """One MLA decode step with ``variant``: the split launch, a block per chunk that holds keys (``work``, longest
    first), and the paged decode's combine where a sequence has more than one chunk. Construction touches no GPU
    (``sm_count`` is given), so CPU tests compile its launches."""

    def __init__(self, variant: MLAVariant, inputs: MLADecode, *, scale: float, sm_count: int) -> None:
        self.variant, self.out = variant, inputs.output_like()
        batch, sq, heads, _ = inputs.q_nope.shape
        rows, tile_l, tile_r = heads * sq, tile_d(inputs.latent_dim), tile_d(inputs.rope_dim)
        tile_m = max(16, 1 << (rows - 1).bit_length())
        self.num_splits, self.split_len = split_plan(inputs.seqlens, 1, variant.tile_n, sm_count,
                                                     programs_per_sm=variant.plan_programs)
        split = self.num_splits > 1
        device = inputs.q.device
        # (sequence, chunk) of each block, built once as a server builds its step's metadata
        self.work = torch.tensor(split_work_list(inputs.seqlens, self.split_len), dtype=torch.int32).to(device)
        parts = (batch, self.num_splits, tile_m) if split else (1, 1, 1)  # unused without a split
        self.part = torch.empty((*parts, tile_l if split else 1), dtype=torch.float32, device=device)
        self.lse = torch.empty(parts, dtype=torch.float32, device=device)
        int64 = needs_int64(inputs.ckv, inputs.kpe)
        self.cache_indexing = "64-bit" if int64 else "32-bit"
        kernel = kernel_with_hints("mla_decode_split" + ("_int64" if int64 else ""),
                                   (("num_worker_warps", variant.worker_warps),), module="mla")
        from impls.cutile import mla  # after kernel_with_hints: the toolchain is set before cuTile is imported

        gather = mla.PAGES if variant.read == "pages" else mla.ROWS
        kv_scale = float(inputs.kv_scale)  # folded into the score scale; multiplies the output once
        self.launches = [((self.work.shape[0], 1, 1), kernel, (
            inputs.q_nope, inputs.q_pe, inputs.ckv, inputs.kpe, inputs.block_table, inputs.cache_seqlens, self.work,
            self.part, self.lse, self.out, scale * kv_scale, kv_scale, self.split_len, heads, sq, tile_m,
            variant.tile_n, tile_l, tile_r, inputs.page_size, gather, split, variant.latency))]
        if split:  # the paged decode's combine: the heads are one kv head's GROUP, nothing windowed
            slice_l, chunks = combine_plan(self.num_splits, tile_l)
            combine = kernel_with_hints("paged_decode_combine", (("occupancy", COMBINE_OCCUPANCY),), module="decode")
            self.launches.append(((batch, rows, tile_l // slice_l), combine, (
                self.part, self.lse, inputs.cache_seqlens, self.out, 1, self.split_len, UNBOUNDED, heads, sq,
                slice_l, chunks, variant.tile_n, False)))

    def prepared(self, **config) -> Prepared:
        return super().prepared(num_splits=self.num_splits, split_len=self.split_len, work_items=self.work.shape[0],
                                cache_indexing=self.cache_indexing, **config)


def mla_form(page_size: int) -> MLAVariant:
    """The fixed form for this page size: block loads where they fit it, else row gathers."""
    return MLA_FORM if MLA_FORM.fits(page_size) else ROWS_FORM


@register("cutile", op="mla", family="cutile", dtypes=HALF, devices=("cuda",), requires=requires,
          variants=("kv_fp8",),
          description="our cuTile split-KV MLA decode: all query heads of a sequence in one tile over its latent "
                      "head, each latent row loaded once for the scores and the values, pages read by block loads, "
                      "chunks merged by log-sum-exp (an fp8 cache widened after each load); one fixed config")
def prepare_mla(inputs: MLADecode, *, scale: float) -> Prepared:
    _, sq, heads, _ = inputs.q_nope.shape
    if heads * sq > MAX_ROWS:
        raise Unsupported(f"{heads} query heads x {sq} new tokens = {heads * sq} rows: this kernel packs at most "
                          f"{MAX_ROWS} in one tile")
    call = MLACall(mla_form(inputs.page_size), inputs, scale=scale, sm_count=device_sm_count(inputs.q.device.index))
    return call.prepared(chosen="fixed")
