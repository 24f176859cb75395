"""Every cuTile kernel compiles to a cubin for each architecture, and the hints reach the compiler.

No GPU is needed: ``cuda.tile.compilation.export_kernel`` runs the whole compiler (tileiras) ahead of time.
"""

import inspect
import itertools
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from impls.contract import NO_WINDOW
from impls.cutile.config import Variant, head_tiles, tile_d
from impls.cutile.export import export_cubin, export_phases
from impls.cutile.spaces import HOPPER_DYNAMIC, HOPPER_STREAMING, HOPPER_WIDE, LADDER, other_forms, search_space
from impls.sass import find_cuobjdump, hgmma_runs, sass_summary, softmax_overlap
from suite.cases import uneven_varlen
from tests.tiers import first_fast, only_fast

ARCHS = ["sm_80", "sm_90", "sm_100", "sm_120"]
# The fast tier compiles the first ladder step on every architecture and each head dim once; -m slow, the rest.
FIRST_STEP = next(iter(LADDER))
ROOT = Path(__file__).resolve().parent.parent


def named(launch: tuple) -> dict:
    """A prepared launch's (grid, kernel, arguments) as the kernel's parameter names and their arguments."""
    _, kernel, arguments = launch
    return dict(zip(inspect.signature(kernel._pyfunc).parameters, arguments, strict=True))


def sass(cubin: bytes) -> dict[str, int]:
    """Registers, stack, shared memory and instruction counts of a cubin (skips where cuobjdump is missing,
    except in CI)."""
    if not find_cuobjdump() and not os.environ.get("CI"):
        pytest.skip("needs cuobjdump (pip install nvidia-cuda-cuobjdump, or triton)")
    return sass_summary(cubin)


@pytest.mark.parametrize(("name", "arch"), only_fast(itertools.product(LADDER, ARCHS),
                                                    [(FIRST_STEP, arch) for arch in ARCHS], unpack=True))
def test_ladder_kernel_compiles(name, arch):
    variant, _ = LADDER[name]
    # causal with a ragged Skv compiles every branch: the unmasked loop, both masks and the division.
    cubin = export_cubin(variant, arch=arch, causal=True, even_n=False)
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("name", first_fast(name for name, (v, _) in LADDER.items() if not v.loop_split))
def test_ladder_kernel_without_a_mask_does_the_matrix_work(name):
    # Non-causal, Skv a multiple of the tile: nothing to mask, and the steps before the loop split still run
    # every key tile (a loop-structure slip once compiled them to kernels with no loop at all, writing zeros).
    usage = sass(export_cubin(LADDER[name][0], arch="sm_90", causal=False, even_n=True))
    assert usage["hgmma"] > 0, usage


@pytest.mark.parametrize(("capability", "causal"), only_fast([((9, 0), False), ((9, 0), True), ((10, 0), False)],
                                                           [((10, 0), False)], unpack=True))
def test_search_space_compiles(capability, causal):
    # Causal on sm_90 adds the kernel's other forms: two launches and the dynamic scheduler (sweep candidates;
    # the scheduler compiles with bytecode 13.4 too, where other_forms leaves it out).
    arch = f"sm_{capability[0]}{capability[1]}"
    extra = list(dict.fromkeys([*other_forms(), HOPPER_DYNAMIC])) if causal and capability == (9, 0) else []
    for variant in search_space(capability, 64, causal=causal) + extra:
        for _, cubin in export_phases(variant, arch=arch, dtype=torch.bfloat16, head_dim=64, causal=causal):
            assert cubin[:4] == b"\x7fELF"


NEW_HEAD_DIMS = [32, 80, 96, 192, 256]  # the model widths besides 64 and 128 (which every other test compiles)


@pytest.mark.parametrize(("arch", "head_dim"), only_fast(
    itertools.product(ARCHS, NEW_HEAD_DIMS), [("sm_120", 32), ("sm_100", 80), ("sm_90", 96), ("sm_100", 192),
                                              ("sm_90", 256)], unpack=True))
