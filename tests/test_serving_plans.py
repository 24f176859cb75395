"""The serving work plans (``impls/_plans.py``) and the dense decode route.

Split-KV chunks for decode (filling the GPU, fitted to the resident programs), the varlen work plan's balance and
its query tiles' costs, the combine's slices; a dense decode step seen as pages of its own memory, run by the
split-KV decode or the dense kernel, whichever is faster, chosen once per shape class.
"""

import itertools

import pytest
import torch

import impls
from impls import Prepared
from impls.contract import UNBOUNDED
from suite.checks import Oracle
from suite.presets import UNEVEN_VARLEN, preset
from tests.tiers import first_fast


def test_split_plan_fills_the_gpu_and_balances_long_tails():
    from impls._plans import split_plan

    splits, length = split_plan([131072], kv_heads=8, block_n=64, sm_count=132)
    assert splits * length >= 131072 and length % 64 == 0 and splits * 8 >= 4 * 132 // 2
    assert split_plan([512] * 256, kv_heads=8, block_n=64, sm_count=132) == (1, 512)  # enough programs already
    splits, length = split_plan([32768] + [1000] * 15, kv_heads=8, block_n=64, sm_count=132)
    assert splits > 8 and length < 32768 // 8  # the long sequence is cut finely
    assert split_plan([8192] * 64, kv_heads=8, block_n=128, sm_count=132) == (1, 8192)  # no sliver of 2 tiles
    splits, length = split_plan([32768] * 16, kv_heads=8, block_n=128, sm_count=132)
    assert splits > 1 and 0 <= splits * length - 32768 < splits * 128  # equal chunks, no sliver


