"""The named presets of cases (``--grid``): the papers' and the blog's charts, real models' shapes, serving steps,
and the small CPU twins of each, shared by correctness, benchmarks and reports."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from impls.contract import NO_WINDOW
from suite.cases import TRAINING_OPS, Case


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
        # decode steps our dense entries run as split-KV decode over the cache as pages (of 256 and of 64)
        + grid(batch=[batch], heads=[(8, 2)], seqlens=[(1, 256), (4, 192)], d=d)
    )


def _blog(causal: bool = True, seqlens: Iterable[int] = (1024, 2048, 4096, 8192, 16384)) -> list[Case]:
    return grid(batch=[4], heads=[(32, 32)], seqlens=seqlens, d=[128], causal=[causal])


def _fa3() -> list[Case]:
    """FlashAttention-3 paper's chart: B * S = 16384 and Hq * D = 2048."""
    return [
        Case(16384 // s, 2048 // d, 2048 // d, s, s, d, "fp16", c)
        for c, d, s in itertools.product((False, True), (64, 128), (512, 1024, 2048, 4096, 8192, 16384))
    ]


def backward(cases: Iterable[Case]) -> list[Case]:
    """Each (dense) case in the three modes of training: the forward, the backward alone and the whole step
    (``fwdbwd``), one after the other, so that a report sets them side by side."""
    return [replace(c, op=op) for c in cases for op in ("dense", "backward", "fwdbwd")]


def packed_training(cases: Iterable[Case]) -> list[Case]:
    """Each case over packed documents (``lengths`` random or equal) in the two modes of training that take them:
    the backward alone and the whole step. Their forward is a varlen case, left to the serving presets so that a
    training report's forward section stays dense."""
    return [replace(c, op=op) for c in cases for op in TRAINING_OPS]


def _train() -> list[Case]:
    """Training's attention: Llama-3-8B and the 70B's slice of 8 GPUs at 4K and 8K, 16K tokens a batch; and
    Llama-3-8B's 16K tokens packed from 8 documents of random lengths, causal within each."""
    dense = backward(Case(16384 // s, hq, hkv, s, s, d, "bf16", True, model=name)
                     for name, hq, hkv, d in (LLAMA3_8B, LLAMA3_70B_TP8) for s in (4096, 8192))
    name, hq, hkv, d = LLAMA3_8B
    return dense + packed_training([Case(8, hq, hkv, 16384, 16384, d, "bf16", True, op="backward", lengths="random",
                                         model=name)])


# Attention shapes of real checkpoints: (name in the case id, Hq, Hkv, D). The 70B is one GPU's slice of
# tensor parallelism 8 (64 query and 8 kv heads over 8 GPUs).
LLAMA3_8B = ("llama3-8b", 32, 8, 128)
LLAMA3_70B_TP8 = ("llama3-70b-tp8", 8, 1, 128)
MAX_SERVING_TOKENS = 1 << 21  # batch x cache length: 8 GiB of bf16 K and V for Llama-3-8B


def paged(model: tuple[str, int, int, int], batch: int, skv: int, *, sq: int = 1, page_size: int = 16,
          lengths: str = "uniform", dtype: str = "bf16", **variants) -> Case:
    """A decode step; ``variants``: the model's window and softcap, the cache's ``kv_dtype``."""
    name, hq, hkv, d = model
    return Case(batch, hq, hkv, sq, skv, d, dtype, True, op="paged", page_size=page_size, lengths=lengths,
                model=name, **variants)


def varlen(model: tuple[str, int, int, int], batch: int, total: int, *, lengths: str = "random",
           causal: bool = True, dtype: str = "bf16", **variants) -> Case:
    """A packed prefill; ``variants``: the model's window and softcap."""
    name, hq, hkv, d = model
    return Case(batch, hq, hkv, total, total, d, dtype, causal, op="varlen", lengths=lengths, model=name,
                **variants)


# Packed batches the varlen cases do not make (query lengths, key lengths, causal): chunked prefill, empty
# sequences, sequences shorter than a tile, the last one ending the packed tensors (``uneven_varlen``).
UNEVEN_VARLEN = [
    ([70, 0, 190, 3], [200, 64, 190, 3], True),
    ([1, 129, 64, 0, 77], [1, 300, 0, 5, 77], False),
    ([64, 1, 200], [0, 1, 333], True),  # the first sequence's rows see no key: zeros
    ([300, 5, 200, 1], [428, 133, 456, 1], True),  # keys whole 128-row tiles ahead: peeled (varlen_resolved)
]


def uneven_varlen(lengths_q: list[int], lengths_k: list[int], causal: bool, device: str | torch.device, *,
                  heads: tuple[int, int] = (8, 2), head_dim: int = 128, dtype: torch.dtype = torch.bfloat16):
    """A ``Varlen`` of random inputs with these per-sequence lengths."""
    from impls.contract import Varlen

    gen = torch.Generator(device=device).manual_seed(len(lengths_q))

    def packed(rows: int, h: int) -> torch.Tensor:
        return torch.randn((rows, h, head_dim), generator=gen, device=device).to(dtype)

    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=device)
                  for n in (lengths_q, lengths_k))
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    return Varlen(packed(total_q, heads[0]), packed(total_k, heads[1]), packed(total_k, heads[1]), cu_q, cu_k,
                  causal=causal)


