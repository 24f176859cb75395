"""How a cuTile variant becomes its launches, on the CPU without compiling.

Head-dim tiles, the forms the search spaces hold, the persistent and planned shares of the work, the two-launch
form's softmax state, arguments bound by the kernel's parameter names, one kernel object per set of hints, and a
launch for every candidate of every GPU preset case.
"""

import itertools
import os
from dataclasses import replace

import pytest
import torch

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from impls.cutile.config import Variant, head_tiles, tile_d
from impls.cutile.spaces import HOPPER_STREAMING, search_space


def test_head_dims_pad_to_the_next_power_of_two():
    assert [tile_d(d) for d in (16, 32, 40, 64, 80, 96, 128, 136, 192, 256)] == [
        16, 32, 64, 64, 128, 128, 128, 256, 256, 256]


def test_head_dims_run_as_a_power_of_two_and_a_narrower_tail():
    # 96 = 64 + 32 instead of 128 padded: a quarter less matrix work; no tail where it would save nothing.
    assert {d: head_tiles(d) for d in (16, 40, 64, 72, 80, 96, 112, 128, 160, 192, 224, 256)} == {
        16: (16, 0), 40: (32, 16), 64: (64, 0), 72: (64, 16), 80: (64, 16), 96: (64, 32), 112: (128, 0),
        128: (128, 0), 160: (128, 32), 192: (128, 64), 224: (256, 0), 256: (256, 0)}
    for d in range(16, 257, 8):
        first, tail = head_tiles(d)
        assert first + tail >= d and tail < first and head_tiles(d, tail=False) == (tile_d(d), 0)
    assert Variant(64, 64).head_tiles(192, 128) == (128, 64, 128, 0)
    assert Variant(64, 64, head_tail=False).head_tiles(96) == (128, 0, 128, 0)


