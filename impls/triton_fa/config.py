"""What every entry of our Triton kernels shares: the head dims they take, what they require of a machine, the
interpreter switch, the tensor-descriptor allocator and the family's tuning cache."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from impls._registry import module_available
from impls.tuning import TuningCache, family_sources

# Any multiple of 8 from 16 (the smallest dot) to 256: a head dim that is not a power of two is padded to the
# next one in registers (masked loads read zeros there). The descriptor (TMA) path needs the exact power of two.
HEAD_DIMS = tuple(range(16, 257, 8))
POW2_HEAD_DIMS = (16, 32, 64, 128, 256)
# The forward's PERSISTENT work orders (0: the one-tile grid): one head's tiles after another, or the heaviest
# causal tiles of all heads first.
PERSISTENT_BY_HEAD = 1
PERSISTENT_HEAVY_FIRST = 2


def block_d(head_dim: int) -> int:
    return 1 << (head_dim - 1).bit_length()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def requires(device: str) -> str | None:
    missing = module_available("triton", "pip install triton")(device)
    if missing:
        return missing
    if device == "cpu" and not interpreting():
        return "Triton needs a GPU on this machine; set TRITON_INTERPRET=1 to run its interpreter on CPU"
    return None


def requires_tma(device: str) -> str | None:
    missing = requires(device)
    if missing or device == "cpu":
        return missing
    major, minor = torch.cuda.get_device_capability()
    return None if major >= 9 else f"tensor descriptors (TMA) need sm_90 or newer, this GPU is sm_{major}{minor}"


@functools.cache
def install_descriptor_allocator() -> None:
    """Device-side tensor descriptors need global scratch memory, which Triton asks its allocator for."""
    import triton

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def head_dims(head_dim: int, value_dim: int | None = None) -> dict:
    """The kernel's head-dim constants: Q/K's and V/output's (the same unless MLA), each with its padded tile."""
    value_dim = head_dim if value_dim is None else value_dim
    return {"HEAD_DIM": head_dim, "BLOCK_D": block_d(head_dim), "HEAD_DIM_V": value_dim,
            "BLOCK_DV": block_d(value_dim)}


def tma_available(device: str) -> bool:
    return device != "cpu" and requires_tma(device) is None


# The chosen config per shape class: shipped in tuned/, tuned on this machine on request (impls/tuning.py).
TUNING = TuningCache("triton", family_sources(__file__), ["triton"], tables=Path(__file__).parent / "tuned")
