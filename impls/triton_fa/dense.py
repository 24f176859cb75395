"""Registers our Triton FlashAttention-2 kernel (``kernel.py``) as ``triton`` and, with its tiles moved through
tensor descriptors (TMA on Hopper) only, as ``triton-tma``, and over packed batches as ``triton``'s varlen entry.

Autotuned over tile shape, warps, pipeline depth and, on sm_90 and newer, how tiles are loaded (pointers or
descriptors built in the kernel or on the host: ``USE_TMA`` and ``HOST_DESC`` are config parameters like the tile
shape), keyed on the shape class (sequence-length buckets, head dim, causal, GQA group, dtype); the chosen config is
reported with every benchmark. Under ``TRITON_INTERPRET=1`` (CPU) the autotuner, which times on a GPU, is bypassed
for one fixed config, and the dots run in float32 because the interpreter computes half-precision ``tl.dot``
wrongly.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import torch

from impls._plans import decode_route
from impls._registry import FLOATS, Prepared, heads_by_batch, length_class, register
from impls.contract import NO_WINDOW, binding_window, window_bounds
from impls.timing import settle_gpu
from impls.triton_fa.config import (
    HEAD_DIMS,
    PERSISTENT_BY_HEAD,
    PERSISTENT_HEAVY_FIRST,
    POW2_HEAD_DIMS,
    TUNING,
    block_d,
    head_dims,
    install_descriptor_allocator,
    interpreting,
    requires,
    requires_tma,
    tma_available,
)

# One config that runs every head dim (one pipeline stage): under the interpreter, which times nothing.
INTERPRETER_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1, "USE_TMA": False}
# (BLOCK_M, BLOCK_N, num_warps, num_stages). Measured on an H200 (fp16, D=128, 2K/8K, causal and not):
# 128x64 with 8 warps led (418-461 TFLOPS), 128x128/8 warps close behind; 4 warps on 128 rows fell to ~120.
# 64-row tiles stay for short sequences and 32-row tiles for decode-like Sq.
# 128x32 with 8 warps: the tile that does not spill at head dims padded to 256 (192, 256; cuobjdump: 253
# registers, no stack, where 64x64 with 4 warps needs 872 B of stack).
SEARCH_SPACE = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (32, 64, 4, 3),
                (128, 32, 8, 3)]
# The descriptor (TMA) path on sm_90+: it needs ~140 registers at 128x64 where the pointer path needs 244
# (cuobjdump, Triton 3.6), so with two pipeline stages two 128-row programs fit on one SM.
TMA_SEARCH_SPACE = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3)]
# The same path with its descriptors built on the host (HOST_DESC): at D=128 the switch sweep's best variant
# (128x128, 3 stages: +2% geomean over the 128x64 pointer tile) and a level one (docs/design.md#the-search-spaces).
HOST_DESC_SEARCH_SPACE = [(128, 128, 8, 3), (128, 64, 8, 3)]
PLACEHOLDER_TILES = (64, 64)  # (BLOCK_M, BLOCK_N): host descriptors' blocks before a config sets its own
# The kernel's host descriptor arguments, for q, k, v and out, and the tile dimension that sizes each one's block.
DESCRIPTORS = {"desc_q": "BLOCK_M", "desc_k": "BLOCK_N", "desc_v": "BLOCK_N", "desc_o": "BLOCK_M"}


def heuristic_config(block_d: int, q_len_class: int, pointer: bool) -> dict:
    """The config without a shipped pick (a GPU we have no table for): the tile the measurements above favour for
    the padded head dim and the query length, from the path's own space."""
    if q_len_class <= 32:
        m, n, warps, stages = 32, 64, 4, 3
    elif block_d > 128:
        m, n, warps, stages = 128, 32, 8, 3
    else:
        m, n, warps, stages = 128, 64, 8, 3 if pointer else 2
    return {"BLOCK_M": m, "BLOCK_N": n, "USE_TMA": not pointer, "num_warps": warps, "num_stages": stages}


def plain_kernel():
    """The plain JIT kernel (no autotuning): for the interpreter and for scripts that pick a config."""
    from impls.triton_fa.kernel import attention_fwd

    return attention_fwd


def configs(pointer: bool = True, tma: bool = False) -> list[dict]:
    """The autotuner's candidates as launch options: the pointer-path space, the TMA-path spaces (descriptors
    built in the kernel, then on the host), or both. ``tma`` only where ``descriptors_fit``."""
    spaces = [({"USE_TMA": False}, SEARCH_SPACE)] * pointer + [
        ({"USE_TMA": True}, TMA_SEARCH_SPACE), ({"USE_TMA": True, "HOST_DESC": True}, HOST_DESC_SEARCH_SPACE)] * tma
    return [{"BLOCK_M": m, "BLOCK_N": n, **path, "num_warps": w, "num_stages": s}
            for path, space in spaces for m, n, w, s in space]