def test_new_head_dims_compile(head_dim, arch):
    """A head dim that is not a power of two runs as one power-of-two tile and a tail (96 = 64 + 32) or padded in
    the next one (zero-padded loads, clipped stores); the first candidate of each architecture's space for that
    width, causal and ragged, compiles on every architecture."""
    capability = (int(arch[3:-1]), int(arch[-1]))
    variant = search_space(capability, head_dim, causal=True)[0]
    cubin = export_cubin(variant, arch=arch, dtype=torch.bfloat16, head_dim=head_dim, causal=True, even_n=False)
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", only_fast(ARCHS, ["sm_90"]))
def test_mla_value_dim_compiles(arch):
    # DeepSeek's MLA prefill: Q and K 192 wide, V and the output 128, on every architecture.
    capability = (int(arch[3:-1]), int(arch[-1]))
    variant = search_space(capability, 192, causal=True, value_dim=128)[0]
    cubin = export_cubin(variant, arch=arch, dtype=torch.bfloat16, head_dim=192, value_dim=128, causal=True,
                         even_n=False)
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", only_fast(["sm_90", "sm_100"], ["sm_100"]))
def test_window_and_softcap_compile(arch):
    # Gemma 2's local layers (sliding window and softcap, D=256 here, 128 on the others); on sm_90 the first
    # candidate of the space must not spill.
    capability = (int(arch[3:-1]), int(arch[-1]))
    head_dim = 256 if arch == "sm_90" else 128
    variant = search_space(capability, head_dim, causal=True)[0]
    cubin = export_cubin(variant, arch=arch, dtype=torch.bfloat16, head_dim=head_dim, causal=True, even_n=False,
                         window=True, softcap=50.0)
    assert cubin[:4] == b"\x7fELF"
    if arch == "sm_90":
        usage = sass(cubin)
        assert usage["stack"] == 0 and usage["hgmma"] > 0, usage


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [128, 256])
def test_sm90_windowed_kernel_has_the_causal_kernels_loops(head_dim):
    """A window's far-edge tiles run in the diagonal's masked loop, not a third loop: the windowed kernel issues
    as many matrix products and TMA loads as the causal one (a third loop cost the persistent 128x256 its
    registers: 11-15 spilled words). The persistent candidates a window adds do not spill. Each as it runs
    where the lengths are not whole tiles: with the masked loop (peeled, the far edge is straight-line code
    of its own, test_sm90_peeled_candidates_deepen_the_pipeline_without_spilling)."""
    space = search_space((9, 0), head_dim, causal=True, window=True)
    added = [v for v in space if v not in search_space((9, 0), head_dim, causal=True)]
    assert added and all(v.persistent for v in added)
    for variant in [replace(v, peel_diagonal=False) for v in (space[0], *added)]:
        windowed, causal = (sass(export_cubin(variant, arch="sm_90", dtype=torch.bfloat16, head_dim=head_dim,
                                              causal=True, window=on)) for on in (True, False))
        assert (windowed["hgmma"], windowed["utmaldg"]) == (causal["hgmma"], causal["utmaldg"]), variant.label()
        assert windowed["stack"] == 0, (variant.label(), windowed)


@pytest.mark.slow
def test_fast_math_softcap_is_one_hardware_tanh_per_score():
    # Gemma 2's softcap: the tuned kernel (fast math) takes the hardware's tanh; the precise one, a dozen
    # instructions per score, is left to the fast_math=False form.
    variant = search_space((9, 0), 256, causal=True)[1]
    fast, precise = (sass(export_cubin(replace(variant, fast_math=on), arch="sm_90", dtype=torch.bfloat16,
                                       head_dim=256, causal=True, softcap=50.0)) for on in (True, False))
    assert fast["mufu_tanh"] > 0 and precise["mufu_tanh"] == 0, (fast, precise)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_mla_candidates_compile_without_spills(causal):
    """DeepSeek's MLA prefill: Q/K 192 wide (128 + 64), V and the output 128. The accumulator takes the value
    width, so the Hopper space is the 128-wide one (two-warpgroup 128x128 tiles; not the 256-wide space of
    64-key tiles), less 128x64 with occupancy 2 and the causal 256-key tile, which spill; nothing left does,
    with whole key tiles or a ragged last one. Blocks of 128 query rows read K's 64-column tail from the head
    tile's load (kernel.head_and_tail), so Q K^T issues its 12 HGMMAs as one run: loaded apart, the compiler
    waited for the first product before it issued the second (8 HGMMAs, a WARPGROUP.DEPBAR wait, 4 more) every
    key tile. The one-warpgroup blocks keep two loads (kernel.one_load)."""
    space = search_space((9, 0), 192, causal=causal, value_dim=128)
    shapes = {(v.tile_m, v.tile_n) for v in space}
    assert (128, 128) in shapes and (128, 64) not in shapes and ((128, 256) in shapes) is not causal
    assert search_space((9, 0), 192, causal=causal) == search_space((9, 0), 192, causal=causal, value_dim=192)
    for variant, even_n in itertools.product(space, (True, False)):
        cubin = export_cubin(variant, arch="sm_90", dtype=torch.bfloat16, head_dim=192, value_dim=128,
                             causal=causal, even_n=even_n)
        usage = sass(cubin)
        assert usage["stack"] == 0 and usage["hgmma"] > 0, (variant.label(), even_n, usage)
        if variant.tile_m >= 128:
            runs = hgmma_runs(cubin)
            assert 12 in runs and 4 not in runs, (variant.label(), even_n, runs)
    q = torch.empty((1, 2, 100, 192), device="meta", dtype=torch.bfloat16)
    assert Variant(64, 64, two_launch=True).state(q, 128)[2].shape == (1, 2, 100, 128)


@pytest.mark.slow
@pytest.mark.parametrize(("head_dim", "value_dim"), [(128, None), (192, 128), (256, None)])
def test_deferred_candidates_overlap_the_softmax_with_the_previous_tiles_product(head_dim, value_dim):
    """Variant.defer_pv: written with each mask-free tile's P V issued in the next step, the causal
    candidates that won with it on the H200 (MLA's peeled 128x128 forms, D=128's peeled one-block-a-tile 128x128,
    D=256's 128x64) issue P V's HGMMAs between the next tile's exponentials, with no stack; written plainly, the
    compiler waits for each product before or after the softmax (sm_90, tileiras 13.5: it overlaps them by
    itself only in the non-causal persistent loop). Only causal spaces without a window take them."""
    space = search_space((9, 0), head_dim, causal=True, value_dim=value_dim)
    deferred = [v for v in space if v.defer_pv and not v.planned]  # the planned twins: their own test
    assert len(deferred) == (3 if value_dim else 1 if head_dim == 128 else 2)
    assert all(replace(v, defer_pv=False) in space for v in deferred)
    for window, causal in ((True, True), (False, False)):
        assert not any(v.defer_pv for v in search_space((9, 0), head_dim, causal=causal, value_dim=value_dim,
                                                        window=window))
    for variant in deferred:
        cubins = [export_cubin(v, arch="sm_90", dtype=torch.bfloat16, head_dim=head_dim, value_dim=value_dim,
                               causal=True) for v in (variant, replace(variant, defer_pv=False))]
        usage = sass(cubins[0])
        assert usage["stack"] == 0 and usage["hgmma"] > 0, (variant.label(), usage)
        assert softmax_overlap(cubins[0]) > 0 == softmax_overlap(cubins[1]), variant.label()


