"""cuTile's paged decode: its kernel space, its split and combine launches, and their exports for sm_90.

No GPU is needed: the launches are built over the CPU twins and compiled ahead of time. Their SASS shows page loads
on TMA (fp8 caches, caches of 2**31 elements through word views, dense decode steps seen as pages), programmatic
dependent launch, and a combine small enough for many blocks per SM.
"""

import os
from dataclasses import replace

import pytest
import torch

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from tests.cutile_helpers import named, sass, serving_inputs
from tests.tiers import only_fast


def test_decode_space_reads_whole_pages_and_falls_back_to_rows():
    from impls.cutile.serving import ROWS_FALLBACK, DecodeVariant, decode_space

    assert {v.read for v in decode_space(16)} == {"pages", "indexed"}
    assert all(v.tile_n % 64 == 0 for v in decode_space(64))
    huge = decode_space(16, huge=True)
    assert huge and {(v.read, v.tile_n) for v in huge} == {("pages", 64)}  # 64-bit offsets: compiles in seconds
    assert decode_space(24) == [ROWS_FALLBACK]  # no power-of-two tile holds whole pages of 24
    # narrow heads add the 128-key page load with two blocks per SM (GPT-2's D=64), not wider ones
    narrow = DecodeVariant(128, "pages", occupancy=2)
    assert narrow in decode_space(16, head_dim=64) and narrow in decode_space(16, head_dim=48)
    assert narrow not in decode_space(16, head_dim=96) and narrow not in decode_space(16)


@pytest.fixture
def short_chunks(monkeypatch):
    """Chunks of one key tile: the CPU twins' short caches split (and need the combine) on one SM."""
    import impls._plans

    monkeypatch.setattr(impls._plans, "SPLIT_MIN_TILES", 1)


@pytest.mark.parametrize("read", only_fast(["pages", "indexed", "rows"], ["indexed"]))
def test_decode_launches_compile(read, short_chunks):
    from impls.cutile.export import export_launch
    from impls.cutile.serving import DecodeCall, DecodeVariant

    inputs = serving_inputs("serving-cpu", 4)  # MQA at batch 1, 300 tokens in pages of 16
    call = DecodeCall(DecodeVariant(64, read), inputs, scale=0.125, sm_count=1)  # one SM, one-tile chunks: split
    assert call.num_splits > 1 and len(call.launches) == 2  # the split launch, then the combine
    (_, rows, _), combine_rows = call.launches[1][0], 4  # one combine block per query head of the kv head
    assert rows == combine_rows
    for _, kernel, arguments in call.launches:
        assert export_launch(kernel, arguments, arch="sm_90")[:4] == b"\x7fELF"


@pytest.mark.slow
def test_decode_split_steps_launch_as_programmatic_dependents(short_chunks):
    """Where a step splits, both launches may run as programmatic dependents of the kernel before them (the
    default on Hopper, ``DecodeVariant.pdl`` forces it here): each then waits for that grid before anything else
    (ACQBULK) and lets its successor launch (PREEXIT); without it neither instruction. Off the GPU the default is
    off."""
    from impls.cutile.export import export_launch
    from impls.cutile.serving import DecodeCall, DecodeVariant

    inputs = serving_inputs("serving-cpu", 4)  # MQA at batch 1, 300 tokens: split on one SM
    assert not DecodeCall(DecodeVariant(64), inputs, scale=0.125, sm_count=1).dependent_launch
    calls = {pdl: DecodeCall(DecodeVariant(64, pdl=pdl), inputs, scale=0.125, sm_count=1) for pdl in (True, False)}
    for pdl, call in calls.items():
        assert call.dependent_launch is pdl and len(call.launches) == 2
        for launch in call.launches:
            assert named(launch)["PDL"] is pdl
            usage = sass(export_launch(*launch[1:], arch="sm_90"))
            assert (usage["acqbulk"], usage["preexit"]) == ((1, 1) if pdl else (0, 0)), (pdl, usage)


@pytest.mark.slow
@pytest.mark.parametrize("read", ["pages", "indexed"])
def test_decode_with_a_window_softcap_and_a_padded_head_dim_compiles(read, short_chunks):
    """Gemma-2's local layers (a window, softcap) and Phi-3's head dim 96 (padded to a tile of 128): the chunks
    cut only what the window shows, from the tile that holds its first position, and both launches compile."""
    from impls.cutile.export import export_launch
    from impls.cutile.serving import DecodeCall, DecodeVariant
    from suite.presets import paged

    inputs = paged(("", 4, 1, 96), 1, 300).make_inputs("cpu")
    call = DecodeCall(DecodeVariant(64, read), inputs, scale=0.125, sm_count=1, window_left=150, softcap=30.0)
    assert call.part.shape[-1] == 128  # the partial outputs are a tile wide
    # 151 positions read, from tile 2 (positions 128 on): 3 tiles, so 3 one-tile chunks on one SM
    assert (call.num_splits, call.split_len) == (3, 64)
    for _, kernel, arguments in call.launches:
        assert export_launch(kernel, arguments, arch="sm_90")[:4] == b"\x7fELF"