def _serving() -> list[Case]:
    """Decode steps of two models: batch x cache length up to MAX_SERVING_TOKENS, one token per sequence,
    pages of 16; then at two points the variations: long-tailed lengths, pages of 64, 4 new tokens."""
    cases = []
    for model in (LLAMA3_8B, LLAMA3_70B_TP8):
        cases += [paged(model, b, n) for b in (1, 16, 64, 256) for n in (512, 2048, 8192, 32768, 131072)
                  if b * n <= MAX_SERVING_TOKENS]
        for b, n in ((16, 32768), (64, 8192)):
            cases += [paged(model, b, n, lengths="longtail"), paged(model, b, n, page_size=64),
                      paged(model, b, n, sq=4)]
    return cases


def _serving_fp8() -> list[Case]:
    """Decode steps over an fp8 cache beside the same steps over a bf16 one (both models, pages of 16, one new
    token): half the bytes to read, so what a step costs, not GB/s, is what to compare between the two."""
    steps = [(1, 32768), (16, 32768), (64, 8192), (256, 2048)]
    return [paged(model, b, n, kv_dtype=kv) for model in (LLAMA3_8B, LLAMA3_70B_TP8) for b, n in steps
            for kv in ("", "fp8")]


def mixed(model: tuple[str, int, int, int], decode: int, skv: int, chunks: int = 0, chunk_tokens: int = 1, *,
          lengths: str = "uniform", page_size: int = 16, dtype: str = "bf16") -> Case:
    """A mixed serving step (``Case``'s ``mixed``): ``decode`` sequences decoding over caches of up to ``skv`` tokens
    beside ``chunks`` prefill chunks of ``chunk_tokens`` new tokens each."""
    name, hq, hkv, d = model
    return Case(decode, hq, hkv, chunk_tokens, skv, d, dtype, True, op="mixed", page_size=page_size, lengths=lengths,
                model=name, chunks=chunks)


def with_parts(cases: list[Case]) -> list[Case]:
    """The cases, each mixed step followed by those of its parts (``Case.mixed_parts``) not already listed: the
    report sets a step against its parts timed apart."""
    listed: dict[str, Case] = {}
    for case in cases:
        for c in (case, *case.mixed_parts().values()):
            listed.setdefault(c.id, c)
    return list(listed.values())


def _serving_mixed() -> list[Case]:
    """Steps of a server that runs prefill chunks beside decoding (vLLM's chunked prefill), for two models: 64
    sequences decoding over 1-32K cached tokens (long-tailed) or 8K each beside 1-4 chunks of 512-4096 new tokens;
    and each step's parts, its decoding alone and its chunks alone."""
    cases = []
    for model in (LLAMA3_8B, LLAMA3_70B_TP8):
        cases += [mixed(model, 64, 32768, 2, 2048, lengths="longtail"), mixed(model, 64, 8192, 1, 4096)]
    return with_parts([*cases, mixed(LLAMA3_8B, 64, 32768, 4, 512, lengths="longtail"),
                       mixed(LLAMA3_8B, 16, 32768, 1, 4096)])


# MLA decode in the absorbed form: (name in the case id, query heads, latent width, rotary width). DeepSeek-V3 (and R1,
# the same attention) has 128 heads: 16 per GPU of tensor parallelism 8.
DEEPSEEK_V3_MLA_TP8 = ("deepseek-v3-tp8", 16, 512, 64)


def mla(model: tuple[str, int, int, int], batch: int, skv: int, *, sq: int = 1, page_size: int = 64,
        lengths: str = "uniform", dtype: str = "bf16", kv_dtype: str = "") -> Case:
    """An MLA decode step over a paged latent cache (``Case``'s ``mla``; ``kv_dtype`` "fp8": quantized)."""
    name, heads, latent, rope = model
    return Case(batch, heads, 1, sq, skv, latent + rope, dtype, True, op="mla", page_size=page_size,
                lengths=lengths, model=name, dv=latent, kv_dtype=kv_dtype)


