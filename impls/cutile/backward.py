"""Registers our cuTile FlashAttention-2 backward (``backward_kernels.py``) as ``cutile`` for op="backward": its fixed
tiles per head dim, the three launches of a call, and the forward of its training step (``fwd_lse``)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from impls._registry import HALF, Prepared, heads_by_batch, register
from impls.contract import Backward
from impls.cutile.config import bind, kernel_with_hints, needs_int64, tile_d
from impls.cutile.launch import Launches, requires

HEAD_DIMS = tuple(range(64, 257, 8))  # padded to 128 or 256 where not a power of two
DELTA_ROWS = 64  # query rows of do * o each block of the pre-pass sums
DELTA_WARPS = 4  # one warpgroup: the pre-pass has no matrix product to share out
MODULE = "backward_kernels"


@dataclass(frozen=True)
class Tiles:
    """One form of the launches: (TILE_N, TILE_M) of the dk/dv kernel, (TILE_M, TILE_N) of the dq kernel, each
    kernel's worker warps, and whether the causal dk/dv kernel splits its loop (``bwd_dkdv``'s LOOP_SPLIT)."""

    dkdv_n: int
    dkdv_m: int
    dkdv_warps: int
    dq_m: int
    dq_n: int
    dq_warps: int
    dkdv_loop_split: bool = True

    def describe(self) -> dict:
        return {**asdict(self), "tuned": False}


# Per head-dim tile set (64, 128, 256): the fixed tiles first, then other forms that compile for sm_90 without stack,
# causal and not, for a later tune. Spilled and left out: dk/dv 64 x 128 at D=64 (400-576 B), 64 x 16 with four
# warps and 32 x 32 at D=256 (376-1024 B), dq 128 x 64 at D=256 (2.3 KB).
SPACE = {
    64: (Tiles(128, 64, 8, 128, 64, 8, dkdv_loop_split=False), Tiles(128, 128, 8, 128, 128, 8, dkdv_loop_split=False),
         Tiles(64, 64, 4, 64, 64, 4, dkdv_loop_split=False)),
    128: (Tiles(128, 64, 8, 128, 64, 8), Tiles(128, 64, 8, 128, 128, 8, dkdv_loop_split=False),
          Tiles(64, 64, 4, 64, 64, 4)),
    256: (Tiles(64, 32, 8, 64, 64, 8, dkdv_loop_split=False), Tiles(64, 16, 8, 128, 32, 8),
          Tiles(64, 32, 8, 64, 32, 4, dkdv_loop_split=False)),
}


def space(head_dim: int) -> tuple[Tiles, ...]:
    """The candidates of a head dim's tile set (``SPACE``), the fixed ones first."""
    return SPACE[max(tile_d(head_dim), 64)]


def tiles(head_dim: int) -> Tiles:
    """The untuned tiles of a head dim, chosen by compiling for sm_90 (``tests/test_cutile_backward.py``): the
    largest that hold their float32 accumulators (dk and dv: TILE_N x D each; dq: TILE_M x D) in registers without
    spilling, with two warpgroups each (a warpgroup MMA is 64 rows). At D=64 and D=256 the causal dk/dv kernel's
    two loops (masked and mask-free) spilled (72 and 208-792 B of stack); one loop that masks every tile does not,
    and the mask is cheap beside four products."""
    return space(head_dim)[0]


@dataclass(frozen=True)
class ForwardTiles:
    """The training step's forward: TILE_M x TILE_N and worker warps, the dq kernel's (the same walk: a query tile
    against the key tiles it sees, a TILE_M x D float32 accumulator)."""

    m: int
    n: int
    warps: int

    def describe(self) -> dict:
        return {"forward": asdict(self), "tuned": False}


def kernel(name: str, warps: int, int64: bool):
    """Kernel ``name`` of ``backward_kernels.py`` with ``warps`` worker warps, with 64-bit indexing where asked."""
    return kernel_with_hints(name + ("_int64" if int64 else ""), (("num_worker_warps", warps),), MODULE)


