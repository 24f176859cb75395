"""When the GPU rests before a benchmark (``--rest-ms``): under a power cap the clocks a benchmark starts at depend on
what ran before it, and a pause gives every benchmark the same start. See docs/design.md#timing."""

from __future__ import annotations

import time

import torch

AUTO_REST_S = 1.0  # the pause of ``--rest-ms auto``
HEAVIER = 2.0  # ... taken after a benchmark whose calls ran at least this many times as long as the next one's


class RestPolicy:
    """When the GPU stays idle before a benchmark (``--rest-ms``): a fixed pause before every one, or (``auto``, the
    default) AUTO_REST_S only after a benchmark whose calls ran at least HEAVIER times as long. Under a power cap a
    light case timed right after a heavy one starts from the power state the heavy one left (H200: FlashInfer's 4 x
    4K cases read 0.93-0.98 of their time alone right after a 1 x 32K case). Decode steps, heavy or light, did not
    move either way, so a pause before every one would only cost time."""

    def __init__(self, fixed_s: float | None = None) -> None:
        self.fixed_s = fixed_s  # None: auto
        self.previous_call_s: float | None = None

    def before(self, call_s: float) -> float:
        """Seconds to rest before a benchmark whose one call took ``call_s``; remembered for the next benchmark."""
        previous, self.previous_call_s = self.previous_call_s, call_s
        if self.fixed_s is not None:
            return self.fixed_s
        return AUTO_REST_S if previous is not None and previous >= HEAVIER * call_s else 0.0


def rest(seconds: float, device: torch.device) -> float:
    """Leave the GPU idle for ``seconds`` once its queue has drained: under a power cap the clocks a benchmark starts
    at depend on what ran before it (one H100 run timed one kernel 12% apart on two cases, the first of its process and
    one right after a heavy case), and a pause gives every benchmark the same start. Returns the seconds rested."""
    if seconds <= 0:
        return 0.0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    time.sleep(seconds)
    return seconds
