"""Every cuTile kernel compiles to a cubin for each architecture, and the hints reach the compiler.

No GPU is needed: ``cuda.tile.compilation.export_kernel`` runs the whole compiler (tileiras) ahead of time. The
dense kernel's SASS shows what the hints did: no stack, the K/V pipeline's depth, the matrix instructions' runs.
The serving kernels' exports are in test_cutile_decode.py, test_cutile_varlen.py, test_cutile_mla.py and
test_cutile_mixed.py.
"""

import itertools
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from impls.cutile.config import Variant, tile_d
from impls.cutile.export import export_cubin, export_phases
from impls.cutile.spaces import HOPPER_DYNAMIC, HOPPER_STREAMING, HOPPER_WIDE, LADDER, other_forms, search_space
from impls.sass import hgmma_runs, softmax_overlap
from tests.cutile_helpers import sass
from tests.tiers import first_fast, only_fast

ARCHS = ["sm_80", "sm_90", "sm_100", "sm_120"]


# The fast tier compiles the first ladder step on every architecture and each head dim once; -m slow, the rest.
FIRST_STEP = next(iter(LADDER))


ROOT = Path(__file__).resolve().parent.parent


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


@pytest.mark.slow
def test_the_two_launch_form_loads_its_softmax_state_without_tma():
    # Through TMA each consumer warpgroup fetched the max and sum vectors into one shared buffer, a write-after-write
    # that compute-sanitizer racecheck reported on the H200; plain loads take them to registers.
    _, mask_free = export_phases(replace(HOPPER_STREAMING, two_launch=True), arch="sm_90", head_dim=128, causal=True)[1]
    usage = sass(mask_free)
    assert usage["utmaldg_3d"] == 0 and usage["utmaldg"] > 0 and usage["stack"] == 0, usage


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
