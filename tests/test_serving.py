"""The serving operations: their contract's validation, the generated cases, the oracle's grip on them."""

import dataclasses
import itertools
import math

import pytest
import torch

import impls
from impls import Prepared, register, unregister
from impls.contract import UNBOUNDED, PagedKV, Varlen
from suite import metrics
from suite.cases import PRESETS, UNEVEN_VARLEN, Case, case_by_id, paged, uneven_varlen, varlen
from suite.checks import Oracle
from tests.tiers import first_fast, only_fast

TINY = ("", 4, 2, 64)


def paged_inputs(**changes) -> PagedKV:
    inputs = paged(TINY, 3, 100, lengths="longtail").make_inputs("cpu")
    return dataclasses.replace(inputs, **changes) if changes else inputs


def varlen_inputs(**changes) -> Varlen:
    inputs = varlen(TINY, 3, 300).make_inputs("cpu")
    return dataclasses.replace(inputs, **changes) if changes else inputs


@pytest.mark.parametrize(("change", "words"), [
    (lambda x: {"block_table": x.block_table.clone().index_fill_(1, torch.tensor([0]), 10_000)}, "out of range"),
    (lambda x: {"block_table": x.block_table[:, :2]}, "needs 7 pages of 16"),
    (lambda x: {"cache_seqlens": torch.zeros_like(x.cache_seqlens)}, "shorter than the 1 new tokens"),
    (lambda x: {"cache_seqlens": x.cache_seqlens.long()}, "cache_seqlens must be int32"),
    (lambda x: {"k_cache": x.k_cache[:, :, :1].expand(-1, -1, 3, -1), "v_cache": x.v_cache[:, :, :1].expand(
        -1, -1, 3, -1)}, "GQA ratio"),
    (lambda x: {"v_cache": x.v_cache[:, :8]}, "same shape"),
    (lambda x: {"v_cache": x.v_cache.float()}, "share one dtype"),
    (lambda x: {"k_cache": x.k_cache.to(torch.float8_e4m3fn)}, "share one dtype"),  # K fp8, V not
    (lambda x: {"k_scale": 0.5}, "applies to an fp8 cache only"),
])
def test_paged_input_errors_name_the_problem(change, words):
    base = paged_inputs()
    with pytest.raises((ValueError, TypeError), match=words):
        dataclasses.replace(base, **change(base))


@pytest.mark.parametrize(("change", "words"), [
    (lambda x: {"cu_seqlens_q": torch.tensor([0, 200, 100, 300], dtype=torch.int32)}, "non-decreasing"),
    (lambda x: {"cu_seqlens_k": torch.tensor([0, 10, 20, 30], dtype=torch.int32)}, "packed tensor has 300 rows"),
    (lambda x: {"cu_seqlens_q": torch.tensor([5, 10, 20, 300], dtype=torch.int32)}, "must be 0"),
    (lambda x: {"q": x.q[None]}, "3-D"),
])
def test_varlen_input_errors_name_the_problem(change, words):
    base = varlen_inputs()
    with pytest.raises((ValueError, TypeError), match=words):
        dataclasses.replace(base, **change(base))


@pytest.mark.parametrize("name", [impl.name for impl in impls.select() if impl.op == "varlen"])
@pytest.mark.parametrize(("lengths_q", "lengths_k", "causal"), first_fast(UNEVEN_VARLEN, unpack=True))
def test_uneven_varlen_batches_pass_or_are_refused_with_a_reason(name, lengths_q, lengths_k, causal):
    """Sequences with no queries or no keys, more keys than queries: what runs here matches the oracle (rows
    that see no key are zeros), what cannot run says why."""
    impl = impls.get(name, "varlen")
    reason = impl.availability("cpu")
    if reason:
        pytest.skip(reason)
    inputs = uneven_varlen(lengths_q, lengths_k, causal, "cpu", heads=(4, 2), head_dim=64)
    try:
        prepared = impl.prepare(inputs)
    except impls.Unsupported as exc:
        assert str(exc), "a refusal names its reason"
        pytest.skip(f"refused: {exc}")
    result = Oracle.serving(inputs).check(prepared())
    assert result.passed, result.message


def test_an_implementation_of_one_operation_refuses_another():
    with pytest.raises(TypeError, match="runs the 'paged' operation, got Varlen"):
        impls.get("naive", "paged").prepare(varlen_inputs())


