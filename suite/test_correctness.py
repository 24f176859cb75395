"""Every available implementation against the float64 oracle, over the selected grid presets."""

from impls import Impl
from suite.cases import Case
from suite.plugin import Problem, Recorder


def test_correctness(impl: Impl, case: Case, problem: Problem, record: Recorder) -> None:
    with record.guard():
        result = record.check(problem, problem.prepare(impl))
    assert result.passed, f"{impl.name} on {case.id}: {result.message}"
    record("passed", **result.as_dict())
