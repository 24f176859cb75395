"""What a compiled kernel is made of, read from its cubin with ``cuobjdump``: no GPU needed.

Used by ``scripts/cutile_sass.py`` (cuTile) and ``impls/triton_fa/aot.py`` (Triton) to find spills and to check
that the matrix work runs on Hopper's warpgroup MMA (HGMMA) and the loads on its copy engine (UTMALDG).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

COUNTED = {"hgmma": "HGMMA", "hmma": " HMMA", "utmaldg": "UTMALDG", "utmastg": "UTMASTG", "ldl": "LDL", "stl": "STL",
           "utmaldg_3d": "UTMALDG.3D",  # TMA loads of 3-D arrays (cuTile: the two-launch form's state vectors)
           "mufu_tanh": "MUFU.TANH", "mufu_ex2": "MUFU.EX2",
           "atomg": "ATOMG",  # a tensor map made at run time is written to global memory with ATOMG.E.EXCH
           "lds_u8": "LDS.U8", "ldsm_t": "LDSM.16.MT88",  # byte loads from shared memory; transposing 16-bit ones
           "acqbulk": "ACQBULK", "preexit": "PREEXIT"}  # PDL: wait for the grid before, let the next one launch


def find_cuobjdump() -> str | None:
    """``cuobjdump`` from PATH, else the copy Triton ships with its NVIDIA backend."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def sass_text(cubin: bytes, cuobjdump: str | None = None, *, option: str = "-sass") -> str:
    """``cuobjdump OPTION`` of a cubin (default: its SASS)."""
    cuobjdump = cuobjdump or find_cuobjdump()
    if cuobjdump is None:
        raise FileNotFoundError("cuobjdump not found: pip install nvidia-cuda-cuobjdump (or triton, which ships it)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, option, f.name], capture_output=True, text=True, check=True).stdout


def hgmma_runs(cubin: bytes, cuobjdump: str | None = None) -> list[int]:
    """How many warpgroup MMAs (HGMMA) the kernel issues between consecutive waits for them to finish
    (``WARPGROUP.DEPBAR``), in program order: each wait drains the tensor cores, so a matrix product issued as
    two runs with a wait between costs one drain more than as one run."""
    runs, count = [], 0
    for line in sass_text(cubin, cuobjdump).splitlines():
        if "HGMMA" in line:
            count += 1
        elif "WARPGROUP.DEPBAR" in line and count:
            runs.append(count)
            count = 0
    return runs


def softmax_overlap(cubin: bytes, cuobjdump: str | None = None) -> int:
    """How many warpgroup MMAs (HGMMA) are issued between two of the softmax's exponentials (``MUFU.EX2``) with no
    wait for the tensor cores (``WARPGROUP.DEPBAR``) between them: products that run while the softmax does
    (FlashAttention-3's intra-warpgroup overlap, ``kernel.free_tiles_deferred``). 0 where every product waits for
    the softmax before it or is waited for before the softmax goes on."""
    overlapped, pending, seen_exp = 0, 0, False
    for line in sass_text(cubin, cuobjdump).splitlines():
        if "WARPGROUP.DEPBAR" in line:
            pending, seen_exp = 0, False
        elif "MUFU.EX2" in line:
            overlapped, pending, seen_exp = overlapped + pending, 0, True
        elif "HGMMA" in line and seen_exp:
            pending += 1
    return overlapped


def products_beside_softmax(cubin: bytes, cuobjdump: str | None = None) -> int:
    """How many warpgroup MMAs (HGMMA) are followed by a softmax exponential (``MUFU.EX2``) before the next wait for
    the tensor cores (``WARPGROUP.DEPBAR``), in program order: products that run while the softmax after them does
    (a P @ V issued before the next tile's softmax, the Triton kernel's OVERLAP_PV). 0 where every product is
    waited for before any exponential follows it."""
    overlapped, pending = 0, 0
    for line in sass_text(cubin, cuobjdump).splitlines():
        if "WARPGROUP.DEPBAR" in line:
            pending = 0
        elif "HGMMA" in line:
            pending += 1
        elif "MUFU.EX2" in line:
            overlapped, pending = overlapped + pending, 0
    return overlapped


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*)")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def loop_spills(sass: str) -> int:
    """Local-memory loads and stores (LDL/STL) inside a loop: between a backward branch's target and the branch.
    A value parked in local memory before a loop and read back after it costs two accesses a program; one
    spilled inside the loop costs them on every iteration."""
    instructions = [(int(m[1], 16), m[2]) for m in map(_INSTRUCTION.search, sass.splitlines()) if m]
    loops = [(int(b[1], 16), address) for address, text in instructions
             if (b := _BRANCH.search(text)) and int(b[1], 16) < address]
    return sum(1 for address, text in instructions if re.search(r"\b(LDL|STL)\b", text)
               and any(start <= address <= end for start, end in loops))


def sass_summary(cubin: bytes, cuobjdump: str | None = None) -> dict[str, int]:
    """Registers, stack and shared bytes per thread/block, counts of the instructions in ``COUNTED``
    (LDL/STL are local-memory loads and stores: spills), and how many of those are inside a loop
    (``loop_spills``)."""
    res, sass = (sass_text(cubin, cuobjdump, option=option) for option in ("-res-usage", "-sass"))
    usage = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", res)}
    return {**usage, **{name: sass.count(op) for name, op in COUNTED.items()}, "loop_spills": loop_spills(sass)}
