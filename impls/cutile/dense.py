"""Registers our cuTile dense entries: the blog's ladder, one fixed ``Variant`` each, and ``cutile``, autotuned."""

from __future__ import annotations

from impls._plans import decode_route
from impls._registry import HALF, Prepared, heads_by_batch, register
from impls.contract import binding_window
from impls.cutile.config import HEAD_DIMS, Variant
from impls.cutile.launch import Call, requires
from impls.cutile.spaces import LADDER, LADDER_HEAD_DIMS
from impls.cutile.tuner import TUNING, tune
from impls.tuning import dense_tuner


def _prepare_fixed(variant: Variant):
    def prepare(q, k, v, *, causal: bool, scale: float) -> Prepared:
        return Call(variant, q, k, v, causal=causal, scale=scale).prepared()

    return prepare


for _name, (_variant, _what) in LADDER.items():
    register(_name, family="cutile", dtypes=HALF, devices=("cuda",), head_dims=LADDER_HEAD_DIMS,
             requires=requires, description=_what, presets=("ladder",))(_prepare_fixed(_variant))

@register("cutile", family="cutile", dtypes=HALF, devices=("cuda",), head_dims=HEAD_DIMS, requires=requires,
          variants=("window", "softcap", "value_dim"),
          description="our cuTile kernel, all optimisations, tile shape and occupancy autotuned; decode steps (up to "
                      "16 new tokens) through our split-KV decode over the cache as pages where that is faster")
def prepare_tuned(q, k, v, *, causal: bool, scale: float, **variants) -> Prepared:
    """``variants``: a sliding window (key tiles outside it are never visited) and softcap, as they come; v may
    have a head dim of its own (MLA), padded like the query/key one. A decode shape runs the split-KV decode
    where that is faster (``impls._plans.decode_route``). More sequences or heads than CUDA's cap on a
    grid axis are refused before tuning: the one-block-per-tile candidates give each an axis."""
    def dense() -> Prepared:
        heads_by_batch(q.shape[1], q.shape[0])
        dense_variants = dict(variants)
        if "window" in variants:  # one that hides no key runs as no window: no masked loop before the free tiles
            dense_variants["window"] = binding_window(variants["window"], causal, q.shape[2], k.shape[2])
        picked = tune(q, k, v, causal=causal, scale=scale, **dense_variants)
        return Call(picked.choice, q, k, v, causal=causal, scale=scale, **dense_variants).prepared(
            **picked.provenance(), tuner=dense_tuner())

    return decode_route("cutile", q, k, v, causal=causal, scale=scale, dense=dense, tuning=TUNING, **variants)
