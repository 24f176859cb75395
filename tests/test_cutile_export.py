"""Every cuTile kernel compiles to a cubin for each architecture, and the hints reach the compiler.

No GPU is needed: ``cuda.tile.compilation.export_kernel`` runs the whole compiler (tileiras) ahead of time.
"""

import os

import pytest
import torch

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from impls.cutile import LADDER, Variant, search_space
from impls.cutile.export import export_cubin

ARCHS = ["sm_80", "sm_90", "sm_100", "sm_120"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(LADDER))
def test_ladder_kernel_compiles(name, arch):
    variant, _ = LADDER[name]
    # causal with a ragged Skv compiles every branch: the unmasked loop, both masks and the division.
    cubin = export_cubin(variant, arch=arch, causal=True, even_n=False)
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize(("capability", "causal"), [((9, 0), False), ((9, 0), True), ((10, 0), False)])
def test_search_space_compiles(capability, causal):
    arch = f"sm_{capability[0]}{capability[1]}"
    for variant in search_space(capability):
        cubin = export_cubin(variant, arch=arch, dtype=torch.bfloat16, head_dim=64, causal=causal)
        assert cubin[:4] == b"\x7fELF"


def test_head_group_keeps_the_heads_in_flight_within_the_l2_budget():
    from impls.cutile import L2_BUDGET_BYTES, MAX_HEAD_GROUP

    auto = Variant(128, 128, head_group=None)
    for kv_len in (1, 300, 1024, 2048, 4096, 8192, 16384, 1 << 20):
        group = auto.heads_per_group(causal=True, kv_len=kv_len, head_dim=128, itemsize=2)
        assert group & (group - 1) == 0 and 1 <= group <= MAX_HEAD_GROUP  # a power of two
        kv_bytes = 2 * kv_len * 128 * 2
        assert group == 1 or group * kv_bytes <= L2_BUDGET_BYTES
        assert group == MAX_HEAD_GROUP or 2 * group * kv_bytes > L2_BUDGET_BYTES  # as many as fit
    assert auto.heads_per_group(causal=True, kv_len=2048, head_dim=128, itemsize=2) == 8
    assert auto.heads_per_group(causal=True, kv_len=16384, head_dim=128, itemsize=2) == 1
    # Only causal blocks that run heaviest-first are regrouped; a fixed group is taken as given.
    assert auto.heads_per_group(causal=False, kv_len=2048, head_dim=128, itemsize=2) == 1
    no_remap = Variant(128, 128, reverse_order=False, head_group=None)
    assert no_remap.heads_per_group(causal=True, kv_len=2048, head_dim=128, itemsize=2) == 1
    assert Variant(64, 64, head_group=4).heads_per_group(causal=True, kv_len=2048, head_dim=128, itemsize=2) == 4


def test_hints_reach_the_compiler():
    one = Variant(64, 64, occupancy=1)
    two = Variant(64, 64, occupancy=2)
    eight = Variant(128, 64, occupancy=1, num_worker_warps=8)
    assert one.kernel()._compiler_options.occupancy == 1
    assert two.kernel()._compiler_options.occupancy == 2
    assert eight.kernel()._compiler_options.num_worker_warps == 8
    # The kernel object the launcher uses compiles differently when only the hint differs.
    assert export_cubin(one, arch="sm_90") != export_cubin(two, arch="sm_90")
    assert export_cubin(Variant(128, 64, occupancy=1), arch="sm_90") != export_cubin(eight, arch="sm_90")


def test_tensors_past_2_31_elements_get_the_64_bit_indexed_kernel():
    import inspect

    import cuda.tile as ct

    from impls.cutile import needs_int64

    variant = Variant(64, 64, occupancy=2)
    wide = variant.kernel(int64=True)
    params = inspect.signature(wide._pyfunc).parameters
    assert all(params[name].annotation is ct.IndexedWithInt64 for name in ("Q", "K", "V", "Out"))
    assert wide._compiler_options.occupancy == 2  # the hints survive
    assert export_cubin(variant, arch="sm_90", int64=True)[:4] == b"\x7fELF"
    assert needs_int64(torch.empty(1).expand(2**31)) and not needs_int64(torch.empty(2**10))


def test_sm90_cubin_is_the_one_that_runs():
    # With the launcher's alignment facts the compiler moves K/V tiles with TMA (UTMALDG); the tuned 128x128
    # tile with eight worker warps does not spill. Without them the export silently fell back to ordinary
    # loads and its SASS described a kernel that never runs.
    from impls._sass import find_cuobjdump, sass_summary

    if not find_cuobjdump() and not os.environ.get("CI"):
        pytest.skip("needs cuobjdump (pip install nvidia-cuda-cuobjdump, or triton)")
    summary = sass_summary(export_cubin(Variant(128, 128, occupancy=1, num_worker_warps=8), arch="sm_90"))
    assert summary["utmaldg"] > 0 and summary["hgmma"] > 0
    assert summary["stack"] == 0
