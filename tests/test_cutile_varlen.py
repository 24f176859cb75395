"""cuTile's packed prefill (varlen): its candidate space, each candidate's launch, and their exports for sm_90.

No GPU is needed: the launches are built on the CPU and compiled ahead of time. The launches peel the diagonal
where every sequence is aligned and take a window and softcap; the SASS keeps the dense kernel's work, no stack, a
deeper pipeline where peeled, and no tensor map made at run time with the plain output store.
"""

import inspect
import os
from dataclasses import replace

import pytest
import torch

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from impls.contract import NO_WINDOW
from impls.cutile.spaces import HOPPER_WIDE, search_space
from suite.presets import uneven_varlen
from tests.cutile_helpers import named, sass, serving_inputs


def test_varlen_launches_compile():
    from impls.contract import Varlen
    from impls.cutile.export import export_launch
    from impls.cutile.serving import VarlenCall, varlen_space

    inputs = serving_inputs("varlen-cpu", 0)
    space = varlen_space((9, 0), inputs.head_dim, inputs.causal)
    assert not any(v.two_launch or v.dynamic or v.paired or v.planned for v in space)
    for head_dim in (64, 96, 128, 192, 256):  # the dense space's planned twins would time a candidate twice here
        for window in (False, True):
            forms = varlen_space((9, 0), head_dim, True, window=window)
            assert len(forms) == len(set(forms)), (head_dim, window)
    for head_dim in (64, 128, 256):  # every candidate makes its launch (D=128 causal: the dense space peels)
        cu = torch.tensor([0, 300, 1324], dtype=torch.int32)
        q = torch.empty((1324, 4, head_dim), dtype=torch.bfloat16)
        packed = Varlen(q, q[:, :2], q[:, :2], cu, cu, causal=True)
        for variant in varlen_space((9, 0), head_dim, True):
            assert VarlenCall(variant, packed, scale=0.125, sm_count=132).launches
    deferred = replace(HOPPER_WIDE, peel_diagonal=True, defer_pv=True)  # in the dense space; dense only
    assert deferred in search_space((9, 0), 128, causal=True) and deferred not in varlen_space((9, 0), 128, True)
    with pytest.raises(ValueError, match="defer_pv runs in the dense kernel only"):
        VarlenCall(deferred, packed, scale=0.125, sm_count=132)
    for variant in (space[0], next(v for v in space if v.persistent)):
        call = VarlenCall(variant, inputs, scale=0.125, sm_count=132)
        (grid, kernel, arguments), = call.launches
        assert grid[1:] == ((1, 1) if variant.persistent else (inputs.q.shape[1], inputs.batch))
        assert export_launch(kernel, arguments, arch="sm_90")[:4] == b"\x7fELF"


def test_varlen_peels_the_diagonal_where_every_sequence_is_aligned():
    """A packed batch runs a peeled candidate peeled where every sequence's keys start a whole number of 128-row
    tiles before its queries (ragged ends are fine: causal hides the keys past a sequence's end); otherwise, and
    without causal, with the masked loop, as a dense call that refuses the peel (the kernel gets DIAGONAL_TILES)."""
    from impls.cutile.serving import VarlenCall, varlen_candidates, varlen_resolved, varlen_space

    unwindowed, windowed = ([v for v in varlen_space((9, 0), 128, True, window=window) if v.peel_diagonal]
                            for window in (False, True))
    assert {(v.tile_m, v.tile_n, v.persistent) for v in unwindowed} == {(128, 128, False), (128, 128, True)}
    assert (128, 256, True) in {(v.tile_m, v.tile_n, v.persistent) for v in windowed}  # with a window only
    peeled = list(dict.fromkeys(unwindowed + windowed))
    ragged = uneven_varlen([300, 5, 1000], [300, 5, 1000], True, "cpu")
    chunked = uneven_varlen([300, 5, 200], [428, 133, 456], True, "cpu")  # keys 128, 128 and 256 ahead
    unaligned = uneven_varlen([300, 5], [364, 5], True, "cpu")  # 64 keys ahead
    full = uneven_varlen([300], [300], False, "cpu")
    for variant in peeled:
        for inputs, window, kept in ((ragged, NO_WINDOW, True), (chunked, NO_WINDOW, True),
                                     (unaligned, NO_WINDOW, False), (full, NO_WINDOW, False),
                                     (ragged, (256, 0), True), (ragged, (300, 0), False),
                                     (ragged, (128, 0), variant.tile_n == 128)):  # peel_narrow: left >= TILE_N
            label = (variant.label(), inputs.seqlens_k(), inputs.causal, window)
            assert varlen_resolved(variant, inputs, window).peel_diagonal == kept, label
            launch, = VarlenCall(variant, inputs, scale=0.1, sm_count=132, window=window).launches
            assert named(launch)["DIAGONAL_TILES"] == (1 if kept else 0), label
    resolved = varlen_candidates((9, 0), unaligned)
    assert not any(v.peel_diagonal for v in resolved) and len(resolved) == len(set(resolved))
    assert any(v.peel_diagonal for v in varlen_candidates((9, 0), ragged))