def test_head_dims_pad_to_the_next_power_of_two():
    assert [tile_d(d) for d in (16, 32, 40, 64, 80, 96, 128, 136, 192, 256)] == [
        16, 32, 64, 64, 128, 128, 128, 256, 256, 256]


def test_head_dims_run_as_a_power_of_two_and_a_narrower_tail():
    # 96 = 64 + 32 instead of 128 padded: a quarter less matrix work; no tail where it would save nothing.
    assert {d: head_tiles(d) for d in (16, 40, 64, 72, 80, 96, 112, 128, 160, 192, 224, 256)} == {
        16: (16, 0), 40: (32, 16), 64: (64, 0), 72: (64, 16), 80: (64, 16), 96: (64, 32), 112: (128, 0),
        128: (128, 0), 160: (128, 32), 192: (128, 64), 224: (256, 0), 256: (256, 0)}
    for d in range(16, 257, 8):
        first, tail = head_tiles(d)
        assert first + tail >= d and tail < first and head_tiles(d, tail=False) == (tile_d(d), 0)
    assert Variant(64, 64).head_tiles(192, 128) == (128, 64, 128, 0)
    assert Variant(64, 64, head_tail=False).head_tiles(96) == (128, 0, 128, 0)


@pytest.mark.parametrize(("causal", "head_dim"), only_fast(
    itertools.product([False, True], [32, 40, 80, 96, 128, 192, 256]), [(False, 40)], unpack=True))
def test_sm90_two_warpgroup_candidate_never_spills(head_dim, causal):
    """Every head dim has a candidate of the Hopper space without stack, whatever the keys' raggedness
    and the dtype: the two-warpgroup block (128 x 128, or 128 x 64 keys with a 256-wide accumulator). A few
    others hold 8-80 B of stack in some of those combinations (hopper_space's docstring lists them); the
    tuner times each compiled kernel, so one whose spill costs is not picked."""
    two_warpgroups = replace(HOPPER_WIDE, tile_n=64 if tile_d(head_dim) > 128 else 128)
    space = search_space((9, 0), head_dim, causal=causal)
    assert two_warpgroups in space or replace(two_warpgroups, peel_diagonal=True) in space  # peeled where aligned
    for dtype, even_n in itertools.product((torch.float16, torch.bfloat16), (True, False)):
        usage = sass(export_cubin(two_warpgroups, arch="sm_90", dtype=dtype, head_dim=head_dim, causal=causal,
                                  even_n=even_n))
        assert usage["stack"] == 0 and usage["hgmma"] > 0, (dtype, even_n, usage)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_head_tail_candidates_do_not_spill(causal):
    # Every Hopper candidate at D=96 (64 + 32) keeps its two accumulators in registers.
    for variant in search_space((9, 0), 96, causal=causal):
        usage = sass(export_cubin(variant, arch="sm_90", dtype=torch.bfloat16, head_dim=96, causal=causal))
        assert usage["stack"] == 0 and usage["hgmma"] > 0, (variant.label(), usage)


@pytest.mark.slow
@pytest.mark.parametrize(("head_dim", "value_dim", "window"),
                         [(128, None, False), (128, None, True), (192, 128, False)])
def test_sm90_peeled_candidates_deepen_the_pipeline_without_spilling(head_dim, value_dim, window):
    """peeled_space: with the diagonal's masked tiles as straight-line code, each peeled candidate of the Hopper
    space keeps no stack and gets more shared memory for its K/V pipeline than the same form with the masked loop
    (99 / 132 -> 165 KB at D=128, 149 -> 214 KB for MLA, 198 KB with a window; the paired 128x256, its diagonal
    peeled in 128-key tiles, 161 -> 225 KB, its window's far edge too). See docs/design.md#cutile-forward."""
    peeled = [v for v in search_space((9, 0), head_dim, causal=True, value_dim=value_dim, window=window)
              if v.peel_diagonal]
    assert len(peeled) >= 3
    for variant in peeled:
        usage, looped = (sass(export_cubin(v, arch="sm_90", dtype=torch.bfloat16, head_dim=head_dim,
                                           value_dim=value_dim, causal=True, window=window))
                         for v in (variant, replace(variant, peel_diagonal=False, defer_pv=False)))
        assert usage["stack"] == 0 and usage["hgmma"] > 0, (variant.label(), usage)
        assert usage["shared"] > looped["shared"], (variant.label(), usage["shared"], looped["shared"])
        if variant.tile_n > variant.tile_m:  # peel_narrow: 165 -> 225 KB, causal and windowed alike; a run-time
            # branch around its diagonal block (caught in the SASS) had left it at 193 KB, 1.2x
            assert usage["shared"] >= 1.3 * looped["shared"], (variant.label(), usage["shared"], looped["shared"])


