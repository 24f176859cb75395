"""Mixed prefill and decode: the contract's validation, the oracle, our Triton kernel under the interpreter, the cases
and their presets, FLOPs and bytes."""

import dataclasses
import itertools
import math

import pytest
import torch

import impls
from impls import MixedBatch, Unsupported
from impls.contract import gather_sequence
from impls.reference import serving_attention_ref
from suite import metrics
from suite.cases import MIXED_PARTS, Case, PageLayout
from suite.checks import Oracle
from suite.presets import LLAMA3_8B, MAX_SERVING_TOKENS, PRESETS, mixed, paged
from tests.tiers import first_fast

TINY = ("", 4, 2, 64)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # our Triton kernel: compiled on a GPU, interpreted without


def mixed_inputs(**changes) -> MixedBatch:
    inputs = mixed(TINY, 3, 100, 2, 40, lengths="longtail").make_inputs("cpu")
    return dataclasses.replace(inputs, **changes) if changes else inputs


def batch(new_tokens: list[int], lengths: list[int], *, heads: tuple[int, int] = (8, 2), head_dim: int = 64,
          page_size: int = 16, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> MixedBatch:
    """A mixed batch of these new tokens and cache lengths per sequence, its pages in a shuffled order and every slot
    no sequence uses NaN."""
    gen = torch.Generator().manual_seed(sum(lengths))
    pages = [math.ceil(n / page_size) for n in lengths]
    num_pages = sum(pages) + 1
    order = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lengths), max(pages) + 1), int(order[-1]), dtype=torch.int32)
    starts = [0, *itertools.accumulate(pages)]
    for b, n in enumerate(pages):
        table[b, :n] = order[starts[b]:starts[b + 1]]
    tails = [(int(table[b, p - 1]), n % page_size) for b, (p, n) in enumerate(zip(pages, lengths, strict=True))
             if n % page_size]
    layout = PageLayout(lengths, num_pages, table, order[-1:], tails)
    k_cache, v_cache = (torch.randn(num_pages, page_size, heads[1], head_dim, generator=gen).to(device, dtype)
                        for _ in range(2))
    for cache in (k_cache, v_cache):
        layout.fill_unused(cache)
    q = torch.randn(sum(new_tokens), heads[0], head_dim, generator=gen).to(device, dtype)
    cu_q = torch.tensor([0, *itertools.accumulate(new_tokens)], dtype=torch.int32, device=device)
    return MixedBatch(q, k_cache, v_cache, *layout.index_tensors(device), cu_q)


@pytest.mark.parametrize(("change", "words"), [
    (lambda x: {"q": x.q[None]}, r"q must be 3-D \(total_q, Hq, D\)"),
    (lambda x: {"k_cache": x.k_cache[0]}, r"k_cache must be 4-D \(num_pages, page_size, Hkv, D\)"),
    (lambda x: {"v_cache": x.v_cache.float()}, "share one dtype"),
    (lambda x: {"q": x.q[:, :3]}, "GQA ratio"),
    (lambda x: {"q": x.q[..., :32]}, r"head dim of q \(32\) and k_cache \(64\) differ"),
    (lambda x: {"cu_seqlens_q": x.cu_seqlens_q.long()}, "cu_seqlens_q must be int32"),
    (lambda x: {"cu_seqlens_q": x.cu_seqlens_q[:-1]}, r"cu_seqlens_q \(B\+1,\)"),
    (lambda x: {"cache_seqlens": x.cache_seqlens[:-1]}, r"cache_seqlens \(B,\), block_table"),
    (lambda x: {"cu_seqlens_q": x.cu_seqlens_q + 1}, r"cu_seqlens_q\[0\] must be 0"),
    (lambda x: {"cu_seqlens_q": torch.tensor([0, 2, 1, 3, 43, 83], dtype=torch.int32)}, "non-decreasing"),
    (lambda x: {"q": x.q[:-1]}, r"cu_seqlens_q\[-1\] = 83 but the packed tensor has 82 rows"),
    (lambda x: {"cu_seqlens_q": torch.tensor([0, 1, 1, 3, 43, 83], dtype=torch.int32)}, "sequence 1 has no new tokens"),
    (lambda x: {"cache_seqlens": x.cache_seqlens.clone().index_fill_(0, torch.tensor([3]), 39)},
     r"cache_seqlens\[3\] = 39 is shorter than the 40 new tokens"),
    (lambda x: {"block_table": x.block_table[:, :2]}, "needs 7 pages of 16"),
    (lambda x: {"block_table": x.block_table.clone().index_fill_(1, torch.tensor([0]), 10_000)}, "out of range"),
])
def test_mixed_input_errors_name_the_problem(change, words):
    base = mixed_inputs()
    with pytest.raises((ValueError, TypeError), match=words):
        dataclasses.replace(base, **change(base))


