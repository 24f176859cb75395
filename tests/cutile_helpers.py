"""Helpers the cuTile test modules share: a prepared launch's arguments by name, a cubin's SASS summary, and
the CPU inputs of a preset's serving case."""

import inspect
import os

import pytest

from impls.sass import find_cuobjdump, sass_summary


def named(launch: tuple) -> dict:
    """A prepared launch's (grid, kernel, arguments) as the kernel's parameter names and their arguments."""
    _, kernel, arguments = launch
    return dict(zip(inspect.signature(kernel._pyfunc).parameters, arguments, strict=True))


def needs_cuobjdump() -> None:
    """Skips where cuobjdump is missing, except in CI."""
    if not find_cuobjdump() and not os.environ.get("CI"):
        pytest.skip("needs cuobjdump (pip install nvidia-cuda-cuobjdump, or triton)")


def sass(cubin: bytes) -> dict[str, int]:
    """Registers, stack, shared memory and instruction counts of a cubin (skips where cuobjdump is missing,
    except in CI)."""
    needs_cuobjdump()
    return sass_summary(cubin)


def serving_inputs(preset_name: str, index: int):
    from suite.presets import preset

    return preset(preset_name)[index].make_inputs("cpu")