@pytest.mark.slow
def test_sm90_peeled_varlen_candidates_deepen_the_pipeline_without_spilling():
    """As the dense kernel's (test_sm90_peeled_candidates_deepen_the_pipeline_without_spilling), the packed
    prefill's peeled candidates get a deeper K/V pipeline than their masked loop (sm_90, tileiras 13.5, D=128:
    the persistent 128x128 99 -> 165 KB; with a window 99 / 132 -> 198 KB, the persistent 128x256 165 -> 230 KB)."""
    from impls.cutile.export import export_launch
    from impls.cutile.serving import VarlenCall, varlen_space

    inputs = uneven_varlen([3000, 1100, 5100], [3000, 1100, 5100], True, "cpu")
    for window in (NO_WINDOW, (4096, 0)):
        for variant in varlen_space((9, 0), 128, True, window=window != NO_WINDOW):
            if not variant.peel_diagonal or not variant.persistent:
                continue
            usage, looped = (sass(export_launch(*VarlenCall(form, inputs, scale=0.1, sm_count=132,
                                                            window=window).launches[0][1:], arch="sm_90"))
                             for form in (variant, replace(variant, peel_diagonal=False)))
            label = (variant.label(), window)
            # No stack: the persistent 128x128 once spilled 8 B, which reading each item one ahead
            # (as the dense planned loop does) took away, with tileiras 13.4 and 13.5.
            assert usage["stack"] == 0 and usage["ldl"] == usage["stl"] == 0 and usage["hgmma"] > 0, (label, usage)
            assert usage["shared"] >= 1.2 * looped["shared"], (label, usage["shared"], looped["shared"])