@pytest.mark.slow
@pytest.mark.parametrize("read", ["pages", "indexed", "rows"])
def test_decode_over_an_fp8_cache_compiles(read, short_chunks):
    """An fp8 cache's tiles are loaded as stored (page loads on TMA) and widened after each load; the split
    launch takes the scales (k's folded into the score scale, v's as an argument) and both launches compile. The
    64-key page load with two blocks per SM (in the space) keeps no stack on sm_90."""
    from impls.cutile.export import export_launch
    from impls.cutile.serving import DecodeCall, DecodeVariant
    from impls.sass import find_cuobjdump, sass_summary
    from suite.presets import paged

    inputs = paged(("", 4, 1, 128), 1, 300, kv_dtype="fp8").make_inputs("cpu")
    form = DecodeVariant(64, read, occupancy=2 if read == "pages" else None)
    call = DecodeCall(form, inputs, scale=0.125, sm_count=1)
    split, _ = call.launches  # the split launch, then the combine
    arguments = named(split)
    assert arguments["KCache"].dtype == torch.float8_e4m3fn and arguments["qk_scale"] == 0.125 * inputs.k_scale
    assert arguments["v_scale"] == inputs.v_scale
    assert arguments["F16_DOT"] is True  # bf16 queries over fp8 run their dots in fp16 (decode.py)
    fp16_queries = replace(inputs, q=inputs.q.half())  # fp16 widens in one step already
    assert named(DecodeCall(form, fp16_queries, scale=0.125, sm_count=1).launches[0])["F16_DOT"] is False
    cubins = [export_launch(k, a, arch="sm_90") for _, k, a in call.launches]
    assert all(cubin[:4] == b"\x7fELF" for cubin in cubins)
    if read == "pages" and find_cuobjdump() is not None:
        usage = sass_summary(cubins[0])
        assert usage["utmaldg"] > 0 and usage["stack"] == 0, usage


@pytest.mark.slow
def test_a_cache_of_2_31_elements_is_read_through_word_views_with_tma(monkeypatch):
    """cuTile reads an array indexed in 64 bits without TMA (sm_90: no UTMALDG, about twice the integer work).
    A cache of 2**31 elements or more (faked: the twin's) goes through 32-bit word views instead: its page
    loads compile as for a small cache, TMA included; a cache the word view does not fit keeps 64 bits."""
    import impls.cutile.serving
    from impls.cutile import decode
    from impls.cutile.export import export_launch
    from impls.cutile.serving import DecodeCall, DecodeVariant, decode_space, decode_space_for
    from impls.sass import find_cuobjdump, sass_summary

    inputs = serving_inputs("serving-cpu", 4)  # MQA at batch 1, 300 tokens in pages of 16, head dim 64
    assert decode_space_for(inputs) == decode_space(16, head_dim=64)
    small = DecodeCall(DecodeVariant(64), inputs, scale=0.125, sm_count=132)
    monkeypatch.setattr(impls.cutile.serving, "needs_int64", lambda *tensors: True)
    huge = DecodeCall(DecodeVariant(64), inputs, scale=0.125, sm_count=132)
    (_, kernel, _), = huge.launches
    arguments = named(huge.launches[0])
    assert kernel._pyfunc.__name__ == "paged_decode_split" and arguments["KCache"].dtype == torch.int32
    assert arguments["GATHER"] == decode.WORD_PAGES
    assert (small.cache_indexing, huge.cache_indexing) == ("32-bit", "32-bit word views")
    assert {v.read for v in decode_space(16, huge=True, words=True)} == {"pages"}
    assert len(decode_space(16, huge=True, words=True)) > len(decode_space(16, huge=True))
    assert decode_space_for(inputs) == decode_space(16, huge=True, words=True, head_dim=64)  # what the tuner tries
    monkeypatch.setattr(impls.cutile.serving, "word_view_fits", lambda *args: False)
    wide = DecodeCall(DecodeVariant(64), inputs, scale=0.125, sm_count=132)
    (_, wide_kernel, wide_arguments), = wide.launches
    assert wide_kernel is not kernel and wide_arguments[1].dtype == inputs.k_cache.dtype
    assert wide.cache_indexing == "64-bit"
    if find_cuobjdump() is None:
        pytest.skip("cuobjdump not found")
    usage = [sass_summary(export_launch(k, a, arch="sm_90"))
             for _, k, a in (small.launches[0], huge.launches[0], (None, wide_kernel, wide_arguments))]
    assert usage[1]["utmaldg"] == usage[0]["utmaldg"] > 0 and usage[1]["reg"] == usage[0]["reg"], usage
    assert usage[2]["utmaldg"] == 0, usage  # why: 64-bit indexing loses TMA


