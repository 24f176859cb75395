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

from impls._registry import (
    FLOATS,
    Prepared,
    Unsupported,
    heads_by_batch,
    length_class,
    module_available,
    register,
)
from impls._serving import (
    AIMED_PLANS,
    PLAN_MIN_TILES,
    PROGRAMS_PER_SM,
    combine_plan,
    decode_route,
    decode_shape_class,
    dependent_launch_available,
    fp16_dots,
    split_plan,
)
from impls._tuning import TuningCache, cold_candidates, family_sources, fastest, settle_gpu
from impls._validate import NO_WINDOW, UNBOUNDED, binding_window, window_bounds

# Any multiple of 8 from 16 (the smallest dot) to 256: a head dim that is not a power of two is padded to the
# next one in registers (masked loads read zeros there). The descriptor (TMA) path needs the exact power of two.
HEAD_DIMS = tuple(range(16, 257, 8))
POW2_HEAD_DIMS = (16, 32, 64, 128, 256)


def block_d(head_dim: int) -> int:
    return 1 << (head_dim - 1).bit_length()

# One config that runs every head dim (one pipeline stage): under the interpreter, and on a GPU that other processes
# share, where the autotuner would time their load (impls/_tuning.py, shares_gpu).
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

    key = ["q_len_class", "kv_len_class", "group", "HEAD_DIM", "CAUSAL", "HAS_WINDOW", "SOFTCAP"]
    return triton.autotune(configs=[as_config(c) for c in configs(pointer, tma)], key=key)(plain_kernel())


def launch(config: dict, q, k, v, out, *, causal: bool, scale: float, window: tuple[int, int] = NO_WINDOW,
           softcap: float = 0.0) -> None:
    """One launch with a fixed config (no autotuning), on contiguous CUDA tensors: for sweeps and tests."""
    import triton

    if config["USE_TMA"]:
        _install_descriptor_allocator()
    batch, heads, q_len = q.shape[:3]
    grid = (triton.cdiv(q_len, config["BLOCK_M"]), *heads_by_batch(heads, batch))
    plain_kernel()[grid](*kernel_arguments(q, k, v, out, scale, window, causal),
                         **dense_meta(q, v, causal=causal, window=window, softcap=softcap), **config)


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


def head_dims(head_dim: int, value_dim: int | None = None) -> dict:
    """The kernel's head-dim constants: Q/K's and V/output's (the same unless MLA), each with its padded tile."""
    value_dim = head_dim if value_dim is None else value_dim
    return {"HEAD_DIM": head_dim, "BLOCK_D": block_d(head_dim), "HEAD_DIM_V": value_dim,
            "BLOCK_DV": block_d(value_dim)}


def dense_meta(q, v, *, causal: bool, window: tuple[int, int], softcap: float) -> dict:
    """``attention_fwd``'s compile-time arguments for a dense call, but for the tile config."""
    return {**head_dims(q.shape[-1], v.shape[-1]), "CAUSAL": causal,
            "DOT_FP32": interpreting() or q.dtype == torch.float32, "HAS_WINDOW": window != NO_WINDOW,
            "SOFTCAP": softcap}


def kernel_arguments(q, k, v, out, scale: float, window: tuple[int, int] = NO_WINDOW, causal: bool = False) -> tuple:
    """``attention_fwd``'s runtime arguments, in order (the compile-time ones go by keyword)."""
    from impls.triton_fa.kernel import LOG2_E

    heads, q_len, kv_len = q.shape[1], q.shape[2], k.shape[2]
    return (
        q, k, v, out, scale * LOG2_E,  # scale in log2 units: exp(x * s) == exp2(x * s * log2 e)
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        heads, q_len, kv_len, length_class(q_len), length_class(kv_len), heads // k.shape[1], None, None,
        *window_bounds(window, causal),
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
        heads, q_len, kv_len, length_class(q_len), length_class(kv_len), heads // k.shape[1],
        inputs.cu_seqlens_q, inputs.cu_seqlens_k, *window_bounds(window, inputs.causal),
    )


def tma_available(device: str) -> bool:
    return device != "cpu" and requires_tma(device) is None


