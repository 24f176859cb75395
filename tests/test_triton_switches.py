"""The Triton forward's switches (impls/triton_fa/dense.py SWITCHES) against the float64 oracle, under the
interpreter: each alone and as the sweep combines them, on GQA, causal and not, ragged lengths and rows that see no
key."""

from __future__ import annotations

import pytest
import torch

from suite.checks import Oracle
from tests.tiers import first_fast, slow

pytest.importorskip("triton")

TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
POINTER = {**TILE, "USE_TMA": False}
HOST = {**TILE, "USE_TMA": True, "HOST_DESC": True}
SWITCHED = {
    "fold": {**POINTER, "FOLD_SCALE": True},
    "lazy": {**POINTER, "LAZY_RESCALE": 8.0},
    "loop-stages": {**POINTER, "LOOP_STAGES": 2, "WARP_SPECIALIZE": True},
    "persistent": {**POINTER, "PERSISTENT": 1},
    "persistent-heavy-first": {**POINTER, "PERSISTENT": 2},
    "overlap": {**POINTER, "OVERLAP_PV": True},
    "overlap-fold": {**POINTER, "OVERLAP_PV": True, "FOLD_SCALE": True},
    "in-kernel-descriptors": {**TILE, "USE_TMA": True},
    "host-descriptors": HOST,
    "all-but-lazy": {**HOST, "PERSISTENT": 1, "PROGRAMS_PER_SM": 2, "FOLD_SCALE": True, "OVERLAP_PV": True},
    "all-but-overlap": {**HOST, "PERSISTENT": 1, "PROGRAMS_PER_SM": 2, "FOLD_SCALE": True, "LAZY_RESCALE": 8.0},
}
# (batch, Hq, Hkv, Sq, Skv, causal). Fast: Sq > Skv, whose first causal rows see no key, and GQA over five whole
# key tiles and a ragged one (the unmasked loop, where lazy rescaling applies). Slow: larger, both ways.
SHAPES = [(1, 2, 1, 130, 97, True), (1, 4, 2, 64, 330, False), (2, 4, 2, 200, 330, True), (2, 4, 2, 200, 330, False),
          (1, 2, 2, 97, 130, False)]


def ramped_inputs(batch: int, hq: int, hkv: int, sq: int, skv: int, head_dim: int = 64, value_dim: int = 64):
    """fp16 inputs whose keys grow along the sequence, so each row's running max rises tile after tile, by less
    and by more than the lazy rescaling's threshold."""
    gen = torch.Generator().manual_seed(sq * 1000 + skv)
    q = torch.randn(batch, hq, sq, head_dim, generator=gen)
    ramp = torch.linspace(0.2, 6.0, skv)[:, None]
    k = torch.randn(batch, hkv, skv, head_dim, generator=gen) * ramp
    v = torch.randn(batch, hkv, skv, value_dim, generator=gen)
    return q.half(), k.half(), v.half()


def run(config: dict, q, k, v, causal: bool, **variants) -> torch.Tensor:
    from impls.triton_fa.dense import launch

    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    launch(config, q, k, v, out, causal=causal, scale=q.shape[-1] ** -0.5, **variants)
    return out


def assert_passes(config: dict, q, k, v, causal: bool, **variants) -> None:
    oracle = Oracle.dense(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5, **variants)
    result = oracle.check(run(config, q, k, v, causal, **variants))
    assert result.passed, result.message


@pytest.mark.parametrize("switch", list(SWITCHED))
@pytest.mark.parametrize("shape", first_fast(SHAPES, fast=2))
def test_each_switch_passes_the_oracle(switch: str, shape: tuple) -> None:
    *dims, causal = shape
    assert_passes(SWITCHED[switch], *ramped_inputs(*dims), causal)


@pytest.mark.parametrize("switch", [slow(name) for name in SWITCHED])
@pytest.mark.parametrize("variants", [{"window": (40, 0)}, {"softcap": 20.0}, {"window": (50, 30), "softcap": 5.0}])
def test_switches_keep_window_and_softcap(switch: str, variants: dict) -> None:
    assert_passes(SWITCHED[switch], *ramped_inputs(1, 4, 2, 200, 330), True, **variants)


@pytest.mark.parametrize("switch", [slow(name) for name in ("fold", "lazy", "persistent", "overlap-fold")])
@pytest.mark.parametrize("dims", [(96, 96), (192, 128), (64, 32)])
def test_pointer_switches_keep_padded_and_value_head_dims(switch: str, dims: tuple[int, int]) -> None:
    assert_passes(SWITCHED[switch], *ramped_inputs(1, 4, 2, 130, 200, *dims), True)


