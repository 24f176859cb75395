"""Every available implementation against the float64 oracle, over the selected grid presets."""

from impls import Impl
from suite.cases import Case
from suite.problem import Problem
from suite.recording import Recorder


def test_correctness(impl: Impl, case: Case, problem: Problem, record: Recorder) -> None:
    with record.guard():
        with record.timer("prepare"):  # validation, tuning (or the tuning cache), compile, first call
            prepared = problem.prepare(impl)
        with record.timer("oracle"):  # the float64 reference: built by the first check of a case, then reused
            problem.oracle  # noqa: B018 - a cached property: this builds it
        with record.timer("check"):
            result = record.check(problem, prepared)
    assert result.passed, f"{impl.name} on {case.id}: {result.message}"
    record("passed", **result.as_dict())