def test_the_generated_batch_packs_decode_rows_then_chunks_over_nan_filled_pages():
    inputs = mixed_inputs()
    assert inputs.seqlens_q() == [1, 1, 1, 40, 40]
    assert inputs.seqlens[3:] == (40, 80)  # the first chunk of a prompt, then the second (40 tokens cached)
    assert inputs.output_like().shape == inputs.q.shape == (83, 4, 64)
    for cache in (inputs.k_cache, inputs.v_cache):
        unused = int(torch.isnan(cache).any(dim=-1).any(dim=-1).sum())
        assert unused == inputs.k_cache.shape[0] * inputs.page_size - sum(inputs.seqlens)


def test_the_oracle_is_causal_bottom_right_over_each_cache():
    """A new token sees its cache up to its own position: the last of a chunk every key, the first the keys cached
    before the chunk and itself."""
    inputs = mixed_inputs()
    ref = serving_attention_ref(inputs, indices=[4])[4][0]  # (Hq, 40, D): the second chunk
    k, v = (t.double() for t in gather_sequence(inputs, 4))  # (Hkv, 80, D)
    q = inputs.q[inputs.offsets_q[4]:].double().transpose(0, 1)  # (Hq, 40, D)
    for token, seen in ((0, 41), (39, 80)):
        head = 3  # kv head 1
        scores = (q[head, token] @ k[1, :seen].T) * inputs.scale(None)
        expected = torch.softmax(scores, 0) @ v[1, :seen]
        torch.testing.assert_close(ref[head, token].double(), expected.to(ref.dtype).double())


def test_the_oracle_passes_naive_and_fails_a_kernel_that_reads_an_unused_slot():
    inputs = mixed_inputs()
    oracle = Oracle.serving(inputs)
    assert oracle.check(impls.get("naive", "mixed").prepare(inputs)()).passed
    whole_pages = torch.tensor([math.ceil(n / 16) * 16 for n in inputs.seqlens], dtype=torch.int32)
    reads_unused = impls.get("naive", "mixed").prepare(dataclasses.replace(inputs, cache_seqlens=whole_pages))()
    assert not oracle.check(reads_unused).passed


def test_an_operation_refuses_the_other_ones_inputs():
    with pytest.raises(TypeError, match="runs the 'mixed' operation, got PagedKV"):
        impls.get("naive", "mixed").prepare(paged(TINY, 2, 50).make_inputs("cpu"))


# Batches for our kernel under the interpreter (tiles of 16 rows and 16 keys there): (new tokens, cache lengths,
# heads, page size). A sequence that is one new token over an empty cache, decode rows beside a chunk of several query
# tiles whose cache does not fill its last page, chunks with and without cached tokens before them, MQA and a group of
# 3 (5 tokens a tile), pages of 32 and of 16.
KERNEL_BATCHES = [
    ([1, 1, 45, 20], [1, 37, 60, 20], (8, 2), 16),
    ([1, 33, 1], [77, 100, 5], (8, 1), 32),
    ([1, 1, 1, 17], [70, 3, 16, 50], (6, 2), 16),
    ([64], [64], (4, 4), 16),
]


@pytest.mark.parametrize(("new_tokens", "lengths", "heads", "page_size"), first_fast(KERNEL_BATCHES, 1, unpack=True))
def test_triton_mixed_matches_the_oracle(new_tokens, lengths, heads, page_size):
    pytest.importorskip("triton")
    inputs = batch(new_tokens, lengths, heads=heads, page_size=page_size, device=DEVICE)
    prepared = impls.get("triton", "mixed").prepare(inputs)
    result = Oracle.serving(inputs).check(prepared())
    assert result.passed, result.message
    assert prepared.config["work_items"] == sum(math.ceil(n / prepared.config["tokens_per_tile"]) for n in new_tokens)


# Steps whose decoding rows the plan splits, under the interpreter (tiles of 16 keys) with the SMs of a GPU the step is
# too small for: (new tokens, cache lengths, heads, SMs). GQA with a prefill chunk beside ragged caches, one of them
# one new token over an empty cache, in one-tile chunks; MQA decoding alone in chunks of two tiles, the last ragged.
SPLIT_BATCHES = [
    ([1, 1, 24, 1, 1], [150, 2, 40, 77, 1], (8, 2), 132),
    ([1, 1], [300, 5], (4, 1), 4),
]


@pytest.mark.parametrize(("new_tokens", "lengths", "heads", "sm_count"), SPLIT_BATCHES)
def test_triton_mixed_splits_the_decoding_rows_of_a_small_step_and_matches_the_oracle(new_tokens, lengths, heads,
                                                                                        sm_count):
    pytest.importorskip("triton")
    from impls.triton_fa.mixed import mixed_launch

    inputs = batch(new_tokens, lengths, heads=heads, device=DEVICE)
    run, config = mixed_launch(inputs, inputs.scale(None), sm_count=sm_count)
    assert config["num_splits"] > 1
    run().fill_(float("nan"))  # every row written by each call: the prefill tiles' and the combine's
    result = Oracle.serving(inputs).check(run())
    assert result.passed, result.message


