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


def compiled(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "impls.triton_fa.aot", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pointer_path_compiles_for_ampere():
    assert compiled("--arch", "80", "--d", "64", "--full")["reg"] > 0


def test_sm90_uses_warpgroup_mma_and_tma():
    pointer = compiled("--arch", "90")
    tma = compiled("--arch", "90", "--tma")
    assert pointer["hgmma"] > 0 and tma["hgmma"] > 0  # warpgroup MMA, not the older HMMA path
    assert tma["utmaldg"] > 0 and pointer["utmaldg"] == 0  # the descriptor path really uses TMA loads


def test_sm90_autotuner_pick_does_not_spill():
    # 128x64 tiles, 8 warps: the H200 autotuner's usual pick. Compiled with the run-time specialisation
    # (16-divisible pointers and strides); without it the pointer path spilled, which misled session 1.
    for path in ((), ("--tma",)):
        assert compiled("--arch", "90", *path)["stack"] == 0, path


@pytest.mark.parametrize("head_dim", [80, 96, 192])
def test_padded_head_dims_compile_for_hopper_without_spills(head_dim):
    # Phi-3 (96), D=80 and DeepSeek-style 192: padded to 128 / 256 in registers, masked loads. At 128 the
    # autotuner's usual 128x64; at 256 the search space's 128x32 with 8 warps.
    block = ("--block", "128", "32", "--warps", "8") if head_dim > 128 else ()
    result = compiled("--arch", "90", "--d", str(head_dim), *block)
    assert result["hgmma"] > 0 and result["stack"] == 0, result


def test_window_and_softcap_compile_for_hopper_without_spills():
    # Gemma-2's local layers: a sliding window and softcap 50, at the autotuner's usual tile.
    result = compiled("--arch", "90", "--d", "128", "--window", "--softcap", "50")
    assert result["hgmma"] > 0 and result["stack"] == 0, result
