"""Every configuration our autotuners may pick is correct on its own (GPU only).

An autotuner keeps whichever candidate is fastest for a shape class, so a candidate that is wrong on some edge
case would show up only on the GPU that happens to prefer it. Each candidate of this GPU's search spaces
(cuTile and Triton, the Triton TMA path included) is launched directly, without autotuning, on edge cases
(ragged lengths, Sq != Skv both ways with rows that see no key, GQA, MQA, bf16, large scores that keep moving
the running max) and checked against the float64 oracle. Without autotuning each candidate runs once per case,
which is also what the sanitizers run (tools/gpu_checks.sh). ``FMHA_CANDIDATES=GLOB`` keeps the cuTile
candidates whose label matches (``*two-launch*``: the sanitizer's subset; serving candidates too, by their
label or, for decode, their description). The kernel's forms the tuner
does not try (``impls.cutile.other_forms``) are checked too.
"""

import os
from collections.abc import Callable
from fnmatch import fnmatchcase

import pytest
import torch

from impls.contract import NO_WINDOW
from suite.cases import Case
from suite.checks import Oracle
from suite.presets import UNEVEN_VARLEN, uneven_varlen

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CASES = [
    Case(2, 8, 2, 300, 300, 128, "fp16", True),
    Case(2, 8, 8, 333, 1000, 64, "bf16", True),  # chunked prefill: bottom-right causal
    Case(2, 8, 2, 200, 130, 128, "fp16", True),  # Sq > Skv: the first 70 rows see no key
    Case(2, 8, 1, 97, 97, 64, "fp16", False),
    Case(1, 4, 4, 1024, 1024, 128, "bf16", False),
    Case(3, 4, 2, 257, 257, 128, "fp16", True),  # 12 batch-heads: the last group of heads is partial
    Case(2, 4, 2, 300, 300, 96, "bf16", True),  # head dims padded to the next power of two
    Case(1, 4, 1, 200, 330, 40, "fp16", True),
    Case(1, 4, 2, 250, 250, 256, "bf16", True),
    Case(1, 4, 2, 300, 300, 256, "bf16", True, window=(100, 0), softcap=50.0),  # Gemma 2's local layers, ragged
    Case(1, 2, 2, 129, 129, 192, "fp16", False),
    # Model variants: key tiles before a window's far edge are masked or skipped, softcap before the mask.
    Case(2, 8, 2, 700, 700, 128, "bf16", True, window=(128, 0), softcap=30.0),  # Gemma 2's local layers
    Case(1, 4, 2, 300, 500, 64, "fp16", False, window=(100, 37)),  # two-sided, Sq < Skv
    Case(1, 4, 1, 200, 130, 128, "fp16", True, window=(16, 0)),  # a window narrower than a tile; empty rows
    Case(1, 4, 4, 257, 257, 96, "fp16", False, softcap=50.0),
    Case(2, 4, 4, 300, 300, 192, "bf16", True, dv=128),  # DeepSeek's MLA prefill: V and the output narrower
    # Whole 128-row tiles: the peeled candidates run peeled (elsewhere with the masked loop: Variant.resolved)
    Case(2, 8, 2, 512, 512, 128, "bf16", True),
    Case(1, 4, 2, 256, 768, 128, "fp16", True),  # chunked prefill, Skv - Sq = 512
    Case(1, 4, 2, 768, 768, 128, "bf16", True, window=(256, 0)),  # the window's far edge peeled too
    Case(1, 4, 2, 512, 1024, 128, "bf16", True, window=(384, 0)),  # and with a window of an odd count of 128 keys
    Case(2, 4, 4, 512, 512, 192, "bf16", True, dv=128),
    # batch x heads past 65535, CUDA's cap on one grid axis: heads and sequences each get an axis (heads_by_batch)
    Case(4097, 16, 4, 20, 50, 64, "bf16", True),
]
# The serving operations past it too: sequences x kv heads (decode), sequences x heads (varlen).
WIDE_SERVING = [Case(4097, 32, 16, 1, 50, 64, "bf16", True, op="paged", page_size=16, lengths="longtail"),
                Case(4097, 16, 4, 4 * 4097, 4 * 4097, 64, "bf16", True, op="varlen", lengths="random")]


def kept(label: str) -> bool:
    """Whether a cuTile candidate's label matches FMHA_CANDIDATES (default: all)."""
    return fnmatchcase(label, os.environ.get("FMHA_CANDIDATES", "*"))


