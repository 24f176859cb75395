"""cuTile's MLA decode: its launches (the split kernel, then the paged decode's combine), their arguments, and their
exports for sm_90. No GPU is needed: the launches are built over the CPU twins and compiled ahead of time."""

import os
from dataclasses import replace

import pytest
import torch

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from impls import Unsupported
from suite.checks import Oracle
from suite.presets import DEEPSEEK_V3_MLA_TP8, mla, preset
from tests.cutile_helpers import named, sass
from tests.tiers import first_fast


def call_of(case, sm_count: int = 1):
    from impls.cutile.mla_serving import MLACall, mla_form

    inputs = case.make_inputs("cpu")
    return inputs, MLACall(mla_form(inputs.page_size), inputs, scale=0.125, sm_count=sm_count)


def exported(call) -> list[bytes]:
    from impls.cutile.export import export_launch

    return [export_launch(kernel, arguments, arch="sm_90") for _, kernel, arguments in call.launches]


def test_a_split_step_compiles_with_the_paged_decodes_combine():
    """Widths that are not powers of two (48 + 16, padded to 64 + 16), pages of 16 joined into 64-key tiles, and a
    600-token cache cut into chunks on one SM: the split launch writes partials that the combine merges, one
    combine block per query head, and both compile."""
    from impls.cutile import mla as kernel

    _, call = call_of(mla(("", 4, 48, 16), 1, 600, page_size=16))
    assert call.num_splits > 1 and len(call.launches) == 2
    (grid, _, _), (combine_grid, combine, _) = call.launches
    split = named(call.launches[0])
    assert split["Work"].tolist() == [[0, chunk] for chunk in range(call.num_splits)]  # each chunk holds keys
    assert grid == (call.num_splits, 1, 1) and split["GATHER"] == kernel.PAGES and split["SPLIT"] is True
    assert (split["TILE_M"], split["TILE_L"], split["TILE_R"]) == (16, 64, 16)
    assert call.part.shape == (1, call.num_splits, 16, 64) and call.lse.shape == (1, call.num_splits, 16)
    assert combine._pyfunc.__name__ == "paged_decode_combine" and combine_grid[:2] == (1, 4)
    merged = named(call.launches[1])
    assert (merged["num_kv_heads"], merged["GROUP"], merged["SQ"], merged["PDL"]) == (1, 4, 1, False)
    assert all(cubin[:4] == b"\x7fELF" for cubin in exported(call))


def test_pages_no_tile_fits_are_gathered_by_rows_in_one_launch():
    """Pages of 24 hold no power-of-two tile whole: the rows are gathered through the table. A short batch on many
    SMs runs unsplit: one launch that writes the output itself."""
    from impls.cutile import mla as kernel

    _, call = call_of(mla(("", 4, 32, 8), 2, 100, page_size=24), sm_count=132)
    (launch,) = call.launches
    assert named(launch)["GATHER"] == kernel.ROWS and named(launch)["SPLIT"] is False
    assert exported(call)[0][:4] == b"\x7fELF"


def test_an_fp8_cache_folds_its_scale_and_keeps_its_dtype():
    """The caches go to the kernel as stored; the one scale is in the score scale and multiplies the output."""
    inputs, call = call_of(mla(("", 8, 64, 16), 3, 150, sq=2, page_size=16, lengths="longtail", kv_dtype="fp8"))
    split = named(call.launches[0])
    assert split["CKV"].dtype == split["KPE"].dtype == torch.float8_e4m3fn
    assert split["qk_scale"] == pytest.approx(0.125 * inputs.kv_scale) and split["kv_scale"] == inputs.kv_scale
    assert (split["HEADS"], split["SQ"], split["TILE_M"]) == (8, 2, 16)


def test_more_rows_than_a_tile_are_refused_with_the_reason():
    from impls.cutile.mla_serving import prepare_mla

    inputs = mla(("", 20, 32, 8), 1, 40, sq=2, page_size=16).make_inputs("cpu")
    with pytest.raises(Unsupported, match="20 query heads x 2 new tokens = 40 rows"):
        prepare_mla(inputs, scale=0.1)


