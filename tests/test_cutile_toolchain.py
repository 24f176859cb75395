"""The Tile IR bytecode our cuTile kernels are compiled as (``impls/cutile/toolchain.py``) and what it opens.

``FMHA_CUTILE_BYTECODE=13.5`` offers cuda-tile's 13.5 writer to a ``tileiras`` 13.5, which allows 16 worker warps a
block. CI has the ``tileiras`` cuda-tile 1.7 installs (13.4): there the request is refused with a message naming
the compiler; with a 13.5 ``tileiras`` (``FMHA_TILEIRAS_HOME``) the 16-warp candidates compile without spilling.
"""

import functools
import os
import re

import pytest

if os.environ.get("CI"):
    import cuda.tile  # noqa: F401 - in CI a missing cuTile fails, never skips
else:
    pytest.importorskip("cuda.tile", reason='cuTile not installed: pip install "cuda-tile[tileiras]"')

from cuda.tile import _compile

from impls.cutile import toolchain
from impls.cutile.launch import requires
from impls.cutile.spaces import hopper_space, other_forms, search_space, sixteen_warp_space


@pytest.fixture
def bytecode(monkeypatch):
    """Set FMHA_CUTILE_BYTECODE for one test; cuda-tile's list of versions and our caches are restored after."""
    offered = list(_compile._SUPPORTED_VERSIONS)
    newest = _compile._get_max_supported_bytecode_version

    def request(version: str | None) -> None:
        if version is None:
            monkeypatch.delenv(toolchain.BYTECODE_ENV, raising=False)
        else:
            monkeypatch.setenv(toolchain.BYTECODE_ENV, version)
        toolchain.enable.cache_clear()
        newest.cache_clear()

    yield request
    _compile._SUPPORTED_VERSIONS[:] = offered
    toolchain.enable.cache_clear()
    newest.cache_clear()


@pytest.fixture
def home(monkeypatch):
    """Set FMHA_TILEIRAS_HOME for one test; cuda-tile's compiler search, PATH, CUDA_HOME and our caches are
    restored after."""
    monkeypatch.setattr(_compile, "_find_pip_tileiras", _compile._find_pip_tileiras)  # undone after the test
    saved = {name: os.environ.get(name) for name in ("PATH", "CUDA_HOME")}
    caches = (toolchain.use_home, toolchain.enable, toolchain.compiler, _compile._find_compiler_bin,
              _compile._get_compiler_version_string, _compile._get_max_supported_bytecode_version)

    def choose(root) -> None:
        monkeypatch.setenv(toolchain.HOME_ENV, str(root))
        for cache in caches:
            cache.cache_clear()

    yield choose
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    for cache in caches:
        cache.cache_clear()


def test_a_toolchain_home_runs_its_tileiras_before_pips(home, tmp_path):
    # the way to a 13.5 tileiras where pip installed 13.4 (CI's): a root as stage_tileiras.sh packs one
    tileiras = tmp_path / "bin" / "tileiras"
    tileiras.parent.mkdir()
    tileiras.write_text("#!/bin/sh\necho 'tileiras: Cuda compilation tools, release 13.9, V13.9.1'\n")
    tileiras.chmod(0o755)
    home(tmp_path)
    assert toolchain.use_home() == str(tileiras)
    assert toolchain.compiler() == f"tileiras 13.9.1 ({tileiras})"
    assert os.environ["CUDA_HOME"] == str(tmp_path) and os.environ["PATH"].startswith(str(tileiras.parent))


def test_a_toolchain_home_without_tileiras_is_a_reason(home, tmp_path):
    home(tmp_path)
    assert requires("cuda") == f"FMHA_TILEIRAS_HOME={tmp_path}: no bin/tileiras there (a toolchain root: bin/, " \
                               "nvvm/lib64/)"


def tileiras_release() -> tuple[int, int]:
    major, minor = re.search(r"tileiras (\d+)\.(\d+)", toolchain.compiler()).groups()
    return int(major), int(minor)


def test_nothing_changes_unless_asked(bytecode):
    bytecode(None)
    assert toolchain.enable() is None and not toolchain.sixteen_warps() and requires("cuda") is None
    assert all((v.num_worker_warps or 0) <= 8 for head_dim in (64, 128) for v in hopper_space(head_dim, False))
    assert toolchain.describe()["bytecode"] == toolchain.newest_readable()
    assert toolchain.describe()["tileiras"].startswith("tileiras 13.")


def test_an_unknown_bytecode_version_names_the_ones_cuda_tile_writes(bytecode):
    bytecode("12.9")
    with pytest.raises(ValueError, match=r"FMHA_CUTILE_BYTECODE=12\.9: cuda-tile writes bytecode 13\.1, .*13\.5"):
        toolchain.enable()
    assert requires("cuda").startswith("FMHA_CUTILE_BYTECODE=12.9")


