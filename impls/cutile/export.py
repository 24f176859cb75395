"""Ahead-of-time compilation of the cuTile kernel to a cubin, with no GPU: for CI and for reading SASS."""

from __future__ import annotations

import io

import torch

from impls.cutile import Variant

TORCH_TO_TILE = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def signature(variant: Variant, *, dtype: torch.dtype, head_dim: int, causal: bool, even_n: bool,
              int64: bool = False):
    """The signature ``ct.launch`` would compile for contiguous (B, H, S, D) tensors of ``dtype``."""
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint

    array = ArrayConstraint(getattr(ct, TORCH_TO_TILE[dtype]), 4, index_dtype=ct.int64 if int64 else ct.int32,
                            stride_lower_bound_incl=0, alias_groups=[], may_alias_internally=False,
                            stride_constant=[None, None, None, 1])
    runtime = [ScalarConstraint(ct.float32)] + [ScalarConstraint(ct.int32)] * 3  # scale, offset, heads, group
    kv_len = variant.tile_n if even_n else variant.tile_n + 1
    constants = variant.constants(head_dim=head_dim, causal=causal, kv_len=kv_len)
    return KernelSignature([array] * 4 + runtime + list(constants), CallingConvention.cutile_python_v1())


def export_cubin(variant: Variant, *, arch: str, dtype: torch.dtype = torch.float16, head_dim: int = 128,
                 causal: bool = True, even_n: bool = True, int64: bool = False) -> bytes:
    from cuda.tile.compilation import export_kernel

    buffer = io.BytesIO()
    sig = signature(variant, dtype=dtype, head_dim=head_dim, causal=causal, even_n=even_n, int64=int64)
    export_kernel(variant.kernel(int64=int64), [sig], buffer, gpu_code=arch, output_format="cubin")
    return buffer.getvalue()
