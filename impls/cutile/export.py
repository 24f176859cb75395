"""Ahead-of-time compilation of the cuTile kernel to a cubin, with no GPU: for CI and for reading SASS."""

from __future__ import annotations

import inspect
import io
import typing

import torch

from impls.cutile.config import Variant, bind, state_arrays

# The window a windowed signature stands for (Mistral-7B's, bottom-right causal bounds): a multiple of every
# TILE_M, as a kernel with the diagonal peeled needs (``Variant.peel_refusal``); only its divisibility matters.
WINDOW = (4096, 0)
TORCH_TO_TILE = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                 torch.int32: "int32", torch.float8_e4m3fn: "float8_e4m3fn"}


def array_constraint(dtype: torch.dtype, shape: tuple[int, ...], *, strides: tuple[int, ...] | None = None,
                     int64: bool = False):
    """What ``ct.launch`` assumes of a tensor of this shape and strides (contiguous unless given; as its JAX
    bridge spells out): strides and base address 16-byte aligned, a dimension of 16 multiples said to be one.
    Without these facts the compiler cannot use TMA, and the cubin would not be the one that runs."""
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint

    strides = strides or torch.empty(shape, device="meta").stride()
    per_16_bytes = 16 // dtype.itemsize  # elements
    return ArrayConstraint(
        getattr(ct, TORCH_TO_TILE[dtype]), len(shape), index_dtype=ct.int64 if int64 else ct.int32,
        stride_lower_bound_incl=0, alias_groups=[], may_alias_internally=False,
        stride_constant=[1 if s == 1 else None for s in strides],
        stride_divisible_by=[per_16_bytes if s % per_16_bytes == 0 else 1 for s in strides],
        shape_divisible_by=[16 if d % 16 == 0 else 1 for d in shape],
        base_addr_divisible_by=256,  # the CUDA caching allocator's blocks are 512-byte aligned
    )


def signature(variant: Variant, *, dtype: torch.dtype, head_dim: int, causal: bool, even_n: bool,
              int64: bool = False, shape: tuple[int, int, int] = (4, 32, 4096), phase: int = 0,
              window: bool = False, softcap: float = 0.0, value_dim: int | None = None):
    """The signature ``ct.launch`` would compile for contiguous (B, H, S, D) tensors of ``dtype``
    (``shape`` is (B, H, S); only its divisibility matters) in launch ``phase`` of ``variant``, with a
    sliding window or not, softcap ``softcap`` (0: none) and V/Out of ``value_dim`` (default: ``head_dim``).
    The variant compiles as a call of that shape runs it (``Variant.resolved``: a peeled diagonal on ragged keys
    as the masked loop)."""
    import cuda.tile as ct
    from cuda.tile.compilation import CallingConvention, KernelSignature, ScalarConstraint

    batch, heads, seq = shape
    if not even_n:
        seq = seq // variant.tile_n * variant.tile_n + 1  # ragged: the last K/V tile is partial
    variant = variant.resolved(causal=causal, q_len=seq, kv_len=seq, window=WINDOW if window else None)
    value_dim = value_dim or head_dim
    qk = array_constraint(dtype, (batch, heads, seq, head_dim), int64=int64)
    vo = array_constraint(dtype, (batch, heads, seq, value_dim), int64=int64)
    q = torch.empty((batch, heads, seq, head_dim), device="meta", dtype=dtype)
    state = [array_constraint(t.dtype, tuple(t.shape), int64=int64) for t in variant.state(q, value_dim)]
    float32, int32 = ScalarConstraint(ct.float32), ScalarConstraint(ct.int32)
    constants = variant.constants(head_dim=head_dim, causal=causal, kv_len=seq, itemsize=dtype.itemsize,
                                  phase=phase, window=WINDOW if window else None, softcap=softcap, value_dim=value_dim,
                                  q_len=seq)
    parameters = bind("fmha_fwd", Q=qk, K=qk, V=vo, Out=vo, **state_arrays(state), qk_scale=float32,
                      causal_offset=int32, window_left=int32, window_right=int32, num_heads=int32, group=int32,
                      **constants)
    return KernelSignature(list(parameters), CallingConvention.cutile_python_v1())


def export_cubin(variant: Variant, *, arch: str, dtype: torch.dtype = torch.float16, head_dim: int = 128,
                 causal: bool = True, even_n: bool = True, int64: bool = False, phase: int = 0,
                 window: bool = False, softcap: float = 0.0, value_dim: int | None = None) -> bytes:
    from cuda.tile.compilation import export_kernel

    buffer = io.BytesIO()
    sig = signature(variant, dtype=dtype, head_dim=head_dim, causal=causal, even_n=even_n, int64=int64,
                    phase=phase, window=window, softcap=softcap, value_dim=value_dim)
    export_kernel(variant.kernel(int64=int64), [sig], buffer, gpu_code=arch, output_format="cubin")
    return buffer.getvalue()


def export_phases(variant: Variant, *, arch: str, **options) -> list[tuple[str, bytes]]:
    """The cubin of each launch ``variant`` makes (``Variant.phases``), named by its PHASE: one, or the diagonal
    and the mask-free launch."""
    from impls.cutile.kernel import DIAGONAL, OFF_DIAGONAL, WHOLE

    names = {WHOLE: "", DIAGONAL: " [diagonal]", OFF_DIAGONAL: " [mask-free]"}
    return [(names[phase], export_cubin(form, arch=arch, phase=phase, **options))
            for form, phase in variant.phases()]


def launch_signature(kernel, arguments: tuple):
    """The signature ``ct.launch(stream, grid, kernel, arguments)`` compiles: tensors by dtype, shape and
    strides (64-bit indexing where the kernel's parameter says so), Python floats and ints as float32 and
    int32 scalars, the kernel's ``ct.Constant`` parameters as given."""
    import cuda.tile as ct
    from cuda.tile._stub import ArrayAnnotation, ConstantAnnotation
    from cuda.tile.compilation import CallingConvention, KernelSignature, ScalarConstraint

    function = kernel._pyfunc
    hints = typing.get_type_hints(function, include_extras=True)
    names = list(inspect.signature(function).parameters)
    if len(names) != len(arguments):
        raise ValueError(f"{function.__name__} takes {len(names)} arguments, got {len(arguments)}")
    parameters = []
    for name, argument in zip(names, arguments, strict=True):
        extras = typing.get_args(hints.get(name))[1:]
        if any(isinstance(extra, ConstantAnnotation) for extra in extras):
            parameters.append(argument)
        elif isinstance(argument, torch.Tensor):
            int64 = any(isinstance(extra, ArrayAnnotation) and extra.index_dtype == ct.int64 for extra in extras)
            parameters.append(array_constraint(argument.dtype, tuple(argument.shape), strides=argument.stride(),
                                               int64=int64))
        else:
            parameters.append(ScalarConstraint(ct.float32 if isinstance(argument, float) else ct.int32))
    return KernelSignature(parameters, CallingConvention.cutile_python_v1())


def export_launch(kernel, arguments: tuple, *, arch: str) -> bytes:
    """The cubin of one launch (``kernel`` with ``arguments``, as a prepared call holds them) for ``arch``."""
    from cuda.tile.compilation import export_kernel

    buffer = io.BytesIO()
    export_kernel(kernel, [launch_signature(kernel, arguments)], buffer, gpu_code=arch, output_format="cubin")
    return buffer.getvalue()
