"""What a measurement is worth: exact FLOPs, minimum bytes, and the device's peak to compare against."""

from __future__ import annotations

from dataclasses import replace

import torch

from impls.contract import NO_WINDOW, decode_read_length, window_bounds
from suite.cases import PAGED_OPS, TRAINING_OPS, Case

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


def windowed_pairs(sq: int, skv: int, causal: bool, window: tuple[int, int]) -> int:
    """Visible pairs under a sliding window (bottom-right, as impls.reference.visible), row by row."""
    left, right = window
    right = 0 if causal else right
    total = 0
    for i in range(sq):
        p = i + skv - sq
        lo = max(0, p - left) if left >= 0 else 0
        hi = min(skv - 1, p + right) if right >= 0 else skv - 1
        total += max(0, hi - lo + 1)
    return total


def pairs(sq: int, skv: int, causal: bool, window: tuple[int, int] = NO_WINDOW) -> int:
    """Visible query-key pairs of one sequence: causal and a window, both bottom-right."""
    return windowed_pairs(sq, skv, causal, window) if window != NO_WINDOW else visible_pairs(sq, skv, causal)


TRAINING_FLOPS = {"backward": 5, "fwdbwd": 7}  # halves of the forward's FLOPs


def flops(case: Case) -> int:
    """Two matmuls (QK^T and PV), 2 FLOPs per multiply-add, over query heads (GQA shares K/V, not work);
    serving cases sum over their sequences (decode: Sq_new new tokens against each cache, bottom-right). The
    backward counts 2.5 times its forward (flash-attention's convention: five matmuls to the forward's two), a
    training step 3.5 times (the forward and its backward)."""
    if case.op in TRAINING_OPS:  # packed documents: the varlen forward's, summed over each document's pairs
        return TRAINING_FLOPS[case.op] * flops(replace(case, op=case.forward_op)) // 2
    if case.op == "dense":
        total = case.batch * pairs(case.sq, case.skv, case.causal, case.window)
    elif case.op in PAGED_OPS:
        total = sum(pairs(case.sq, n, True, case.window) for n in case.seqlens())
    elif case.op == "mixed":
        total = sum(pairs(new, n, True) for new, n in zip(case.new_tokens(), case.seqlens(), strict=True))
    else:
        total = sum(pairs(n, n, case.causal, case.window) for n in case.seqlens())
    return 2 * case.hq * (case.d + case.value_dim) * total  # Q K^T over d, P V over the value head dim (MLA: latent)


def itemsize(case: Case, kv: bool = False) -> int:
    """Bytes of one element of q (or, ``kv``, of the K/V cache: 1 for an fp8 cache)."""
    return torch.empty((), dtype=case.kv_torch_dtype if kv else case.torch_dtype).element_size()


def kv_bytes(case: Case) -> int:
    """K and V bytes a kernel must read: each sequence's cache once (decode: with a sliding window, only the
    positions some new token sees), each kv head once (GQA), in the cache's dtype. MLA: each token's latent and
    rotary rows once, the latent row serving as key and value."""
    if case.op == "mla":
        return sum(case.seqlens()) * case.d * itemsize(case, kv=True)
    if case.op == "dense":
        tokens = case.batch * case.skv
    elif case.op == "paged":
        window_left, _ = window_bounds(case.window, causal=True)
        tokens = sum(decode_read_length(n, case.sq, window_left) for n in case.seqlens())
    else:  # varlen, mixed: each sequence's keys once
        tokens = sum(case.seqlens())
    return tokens * case.hkv * (case.d + case.value_dim) * itemsize(case, kv=True)


def min_bytes(case: Case) -> int:
    """q, k, v read once and o written once; the backward: q, k, v, o, do and lse read once, dq, dk, dv written
    once; a training step: both."""
    if case.op in TRAINING_OPS:
        forward = min_bytes(replace(case, op=case.forward_op))
        rows = case.sq if case.packed else case.batch * case.sq
        backward = 2 * forward + rows * case.hq * 4  # (k, v, q, o) twice, and lse
        return backward + (forward if case.op == "fwdbwd" else 0)
    q_rows = {"varlen": case.sq, "mixed": sum(case.new_tokens())}.get(case.op, case.batch * case.sq)
    return kv_bytes(case) + q_rows * case.hq * (case.d + case.value_dim) * itemsize(case)


# FLOPs per byte where the H200's 16-bit tensor-core peak and its HBM bandwidth take the same time (989 / 4.8)
RIDGE_FLOPS_PER_BYTE = 206


def memory_bound(case: Case) -> bool:
    """Whether reading the case's minimum bytes takes longer than its FLOPs at the H200's peaks (a mixed step
    ranks by GB/s where its decoding sequences' caches dominate, by TFLOPS where its prefill chunks do)."""
    return flops(case) < RIDGE_FLOPS_PER_BYTE * min_bytes(case)


# HBM bandwidth of the SXM parts, TB/s, from NVIDIA's datasheets: H100 SXM5 80 GB (HBM3), H200 SXM (HBM3e),
# A100 SXM 80 GB, B200. Matched on the device name.
PEAK_HBM_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.039, "B200": 8.0}


def device_peak_hbm(device: torch.device) -> tuple[float | None, str]:
    if device.type != "cuda":
        return None, "no HBM peak for CPU"
    name = torch.cuda.get_device_name(device)
    part = next((p for p in PEAK_HBM_TBPS if p in name), None)
    if part is None:
        return None, f"no HBM peak known for {name}"
    return PEAK_HBM_TBPS[part], f"{part} SXM datasheet HBM bandwidth"


def device_peak_tflops(device: torch.device) -> tuple[float | None, str]:
    if device.type != "cuda":
        return None, "no peak for CPU"
    cap = torch.cuda.get_device_capability(device)
    if cap in PEAK_TFLOPS_16BIT:
        return PEAK_TFLOPS_16BIT[cap], f"sm_{cap[0]}{cap[1]} dense 16-bit peak of {PEAK_SOURCE[cap]}"
    return None, f"no peak known for sm_{cap[0]}{cap[1]}"
