"""The machine a run measured on, as the results file's ``machine_info.fmha`` block records it."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from typing import Any

import torch

from suite.metrics import device_peak_tflops


def version(dist: str) -> str | None:
    """The installed version of a distribution, None where it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and, on a GPU, the device's identity: what a reader needs to place the numbers."""
    info: dict[str, Any] = {
        "device": device.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "triton": version("triton"),
        "cuda-tile": version("cuda-tile"),
        "flash-attn": version("flash-attn") or version("flash-attn-4") or version("flash_attn_3"),
    }
    peak, source = device_peak_tflops(device)
    info.update(peak_tflops=peak, peak_source=source)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
            driver=_nvidia_smi("driver_version"),
            sm_clock_max_mhz=_nvidia_smi("clocks.max.sm"),
            mem_clock_max_mhz=_nvidia_smi("clocks.max.mem"),
        )
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def _nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None
