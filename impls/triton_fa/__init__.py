"""Our Triton FlashAttention-2 kernel (``kernel.py``), registered as ``triton`` and, with its tiles moved
through tensor descriptors (TMA on Hopper) only, as ``triton-tma``.

Autotuned over tile shape, warps, pipeline depth and, on sm_90 and newer, how tiles are loaded (pointers or
descriptors: ``USE_TMA`` is a config parameter like the tile shape), keyed on the shape class (sequence-length buckets,
head dim, causal, GQA group, dtype); the chosen config is reported with every benchmark. Under
``TRITON_INTERPRET=1`` (CPU) the autotuner, which times on a GPU, is bypassed for one fixed config, and the
dots run in float32 because the interpreter computes half-precision ``tl.dot`` wrongly.
"""

from __future__ import annotations

import functools
import os

import torch

from impls._registry import FLOATS, Prepared, length_class, module_available, register

INTERPRETER_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1, "USE_TMA": False}
# (BLOCK_M, BLOCK_N, num_warps, num_stages). Measured on an H200 (fp16, D=128, 2K/8K, causal and not):
# 128x64 with 8 warps led (418-461 TFLOPS), 128x128/8 warps close behind; 4 warps on 128 rows fell to ~120.
# 64-row tiles stay for short sequences and 32-row tiles for decode-like Sq.
SEARCH_SPACE = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (32, 64, 4, 3)]
# The descriptor (TMA) path on sm_90+: it needs ~140 registers at 128x64 where the pointer path needs 244
# (cuobjdump, Triton 3.6), so with two pipeline stages two 128-row programs fit on one SM.
TMA_SEARCH_SPACE = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3)]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def requires(device: str) -> str | None:
    missing = module_available("triton", "pip install triton")(device)
    if missing:
        return missing
    if device == "cpu" and not interpreting():
        return "Triton needs a GPU on this machine; set TRITON_INTERPRET=1 to run its interpreter on CPU"
    return None


def plain_kernel():
    """The plain JIT kernel (no autotuning): for the interpreter and for scripts that pick a config."""
    from impls.triton_fa.kernel import attention_fwd

    return attention_fwd


def configs(pointer: bool = True, tma: bool = False) -> list[dict]:
    """The autotuner's candidates as launch options: the pointer-path space, the TMA-path space, or both."""
    spaces = [(False, SEARCH_SPACE)] * pointer + [(True, TMA_SEARCH_SPACE)] * tma
    return [{"BLOCK_M": m, "BLOCK_N": n, "USE_TMA": use_tma, "num_warps": w, "num_stages": s}
            for use_tma, space in spaces for m, n, w, s in space]


@functools.cache
def autotuned(pointer: bool, tma: bool):
    """The kernel autotuned over ``configs(pointer, tma)``, keyed on the shape class."""
    import triton

    def as_config(c: dict) -> triton.Config:
        options = {k: c[k] for k in ("num_warps", "num_stages")}
        return triton.Config({k: v for k, v in c.items() if k not in options}, **options)

    key = ["q_len_class", "kv_len_class", "group", "HEAD_DIM", "CAUSAL"]
    return triton.autotune(configs=[as_config(c) for c in configs(pointer, tma)], key=key)(plain_kernel())


def launch(config: dict, q, k, v, out, *, causal: bool, scale: float) -> None:
    """One launch with a fixed config (no autotuning), on contiguous CUDA tensors: for sweeps and tests."""
    import triton

    if config["USE_TMA"]:
        _install_descriptor_allocator()
    batch, heads, q_len, head_dim = q.shape
    grid = (triton.cdiv(q_len, config["BLOCK_M"]), batch * heads)
    plain_kernel()[grid](*kernel_arguments(q, k, v, out, scale), HEAD_DIM=head_dim, CAUSAL=causal,
                         DOT_FP32=q.dtype == torch.float32, **config)


def requires_tma(device: str) -> str | None:
    missing = requires(device)
    if missing or device == "cpu":
        return missing
    major, minor = torch.cuda.get_device_capability()
    return None if major >= 9 else f"tensor descriptors (TMA) need sm_90 or newer, this GPU is sm_{major}{minor}"


@functools.cache
def _install_descriptor_allocator() -> None:
    """Device-side tensor descriptors need global scratch memory, which Triton asks its allocator for."""
    import triton

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def kernel_arguments(q, k, v, out, scale: float) -> tuple:
    """``attention_fwd``'s runtime arguments, in order (the compile-time ones go by keyword)."""
    from impls.triton_fa.kernel import LOG2_E

    heads, q_len, kv_len = q.shape[1], q.shape[2], k.shape[2]
    return (
        q, k, v, out, scale * LOG2_E,  # scale in log2 units: exp(x * s) == exp2(x * s * log2 e)
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        heads, q_len, kv_len, length_class(q_len), length_class(kv_len), heads // k.shape[1],
    )


def tma_available(device: str) -> bool:
    return device != "cpu" and requires_tma(device) is None


def _make(name: str, paths: str, description: str) -> None:
    """Register one entry: ``paths`` is "pointer", "tma" or "pointer+tma" (the autotuner chooses)."""
    @register(name, family="triton", dtypes=FLOATS, head_dims=(16, 32, 64, 128, 256),
              requires=requires_tma if paths == "tma" else requires, description=description)
    def prepare(q, k, v, *, causal: bool, scale: float) -> Prepared:
        import triton

        interp = interpreting()
        pointer = "pointer" in paths
        tma = "tma" in paths and (paths == "tma" or tma_available(q.device.type))
        if tma:  # descriptors address the contiguous (B*H, S, D) views; they need scratch memory
            q, k, v = (t.contiguous() for t in (q, k, v))
            if q.is_cuda:
                _install_descriptor_allocator()
        else:
            q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        batch, heads, q_len, head_dim = q.shape
        out = torch.empty_like(q)
        args = kernel_arguments(q, k, v, out, scale)
        meta = {"HEAD_DIM": head_dim, "CAUSAL": causal, "DOT_FP32": interp or q.dtype == torch.float32}

        def grid(cfg):
            return (triton.cdiv(q_len, cfg["BLOCK_M"]), batch * heads)

        if interp:  # the autotuner times on a GPU: one fixed config
            launcher, meta = plain_kernel(), {**meta, **INTERPRETER_CONFIG, "USE_TMA": paths == "tma"}
        else:
            launcher = autotuned(pointer, tma)

        def run():
            launcher[grid](*args, **meta)
            return out

        run()  # compiles and, on a GPU, autotunes this shape class: outside any timed region
        config = {k: v for k, v in meta.items() if k in INTERPRETER_CONFIG} if interp else _describe(
            launcher.best_config)
        return Prepared(run, config=config)


_make("triton", "pointer+tma", "our FlashAttention-2 Triton kernel, autotuned over tiles, warps, stages and, "
      "on sm_90+, pointer or descriptor (TMA) loads")
_make("triton-tma", "tma", "the same kernel, tiles moved through tensor descriptors (TMA) only, autotuned")


def _describe(cfg) -> dict:
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