def test_the_sweeps_variants_are_configs_launch_takes() -> None:
    from impls.triton_fa.dense import check_config
    from tools.sweep import TRITON_VARIANTS

    assert "base" in TRITON_VARIANTS and len(TRITON_VARIANTS) > 10
    for config in TRITON_VARIANTS.values():
        check_config(config)


@pytest.mark.parametrize("name", [slow(n) for n in ("base", "fold-lazy8", "host-persist-overlap-fold", "128x128-s2")])
def test_sweep_variants_pass_the_oracle(name: str) -> None:
    from tools.sweep import TRITON_VARIANTS

    assert_passes(TRITON_VARIANTS[name], *ramped_inputs(1, 4, 2, 300, 300, 128, 128), True)


@pytest.mark.parametrize(("config", "match"), [
    ({**POINTER, "NO_SUCH_SWITCH": True}, "unknown Triton config keys"),
    ({**POINTER, "HOST_DESC": True}, "needs USE_TMA"),
    ({**POINTER, "PERSISTENT": 3}, "PERSISTENT is 0"),
    ({**POINTER, "OVERLAP_PV": True, "LAZY_RESCALE": 8.0}, "undoes the overlap"),
])
def test_a_config_launch_cannot_run_is_refused(config: dict, match: str) -> None:
    from impls.triton_fa.dense import check_config

    with pytest.raises(ValueError, match=match):
        check_config(config)


def test_host_descriptors_refuse_padded_head_dims() -> None:
    with pytest.raises(ValueError, match="power-of-two head dims"):
        run(HOST, *ramped_inputs(1, 2, 2, 64, 64, 96, 96), False)


def test_the_sweep_checks_each_variant_and_reports_a_broken_one_without_stopping(monkeypatch, tmp_path) -> None:
    """``tools.sweep --which variants`` on CPU (check only): a variant that cannot launch is a failed row, and the
    variants after it still run."""
    import json

    from tools import sweep

    broken = {**POINTER, "NO_SUCH_SWITCH": True}
    monkeypatch.setattr(sweep, "TRITON_VARIANTS", {"broken": broken, "fold": SWITCHED["fold"]})
    out = tmp_path / "rows.json"
    sweep.main(["--device", "cpu", "--check-only", "--which", "variants", "--layout", "1x2", "--hkv", "1",
                "--d", "64", "--seqlens", "97", "--causal", "causal", "--out", str(out)])
    rows = {row["name"]: row for row in json.loads(out.read_text())}
    assert rows["triton-v:broken"]["passed"] is False
    assert rows["triton-v:fold"]["passed"] is True and rows["triton-v:fold"]["d"] == 64


def test_the_sweep_summary_names_each_cases_best_variant_against_the_base_and_the_peer() -> None:
    from tools.sweep import variant_summary

    timed = [("c1", "triton-v:base", 400.0), ("c1", "triton-v:x", 440.0), ("c1", "flash-attn4", 500.0),
             ("c1", "triton-v:broken", None), ("c2", "sdpa-cudnn", 300.0)]
    rows = [{"case": case, "name": name, "tflops": tflops} for case, name, tflops in timed]
    (line,) = variant_summary(rows)
    assert "best triton-v:x 440.0" in line and "1.100 of triton-v:base" in line and "0.880 of flash-attn4" in line


def test_the_scale_folds_by_default_where_it_measured_faster() -> None:
    from impls.triton_fa.dense import dense_meta

    def folds(d: int) -> bool:
        q = torch.empty(1, 1, 4, d)
        return dense_meta(q, q, causal=True, window=(-1, -1), softcap=0.0)["FOLD_SCALE"]

    assert folds(32) and folds(64) and not folds(96) and not folds(128)


# Host descriptors (HOST_DESC) as the dense entry's tuning candidates, on the descriptor path only.
HOST_CANDIDATES = [{"BLOCK_M": m, "BLOCK_N": n, "USE_TMA": True, "HOST_DESC": True, "num_warps": 8, "num_stages": 3}
                   for m, n in ((128, 128), (128, 64))]


def test_host_descriptor_configs_are_candidates_of_the_descriptor_path_only() -> None:
    from impls.triton_fa.dense import configs, heuristic_config

    host = [c for c in configs(pointer=True, tma=True) if c.get("HOST_DESC")]
    assert host == HOST_CANDIDATES
    assert not any(c.get("HOST_DESC") for c in configs(pointer=True, tma=False))
    assert not any(heuristic_config(128, 8192, pointer).get("HOST_DESC") for pointer in (True, False))