def fp8_inputs(**changes) -> PagedKV:
    inputs = paged(TINY, 3, 100, lengths="longtail", kv_dtype="fp8").make_inputs("cpu")
    return dataclasses.replace(inputs, **changes) if changes else inputs


@pytest.mark.parametrize(("change", "words"), [
    (lambda x: {"q": x.q.float()}, "needs fp16 or bf16 q"),
    (lambda x: {"v_scale": 0.0}, "finite positive"),
    (lambda x: {"k_scale": float("nan")}, "finite positive"),
])
def test_fp8_cache_errors_name_the_problem(change, words):
    base = fp8_inputs()
    with pytest.raises((ValueError, TypeError), match=words):
        dataclasses.replace(base, **change(base))


def test_an_fp8_case_is_its_bf16_twin_quantized_per_tensor():
    """The fp8 cache holds the bf16 twin's draw (lengths and values) over its own scale (largest magnitude at fp8's
    448), and half the bytes to read."""
    wide, narrow = (paged(TINY, 3, 100, lengths="longtail", kv_dtype=kv) for kv in ("", "fp8"))
    assert narrow.id == wide.id.replace("-d64-", "-d64-kvfp8-")
    inputs = fp8_inputs()
    assert inputs.kv_fp8 and inputs.k_cache.dtype == torch.float8_e4m3fn and inputs.q.dtype == torch.bfloat16
    stored = inputs.k_cache.float()
    assert 224 < stored[torch.isfinite(stored)].abs().max() <= 448  # the top of fp8's range (its largest may be NaN'd)
    assert inputs.k_scale != inputs.v_scale  # one scale per tensor
    assert narrow.seqlens() == wide.seqlens() and metrics.kv_bytes(narrow) * 2 == metrics.kv_bytes(wide)
    twin = wide.make_inputs("cpu")
    used = torch.isfinite(twin.k_cache)
    dequantized = inputs.k_cache.float()[used] * inputs.k_scale
    assert torch.allclose(dequantized, twin.k_cache.float()[used], rtol=2**-3, atol=inputs.k_scale * 2**-6)
    with pytest.raises(ValueError, match="kv_dtype"):
        Case(1, 4, 2, 64, 64, 64, "bf16", True, kv_dtype="fp8")  # dense attention has no cache to quantize


def test_an_fp8_cache_read_without_its_scales_fails_the_check():
    """The oracle dequantizes: an implementation that takes the stored values for the keys and values fails,
    one that scales them passes, and one that declares no fp8 cache refuses it with the reason."""
    @register("unscaled", op="paged", family="toy", devices=("cpu",), variants=("kv_fp8",))
    def unscaled(inputs, *, scale):
        plain = dataclasses.replace(inputs, k_cache=inputs.k_cache.to(inputs.q.dtype),
                                    v_cache=inputs.v_cache.to(inputs.q.dtype), k_scale=1.0, v_scale=1.0)
        return impls.get("naive", "paged").prepare(plain, scale=scale).run

    try:
        inputs = fp8_inputs()
        oracle = Oracle.serving(inputs)
        assert not oracle.check(impls.get("unscaled", "paged").prepare(inputs)()).passed
        assert oracle.check(impls.get("naive", "paged").prepare(inputs)()).passed
        with pytest.raises(impls.Unsupported, match="fp8"):
            impls.get("flash-attn4", "paged").prepare(inputs)
    finally:
        unregister("unscaled", "paged")


# Query magnitudes far outside fp16's range: 2**40 would overflow it, 2**-60 flush to zero. The fp16 dots of bf16
# queries over an fp8 cache (F16_DOT) must keep both.
EXTREME_MAGNITUDES = (2.0**40, 2.0**-60)


def extreme_fp8_inputs(device: str, magnitude: float) -> tuple[PagedKV, float]:
    """The fp8 twin (ragged pages, NaN in unused slots) with its query heads multiplied by ``magnitude``, but for
    one all-zero head, and the score scale that gives the twin's own scores back (its softmax is the same)."""
    inputs = paged(TINY, 3, 100, lengths="longtail", kv_dtype="fp8").make_inputs(device)
    rows = torch.tensor([magnitude, magnitude, 0.0, magnitude], device=device, dtype=inputs.q.dtype)
    return dataclasses.replace(inputs, q=inputs.q * rows[None, None, :, None]), inputs.head_dim ** -0.5 / magnitude


