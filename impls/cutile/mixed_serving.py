"""Our cuTile mixed prefill and decode (``mixed.py``'s kernel), registered as ``cutile``'s ``mixed`` entry: one fixed
form, one launch a step from the host's work list (``impls._plans.mixed_work``), its arguments made once so that the
timed call only launches. Construction touches no GPU, so the CPU tests compile the very launch a GPU would run
(``export.export_launch``) and emulate it (tests/cutile_emulator.py)."""

from __future__ import annotations

from dataclasses import dataclass

from impls._plans import mixed_work
from impls._registry import HALF, Prepared, Unsupported, register
from impls.contract import MixedBatch
from impls.cutile.config import kernel_with_hints, tile_d
from impls.cutile.launch import Launches, requires
from impls.cutile.serving import DECODE_HEAD_DIMS, ROWS_FALLBACK, DecodeVariant, cache_operands, form


@dataclass(frozen=True)
class MixedForm:
    """The kernel's one form: the query rows of a tile (TILE_M: new tokens x query heads of a kv head) and how its
    key tiles are read (a paged decode form; its split plan does not apply here)."""

    tile_m: int
    keys: DecodeVariant

    def describe(self) -> dict:
        return {"tile_m": self.tile_m, **form(self.keys.describe())}


# Fixed tiles, no tuner yet (docs/design.md#mixed-batches). 64 rows is one warpgroup's matrix instruction: a prefill
# tile keeps a 64-row tile's arithmetic intensity, and a decode row's unused rows of a dot hide behind reading its
# K/V. Keys as the paged decode's lead form, 64-key page loads with two blocks a SM asked, issued 4 / 4 tiles ahead
# (the decode's 3 / 3 within 1% of it; here 3 / 3 gave SASS that no nvdisasm up to 13.5 reads). Compiled for sm_90
# (tileiras 13.4) at D 64-128 and groups 4-12: 128 registers, 83-91 KB of shared memory, no stack; at D 256 the
# compiler keeps one block a SM (168 registers, no stack). A group wider than the tile is refused: a 128-row tile
# spilled 352-904 B in every key form.
MIXED_ROWS = 64
KEY_FORM = DecodeVariant(64, "pages", k_latency=4, v_latency=4, occupancy=2)


def mixed_form(page_size: int) -> MixedForm:
    """The fixed form for this page size: row gathers where no page load fits it (``DecodeVariant.fits``)."""
    return MixedForm(MIXED_ROWS, KEY_FORM if KEY_FORM.fits(page_size) else ROWS_FALLBACK)


class MixedCall(Launches):
    """One mixed step: the work list and the one launch over it. A group wider than the form's tile is refused."""

    def __init__(self, inputs: MixedBatch, *, scale: float, variant: MixedForm | None = None) -> None:
        q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
        hq, head_dim = q.shape[1:]
        hkv = k_cache.shape[2]
        group, width = hq // hkv, tile_d(head_dim)
        self.variant = variant = variant or mixed_form(inputs.page_size)
        if group > variant.tile_m:
            raise Unsupported(f"{group} query heads per kv head: this kernel packs a decode row's query heads in one "
                              f"tile of at most {variant.tile_m} rows")
        self.tokens = variant.tile_m // group  # new tokens a tile
        self.work = mixed_work(inputs, self.tokens)
        self.out = inputs.output_like()
        keys = variant.keys
        k_cache, v_cache, gather, int64, self.cache_indexing = cache_operands(keys, k_cache, v_cache, width)
        hints = (("occupancy", keys.occupancy),) if keys.occupancy else ()
        kernel = kernel_with_hints("mixed_attention" + ("_int64" if int64 else ""), hints, module="mixed")
        self.launches = [((self.work.shape[0] * hkv, 1, 1), kernel, (
            q, k_cache, v_cache, inputs.block_table, inputs.cache_seqlens, inputs.cu_seqlens_q, self.work, self.out,
            scale, hkv, group, self.tokens, variant.tile_m, keys.tile_n, width, inputs.page_size, gather,
            keys.k_latency, keys.v_latency))]

    def prepared(self, **config) -> Prepared:
        return super().prepared(tokens_per_tile=self.tokens, work_items=self.work.shape[0],
                                cache_indexing=self.cache_indexing, **config)


@register("cutile", op="mixed", family="cutile", dtypes=HALF, devices=("cuda",), head_dims=DECODE_HEAD_DIMS,
          requires=requires,
          description="our cuTile mixed-batch kernel: one launch for decoding sequences and prefill chunks, a block "
                      "per (tile of a sequence's new tokens, kv head) from a host-built work list, query heads of a "
                      "kv head packed in one tile, pages read by the paged decode's block loads; one fixed config")
def prepare_mixed(inputs: MixedBatch, *, scale: float) -> Prepared:
    return MixedCall(inputs, scale=scale).prepared(chosen="fixed")
