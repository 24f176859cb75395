"""What a compiled kernel is made of, read from its cubin with ``cuobjdump``: no GPU needed.

Used by ``scripts/cutile_sass.py`` (cuTile) and ``impls/triton_fa/aot.py`` (Triton) to find spills and to check
that the matrix work runs on Hopper's warpgroup MMA (HGMMA) and the loads on its copy engine (UTMALDG).
"""

from __future__ import annotations

import re
import subprocess
import tempfile

COUNTED = {"hgmma": "HGMMA", "hmma": " HMMA", "utmaldg": "UTMALDG", "ldl": "LDL", "stl": "STL"}


def sass_summary(cubin: bytes, cuobjdump: str = "cuobjdump") -> dict[str, int]:
    """Registers, stack and shared bytes per thread/block, and counts of the instructions in ``COUNTED``
    (LDL/STL are local-memory loads and stores: spills)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    usage = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", res)}
    return {**usage, **{name: sass.count(op) for name, op in COUNTED.items()}}