@pytest.mark.parametrize(("head_dim", "value_dim"), first_fast([(64, None), (128, None), (192, 128)], unpack=True))
def test_sm90_planned_candidates_compile_as_their_paired_twins(head_dim, value_dim):
    """Variant.planned changes where a persistent block's items come from (the host's plan, by loads) and nothing
    in the loop: the same registers, K/V pipeline and products as the paired form, and no more stack. (A few bytes
    of stack come and go with the compiler: tileiras 13.4 gives the D=128 128x256 8 B in both forms, 13.5 the
    paired D=64 one 8 B and its planned twin none.)"""
    planned = [v for v in search_space((9, 0), head_dim, causal=True, value_dim=value_dim) if v.planned]
    assert planned
    for variant in planned:
        usage, paired = (sass(export_cubin(v, arch="sm_90", dtype=torch.bfloat16, head_dim=head_dim,
                                           value_dim=value_dim, causal=True))
                         for v in (variant, replace(variant, planned=False, paired=True)))
        assert usage["stack"] <= paired["stack"] and usage["hgmma"] == paired["hgmma"] > 0, (variant.label(), usage)
        assert {f: usage[f] for f in ("reg", "shared")} == {f: paired[f] for f in ("reg", "shared")}, variant.label()


def test_planned_share_runs_each_query_tile_once_from_the_hosts_plan(monkeypatch):
    # The plan's arrays as the kernel reads them: block b runs WorkItems[WorkStarts[b]:WorkStarts[b + 1]], an item
    # (batch * num_m + query tile) * heads + head, decoded here as fmha_fwd decodes it.
    import impls.cutile.config

    monkeypatch.setattr(impls.cutile.config, "device_sm_count", lambda *args, **kwargs: 5)
    batch, heads, q_len, kv_len, num_m = 2, 3, 1000, 1100, 8  # 128-row tiles, the last one ragged
    q = torch.empty((batch, heads, q_len, 64))
    variant = replace(HOPPER_STREAMING, tile_n=256, planned=True)
    starts, items = variant.state(q, kv_len=kv_len)[-2:]
    assert starts.dtype == items.dtype == torch.int32 and len(starts) == variant.grid(q)[0] + 1 == 6
    assert starts[0] == 0 and starts[-1] == len(items) and bool((starts[1:] >= starts[:-1]).all())
    decoded = [(rest % num_m, rest // num_m * heads + item % heads) for item in items.tolist()
               for rest in [item // heads]]
    assert sorted(decoded) == [(t, bh) for t in range(num_m) for bh in range(batch * heads)]
    assert all(t.numel() == 1 for t in Variant(64, 64).state(q)[-2:])  # no plan: placeholders


@pytest.mark.parametrize("other", [dict(persistent=False), dict(paired=True), dict(dynamic=True)])
def test_planned_share_refuses_any_other_share(other):
    with pytest.raises(ValueError, match="planned"):
        replace(HOPPER_STREAMING, planned=True, **other)


def test_two_launch_variants_pass_the_softmax_state_between_launches():
    # The first launch is one block per query tile in plain order; both share a float32 state workspace.
    split = Variant(128, 128, num_worker_warps=8, persistent=True, dynamic=True, two_launch=True)
    diagonal = split.diagonal()
    assert not diagonal.persistent and not diagonal.reverse_order and diagonal.two_launch
    q = torch.empty((2, 4, 300, 96), device="meta", dtype=torch.float16)
    m, s, acc, counter, _, _ = split.state(q)
    assert m.shape == s.shape == (2, 4, 300) and acc.shape == (2, 4, 300, 128)
    assert {t.dtype for t in (m, s, acc)} == {torch.float32}
    assert counter.shape == (1,) and counter.dtype == torch.int32
    assert all(t.numel() == 1 for t in Variant(64, 64).state(q))  # one launch: placeholders only


@pytest.mark.slow
def test_the_two_launch_form_loads_its_softmax_state_without_tma():
    # Through TMA each consumer warpgroup fetched the max and sum vectors into one shared buffer, a write-after-write
    # that compute-sanitizer racecheck reported on the H200; plain loads take them to registers.
    _, mask_free = export_phases(replace(HOPPER_STREAMING, two_launch=True), arch="sm_90", head_dim=128, causal=True)[1]
    usage = sass(mask_free)
    assert usage["utmaldg_3d"] == 0 and usage["utmaldg"] > 0 and usage["stack"] == 0, usage


def test_search_space_holds_single_launches_only():
    """The tuner times one launch per candidate (cuda.tile.tune.exhaustive_search); on the H200 the two-launch
    and dynamically scheduled forms lost, so no causal candidate is persistent but the 128x256 one at head
    dims 33-128 on Hopper (the only one whose masked loop kept up there; with GQA it leads from 4K at D=128),
    with each block's share taken every num_blocks-th item or in mirror pairs, and at D=128 a 128x128 one
    with the diagonal peeled (no masked loop at all where it runs) and the paired 128x256 peeled too."""
    for capability in ((8, 0), (9, 0), (10, 0), (12, 0)):
        for head_dim in (32, 64, 96, 128, 256):
            for causal in (False, True):
                space = search_space(capability, head_dim, causal=causal)
                assert space and not any(v.two_launch or v.dynamic for v in space)
                persistent = [(v.tile_m, v.tile_n, v.paired) for v in space
                              if causal and v.persistent and v.num_worker_warps != 16 and not v.planned]
                hopper_wide = causal and capability == (9, 0) and head_dim in (64, 96, 128)
                peeled = [(128, 128, True), (128, 256, True)] if hopper_wide and head_dim == 128 else []  # peeled_space
                assert persistent == ([(128, 256, False), (128, 256, True), *peeled] if hopper_wide else [])
                # tileiras 13.5's blocks of 16 warps: causal and persistent only with a paired share
                assert all(v.paired or v.planned for v in space
                           if causal and v.persistent and v.num_worker_warps == 16)
                # every paired candidate again taking the host's plan, and no other planned one
                assert [replace(v, paired=False, planned=True) for v in space if v.paired] == [
                    v for v in space if v.planned]


def test_settled_tuner_times_again_only_the_candidates_near_the_searchs_best(monkeypatch, tmp_path):
    """FMHA_TUNER=settled: exhaustive_search first; the candidates within FINALIST_MARGIN of its best are timed
    again each at its own sustained clocks, and that decides. Where the search alone decides (the default),
    its best is the pick. The settled pick keeps its finalists' times in the tuning cache, beside the config,
    and a later process reads them back with the pick."""
    import impls.cutile.tuner as cutile
    from impls import tuning as _tuning

    space = [Variant(64, 128, occupancy=2), HOPPER_WIDE, replace(HOPPER_WIDE, persistent=True, tile_n=256)]
    times = dict(zip(space, (100.0, 140.0, 109.0), strict=True))  # us: the second is out of the running
    result = SimpleNamespace(best=SimpleNamespace(config=space[0]),
                             successes=[SimpleNamespace(config=v, mean_us=t) for v, t in times.items()])
    retimed = []

    def settled_ranking(candidates):  # the suite's way, the search's third is fastest
        candidates = list(candidates)
        retimed.extend(variant for variant, _ in candidates)
        assert all(call.variant is variant for variant, call in candidates)
        settled_ms = {space[0]: 0.1234, space[2]: 0.1171}
        return sorted(((variant, settled_ms[variant]) for variant, _ in candidates), key=lambda entry: entry[1])

    monkeypatch.setenv("FMHA_TUNING_CACHE", str(tmp_path))
    monkeypatch.setenv("FMHA_TUNING", "tune")
    monkeypatch.delenv("FMHA_GPU_SHARED", raising=False)
    monkeypatch.setattr(cutile, "_TUNED", {})
    monkeypatch.setattr(cutile, "precompile", lambda calls: calls)
    monkeypatch.setattr(cutile, "settle_gpu", lambda device: None)
    monkeypatch.setattr(cutile, "exhaustive_timings", lambda calls: result)
    monkeypatch.setattr(cutile, "settled_ranking", settled_ranking)
    monkeypatch.setattr(cutile.TUNING, "key", lambda device, shape: repr(shape))
    picks = {}
    for tuner in ("exhaustive", "settled"):
        monkeypatch.setenv("FMHA_TUNER", tuner)
        picks[tuner] = cutile.tuned(("test-shape", tuner), torch.device("cpu"), space,
                                    lambda v: SimpleNamespace(variant=v))
        assert picks[tuner].source == _tuning.TUNED
    assert {tuner: pick.choice for tuner, pick in picks.items()} == {"exhaustive": space[0], "settled": space[2]}
    assert retimed == [space[0], space[2]]  # fastest first; 140 us is more than FINALIST_MARGIN behind
    assert _tuning.FINALIST_MARGIN == 0.10
    finalists = [{"variant": space[2].label(), "search_us": 109.0, "settled_us": 117.1},
                 {"variant": space[0].label(), "search_us": 100.0, "settled_us": 123.4}]
    assert picks["exhaustive"].finalists is None and picks["settled"].finalists == finalists
    assert picks["settled"].provenance() == {"chosen": "autotuned", _tuning.EVIDENCE: finalists}
    assert picks["exhaustive"].provenance() == {"chosen": "autotuned"}
    # another process: the pick and its evidence from the cache, the config without it
    monkeypatch.setattr(cutile, "_TUNED", {})
    again = cutile.tuned(("test-shape", "settled"), torch.device("cpu"), space, lambda v: pytest.fail("re-tuned"))
    assert again == (space[2], _tuning.CACHED, finalists)
    assert again.provenance() == {"chosen": "tuning cache", _tuning.EVIDENCE: finalists}
    # a search with one finalist needs no second round
    result.successes[2] = SimpleNamespace(config=space[2], mean_us=150.0)
    pick = cutile.tuned(("test-shape", "alone"), torch.device("cpu"), space, lambda v: SimpleNamespace(variant=v))
    assert pick.choice == space[0] and pick.finalists is None and retimed == [space[0], space[2]]
    # a process that shares its GPU runs the space's first candidate, untimed, and stores nothing
    monkeypatch.setenv("FMHA_GPU_SHARED", "1")
    shared = cutile.tuned(("test-shape", "shared"), torch.device("cpu"), space[::-1], lambda v: pytest.fail("timed"))
    assert shared == (space[2], _tuning.FIXED, None) and shared.provenance() == {"chosen": _tuning.FIXED}
    assert cutile.TUNING.get(repr(("test-shape", "shared"))) is None
    # ... after compiling every candidate of the space, untimed, where a chain's prime asks it to
    compiled = []
    monkeypatch.setattr(cutile, "precompile", lambda calls: compiled.extend(call.variant for call in calls) or calls)
    monkeypatch.setenv("FMHA_COMPILE_CANDIDATES", "1")
    primed = cutile.tuned(("test-shape", "primed"), torch.device("cpu"), space[::-1],
                          lambda v: SimpleNamespace(variant=v, __call__=lambda: pytest.fail("timed")))
    assert primed == (space[2], _tuning.FIXED, None) and compiled == space[::-1]
    assert cutile.TUNING.get(repr(("test-shape", "primed"))) is None


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [40, 64])
def test_sm90_causal_candidates_do_not_spill_at_head_dims_up_to_64(head_dim):
    # The persistent 128x256 causal candidate included: 83 KB of pipeline at D=64, no stack (it spills at 32).
    for variant in search_space((9, 0), head_dim, causal=True):
        usage = sass(export_cubin(variant, arch="sm_90", dtype=torch.bfloat16, head_dim=head_dim, causal=True,
                                  even_n=False))
        assert usage["stack"] == 0 and usage["hgmma"] > 0, (variant.label(), usage)


@pytest.mark.slow
def test_sm90_mask_free_launch_gets_a_deeper_pipeline():
    # The point of two launches: the causal persistent kernel with its mask in the loop body gets a shallow
    # K/V pipeline; the mask-free second launch a deeper one (sm_90 shared memory: 100 KB against 167 KB).
    one_launch = Variant(128, 128, occupancy=1, num_worker_warps=8, head_group=None, persistent=True, dynamic=True,
                         k_latency=3, v_latency=6)
    split = Variant(**{**one_launch.describe(), "two_launch": True})
    (_, diagonal), (_, mask_free) = export_phases(split, arch="sm_90")
    shallow = sass(export_cubin(one_launch, arch="sm_90"))
    deep = sass(mask_free)
    assert deep["shared"] > 1.5 * shallow["shared"]
    assert deep["stack"] == 0 and sass(diagonal)["stack"] == 0


@pytest.mark.slow
def test_sm90_kernel_without_a_mask_keeps_the_deep_pipeline():
    # Non-causal with Skv a multiple of the tile: no masked loop is compiled at all (one the compiler cannot
    # prove empty cut the persistent kernel's pipeline from 198 KB to 99 KB); a ragged Skv needs it.
    streaming = Variant(128, 128, occupancy=1, num_worker_warps=8, persistent=True, k_latency=3, v_latency=6)
    even = sass(export_cubin(streaming, arch="sm_90", causal=False, even_n=True))
    ragged = sass(export_cubin(streaming, arch="sm_90", causal=False, even_n=False))
    assert even["shared"] > 1.5 * ragged["shared"] and even["stack"] == 0


def test_sm90_cubin_is_the_one_that_runs():
    """With the launcher's alignment facts the compiler moves K/V tiles with TMA (UTMALDG); the tuned 128x128
    tile with eight worker warps does not spill. Without them the export silently fell back to ordinary
    loads and its SASS described a kernel that never runs."""
    summary = sass(export_cubin(Variant(128, 128, occupancy=1, num_worker_warps=8), arch="sm_90"))
    assert summary["utmaldg"] > 0 and summary["hgmma"] > 0
    assert summary["stack"] == 0


def test_a_two_launch_call_runs_the_diagonal_first_then_the_mask_free_part():
    import inspect

    from impls.cutile.kernel import DIAGONAL, OFF_DIAGONAL, WHOLE, fmha_fwd

    phase = list(inspect.signature(fmha_fwd._pyfunc).parameters).index("PHASE")
    q = torch.empty((2, 4, 300, 64), device="meta", dtype=torch.float16)
    k = v = torch.empty((2, 2, 300, 64), device="meta", dtype=torch.float16)
    split = Variant(64, 64, two_launch=True)
    state = split.state(q)
    launches = split.launches(q, k, v, q, state, causal=True, scale=0.125)
    assert [args[phase] for _, _, args in launches] == [DIAGONAL, OFF_DIAGONAL]
    assert all(args[4:10] == state for _, _, args in launches)  # both launches see one workspace
    (_, _, whole), = Variant(64, 64).launches(q, k, v, q, Variant(64, 64).state(q), causal=True, scale=0.125)
    assert whole[phase] == WHOLE


def serving_inputs(preset_name: str, index: int):
    from suite.cases import preset

    return preset(preset_name)[index].make_inputs("cpu")


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
    from suite.cases import paged

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
    from suite.cases import paged

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


def test_decode_tuner_tries_each_aimed_plan_once_per_chunk_length(monkeypatch):
    """The decode tuner times every kernel form with each split plan of ``AIMED_PLANS`` (one chunk a sequence
    where the GPU holds the batch, or more), once per distinct chunk length, and every plan of a form runs the
    same compiled kernel (the chunk length is a run-time argument)."""
    import impls._plans
    from impls._plans import AIMED_PLANS
    from impls.cutile.serving import DecodeVariant, plan_candidates

    inputs = serving_inputs("serving-cpu", 4)  # MQA at batch 1, 300 tokens: 5 tiles of 64 keys
    forms = [DecodeVariant(64), DecodeVariant(64, "indexed")]
    monkeypatch.setattr(impls._plans, "SPLIT_MIN_TILES", 1)  # one-tile chunks, one SM: each plan cuts apart
    one_sm = plan_candidates(forms, inputs, scale=0.125, sm_count=1)
    assert len(one_sm) == len(forms) * len(AIMED_PLANS)
    for form in forms:
        calls = [call for call in one_sm if call.variant.read == form.read]
        assert sorted(call.variant.plan_programs for call in calls) == sorted(AIMED_PLANS)
        assert len({call.split_len for call in calls}) == len(AIMED_PLANS)  # 2, 3 and 5 chunks
        assert len({call.launches[0][1] for call in calls}) == 1
    monkeypatch.undo()
    many_sms = plan_candidates(forms, inputs, scale=0.125, sm_count=132)
    # every aimed plan of chunks of at least SPLIT_MIN_TILES leaves it whole; those of one tile (PLAN_MIN_TILES,
    # for short steps) cut it into its 5 tiles
    assert [(call.variant.plan_min_tiles, call.num_splits) for call in many_sms] == [(None, 1), (1, 5)] * 2


def test_decode_tuner_tries_split_steps_with_and_without_programmatic_dependent_launch(monkeypatch):
    """Where a GPU has programmatic dependent launch, the decode tuner times each split candidate both ways
    (``DecodeVariant.pdl``), and the chosen variant launches as it says; an unsplit step is tried once, as
    before (one launch: nothing to overlap). Without the feature (here, on CPU) nothing doubles."""
    import impls._plans
    import impls.cutile.serving as serving

    inputs = serving_inputs("serving-cpu", 4)  # MQA at batch 1, 300 tokens
    form = [serving.DecodeVariant(64)]
    with monkeypatch.context() as one_tile_chunks:
        one_tile_chunks.setattr(impls._plans, "SPLIT_MIN_TILES", 1)
        plain = serving.plan_candidates(form, inputs, scale=0.125, sm_count=1)
        assert {call.variant.pdl for call in plain} == {None} and not any(c.dependent_launch for c in plain)
        monkeypatch.setattr(serving, "dependent_launch_available", lambda device: True)
        both = serving.plan_candidates(form, inputs, scale=0.125, sm_count=1)
    assert len(both) == 2 * len(plain)
    assert sorted((c.split_len, c.dependent_launch) for c in both) == sorted(
        (c.split_len, pdl) for c in plain for pdl in (False, True))
    for call in both:  # as the tuning cache rebuilds the chosen one
        rebuilt = serving.DecodeCall(serving.DecodeVariant(**call.variant.describe()), inputs, scale=0.125,
                                     sm_count=1)
        assert rebuilt.dependent_launch is call.variant.pdl is named(rebuilt.launches[0])["PDL"]
    # on 132 SMs the plans of SPLIT_MIN_TILES leave it whole (tried once), the one-tile plan splits it (both ways)
    whole = serving.plan_candidates(form, inputs, scale=0.125, sm_count=132)
    assert [(c.num_splits, c.variant.pdl, c.dependent_launch) for c in whole] == [
        (1, None, False), (5, False, False), (5, True, True)]


def test_decode_without_a_split_writes_the_output_directly():
    from impls.cutile.serving import DecodeCall, DecodeVariant

    inputs = serving_inputs("serving-cpu", 1)
    call = DecodeCall(DecodeVariant(64), inputs, scale=0.125, sm_count=132)
    assert call.num_splits == 1 and len(call.launches) == 1


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


def test_arguments_are_bound_by_the_kernels_parameter_names():
    """The launch arguments follow the kernel's signature, whatever order they are given in; a parameter left
    without a value is named."""
    pytest.importorskip("cuda.tile")
    import inspect

    from impls.cutile import kernel
    from impls.cutile.config import bind

    names = list(inspect.signature(kernel.fmha_varlen._pyfunc).parameters)
    values = {name: i for i, name in enumerate(reversed(names))}
    assert bind("fmha_varlen", **values, EXTRA=-1) == tuple(values[name] for name in names)
    del values["HEAD_GROUP"]
    with pytest.raises(TypeError, match="fmha_varlen: no value for HEAD_GROUP"):
        bind("fmha_varlen", **values)


def test_a_kernel_and_its_hints_are_made_once():
    """Launches share one kernel object per kernel and set of hints: a new object per call would compile again,
    and would free its module while a CUDA graph captured from it still runs (a segfault)."""
    pytest.importorskip("cuda.tile")
    from impls.cutile.config import Variant

    variant = Variant(64, 128, occupancy=2)
    assert variant.kernel() is variant.kernel()
    assert variant.kernel(base="fmha_varlen") is Variant(64, 128, occupancy=2).kernel(base="fmha_varlen")
    assert variant.kernel() is not Variant(64, 128, occupancy=1).kernel()


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0), (12, 0)])
def test_every_candidate_of_every_gpu_preset_case_makes_its_launches(monkeypatch, capability):
    """What the tuners try on the GPU presets, built on the CPU without compiling: each dense case's candidates
    (``candidates``, its window bound as ``prepare_tuned`` binds it) and each varlen case's (``varlen_candidates``,
    with its window and softcap).
    A form some shape refuses at launch time fails here, not on the GPU (a peeled diagonal once reached the
    varlen space, which has no one query length, and refused every causal D=128 varlen case there)."""
    import impls.cutile.config
    from impls.contract import Varlen, binding_window
    from impls.cutile.launch import Call
    from impls.cutile.serving import VarlenCall, varlen_candidates
    from impls.cutile.spaces import candidates
    from suite.cases import PRESETS

    # persistent grids size by SMs
    monkeypatch.setattr(impls.cutile.config, "device_sm_count", lambda *args, **kwargs: 132)
    cases = {case.id: case for name, preset in PRESETS.items() if "cpu" not in name for case in preset}
    built = 0
    for case in cases.values():
        if case.op == "dense":  # meta tensors: shapes and strides, no memory
            q, k, v = (torch.empty(shape, dtype=case.torch_dtype, device="meta") for shape in (
                (case.batch, case.hq, case.sq, case.d), (case.batch, case.hkv, case.skv, case.d),
                (case.batch, case.hkv, case.skv, case.value_dim)))
            variants = dict(case.variants)
            if "window" in variants:  # as prepare_tuned binds it
                variants["window"] = binding_window(variants["window"], case.causal, case.sq, case.skv)
            calls = [Call(variant, q, k, v, causal=case.causal, scale=0.125, **variants)
                     for variant in candidates(capability, q, k, v, causal=case.causal, **variants)]
        elif case.op == "varlen":
            cu = torch.tensor([0, *itertools.accumulate(case.seqlens())], dtype=torch.int32)
            q, k = (torch.empty((case.sq, heads, case.d), dtype=case.torch_dtype) for heads in (case.hq, case.hkv))
            inputs = Varlen(q, k, k, cu, cu.clone(), causal=case.causal)
            window = inputs.binding_window(case.window)  # as prepare_varlen binds it
            calls = [VarlenCall(variant, inputs, scale=0.125, sm_count=132, window=window, softcap=case.softcap)
                     for variant in varlen_candidates(capability, inputs, window)]
        else:
            continue
        assert calls and all(call.launches for call in calls), case.id
        built += len(calls)
    assert built > len(cases)


