"""The case grid: one definition of cases and named presets, shared by correctness, benchmarks and reports."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    batch: int
    hq: int
    hkv: int
    sq: int
    skv: int
    d: int
    dtype: str = "fp16"
    causal: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.hq % self.hkv:
            raise ValueError(f"GQA ratio: hq={self.hq} is not a multiple of hkv={self.hkv}")

    @property
    def id(self) -> str:
        """Reads like ``fp16-causal-h8:2-s300x300-d128`` (``-b4`` appended when batch > 1)."""
        mask = "causal" if self.causal else "full"
        tail = f"-b{self.batch}" if self.batch != 1 else ""
        return f"{self.dtype}-{mask}-h{self.hq}:{self.hkv}-s{self.sq}x{self.skv}-d{self.d}{tail}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def gqa_ratio(self) -> int:
        return self.hq // self.hkv

    def as_dict(self) -> dict:
        return asdict(self)

    def make_inputs(self, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random normal q, k, v; the seed comes from the case, so every case draws fresh data."""
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(self.id.encode()))
        shapes = [(self.batch, self.hq, self.sq, self.d)] + [(self.batch, self.hkv, self.skv, self.d)] * 2
        return tuple(  # type: ignore[return-value]
            torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(self.torch_dtype)
            for s in shapes
        )


def grid(
    *,
    batch: Iterable[int] = (1,),
    heads: Iterable[tuple[int, int]] = ((4, 4),),
    seqlens: Iterable[tuple[int, int] | int] = (128,),
    d: Iterable[int] = (64,),
    dtype: Iterable[str] = ("fp16",),
    causal: Iterable[bool] = (False, True),
) -> list[Case]:
    """Cartesian product; a bare seqlen ``s`` means ``Sq = Skv = s``."""
    pairs = [(s, s) if isinstance(s, int) else s for s in seqlens]
    return [
        Case(b, hq, hkv, sq, skv, dd, dt, c)
        for dt, c, dd, (hq, hkv), b, (sq, skv) in itertools.product(dtype, causal, d, heads, batch, pairs)
    ]


def _edge_cases(batch: int, d: Iterable[int]) -> list[Case]:
    """Lengths on and off the 64/128 grid, decode, chunked prefill and Sq > Skv, over MHA/GQA/MQA."""
    return (
        grid(batch=[batch], heads=[(4, 4)], seqlens=[1, 64, 128, 300], d=d)
        + grid(batch=[batch], heads=[(8, 2)], seqlens=[97, 300], d=d)
        + grid(batch=[batch], heads=[(8, 1)], seqlens=[200], d=d)
        + grid(batch=[batch], heads=[(8, 2)], seqlens=[(1, 300), (64, 1024), (200, 130)], d=d)
    )


def _blog(causal: bool = True, seqlens: Iterable[int] = (1024, 2048, 4096, 8192, 16384)) -> list[Case]:
    return grid(batch=[4], heads=[(32, 32)], seqlens=seqlens, d=[128], causal=[causal])


def _fa3() -> list[Case]:
    """FlashAttention-3 paper's chart: B * S = 16384 and Hq * D = 2048."""
    return [
        Case(16384 // s, 2048 // d, 2048 // d, s, s, d, "fp16", c)
        for c, d, s in itertools.product((False, True), (64, 128), (512, 1024, 2048, 4096, 8192, 16384))
    ]


PRESETS: dict[str, list[Case]] = {
    # CPU: every code path (GQA, ragged, decode, Sq > Skv, each dtype) at sizes the Triton interpreter takes.
    "cpu": (
        _edge_cases(1, d=[64])
        + grid(batch=[2], heads=[(4, 2)], seqlens=[256], d=[128])
        + grid(heads=[(4, 2)], seqlens=[100, (1, 130)], dtype=["bf16", "fp32"])
    ),
    # GPU correctness: edge cases at model-like batch/heads, and long sequences.
    "gpu": (
        _edge_cases(2, d=[64, 128])
        + grid(batch=[2], heads=[(8, 2)], seqlens=[333, (1, 4097), (128, 8192)], d=[128], dtype=["bf16"])
        + grid(batch=[4], heads=[(32, 32), (32, 8)], seqlens=[1024, 4096], d=[64, 128])
        + grid(batch=[4], heads=[(32, 8)], seqlens=[16384], d=[128])
        + grid(batch=[2], heads=[(8, 8)], seqlens=[1000, 2048], d=[128], dtype=["bf16"])
    ),
    "blog": _blog(),
    # The blog's shapes without the mask: the other half of the speed targets (cuDNN, FA4) at B=4, H=32, D=128.
    "blog-noncausal": _blog(causal=False),
    "ladder": _blog(),
    "fa3": _fa3(),
    "gqa": grid(batch=[4], heads=[(32, h) for h in (32, 8, 4, 1)], seqlens=[4096], d=[128]),
    "decode": grid(
        batch=[4], heads=[(32, 8)], seqlens=[(sq, skv) for sq in (1, 16) for skv in (1024, 4096, 16384, 32768)],
        d=[128], causal=[True],
    ),
    # Under compute-sanitizer (memcheck, racecheck): every code path, smallest sizes.
    "sanitize": (
        grid(heads=[(4, 4)], seqlens=[128, 200], d=[64])
        + grid(heads=[(8, 2)], seqlens=[97, (1, 130), (64, 300), (150, 100)], d=[128], dtype=["bf16"])
    ),
    # Benchmarks without a GPU: small enough for the Triton interpreter.
    "cpu-bench": grid(heads=[(2, 2)], seqlens=[128, 256], d=[64], dtype=["fp32"]),
}


def preset(name: str) -> list[Case]:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown grid preset {name!r}; known: {', '.join(PRESETS)}") from None


def cases(names: Iterable[str]) -> Iterator[tuple[str, Case]]:
    """(preset, case) for each named preset, each case once per run (first preset wins)."""
    seen: set[Case] = set()
    for name in names:
        for case in preset(name):
            if case not in seen:
                seen.add(case)
                yield name, case