def pin_config(monkeypatch, config: dict) -> list:
    """Run the dense entries as on an sm_90 GPU whose tuning lookup gives ``config`` (the interpreter still runs
    the kernel: fp32 inputs, whose dots it computes right); returns the space checks each lookup was given."""
    from impls.triton_fa import dense

    checks = []

    def lookup(key, tune, fixed, compile_all=None, near=(), valid=None):
        checks.append(valid)
        return config, "pinned"

    monkeypatch.setattr(dense, "interpreting", lambda: False)
    monkeypatch.setattr(dense, "tma_available", lambda device: True)
    monkeypatch.setattr(dense.TUNING, "key", lambda device, shape: repr(shape))
    monkeypatch.setattr(dense.TUNING, "lookup", lookup)
    return checks


@pytest.mark.parametrize("config", [slow(HOST_CANDIDATES[0]), HOST_CANDIDATES[1]],
                         ids=lambda c: f"{c['BLOCK_M']}x{c['BLOCK_N']}")
def test_a_host_descriptor_pick_runs_through_the_prepared_launch(monkeypatch, config: dict) -> None:
    import impls

    checks = pin_config(monkeypatch, config)
    q, k, v = (t.float() for t in ramped_inputs(1, 2, 1, 130, 200))
    oracle = Oracle.dense(q, k, v, causal=True, scale=q.shape[-1] ** -0.5)
    prepared = impls.get("triton").prepare(q, k, v, causal=True, scale=q.shape[-1] ** -0.5)
    result = oracle.check(prepared.run())
    assert result.passed, result.message
    assert prepared.config["HOST_DESC"] and prepared.config["chosen"] == "pinned"
    assert checks[0](config)  # a shipped table may carry it


def test_host_descriptor_picks_are_refused_where_descriptors_do_not_fit(monkeypatch) -> None:
    import impls

    checks = pin_config(monkeypatch, {"BLOCK_M": 64, "BLOCK_N": 64, "USE_TMA": False, "num_warps": 4,
                                      "num_stages": 1})
    q, k, v = (t.float() for t in ramped_inputs(1, 2, 2, 16, 16, 96, 96))
    impls.get("triton").prepare(q, k, v, causal=False, scale=0.1).run()
    assert not any(checks[0](c) for c in HOST_CANDIDATES)


@pytest.mark.parametrize("winner", ["host", "pointer"])
def test_one_autotuner_runs_host_descriptor_and_pointer_configs_on_the_same_arguments(winner: str) -> None:
    """``triton.autotune`` over a host-descriptor config, then an in-kernel-descriptor and a pointer one (timed by
    a stand-in that ranks them as ``winner`` asks), on descriptors built with other block shapes as the tuned launch
    builds them: the pick's run, after the others reshaped nothing it reads, passes the oracle."""
    import triton

    from impls.triton_fa.dense import (
        PLACEHOLDER_TILES,
        dense_meta,
        host_descriptors,
        kernel_arguments,
        plain_kernel,
        tuner_configs,
    )

    def wanted(c) -> bool:
        tiles = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages)
        return tiles == (128, 64, 3) if c.kwargs.get("HOST_DESC") else tiles == (64, 64, 3)

    candidates = sorted(filter(wanted, tuner_configs(pointer=True, tma=True)), key=lambda c: -c.kwargs["BLOCK_M"])
    assert [(c.kwargs["USE_TMA"], c.kwargs.get("HOST_DESC", False)) for c in candidates] == [
        (True, True), (False, False), (True, False)]
    times = iter([1.0, 3.0, 2.0] if winner == "host" else [3.0, 1.0, 2.0])

    def stand_in_bench(call, quantiles) -> list[float]:
        call()
        return [next(times)] * len(quantiles)

    key = ["q_len_class", "HEAD_DIM", "CAUSAL"]
    tuner = triton.autotune(configs=candidates, key=key, do_bench=stand_in_bench)(plain_kernel())
    q, k, v = (t.float() for t in ramped_inputs(1, 2, 1, 130, 200))
    out, scale = torch.empty_like(q), q.shape[-1] ** -0.5
    meta = {**dense_meta(q, v, causal=True, window=(-1, -1), softcap=0.0),
            **host_descriptors(q, k, v, out, *PLACEHOLDER_TILES)}
    tuner[lambda c: (triton.cdiv(130, c["BLOCK_M"]), 2, 1)](*kernel_arguments(q, k, v, out, scale, causal=True),
                                                            **meta)
    assert bool(tuner.best_config.kwargs.get("HOST_DESC")) == (winner == "host")
    result = Oracle.dense(q, k, v, causal=True, scale=scale).check(out)
    assert result.passed, result.message
