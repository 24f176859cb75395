import itertools

import pytest

from impls.reference import causal_visible
from suite import metrics
from suite.cases import Case
from suite.presets import PRESETS, cases


def test_case_ids_read_like_the_issue():
    assert Case(1, 8, 2, 300, 300, 128, "fp16", True).id == "fp16-causal-h8:2-s300x300-d128"
    assert Case(4, 32, 8, 1, 4096, 64, "bf16", False).id == "bf16-full-h32:8-s1x4096-d64-b4"


def test_presets_have_unique_valid_cases():
    for name, grid in PRESETS.items():
        assert grid, name
        assert len({c.id for c in grid}) == len(grid), name


def test_cases_across_presets_are_deduplicated():
    both = list(cases(["blog", "ladder"]))
    assert len(both) == len(PRESETS["blog"])


def test_bad_case_is_refused():
    with pytest.raises(ValueError, match="GQA ratio"):
        Case(1, 6, 4, 8, 8, 64)
    with pytest.raises(ValueError, match="dtype"):
        Case(1, 4, 4, 8, 8, 64, "fp8")


@pytest.mark.parametrize(("sq", "skv"), list(itertools.product([1, 2, 5, 64, 100], [1, 3, 64, 100])))
@pytest.mark.parametrize("causal", [False, True])
def test_visible_pairs_counts_the_mask_exactly(sq, skv, causal):
    expected = int(causal_visible(sq, skv).sum()) if causal else sq * skv
    assert metrics.visible_pairs(sq, skv, causal) == expected


def test_flops_and_bytes():
    case = Case(2, 8, 2, 128, 128, 64, "fp16", False)
    assert metrics.flops(case) == 4 * 2 * 8 * 128 * 128 * 64
    causal = Case(2, 8, 2, 128, 128, 64, "fp16", True)
    assert metrics.flops(causal) == 4 * 2 * 8 * 64 * (128 * 129 // 2)
    # q and o over 8 query heads, k and v over 2 kv heads, 2 bytes each
    assert metrics.min_bytes(case) == 2 * 64 * 2 * (2 * 8 * 128 + 2 * 2 * 128)


def test_iterations_fill_a_round_and_are_bounded():
    from impls.timing import iterations_for

    assert iterations_for(0.001, 0.02) == 20
    assert iterations_for(0.5, 0.02) == 1  # a long call is timed one per round
    assert iterations_for(1e-9, 0.02) == 1000  # capped
    assert iterations_for(0.0, 0.02) == 1000


def test_a_case_is_found_by_its_id_in_any_preset():
    from suite.presets import PRESETS, case_by_id

    case = PRESETS["serving-cpu"][1]
    assert case_by_id(case.id) is case
    with pytest.raises(ValueError, match="no preset has a case 'nope'"):
        case_by_id("nope")