def precompile(kernel, args: tuple, meta: dict, grid, candidates: list[dict]) -> None:
    """Compile every candidate config at once, in threads (Triton's compiler and ptxas release the GIL):
    the autotuner then finds them all compiled, and a cold tune costs about one compile, not one per config."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(len(candidates), os.cpu_count() or 1)) as pool:
        list(pool.map(lambda c: kernel.warmup(*args, grid=grid(c), **meta, **c), candidates))


TUNING = TuningCache("triton", family_sources(__file__), ["triton"])


def prepared_launch(args: tuple, meta: dict, grid, out: torch.Tensor, *, pointer: bool, tma: bool,
                    shape_class: tuple) -> Prepared:
    """The timed call: ``attention_fwd`` with ``args`` and ``meta``, its config from the tuning cache or the
    autotuner (keyed on ``shape_class``); under the interpreter one fixed config. Runs once (compile, tune)."""
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

        key = TUNING.key(out.device, (f"pointer={pointer}", f"tma={tma}", out.dtype, *shape_class))
        config, source = TUNING.lookup(key, tune, lambda: fixed, compile_all)
    launch_grid = grid(config)

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
            _install_descriptor_allocator()
    batch, heads, q_len, head_dim = q.shape
    out = q.new_empty((batch, heads, q_len, value_dim))
    window = binding_window(window, causal, q_len, k.shape[2])  # one that hides no key: no window masks
    meta = dense_meta(q, v, causal=causal, window=window, softcap=softcap)

    def grid(cfg):
        return (triton.cdiv(q_len, cfg["BLOCK_M"]), *axes)

    shape = (head_dim, causal, heads // k.shape[1], length_class(q_len), length_class(k.shape[2]),
             meta["HAS_WINDOW"], softcap, value_dim)
    return prepared_launch(kernel_arguments(q, k, v, out, scale, window, causal), meta, grid, out,
                           pointer=pointer, tma=tma, shape_class=shape)


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
            "SOFTCAP": softcap}

    def grid(cfg):
        return (triton.cdiv(inputs.max_seqlen_q, cfg["BLOCK_M"]), *axes)

    shape = ("varlen", head_dim, inputs.causal, heads // inputs.k.shape[1], length_class(inputs.max_seqlen_q),
             length_class(inputs.max_seqlen_k), meta["HAS_WINDOW"], softcap)
    return prepared_launch(varlen_arguments(inputs, out, scale, window), meta, grid, out, pointer=True, tma=False,
                           shape_class=shape)


def _describe(cfg) -> dict:
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


# Paged decode (decode.py): the split plan is impls._serving.split_plan, shared with the cuTile kernel.
# Candidates of the decode autotuner (tuned per shape class, kept in the tuning cache).
# Session 8 (H200, scripts/serving_probe.py --triton over 24 configs): 128 keys, 4 warps, 3 stages leads at
# large batch (8B, 16 x 32K: 4.23 TB/s) and for the 70B slice at batch 1; 64 keys, 4 warps, 2 stages for 8B at
# batch 1; 8 warps with 3+ stages and 256-key tiles lost everywhere. Each of these is tried with the split plans
# that aim at 2, 4 and 8 programs per SM (PLAN_PROGRAMS): the chunk count is part of the search, so that a batch
# whose plan lands just past a wave can take fewer or more chunks (no other split kernel is compiled for it).
# Session 11 (H200, same probe beside FlashInfer): 64 keys with 3 stages, once the combine was gone from unsplit
# steps, read 4.48 TB/s at 8B 256 x 8K and 4.38 at 256 x 2K (64 x 4 x 2: 4.16, 4.12; the tuner's choice 128 x 4 x 3:
# 4.43, 4.31); a fourth stage added nothing.
# Session 12 (H200, the same probe, 8 cases beside FlashInfer): the split kernel's last program of each (batch,
# kv head) merging the chunks itself after an acquire-release count (no combine launch; commit 34a4c4c has it)
# was correct, but slower than the same config with the combine launch in 102 of 108 pairs (0.45-0.64 at 2
# chunks, down to 0.07 at 1024: the tail merge is serial per pair, and the kernel compiles heavier). Where it
# led (3-9 chunks of 8B / 70B 64 x 32K), it stayed within 1.4% of, or below, the best two-launch plan of the
# case. Dropped.
# Session 13 (H200, the same probe, 9 cases of targets (a) and (b) beside FlashInfer): programmatic dependent
# launch of both kernels (each waits before its first load and lets the next one launch early, as FlashInfer's
# kernels run by default on Hopper; commit c5d00f4 has it, with a compile test) was correct, and changed the
# best config of each case by -0.5 to +1.0% (8B 1 x 128K 134.0 -> 133.1 us; median over config pairs 0.994-1.007):
# launch latency is not what the gap to 85% of HBM or to FlashInfer is made of. Dropped then; see session 44.
# Session 44 (H200, scripts/serving_probe.py --triton-switch PDL: the fastest config of this space without and with
# PDL and each peer, alternating, median of 7, us a step): on short steps that split it is what separated us from a
# peer: the 70B slice at 64 x 512 11.12 -> 10.24 (flash-attn4 10.49, FlashInfer 11.92), at 64 x 8K with pages of 64
# 72.24 -> 71.16 (FlashInfer 71.49); 8B 1 x 32K 40.26 -> 40.03, the 70B slice's 16 x 32K 71.75 -> 71.80; 8B 64 x 8K
# 497.1 -> 498.8 (two chunks), and unsplit (one launch a step) the 70B slice's 256 x 8K 254.8 -> 257.1. So PDL is
# on where a step splits (a combine follows the split kernel; LAUNCH_KEYS) and off where it does not. Measured and
# dropped (the same probe, off / next kernel let in at the split kernel's start / after its stores, us; commit a3bca94
# has the late trigger): 8B 256 x 2K (unsplit) 499.9 / 500.5 / 500.5, 8B 64 x 8K (two chunks) 496.9 / 498.8 / 499.6.
# Letting it in late gains nothing, and on that long two-chunk step PDL costs 0.3-0.4% (measured twice); a tuner
# axis could keep it off there. Session 45: cuTile's decode tuner took PDL as an axis (impls.cutile.serving's
# plan_candidates: its combine ran 3x longer under PDL after a split grid of 256 programs at two a SM, up to 13% of a
# step); here the rule stays, since this combine did not slow so (the profiler, the 70B slice's 1 x 32K in 256
# programs: 2.4 us under PDL) and an axis would double the split configs the tuner compiles.
# Session 14 (H200, scripts/serving_probe.py --triton ab, 12 cases, each config with and without, 5 alternating
# passes): the key tiles that every new token sees whole, run as a loop without any mask (MASK_FREE; only the
# chunk's last tile masked, as the dense kernel's loop split does), moved single configs by -28% to +28% (the
# compiler pipelines the two loops differently), and the best config of a case by -3.7% (70B 64 x 512) to
# +1.9% (8B 256 x 8K), +0.9% at 8B 1 x 128K and 70B 16 x 32K. Both forms are candidates. How far from the
# memory's limit: a kernel that only reads the same bytes through the block table (scripts/bandwidth_probe.py,
# 8B 64 x 32K and 256 x 8K) reads 4.49-4.54 TB/s whatever it reads at once, one head's 256 B of a token or whole
# 32 KB pages, in the table's random page order or sorted; the tuned decode read 96% of that in the same
# process, and its best configs 4.52-4.53 TB/s on the machine of the A/B run. Between machine instances the
# same config moved by 2-3% (the tuner's pick held in three retunes within one process).
# Session 14, measured and dropped: a kv head's query heads shared among 2 or 4 programs, each reading the whole
# cache (HEAD_SPLIT; commit b0b13a4 has it, with CPU and GPU tests), to get more programs without a combine on
# short 70B steps: on all 11 cases the best head-split config ran at 0.70-0.97 of the best unsplit one with 2
# parts (70B 64 x 512: 1513 against 1556 GB/s) and 0.42-0.79 with 4; the second read of each page costs more.
# Session 26 (H200): the plans above aim at programs per SM and round the chunk count up, so a batch can land a
# little past a wave of the blocks the SMs hold at once. The fitted plans (PLAN_FIT) take the shortest chunk whose
# programs fill PLAN_PROGRAMS whole waves of the compiled split kernel's resident blocks (``resident_blocks``: the
# driver's occupancy for its registers, shared memory and warps), as FlashInfer sizes its grid. Measured
# (scripts/serving_probe.py --triton plans, best of each kind, alternating): the 70B slice at 64 x 32K +0.9-1.1%
# (4 or 12 chunks; level with FlashInfer), elsewhere level or up to 3% behind the aimed plan, which the tuner then
# keeps. The wave tail is not what holds the 70B slice at 16 x 32K at 3.7 TB/s: a kernel that only reads its pages
# (scripts/bandwidth_probe.py) reads 4.29 on the same grid, so the gap is the split kernel's own.
# Session 33 (H200, scripts/serving_probe.py --triton evict, commit 2857406 has it): the K/V loads (cp.async.cg
# already, so L1 is not in the way) with L2's evict_first policy, the three fastest tuner configs of 11 cases each
# with and without, alternating: every pair within 0.4% (8B 1 x 128K 4145 / 4145 GB/s, 8B 64 x 8K 4409 / 4412,
# FlashInfer 4477). The cache's lines are read once either way; L2's policy does not change what HBM delivers.
# Session 33: Triton's pipeliner spends two stages on the block-table load that a tile's K/V addresses depend on, so
# up to 4 stages a program holds one K and one V buffer and waits for them right after issuing them (the TTGIR of
# sm_90: ``async_wait num=0`` at the loop's top); from 5 stages on they are double-buffered (140 KB of shared memory
# at 128 keys: one block per SM). H200, scripts/serving_probe.py --triton deep, the fastest of this space against
# the fastest of six double-buffered tiles, alternating, GB/s: 70B slice 1 x 128K 2573 -> 2681, 16 x 32K 3719 ->
# 3761, 64 x 32K 4163 -> 4242 (FlashInfer 4182), 64 x 8K with pages of 64 3717 -> 3803 (FlashInfer 3752), 64 x 512
# 1547 -> 1598; 8B 1 x 32K 3305 -> 3336; level at 8B 1 x 128K and 64 x 8K; at 8B 64 x 32K, 256 x 2K and 256 x 8K
# the deep tiles lost 4-5% (there many blocks per SM hide the wait already). The winner in 6 of 7 cases where they
# won: 128 keys, 4 warps, 5 stages, on a plan fitted to one wave; it joins the space. With it in the space, a second
# pass against six more double-buffered tiles (128 keys with 8 warps at 5 and 7 stages, 64 keys with 4 or 8 warps,
# 32 keys at 7 stages) found none faster on any of the 12 cases. Session 34 (same probe, ``--deep-tile``): three K/V
# buffers at 128 keys (4 warps, 7 stages: 206 KB, no spill) and the 6-stage twins of 128 and 64 keys, on the six cases
# still short of a target (70B 16 x 32K with 1 and 4 new tokens, 8B 1 x 128K, 8B 64 x 8K and 256 x 8K, 70B 256 x 8K):
# the three-buffer tile was never the fastest of them; the best of them came within 0.5% of the space's fastest on four
# cases (at most +0.5%: 70B 16 x 32K with 4 new tokens) and 4-5% behind it at 8B 64 x 8K and 256 x 8K. None joins.
# Session 34: a persistent stream-K form (scripts/streamk_probe.py: contiguous tile ranges in one flattened loop)
# ran 5-8% slower than this space's fastest on four cases; its per-tile bookkeeping costs more than the tail it removes.
# Session 63, measured and dropped (commit e8ae5df has it): each key tile as KV_SLICES runs of contiguous keys, a warp
# each with its own softmax state, merged at the chunk's end, as FlashInfer's decode splits a tile among its warps. A
# 16-row tile puts Triton's four warps side by side along the keys (mma warpsPerCTA [1, 4]), so each tile's row max,
# row sum and P's layout cross warps; as a batched dot (warpsPerCTA [4, 1, 1]) none of that does, but every warp then
# holds a whole 16 x 128 accumulator and q: 190-255 registers (the 128-key tiles spill) against 72-108, half the
# blocks per SM. H200, the tuner's pick against its tile and 64/128-key tiles with 1, 2 and 4 slices, alternating,
# median of 5: the best sliced config 0.91 of the pick at 8B 256 x 8K, 0.989 at the 70B slice's 256 x 8K, 0.998 at 8B
# 64 x 8K (unsplit, against the pick's two chunks), 0.89 at 8B 64 x 32K. Also session 63: the grid's order. The split
# kernel's grid runs (splits, kv heads, sequences), so the blocks running at once read every kv head of a few
# sequences (the whole of each page); with sequences on the faster axis instead (each block reads one kv head's rows
# of neighbouring sequences' pages), the tuner's pick and two other tiles, alternating, median of 7, ran at 0.977 of
# the pick's speed at 8B 256 x 8K, 0.987 at 256 x 2K, 0.991 at 64 x 32K, 1.000 at 64 x 8K (the 70B slice has one kv
# head: the same order either way, 1.000-1.001). Kept as it was.
# Session 63: tiles of 2 warps (never in a space before: TRITON_WIDE had 4 and 8). With 16 rows a 2-warp program
# shares each tile's row max and sum between two warps instead of four, and more programs fit an SM. H200, each
# beside the tuner's pick (its plan), alternating, median of 7, speed over the pick's: 64 keys at 3 stages 1.015 at
# 8B 64 x 8K (unsplit, against the pick's two chunks of 32-key tiles) and 1.018 at the 70B slice's 16 x 32K (3844
# GB/s); 32 keys at 2 stages 1.006 at 8B 256 x 8K and 1.011 at 256 x 2K. They lost 3-12% at 8B 64 x 32K, the 70B
# slice's 256 x 8K and 64 x 32K, and 8B 16 x 512, where the pick stays. Both join. With them in the space (a cold
# tune on another H200, then Triton and FlashInfer in one suite run, graph timing) the tuner took a 2-warp tile on 11
# of 24 serving cases: the 8B's seven uniform steps from 64 sequences with pages of 16, its 16 x 32K, and the 70B
# slice's 16 x 32K with one and with four new tokens. Triton alone was at or above FlashInfer on 17 of the 20 cases
# with 64 or more sequences, among them the 8B's 64 x 8K (1.001), 64 x 32K (1.002), 256 x 2K (1.018) and 256 x 8K
# (1.005), where ours trailed it by 0.3-2.0% in that day's full run without them.
# Session 64: a 2-warp tile double-buffered (64 keys, 5 stages: two K/V buffers, 72 KB). H200,
# scripts/serving_probe.py --triton deep with 2-warp tiles of 32, 64 and 128 keys at 4-5 stages: on the 70B slice's
# 256 x 8K, the one case of 64 or more sequences where FlashInfer still led ours in that day's full run (0.987), it
# ran unsplit at 4272 GB/s against the space's fastest 4216 and FlashInfer's 4252, alternating. It joins. With it
# in the space (another H200, a cold tune, then Triton and FlashInfer in one suite run over the whole preset, graph
# timing) the tuner took it on 11 of the 46 steps (the 70B slice's 256 x 512, 2K and 8K, its uniform batches of 16
# from 8K, its 1 x 128K; the 8B's 1 x 32K, 16 x 2K and 64 x 32K), and Triton alone was at or above FlashInfer on
# all 20 cases with 64 or more sequences: the 70B slice's 256 x 8K 1.005, 256 x 2K 1.034, 64 x 32K 1.037. At 255
# registers it parks a few values in local memory before its loop and reads them back after it (none inside:
# tests/test_triton_compile.py).
# Session 66, measured and dropped (commit 27bf60a has it, with serving_probe.py --prefetch-ab): PREFETCH, the split
# kernel asking the L2 for a chunk's lookups (its sequence's length, the table line where it starts, the query rows;
# PTX prefetch.global.L2) before the PDL wait, so that they arrive while the kernel ahead still runs. H200, the cold-
# tuned pick without and with it, alternating, median of 7, us a step, warm / cold: the 70B slice's 64 x 512 9.18 /
# 12.24 -> 9.13 / 11.99 (twice: -2.2% cold); but 1 x 8K 5.69 / 7.16 -> 7.01 / 9.31, 1 x 32K 9.19 / 12.50 -> 12.31 /
# 17.12, 16 x 2K 9.11 / 11.83 -> 12.42 / 14.72, 8B 1 x 8K 12.30 / 15.90 -> 16.78 / 22.11: where hundreds of one-tile
# chunks of a sequence each ask for the same lines, 25-40% slower, warm too (1 x 2K, 1 MB: 5.20 -> 5.23). The
# compiled kernels had the same registers, shared memory and buffers.
# Session 67 (H200, serving_probe.py --prefetch-ab tuned: each step's cold-tuned pick off / asked by every chunk /
# asked by the first chunk's program of each sequence and kv head alone, alternating, median of 7, us, cold): the
# 70B slice's 64 x 512 12.26 / 12.05 / 11.74 (again 12.19 / 11.97 / 11.66; FlashInfer 14.8), 1 x 8K 7.11 / 8.80 /
# 6.82, 1 x 32K 12.46 / 16.46 / 11.89, 16 x 2K 11.79 / 14.65 / 11.46, 256 x 512 21.96 / 22.04 / 21.56; 8B 1 x 8K
# 16.00 / 22.18 / 15.64; warm the first-chunk form was 0.7-1.8% faster on all six. Its chunks share the lines, so
# one program asking serves them all. So the split kernel prefetches so wherever it runs under PDL (PREFETCH);
# unsplit steps run without PDL, where nothing runs ahead to overlap (8B 16 x 512, unsplit: 15.06 -> 15.31 cold).
DECODE_TILES = ((128, 4, 3), (128, 4, 2), (64, 4, 3), (64, 4, 2), (64, 8, 2), (32, 4, 2), (128, 4, 5), (64, 2, 3),
                (32, 2, 2), (64, 2, 5))
DECODE_PLANS = [{"PLAN_PROGRAMS": programs, "PLAN_FIT": fit, "PLAN_MIN_TILES": min_tiles}
                for min_tiles in PLAN_MIN_TILES
                for programs, fit in [*((programs, False) for programs in AIMED_PLANS), (1, True), (2, True)]]


def decode_space(tiles: tuple[tuple[int, int, int], ...]) -> list[dict]:
    """Decode configs: each (BLOCK_N, warps, stages) tile with and without the mask-free loop and with every split
    plan (the tuner's space over DECODE_TILES; scripts/serving_probe.py's over others)."""
    return [{"BLOCK_N": n, "num_warps": w, "num_stages": st, "MASK_FREE": mask_free, **plan}
            for n, w, st in tiles for mask_free in (True, False) for plan in DECODE_PLANS]


DECODE_SPACE = decode_space(DECODE_TILES)
# Decode config entries for the launch, not constexprs of the split kernel: the split plan (PLAN_MIN_TILES: the
# shortest chunk in key tiles, by default SPLIT_MIN_TILES), and PDL (programmatic dependent launch of both kernels,
# decode.py's USE_PDL; by default on where a step splits: the comment above).
LAUNCH_KEYS = (*DECODE_PLANS[0], "PDL")
# the decode's one config, likewise under the interpreter and on a shared GPU
INTERPRETER_DECODE_CONFIG = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "MASK_FREE": True,
                             "PLAN_PROGRAMS": PROGRAMS_PER_SM}
INTERPRETER_SM_COUNT = 8  # the interpreter has no SMs: with these and one-tile chunks the CPU cases split


def decode_candidates(space: list[dict], launch) -> list[tuple[dict, object]]:
    """(config, run) for the configs of ``space`` that this call can run, each kernel and chunk length once (several
    plans often cut alike). ``launch(config)`` gives ``(run, plan)``. Each run is called once here (it compiles); a
    config whose buffers do not fit in shared memory at this head dim and dtype (the double-buffered 128-key tile at
    D=256, 2 x 128 KB) is left out, as Triton's own autotuner prunes it."""
    from triton.runtime.errors import OutOfResources

    distinct, refused = {}, []
    for config in space:
        try:
            run, plan = launch(config)
            form = (*(v for k, v in config.items() if k not in LAUNCH_KEYS), plan["split_len"])
            if form not in distinct:
                run()
                distinct[form] = (config, run)
        except OutOfResources as exc:
            refused.append(f"{config}: {exc}")
    if not distinct:
        raise Unsupported("no decode config fits this GPU's shared memory: " + "; ".join(refused[:3]))
    return list(distinct.values())