@pytest.mark.slow
@pytest.mark.parametrize(("causal", "window"), [(True, (4096, 0)), (False, (300, 200))])
def test_varlen_with_a_window_and_softcap_compiles(causal, window):
    """Gemma-2's local layers over a packed batch: each candidate of the windowed space makes its launch with the
    window's bounds and the softcap, and the first two-warpgroup one and the persistent one compile for sm_90
    without a stack."""
    from impls.contract import Varlen
    from impls.cutile import kernel
    from impls.cutile.export import export_launch
    from impls.cutile.serving import VarlenCall, varlen_space

    cu = torch.tensor([0, 5000, 5100, 9200], dtype=torch.int32)
    q = torch.empty((9200, 8, 256), dtype=torch.bfloat16)
    k = torch.empty((9200, 4, 256), dtype=torch.bfloat16)
    inputs = Varlen(q, k, k, cu, cu, causal=causal)
    space = varlen_space((9, 0), 256, causal, window=True)
    calls = [VarlenCall(v, inputs, scale=0.0625, sm_count=132, window=window, softcap=50.0) for v in space]
    names = list(inspect.signature(kernel.fmha_varlen._pyfunc).parameters)
    bounds = (window[0], 0) if causal else window
    for call in calls:
        (_, _, arguments), = call.launches
        bound = dict(zip(names, arguments, strict=True))
        assert (bound["window_left"], bound["window_right"]) == bounds, call.variant.label()
        assert bound["HAS_WINDOW"] and bound["SOFTCAP"] == 50.0, call.variant.label()
    # The two-warpgroup forms, as Gemma-2's dense picks (the 64x64 one spills 536-552 B at D=256 with a window)
    wide = [c for c in calls if c.variant.tile_m == 128]
    for call in (wide[0], next(c for c in wide if c.variant.persistent)):
        usage = sass(export_launch(*call.launches[0][1:], arch="sm_90"))
        assert usage["hgmma"] > 0 and usage["stack"] == 0, (call.variant.label(), usage)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_sm90_persistent_varlen_kernel_is_the_dense_persistent_kernel(causal):
    """The planned persistent varlen kernel runs the same tile work as one block per query tile: the same
    matrix instructions, TMA loads and no stack (a run-time row check inside the loop doubled the HGMMA and
    spilled, before the plan made it needless)."""
    from impls.contract import Varlen
    from impls.cutile.export import export_launch
    from impls.cutile.serving import VarlenCall, varlen_space

    cu = torch.tensor([0, 4096, 8192], dtype=torch.int32)
    q = torch.empty((8192, 8, 128), dtype=torch.bfloat16)
    k = torch.empty((8192, 2, 128), dtype=torch.bfloat16)
    inputs = Varlen(q, k, k, cu, cu, causal=causal)
    persistent = next(v for v in varlen_space((9, 0), 128, causal) if v.persistent)
    usage = [sass(export_launch(*VarlenCall(form, inputs, scale=0.125, sm_count=132).launches[0][1:],
                                arch="sm_90"))
             for form in (persistent, replace(persistent, persistent=False))]
    assert usage[0]["hgmma"] == usage[1]["hgmma"] > 0 and usage[0]["utmaldg"] == usage[1]["utmaldg"] > 0
    assert usage[0]["stack"] == 0 and usage[0]["ldl"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_sm90_varlen_plain_store_makes_no_tensor_map_at_run_time(monkeypatch, persistent):
    """The output of a packed sequence is the packed output sliced at run time: a TMA store of it makes a tensor
    map in the kernel and writes it to a global workspace (ATOMG.E.EXCH; memcheck flagged that write). The
    default store, plain, uses bounds-checked vector stores instead: no tensor map, no ATOMG."""
    from impls.cutile.export import export_launch
    from impls.cutile.serving import VarlenCall, varlen_space

    inputs = serving_inputs("varlen-cpu", 0)
    variant = next(v for v in varlen_space((9, 0), inputs.head_dim, inputs.causal) if v.persistent == persistent)
    monkeypatch.delenv("FMHA_VARLEN_STORE", raising=False)
    calls = {"plain": VarlenCall(variant, inputs, scale=0.125, sm_count=132)}  # the default
    monkeypatch.setenv("FMHA_VARLEN_STORE", "tma")
    calls["tma"] = VarlenCall(variant, inputs, scale=0.125, sm_count=132)
    usage = {}
    for store, call in calls.items():
        assert call.schedule()["output_store"] == store
        usage[store] = sass(export_launch(*call.launches[0][1:], arch="sm_90"))
    assert usage["tma"]["atomg"] > 0 and usage["tma"]["utmastg"] > 0
    assert usage["plain"]["atomg"] == 0 and usage["plain"]["utmastg"] == 0
    assert usage["plain"]["hgmma"] == usage["tma"]["hgmma"] and usage["plain"]["stack"] == 0
    assert VarlenCall(variant, inputs, scale=0.125, sm_count=132, store="plain").store == "plain"  # over the env
    monkeypatch.setenv("FMHA_VARLEN_STORE", "tensor-map")
    with pytest.raises(ValueError, match="FMHA_VARLEN_STORE='tensor-map': expected one of plain, tma"):
        VarlenCall(variant, inputs, scale=0.125, sm_count=132)