def _mla() -> list[Case]:
    """DeepSeek-V3's decode steps per GPU of 8: batch x cache length up to MAX_SERVING_TOKENS, one and two new
    tokens (speculative decoding's one draft token), pages of 64; a long-tailed batch; and the one-token steps over an
    fp8 latent cache (FlashMLA's and FlashInfer's e4m3), beside their bf16 twins."""
    steps = [(b, n) for b in (1, 16, 64, 256) for n in (1024, 4096, 32768) if b * n <= MAX_SERVING_TOKENS]
    return ([mla(DEEPSEEK_V3_MLA_TP8, b, n, sq=sq) for sq in (1, 2) for b, n in steps]
            + [mla(DEEPSEEK_V3_MLA_TP8, 64, 8192, lengths="longtail")]
            + [mla(DEEPSEEK_V3_MLA_TP8, b, n, kv_dtype="fp8") for b, n in steps])


# The attention of real checkpoints: (name in the case id, Hq, Hkv, D, window, softcap). Gemma 2 alternates
# local (sliding window) and global layers, both softcapped at 50; Mistral slides a 4096-token window.
MODELS = [  # name, Hq, Hkv, D, window, softcap, Dv (0: D)
    ("llama3-8b", 32, 8, 128, NO_WINDOW, 0.0, 0),
    ("llama3-70b-tp8", 8, 1, 128, NO_WINDOW, 0.0, 0),
    ("mistral-7b", 32, 8, 128, (4096, 0), 0.0, 0),
    ("qwen2.5-7b", 28, 4, 128, NO_WINDOW, 0.0, 0),
    ("gemma2-9b-local", 16, 8, 256, (4096, 0), 50.0, 0),
    ("gemma2-9b-global", 16, 8, 256, NO_WINDOW, 50.0, 0),
    ("phi3-mini", 32, 32, 96, NO_WINDOW, 0.0, 0),
    ("gpt2", 12, 12, 64, NO_WINDOW, 0.0, 0),
    # DeepSeek-V3's MLA in prefill, decompressed: 128 heads of Dqk 192 (128 + 64 rotary), Dv 128; per GPU of 8.
    ("deepseek-v3-mla-tp8", 16, 16, 192, NO_WINDOW, 0.0, 128),
]