@pytest.mark.slow
def test_sm90_wide_block_joins_the_head_dim_256_space_with_its_deep_pipeline():
    """The 128x128 block of 8 warps is in the D=256 space (H200, Gemma-2: 3-4% ahead of the 128x64
    block). Its 256-wide accumulator leaves the compiler few registers: none spilled without softcap on whole key
    tiles, a few words with softcap (24 B), and the deep K/V pipeline either way."""
    for causal in (True, False):
        assert HOPPER_WIDE in search_space((9, 0), 256, causal=causal)
    for softcap, most in ((0.0, 0), (50.0, 24)):
        usage = sass(export_cubin(HOPPER_WIDE, arch="sm_90", dtype=torch.bfloat16, head_dim=256, causal=True,
                                  softcap=softcap))
        assert usage["stack"] <= most and usage["shared"] > 190_000 and usage["hgmma"] > 0, (softcap, usage)


@pytest.mark.slow
def test_sass_diff_reports_what_moved_between_two_trees():
    # tools/sass_diff.py: a change to the pipeline (shared memory) or to the instructions is named, one that
    # moved nothing reads "same", and a candidate on one side only says which
    from tools.sass_diff import compare

    row = {"reg": 168, "stack": 0, "shared": 230544, "digest": "a"}
    old = {"kept": row, "deepened": {**row, "shared": 197800}, "rescheduled": row, "dropped": row}
    new = {"kept": row, "deepened": row, "rescheduled": {**row, "digest": "b"}, "added": row}
    assert compare(old, new) == ["kept: same reg/stack/shared",
                                 "deepened: shared 197800 -> 230544",
                                 "rescheduled: same reg/stack/shared (SASS changed)",
                                 "dropped: gone from the working tree",
                                 "added: only in the working tree"]
    # end to end, against the checked-out revision itself (a git worktree, compiled apart): nothing moved
    one = "64x64:{'occupancy': 2}:L2,4:g-auto"
    proc = subprocess.run([sys.executable, "tools/sass_diff.py", "HEAD", "--head-dim", "64", "--no-causal",
                           "--match", one], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines() == [f"{one}: same reg/stack/shared"], proc.stdout


def test_a_persistent_grid_counts_clusters_as_blocks(monkeypatch):
    # a block of num_ctas=2 is a cluster on two SMs: 132 SMs hold 66 of them at once, not 132 (a second wave of
    # persistent blocks would run their whole share after the first)
    import impls.cutile.config

    monkeypatch.setattr(impls.cutile.config, "device_sm_count", lambda *args, **kwargs: 132)
    q = torch.empty((4, 32, 4096, 128))
    assert HOPPER_STREAMING.grid(q) == (132, 1, 1)
    assert replace(HOPPER_STREAMING, num_ctas=2).grid(q) == (66, 1, 1)
    assert replace(HOPPER_STREAMING, occupancy=2, num_ctas=2).grid(q) == (132, 1, 1)
    assert replace(HOPPER_STREAMING, num_ctas=2).resident_blocks(1) == 1  # never none
