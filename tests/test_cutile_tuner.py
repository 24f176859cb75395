"""What the cuTile tuners time and pick, on the CPU with the timing stubbed.

The settled tuner's second round over the search's finalists (and the tuning cache that keeps their times), and
the decode tuner's candidates: each split plan once per chunk length, with and without programmatic dependent
launch.
"""

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from impls.cutile.config import Variant
from impls.cutile.spaces import HOPPER_WIDE
from tests.cutile_helpers import named, serving_inputs


def test_settled_tuner_times_again_only_the_candidates_near_the_searchs_best(monkeypatch, tmp_path):
    """FMHA_TUNER=settled: exhaustive_search first; the candidates within FINALIST_MARGIN of its best are timed
    again each at its own sustained clocks, and that decides. Where the search alone decides (the default),
    its best is the pick. The settled pick keeps its finalists' times in the tuning cache, beside the config,
    and a later process reads them back with the pick."""
    import impls.cutile.tuner as cutile
    from impls import tuning as _tuning

    space = [Variant(64, 128, occupancy=2), HOPPER_WIDE, replace(HOPPER_WIDE, persistent=True, tile_n=256)]
    times = dict(zip(space, (100.0, 140.0, 109.0), strict=True))  # us: the second is out of the running
    result = SimpleNamespace(best=SimpleNamespace(config=space[0]),
                             successes=[SimpleNamespace(config=v, mean_us=t) for v, t in times.items()])
    retimed = []

    def settled_ranking(candidates):  # the suite's way, the search's third is fastest
        candidates = list(candidates)
        retimed.extend(variant for variant, _ in candidates)
        assert all(call.variant is variant for variant, call in candidates)
        settled_ms = {space[0]: 0.1234, space[2]: 0.1171}
        return sorted(((variant, settled_ms[variant]) for variant, _ in candidates), key=lambda entry: entry[1])

    monkeypatch.setenv("FMHA_TUNING_CACHE", str(tmp_path))
    monkeypatch.setenv("FMHA_TUNING", "tune")
    monkeypatch.delenv("FMHA_GPU_SHARED", raising=False)
    monkeypatch.setattr(cutile, "_TUNED", {})
    monkeypatch.setattr(cutile, "precompile", lambda calls: calls)
    monkeypatch.setattr(cutile, "settle_gpu", lambda device: None)
    monkeypatch.setattr(cutile, "exhaustive_timings", lambda calls: result)
    monkeypatch.setattr(cutile, "settled_ranking", settled_ranking)
    monkeypatch.setattr(cutile.TUNING, "key", lambda device, shape: repr(shape))
    picks = {}
    for tuner in ("exhaustive", "settled"):
        monkeypatch.setenv("FMHA_TUNER", tuner)
        picks[tuner] = cutile.tuned(("test-shape", tuner), torch.device("cpu"), space,
                                    lambda v: SimpleNamespace(variant=v))
        assert picks[tuner].source == _tuning.TUNED
    assert {tuner: pick.choice for tuner, pick in picks.items()} == {"exhaustive": space[0], "settled": space[2]}
    assert retimed == [space[0], space[2]]  # fastest first; 140 us is more than FINALIST_MARGIN behind
    assert _tuning.FINALIST_MARGIN == 0.10
    finalists = [{"variant": space[2].label(), "search_us": 109.0, "settled_us": 117.1},
                 {"variant": space[0].label(), "search_us": 100.0, "settled_us": 123.4}]
    assert picks["exhaustive"].finalists is None and picks["settled"].finalists == finalists
    assert picks["settled"].provenance() == {"chosen": "autotuned", _tuning.EVIDENCE: finalists}
    assert picks["exhaustive"].provenance() == {"chosen": "autotuned"}
    # another process: the pick and its evidence from the cache, the config without it
    monkeypatch.setattr(cutile, "_TUNED", {})
    again = cutile.tuned(("test-shape", "settled"), torch.device("cpu"), space, lambda v: pytest.fail("re-tuned"))
    assert again == (space[2], _tuning.CACHED, finalists)
    assert again.provenance() == {"chosen": "tuning cache", _tuning.EVIDENCE: finalists}
    # a search with one finalist needs no second round
    result.successes[2] = SimpleNamespace(config=space[2], mean_us=150.0)
    pick = cutile.tuned(("test-shape", "alone"), torch.device("cpu"), space, lambda v: SimpleNamespace(variant=v))
    assert pick.choice == space[0] and pick.finalists is None and retimed == [space[0], space[2]]
    # a process that shares its GPU runs the space's first candidate, untimed, and stores nothing
    monkeypatch.setenv("FMHA_GPU_SHARED", "1")
    shared = cutile.tuned(("test-shape", "shared"), torch.device("cpu"), space[::-1], lambda v: pytest.fail("timed"))
    assert shared == (space[2], _tuning.FIXED, None) and shared.provenance() == {"chosen": _tuning.FIXED}
    assert cutile.TUNING.get(repr(("test-shape", "shared"))) is None
    # ... after compiling every candidate of the space, untimed, where a chain's prime asks it to
    compiled = []
    monkeypatch.setattr(cutile, "precompile", lambda calls: compiled.extend(call.variant for call in calls) or calls)
    monkeypatch.setenv("FMHA_COMPILE_CANDIDATES", "1")
    primed = cutile.tuned(("test-shape", "primed"), torch.device("cpu"), space[::-1],
                          lambda v: SimpleNamespace(variant=v, __call__=lambda: pytest.fail("timed")))
    assert primed == (space[2], _tuning.FIXED, None) and compiled == space[::-1]
    assert cutile.TUNING.get(repr(("test-shape", "primed"))) is None


