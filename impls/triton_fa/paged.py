"""Registers our Triton split-KV decode (``decode.py``) as ``triton``'s paged entry: its search space, the launches
of one step (split, then combine) on the shared split plan (``impls._plans.split_plan``), and the tuner, which times
its candidates cold."""

from __future__ import annotations

import torch

from impls import _plans
from impls._plans import combine_plan, decode_shape_class, dependent_launch_available, fp16_dots, split_plan
from impls._registry import FLOATS, Prepared, Unsupported, heads_by_batch, register
from impls.contract import NO_WINDOW, UNBOUNDED
from impls.timing import cold_candidates
from impls.triton_fa.config import HEAD_DIMS, TUNING, block_d, interpreting, requires
from impls.tuning import fastest

# The decode tuner's tiles (BLOCK_N, warps, stages), each with and without the mask-free loop and with every split plan
# (PLAN_PROGRAMS, PLAN_FIT, PLAN_MIN_TILES): 128 keys, 4 warps, 3 stages leads at large batch (H200, 8B 16 x 32K:
# 4.23 TB/s); the 5-stage tiles double-buffer K/V (the 70B slice's 1 x 128K 2573 -> 2681 GB/s); 2-warp tiles gain 1-2%
# on some steps of 64 or more sequences. PDL runs where a step splits (short split steps: 11.12 -> 10.24 us) and the
# split kernel then prefetches its lookups (PREFETCH). See docs/design.md#triton-serving for what was measured and
# left out.
DECODE_TILES = ((128, 4, 3), (128, 4, 2), (64, 4, 3), (64, 4, 2), (64, 8, 2), (32, 4, 2), (128, 4, 5), (64, 2, 3),
                (32, 2, 2), (64, 2, 5))
DECODE_PLANS = [{"PLAN_PROGRAMS": programs, "PLAN_FIT": fit, "PLAN_MIN_TILES": min_tiles}
                for min_tiles in _plans.PLAN_MIN_TILES
                for programs, fit in [*((programs, False) for programs in _plans.AIMED_PLANS), (1, True), (2, True)]]


def decode_space(tiles: tuple[tuple[int, int, int], ...]) -> list[dict]:
    """Decode configs: each (BLOCK_N, warps, stages) tile with and without the mask-free loop and with every split
    plan (the tuner's space over DECODE_TILES; a probe's over others)."""
    return [{"BLOCK_N": n, "num_warps": w, "num_stages": st, "MASK_FREE": mask_free, **plan}
            for n, w, st in tiles for mask_free in (True, False) for plan in DECODE_PLANS]


DECODE_SPACE = decode_space(DECODE_TILES)
# Decode config entries for the launch, not constexprs of the split kernel: the split plan (PLAN_MIN_TILES: the
# shortest chunk in key tiles, by default SPLIT_MIN_TILES), and PDL (programmatic dependent launch of both kernels,
# decode.py's USE_PDL; by default on where a step splits: the comment above DECODE_TILES).
LAUNCH_KEYS = (*DECODE_PLANS[0], "PDL")
# the decode's one config, likewise under the interpreter and on a shared GPU
INTERPRETER_DECODE_CONFIG = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "MASK_FREE": True,
                             "PLAN_PROGRAMS": _plans.PROGRAMS_PER_SM}
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


# Reading an fp8 value cache as words gained 2-6% (H100, 8B 64 x 8K: 2656 -> 2818 GB/s) and no tile spills so.
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

    programs_per_sm, fit = config.get("PLAN_PROGRAMS", _plans.PROGRAMS_PER_SM), config.get("PLAN_FIT", False)
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

        def timed_cold() -> dict:  # impls.timing.cold_candidates: a short step's K/V evicted between its calls
            return fastest(cold_candidates(compiled(), inputs, lambda copy, candidate: launch(copy, candidate)[0]))

        config, source = TUNING.lookup(TUNING.key(inputs.q.device, decode_shape_class(inputs, window_left, softcap)),
                                       timed_cold, lambda: DECODE_SPACE[0], compiled,  # the lead tile
                                       _plans.NEAR_DECODE, DECODE_SPACE.__contains__)
    run, plan = paged_launch(inputs, scale, config, window_left, softcap)
    run()  # compile outside any timed region
    return Prepared(run, config={**config, **plan, "chosen": source})
