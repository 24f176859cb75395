"""The two tiers of the tests: a fast default run that covers every kind of check once, and the ``slow`` tier
(``pytest -m slow``) that repeats it over every candidate and parametrisation. Together they run every check."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest

SLOW = pytest.mark.slow


def slow(value: Any, unpack: bool = False) -> Any:
    """``value`` as a parameter of the slow tier; ``unpack``: a tuple of several argnames' values."""
    if isinstance(value, type(pytest.param(None))):
        return pytest.param(*value.values, marks=[*value.marks, SLOW], id=value.id)
    return pytest.param(*(value if unpack else (value,)), marks=SLOW)


def first_fast(values: Iterable[Any], fast: int = 1, unpack: bool = False) -> list[Any]:
    """Parameters of which the first ``fast`` run by default and the rest in the slow tier."""
    return [value if i < fast else slow(value, unpack) for i, value in enumerate(values)]


def only_fast(values: Iterable[Any], fast: Sequence[Any], unpack: bool = False) -> list[Any]:
    """Parameters of which those in ``fast`` run by default and the others in the slow tier."""
    return [value if value in fast else slow(value, unpack) for value in values]
