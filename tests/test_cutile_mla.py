"""cuTile's MLA decode: its launches (the split kernel, then the paged decode's combine), their arguments, and their
exports for sm_90. No GPU is needed: the launches are built over the CPU twins and compiled ahead of time."""

import os

import pytest
import torch

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from impls import Unsupported
from suite.presets import DEEPSEEK_V3_MLA_TP8, mla
from tests.cutile_helpers import named, sass


def call_of(case, sm_count: int = 1):
    from impls.cutile.mla_serving import MLACall, mla_form

    inputs = case.make_inputs("cpu")
    return inputs, MLACall(mla_form(inputs.page_size), inputs, scale=0.125, sm_count=sm_count)


def exported(call) -> list[bytes]:
    from impls.cutile.export import export_launch

    return [export_launch(kernel, arguments, arch="sm_90") for _, kernel, arguments in call.launches]


def test_a_split_step_compiles_with_the_paged_decodes_combine():
    """Widths that are not powers of two (48 + 16, padded to 64 + 16), pages of 16 joined into 32-key tiles, and a
    300-token cache cut into chunks on one SM: the split launch writes partials that the combine merges, one
    combine block per query head, and both compile."""
    from impls.cutile import mla as kernel

    _, call = call_of(mla(("", 4, 48, 16), 1, 300, page_size=16))
    assert call.num_splits > 1 and len(call.launches) == 2
    (grid, _, _), (combine_grid, combine, _) = call.launches
    split = named(call.launches[0])
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


@pytest.mark.slow
@pytest.mark.parametrize(("sq", "kv_dtype"), [(1, ""), (2, ""), (1, "fp8")])
def test_deepseek_steps_compile_on_tma_with_tensor_cores(sq, kv_dtype):
    """DeepSeek-V3 per GPU of 8 (16 heads, 512 + 64, pages of 64): 32-key tiles are half a page, loaded on TMA, and
    both products run on tensor cores."""
    _, call = call_of(mla(DEEPSEEK_V3_MLA_TP8, 1, 4096, sq=sq, kv_dtype=kv_dtype))
    assert call.num_splits > 1
    split, combine = exported(call)
    usage = sass(split)
    assert usage["utmaldg"] > 0 and usage["hmma"] + usage["hgmma"] > 0, usage
    assert combine[:4] == b"\x7fELF"
