"""The Triton kernel compiles for real GPUs, here without one, and uses Hopper's instructions on sm_90.

The compile runs in a subprocess: this test process may hold the kernel in Triton's interpreter.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def compiled(*configs: str) -> list[dict]:
    """Resources of each configuration (a line of ``impls.triton_fa.aot`` options), compiled in one process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "impls.triton_fa.aot", "--each"], cwd=ROOT, env=env,
                          input="\n".join(configs), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(configs):]]
    assert len(results) == len(configs)
    return results


def test_hopper_uses_warpgroup_mma_and_tma_and_the_autotuners_pick_does_not_spill():
    # 128x64 tiles, 8 warps: the H200 autotuner's usual pick. Compiled with the run-time specialisation
    # (16-divisible pointers and strides); without it the pointer path spilled, which misleads.
    pointer, tma = compiled("--arch 90", "--arch 90 --tma")
    assert pointer["hgmma"] > 0 and tma["hgmma"] > 0  # warpgroup MMA, not the older HMMA path
    assert tma["utmaldg"] > 0 and pointer["utmaldg"] == 0  # the descriptor path really uses TMA loads
    assert pointer["stack"] == 0 and tma["stack"] == 0


def test_overlap_pv_runs_the_product_beside_the_softmax_without_serialising_the_mmas():
    """OVERLAP_PV's point, in the sm_90 SASS: P @ V products are in flight while the next softmax's exponentials run
    (none in the default loop), and ptxas keeps the warpgroup MMAs in runs (a run of 1: it serialised them). On
    pointers (where the first forms serialised) and descriptors."""
    pointer = "--arch 90 --full"
    descriptors = "--arch 90 --full --tma --stages 2"
    default, *overlaps = compiled(pointer, f"{pointer} --switch OVERLAP_PV=1", f"{descriptors} --switch OVERLAP_PV=1")
    assert default["products_beside_softmax"] == 0 and default["hgmma_max_run"] > 1
    for overlap in overlaps:
        assert overlap["products_beside_softmax"] > 0 and overlap["hgmma_max_run"] > 1 and overlap["stack"] == 0


@pytest.mark.slow
def test_ampere_padded_head_dims_window_and_softcap_compile_without_spills():
    """Ampere (no warpgroup MMA); Phi-3 (96), D=80 and DeepSeek-style 192 padded to 128 / 256 in registers,
    masked loads (at 256 the search space's 128x32 with 8 warps); Gemma-2's local layers (a sliding window
    and softcap 50) at the autotuner's usual tile."""
    ampere, *hopper = compiled("--arch 80 --d 64 --full", "--arch 90 --d 80", "--arch 90 --d 96",
                               "--arch 90 --d 192 --block 128 32 --warps 8",
                               "--arch 90 --d 128 --window --softcap 50")
    assert ampere["reg"] > 0 and ampere["hgmma"] == 0
    for result in hopper:
        assert result["hgmma"] > 0 and result["stack"] == 0, result


@pytest.mark.slow
def test_decode_tiles_double_buffer_k_and_v_from_five_stages_and_none_spills_in_its_loop():
    """Triton's pipeliner spends two stages on the block-table load that a decode tile's K/V addresses depend on:
    up to 4 stages the split kernel holds one K and one V buffer (a program waits for each tile right after
    issuing its loads), from 5 on two. The decode tuner's tiles are what their comment says they are, and fit.
    No tile touches local memory inside its loop; only the double-buffered tile of 2 warps holds any stack (at
    255 registers it parks a few values before the loop and reads them back after it: 6 stores, 8 loads)."""
    from impls.triton_fa.paged import DECODE_TILES

    results = compiled(*(f"--arch 90 --decode {n} {w} {st}" for n, w, st in DECODE_TILES))
    assert any(st >= 5 for _, _, st in DECODE_TILES)
    for (n, w, st), result in zip(DECODE_TILES, results, strict=True):
        assert result["kv_buffers"] == (2 if st >= 5 else 1), (n, w, st, result)
        assert result["loop_spills"] == 0 and result["shared"] <= 227 * 1024, (n, w, st, result)
        assert result["stack"] == 0 or (w, st) == (2, 5), (n, w, st, result)