@pytest.mark.slow
@pytest.mark.parametrize("tile_n", [64, 128])
def test_a_dense_decode_step_compiles_as_page_loads_of_the_dense_cache(tile_n, short_chunks):
    """A dense decode step as the dense ``cutile`` entry hands it to the decode (``impls._plans.dense_as_paged``):
    the caches are views whose pages overlap other heads' rows (strides not in order), and their page loads still
    compile to TMA; the view's element count is past 2**31 while no offset into it is, so it keeps 32-bit
    indexing."""
    from impls._plans import dense_as_paged
    from impls.cutile.config import needs_int64
    from impls.cutile.export import export_launch
    from impls.cutile.serving import DecodeCall, DecodeVariant

    q = torch.empty(2, 8, 1, 128, dtype=torch.bfloat16)
    k, v = (torch.empty(2, 2, 1024, 128, dtype=torch.bfloat16) for _ in range(2))
    inputs = dense_as_paged(q, k, v, causal=True)
    assert inputs.page_size == 256 and inputs.k_cache.stride() == (256 * 128, 128, 1024 * 128, 1)
    call = DecodeCall(DecodeVariant(tile_n, plan_programs=8), inputs, scale=0.125, sm_count=1)
    assert call.num_splits > 1 and call.cache_indexing == "32-bit"
    cubins = [export_launch(kernel, arguments, arch="sm_90") for _, kernel, arguments in call.launches]
    assert all(cubin[:4] == b"\x7fELF" for cubin in cubins)
    assert sass(cubins[0])["utmaldg"] > 0
    # 16 sequences x 8 kv heads x 32K x 128 (2**29 elements) as pages of 256: 15 sequences' pages, all 8 heads', and
    # the last one's own (dense_as_paged's view, made here without the tensors' data)
    view = torch.empty(16, 8, 32768, 128, device="meta").as_strided(
        ((15 * 8 + 1) * 128, 256, 8, 128), (256 * 128, 128, 32768 * 128, 1))
    assert view.numel() >= 2**31 and not needs_int64(view) and needs_int64(torch.empty(2**31, device="meta"))


@pytest.mark.slow
def test_a_dense_decode_step_of_any_length_compiles_as_row_gathers_of_one_page():
    """A length that no page size of 16-256 divides is one page a sequence: cuTile's page loads need pages of whole
    tiles, so its decode space is the row gather, which compiles for such a page."""
    from impls._plans import dense_as_paged
    from impls.cutile.export import export_launch
    from impls.cutile.serving import ROWS_FALLBACK, DecodeCall, decode_space_for

    q = torch.empty(2, 8, 1, 128, dtype=torch.bfloat16)
    k, v = (torch.empty(2, 2, 300, 128, dtype=torch.bfloat16) for _ in range(2))
    inputs = dense_as_paged(q, k, v, causal=True)
    assert inputs.page_size == 300 and decode_space_for(inputs) == [ROWS_FALLBACK]
    call = DecodeCall(ROWS_FALLBACK, inputs, scale=0.125, sm_count=1)
    for _, kernel, arguments in call.launches:
        assert export_launch(kernel, arguments, arch="sm_90")[:4] == b"\x7fELF"


def test_decode_combine_is_small_enough_for_many_blocks_per_sm(short_chunks):
    """The combine's occupancy hint reaches the compiler: few registers, little shared memory (the
    combine, left to the compiler, took 255 registers and ran two blocks per SM)."""
    from impls.cutile.export import export_launch
    from impls.cutile.serving import DecodeCall, DecodeVariant
    from impls.sass import find_cuobjdump, sass_summary

    if find_cuobjdump() is None:
        pytest.skip("cuobjdump not found")
    call = DecodeCall(DecodeVariant(64), serving_inputs("serving-cpu", 4), scale=0.125, sm_count=1)
    _, kernel, arguments = call.launches[1]
    usage = sass_summary(export_launch(kernel, arguments, arch="sm_90"))
    assert usage["reg"] <= 64 and usage["shared"] <= 8192 and usage["stack"] == 0, usage


def test_decode_combine_in_head_dim_slices_compiles(monkeypatch, short_chunks):
    import impls._plans
    from impls.cutile.export import export_launch
    from impls.cutile.serving import DecodeCall, DecodeVariant

    monkeypatch.setattr(impls._plans, "COMBINE_STEP_ELEMENTS", 32)  # as hundreds of chunks would make it
    call = DecodeCall(DecodeVariant(64), serving_inputs("serving-cpu", 4), scale=0.125, sm_count=1)
    (_, _, slices), kernel, arguments = call.launches[1]
    assert slices == 4  # head dim 64 in slices of 16
    assert export_launch(kernel, arguments, arch="sm_90")[:4] == b"\x7fELF"


def test_decode_without_a_split_writes_the_output_directly():
    from impls.cutile.serving import DecodeCall, DecodeVariant

    inputs = serving_inputs("serving-cpu", 1)
    call = DecodeCall(DecodeVariant(64), inputs, scale=0.125, sm_count=132)
    assert call.num_splits == 1 and len(call.launches) == 1
