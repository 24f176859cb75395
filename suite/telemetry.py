"""The state of the GPU a benchmark ran on, read through NVML (``nvidia-ml-py``): clocks, power limit,
temperature and throttle reasons. Recorded beside every GPU benchmark, so that a fleet comparison can say why
one GPU is outside the pack. Without NVML (not installed, no driver) it records nothing and says why.
"""

from __future__ import annotations

import functools
from typing import Any

# NVML's clocks-event (throttle) reason bits, by the names nvidia-smi prints.
THROTTLE_REASONS = {
    0x1: "gpu idle", 0x2: "applications clocks setting", 0x4: "sw power cap", 0x8: "hw slowdown",
    0x20: "sw thermal slowdown", 0x40: "hw thermal slowdown", 0x80: "hw power brake slowdown",
}


@functools.cache
def _nvml():
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def gpu_state(uuid: str) -> dict[str, Any]:
    """NVML's reading of the GPU with this UUID (``torch.cuda.get_device_properties(...).uuid``)."""
    try:
        nvml = _nvml()
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
        return {
            "sm_clock_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            "mem_clock_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM),
            "power_limit_w": nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000,
            "power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
            "temperature_c": nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
            "throttle": [name for bit, name in THROTTLE_REASONS.items() if reasons & bit],
        }
    except Exception as exc:  # NVML missing or refusing: the benchmark stands, the telemetry says why
        return {"unavailable": f"{type(exc).__name__}: {exc}"[:200]}