def cutile_candidates(case: Case, q, k, v, out) -> list[tuple[str, Callable[[], object]]]:
    pytest.importorskip("cuda.tile")
    from impls.cutile.config import HEAD_DIMS, tile_d
    from impls.cutile.launch import Call
    from impls.cutile.spaces import other_forms, search_space
    from impls.cutile.tuner import precompile

    if case.d not in HEAD_DIMS:
        return []
    space = search_space(torch.cuda.get_device_capability(), case.d, causal=case.causal, value_dim=case.dv or None,
                         window="window" in case.variants)
    space += other_forms() if tile_d(case.d) <= 128 else []  # the kernel's other forms: correct, if not tuned
    calls = [Call(var, q, k, v, out=out, causal=case.causal, scale=case.d ** -0.5, **case.variants)
             for var in space if kept(var.label())]
    calls = list({call.variant: call for call in calls}.values())  # a refused peel runs its twin's form
    precompile(calls)  # every candidate's compile at once, in threads
    return [(call.variant.label(), call) for call in calls]


def triton_candidates(case: Case, q, k, v, out) -> list[tuple[str, Callable[[], object]]]:
    pytest.importorskip("triton")
    from impls.triton_fa.config import requires_tma
    from impls.triton_fa.dense import configs, descriptors_fit, launch

    def call(config: dict) -> Callable[[], object]:
        return lambda: launch(config, q, k, v, out, causal=case.causal, scale=case.d ** -0.5, **case.variants)

    tma = requires_tma("cuda") is None and descriptors_fit(q.shape[-1], v.shape[-1])  # as the autotuner's space
    return [(str(c), call(c)) for c in configs(pointer=True, tma=tma)]


