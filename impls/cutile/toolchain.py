"""Which Tile IR bytecode cuda-tile writes for our kernels, and which ``tileiras`` compiles it.

cuda-tile 1.7.0 can write bytecode 13.1 to 13.5 but offers 13.5 only in its developer builds. ``tileiras`` 13.5
reads 13.5, and only with it may a block have 16 worker warps (four consumer warpgroups; 13.4 takes 4 or 8).
``FMHA_CUTILE_BYTECODE=13.5`` opts in: 13.5 joins the versions cuda-tile offers (it writes the newest one the
``tileiras`` it finds reads) and the Hopper search space gains its 16-warp candidates. Unset, nothing changes.

cuda-tile runs the ``tileiras`` pip installed (``nvidia-cuda-tileiras``, 13.4 with ``cuda-tile[tileiras]``) before any
on PATH. ``FMHA_TILEIRAS_HOME`` names a toolchain root of another release (``bin/tileiras``, ``bin/ptxas``,
``nvvm/lib64``, as ``scripts/stage_tileiras.sh`` packs 13.5) to run instead, so that a machine whose environment
has 13.4 compiles, exports and reads the SASS of the 16-warp candidates without a GPU.

cuda-tile keeps these choices in private names (``cuda.tile._compile``); they are read and set here only.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

BYTECODE_ENV = "FMHA_CUTILE_BYTECODE"
HOME_ENV = "FMHA_TILEIRAS_HOME"
SIXTEEN_WARPS = "13.5"  # the first bytecode (and tileiras) with 16 worker warps a block
# The first whose compile of a persistent block's ``while`` loop over work items from an atomic counter (the
# kernel's DYNAMIC form) is right under compute-sanitizer memcheck: 13.4's gave wrong rows under it (H200, causal bf16
# D=64; its sm_90 SASS waits on its pipeline's barriers 67 times where 13.5's waits 115: a race slowed warps expose).
DYNAMIC_SCHEDULER = "13.5"


def requested() -> str | None:
    """The bytecode version ``FMHA_CUTILE_BYTECODE`` asks for, or None."""
    return os.environ.get(BYTECODE_ENV) or None


@functools.cache
def use_home() -> str | None:
    """Have cuda-tile run the toolchain ``FMHA_TILEIRAS_HOME`` names (its ``bin/`` first on PATH, CUDA_HOME there,
    pip's ``tileiras`` passed over); its ``tileiras``, or None where the variable is unset. A root without
    ``bin/tileiras`` is an error naming it."""
    home = os.environ.get(HOME_ENV)
    if not home:
        return None
    tileiras = Path(home, "bin", "tileiras")
    if not tileiras.is_file():
        raise FileNotFoundError(f"{HOME_ENV}={home}: no bin/tileiras there (a toolchain root: bin/, nvvm/lib64/)")
    from cuda.tile import _compile

    _compile._find_pip_tileiras = lambda: None  # cuda-tile then searches PATH, then CUDA_HOME
    for found in (_compile._find_compiler_bin, _compile._get_compiler_version_string):
        found.cache_clear()  # what it found before, if it looked
    os.environ["PATH"] = os.pathsep.join([str(tileiras.parent), os.environ.get("PATH", "")])
    os.environ["CUDA_HOME"] = home
    return str(tileiras)


@functools.cache
def enable() -> str | None:
    """Offer the requested bytecode version to cuda-tile (before its first compile, which caches the newest
    version ``tileiras`` reads); the version, or None when none is requested. An unknown version, or a
    ``tileiras`` that cannot read it, is an error that names both. The toolchain of ``FMHA_TILEIRAS_HOME``, where
    set, is taken first (``use_home``)."""
    use_home()
    wanted = requested()
    if wanted is None:
        return None
    from cuda.tile import _compile
    from cuda.tile._bytecode import BytecodeVersion

    known = {version.as_string(): version for version in BytecodeVersion}
    if wanted not in known:
        raise ValueError(f"{BYTECODE_ENV}={wanted}: cuda-tile writes bytecode {', '.join(known)}")
    if known[wanted] not in _compile._SUPPORTED_VERSIONS:
        _compile._SUPPORTED_VERSIONS.append(known[wanted])
    reads = newest_readable()
    if _as_tuple(reads) < _as_tuple(wanted):
        raise RuntimeError(f"{BYTECODE_ENV}={wanted}, but {compiler()} reads bytecode up to {reads}")
    return wanted


def newest_readable() -> str:
    """The newest bytecode version cuda-tile offers that the ``tileiras`` it finds reads (its own probe)."""
    from cuda.tile import _compile
    from cuda.tile._cext import default_tile_context, dev_features_enabled

    return _compile._get_max_supported_bytecode_version(default_tile_context.config.temp_dir,
                                                        allow_dev=dev_features_enabled()).as_string()


@functools.cache
def compiler() -> str:
    """The ``tileiras`` cuda-tile runs and its release, e.g. ``tileiras 13.5.37 (/tmp/ctk/bin/tileiras)``."""
    use_home()
    from cuda.tile import _compile

    path = _compile._find_compiler_bin().path
    release = re.search(r"V(\d+\.\d+\.\d+)", _compile._try_get_compiler_version(path) or "")
    return f"tileiras {release.group(1) if release else '(version unknown)'} ({path})"


def reads_at_least(version: str) -> bool:
    """Whether bytecode ``version`` or newer is requested and read (so compiled by that ``tileiras`` or newer)."""
    wanted = enable()
    return wanted is not None and _as_tuple(wanted) >= _as_tuple(version)


def sixteen_warps() -> bool:
    """Whether blocks of 16 worker warps compile here: bytecode 13.5 requested and read."""
    return reads_at_least(SIXTEEN_WARPS)


def dynamic_scheduler() -> bool:
    """Whether the dynamically scheduled persistent form compiles race-free here (``DYNAMIC_SCHEDULER``)."""
    return reads_at_least(DYNAMIC_SCHEDULER)


def describe() -> dict[str, str]:
    """What a benchmark's config records of the toolchain."""
    return {"tileiras": compiler().split(" (")[0], "bytecode": enable() or newest_readable()}


def _as_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))