def test_planned_share_runs_each_query_tile_once_from_the_hosts_plan(monkeypatch):
    # The plan's arrays as the kernel reads them: block b runs WorkItems[WorkStarts[b]:WorkStarts[b + 1]], an item
    # (batch * num_m + query tile) * heads + head, decoded here as fmha_fwd decodes it.
    import impls.cutile.config

    monkeypatch.setattr(impls.cutile.config, "device_sm_count", lambda *args, **kwargs: 5)
    batch, heads, q_len, kv_len, num_m = 2, 3, 1000, 1100, 8  # 128-row tiles, the last one ragged
    q = torch.empty((batch, heads, q_len, 64))
    variant = replace(HOPPER_STREAMING, tile_n=256, planned=True)
    starts, items = variant.state(q, kv_len=kv_len)[-2:]
    assert starts.dtype == items.dtype == torch.int32 and len(starts) == variant.grid(q)[0] + 1 == 6
    assert starts[0] == 0 and starts[-1] == len(items) and bool((starts[1:] >= starts[:-1]).all())
    decoded = [(rest % num_m, rest // num_m * heads + item % heads) for item in items.tolist()
               for rest in [item // heads]]
    assert sorted(decoded) == [(t, bh) for t in range(num_m) for bh in range(batch * heads)]
    assert all(t.numel() == 1 for t in Variant(64, 64).state(q)[-2:])  # no plan: placeholders


@pytest.mark.parametrize("other", [dict(persistent=False), dict(paired=True), dict(dynamic=True)])
def test_planned_share_refuses_any_other_share(other):
    with pytest.raises(ValueError, match="planned"):
        replace(HOPPER_STREAMING, planned=True, **other)


def test_two_launch_variants_pass_the_softmax_state_between_launches():
    # The first launch is one block per query tile in plain order; both share a float32 state workspace.
    split = Variant(128, 128, num_worker_warps=8, persistent=True, dynamic=True, two_launch=True)
    diagonal = split.diagonal()
    assert not diagonal.persistent and not diagonal.reverse_order and diagonal.two_launch
    q = torch.empty((2, 4, 300, 96), device="meta", dtype=torch.float16)
    m, s, acc, counter, _, _ = split.state(q)
    assert m.shape == s.shape == (2, 4, 300) and acc.shape == (2, 4, 300, 128)
    assert {t.dtype for t in (m, s, acc)} == {torch.float32}
    assert counter.shape == (1,) and counter.dtype == torch.int32
    assert all(t.numel() == 1 for t in Variant(64, 64).state(q))  # one launch: placeholders only


def test_search_space_holds_single_launches_only():
    """The tuner times one launch per candidate (cuda.tile.tune.exhaustive_search); on the H200 the two-launch
    and dynamically scheduled forms lost, so no causal candidate is persistent but the 128x256 one at head
    dims 33-128 on Hopper (the only one whose masked loop kept up there; with GQA it leads from 4K at D=128),
    with each block's share taken every num_blocks-th item or in mirror pairs, and at D=128 a 128x128 one
    with the diagonal peeled (no masked loop at all where it runs) and the paired 128x256 peeled too."""
    for capability in ((8, 0), (9, 0), (10, 0), (12, 0)):
        for head_dim in (32, 64, 96, 128, 256):
            for causal in (False, True):
                space = search_space(capability, head_dim, causal=causal)
                assert space and not any(v.two_launch or v.dynamic for v in space)
                persistent = [(v.tile_m, v.tile_n, v.paired) for v in space
                              if causal and v.persistent and v.num_worker_warps != 16 and not v.planned]
                hopper_wide = causal and capability == (9, 0) and head_dim in (64, 96, 128)
                peeled = [(128, 128, True), (128, 256, True)] if hopper_wide and head_dim == 128 else []  # peeled_space
                assert persistent == ([(128, 256, False), (128, 256, True), *peeled] if hopper_wide else [])
                # tileiras 13.5's blocks of 16 warps: causal and persistent only with a paired share
                assert all(v.paired or v.planned for v in space
                           if causal and v.persistent and v.num_worker_warps == 16)
                # every paired candidate again taking the host's plan, and no other planned one
                assert [replace(v, paired=False, planned=True) for v in space if v.paired] == [
                    v for v in space if v.planned]


def test_a_two_launch_call_runs_the_diagonal_first_then_the_mask_free_part():
    import inspect

    from impls.cutile.kernel import DIAGONAL, OFF_DIAGONAL, WHOLE, fmha_fwd

    phase = list(inspect.signature(fmha_fwd._pyfunc).parameters).index("PHASE")
    q = torch.empty((2, 4, 300, 64), device="meta", dtype=torch.float16)
    k = v = torch.empty((2, 2, 300, 64), device="meta", dtype=torch.float16)
    split = Variant(64, 64, two_launch=True)
    state = split.state(q)
    launches = split.launches(q, k, v, q, state, causal=True, scale=0.125)
    assert [args[phase] for _, _, args in launches] == [DIAGONAL, OFF_DIAGONAL]
    assert all(args[4:10] == state for _, _, args in launches)  # both launches see one workspace
    (_, _, whole), = Variant(64, 64).launches(q, k, v, q, Variant(64, 64).state(q), causal=True, scale=0.125)
    assert whole[phase] == WHOLE


def test_arguments_are_bound_by_the_kernels_parameter_names():
    """The launch arguments follow the kernel's signature, whatever order they are given in; a parameter left
    without a value is named."""
    pytest.importorskip("cuda.tile")
    import inspect

    from impls.cutile import kernel
    from impls.cutile.config import bind

    names = list(inspect.signature(kernel.fmha_varlen._pyfunc).parameters)
    values = {name: i for i, name in enumerate(reversed(names))}
    assert bind("fmha_varlen", **values, EXTRA=-1) == tuple(values[name] for name in names)
    del values["HEAD_GROUP"]
    with pytest.raises(TypeError, match="fmha_varlen: no value for HEAD_GROUP"):
        bind("fmha_varlen", **values)


def test_a_kernel_and_its_hints_are_made_once():
    """Launches share one kernel object per kernel and set of hints: a new object per call would compile again,
    and would free its module while a CUDA graph captured from it still runs (a segfault)."""
    pytest.importorskip("cuda.tile")
    from impls.cutile.config import Variant

    variant = Variant(64, 128, occupancy=2)
    assert variant.kernel() is variant.kernel()
    assert variant.kernel(base="fmha_varlen") is Variant(64, 128, occupancy=2).kernel(base="fmha_varlen")
    assert variant.kernel() is not Variant(64, 128, occupancy=1).kernel()


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0), (12, 0)])
def test_every_candidate_of_every_gpu_preset_case_makes_its_launches(monkeypatch, capability):
    """What the tuners try on the GPU presets, built on the CPU without compiling: each dense case's candidates
    (``candidates``, its window bound as ``prepare_tuned`` binds it) and each varlen case's (``varlen_candidates``,
    with its window and softcap).
    A form some shape refuses at launch time fails here, not on the GPU (a peeled diagonal once reached the
    varlen space, which has no one query length, and refused every causal D=128 varlen case there)."""
    import impls.cutile.config
    from impls.contract import Varlen, binding_window
    from impls.cutile.launch import Call
    from impls.cutile.serving import VarlenCall, varlen_candidates
    from impls.cutile.spaces import candidates
    from suite.presets import PRESETS

    # persistent grids size by SMs
    monkeypatch.setattr(impls.cutile.config, "device_sm_count", lambda *args, **kwargs: 132)
    cases = {case.id: case for name, preset in PRESETS.items() if "cpu" not in name for case in preset}
    built = 0
    for case in cases.values():
        if case.op == "dense":  # meta tensors: shapes and strides, no memory
            q, k, v = (torch.empty(shape, dtype=case.torch_dtype, device="meta") for shape in (
                (case.batch, case.hq, case.sq, case.d), (case.batch, case.hkv, case.skv, case.d),
                (case.batch, case.hkv, case.skv, case.value_dim)))
            variants = dict(case.variants)
            if "window" in variants:  # as prepare_tuned binds it
                variants["window"] = binding_window(variants["window"], case.causal, case.sq, case.skv)
            calls = [Call(variant, q, k, v, causal=case.causal, scale=0.125, **variants)
                     for variant in candidates(capability, q, k, v, causal=case.causal, **variants)]
        elif case.op == "varlen":
            cu = torch.tensor([0, *itertools.accumulate(case.seqlens())], dtype=torch.int32)
            q, k = (torch.empty((case.sq, heads, case.d), dtype=case.torch_dtype) for heads in (case.hq, case.hkv))
            inputs = Varlen(q, k, k, cu, cu.clone(), causal=case.causal)
            window = inputs.binding_window(case.window)  # as prepare_varlen binds it
            calls = [VarlenCall(variant, inputs, scale=0.125, sm_count=132, window=window, softcap=case.softcap)
                     for variant in varlen_candidates(capability, inputs, window)]
        else:
            continue
        assert calls and all(call.launches for call in calls), case.id
        built += len(calls)
    assert built > sum(case.op in ("dense", "varlen") for case in cases.values())  # more than one a case


def test_a_persistent_grid_counts_clusters_as_blocks(monkeypatch):
    # a block of num_ctas=2 is a cluster on two SMs: 132 SMs hold 66 of them at once, not 132 (a second wave of
    # persistent blocks would run their whole share after the first)
    import impls.cutile.config

    monkeypatch.setattr(impls.cutile.config, "device_sm_count", lambda *args, **kwargs: 132)
    q = torch.empty((4, 32, 4096, 128))
    assert HOPPER_STREAMING.grid(q) == (132, 1, 1)
    assert replace(HOPPER_STREAMING, num_ctas=2).grid(q) == (66, 1, 1)
    assert replace(HOPPER_STREAMING, occupancy=2, num_ctas=2).grid(q) == (132, 1, 1)
    assert replace(HOPPER_STREAMING, num_ctas=2).resident_blocks(1) == 1  # never none