def test_decode_tuner_tries_each_aimed_plan_once_per_chunk_length(monkeypatch):
    """The decode tuner times every kernel form with each split plan of ``AIMED_PLANS`` (one chunk a sequence
    where the GPU holds the batch, or more), once per distinct chunk length, and every plan of a form runs the
    same compiled kernel (the chunk length is a run-time argument)."""
    import impls._plans
    from impls._plans import AIMED_PLANS
    from impls.cutile.serving import DecodeVariant, plan_candidates

    inputs = serving_inputs("serving-cpu", 4)  # MQA at batch 1, 300 tokens: 5 tiles of 64 keys
    forms = [DecodeVariant(64), DecodeVariant(64, "indexed")]
    monkeypatch.setattr(impls._plans, "SPLIT_MIN_TILES", 1)  # one-tile chunks, one SM: each plan cuts apart
    one_sm = plan_candidates(forms, inputs, scale=0.125, sm_count=1)
    assert len(one_sm) == len(forms) * len(AIMED_PLANS)
    for form in forms:
        calls = [call for call in one_sm if call.variant.read == form.read]
        assert sorted(call.variant.plan_programs for call in calls) == sorted(AIMED_PLANS)
        assert len({call.split_len for call in calls}) == len(AIMED_PLANS)  # 2, 3 and 5 chunks
        assert len({call.launches[0][1] for call in calls}) == 1
    monkeypatch.undo()
    many_sms = plan_candidates(forms, inputs, scale=0.125, sm_count=132)
    # every aimed plan of chunks of at least SPLIT_MIN_TILES leaves it whole; those of one tile (PLAN_MIN_TILES,
    # for short steps) cut it into its 5 tiles
    assert [(call.variant.plan_min_tiles, call.num_splits) for call in many_sms] == [(None, 1), (1, 5)] * 2


def test_decode_tuner_tries_split_steps_with_and_without_programmatic_dependent_launch(monkeypatch):
    """Where a GPU has programmatic dependent launch, the decode tuner times each split candidate both ways
    (``DecodeVariant.pdl``), and the chosen variant launches as it says; an unsplit step is tried once, as
    before (one launch: nothing to overlap). Without the feature (here, on CPU) nothing doubles."""
    import impls._plans
    import impls.cutile.serving as serving

    inputs = serving_inputs("serving-cpu", 4)  # MQA at batch 1, 300 tokens
    form = [serving.DecodeVariant(64)]
    with monkeypatch.context() as one_tile_chunks:
        one_tile_chunks.setattr(impls._plans, "SPLIT_MIN_TILES", 1)
        plain = serving.plan_candidates(form, inputs, scale=0.125, sm_count=1)
        assert {call.variant.pdl for call in plain} == {None} and not any(c.dependent_launch for c in plain)
        monkeypatch.setattr(serving, "dependent_launch_available", lambda device: True)
        both = serving.plan_candidates(form, inputs, scale=0.125, sm_count=1)
    assert len(both) == 2 * len(plain)
    assert sorted((c.split_len, c.dependent_launch) for c in both) == sorted(
        (c.split_len, pdl) for c in plain for pdl in (False, True))
    for call in both:  # as the tuning cache rebuilds the chosen one
        rebuilt = serving.DecodeCall(serving.DecodeVariant(**call.variant.describe()), inputs, scale=0.125,
                                     sm_count=1)
        assert rebuilt.dependent_launch is call.variant.pdl is named(rebuilt.launches[0])["PDL"]
    # on 132 SMs the plans of SPLIT_MIN_TILES leave it whole (tried once), the one-tile plan splits it (both ways)
    whole = serving.plan_candidates(form, inputs, scale=0.125, sm_count=132)
    assert [(c.num_splits, c.variant.pdl, c.dependent_launch) for c in whole] == [
        (1, None, False), (5, False, False), (5, True, True)]