def test_a_missing_tileiras_is_a_reason_not_a_failure(bytecode, monkeypatch):
    # cuda-tile imports without its compiler, then fails each compile: the implementations must say so up front
    def not_found():
        raise FileNotFoundError("'tileiras' compiler not found, make sure it is available")

    bytecode(None)
    toolchain.compiler.cache_clear()
    monkeypatch.setattr(_compile, "_find_compiler_bin", not_found)
    try:
        assert requires("cuda") == "'tileiras' compiler not found, make sure it is available"
    finally:
        toolchain.compiler.cache_clear()


def test_bytecode_13_5_needs_tileiras_13_5(bytecode):
    bytecode("13.5")
    if tileiras_release() < (13, 5):
        with pytest.raises(RuntimeError, match=r"FMHA_CUTILE_BYTECODE=13\.5, but tileiras 13\.4.* reads bytecode up "
                                               r"to 13\.4"):
            toolchain.enable()
        assert "reads bytecode up to 13.4" in requires("cuda")  # the implementations say why they cannot run
        return
    assert toolchain.enable() == "13.5" and toolchain.sixteen_warps()
    assert toolchain.describe() == {"tileiras": toolchain.compiler().split(" (")[0], "bytecode": "13.5"}
    sixteen = [v for v in hopper_space(64, False) if v.num_worker_warps == 16]
    assert sixteen == sixteen_warp_space(64, False) and sixteen


def test_sixteen_warps_run_head_dims_whose_first_tile_is_64_at_most():
    # at D=128 every 16-warp shape that does not spill ran at 0.3-0.8 of the 8-warp candidates; D=96
    # runs as 64 + 32 and wins there; 112 and 192 run 128 wide first
    for head_dim in (112, 128, 192, 256):
        assert sixteen_warp_space(head_dim, True) == [] == sixteen_warp_space(head_dim, False)
    for head_dim in (32, 64, 72, 80, 96):
        assert [v.tile_m for v in sixteen_warp_space(head_dim, False)] == [256, 256]
        # causal: one block a tile, and persistent only with the paired share
        assert [(v.persistent, v.paired) for v in sixteen_warp_space(head_dim, True)] == [(False, False), (True, True)]


def test_a_readable_request_is_offered_and_opens_the_sixteen_warp_space(bytecode, monkeypatch):
    # the branch a 13.5 tileiras takes, here without one: cuda-tile's probe answers 13.5
    from cuda.tile._bytecode import BytecodeVersion

    bytecode("13.5")
    monkeypatch.setattr(_compile, "_get_max_supported_bytecode_version",
                        lambda *args, **kwargs: BytecodeVersion.V_13_5)
    assert toolchain.enable() == "13.5" and BytecodeVersion.V_13_5 in _compile._SUPPORTED_VERSIONS
    assert toolchain.sixteen_warps() and requires("cuda") is None and toolchain.describe()["bytecode"] == "13.5"
    for head_dim in (64, 96):
        assert hopper_space(head_dim, False)[-2:] == sixteen_warp_space(head_dim, False)
        causal = [v for v in search_space((9, 0), head_dim, causal=True) if not v.planned]  # less the planned twins
        assert causal[-2:] == sixteen_warp_space(head_dim, True)
    assert all(v.num_worker_warps != 16 for v in hopper_space(128, False))
    assert all(v.num_worker_warps != 16 for v in search_space((10, 0), 64, causal=False))  # Hopper's only


@pytest.mark.parametrize("head_dim", [32, 40, 64, 80, 96])
@pytest.mark.parametrize("causal", [False, True])
def test_sixteen_warp_candidates_compile_without_spilling(bytecode, head_dim, causal):
    from impls.cutile.export import export_phases
    from impls.sass import sass_summary

    bytecode("13.5")
    if tileiras_release() < (13, 5):
        pytest.skip(f"needs tileiras 13.5 (FMHA_TILEIRAS_HOME), found {toolchain.compiler()}")
    toolchain.enable()  # the kernel objects are made once per process, the first time with this call in them
    space = sixteen_warp_space(head_dim, causal)
    assert space
    for variant in space:
        for _, cubin in export_phases(variant, arch="sm_90", head_dim=head_dim, causal=causal):
            usage = sass_summary(cubin)
            assert usage["stack"] == 0 and usage["hgmma"] > 0 and usage["utmaldg"] > 0, (variant.label(), usage)


def test_the_dynamic_scheduler_is_offered_with_bytecode_13_5_only(bytecode, monkeypatch):
    # 13.4 compiles its work-item loop with a race that memcheck's slowed warps expose (toolchain.DYNAMIC_SCHEDULER)
    bytecode(None)
    forms = other_forms()
    assert not toolchain.dynamic_scheduler() and not any(v.dynamic for v in forms)
    assert [v.two_launch for v in forms] == [True]  # the kernel's other form stays
    # as a 13.5 tileiras reads it, wherever CI runs (cached, as the fixture's teardown clears it)
    monkeypatch.setattr(toolchain, "enable", functools.cache(lambda: "13.5"))
    assert toolchain.dynamic_scheduler()
    assert [(v.dynamic, v.k_latency) for v in other_forms()] == [(True, 3), (True, 2), (False, 3)]