class BackwardCall(Launches):
    """The three launches of one backward call, with contiguous inputs, the delta workspace and the gradients."""

    def __init__(self, inputs: Backward, *, scale: float) -> None:
        q, k, v, o, do = (t.contiguous() for t in (inputs.q, inputs.k, inputs.v, inputs.o, inputs.do))
        lse = inputs.lse.contiguous()
        batch, heads, q_len, head_dim = q.shape
        kv_heads, kv_len = k.shape[1], k.shape[2]
        self.variant = t = tiles(head_dim)
        self.out = dq, dk, dv = tuple(torch.empty_like(x) for x in (q, k, v))
        delta = torch.empty_like(lse)
        int64 = needs_int64(q, k, v, o, do)
        common = shared_constants(q, k, causal=inputs.causal, scale=scale)
        self.launches = [
            ((math.ceil(q_len / DELTA_ROWS), *heads_by_batch(heads, batch)), kernel("bwd_delta", DELTA_WARPS, int64),
             bind("bwd_delta", MODULE, Out=o, DO=do, Delta=delta, TILE_M=DELTA_ROWS, **common)),
            ((math.ceil(kv_len / t.dkdv_n), *heads_by_batch(kv_heads, batch, "kv heads")),
             kernel("bwd_dkdv", t.dkdv_warps, int64),
             bind("bwd_dkdv", MODULE, Q=q, K=k, V=v, DO=do, LSE=lse, Delta=delta, DK=dk, DV=dv, TILE_M=t.dkdv_m,
                  TILE_N=t.dkdv_n, LOOP_SPLIT=t.dkdv_loop_split, **common)),
            ((math.ceil(q_len / t.dq_m), *heads_by_batch(heads, batch)), kernel("bwd_dq", t.dq_warps, int64),
             bind("bwd_dq", MODULE, Q=q, K=k, V=v, DO=do, LSE=lse, Delta=delta, DQ=dq, TILE_M=t.dq_m, TILE_N=t.dq_n,
                  EVEN_N=kv_len % t.dq_n == 0, **common)),
        ]


def shared_constants(q: torch.Tensor, k: torch.Tensor, *, causal: bool, scale: float) -> dict:
    """What every kernel of ``backward_kernels.py`` takes alike: the scale, the bottom-right causal offset, the GQA
    group and the padded head dim."""
    return {"qk_scale": scale, "causal_offset": k.shape[2] - q.shape[2], "group": q.shape[1] // k.shape[1],
            "TILE_D": tile_d(q.shape[-1]), "CAUSAL": causal}


class ForwardCall(Launches):
    """The one launch of a training step's forward: ``(o, lse)``, the same two buffers every call."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float) -> None:
        q, k, v = (t.contiguous() for t in (q, k, v))
        batch, heads, q_len, head_dim = q.shape
        t = tiles(head_dim)
        self.variant = ForwardTiles(t.dq_m, t.dq_n, t.dq_warps)
        self.out = o, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
        self.launches = [
            ((math.ceil(q_len / t.dq_m), *heads_by_batch(heads, batch)),
             kernel("fwd_lse", t.dq_warps, needs_int64(q, k, v)),
             bind("fwd_lse", MODULE, Q=q, K=k, V=v, Out=o, LSE=lse, TILE_M=t.dq_m, TILE_N=t.dq_n,
                  EVEN_N=k.shape[2] % t.dq_n == 0, **shared_constants(q, k, causal=causal, scale=scale))),
        ]


def training_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float) -> Prepared:
    """The forward of a training step (``forward=`` of the backward's entry): our dense forward writes no lse."""
    return ForwardCall(q, k, v, causal=causal, scale=scale).prepared()


@register("cutile", op="backward", family="cutile", dtypes=HALF, devices=("cuda",), head_dims=HEAD_DIMS,
          requires=requires, needs=("lse",), forward=training_forward,
          description="our FlashAttention-2 backward in cuTile: delta pre-pass, dk/dv over key tiles walking the "
                      "query tiles of the GQA group, dq over query tiles; fixed tiles, untuned")
def cutile_backward(inputs: Backward, *, scale: float) -> Prepared:
    return BackwardCall(inputs, scale=scale).prepared()
