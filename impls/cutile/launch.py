"""Launching our cuTile kernels: what a launch needs on a machine (``requires``) and a prepared call, every launch's
arguments made once so that a timed call only launches (``Launches``, ``Call`` for the dense kernel)."""

from __future__ import annotations

import torch

from impls._registry import Prepared, module_available
from impls.contract import NO_WINDOW
from impls.cutile import toolchain
from impls.cutile.config import Variant, kernel_window


def requires(device: str) -> str | None:
    """cuTile installed, its compiler ``tileiras`` found, and the bytecode FMHA_CUTILE_BYTECODE asks for readable by
    it. Without a ``tileiras`` cuda-tile still imports and then fails every compile, so its absence is a reason."""
    missing = module_available("cuda.tile", 'pip install "cuda-tile[tileiras]"')(device)
    if missing:
        return missing
    try:
        toolchain.compiler()
        toolchain.enable()
    except (ValueError, RuntimeError, FileNotFoundError) as error:
        return str(error)
    return None


class Launches:
    """A prepared call: ``launches`` (grid, kernel, arguments), made once, so that a timed call only launches;
    ``variant`` is the form it runs (its ``describe()`` goes into the benchmark's config), ``out`` the result."""

    variant: Variant
    launches: list[tuple]
    out: torch.Tensor
    dependent_launch = False  # every launch a programmatic dependent of the one before it (kernels that wait: PDL)

    def reset(self) -> None:
        """What must happen before every call's launches (a scheduler's counter to zero): nothing here."""

    def __call__(self) -> torch.Tensor:
        import cuda.tile as ct

        stream = torch.cuda.current_stream()
        self.reset()
        for grid, kernel, arguments in self.launches:
            ct.launch(stream, grid, kernel, arguments, programmatic_dependent_launch=self.dependent_launch)
        return self.out

    def prepared(self, **config) -> Prepared:
        self()  # compile outside any timed region
        return Prepared(self, config={**self.variant.describe(), **toolchain.describe(), **config})


class Call(Launches):
    """One prepared dense call of a variant: contiguous inputs, the output, the workspace and every launch's
    arguments."""

    def __init__(self, variant: Variant, q, k, v, *, causal: bool, scale: float,
                 out: torch.Tensor | None = None, **variants) -> None:
        window = kernel_window(variants.get("window", NO_WINDOW), causal)
        self.variant = variant = variant.resolved(causal=causal, q_len=q.shape[2], kv_len=k.shape[2], window=window)
        self.q, self.k, self.v = (t.contiguous() for t in (q, k, v))  # a no-op for the contract's usual layout
        self.out = self.q.new_empty((*self.q.shape[:3], self.v.shape[-1])) if out is None else out
        self.state = variant.state(self.q, self.v.shape[-1], kv_len=self.k.shape[2], causal=causal, window=window)
        self.launches = variant.launches(self.q, self.k, self.v, self.out, self.state, causal=causal, scale=scale,
                                         **variants)

    def reset(self) -> None:
        if self.variant.dynamic:  # the scheduler's counter: part of every call, so inside any timed region
            self.state[-1].zero_()