def _models(shapes: Iterable[tuple[int, int]], shrink: int = 1, window_to: int | None = None) -> list[Case]:
    """Each model's prefill at (batch, length). For the CPU twin, ``shrink`` divides the heads (keeping the GQA
    ratio) and ``window_to`` replaces a window's length, so that it ends inside the short sequences."""
    def scaled(window: tuple[int, int]) -> tuple[int, int]:
        return (window_to, window[1]) if window_to and window[0] > 0 else window

    return [Case(b, max(hq // shrink, hq // hkv), max(hkv // shrink, 1), n, n, d, "bf16", True, model=name,
                 window=scaled(window), softcap=cap, dv=dv)
            for name, hq, hkv, d, window, cap, dv in MODELS for b, n in shapes]


# The models whose serving steps differ from Llama-3's (the `serving` preset): a window, softcap, head dims 256,
# 96 and 64, a GQA ratio of 7, plain multi-head attention. MLA decodes in its absorbed form, another operation.
SERVED_MODELS = ("mistral-7b", "qwen2.5-7b", "gemma2-9b-local", "gemma2-9b-global", "phi3-mini", "gpt2")


def _models_serving(decode: Iterable[tuple[int, int]], prefill: Iterable[tuple[int, int]], shrink: int = 1,
                    window_to: int | None = None) -> list[Case]:
    """Each served model's decode steps (batch, cache length; one new token, pages of 16) and packed prefills
    (sequences, tokens in all; random lengths, causal), with its window and softcap. ``shrink`` and
    ``window_to`` as in ``_models``."""
    cases = []
    for name, hq, hkv, d, window, cap, _ in (m for m in MODELS if m[0] in SERVED_MODELS):
        model = (name, max(hq // shrink, hq // hkv), max(hkv // shrink, 1), d)
        window = (window_to, window[1]) if window_to and window[0] > 0 else window
        variants = {"window": window, "softcap": cap}
        cases += [paged(model, b, n, **variants) for b, n in decode]
        cases += [varlen(model, b, t, **variants) for b, t in prefill]
    return cases


def _varlen() -> list[Case]:
    """Packed prefill of random lengths, 16K and 64K tokens; and the equal-length batch beside the dense case
    of the same shape (the varlen path should cost nothing over the dense kernel)."""
    name, hq, hkv, d = LLAMA3_8B
    return ([varlen(LLAMA3_8B, b, t) for t, bs in ((16384, (4, 16)), (65536, (16, 64))) for b in bs]
            + [varlen(LLAMA3_8B, 4, 16384, lengths="equal"),
               Case(4, hq, hkv, 4096, 4096, d, "bf16", True, model=name)])


PRESETS: dict[str, list[Case]] = {
    # CPU: every code path (GQA, ragged, decode, Sq > Skv, each dtype) at sizes the Triton interpreter takes.
    "cpu": (
        _edge_cases(1, d=[64])
        + grid(batch=[2], heads=[(4, 2)], seqlens=[256], d=[128])
        + grid(heads=[(4, 2)], seqlens=[100, (1, 130)], dtype=["bf16", "fp32"])
        # Head dims that are not powers of two (Phi-3's 96, and 80): padded by some, refused with a reason by others.
        + grid(heads=[(4, 2)], seqlens=[100], d=[80, 96], causal=[True])
    ),
    # GPU correctness: edge cases at model-like batch/heads, and long sequences.
    "gpu": (
        _edge_cases(2, d=[64, 128])
        + grid(batch=[2], heads=[(8, 2)], seqlens=[333, (1, 4097), (128, 8192)], d=[128], dtype=["bf16"])
        + grid(batch=[4], heads=[(32, 32), (32, 8)], seqlens=[1024, 4096], d=[64, 128])
        + grid(batch=[4], heads=[(32, 8)], seqlens=[16384], d=[128])
        + grid(batch=[2], heads=[(8, 8)], seqlens=[1000, 2048], d=[128], dtype=["bf16"])
        # Head dims of real models that are not 64 or 128 (Phi-3's 96, Gemma's 256, DeepSeek's 192).
        + grid(batch=[2], heads=[(8, 2)], seqlens=[777], d=[32, 96, 192, 256], dtype=["bf16"])
    ),
    "blog": _blog(),
    # The blog's shapes without the mask: the other half of the speed targets (cuDNN, FA4) at B=4, H=32, D=128.
    "blog-noncausal": _blog(causal=False),
    "ladder": _blog(),
    "fa3": _fa3(),
    # The FlashAttention-3 paper's backward chart (same shapes as fa3), and training shapes of two models.
    "fa3-bwd": backward(_fa3()),
    "train": _train(),
    # The backward's CPU twin: GQA, MQA, causal with Sq < Skv and Sq > Skv, D 64 and 128, fp32 and fp16, a
    # sliding window with softcap (Gemma-2's variants), and documents of random lengths packed (GQA, causal).
    "bwd-cpu": backward([
        Case(1, 4, 2, 100, 100, 64, "fp32", True),
        Case(1, 4, 1, 70, 130, 64, "fp16", True),
        Case(1, 2, 2, 130, 70, 128, "fp32", True),
        Case(2, 2, 1, 40, 40, 128, "fp16", False),
        Case(1, 2, 1, 90, 90, 64, "bf16", True, window=(32, -1), softcap=20.0),
    ]) + packed_training([Case(4, 4, 2, 150, 150, 64, "fp16", True, op="backward", lengths="random")]),
    "gqa": grid(batch=[4], heads=[(32, h) for h in (32, 8, 4, 1)], seqlens=[4096], d=[128]),
    "decode": grid(
        batch=[4], heads=[(32, 8)], seqlens=[(sq, skv) for sq in (1, 16) for skv in (1024, 4096, 16384, 32768)],
        d=[128], causal=[True],
    ),
    # Under compute-sanitizer (memcheck, racecheck): every code path, smallest sizes.
    "sanitize": (
        grid(heads=[(4, 4)], seqlens=[128, 200], d=[64])
        + grid(heads=[(8, 2)], seqlens=[97, (1, 130), (64, 300), (150, 100), (1, 256), (4, 192)], d=[128],
               dtype=["bf16"])
    ),
    # Benchmarks without a GPU: small enough for the Triton interpreter.
    "cpu-bench": grid(heads=[(2, 2)], seqlens=[128, 256], d=[64], dtype=["fp32"]),
    # Prefill as serving runs it, per model: 4 x 4K and 1 x 32K.
    "models": _models([(4, 4096), (1, 32768)]),
    "models-cpu": _models([(1, 96)], shrink=64, window_to=32),
    # Serving steps of the models beside Llama-3: decode over pages and packed prefill, with their variants.
    "models-serving": _models_serving(decode=[(64, 8192), (16, 32768)], prefill=[(16, 65536)]),
    "models-serving-cpu": _models_serving(decode=[(2, 100)], prefill=[(3, 200)], shrink=16, window_to=40),
    "serving": _serving(),
    "serving-fp8": _serving_fp8(),
    "varlen": _varlen(),
    # The serving twins on CPU (and as cheap GPU edge cases): ragged lengths over page boundaries, GQA and MQA,
    # several new tokens, pages of 16 and 32, each half dtype.
    "serving-cpu": [
        paged(("", 4, 2, 64), 3, 100, lengths="longtail"),
        paged(("", 8, 1, 64), 2, 77, sq=4, dtype="fp16"),
        paged(("", 4, 4, 64), 2, 40, page_size=32),
        paged(("", 4, 2, 128), 1, 16, sq=3, dtype="fp16"),
        paged(("", 4, 1, 64), 1, 300),  # MQA at batch 1: many chunks, more than the combine reads at once
        # An fp8 cache: ragged, several new tokens, MQA over many chunks
        paged(("", 4, 2, 64), 3, 100, lengths="longtail", kv_dtype="fp8"),
        paged(("", 8, 1, 64), 2, 77, sq=4, dtype="fp16", kv_dtype="fp8"),
    ],
    "varlen-cpu": [
        varlen(("", 4, 2, 64), 3, 300),
        varlen(("", 4, 1, 64), 2, 130, causal=False, dtype="fp16"),
        varlen(("", 8, 2, 64), 4, 256, lengths="equal"),
    ],
    # Serving benchmarks without a GPU (decode ranks by GB/s, prefill by TFLOPS: one preset each).
    "serving-cpu-bench": [paged(("", 4, 2, 64), 4, 256), paged(("", 4, 2, 64), 4, 512)],
    "varlen-cpu-bench": [varlen(("", 4, 2, 64), 2, 256)],
    "serving-mixed": _serving_mixed(),
    # The mixed twin on CPU (and as cheap GPU edge cases): decoding sequences beside prefill chunks over several
    # query and key tiles, GQA and MQA, a group of 3 and a head dim that is not a power of two, pages that the
    # lengths do not fill, and both ends (prefill alone, decode alone); the first step with its two parts.
    "serving-mixed-cpu": [
        *with_parts([mixed(("", 4, 2, 64), 3, 100, 2, 40, lengths="longtail")]),
        mixed(("", 8, 1, 64), 2, 77, 1, 33, page_size=32, dtype="fp16"),
        mixed(("", 6, 2, 40), 4, 70),
        mixed(("", 4, 4, 32), 0, 0, 2, 50, dtype="fp32"),
    ],
    "mla": _mla(),
    # The MLA twin on CPU (and as cheap GPU edge cases): narrow latent and rotary parts (one not a power of two),
    # ragged lengths over page boundaries, one and two new tokens, many chunks at batch 1.
    "mla-cpu": [
        mla(("", 4, 32, 8), 3, 100, page_size=16, lengths="longtail"),
        mla(("", 8, 64, 16), 2, 77, sq=2, page_size=32, dtype="fp16"),
        mla(("", 4, 48, 16), 1, 300, page_size=16),
        # An fp8 latent cache. No sequence of one token: its row's output is one dequantized latent row, which the
        # naive yardstick rounds to bf16 exactly, while Triton's interpreter truncates every store to bf16 (a GPU
        # rounds to nearest), one ulp off against a naive error of nearly 0.
        mla(("", 8, 64, 16), 3, 150, sq=2, page_size=16, lengths="longtail", kv_dtype="fp8"),
    ],
}


# The presets the README documents. ``sanitize`` is run by the GPU tools under compute-sanitizer: accepted by
# ``--grid`` but left out of the lists a user reads.
LISTED_PRESETS = tuple(name for name in PRESETS if name != "sanitize")


def preset(name: str) -> list[Case]:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown grid preset {name!r}; known: {', '.join(LISTED_PRESETS)}") from None


def case_by_id(case_id: str) -> Case:
    """The case with this id, from whichever preset holds it (for tools that take a case id)."""
    for grid_cases in PRESETS.values():
        for case in grid_cases:
            if case.id == case_id:
                return case
    raise ValueError(f"no preset has a case {case_id!r}")


def cases(names: Iterable[str]) -> Iterator[tuple[str, Case]]:
    """(preset, case) for each named preset, each case once per run (first preset wins)."""
    seen: set[Case] = set()
    for name in names:
        for case in preset(name):
            if case not in seen:
                seen.add(case)
                yield name, case
