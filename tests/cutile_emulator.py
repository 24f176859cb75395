"""Runs our cuTile kernels' Python bodies on CPU, block by block, with torch standing in for the part of ``cuda.tile``
they call. cuTile has no interpreter; this checks a kernel's index arithmetic, loop bounds, masks and dtypes
against the oracle where no GPU is at hand. It says nothing about what the compiler makes of the kernel.

Stand-ins: ``ct.load`` reads whole tiles at tile indices (in a dimension order where given) with zeros past the
array's ends, ``ct.store`` drops what lies past them, ``ct.gather`` and ``ct.scatter`` read and write elements at
broadcast indices, skipping masked and out-of-bounds ones (a gather reads its padding value there), ``ct.mma``
multiplies in float64 and accumulates in float32 (and, as cuTile, refuses operands of two dtypes). Helpers a kernel
calls are rebound so that they see the stand-in too.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from types import ModuleType

import torch


class Tile(torch.Tensor):
    """A torch tensor with cuTile's ``astype``."""

    def astype(self, dtype: torch.dtype) -> Tile:
        return self.to(dtype)


def _tile(t: torch.Tensor) -> Tile:
    return t.as_subclass(Tile)


def _mma(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor) -> Tile:
    if a.dtype != b.dtype:
        raise TypeError(f"mma of {a.dtype} and {b.dtype}")
    return _tile(acc + (a.double() @ b.double()).to(acc.dtype))


def _load(A, index, shape, order=None, latency=None, padding_mode=None, allow_tma=None) -> Tile:
    if order is not None:  # the tile's dimension i is the array's dimension order[i]
        A = A.permute(order)
    out = torch.zeros(shape, dtype=A.dtype)
    part = A[tuple(slice(i * s, i * s + s) for i, s in zip(index, shape, strict=True))]
    out[tuple(slice(0, n) for n in part.shape)] = part
    return _tile(out)


def _store(A, index, tile, allow_tma=None) -> None:
    view = A[tuple(slice(i * s, i * s + s) for i, s in zip(index, tile.shape, strict=True))]
    view.copy_(tile[tuple(slice(0, n) for n in view.shape)].to(A.dtype))


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an element's bits (fp8 has no CPU where)


def _elements(A, indices, mask) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Indices into ``A`` broadcast to one shape, clamped into bounds, and where they are real: unmasked and in
    bounds."""
    indices = indices if isinstance(indices, tuple) else (indices,)
    indices = torch.broadcast_tensors(*(torch.as_tensor(i, dtype=torch.int64) for i in indices))
    shape = indices[0].shape
    real = torch.ones(shape, dtype=torch.bool) if mask is None else torch.as_tensor(mask).broadcast_to(shape).clone()
    for i, n in zip(indices, A.shape, strict=True):
        real &= (i >= 0) & (i < n)
    return tuple(torch.where(real, i, 0) for i in indices), real


def _gather(A, indices, mask=None, latency=None, padding_value=0, check_bounds=True) -> Tile:
    where, real = _elements(A, indices, mask)
    bits = BITS[A.element_size()]
    pad = torch.tensor(padding_value, dtype=A.dtype).view(bits)
    return _tile(torch.where(real, A.view(bits)[where], pad).view(A.dtype))


def _scatter(A, indices, value, mask=None, latency=None, check_bounds=True) -> None:
    where, real = _elements(A, indices, mask)
    value = torch.as_tensor(value).to(A.dtype).broadcast_to(real.shape)
    A[tuple(i[real] for i in where)] = value[real]


def _where(cond, a, b) -> Tile:
    return _tile(torch.where(torch.as_tensor(cond), torch.as_tensor(a), torch.as_tensor(b)))


class Emulator:
    """The stand-in ``ct`` and the kernels of ``modules`` rebound to it (each module: the names of its functions
    that kernels call, kernels included)."""

    def __init__(self, modules: Iterable[tuple[ModuleType, Iterable[str]]]) -> None:
        self.block = [0, 0, 0]
        ct = types.SimpleNamespace(
            float32=torch.float32, int32=torch.int32, bool_=torch.bool, bid=lambda axis: self.block[axis],
            cdiv=lambda a, b: -(-a // b), full=lambda shape, value, dtype: _tile(torch.full(shape, value, dtype=dtype)),
            arange=lambda n, dtype: _tile(torch.arange(n, dtype=dtype)),
            where=_where, gather=_gather, scatter=_scatter, PaddingMode=types.SimpleNamespace(ZERO=0),
            static_iter=iter, cat=lambda tiles, axis: _tile(torch.cat(tiles, axis)),
            truediv=lambda x, y: _tile(torch.div(x, y)),
            exp2=lambda x, flush_to_zero=False: _tile(torch.exp2(x)), log2=lambda x: _tile(torch.log2(x)),
            max=lambda x, axis=None, keepdims=False: _tile(torch.amax(x, dim=axis, keepdim=keepdims)),
            maximum=lambda x, y: _tile(torch.maximum(x, y)),
            transpose=lambda x: _tile(x.transpose(-1, -2)),
            sum=lambda x, axis=None, keepdims=False: _tile(torch.sum(x, dim=axis, keepdim=keepdims)),
            mma=_mma, load=_load, store=_store)
        scopes = [({**vars(module), "ct": ct}, module, names) for module, names in modules]
        self.functions: dict[str, Callable] = {}
        for scope, module, names in scopes:
            for name in names:
                f = getattr(module, name)
                f = getattr(f, "_pyfunc", f)  # a kernel's Python body
                self.functions[name] = types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__,
                                                          f.__closure__)
        for scope, _, _ in scopes:  # every module's functions call the rebound ones, wherever defined
            scope.update(self.functions)

    def launch(self, grid: tuple[int, int, int], kernel, arguments: tuple) -> None:
        """Every block of ``grid``, in turn, as ``ct.launch`` would run them."""
        body = self.functions[kernel._pyfunc.__name__.removesuffix("_int64")]
        for b2 in range(grid[2]):
            for b1 in range(grid[1]):
                for b0 in range(grid[0]):
                    self.block[:] = [b0, b1, b2]
                    body(*arguments)