@pytest.mark.parametrize("family", [cutile_candidates, triton_candidates], ids=["cutile", "triton"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("amplitude", [1.0, 8.0], ids=["unit", "large-scores"])
def test_every_candidate(family, case: Case, amplitude: float):
    q, k, v = case.make_inputs("cuda")
    q = (q.float() * amplitude).to(q.dtype)  # large scores: the row max keeps moving along the keys
    oracle = Oracle.dense(q, k, v, causal=case.causal, **case.variants)
    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    failures, launched = [], 0
    candidates = family(case, q, k, v, out)
    for name, launch in candidates:
        out.fill_(float("nan"))  # a row the candidate never writes stays NaN and fails
        try:
            launch()
        except Exception as exc:
            if type(exc).__name__ == "OutOfResources":
                continue  # more shared memory than this GPU has: Triton's autotuner skips such a config too
            # Named and the next candidate tried, so that one run lists every candidate that fails (a sticky
            # device fault fails the rest too; the first such line names the culprit).
            failures.append(f"{name}: raised {type(exc).__name__}: {exc}")
            continue
        launched += 1
        result = oracle.check(out)
        if not result.passed:
            failures.append(f"{name}: {result.message}")
    assert not failures, "\n".join(failures)
    assert launched or not candidates, "no candidate fits this GPU"


def serving_cases() -> list[Case]:
    """The cases every decode form and varlen candidate of our cuTile kernels run on: the serving twins (NaN in
    every unused cache slot, ragged lengths over page boundaries, several new tokens, splits merged by the
    combine) and the models' twins with a sliding window or softcap."""
    from suite.presets import preset

    variants = [c for c in preset("models-serving-cpu") if c.window != NO_WINDOW or c.softcap]
    return preset("serving-cpu") + preset("varlen-cpu") + variants + WIDE_SERVING


def cutile_serving_candidates(inputs, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
                              scale: float | None = None) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    pytest.importorskip("cuda.tile")
    import impls.cutile.serving
    from impls.cutile.config import tile_d
    from impls.cutile.serving import DecodeCall, VarlenCall, decode_space, varlen_space, word_view_fits
    from impls.cutile.tuner import precompile

    scale = inputs.head_dim ** -0.5 if scale is None else scale
    if inputs.op == "paged":  # one SM: the short twins split into several chunks
        variants = {"window_left": inputs.window_left(window), "softcap": softcap}
        named = [(str(var), DecodeCall(var, inputs, scale=scale, sm_count=1, **variants))
                 for var in decode_space(inputs.page_size, head_dim=inputs.head_dim)]
        # A cache of 2**31 elements or more is read through 32-bit word views (decode.py's WORD_PAGES): its
        # page-load forms, as such a cache runs them, on the twins.
        if word_view_fits(inputs.k_cache, inputs.v_cache, tile_d(inputs.head_dim)):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(impls.cutile.serving, "needs_int64", lambda *tensors: True)
                named += [(f"word views, {var}", DecodeCall(var, inputs, scale=scale, sm_count=1, **variants))
                          for var in decode_space(inputs.page_size, huge=True, words=True,
                                                  head_dim=inputs.head_dim)]
    else:
        space = varlen_space(torch.cuda.get_device_capability(), inputs.head_dim, inputs.causal,
                             window=window != NO_WINDOW)
        named = [(var.label(), VarlenCall(var, inputs, scale=scale, window=window, softcap=softcap)) for var in space]
    named = [(name, call) for name, call in named if kept(name)]
    precompile([call for _, call in named])
    return named


def check_serving_candidates(inputs, window: tuple[int, int] = NO_WINDOW, softcap: float = 0.0) -> None:
    oracle = Oracle.serving(inputs, window=window, softcap=softcap)
    failures = []
    for name, call in cutile_serving_candidates(inputs, window, softcap):
        call.out.fill_(float("nan"))
        result = oracle.check(call())
        if not result.passed:
            failures.append(f"{name}: {result.message}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", serving_cases(), ids=lambda c: c.id)
def test_every_serving_candidate(case: Case, monkeypatch):
    import impls._plans

    monkeypatch.setattr(impls._plans, "SPLIT_MIN_TILES", 1)  # the short twins split, the combine runs
    check_serving_candidates(case.make_inputs("cuda"), case.window, case.softcap)


@pytest.mark.parametrize("case", WIDE_SERVING, ids=lambda c: c.id)
def test_triton_serving_past_one_grid_axis(case: Case):
    """Our Triton decode and varlen entries (autotuned) on more programs than one grid axis holds."""
    import impls

    inputs = case.make_inputs("cuda")
    result = Oracle.serving(inputs).check(impls.get("triton", case.op).prepare(inputs)())
    assert result.passed, result.message


def test_every_decode_form_over_fp8_keeps_bf16_queries_of_any_magnitude(monkeypatch):
    """cuTile's fp16 dots of bf16 queries over an fp8 cache (decode.py's F16_DOT) on queries far outside fp16's
    range, and an all-zero head (tests/serving_helpers.py's EXTREME_MAGNITUDES)."""
    import impls._plans
    from tests.serving_helpers import EXTREME_MAGNITUDES, extreme_fp8_inputs

    monkeypatch.setattr(impls._plans, "SPLIT_MIN_TILES", 1)  # the combine runs too
    for magnitude in EXTREME_MAGNITUDES:
        inputs, scale = extreme_fp8_inputs("cuda", magnitude)
        oracle = Oracle.serving(inputs, scale=scale)
        failures = [f"{name}: {result.message}" for name, call in cutile_serving_candidates(inputs, scale=scale)
                    if not (result := oracle.check(call())).passed]
        assert not failures, f"queries of {magnitude}: " + "\n".join(failures)


@pytest.mark.parametrize("lengths_q, lengths_k, causal", UNEVEN_VARLEN)
def test_every_varlen_candidate_on_uneven_batches(lengths_q: list[int], lengths_k: list[int], causal: bool):
    check_serving_candidates(uneven_varlen(lengths_q, lengths_k, causal, "cuda"))


@pytest.mark.parametrize("lengths_q, lengths_k, causal", [UNEVEN_VARLEN[0], UNEVEN_VARLEN[-1]])
def test_every_varlen_candidate_with_a_64_column_tail(lengths_q: list[int], lengths_k: list[int], causal: bool):
    """Head dim 192 (128 + 64): the 128-row candidates read K's and V's tail from the first tile's load
    (``kernel.one_load``), through the varlen kernel's row-offset views too."""
    check_serving_candidates(uneven_varlen(lengths_q, lengths_k, causal, "cuda", head_dim=192))


@pytest.mark.parametrize("window", [(256, 0), (384, 0)])
@pytest.mark.parametrize("lengths_q, lengths_k", [([700, 130, 1000], [700, 130, 1000]),
                                                  ([300, 5, 200, 1], [428, 133, 456, 1])])
def test_every_varlen_candidate_with_a_window_it_peels(lengths_q: list[int], lengths_k: list[int],
                                                       window: tuple[int, int]):
    """Windows whose left size is whole 128-key tiles (at least 256): the peeled candidates run the window's far
    edge as straight-line code too (``varlen_resolved`` keeps their peel), on ragged and chunked batches."""
    check_serving_candidates(uneven_varlen(lengths_q, lengths_k, True, "cuda"), window)