def test_triton_decode_over_fp8_keeps_bf16_queries_of_any_magnitude():
    """Under bf16 queries the Triton decode over an fp8 cache runs its dots in fp16 (F16_DOT), each query row
    scaled by a power of two first: queries of EXTREME_MAGNITUDES still give the oracle's output. Compiled on a
    GPU; under the interpreter on CPU (its fp32 dots still take the scaled rows). tests/test_gpu_candidates.py checks
    cuTile's decode forms the same way."""
    pytest.importorskip("triton")
    from impls.triton_fa.paged import DECODE_TILES, INTERPRETER_DECODE_CONFIG, paged_launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, w, st = DECODE_TILES[0]
    config = INTERPRETER_DECODE_CONFIG if device == "cpu" else {"BLOCK_N": n, "num_warps": w, "num_stages": st}
    for magnitude in EXTREME_MAGNITUDES:
        inputs, scale = extreme_fp8_inputs(device, magnitude)
        run, _ = paged_launch(inputs, scale, config)
        result = Oracle.serving(inputs, scale=scale).check(run())
        assert result.passed, f"queries of {magnitude}: {result.message}"


def off_word(cache: torch.Tensor) -> torch.Tensor:
    """The same cache one byte past a 32-bit word boundary (its unused slots' NaN too)."""
    shifted = torch.empty(cache.numel() + 1, dtype=cache.dtype, device=cache.device)[1:].view(cache.shape)
    return shifted.copy_(cache)


def test_triton_reads_fp8_values_as_words_only_where_it_can():
    """V_WORDS (decode.py): the values come as 32-bit words under fp16 dots in compiled code, over a word-aligned
    cache; bf16 dots, the interpreter or a cache off word alignment keep the byte path."""
    from impls.triton_fa.paged import word_values

    inputs = fp8_inputs()
    assert word_values(inputs, interp=False) and not word_values(inputs, interp=True)
    assert word_values(dataclasses.replace(inputs, q=inputs.q.half()), interp=False)  # fp16 queries: fp16 dots
    assert not word_values(inputs, interp=False, f16_dot=False)  # bf16 queries with F16_DOT off: bf16 dots
    assert not word_values(dataclasses.replace(inputs, v_cache=off_word(inputs.v_cache)), interp=False)
    assert not word_values(paged_inputs(), interp=False)  # a bf16 cache