def resident_blocks(kernel, args: tuple, meta: dict) -> int:
    """How many blocks of ``kernel`` compiled for ``args`` and ``meta`` one SM holds at once: the driver's
    occupancy for its registers, shared memory and warps (cuOccupancyMaxActiveBlocksPerMultiprocessor)."""
    import ctypes

    compiled = kernel.warmup(*args, grid=(1,), **meta)
    compiled._init_handles()
    blocks = ctypes.c_int()
    status = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(compiled.function), ctypes.c_int(32 * meta["num_warps"]),
        ctypes.c_size_t(compiled.metadata.shared))
    if status != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUresult {status}")
    return max(blocks.value, 1)


# Session 40 (H100, serving_probe.py --triton-switch V_WORDS: the fastest config of the tuner's space each way, then
# both in alternation, median of 5; GB/s, bytes before -> words): 8B 1 x 32K 1792 -> 1902, 16 x 32K 2697 -> 2799,
# 64 x 8K 2656 -> 2818, 256 x 2K 2561 -> 2667; 70B slice 16 x 32K 2229 -> 2330, 64 x 8K 2230 -> 2332, 256 x 2K
# 2359 -> 2410; at its 1 x 32K (a step of 10 us, 32-key tiles) 816 -> 796. With words no tile spills, and deeper or
# wider ones (128 keys at 7 stages or 8 warps, 64 at 5 stages, 256 at 5) still lost 5-10% to the 128-key 5-stage one.
def word_values(inputs, interp: bool, f16_dot: bool | None = None) -> bool:
    """Whether the split kernel reads an fp8 value cache as 32-bit words and widens them before its dot (V_WORDS):
    under fp16 dots (fp16 queries, or bf16 ones with F16_DOT: ``f16_dot``, by default ``fp16_dots``), compiled (the
    interpreter runs no inline PTX), over a cache whose base and strides hold whole words."""
    f16_dot = fp16_dots(inputs) if f16_dot is None else f16_dot
    v_cache = inputs.v_cache
    in_words = v_cache.data_ptr() % 4 == 0 and all(stride % 4 == 0 for stride in v_cache.stride()[:3])
    return inputs.kv_fp8 and not interp and in_words and (inputs.q.dtype == torch.float16 or f16_dot)