@pytest.mark.parametrize(("sq", "kv_dtype"), first_fast([(1, ""), (2, ""), (1, "fp8")], unpack=True))
def test_deepseek_steps_compile_to_warpgroup_mma_with_no_stack(sq, kv_dtype):
    """DeepSeek-V3 per GPU of 8 (16 heads, 512 + 64, pages of 64), 16 and 32 rows: 64-key tiles are a page, loaded on
    TMA; with the keys as the products' rows both run on warpgroup MMA, and nothing spills (the query rows as the
    products' rows ran on HMMA with 416-1392 B of stack)."""
    _, call = call_of(mla(DEEPSEEK_V3_MLA_TP8, 1, 4096, sq=sq, kv_dtype=kv_dtype))
    assert call.num_splits > 1
    split, combine = exported(call)
    usage = sass(split)
    assert usage["utmaldg"] > 0 and usage["hgmma"] > 0 and usage["hmma"] == 0, usage
    assert usage["stack"] == usage["ldl"] == usage["stl"] == 0, usage
    assert combine[:4] == b"\x7fELF"


def test_the_sass_tool_refuses_more_rows_than_the_kernel_packs(capsys):
    from tools.cutile_sass import main

    with pytest.raises(SystemExit):
        main(["--mla", "40"])
    assert "--mla takes 1 to 32 query rows" in capsys.readouterr().err


def emulated(call) -> torch.Tensor:
    """A prepared call's launches (the split kernel, then the combine where it splits) run block by block on CPU."""
    from impls.cutile import decode, kernel, mla
    from tests.cutile_emulator import Emulator

    stand_in = Emulator([(mla, ("mla_decode_split", "fold_keys", "latent_tile", "page_rows")),
                         (decode, ("concatenate", "page_of", "first_tile", "paged_decode_combine")),
                         (kernel, ("softmax_step", "finite"))])
    for launch in call.launches:
        stand_in.launch(*launch)
    return call.out


# The CPU twins, and pages of 24 that no tile fits (row gathers), each as launched (64-key tiles: on one SM, one
# chunk a sequence) and with 16-key tiles, which cut the longer caches into chunks that the combine merges. The fast
# tier runs the fp8 twin as launched and the 300-token cache cut into 4 chunks.
TWINS = [*preset("mla-cpu"), mla(("", 4, 32, 8), 2, 100, page_size=24)]
FAST = [(TWINS[3], None), (TWINS[2], 16)]
EMULATED = FAST + [(case, tile_n) for tile_n in (None, 16) for case in TWINS if (case, tile_n) not in FAST]


@pytest.mark.parametrize(("case", "tile_n"), first_fast(EMULATED, fast=2, unpack=True),
                         ids=lambda v: getattr(v, "id", f"tile_n={v}"))
def test_the_kernel_passes_the_oracle_when_emulated_on_cpu(case, tile_n):
    """The transposed products, the softmax down the key axis, the page loads and row gathers, the masks, the chunks
    and their combine, emulated block by block: within the oracle's tolerance."""
    from impls.cutile.mla_serving import MLACall, mla_form

    inputs = case.make_inputs("cpu")
    form = mla_form(inputs.page_size)
    call = MLACall(replace(form, tile_n=tile_n or form.tile_n), inputs, scale=inputs.scale(None), sm_count=1)
    result = Oracle.serving(inputs).check(emulated(call))
    assert result.passed, result.message


def test_a_long_tailed_batch_runs_only_its_chunks_with_keys_and_passes_the_oracle():
    """Ragged caches of 300, 1, 77, 1 and 160 tokens cut into chunks of 7 tiles of 16 keys: a block per chunk that
    holds keys (8 of the 15 a grid of chunks x sequences would launch), the combine merging just those, within the
    oracle's tolerance. A sequence emptied after its checks (the contract has none: each holds its new token) keeps
    one block, which writes nothing its combine reads: its output is zeros and the others' are unchanged."""
    from impls.cutile.mla_serving import MLACall, mla_form

    lengths = [300, 1, 77, 1, 160]
    inputs = replace(mla(("", 4, 32, 8), len(lengths), 300, page_size=16).make_inputs("cpu"),
                     cache_seqlens=torch.tensor(lengths, dtype=torch.int32))
    form = replace(mla_form(inputs.page_size), tile_n=16)
    call = MLACall(form, inputs, scale=inputs.scale(None), sm_count=1)
    assert (call.num_splits, call.split_len, call.work.shape[0]) == (3, 112, 8)
    out = emulated(call).clone()
    result = Oracle.serving(inputs).check(out)
    assert result.passed, result.message

    inputs.cache_seqlens[1], inputs.seqlens = 0, (300, 0, 77, 1, 160)
    emptied = MLACall(form, inputs, scale=inputs.scale(None), sm_count=1)
    assert emptied.split_len == call.split_len and emptied.work.shape[0] == 8
    again = emulated(emptied)
    assert torch.equal(again[1], torch.zeros_like(again[1]))
    assert torch.equal(again[[0, 2, 3, 4]], out[[0, 2, 3, 4]])
