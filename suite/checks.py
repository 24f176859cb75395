"""The correctness check: flash-attention's tolerance rule against a float64 oracle.

An output passes when ``max|out - ref64| <= 2 * max|naive - ref64| + atol``: at most twice the error that
standard attention in the same dtype makes on the same inputs (``naive``: matmuls in the input dtype,
softmax in float32), plus ``atol``, twice float32's rounding noise at the output's magnitude, so that exact
float32 implementations are not failed by the last bit. NaN or Inf never passes.

Large cases are checked on a sample of (batch, head) pairs, always including the first and the last, with
every query row of each: the oracle's cost grows as Sq * Skv per head. Serving batches (paged decode, varlen)
are checked on a sample of sequences, every head and row of each. The backward pass (``BackwardOracle``) holds
each of dq, dk and dv to the same rule against float64 autograd, on sampled (batch, kv head) pairs with all the
query heads of each one's group; over packed documents, on sampled (document, kv head) pairs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from impls.reference import attention_grads_ref, attention_ref, serving_attention_ref

TOLERANCE_FACTOR = 2.0
MAX_CHECKED_HEADS = 8
MAX_CHECKED_SEQUENCES = 16  # serving batches: sequences checked, every head and row of each
PACKED_OPS = ("varlen", "mixed")  # serving operations whose queries are packed rows (total_q, H, D)
FULL_CHECK_SCORES = 1 << 26  # check every head while B * Hq * Sq * Skv stays under this


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    max_error: float
    naive_error: float
    tolerance: float
    sampled: int  # (batch, head) pairs (dense) or sequences (serving) checked
    message: str

    def as_dict(self) -> dict:
        return {
            "passed": self.passed,
            "max_error": self.max_error,
            "naive_error": self.naive_error,
            "tolerance": self.tolerance,
            "sampled": self.sampled,
            "message": self.message,
        }


def sampled_heads(batch: int, hq: int, scores_per_head: int) -> list[tuple[int, int]]:
    pairs = [(b, h) for b in range(batch) for h in range(hq)]
    if len(pairs) * scores_per_head <= FULL_CHECK_SCORES or len(pairs) <= MAX_CHECKED_HEADS:
        return pairs
    step = (len(pairs) - 1) / (MAX_CHECKED_HEADS - 1)
    return sorted({pairs[round(i * step)] for i in range(MAX_CHECKED_HEADS)})


class Oracle:
    """The float64 reference and the naive yardstick on a sample of one problem, computed once.

    ``refs`` and ``naives`` are matching lists of tensors (a sampled head, or a sampled sequence, each);
    ``extract`` takes an implementation's output to the same list, ``expected`` is what that output must be.
    """

    def __init__(self, refs: list[torch.Tensor], naives: list[torch.Tensor],
                 extract: Callable[[torch.Tensor], list[torch.Tensor]], expected: torch.Tensor,
                 sampled: int) -> None:
        self.refs, self._extract, self._expected, self.sampled = refs, extract, expected, sampled
        self.naive_error = max(_max_abs(n, r) for n, r in zip(naives, refs, strict=True))
        self.atol = max(2 * _max_abs((r.float() + 0.3 - 0.3), r.float()) for r in refs)
        self.tolerance = TOLERANCE_FACTOR * self.naive_error + self.atol

    @classmethod
    def dense(cls, q, k, v, *, causal: bool, scale: float | None = None, **variants) -> Oracle:
        """Sampled (batch, head) pairs, every query row of each; ``variants``: window, softcap."""
        batch, hq, sq, _ = q.shape
        group = hq // k.shape[1]
        heads = sampled_heads(batch, hq, sq * k.shape[2])
        bi = torch.tensor([b for b, _ in heads], device=q.device)
        hi = torch.tensor([h for _, h in heads], device=q.device)
        # Each sampled head becomes one batch entry of a single-head problem.
        qs, ks, vs = q[bi, hi][:, None], k[bi, hi // group][:, None], v[bi, hi // group][:, None]
        ref = attention_ref(qs, ks, vs, causal=causal, scale=scale, upcast=True, **variants)
        naive = attention_ref(qs, ks, vs, causal=causal, scale=scale, upcast=False, **variants)
        expected = q[..., :1].expand(*q.shape[:3], v.shape[-1])  # o's shape, dtype and device, allocating nothing
        return cls([ref], [naive], lambda out: [out[bi, hi][:, None]], expected, len(heads))

    @classmethod
    def serving(cls, inputs, *, scale: float | None = None, **variants) -> Oracle:
        """Sampled sequences of a paged-decode, MLA-decode, varlen or mixed batch, every head and query row of each;
        ``variants``: window, softcap."""
        decode = inputs.op not in PACKED_OPS  # paged and MLA decode: (B, Sq_new, H, D) in and out
        batch = inputs.q.shape[0] if decode else inputs.batch
        rows = [1] * batch if decode else inputs.seqlens_q()
        seqs = [b for b in sampled_sequences(batch) if rows[b]]  # a varlen sequence may have no rows to check
        refs = serving_attention_ref(inputs, scale=scale, upcast=True, indices=seqs, **variants)
        naives = serving_attention_ref(inputs, scale=scale, upcast=False, indices=seqs, **variants)

        def extract(out: torch.Tensor) -> list[torch.Tensor]:
            if decode:
                return [out[b].transpose(0, 1)[None] for b in seqs]
            return [out[inputs.offsets_q[b]:inputs.offsets_q[b + 1]].transpose(0, 1)[None] for b in seqs]

        return cls([refs[b] for b in seqs], [naives[b] for b in seqs], extract, inputs.q, len(seqs))

    def check(self, out: torch.Tensor) -> CheckResult:
        def fail(message: str, err: float = math.inf) -> CheckResult:
            return CheckResult(False, err, self.naive_error, self.tolerance, self.sampled, message)

        expected = self._expected
        if not isinstance(out, torch.Tensor):
            return fail(f"returned {type(out).__name__}, not a tensor")
        if out.shape != expected.shape or out.dtype != expected.dtype or out.device != expected.device:
            return fail(
                f"returned {tuple(out.shape)} {out.dtype} on {out.device}; "
                f"expected {tuple(expected.shape)} {expected.dtype} on {expected.device}"
            )
        samples = self._extract(out)
        rows = sum(int((~torch.isfinite(s)).any(dim=-1).sum()) for s in samples)
        if rows:
            return fail(f"{rows} output rows hold NaN or Inf")
        err = max(_max_abs(s, r) for s, r in zip(samples, self.refs, strict=True))
        passed = err <= self.tolerance
        verdict = "within" if passed else "exceeds"
        message = (
            f"max error {err:.3g} {verdict} tolerance {self.tolerance:.3g} "
            f"(2 x naive {self.naive_error:.3g} + {self.atol:.2g})"
        )
        return CheckResult(passed, err, self.naive_error, self.tolerance, self.sampled, message)


def sampled_sequences(batch: int) -> list[int]:
    """Every sequence of a small batch; of a large one, MAX_CHECKED_SEQUENCES spread over it, first and last."""
    if batch <= MAX_CHECKED_SEQUENCES:
        return list(range(batch))
    step = (batch - 1) / (MAX_CHECKED_SEQUENCES - 1)
    return sorted({round(i * step) for i in range(MAX_CHECKED_SEQUENCES)})


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


GRADIENTS = ("dq", "dk", "dv")


class BackwardOracle:
    """The rule for each of ``(dq, dk, dv)``: one ``Oracle`` per gradient, on sampled (sequence, kv head) pairs with
    every query head of the pair's group (dk and dv sum over them) and every row. Packed documents (``cu_seqlens``)
    are sampled as serving batches' sequences are, then their (document, kv head) pairs."""

    def __init__(self, inputs, *, scale: float | None = None, **variants) -> None:
        q, hkv = inputs.q, inputs.k.shape[1]  # heads are axis 1 of dense and packed tensors alike
        group = q.shape[1] // hkv
        lengths = inputs.seqlens()
        sequences = [b for b in sampled_sequences(inputs.batch) if lengths[b]] if inputs.packed else list(
            range(inputs.batch))
        longest = max(lengths[b] for b in sequences)
        scores = group * longest * (longest if inputs.packed else inputs.k.shape[2])
        pairs = [(sequences[i], h) for i, h in sampled_heads(len(sequences), hkv, scores)]

        def pick(t: torch.Tensor, pair: tuple[int, int], query_heads: bool) -> torch.Tensor:
            """A pair's part of ``t`` in the dense layout, (1, group, S, D) (query heads) or (1, 1, S, D)."""
            b, h = pair
            heads = slice(h * group, (h + 1) * group) if query_heads else slice(h, h + 1)
            return inputs.document(t, b)[:, heads] if inputs.packed else t[b:b + 1, heads]

        options = {"causal": inputs.causal, "scale": scale, **variants}
        samples = [[pick(t, pair, i in (0, 3)) for i, t in enumerate((q, inputs.k, inputs.v, inputs.do))]
                   for pair in pairs]
        # One pair at a time: autograd keeps every chunk's scores, so memory grows with the pairs done at once.
        refs, naives = ([attention_grads_ref(*sample, upcast=upcast, **options) for sample in samples]
                        for upcast in (True, False))
        self.sampled = len(pairs)
        self.oracles = [Oracle([ref[i] for ref in refs], [naive[i] for naive in naives],
                               lambda out, query=i == 0: [pick(out, pair, query) for pair in pairs], t, len(pairs))
                        for i, t in enumerate((q, inputs.k, inputs.v))]

    def check(self, out) -> CheckResult:
        """Passes when every gradient does; the figures are those of the gradient nearest its tolerance (or the
        first that fails)."""
        if not isinstance(out, tuple | list) or len(out) != len(GRADIENTS):
            what = f"{len(out)} values" if isinstance(out, tuple | list) else type(out).__name__
            return CheckResult(False, math.inf, math.nan, math.nan, self.sampled,
                               f"returned {what}, not (dq, dk, dv)")
        results = [oracle.check(grad) for oracle, grad in zip(self.oracles, out, strict=True)]
        failed = [r for r in results if not r.passed]
        worst = failed[0] if failed else max(results, key=lambda r: r.max_error / max(r.tolerance, 1e-300))
        message = "; ".join(f"{name}: {r.message}" for name, r in zip(GRADIENTS, results, strict=True))
        return CheckResult(not failed, worst.max_error, worst.naive_error, worst.tolerance, self.sampled, message)