def test_short_steps_get_one_tile_chunks_among_the_tuners_plans():
    """A short step (the 70B slice at 1 x 512: 16 tiles of 32 keys for 132 SMs) splits into chunks of SPLIT_MIN_TILES
    at the most, 4 of them; the plans of one-tile chunks (PLAN_MIN_TILES) cut it into 16, one dependent chain of
    loads a program. Both tuners try both; a batch that fills the GPU cuts alike either way."""
    from impls._plans import PLAN_MIN_TILES, SPLIT_MIN_TILES, split_plan
    from impls.triton_fa.paged import DECODE_SPACE, LAUNCH_KEYS

    assert split_plan([512], 1, 32, 132, programs_per_sm=2) == (512 // 32 // SPLIT_MIN_TILES, 32 * SPLIT_MIN_TILES)
    assert split_plan([512], 1, 32, 132, min_tiles=1, programs_per_sm=2) == (16, 32)
    assert split_plan([8192] * 64, 8, 128, 132, min_tiles=1) == split_plan([8192] * 64, 8, 128, 132)
    assert "PLAN_MIN_TILES" in LAUNCH_KEYS  # a launch setting: every plan of a config runs one compiled kernel
    plans = {tuple(config[key] for key in LAUNCH_KEYS if key != "PDL") for config in DECODE_SPACE}
    assert {config["PLAN_MIN_TILES"] for config in DECODE_SPACE} == set(PLAN_MIN_TILES)
    assert len(plans) % len(PLAN_MIN_TILES) == 0  # each plan with each floor


@pytest.mark.parametrize(("lengths", "kv_heads", "slots_per_sm"), [
    ([32768] * 64, 1, 1), ([32768] * 64, 1, 2), ([32768] * 16, 1, 1), ([32768] + [1000] * 15, 8, 4),
    ([8192] * 256, 1, 1), ([300, 4000, 17, 1024], 8, 2), ([512] * 256, 8, 4)])
def test_fitted_split_plan_is_the_shortest_chunk_whose_programs_fit_at_once(lengths, kv_heads, slots_per_sm):
    from impls._plans import SPLIT_MIN_TILES, split_plan

    block_n, sm_count = 64, 132
    splits, length = split_plan(lengths, kv_heads, block_n, sm_count, programs_per_sm=slots_per_sm, fit=True)
    tiles = [-(-n // block_n) for n in lengths]
    chunk = length // block_n

    def programs(c: int) -> int:
        return kv_heads * sum(-(-t // c) for t in tiles)

    assert length % block_n == 0 and splits == -(-max(tiles) // chunk)
    slots = slots_per_sm * sm_count
    if chunk < max(tiles):  # split: every program fits at once, and a chunk one tile shorter would not
        assert programs(chunk) <= slots and chunk >= SPLIT_MIN_TILES
        assert chunk == SPLIT_MIN_TILES or programs(chunk - 1) > slots
    else:  # whole sequences: one chunk shorter was too many programs (or the sequences are that short)
        assert programs(chunk) > slots or chunk <= SPLIT_MIN_TILES or programs(chunk - 1) > slots


@pytest.mark.parametrize(("lengths_q", "lengths_k", "causal"), [
    *UNEVEN_VARLEN, ([4096] * 4, [4096] * 4, True), ([300, 4000, 17, 1024], [300, 4000, 17, 1024], True),
    ([512, 1000], [512, 1000], False)])
@pytest.mark.parametrize("slots", [1, 7, 132])
def test_varlen_work_plan_runs_every_query_tile_once_and_balances_the_blocks(lengths_q, lengths_k, causal, slots):
    from impls._plans import query_tile_cost, varlen_work_plan

    heads, tile_m, tile_n = 3, 128, 64
    plan = varlen_work_plan(lengths_q, lengths_k, heads, tile_m, tile_n, causal, slots)
    expected = {(b, t, h) for b, n in enumerate(lengths_q) for t in range(-(-n // tile_m)) for h in range(heads)}
    decoded = [plan.decode(item) for item in plan.items]
    assert sorted(decoded) == sorted(expected)  # every tile with query rows, once; none past a sequence's end
    assert plan.starts[0] == 0 and plan.starts[-1] == len(plan.items) and 1 <= plan.blocks <= slots
    assert all(a <= b for a, b in itertools.pairwise(plan.starts))

    def cost(item):
        b, t, _ = plan.decode(item)
        return query_tile_cost(t, lengths_q[b], lengths_k[b], tile_m, tile_n, causal)

    loads = [sum(map(cost, plan.items[a:b])) for a, b in itertools.pairwise(plan.starts)]
    heaviest_unit = 2 * max(map(cost, plan.items), default=0)  # a causal unit is a pair of tiles
    assert max(loads) - min(loads) <= heaviest_unit  # longest processing time first: within one unit


@pytest.mark.parametrize(("len_q", "len_k", "causal", "window"), [
    (1000, 1000, True, (UNBOUNDED, 0)), (1000, 1000, True, (300, 0)), (700, 1000, True, (128, 0)),
    (1000, 1000, False, (300, 200)), (300, 1000, False, (UNBOUNDED, 50)), (1000, 1000, False, (UNBOUNDED,) * 2)])
def test_query_tile_cost_counts_the_key_tiles_the_tiles_rows_see(len_q, len_k, causal, window):
    # Against a row-by-row count: the key tiles from the first one some row of the query tile sees to the last
    # (its rows past the sequence's end included, as the kernel's key_tiles counts them), plus the overhead.
    from impls._plans import PLAN_ITEM_OVERHEAD_TILES, query_tile_cost

    tile_m, tile_n = 128, 64
    left, right = window
    for tile in range(-(-len_q // tile_m)):
        seen = [key for row in range(tile * tile_m, (tile + 1) * tile_m) for key in range(len_k)
                if row + len_k - len_q - left <= key <= row + len_k - len_q + (0 if causal else right)]
        tiles = seen[-1] // tile_n - seen[0] // tile_n + 1 if seen else 0
        assert query_tile_cost(tile, len_q, len_k, tile_m, tile_n, causal, window) == tiles + PLAN_ITEM_OVERHEAD_TILES


def test_varlen_work_plan_pairs_mirror_tiles_as_the_dense_kernel_does():
    from impls._plans import varlen_work_plan

    plan = varlen_work_plan([1024] * 2, [1024] * 2, 2, 128, 128, True, 4)  # 8 tiles a head: 4 mirror pairs
    block0 = [plan.decode(item) for item in plan.items[plan.starts[0]:plan.starts[1]]]
    assert block0[:2] == [(0, 7, 0), (0, 0, 0)]  # heaviest tile, then the lightest of the same head
    assert len(plan.items) == 2 * 2 * 8 and plan.blocks == 4
    assert {plan.starts[b + 1] - plan.starts[b] for b in range(4)} == {8}  # 16 equal pairs over 4 blocks


def test_varlen_work_plan_fills_the_last_round_that_equal_pairs_leave_part_empty():
    """GPT-2 1 x 32K as the dense kernel's planned share runs it: 12 heads of 128 query tiles of 256 rows, 768 equal
    mirror pairs on 132 blocks. Whole pairs give the busiest block 6 where the mean is 5.82 (3% of the launch
    idle); the trailing pairs split into their tiles fill that round, and the rest stay pairs."""
    from impls._plans import longest_first, query_tile_cost, varlen_work_plan

    heads, length, tile_m, tile_n, blocks = 12, 32768, 256, 64, 132
    plan = varlen_work_plan([length], [length], heads, tile_m, tile_n, True, blocks)

    def cost(item):
        return query_tile_cost(plan.decode(item)[1], length, length, tile_m, tile_n, True)

    loads = [sum(map(cost, plan.items[a:b])) for a, b in itertools.pairwise(plan.starts)]
    tiles = length // tile_m
    pairs = [[(cost(t * heads + h), t * heads + h) for t in (tiles - 1 - i, i)]
             for h in range(heads) for i in range(tiles // 2)]
    whole_pairs, _ = longest_first(pairs, blocks)
    mean = sum(loads) / blocks
    assert whole_pairs > 1.03 * mean and max(loads) < 1.005 * mean
    first = [plan.decode(item) for item in plan.items[plan.starts[0]:plan.starts[1]]]
    assert first[:2] == [(0, tiles - 1, 0), (0, 0, 0)]  # the first head's pairs stay pairs, heavy tile first


def test_combine_plan_merges_many_chunks_in_one_step():
    from impls._plans import COMBINE_STEP_ELEMENTS, combine_plan

    assert combine_plan(1, 128) == (128, 1) and combine_plan(5, 128) == (128, 8)  # few chunks: whole rows
    tile_d, chunks = combine_plan(256, 128)  # batch 1, 128K: a row's 256 chunks in one step, 8 blocks a row
    assert chunks == 256 and tile_d * chunks <= COMBINE_STEP_ELEMENTS and 128 % tile_d == 0
    tile_d, chunks = combine_plan(1000, 64)  # beyond one step at the narrowest slice: the loop takes the rest
    assert tile_d == 16 and chunks * tile_d == COMBINE_STEP_ELEMENTS


def test_split_work_list_holds_each_chunk_with_keys_once_full_chunks_first():
    """The programs of a split decode: exactly the (sequence, chunk) pairs whose chunk holds keys, the ones the
    combine merges, those with the most keys first; a sequence of no keys keeps its chunk 0 (its zeros, unsplit)."""
    from impls._plans import chunk_keys, split_plan, split_work_list

    lengths = [700, 1, 0, 256, 257, 5]
    items = split_work_list(lengths, 256)
    assert sorted(items) == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (3, 0), (4, 0), (4, 1), (5, 0)]
    keys = [chunk_keys(lengths[seq], 256)[chunk] if lengths[seq] else 0 for seq, chunk in items]
    assert keys == sorted(keys, reverse=True) and keys[:4] == [256] * 4 and items[-1] == (2, 0)
    assert [len(chunk_keys(n, 256)) for n in lengths] == [-(-n // 256) for n in lengths]  # the combine's count
    assert split_work_list([300, 20], 320) == [(0, 0), (1, 0)]  # unsplit: a program a sequence, longest first
    # The `mla` preset's long-tailed batch (64 sequences, 1-8192 keys) on 132 SMs: 26 chunks of 320 keys, 1,664
    # programs as a grid of (chunk, sequence), of which 504 hold keys.
    longtail = next(c for c in preset("mla") if c.lengths == "longtail").seqlens()
    splits, split_len = split_plan(longtail, 1, 64, 132)
    assert (splits, split_len, len(longtail)) == (26, 320, 64)
    assert len(split_work_list(longtail, split_len)) == sum(-(-n // split_len) for n in longtail) == 504


def dense_decode(batch=2, hq=8, hkv=2, sq=1, skv=256, layout="bhsd", dtype=torch.float16):
    """A dense decode step's q, k, v: k and v in the contract's (B, Hkv, Skv, D) or as flash-attn keeps them,
    (B, Skv, Hkv, D) seen through a transpose."""
    gen = torch.Generator().manual_seed(sq * 1000 + skv)
    q = torch.randn(batch, hq, sq, 64, generator=gen).to(dtype)
    shape = (batch, hkv, skv, 64) if layout == "bhsd" else (batch, skv, hkv, 64)
    k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    return (q, k, v) if layout == "bhsd" else (q, k.transpose(1, 2), v.transpose(1, 2))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize(("sq", "skv", "page"), [(1, 256, 256), (4, 192, 64), (16, 48, 16), (1, 300, 300)])
def test_a_dense_decode_step_is_seen_as_pages_of_the_same_memory(layout, sq, skv, page):
    """Each sequence's pages hold its own rows in order, for both layouts: the view gathers back to the dense
    cache exactly, and nothing was copied."""
    from impls._plans import dense_as_paged
    from impls.contract import gather_sequence

    q, k, v = dense_decode(batch=3, sq=sq, skv=skv, layout=layout)
    inputs = dense_as_paged(q, k, v, causal=True)
    assert inputs.page_size == page and inputs.seqlens == (skv,) * 3
    assert inputs.k_cache.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert torch.equal(inputs.q, q.transpose(1, 2))
    for b in range(3):
        k_b, v_b = gather_sequence(inputs, b)
        assert torch.equal(k_b, k[b]) and torch.equal(v_b, v[b])


@pytest.mark.parametrize(("shape", "causal", "change"), [
    ({"sq": 17, "skv": 256}, True, None),  # more new tokens than decode takes
    ({"sq": 4, "skv": 256}, False, None),  # several queries that see the whole cache: not a decode step
    ({"sq": 1, "skv": 1}, True, None),  # no cache before the new token
    ({"sq": 1, "skv": 256}, True, lambda k, v: (k, v.transpose(2, 3).contiguous().transpose(2, 3))),  # apart
    # the first 250 rows of a longer buffer: its sequences start 2 x 260 rows apart, no whole number of pages of 250
    ({"sq": 1, "skv": 260}, True, lambda k, v: (k[:, :, :250], v[:, :, :250])),
])
def test_dense_calls_that_are_not_decode_steps_are_not_seen_as_pages(shape, causal, change):
    from impls._plans import dense_as_paged

    q, k, v = dense_decode(**shape)
    if change:
        k, v = change(k, v)
    assert dense_as_paged(q, k, v, causal) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the dense route: CPU")
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize(("sq", "skv", "causal", "variants"), first_fast([
    (1, 256, False, {}), (4, 192, True, {}), (1, 512, True, {"window": (100, 0), "softcap": 30.0}),
    (3, 130, True, {})], unpack=True))  # 130 rows: one page a sequence
def test_triton_runs_a_dense_decode_step_as_split_kv_decode(layout, sq, skv, causal, variants, monkeypatch):
    """The dense ``triton`` entry hands a decode step to its split-KV decode (the config says so), whose output,
    in the dense layout, passes the float64 oracle; FMHA_DENSE_DECODE=0 keeps the dense kernel."""
    pytest.importorskip("triton")
    from impls._plans import DENSE_DECODE_ENV

    q, k, v = dense_decode(sq=sq, skv=skv, layout=layout)
    oracle = Oracle.dense(q, k, v, causal=causal, **variants)
    prepared = impls.get("triton").prepare(q, k, v, causal=causal, **variants)
    assert prepared.config["route"].startswith("split-KV decode") and "num_splits" in prepared.config
    out = prepared()
    assert out.shape == q.shape and out.is_contiguous()
    result = oracle.check(out)
    assert result.passed, result.message
    monkeypatch.setenv(DENSE_DECODE_ENV, "0")
    assert "route" not in impls.get("triton").prepare(q, k, v, causal=causal, **variants).config


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the dense route: CPU")
def test_a_decode_step_the_decode_kernel_refuses_runs_the_dense_kernel_and_says_why():
    """128 query heads of one kv head x 2 new tokens are more rows than the decode kernel packs: the dense kernel
    runs the step, correctly, and its config records why the decode did not."""
    pytest.importorskip("triton")
    q, k, v = dense_decode(batch=1, hq=128, hkv=1, sq=2, skv=32)
    prepared = impls.get("triton").prepare(q, k, v, causal=True)
    assert "route" not in prepared.config and "256 rows" in prepared.config["decode_route"]
    result = Oracle.dense(q, k, v, causal=True).check(prepared())
    assert result.passed, result.message


class RecordingTuning:
    """A tuning cache that keeps its entries in a dict and records what it was asked."""

    def __init__(self):
        self.entries, self.tuned = {}, []

    def key(self, device, shape_class):
        return repr(list(shape_class))

    def lookup(self, key, tune, fixed, compile_all=None, near=(), valid=None):
        if key in self.entries:
            return self.entries[key], "tuning cache"
        self.tuned.append(key)
        self.entries[key] = tune()
        return self.entries[key], "tuned"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the dense route: CPU")
@pytest.mark.parametrize("faster", ["decode", "dense"])
def test_a_dense_decode_step_takes_whichever_route_is_faster_once_per_shape_class(faster, monkeypatch):
    """Where the route can be timed, the decode and the dense kernel are timed once for the decode's shape class,
    the faster one runs (its config says which and where the choice came from), and the next call of the class
    reads the choice and prepares the dense kernel only if it runs it."""
    pytest.importorskip("triton")
    import impls._plans as serving

    timed = []
    monkeypatch.setattr(serving, "timed_here", lambda q: True)
    monkeypatch.setattr(serving, "fastest", lambda candidates: timed.append([c for c, _ in candidates]) or faster)
    tuning, built = RecordingTuning(), []

    def dense():
        built.append("dense")
        return Prepared(lambda: torch.zeros(1), config={"kernel": "dense"})

    q, k, v = dense_decode(sq=1, skv=256)
    for source in ("tuned", "tuning cache"):
        prepared = serving.decode_route("triton", q, k, v, causal=True, scale=0.125, dense=dense, tuning=tuning)
        assert prepared.config["route_chosen"] == source
        assert prepared.config["route"].startswith("split-KV decode" if faster == "decode" else "dense kernel")
    assert timed == [["decode", "dense"]] and len(tuning.tuned) == 1 and tuning.tuned[0].startswith("['dense decode'")
    # the dense kernel is prepared to be timed, and again only for a call that runs it
    assert built == ["dense"] * (1 if faster == "decode" else 2)
    assert ("kernel" in prepared.config) == (faster == "dense")
