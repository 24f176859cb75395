"""cuTile's mixed prefill and decode: its one launch over the host's work list compiles for sm_90 without a GPU, with
no stack at Llama-3-8B's and the 70B slice's groups; its body, emulated on CPU (tests/cutile_emulator.py), passes the
float64 oracle through the registered entry on the CPU twin's steps, and at small tiles over many query and key
tiles; and it refuses what it does not run, with the reason."""

import dataclasses
import math
import os

import pytest
import torch

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from impls import Unsupported, get
from impls.cutile.export import export_launch
from impls.cutile.launch import Launches
from impls.cutile.mixed_serving import MIXED_ROWS, MixedCall, MixedForm, prepare_mixed
from impls.cutile.serving import DecodeVariant
from suite.checks import Oracle
from suite.presets import LLAMA3_8B, LLAMA3_70B_TP8, PRESETS, mixed
from tests.cutile_helpers import named, needs_cuobjdump, sass
from tests.test_mixed import KERNEL_BATCHES, batch
from tests.tiers import first_fast


def emulated_launches(call: Launches) -> torch.Tensor:
    """A prepared call's launches, each run block by block with torch standing in for cuTile; what the call returns."""
    from impls.cutile import decode, kernel, mixed
    from tests.cutile_emulator import Emulator

    stand_in = Emulator([(kernel, ("softmax_step", "finite", "capped", "score_scale")),
                         (decode, ("key_tile", "page_loads", "page_of", "concatenate", "tile_scores", "fold",
                                   "whole_fold", "masked_fold")),
                         (mixed, ("mixed_attention",))])
    for grid, kernel_object, arguments in call.launches:
        stand_in.launch(grid, kernel_object, arguments)
    return call.out


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch):
    """The registered entry as it runs on a GPU, its launches emulated on CPU."""
    monkeypatch.setattr(Launches, "__call__", emulated_launches)
    return dataclasses.replace(get("cutile", "mixed"), devices=("cpu",))


def test_a_step_is_one_launch_over_its_work_list_and_compiles_without_stack():
    """Llama-3-8B's group of 4 at D 128: 64 rows are 16 new tokens, so a decode row is one item and a chunk of 40
    three; one block per (item, kv head), the kv heads of an item adjacent; compiled for sm_90 its products run on
    the warpgroup MMA, its pages load by TMA and nothing spills."""
    inputs = mixed(LLAMA3_8B, 3, 100, 2, 40, lengths="longtail").make_inputs("cpu")
    call = MixedCall(inputs, scale=0.125)
    (grid, kernel, arguments), = call.launches
    assert kernel._pyfunc.__name__ == "mixed_attention" and call.tokens == MIXED_ROWS // 4 == 16
    assert grid == ((3 + 2 * 3) * 8, 1, 1) and call.work.shape == (9, 2) and call.work.dtype == torch.int32
    launch = named(call.launches[0])
    assert (launch["GROUP"], launch["TOKENS"], launch["TILE_M"], launch["TILE_N"], launch["TILE_D"]) == (4, 16, 64, 64,
                                                                                                         128)
    usage = sass(export_launch(kernel, arguments, arch="sm_90"))
    assert usage["hgmma"] > 0 and usage["utmaldg"] > 0 and usage["stack"] == 0, usage


@pytest.mark.slow
@pytest.mark.parametrize(("model", "page_size"), [(LLAMA3_70B_TP8, 16), (LLAMA3_8B, 64), (("", 28, 4, 128), 16),
                                                  (("", 16, 8, 256), 16), (("", 32, 8, 96), 32)])
def test_model_groups_and_head_dims_compile_without_stack(model, page_size):
    """The 70B slice's group of 8, a page a key tile, Qwen2.5-7B's group of 7 (9 tokens a tile), D 256 (where the
    compiler keeps one block a SM) and Phi-3's 96 padded to 128."""
    inputs = mixed(model, 2, 300, 1, 70, page_size=page_size).make_inputs("cpu")
    (_, kernel, arguments), = MixedCall(inputs, scale=0.125).launches
    usage = sass(export_launch(kernel, arguments, arch="sm_90"))
    assert usage["hgmma"] > 0 and usage["utmaldg"] > 0 and usage["stack"] == 0, usage


ROW_GATHER_BATCH = ([1, 1, 70], [300, 9, 200], (32, 8), 24)  # pages of 24: no page load fits them


@pytest.mark.slow
def test_pages_no_key_tile_fits_are_gathered_by_rows():
    """The fixed form falls back to the paged decode's row gathers: compiled, and emulated within the oracle."""
    from impls.cutile import decode

    new_tokens, lengths, heads, page_size = ROW_GATHER_BATCH
    inputs = batch(new_tokens, lengths, heads=heads, page_size=page_size)
    call = MixedCall(inputs, scale=inputs.scale(None))
    assert named(call.launches[0])["GATHER"] == decode.ROWS
    assert export_launch(*call.launches[0][1:], arch="sm_90")[:4] == b"\x7fELF"
    result = Oracle.serving(inputs).check(emulated_launches(call))
    assert result.passed, result.message


