"""What a measurement is worth: exact FLOPs, minimum bytes, and the device's peak to compare against."""

from __future__ import annotations

import torch

from suite.cases import Case

# Dense fp16/bf16 tensor-core peak (TFLOP/s, no sparsity) of each architecture's flagship datacenter part,
# from NVIDIA's datasheets: A100 SXM (sm_80), H100/H200 SXM (sm_90), B200 (sm_100).
PEAK_TFLOPS_16BIT = {(8, 0): 312.0, (9, 0): 989.4, (10, 0): 2250.0}
PEAK_SOURCE = {(8, 0): "A100 SXM", (9, 0): "H100/H200 SXM", (10, 0): "B200"}


def visible_pairs(sq: int, skv: int, causal: bool) -> int:
    """Query-key pairs that attention computes; causal is bottom-right aligned (query i sees j <= i+skv-sq)."""
    if not causal:
        return sq * skv
    offset = skv - sq
    # Row i sees clamp(i + offset + 1, 0, skv) keys: sum it in closed form over the three regimes.
    first = max(0, -offset)  # rows before this see nothing
    full_from = max(first, min(sq, skv - offset - 1))  # rows from here on see every key
    ramp = sum_range(first + offset + 1, full_from + offset + 1)
    return ramp + (sq - full_from) * skv


def sum_range(lo: int, hi: int) -> int:
    """lo + (lo+1) + ... + (hi-1)."""
    return (hi - lo) * (lo + hi - 1) // 2 if hi > lo else 0


def flops(case: Case) -> int:
    """Two matmuls (QK^T and PV), 2 FLOPs per multiply-add, over query heads (GQA shares K/V, not work)."""
    return 4 * case.batch * case.hq * case.d * visible_pairs(case.sq, case.skv, case.causal)


def min_bytes(case: Case) -> int:
    """q, k, v read once and o written once."""
    size = torch.empty((), dtype=case.torch_dtype).element_size()
    return size * case.d * case.batch * (2 * case.hq * case.sq + 2 * case.hkv * case.skv)


def device_peak_tflops(device: torch.device) -> tuple[float | None, str]:
    if device.type != "cuda":
        return None, "no peak for CPU"
    cap = torch.cuda.get_device_capability(device)
    if cap in PEAK_TFLOPS_16BIT:
        return PEAK_TFLOPS_16BIT[cap], f"sm_{cap[0]}{cap[1]} dense 16-bit peak of {PEAK_SOURCE[cap]}"
    return None, f"no peak known for sm_{cap[0]}{cap[1]}"