def tuner_configs(pointer: bool, tma: bool) -> list:
    """``configs(pointer, tma)`` as the autotuner's ``triton.Config``s. On the TMA path each sets the host
    descriptors' block shapes to its own tiles before it runs (``shape_descriptors``): HOST_DESC configs read
    them, and the others, which ignore them, then compile for the same argument types every time."""
    import triton

    def as_config(c: dict) -> triton.Config:
        options = {k: c[k] for k in ("num_warps", "num_stages")}
        return triton.Config({k: v for k, v in c.items() if k not in options}, **options,
                             pre_hook=shape_descriptors if tma else None)

    return [as_config(c) for c in configs(pointer, tma)]


@functools.cache
def autotuned(pointer: bool, tma: bool):
    """The kernel autotuned over ``configs(pointer, tma)``, keyed on the shape class."""
    import triton

    key = ["q_len_class", "kv_len_class", "group", "HEAD_DIM", "CAUSAL", "HAS_WINDOW", "SOFTCAP"]
    return triton.autotune(configs=tuner_configs(pointer, tma), key=key)(plain_kernel())


def shape_descriptors(nargs: dict) -> None:
    """The autotuner's pre_hook (Triton's fused-attention tutorial does the same): ``nargs``' host descriptors, if
    any, given blocks of one head's BLOCK_M query or BLOCK_N key rows for the config in ``nargs``."""
    for name, rows in DESCRIPTORS.items():
        if nargs.get(name) is not None:
            nargs[name].block_shape = [1, nargs[rows], nargs[name].block_shape[-1]]


def shaped_descriptors(meta: dict, config: dict) -> dict:
    """``meta`` with copies of its host descriptors shaped for ``config`` (``shape_descriptors``), so that
    compiles in parallel threads do not reshape each other's."""
    copies = {name: dataclasses.replace(meta[name]) for name in DESCRIPTORS if meta.get(name) is not None}
    shape_descriptors({**copies, **config})
    return {**meta, **copies}


# Config keys beside the tile shape that pick among the kernel's switches (kernel.py; all off by default). They
# reach the kernel through launch() for sweeps (tools/sweep.py --which variants); the autotuner's spaces leave
# them off, but for HOST_DESC (HOST_DESC_SEARCH_SPACE).
SWITCHES = {"FOLD_SCALE": False, "LAZY_RESCALE": 0.0, "LOOP_STAGES": 0, "WARP_SPECIALIZE": False,
            "HOST_DESC": False, "PERSISTENT": 0, "OVERLAP_PV": False}
# Launch-side keys, not kernel arguments: persistent programs per SM (the grid is that times the SM count).
LAUNCH_KEYS = {"PROGRAMS_PER_SM": 1}
INTERPRETER_SMS = 3  # under the interpreter: few programs, so a persistent one loops over several tiles


def launch(config: dict, q, k, v, out, *, causal: bool, scale: float, window: tuple[int, int] = NO_WINDOW,
           softcap: float = 0.0, warmup: bool = False) -> None:
    """One launch with a fixed config (no autotuning), on contiguous CUDA tensors: for sweeps and tests.
    ``config`` may set the kernel's switches (``SWITCHES``) and ``LAUNCH_KEYS``; ``warmup``: compile only."""
    fixed_launch(config, q, k, v, out, causal=causal, scale=scale, window=window, softcap=softcap, warmup=warmup)()


def fixed_launch(config: dict, q, k, v, out, *, causal: bool, scale: float, window: tuple[int, int] = NO_WINDOW,
                 softcap: float = 0.0, warmup: bool = False) -> Callable[[], None]:
    """``launch``'s call with its arguments, grid and descriptors built once (a timed loop then pays only the
    launch)."""
    check_config(config)
    config = {**config}
    per_sm = config.pop("PROGRAMS_PER_SM", LAUNCH_KEYS["PROGRAMS_PER_SM"])
    host_desc = config.get("HOST_DESC", False)
    if host_desc and not descriptors_fit(q.shape[-1], v.shape[-1]):
        raise ValueError(f"HOST_DESC needs power-of-two head dims, not {q.shape[-1]} and {v.shape[-1]}")
    if config["USE_TMA"] and not host_desc:
        install_descriptor_allocator()
    batch, heads, q_len = q.shape[:3]
    args = kernel_arguments(q, k, v, out, scale, window, causal)
    grid = launch_grid(config, q_len, heads, batch, q.device, per_sm)
    meta = dense_meta(q, v, causal=causal, window=window, softcap=softcap)
    if host_desc:
        meta.update(host_descriptors(q, k, v, out, config["BLOCK_M"], config["BLOCK_N"]))
    meta.update({key: config.pop(key) for key in SWITCHES if key in config})  # the config's switches win
    kernel = plain_kernel()
    if warmup:
        return lambda: kernel.warmup(*args, grid=grid, **meta, **config)
    return lambda: kernel[grid](*args, **meta, **config)


