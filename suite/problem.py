"""One case's inputs and oracle (``Problem``), cached across the implementations that run it, and the
out-of-memory helpers that let a run record a case too big for the device and go on."""

from __future__ import annotations

import gc
import re
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from impls import Impl, Prepared
from impls.timing import clone_inputs
from suite.cases import TRAINING_OPS, Case
from suite.checks import BackwardOracle, CheckResult, Oracle

if TYPE_CHECKING:
    from suite.recording import Recorder


class Problem:
    """One case's inputs on the device and, on first use, its oracle."""

    def __init__(self, case: Case, device: torch.device) -> None:
        self.case = case
        self.device = device
        self.inputs = case.make_inputs(device)

    @property
    def q(self) -> torch.Tensor:
        return self.inputs[0] if self.case.op == "dense" else self.inputs.q

    @property
    def k(self) -> torch.Tensor:  # dense only
        return self.inputs[1]

    @property
    def v(self) -> torch.Tensor:  # dense only
        return self.inputs[2]

    @cached_property
    def oracle(self) -> Oracle | BackwardOracle:
        if self.case.op in TRAINING_OPS:
            return BackwardOracle(self.inputs, **self.case.variants)
        if self.case.op == "dense":
            return Oracle.dense(*self.inputs, causal=self.case.causal, **self.case.variants)
        return Oracle.serving(self.inputs, **self.case.variants)

    def prepare(self, impl: Impl, inputs: Any = None) -> Prepared:
        """``impl`` prepared on this case's inputs (or on a copy of them, ``inputs``)."""
        inputs = self.inputs if inputs is None else inputs
        if self.case.op == "dense":
            return impl.prepare(*inputs, causal=self.case.causal, **self.case.variants)
        return impl.prepare(inputs, **self.case.variants)

    def input_copies(self, n: int) -> list[Any]:
        """``n`` copies of the inputs in fresh memory, the first being the inputs themselves."""
        return [self.inputs] + [clone_inputs(self.inputs) for _ in range(n - 1)]

    def check(self, out: torch.Tensor) -> CheckResult:
        return self.oracle.check(out)


_last_problem: list[Problem] = []  # tests run case-major, so one cached case serves all implementations


def problem_for(case: Case, device: torch.device, record: Recorder) -> Problem:
    """The ``problem`` fixture: the case's ``Problem``, made once for the implementations that run it in turn.
    Inputs that alone outgrow the free memory (many workers on one GPU) are recorded as out of memory."""
    if not _last_problem or _last_problem[0].case != case or _last_problem[0].device != device:
        _last_problem.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            _last_problem.append(Problem(case, device))
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            record.skip_out_of_memory(exc, "making the case's inputs")
    return _last_problem[0]


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's refusal (a plain RuntimeError)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def out_of_memory_message(exc: BaseException) -> str:
    text = str(exc)
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    if asked:
        return f"out of memory (asked for {asked.group(1)})"
    asked = re.search(r"tried to allocate (\d+) bytes", text)
    return f"out of memory (asked for {int(asked.group(1))} bytes)" if asked else "out of memory"


def release_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