def test_a_mixed_step_splits_its_decoding_rows_only_when_its_programs_are_too_few():
    from impls._plans import mixed_split_plan, split_plan

    seqlens_q, seqlens = [1, 1, 24], (4096, 64, 40)  # 2 decode items and 6 tiles of 4 tokens over 2 kv heads
    assert mixed_split_plan(seqlens_q, seqlens, 2, 4, 64, sm_count=16) == (1, 0)  # 16 programs
    assert mixed_split_plan(seqlens_q, seqlens, 2, 4, 64, sm_count=17) == split_plan([4096, 64], 2, 64, 17)
    assert mixed_split_plan([24, 30], (40, 30), 2, 4, 64, sm_count=132) == (1, 0)  # nothing decodes
    assert mixed_split_plan([1, 1], (64, 64), 1, 4, 64, sm_count=132) == (1, 0)  # one tile each: the plan keeps them


def test_the_split_work_list_cuts_each_decoding_cache_into_its_chunks_and_keeps_the_prefill_tiles():
    from impls._plans import mixed_split_work_list, mixed_work_list, tile_keys

    seqlens_q, seqlens = [1, 45, 1, 20], (37, 60, 900, 20)
    items = mixed_split_work_list(seqlens_q, seqlens, tokens=8, split_len=32)
    chunks = sorted((seq, chunk, slot) for seq, _, chunk, slot in items if slot >= 0)
    assert chunks == [(0, 0, 0), (0, 1, 0), *((2, c, 1) for c in range(29))]  # 37 and 900 keys in chunks of 32
    prefill = [(seq, first) for seq, first, chunk, slot in items if slot < 0]
    assert prefill == [item for item in mixed_work_list(seqlens_q, seqlens, 8) if seqlens_q[item[0]] > 1]
    keys = [min(32, seqlens[seq] - 32 * chunk) if slot >= 0 else tile_keys(seqlens_q, seqlens, 8, seq, first)
            for seq, first, chunk, slot in items]
    assert keys == sorted(keys, reverse=True)  # the chunk ends first, then the rest, longest first


def test_the_work_list_covers_every_token_once_longest_first():
    from impls._plans import mixed_work_list

    seqlens_q, seqlens = [1, 45, 1, 20], (37, 60, 900, 20)
    items = mixed_work_list(seqlens_q, seqlens, tokens=8)
    covered = sorted((seq, first + t) for seq, first in items for t in range(8) if first + t < seqlens_q[seq])
    assert covered == [(seq, t) for seq, n in enumerate(seqlens_q) for t in range(n)]
    keys = [seqlens[seq] - seqlens_q[seq] + min(first + 8, seqlens_q[seq]) for seq, first in items]
    assert keys == sorted(keys, reverse=True) and items[0] == (2, 0)  # the long decode first, then the chunk's end


def test_the_tiles_pack_a_decode_rows_query_heads_in_one_tile():
    from impls.triton_fa.mixed import tiles

    assert tiles(4, 128, interp=False) == (64, 64, 4)
    assert tiles(4, 256, interp=False) == (64, 32, 8)
    assert tiles(128, 128, interp=False) == (128, 64, 8)  # a group wider than the tile: a tile of its own, 8 warps
    assert tiles(3, 64, interp=True) == (16, 16, 4)


@pytest.mark.parametrize(("changes", "words"), [
    ({"chunks": 2, "op": "paged"}, "prefill chunks belong to mixed cases"),
    ({"batch": 0, "chunks": 0}, "at least one sequence"),
    ({"page_size": 0}, "paged cases need one"),
    ({"causal": False}, "causal"),
    ({"lengths": "random"}, "do not apply to mixed"),
])
def test_a_mixed_case_is_a_causal_step_over_pages(changes, words):
    with pytest.raises(ValueError, match=words):
        dataclasses.replace(mixed(TINY, 2, 50, 1, 8), **changes)