def check_config(config: dict) -> None:
    """Refuse a config ``launch`` cannot run, naming the problem."""
    known = {"BLOCK_M", "BLOCK_N", "USE_TMA", "num_warps", "num_stages", "maxnreg", *SWITCHES, *LAUNCH_KEYS}
    unknown = set(config) - known
    if unknown:
        raise ValueError(f"unknown Triton config keys {sorted(unknown)}; known: {sorted(known)}")
    if config.get("HOST_DESC") and not config["USE_TMA"]:
        raise ValueError("HOST_DESC is the descriptor path: it needs USE_TMA")
    if config.get("PERSISTENT", 0) not in (0, PERSISTENT_BY_HEAD, PERSISTENT_HEAVY_FIRST):
        raise ValueError(f"PERSISTENT is 0 (off), {PERSISTENT_BY_HEAD} (head by head) or {PERSISTENT_HEAVY_FIRST} "
                         f"(heaviest tiles first), not {config['PERSISTENT']!r}")
    if config.get("OVERLAP_PV") and config.get("LAZY_RESCALE"):
        raise ValueError("OVERLAP_PV with LAZY_RESCALE: the conditional rescale before P @ V makes Triton wait for "
                         "that product before the softmax, which undoes the overlap")


def launch_grid(config: dict, q_len: int, heads: int, batch: int, device: torch.device,
                programs_per_sm: int = 1) -> tuple[int, ...]:
    """(query tiles, heads, batch), or for PERSISTENT one axis of ``programs_per_sm`` programs an SM (never more
    programs than work items)."""
    import triton

    tiles = triton.cdiv(q_len, config["BLOCK_M"])
    if not config.get("PERSISTENT", False):
        return (tiles, *heads_by_batch(heads, batch))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
        else INTERPRETER_SMS
    return (min(sms * programs_per_sm, tiles * heads * batch),)