@pytest.mark.slow
def test_a_cache_of_2_31_elements_is_read_through_word_views_or_64_bit_offsets(monkeypatch):
    """As the paged decode reads one (``serving.cache_operands``; faked here: the twin's caches): page loads through
    32-bit word views, on TMA; where a word view does not fit, the kernel's 64-bit twin."""
    import impls.cutile.serving
    from impls.cutile import decode

    inputs = mixed(LLAMA3_8B, 2, 100, 1, 40).make_inputs("cpu")
    monkeypatch.setattr(impls.cutile.serving, "needs_int64", lambda *tensors: True)
    words = MixedCall(inputs, scale=0.125)
    assert named(words.launches[0])["GATHER"] == decode.WORD_PAGES and words.cache_indexing == "32-bit word views"
    assert sass(export_launch(*words.launches[0][1:], arch="sm_90"))["utmaldg"] > 0
    monkeypatch.setattr(impls.cutile.serving, "word_view_fits", lambda *args: False)
    wide = MixedCall(inputs, scale=0.125)
    (_, kernel, arguments), = wide.launches
    assert kernel._pyfunc.__name__ == "mixed_attention" and wide.cache_indexing == "64-bit"
    assert kernel is not words.launches[0][1] and arguments[1].dtype == inputs.k_cache.dtype
    assert export_launch(kernel, arguments, arch="sm_90")[:4] == b"\x7fELF"


CPU_CASES = PRESETS["serving-mixed-cpu"]


@pytest.mark.parametrize("case", first_fast(CPU_CASES), ids=lambda c: c.id)
def test_the_registered_entry_passes_the_oracle_when_emulated_on_cpu(case, on_cpu):
    """The CPU twin's steps through the registered entry (fixed tiles of 64 rows and 64 keys), the kernel emulated:
    within the oracle's tolerance; fp32, which the kernel does not run, refused by the registry with the reason."""
    inputs = case.make_inputs("cpu")
    if inputs.q.dtype == torch.float32:
        with pytest.raises(Unsupported, match="dtype float32 not supported"):
            on_cpu.prepare(inputs)
        return
    prepared = on_cpu.prepare(inputs)
    result = Oracle.serving(inputs).check(prepared())
    assert result.passed, result.message
    assert prepared.config["work_items"] == sum(math.ceil(n / prepared.config["tokens_per_tile"])
                                                for n in inputs.seqlens_q())


SMALL_TILES = MixedForm(16, DecodeVariant(16, "pages"))  # many query and key tiles in the CPU batches


@pytest.mark.parametrize(("new_tokens", "lengths", "heads", "page_size"), first_fast(KERNEL_BATCHES, 1, unpack=True))
@pytest.mark.parametrize("variant", [SMALL_TILES, MixedForm(16, DecodeVariant(32, "rows"))], ids=["pages", "rows"])
def test_small_tiles_pass_the_oracle_when_emulated_on_cpu(new_tokens, lengths, heads, page_size, variant):
    """Tiles of 16 rows over 16 keys (page loads) or 32 keys (row gathers): chunks over several query tiles, key tiles
    whole and masked, a page of 32 read in halves, decode rows over an empty cache and caches that stop mid-page, MQA
    and a group of 3 (5 tokens a tile); every unused slot NaN."""
    inputs = batch(new_tokens, lengths, heads=heads, page_size=page_size)
    call = MixedCall(inputs, scale=inputs.scale(None), variant=variant)
    result = Oracle.serving(inputs).check(emulated_launches(call))
    assert result.passed, result.message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("new_tokens", "lengths", "heads", "page_size"),
                         [*KERNEL_BATCHES, ROW_GATHER_BATCH])
def test_the_compiled_kernel_passes_the_oracle(new_tokens, lengths, heads, page_size):
    """On a GPU, shapes the presets leave out: pages of 32 read in halves, a group of 3, MQA, an empty cache before
    one token, and pages of 24 that no page load fits."""
    inputs = batch(new_tokens, lengths, heads=heads, page_size=page_size, device="cuda")
    result = Oracle.serving(inputs).check(get("cutile", "mixed").prepare(inputs)())
    assert result.passed, result.message


def test_a_group_wider_than_a_tile_is_refused_with_the_reason():
    inputs = batch([1, 3], [5, 9], heads=(128, 1))
    with pytest.raises(Unsupported, match=r"128 query heads per kv head: .* at most 64 rows"):
        prepare_mixed(inputs, scale=0.1)


def test_head_dims_outside_the_list_are_refused_by_the_registry(on_cpu):
    with pytest.raises(Unsupported, match="head dim 12 not supported"):
        on_cpu.prepare(batch([1, 3], [5, 9], head_dim=12))


def test_the_sass_tool_prints_the_mixed_kernels_form_and_spills(capsys):
    from tools.cutile_sass import main

    needs_cuobjdump()
    main(["--mixed", "8", "--head-dim", "64"])
    line = capsys.readouterr().out
    assert line.startswith("mixed: group 8, {'tile_m': 64, 'tile_n': 64, 'read': 'pages'") and "'stack': 0" in line
