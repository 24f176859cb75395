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

from impls.cutile import LADDER, Variant, search_space, tile_d
from impls.cutile.export import export_cubin, export_phases

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
    for variant in search_space(capability, 64, causal=causal):
        for _, cubin in export_phases(variant, arch=arch, dtype=torch.bfloat16, head_dim=64, causal=causal):
            assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_dim", [32, 80, 96, 192, 256])
def test_new_head_dims_compile(head_dim, arch):
    # A head dim that is not a power of two runs in the next one (zero-padded loads, clipped stores); the
    # first candidate of each architecture's space for that width, causal and ragged, compiles.
    capability = (int(arch[3:-1]), int(arch[-1]))
    variant = search_space(capability, head_dim, causal=True)[0]
    cubin = export_cubin(variant, arch=arch, dtype=torch.bfloat16, head_dim=head_dim, causal=True, even_n=False)
    assert cubin[:4] == b"\x7fELF"


def test_head_dims_pad_to_the_next_power_of_two():
    assert [tile_d(d) for d in (16, 32, 40, 64, 80, 96, 128, 136, 192, 256)] == [
        16, 32, 64, 64, 128, 128, 128, 256, 256, 256]


def test_two_launch_variants_pass_the_softmax_state_between_launches():
    # Causal Hopper candidates that stream persistently take their items from a counter, some as the
    # mask-free half of two launches; the first launch is one block per query tile in plain order, and both
    # share a float32 state workspace.
    space = search_space((9, 0), 128, causal=True)
    split = [v for v in space if v.two_launch]
    assert split and all(v.persistent for v in split)
    assert all(v.dynamic for v in space if v.persistent)
    assert not any(v.two_launch for v in search_space((9, 0), 128, causal=False))
    diagonal = split[0].diagonal()
    assert not diagonal.persistent and not diagonal.reverse_order
    q = torch.empty((2, 4, 300, 96), device="meta", dtype=torch.float16)
    m, s, acc, counter = split[0].state(q)
    assert m.shape == s.shape == (2, 4, 300) and acc.shape == (2, 4, 300, 128)
    assert {t.dtype for t in (m, s, acc)} == {torch.float32}
    assert counter.shape == (1,) and counter.dtype == torch.int32
    assert all(t.numel() == 1 for t in Variant(64, 64).state(q))  # one launch: placeholders only


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


def test_sm90_mask_free_launch_gets_a_deeper_pipeline():
    # The point of two launches: the causal persistent kernel with its mask in the loop body gets a shallow
    # K/V pipeline; the mask-free second launch a deeper one (sm_90 shared memory: 100 KB against 167 KB).
    from impls._sass import find_cuobjdump, sass_summary

    if not find_cuobjdump() and not os.environ.get("CI"):
        pytest.skip("needs cuobjdump (pip install nvidia-cuda-cuobjdump, or triton)")
    split = next(v for v in search_space((9, 0), 128, causal=True) if v.two_launch)
    one_launch = Variant(**{**split.describe(), "two_launch": False})
    (_, diagonal), (_, mask_free) = export_phases(split, arch="sm_90")
    shallow = sass_summary(export_cubin(one_launch, arch="sm_90"))
    deep = sass_summary(mask_free)
    assert deep["shared"] > 1.5 * shallow["shared"]
    assert deep["stack"] == 0 and sass_summary(diagonal)["stack"] == 0


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