def host_descriptors(q, k, v, out, block_m: int, block_n: int) -> dict:
    """Tensor descriptors over the contiguous (B*H, S, D) views of q, k, v and out, built on the host (HOST_DESC),
    by their kernel argument names: the kernel then writes none to global scratch; blocks of one head's BLOCK_M
    query or BLOCK_N key rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def describe(t, rows: int) -> TensorDescriptor:
        if not t.is_contiguous():
            raise ValueError("HOST_DESC needs contiguous q, k, v and out")
        b, h, s, d = t.shape
        return TensorDescriptor(t, [b * h, s, d], [s * d, d, 1], [1, rows, d])

    return dict(zip(DESCRIPTORS, (describe(q, block_m), describe(k, block_n), describe(v, block_n),
                                  describe(out, block_m)), strict=True))


# FOLD_SCALE by default up to this padded head dim: at D=64 the softmax's arithmetic, not the dots, bounds the
# kernel, and one multiply-add a score instead of a multiply and a subtract ran 1.19-1.31x faster (H200, fa3's
# shapes); at D=128 it moved -3% to +4%, so stays off (docs/design.md#what-each-switch-measured).
FOLD_SCALE_MAX_D = 64


def folds_scale(head_dim: int) -> bool:
    """Whether the kernel folds the scale (``FOLD_SCALE``) by default at this head dim (its padded tile's)."""
    return block_d(head_dim) <= FOLD_SCALE_MAX_D


def dense_meta(q, v, *, causal: bool, window: tuple[int, int], softcap: float) -> dict:
    """``attention_fwd``'s compile-time arguments for a dense call, but for the tile config."""
    return {**head_dims(q.shape[-1], v.shape[-1]), "CAUSAL": causal,
            "DOT_FP32": interpreting() or q.dtype == torch.float32, "HAS_WINDOW": window != NO_WINDOW,
            "SOFTCAP": softcap, "FOLD_SCALE": folds_scale(q.shape[-1])}


def kernel_arguments(q, k, v, out, scale: float, window: tuple[int, int] = NO_WINDOW, causal: bool = False) -> tuple:
    """``attention_fwd``'s runtime arguments, in order (the compile-time ones go by keyword)."""
    from impls.triton_fa.kernel import LOG2_E

    heads, q_len, kv_len = q.shape[1], q.shape[2], k.shape[2]
    return (
        q, k, v, out, scale * LOG2_E,  # scale in log2 units: exp(x * s) == exp2(x * s * log2 e)
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        q.shape[0], heads, q_len, kv_len, length_class(q_len), length_class(kv_len), heads // k.shape[1], None,
        None, *window_bounds(window, causal),
    )


def varlen_arguments(inputs, out, scale: float, window: tuple[int, int] = NO_WINDOW) -> tuple:
    """``attention_fwd``'s runtime arguments for a packed batch: the (B, H, S, D) views of its strides with a
    batch stride of 0 (the kernel starts each sequence at its cu_seqlens offset) and the longest lengths."""
    from impls.triton_fa.kernel import LOG2_E

    q, k, v = (t.transpose(0, 1)[None] for t in (inputs.q, inputs.k, inputs.v))  # (1, H, total, D) views
    o = out.transpose(0, 1)[None]
    strides = [(0, *t.stride()[1:3]) for t in (q, k, v, o)]
    heads, q_len, kv_len = q.shape[1], inputs.max_seqlen_q, inputs.max_seqlen_k
    return (
        inputs.q, inputs.k, inputs.v, out, scale * LOG2_E, *(x for st in strides for x in st),
        inputs.batch, heads, q_len, kv_len, length_class(q_len), length_class(kv_len), heads // k.shape[1],
        inputs.cu_seqlens_q, inputs.cu_seqlens_k, *window_bounds(window, inputs.causal),
    )


def precompile(kernel, args: tuple, meta: dict, grid, candidates: list[dict]) -> None:
    """Compile every candidate config at once, in threads (Triton's compiler and ptxas release the GIL):
    the autotuner then finds them all compiled, and a cold tune costs about one compile, not one per config."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(len(candidates), os.cpu_count() or 1)) as pool:
        list(pool.map(lambda c: kernel.warmup(*args, grid=grid(c), **shaped_descriptors(meta, c), **c), candidates))


def prepared_launch(args: tuple, meta: dict, grid, out: torch.Tensor, *, pointer: bool, tma: bool,
                    shape_class: tuple, lengths: tuple[int, int]) -> Prepared:
    """The timed call: ``attention_fwd`` with ``args`` and ``meta``, its config as ``TuningCache.lookup`` gives it
    for ``shape_class`` (whose positions ``lengths``, the length classes, a shipped pick carries across); under the
    interpreter one fixed config. ``meta`` holds the host descriptors (``host_descriptors``, any block shape) where
    the space has HOST_DESC configs; a config that is not one runs without them. Runs once (compile, tune where
    asked)."""
    kernel = plain_kernel()
    fixed = {**INTERPRETER_CONFIG, "USE_TMA": tma and not pointer}
    if interpreting():  # the autotuner times on a GPU
        config, source = fixed, "fixed (interpreter)"
    else:
        def compile_all() -> None:
            precompile(kernel, args, meta, grid, configs(pointer, tma))

        def tune() -> dict:
            compile_all()
            settle_gpu(out.device)  # compiling was a pause: time every config at sustained clocks
            tuner = autotuned(pointer, tma)
            tuner[grid](*args, **meta)
            return _describe(tuner.best_config)

        prefix = (f"pointer={pointer}", f"tma={tma}", out.dtype)
        space = configs(pointer, tma)
        guess = heuristic_config(meta["BLOCK_D"], shape_class[lengths[0]], pointer)
        config, source = TUNING.lookup(TUNING.key(out.device, (*prefix, *shape_class)), tune, lambda: guess,
                                       compile_all, [len(prefix) + i for i in lengths], space.__contains__)
    launch_grid = grid(config)
    if config.get("HOST_DESC"):
        meta = shaped_descriptors(meta, config)
    else:  # the same compile as where the space has no descriptors
        meta = {k: v for k, v in meta.items() if k not in DESCRIPTORS}

    def run() -> torch.Tensor:
        kernel[launch_grid](*args, **meta, **config)
        return out

    run()  # compiles this config: outside any timed region
    return Prepared(run, config={**config, "chosen": source})


def descriptors_fit(head_dim: int, value_dim: int) -> bool:
    """Tensor descriptors (TMA) need the exact power of two, in both head dims: padded ones run on pointers."""
    return block_d(head_dim) == head_dim and block_d(value_dim) == value_dim


def _make(name: str, paths: str, description: str) -> None:
    """Register one entry: ``paths`` is "pointer", "tma" or "pointer+tma" (the autotuner chooses)."""
    @register(name, family="triton", dtypes=FLOATS, head_dims=POW2_HEAD_DIMS if paths == "tma" else HEAD_DIMS,
              requires=requires_tma if paths == "tma" else requires, description=description,
              variants=("window", "softcap", "value_dim"))
    def prepare(q, k, v, *, causal: bool, scale: float, window: tuple[int, int] = NO_WINDOW,
                softcap: float = 0.0) -> Prepared:
        def dense() -> Prepared:
            return prepare_dense(q, k, v, paths, causal=causal, scale=scale, window=window, softcap=softcap)

        if paths == "tma":  # the blog's TMA step stays itself
            return dense()
        return decode_route(name, q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, dense=dense,
                            tuning=TUNING)


def prepare_dense(q, k, v, paths: str, *, causal: bool, scale: float, window: tuple[int, int],
                  softcap: float) -> Prepared:
    """The dense kernel's call, on ``paths`` (``_make``'s)."""
    import triton

    axes = heads_by_batch(q.shape[1], q.shape[0])
    pointer = "pointer" in paths
    value_dim = v.shape[-1]  # within the declared head dims (the registry checks it like the query's)
    tma = "tma" in paths and descriptors_fit(q.shape[-1], value_dim) and (
        paths == "tma" or tma_available(q.device.type))
    if tma:  # descriptors address the contiguous (B*H, S, D) views; they need scratch memory
        q, k, v = (t.contiguous() for t in (q, k, v))
        if q.is_cuda:
            install_descriptor_allocator()
    batch, heads, q_len, head_dim = q.shape
    out = q.new_empty((batch, heads, q_len, value_dim))
    window = binding_window(window, causal, q_len, k.shape[2])  # one that hides no key: no window masks
    meta = dense_meta(q, v, causal=causal, window=window, softcap=softcap)
    if tma:  # for the HOST_DESC configs: each shapes them to its tiles before it runs
        meta.update(host_descriptors(q, k, v, out, *PLACEHOLDER_TILES))

    def grid(cfg):
        return (triton.cdiv(q_len, cfg["BLOCK_M"]), *axes)

    shape = (head_dim, causal, heads // k.shape[1], length_class(q_len), length_class(k.shape[2]),
             meta["HAS_WINDOW"], softcap, value_dim)
    return prepared_launch(kernel_arguments(q, k, v, out, scale, window, causal), meta, grid, out,
                           pointer=pointer, tma=tma, shape_class=shape, lengths=(3, 4))


_make("triton", "pointer+tma", "our FlashAttention-2 Triton kernel, autotuned over tiles, warps, stages and, "
      "on sm_90+, pointer or descriptor (TMA) loads; decode steps (up to 16 new tokens) through our split-KV "
      "decode over the cache as pages where that is faster")
_make("triton-tma", "tma", "the same kernel, tiles moved through tensor descriptors (TMA) only, autotuned")


@register("triton", op="varlen", family="triton", dtypes=FLOATS, head_dims=HEAD_DIMS, requires=requires,
          variants=("window", "softcap"),
          description="the same kernel over a packed batch: each program finds its sequence in cu_seqlens "
                      "(pointer loads; autotuned like the dense entry)")
def prepare_varlen(inputs, *, scale: float, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0) -> Prepared:
    import triton

    heads, head_dim = inputs.q.shape[1], inputs.head_dim
    axes = heads_by_batch(heads, inputs.batch)
    out = inputs.output_like()
    window = inputs.binding_window(window)
    meta = {**head_dims(head_dim), "CAUSAL": inputs.causal, "VARLEN": True,
            "DOT_FP32": interpreting() or inputs.q.dtype == torch.float32, "HAS_WINDOW": window != NO_WINDOW,
            "SOFTCAP": softcap, "FOLD_SCALE": folds_scale(head_dim)}

    def grid(cfg):
        return (triton.cdiv(inputs.max_seqlen_q, cfg["BLOCK_M"]), *axes)

    shape = ("varlen", head_dim, inputs.causal, heads // inputs.k.shape[1], length_class(inputs.max_seqlen_q),
             length_class(inputs.max_seqlen_k), meta["HAS_WINDOW"], softcap)
    return prepared_launch(varlen_arguments(inputs, out, scale, window), meta, grid, out, pointer=True, tma=False,
                           shape_class=shape, lengths=(4, 5))


def _describe(cfg) -> dict:
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