def test_words_widen_into_their_columns_in_order():
    """V_WORDS' four values of a word land in its four columns, lowest byte first (``interleave_columns``; the
    widening itself is inline PTX, which only a GPU runs: the next test)."""
    kernels = pytest.importorskip("tests._triton_kernels")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(2, 16, dtype=torch.int32, device=device)
    kernels.spread_words[(1,)](out, ROWS=2, WORDS=4)
    assert out.flatten().tolist() == list(range(32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="V_WORDS runs inline PTX: compiled code on a GPU")
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.bfloat16, 64), (torch.float16, 64), (torch.bfloat16, 96)])
def test_triton_fp8_values_as_words_on_every_decode_tile(dtype, head_dim):
    """Every tile of the decode tuner over the fp8 twin (ragged pages, NaN in unused slots), its values read as
    words (bf16 queries with the fp16 dots, and fp16 queries; a head dim of 96 pads the tile to 128, its last
    words masked), then as bytes from a cache off word alignment: the oracle's output each time."""
    from impls.triton_fa.paged import DECODE_TILES, paged_launch, word_values

    inputs = paged((*TINY[:3], head_dim), 3, 100, lengths="longtail", kv_dtype="fp8").make_inputs("cuda")
    inputs = dataclasses.replace(inputs, q=inputs.q.to(dtype))
    shifted = dataclasses.replace(inputs, v_cache=off_word(inputs.v_cache))
    for case, words in ((inputs, True), (shifted, False)):
        assert word_values(case, interp=False) is words
        for n, w, st in DECODE_TILES:
            run, plan = paged_launch(case, head_dim ** -0.5, {"BLOCK_N": n, "num_warps": w, "num_stages": st})
            assert plan["fp8_values"] == ("words" if words else "bytes")  # recorded with the benchmark's config
            result = Oracle.serving(case).check(run())
            assert result.passed, f"tile {n, w, st}, words {words}: {result.message}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PREFETCH is inline PTX before the PDL wait: a GPU")
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_triton_split_decode_prefetches_under_pdl_and_gives_the_oracle_output(head_dim):
    """Where a step splits on Hopper its kernels run under PDL, and the first chunk's program of each sequence asks
    the L2 for its lookups before the wait (PREFETCH): on every tile of the tuner's space, with 1 and 4 new tokens,
    long-tailed lengths (NaN in unused slots) and a head dim that pads the tile (96), the output is the oracle's, with
    and without it (also worth running under compute-sanitizer's memcheck)."""
    from impls._plans import dependent_launch_available
    from impls.triton_fa.paged import DECODE_TILES, paged_launch

    if not dependent_launch_available(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    for sq in (1, 4):
        inputs = paged((*TINY[:3], head_dim), 3, 300, sq=sq, lengths="longtail").make_inputs("cuda")
        oracle = Oracle.serving(inputs)
        for (n, w, st), prefetch in itertools.product(DECODE_TILES, (True, False)):
            config = {"BLOCK_N": n, "num_warps": w, "num_stages": st, "PLAN_MIN_TILES": 1, "PREFETCH": prefetch}
            run, plan = paged_launch(inputs, head_dim ** -0.5, config)
            assert plan["num_splits"] > 1 and plan["PDL"] and plan["PREFETCH"] is prefetch, plan
            result = oracle.check(run())
            assert result.passed, f"tile {n, w, st}, {sq} new, prefetch {prefetch}: {result.message}"


def test_case_ids_and_lengths():
    case = paged(("llama3-8b", 32, 8, 128), 16, 32768, lengths="longtail")
    assert case.id == "llama3-8b-paged-bf16-h32:8-q1-kv32768-longtail-p16-d128-b16"
    lengths = case.seqlens()
    assert lengths[0] == 32768 and all(1 <= n <= 32768 for n in lengths) and len(set(lengths)) > 8
    assert case.seqlens() == lengths  # seeded by the case
    mixed = varlen(("llama3-8b", 32, 8, 128), 16, 65536)
    assert sum(mixed.seqlens()) == 65536 and len(mixed.seqlens()) == 16
    assert varlen(TINY, 4, 256, lengths="equal").seqlens() == [64] * 4
    with pytest.raises(ValueError, match="do not apply to paged"):
        Case(1, 4, 2, 1, 64, 64, "bf16", True, op="paged", page_size=16, lengths="random")


def test_unused_cache_slots_hold_nan_and_the_pages_are_scattered():
    inputs = paged_inputs()
    page = inputs.page_size
    used = [math.ceil(n / page) for n in inputs.seqlens]
    table = inputs.block_table
    assert not torch.equal(table[0, : used[0]], torch.arange(used[0], dtype=torch.int32))  # not in order
    for b, n in enumerate(inputs.seqlens):
        pages = table[b, : used[b]].long()
        slots = inputs.k_cache[pages].flatten(0, 1)
        assert torch.isfinite(slots[:n]).all() and torch.isnan(slots[n:]).all()
        assert torch.isnan(inputs.v_cache[table[b, used[b]:].long()]).all()  # entries past the last page


def test_an_implementation_that_reads_past_a_length_fails_the_check():
    """Reading a whole last page (NaN past the length) must be caught, not averaged away."""
    @register("reads-whole-pages", op="paged", family="toy", devices=("cpu",))
    def whole_pages(inputs, *, scale):
        padded = dataclasses.replace(inputs, cache_seqlens=torch.tensor(
            [math.ceil(n / inputs.page_size) * inputs.page_size for n in inputs.seqlens], dtype=torch.int32))
        out = impls.get("naive", "paged").prepare(padded, scale=scale)
        return Prepared(out.run)

    try:
        inputs = paged_inputs()
        result = Oracle.serving(inputs).check(impls.get("reads-whole-pages", "paged").prepare(inputs)())
        assert not result.passed and "NaN" in result.message
    finally:
        unregister("reads-whole-pages", "paged")


def test_serving_metrics_count_each_sequence():
    case = paged(TINY, 3, 100, lengths="longtail")
    tokens = sum(case.seqlens())
    assert metrics.kv_bytes(case) == 2 * tokens * 2 * 64 * 2
    assert metrics.flops(case) == 4 * 4 * 64 * tokens  # one new token sees its whole sequence
    v = varlen(TINY, 3, 300, causal=False)
    assert metrics.flops(v) == 4 * 4 * 64 * sum(n * n for n in v.seqlens())


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the narrowed combine: CPU")
def test_triton_decode_with_a_narrowed_combine(monkeypatch):
    """The Triton combine with head-dim slices (as many chunks make it) is correct: a small
    ``COMBINE_STEP_ELEMENTS`` narrows the slices of a CPU twin's few chunks."""
    pytest.importorskip("triton")
    import impls._plans

    monkeypatch.setattr(impls._plans, "COMBINE_STEP_ELEMENTS", 64)
    inputs = PRESETS["serving-cpu"][4].make_inputs("cpu")  # MQA, 300 tokens: split under the interpreter
    from impls.triton_fa.paged import INTERPRETER_DECODE_CONFIG, paged_launch

    run, plan = paged_launch(inputs, inputs.head_dim ** -0.5, INTERPRETER_DECODE_CONFIG)
    assert plan["num_splits"] > 4 and impls._plans.combine_plan(plan["num_splits"], inputs.head_dim)[0] == 16
    result = Oracle.serving(inputs).check(run())
    assert result.passed, result.message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the split plans: CPU")
def test_triton_decode_plans_for_more_or_fewer_programs_are_correct():
    """The decode tuner's plan axes (PLAN_PROGRAMS, PLAN_FIT) change the chunk count; each plan is still
    correct."""
    pytest.importorskip("triton")
    from impls.triton_fa.paged import INTERPRETER_DECODE_CONFIG, paged_launch

    inputs = PRESETS["serving-cpu"][4].make_inputs("cpu")  # MQA, 300 tokens
    splits = set()
    for programs, fit in ((2, False), (8, False), (1, True)):
        run, plan = paged_launch(inputs, inputs.head_dim ** -0.5, {**INTERPRETER_DECODE_CONFIG,
                                                                   "PLAN_PROGRAMS": programs, "PLAN_FIT": fit})
        result = Oracle.serving(inputs).check(run())
        assert result.passed, result.message
        splits.add(plan["num_splits"])
    assert len(splits) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the driver's occupancy of a compiled kernel: GPU")
@pytest.mark.parametrize("waves", [1, 2])
def test_triton_fitted_decode_plans_fill_whole_waves_of_resident_blocks(waves):
    """A fitted plan (PLAN_FIT) counts the compiled split kernel's resident blocks: its programs fit in
    ``waves`` x that x the SMs, and it is correct on every paged CPU twin and on the 70B slice at batch 1 (32K
    tokens: split)."""
    pytest.importorskip("triton")
    from impls.triton_fa.paged import DECODE_TILES, paged_launch

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    long_one = case_by_id("llama3-70b-tp8-paged-bf16-h8:1-q1-kv32768-uniform-p16-d128")
    for case in [c for c in PRESETS["serving-cpu"] if c.op == "paged"] + [long_one]:
        inputs = case.make_inputs("cuda")
        oracle = Oracle.serving(inputs)
        for n, w, st in DECODE_TILES:
            run, plan = paged_launch(inputs, inputs.head_dim ** -0.5, {
                "BLOCK_N": n, "num_warps": w, "num_stages": st, "PLAN_PROGRAMS": waves, "PLAN_FIT": True})
            resident = plan["programs_per_sm"] // waves
            assert plan["programs_per_sm"] == waves * resident and 1 <= resident <= 32
            chunks = sum(-(-length // plan["split_len"]) for length in inputs.seqlens)
            assert plan["num_splits"] == 1 or chunks * inputs.k_cache.shape[2] <= waves * resident * sm_count
            assert plan["num_splits"] > 1 or case is not long_one
            result = oracle.check(run())
            assert result.passed, f"{case.id} {n}x{w}x{st}: {result.message}"


@pytest.mark.parametrize("mask_free", [True, False])
@pytest.mark.parametrize("case", [c for preset in ("serving-cpu", "models-serving-cpu") for c in PRESETS[preset]
                                  if c.op == "paged"], ids=lambda c: c.id)
def test_triton_decode_with_and_without_the_mask_free_loop(case, mask_free):
    """Both forms of the decode tuner's MASK_FREE axis are correct on every paged CPU twin (several new tokens,
    ragged last pages, NaN in the unused slots; the models' windows, softcap and head dims 96 and 256): the
    mask-free loop stops before any position that some new token must not see or that is past the sequence.
    Under the interpreter on CPU; on a GPU compiled, with each tile shape of the tuner's space that fits in
    shared memory (only D=256 leaves one out: the double-buffered 128-key tile, as the tuner does)."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from impls.triton_fa.paged import DECODE_SPACE, DECODE_TILES, INTERPRETER_DECODE_CONFIG, paged_launch

    assert {config["MASK_FREE"] for config in DECODE_SPACE} == {True, False}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = case.make_inputs(device)
    configs = [INTERPRETER_DECODE_CONFIG] if device == "cpu" else [
        {"BLOCK_N": n, "num_warps": w, "num_stages": st} for n, w, st in DECODE_TILES]
    oracle = Oracle.serving(inputs)
    for config in configs:
        run, _ = paged_launch(inputs, inputs.head_dim ** -0.5, {**config, "MASK_FREE": mask_free})
        try:
            out = run()
        except OutOfResources:
            assert inputs.head_dim > 128 and config["num_stages"] >= 5, f"{config} refused at D={inputs.head_dim}"
            continue
        result = oracle.check(out)
        assert result.passed, f"{config}: {result.message}"


def test_triton_decode_tuner_leaves_out_configs_beyond_shared_memory():
    """A decode config whose buffers do not fit (Triton raises OutOfResources when it compiles or launches it: the
    double-buffered 128-key tile at D=256) is left out of the tuning; the others are timed, each kernel and chunk
    length once; with none left the call is refused with the reason."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from impls.triton_fa.paged import DECODE_SPACE, decode_candidates

    calls = []

    def launch(config):
        def run():
            calls.append(config)
            if config["num_stages"] >= 5:
                raise OutOfResources(262144, 232448, "shared memory")
        return run, {"split_len": 1024 if config["PLAN_FIT"] else 2048}

    kept = decode_candidates(DECODE_SPACE, launch)
    assert kept and all(config["num_stages"] < 5 for config, _ in kept)
    assert {config["num_stages"] for config in calls} >= {5}  # tried, then left out
    forms = [(c["BLOCK_N"], c["num_warps"], c["num_stages"], c["MASK_FREE"], c["PLAN_FIT"]) for c, _ in kept]
    assert len(forms) == len(set(forms))  # each kernel and chunk length once
    with pytest.raises(impls.Unsupported, match="shared memory"):
        decode_candidates([c for c in DECODE_SPACE if c["num_stages"] >= 5], launch)


def test_decode_tuners_time_a_step_that_fits_in_the_l2_over_copies_of_its_inputs(monkeypatch):
    """A step whose inputs fit in twice the L2 is timed cold by the decode tuners: each candidate's call runs over the
    inputs and then each copy of them (fresh memory, equal contents), enough copies that the others' bytes evict the
    L2 between a copy's uses; a step of twice the L2 or more, or off CUDA, keeps its calls as they are."""
    from impls import timing

    inputs = paged_inputs()
    size = sum(t.nbytes for t in timing.input_tensors(inputs).values())
    assert size == sum(t.nbytes for t in (inputs.q, inputs.k_cache, inputs.v_cache, inputs.block_table,
                                          inputs.cache_seqlens))
    ran = []
    candidates = [(name, lambda name=name: ran.append((name, inputs))) for name in ("a", "b")]

    def call_on(copy, name):
        return lambda: ran.append((name, copy))

    assert timing.cold_candidates(candidates, inputs, call_on) is candidates  # CPU: no L2 to evict
    monkeypatch.setattr(timing, "l2_bytes", lambda device: size)  # the inputs fit in twice the L2
    cold = timing.cold_candidates(candidates, inputs, call_on)
    assert [name for name, _ in cold] == ["a", "b"]
    cold[1][1]()
    assert [name for name, _ in ran] == ["b"] * 3  # itself and 2 copies, whose bytes are twice the L2
    assert ran[0][1] is inputs and len({id(copy.k_cache) for _, copy in ran}) == 3
    for _, copy in ran[1:]:
        assert copy.k_cache.data_ptr() != inputs.k_cache.data_ptr()
        torch.testing.assert_close(copy.k_cache, inputs.k_cache, rtol=0, atol=0, equal_nan=True)  # NaN in free slots
        assert torch.equal(copy.block_table, inputs.block_table) and copy.page_size == inputs.page_size
    monkeypatch.setattr(timing, "l2_bytes", lambda device: size // 2)  # twice the L2 is the step: it evicts itself
    assert timing.cold_candidates(candidates, inputs, call_on) is candidates


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the unsplit decode: CPU")
def test_triton_decode_without_a_split_writes_the_output_directly(monkeypatch):
    """One chunk per sequence: the split kernel writes the output rows, and no combine is launched."""
    pytest.importorskip("triton")
    import impls.triton_fa.decode
    from impls.triton_fa.paged import INTERPRETER_DECODE_CONFIG, paged_launch

    def no_combine(*args, **kwargs):
        raise AssertionError("the combine was launched for an unsplit decode")

    monkeypatch.setattr(impls.triton_fa.decode, "paged_decode_combine", no_combine)
    inputs = PRESETS["serving-cpu"][4].make_inputs("cpu")  # MQA, 300 tokens: one chunk of 512 keys
    run, plan = paged_launch(inputs, inputs.head_dim ** -0.5, {**INTERPRETER_DECODE_CONFIG, "BLOCK_N": 512})
    assert plan["num_splits"] == 1
    result = Oracle.serving(inputs).check(run())
    assert result.passed, result.message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the split decode: CPU")
def test_triton_decode_asked_to_prefetch_runs_without_it_under_the_interpreter():
    """PREFETCH is inline PTX (prefetch.global.L2) before the PDL wait, neither of which Triton's interpreter runs: a
    config asking for it runs there without it, split and combined, says so, and stays correct
    (tests/test_triton_compile.py has the PTX)."""
    pytest.importorskip("triton")
    from impls.triton_fa.paged import INTERPRETER_DECODE_CONFIG, paged_launch

    inputs = PRESETS["serving-cpu"][0].make_inputs("cpu")
    run, plan = paged_launch(inputs, inputs.head_dim ** -0.5, {**INTERPRETER_DECODE_CONFIG, "PREFETCH": True})
    assert plan["num_splits"] > 1 and plan["PDL"] is False and plan["PREFETCH"] is False, plan
    result = Oracle.serving(inputs).check(run())
    assert result.passed, result.message


@pytest.mark.parametrize("name", ["serving-cpu", "varlen-cpu"])
def test_the_cpu_twins_cover_gqa_mqa_several_tokens_and_ragged_pages(name):
    grid = PRESETS[name]
    assert {c.hq // c.hkv for c in grid} >= ({1, 2, 4} if name == "serving-cpu" else {2, 4})
    if name == "serving-cpu":
        assert any(c.sq > 1 for c in grid) and any(c.skv % c.page_size for c in grid)
        assert {c.page_size for c in grid} >= {16, 32}


@pytest.mark.parametrize("pdl", only_fast([True, False, None], [None]))
def test_triton_decode_with_and_without_programmatic_dependent_launch(pdl):
    """Both launch modes of the decode (config ``PDL``; by default on where the step splits) are correct on every
    paged CPU twin, split and unsplit. On a GPU the steps also run back to back in one CUDA graph, where under PDL
    each kernel starts while the one before it still runs (it waits for it before its first load). Hopper and later
    take it; the interpreter and older GPUs launch as before, and the plan says which ran."""
    pytest.importorskip("triton")
    from impls.triton_fa.paged import INTERPRETER_DECODE_CONFIG, paged_launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hopper = device == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    switch = {} if pdl is None else {"PDL": pdl}
    config = {**INTERPRETER_DECODE_CONFIG, **switch} if device == "cpu" else {
        "BLOCK_N": 16, "num_warps": 4, "num_stages": 3, **switch}  # 300 tokens in 16-key tiles: split
    splits = set()
    for case in [c for c in PRESETS["serving-cpu"] if c.op == "paged"]:
        inputs = case.make_inputs(device)
        run, plan = paged_launch(inputs, inputs.head_dim ** -0.5, config)
        assert plan["PDL"] is (hopper and (plan["num_splits"] > 1 if pdl is None else pdl))
        splits.add(plan["num_splits"] > 1)
        out = run()
        if device == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(4):
                    out = run()
            out.zero_()
            graph.replay()
        result = Oracle.serving(inputs).check(out)
        assert result.passed, f"{case.id}: {result.message}"
    assert splits == {True, False}  # both the two-launch and the one-launch step


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


def test_dense_decode_steps_rank_by_bandwidth():
    """A decode-shaped dense case ranks by GB/s, as paged decode does; prefill, and a step of several queries
    that see the whole cache, by TFLOPS."""
    assert {c.merit for c in PRESETS["decode"]} == {"gbps"}
    assert Case(1, 8, 2, 4, 256, 64, "fp16", False).merit == "tflops"
    assert {c.merit for c in PRESETS["blog"]} == {"tflops"}


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
