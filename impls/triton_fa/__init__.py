"""Our Triton FlashAttention-2 kernel (``kernel.py``), registered as ``triton`` and, with its tiles moved
through tensor descriptors (TMA on Hopper), as ``triton-tma``.

Autotuned over tile shape, warps and pipeline depth, keyed on the shape class (sequence-length buckets,
head dim, causal, GQA group, dtype); the chosen config is reported with every benchmark. Under
``TRITON_INTERPRET=1`` (CPU) the autotuner, which times on a GPU, is bypassed for one fixed config, and the
dots run in float32 because the interpreter computes half-precision ``tl.dot`` wrongly.
"""

from __future__ import annotations

import functools
import os

import torch

from impls._registry import FLOATS, Prepared, length_class, module_available, register

INTERPRETER_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
# (BLOCK_M, BLOCK_N, num_warps, num_stages). Measured on an H200 (fp16, D=128, 2K/8K, causal and not):
# 128x64 with 8 warps led (418-461 TFLOPS), 128x128/8 warps close behind; 4 warps on 128 rows fell to ~120.
# 64-row tiles stay for short sequences and 32-row tiles for decode-like Sq.
SEARCH_SPACE = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (32, 64, 4, 3)]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def requires(device: str) -> str | None:
    missing = module_available("triton", "pip install triton")(device)
    if missing:
        return missing
    if device == "cpu" and not interpreting():
        return "Triton needs a GPU on this machine; set TRITON_INTERPRET=1 to run its interpreter on CPU"
    return None


@functools.cache
def _kernels():
    import triton

    from impls.triton_fa.kernel import attention_fwd

    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in SEARCH_SPACE
    ]
    key = ["q_len_class", "kv_len_class", "group", "HEAD_DIM", "CAUSAL", "USE_TMA"]
    return attention_fwd, triton.autotune(configs=configs, key=key)(attention_fwd)


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


def _make(name: str, use_tma: bool, description: str) -> None:
    @register(name, family="triton", dtypes=FLOATS, head_dims=(16, 32, 64, 128, 256),
              requires=requires_tma if use_tma else requires, description=description)
    def prepare(q, k, v, *, causal: bool, scale: float) -> Prepared:
        import triton

        plain, tuned = _kernels()
        if use_tma:  # descriptors address the contiguous (B*H, S, D) view
            q, k, v = (t.contiguous() for t in (q, k, v))
            if q.is_cuda:
                _install_descriptor_allocator()
        else:
            q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        batch, heads, q_len, head_dim = q.shape
        out = torch.empty_like(q)
        interp = interpreting()
        args = kernel_arguments(q, k, v, out, scale)
        meta = {"HEAD_DIM": head_dim, "CAUSAL": causal, "DOT_FP32": interp or q.dtype == torch.float32,
                "USE_TMA": use_tma}

        def grid(cfg):
            return (triton.cdiv(q_len, cfg["BLOCK_M"]), batch * heads)

        if interp:
            def run():
                plain[grid](*args, **meta, **INTERPRETER_CONFIG)
                return out
        else:
            def run():
                tuned[grid](*args, **meta)
                return out

        run()  # compiles and, on a GPU, autotunes this shape class: outside any timed region
        config = dict(INTERPRETER_CONFIG) if interp else _describe(tuned.best_config)
        return Prepared(run, config=config)


_make("triton", False, "our FlashAttention-2 Triton kernel, autotuned")
_make("triton-tma", True, "the same kernel moving tiles through tensor descriptors (TMA on Hopper), autotuned")


def _describe(cfg) -> dict:
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