def test_loop_spills_counts_local_memory_only_between_a_backward_branch_and_its_target():
    from impls.sass import loop_spills

    listing = """
        /*0010*/                   STL [R1], R14 ;
        /*0020*/                   IMAD R2, R3, R4, RZ ;
        /*0030*/                   LDL.LU R5, [R1+0x4] ;
        /*0040*/              @!P0 BRA 0x20 ;
        /*0050*/                   LDL.LU R6, [R1] ;
        /*0060*/              @P1 BRA 0x80 ;
        /*0070*/                   STL [R1+0x8], R7 ;
        /*0080*/                   EXIT ;
    """
    assert loop_spills(listing) == 1  # the LDL at 0x30, in the loop 0x20-0x40; not the forward branch's
    assert loop_spills(listing.replace("BRA 0x20", "BRA 0x50")) == 0


@pytest.mark.slow
def test_decode_tiles_over_an_fp8_cache_read_values_as_words_and_hold_no_stack():
    """Over an fp8 cache under bf16 queries (fp16 dots, F16_DOT) every tile of the decode tuner reads V as words
    (V_WORDS) and widens it before the dot's layout: V reaches the dot through transposing 16-bit loads, no byte
    loads, and no tile holds stack. Read as bytes, each tile gathered V with LDS.U8 and the
    128-key ones spilled 56-64 B (Triton 3.9)."""
    from impls.triton_fa.paged import DECODE_TILES

    words = compiled(*(f"--arch 90 --decode {n} {w} {st} --kv-fp8" for n, w, st in DECODE_TILES))
    byte_tile = compiled("--arch 90 --decode 128 4 5 --kv-fp8 --value-bytes")[0]
    assert byte_tile["lds_u8"] > 0 and byte_tile["ldsm_t"] == 0
    for (n, w, st), result in zip(DECODE_TILES, words, strict=True):
        assert result["hmma"] > 0 and result["shared"] <= 227 * 1024, (n, w, st, result)
        assert result["lds_u8"] == 0 and result["ldsm_t"] > 0 and result["stack"] == 0, (n, w, st, result)


def test_decode_under_programmatic_dependent_launch_waits_before_its_first_load():
    """With USE_PDL (the decode's default on Hopper where a step splits) the split kernel may start while the kernel
    before it in the stream still runs: it must wait for that grid (``griddepcontrol.wait``) before it reads
    anything, and it lets the combine launch once it runs. Without it, neither instruction, and the same tile."""
    with_pdl, without = compiled("--arch 90 --decode 128 4 5 --pdl", "--arch 90 --decode 128 4 5")
    assert with_pdl["pdl_waits"] == 1 and with_pdl["pdl_triggers"] == 1, with_pdl
    assert with_pdl["loads_before_wait"] == 0, with_pdl
    assert without["pdl_waits"] == 0 and without["pdl_triggers"] == 0, without
    assert with_pdl["shared"] == without["shared"] and with_pdl["stack"] == without["stack"] == 0


@pytest.mark.slow
def test_decode_prefetches_its_lookups_before_the_wait_and_loads_nothing_there():
    """PREFETCH asks the L2 for the sequence length, its table line and the query rows while the kernel ahead still
    runs (prefetch.global.L2 before griddepcontrol.wait): hints only, no load before the wait, and the loop's tile is
    the one without them."""
    on, off = compiled("--arch 90 --decode 128 4 5 --pdl --prefetch", "--arch 90 --decode 128 4 5 --pdl")
    assert on["prefetches_before_wait"] > 2 and on["prefetches"] == on["prefetches_before_wait"], on
    assert on["loads_before_wait"] == 0 and on["pdl_waits"] == 1, on
    assert off["prefetches"] == 0, off
    assert on["shared"] == off["shared"] and on["stack"] == off["stack"] == 0 and on["kv_buffers"] == off["kv_buffers"]
