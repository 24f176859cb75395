"""The state of the GPU a benchmark ran on, read through NVML (``nvidia-ml-py``): clocks, power limit,
temperature and throttle reasons, and (``--energy-ms``) the energy of its calls run back to back after the
timing. Recorded beside every GPU benchmark, so that a fleet comparison can say why one GPU is outside the pack,
and a comparison of kernels what each costs in joules under the power limit that sets its clocks. Without NVML
(not installed, no driver) it records nothing and says why.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
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


def _handle(nvml: Any, uuid: str) -> Any:
    return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


def _unavailable(exc: Exception) -> dict[str, str]:
    return {"unavailable": f"{type(exc).__name__}: {exc}"[:200]}


def gpu_state(uuid: str) -> dict[str, Any]:
    """NVML's reading of the GPU with this UUID (``torch.cuda.get_device_properties(...).uuid``)."""
    try:
        nvml = _nvml()
        handle = _handle(nvml, uuid)
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
        return _unavailable(exc)


@contextlib.contextmanager
def energy_during(uuid: str, sync: Callable[[], object] = lambda: None) -> Iterator[dict[str, Any]]:
    """NVML's energy counter (millijoules since the driver loaded) across the block, for the GPU with this UUID.

    Yields a dict that is filled when the block ends (after ``sync``, so that the GPU's queued work is inside):
    ``joules``, ``seconds`` (host clock around the block, idle gaps included) and their ratio ``avg_power_w``, and
    ``state``, the GPU's clocks and throttle reasons at that moment (``gpu_state``), before anything else runs.
    ``unavailable`` says why where NVML cannot tell.
    """
    reading: dict[str, Any] = {}
    try:
        nvml = _nvml()
        handle = _handle(nvml, uuid)
        start_mj, start_s = nvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter()
    except Exception as exc:
        reading.update(_unavailable(exc))
        yield reading
        return
    yield reading
    sync()
    try:
        joules = (nvml.nvmlDeviceGetTotalEnergyConsumption(handle) - start_mj) / 1e3
    except Exception as exc:
        reading.update(_unavailable(exc))
        return
    seconds = time.perf_counter() - start_s
    reading.update(joules=joules, seconds=seconds, avg_power_w=joules / seconds if seconds > 0 else None,
                   state=gpu_state(uuid))
