"""The correctness check: flash-attention's tolerance rule against a float64 oracle.

An output passes when ``max|out - ref64| <= 2 * max|naive - ref64| + atol``: at most twice the error that
standard attention in the same dtype makes on the same inputs (``naive``: matmuls in the input dtype,
softmax in float32), plus ``atol``, twice float32's rounding noise at the output's magnitude, so that exact
float32 implementations are not failed by the last bit. NaN or Inf never passes.

Large cases are checked on a sample of (batch, head) pairs, always including the first and the last, with
every query row of each: the oracle's cost grows as Sq * Skv per head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from impls._reference import attention_ref

TOLERANCE_FACTOR = 2.0
MAX_CHECKED_HEADS = 8
FULL_CHECK_SCORES = 1 << 26  # check every head while B * Hq * Sq * Skv stays under this


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    max_error: float
    naive_error: float
    tolerance: float
    heads_checked: int
    message: str

    def as_dict(self) -> dict:
        return {
            "passed": self.passed,
            "max_error": self.max_error,
            "naive_error": self.naive_error,
            "tolerance": self.tolerance,
            "heads_checked": self.heads_checked,
            "message": self.message,
        }


def sampled_heads(batch: int, hq: int, scores_per_head: int) -> list[tuple[int, int]]:
    pairs = [(b, h) for b in range(batch) for h in range(hq)]
    if len(pairs) * scores_per_head <= FULL_CHECK_SCORES or len(pairs) <= MAX_CHECKED_HEADS:
        return pairs
    step = (len(pairs) - 1) / (MAX_CHECKED_HEADS - 1)
    return sorted({pairs[round(i * step)] for i in range(MAX_CHECKED_HEADS)})


class Oracle:
    """The float64 reference and the naive yardstick for one set of inputs, computed once."""

    def __init__(self, q, k, v, *, causal: bool, scale: float | None = None) -> None:
        batch, hq, sq, _ = q.shape
        group = hq // k.shape[1]
        self.heads = sampled_heads(batch, hq, sq * k.shape[2])
        bi = torch.tensor([b for b, _ in self.heads], device=q.device)
        hi = torch.tensor([h for _, h in self.heads], device=q.device)
        self._index = (bi, hi)
        # Each sampled head becomes one batch entry of a single-head problem.
        qs, ks, vs = q[bi, hi][:, None], k[bi, hi // group][:, None], v[bi, hi // group][:, None]
        self.ref = attention_ref(qs, ks, vs, causal=causal, scale=scale, upcast=True)
        naive = attention_ref(qs, ks, vs, causal=causal, scale=scale, upcast=False)
        self.naive_error = _max_abs(naive, self.ref)
        ref32 = self.ref.float()
        self.atol = 2 * _max_abs((ref32 + 0.3 - 0.3), ref32)
        self.tolerance = TOLERANCE_FACTOR * self.naive_error + self.atol

    def check(self, out: torch.Tensor, q: torch.Tensor) -> CheckResult:
        def fail(message: str, err: float = math.inf) -> CheckResult:
            return CheckResult(False, err, self.naive_error, self.tolerance, len(self.heads), message)

        if not isinstance(out, torch.Tensor):
            return fail(f"returned {type(out).__name__}, not a tensor")
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            return fail(
                f"returned {tuple(out.shape)} {out.dtype} on {out.device}; "
                f"expected {tuple(q.shape)} {q.dtype} on {q.device}"
            )
        sample = out[self._index][:, None]
        bad = ~torch.isfinite(sample)
        if bad.any():
            rows = bad.any(dim=-1).sum().item()
            return fail(f"{rows} output rows hold NaN or Inf")
        err = _max_abs(sample, self.ref)
        passed = err <= self.tolerance
        verdict = "within" if passed else "exceeds"
        message = (
            f"max error {err:.3g} {verdict} tolerance {self.tolerance:.3g} "
            f"(2 x naive {self.naive_error:.3g} + {self.atol:.2g})"
        )
        return CheckResult(passed, err, self.naive_error, self.tolerance, len(self.heads), message)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()
