"""One GPU per pytest-xdist worker: the worker ``gwN`` sees only the N-th visible GPU (modulo their number).

It must run before CUDA initialises in the worker, so the root ``conftest.py`` calls it before anything asks
torch about devices; this module imports nothing that touches CUDA. With ``-n`` equal to the number of GPUs,
every GPU runs one worker, and each worker (alone on its GPU, ``FMHA_GPU_EXCLUSIVE=1``) times its benchmarks;
with more workers than GPUs they share round-robin (``FMHA_GPU_SHARED=1``): pytest-benchmark stays off and our
tuners time nothing (``impls/tuning.py``). ``FMHA_NO_PIN=1`` leaves ``CUDA_VISIBLE_DEVICES`` alone (every worker
then on the first visible GPU).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import MutableMapping


def visible_gpus(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` if set, else nvidia-smi's indices, else none."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def pin_worker_to_gpu(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Restrict an xdist worker to one GPU; returns that GPU's id, or None (not a worker, no GPU, opted out)."""
    worker = environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return None
    gpus = visible_gpus(environ)
    if not gpus:
        return None
    pinned = environ.get("FMHA_NO_PIN") != "1"
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    # alone on its GPU, a worker's timings can be trusted; beside others, they time the others' load too
    environ["FMHA_GPU_EXCLUSIVE" if workers <= (len(gpus) if pinned else 1) else "FMHA_GPU_SHARED"] = "1"
    if not pinned:
        return None
    gpu = gpus[int(worker.removeprefix("gw")) % len(gpus)]
    environ["CUDA_VISIBLE_DEVICES"] = gpu
    return gpu


def worker_may_time(environ: MutableMapping[str, str] = os.environ) -> bool:
    """pytest-benchmark disables itself in xdist workers, since workers sharing a device disturb each other's
    timings. A worker alone on its GPU may time; ``FMHA_XDIST_BENCHMARKS=1`` allows it anyway (CPU tests of
    the merge, where the numbers do not matter)."""
    return bool(environ.get("PYTEST_XDIST_WORKER")) and (
        environ.get("FMHA_GPU_EXCLUSIVE") == "1" or environ.get("FMHA_XDIST_BENCHMARKS") == "1")