def test_case_ids_bytes_and_flops():
    case = mixed(LLAMA3_8B, 2, 1024, 1, 512)
    assert case.id == "llama3-8b-mixed-bf16-h32:8-dec2xkv1024-uniform-pre1x512-p16-d128"
    assert case.seqlens() == [1024, 1024, 512] and case.new_tokens() == [1, 1, 512]
    assert metrics.kv_bytes(case) == (2 * 1024 + 512) * 8 * 2 * 128 * 2  # each sequence's K and V once
    assert metrics.min_bytes(case) == metrics.kv_bytes(case) + 514 * 32 * 2 * 128 * 2  # q in, o out
    assert metrics.flops(case) == 4 * 32 * 128 * (2 * 1024 + 512 * 513 // 2)  # causal: the chunk's triangle
    assert mixed(LLAMA3_8B, 0, 0, 2, 8).id == "llama3-8b-mixed-bf16-h32:8-pre2x8-p16-d128"
    decode_only = mixed(LLAMA3_8B, 64, 8192, lengths="longtail")
    assert decode_only.id == "llama3-8b-mixed-bf16-h32:8-dec64xkv8192-longtail-p16-d128"


def test_a_case_ranks_by_whichever_of_bytes_and_flops_bounds_it():
    assert mixed(LLAMA3_8B, 64, 8192, 1, 4096).merit == "gbps"  # the decoding caches' bytes
    assert mixed(LLAMA3_8B, 0, 0, 4, 4096).merit == "tflops"  # prefill alone


def test_the_presets_hold_both_ends_and_the_cpu_twin_every_path():
    gpu: list[Case] = PRESETS["serving-mixed"]
    assert 8 <= len(gpu) <= 16 and len({c.id for c in gpu}) == len(gpu)
    assert {(c.hq, c.hkv, c.d) for c in gpu} == {(32, 8, 128), (8, 1, 128)}
    assert any(c.batch == 0 for c in gpu) and any(c.chunks == 0 for c in gpu)  # prefill alone, decode alone
    assert {c.sq for c in gpu if c.chunks} == {512, 2048, 4096} and max(c.chunks for c in gpu) == 4
    assert max(sum(c.seqlens()) for c in gpu) <= MAX_SERVING_TOKENS
    cpu: list[Case] = PRESETS["serving-mixed-cpu"]
    assert {c.op for c in gpu + cpu} == {"mixed"}
    assert {c.dtype for c in cpu} == {"bf16", "fp16", "fp32"} and {c.hkv for c in cpu} >= {1}
    for case in cpu:
        inputs = case.make_inputs("cpu")
        assert inputs.seqlens_q() == case.new_tokens() and list(inputs.seqlens) == case.seqlens()


def test_a_steps_parts_are_its_decoding_alone_and_its_chunks_alone_over_the_same_lengths():
    """The GPU preset holds every step's two parts, the CPU twin its first step's; a part is the whole less the other
    part's fields (the report matches them so: reports.build.MIXED_PARTS), and the whole's lengths are the decode
    part's then the prefill's."""
    from reports.build import MIXED_PARTS as REPORTED

    assert REPORTED == MIXED_PARTS
    for name, with_parts in (("serving-mixed", slice(None)), ("serving-mixed-cpu", slice(1))):
        ids = {c.id for c in PRESETS[name]}
        steps = [c for c in PRESETS[name] if c.mixed_parts()]
        assert steps and all({p.id for p in c.mixed_parts().values()} <= ids for c in steps[with_parts])
        for case in steps:
            parts = case.mixed_parts()
            assert parts["decode"].seqlens() + parts["prefill"].seqlens() == case.seqlens()
            assert parts["decode"].new_tokens() + parts["prefill"].new_tokens() == case.new_tokens()
            assert all(p.as_dict() == {**case.as_dict(), **MIXED_PARTS[n]} for n, p in parts.items())
    assert mixed(LLAMA3_8B, 64, 8192).mixed_parts() == {} == mixed(LLAMA3_8B, 0, 0, 2, 8).mixed_parts()


def test_the_peers_say_why_they_cannot_run_here():
    if torch.cuda.is_available():
        pytest.skip("a GPU: the suite checks the peers' mixed entries themselves")
    for name in ("flashinfer", "flash-attn2", "flash-attn3", "flash-attn4"):
        assert "cuda" in impls.get(name, "mixed").availability("cpu")


def test_triton_refuses_a_head_dim_outside_its_list_with_the_reason():
    inputs = batch([1, 3], [5, 9], head_dim=12, device=DEVICE)
    with pytest.raises(Unsupported, match="head dim 12 not supported"):
        impls.get("triton", "mixed").prepare(inputs)


@pytest.mark.slow
def test_triton_mixed_compiles_for_hopper_without_spills():
    """Llama-3-8B's and the 70B slice's groups at D 128, Qwen2.5's group of 7, and D 256, compiled for sm_90 as
    launched, whole and in the form that splits the decoding rows."""
    from tests.test_triton_compile import compiled

    forms = ("--arch 90 --mixed 4", "--arch 90 --mixed 8", "--arch 90 --mixed 7", "--arch 90 --mixed 2 --d 256")
    for result in compiled(*forms, *(f"{form} --split" for form in forms)):
        assert result["hgmma"] > 0 and result["stack"] == 0, result