def paged_launch(inputs, scale: float, config: dict, window_left: int = UNBOUNDED, softcap: float = 0.0):
    """The launches of one decode step with ``config`` (split, then combine where a sequence has more than one
    chunk), and the split plan. ``window_left``: a sliding window as ``PagedKV.window_left`` gives it."""
    import triton

    from impls.triton_fa.decode import paged_decode_combine, paged_decode_split
    from impls.triton_fa.kernel import LOG2_E

    q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
    batch, sq, hq, head_dim = q.shape
    hkv = k_cache.shape[2]
    axes = heads_by_batch(hkv, batch, "kv heads")
    rows = hq // hkv * sq
    interp = interpreting()
    sm_count = INTERPRETER_SM_COUNT if interp else torch.cuda.get_device_properties(q.device).multi_processor_count
    block_m, width = max(16, triton.next_power_of_2(rows)), block_d(head_dim)
    out = inputs.output_like()
    tile_rows = {"GROUP": hq // hkv, "SQ": sq, "BLOCK_M": block_m}
    split_meta = {"PAGE_SIZE": inputs.page_size, "HEAD_DIM": head_dim, "BLOCK_D": width,
                  "DOT_FP32": interp or q.dtype == torch.float32,
                  "HAS_WINDOW": window_left < UNBOUNDED, "SOFTCAP": softcap, "KV_FP8": inputs.kv_fp8,
                  "F16_DOT": fp16_dots(inputs),
                  **tile_rows, **{name: value for name, value in config.items() if name not in LAUNCH_KEYS}}
    split_meta.setdefault("V_WORDS", word_values(inputs, interp, split_meta["F16_DOT"]))  # after a config's F16_DOT

    def partials(num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each chunk's normalised output and log-sum-exp, for the combine (unused without a split)."""
        parts = (batch * hkv, num_splits, block_m) if num_splits > 1 else (1, 1, 1)
        o_part = torch.empty(*parts, width if num_splits > 1 else 1, dtype=torch.float32, device=q.device)
        return o_part, torch.empty(parts, dtype=torch.float32, device=q.device)

    def split_args(o_part: torch.Tensor, lse_part: torch.Tensor, split_len: int) -> tuple:
        return (q, k_cache, v_cache, inputs.block_table, inputs.cache_seqlens, o_part, lse_part, out,
                scale * inputs.k_scale * LOG2_E, *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
                inputs.block_table.stride(0), *o_part.stride()[:3], *out.stride()[:3], hkv, split_len, window_left,
                inputs.v_scale)

    programs_per_sm, fit = config.get("PLAN_PROGRAMS", PROGRAMS_PER_SM), config.get("PLAN_FIT", False)
    if fit and not interp:  # whole waves of the split kernel's resident blocks
        programs_per_sm *= resident_blocks(paged_decode_split, split_args(*partials(2), config["BLOCK_N"]),
                                           {**split_meta, "SPLIT": True})
    num_splits, split_len = split_plan(inputs.read_lengths(window_left), hkv, config["BLOCK_N"], sm_count,
                                       min_tiles=1 if interp else config.get("PLAN_MIN_TILES"),
                                       programs_per_sm=programs_per_sm, fit=fit)
    split = num_splits > 1
    # decode.py's USE_PDL: compiled kernels only; by default where a combine follows
    pdl = config.get("PDL", split) and not interp and dependent_launch_available(q.device)
    launch = {"USE_PDL": pdl, **({"launch_pdl": True} if pdl else {})}
    # decode.py's PREFETCH: under PDL (where a kernel runs ahead to overlap), unless a config turns it off
    prefetch = pdl and split_meta.pop("PREFETCH", True)
    o_part, lse_part = partials(num_splits)
    launches = [(paged_decode_split, (num_splits, *axes), split_args(o_part, lse_part, split_len),
                 {**split_meta, **launch, "SPLIT": split, "PREFETCH": prefetch})]
    if split:
        tile_d, chunks = combine_plan(num_splits, width)
        combine_args = (o_part, lse_part, inputs.cache_seqlens, out, *o_part.stride()[:3], *out.stride()[:3], hkv,
                        num_splits, split_len, window_left)
        combine_meta = {**launch, **tile_rows, "MAX_SPLITS": triton.next_power_of_2(num_splits), "SPLIT_CHUNK": chunks,
                        "BLOCK_D": tile_d, "HEAD_DIM": head_dim}
        launches.append((paged_decode_combine, (batch * hkv, rows, width // tile_d), combine_args, combine_meta))

    def run() -> torch.Tensor:
        for kernel, grid, args, meta in launches:
            kernel[grid](*args, **meta)
        return out

    read_as = {"fp8_values": "words" if split_meta["V_WORDS"] else "bytes"} if inputs.kv_fp8 else {}
    return run, {"num_splits": num_splits, "split_len": split_len, "BLOCK_M": block_m, "PDL": pdl, "PREFETCH": prefetch,
                 **({"programs_per_sm": programs_per_sm} if fit else {}), **read_as}


@register("triton", op="paged", family="triton", dtypes=FLOATS, head_dims=HEAD_DIMS, requires=requires,
          variants=("window", "softcap", "kv_fp8"),
          description="our split-KV decode kernel: all query heads of a kv head in one tile (K/V read once), "
                      "pages gathered through the block table, chunks merged by log-sum-exp (a sliding window "
                      "bounds what is read; an fp8 cache read as stored and widened in registers); autotuned")
def prepare_paged(inputs, *, scale: float, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0) -> Prepared:
    _, sq, hq, _ = inputs.q.shape
    window_left = inputs.window_left(window)
    rows = hq // inputs.k_cache.shape[2] * sq
    if rows > 128:
        raise Unsupported(f"{hq // inputs.k_cache.shape[2]} query heads per kv head x {sq} new tokens = {rows} "
                          "rows: this kernel packs at most 128 in one tile")
    if interpreting():
        config, source = INTERPRETER_DECODE_CONFIG, "fixed (interpreter)"
    else:
        def launch(on, candidate: dict):
            return paged_launch(on, scale, candidate, window_left, softcap)

        def compiled() -> list[tuple[dict, object]]:
            return decode_candidates(DECODE_SPACE, lambda candidate: launch(inputs, candidate))

        def timed_cold() -> dict:  # impls._tuning.cold_candidates: a short step's K/V evicted between its calls
            return fastest(cold_candidates(compiled(), inputs, lambda copy, candidate: launch(copy, candidate)[0]))

        config, source = TUNING.lookup(TUNING.key(inputs.q.device, decode_shape_class(inputs, window_left, softcap)),
                                       timed_cold, lambda: INTERPRETER_DECODE_CONFIG, compiled)
    run, plan = paged_launch(inputs, scale, config, window_left, softcap)
    run()  # compile outside any timed region
    return Prepared(run, config={**config, **plan, "chosen": source})
