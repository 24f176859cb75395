"""How a GPU's clocks move under sustained attention work, and how long they take to settle (GPU).

For each implementation on one dense case: rest (idle) for ``--rest`` seconds, then replay a CUDA graph of
calls back to back in rounds of about ``--round-ms`` for ``--seconds``, one round at a time; after each round print its
time per call (CUDA events) and NVML's SM clock, power and throttle reasons. The suite's benchmark of a case
is a few hundred milliseconds of such rounds: if the clocks are still falling then, its median depends on how
long the GPU rested before (which implementation ran before, how long the compile took).

    python scripts/clock_probe.py --case llama3-8b-bf16-causal-h32:8-s4096x4096-d128-b4 --impl cutile
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import impls
from impls.timing import GraphTarget, graph_repeats, iterations_for, time_once
from suite import metrics
from suite.cases import case_by_id
from suite.telemetry import gpu_state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", required=True)
    p.add_argument("--impl", action="append", required=True)
    p.add_argument("--rest", type=float, default=3.0, help="idle seconds before each implementation's rounds")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds of rounds per implementation")
    p.add_argument("--round-ms", type=float, default=10.0)
    a = p.parse_args()
    case = case_by_id(a.case)
    q, k, v = case.make_inputs("cuda")
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    for name in a.impl:
        run = impls.get(name).prepare(q, k, v, causal=case.causal, **case.variants)
        per_call = time_once(run, q.device)
        graph = GraphTarget([run], graph_repeats(per_call, 1))  # a replay of about a millisecond
        rounds = iterations_for(time_once(graph, q.device), a.round_ms / 1e3)
        torch.cuda.synchronize()
        time.sleep(a.rest)
        start = time.perf_counter()
        while time.perf_counter() - start < a.seconds:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(rounds):
                graph()
            end.record()
            end.synchronize()
            ms = begin.elapsed_time(end) / (rounds * graph.calls_per_replay)
            state = gpu_state(uuid)
            print(json.dumps({"impl": name, "t_s": round(time.perf_counter() - start, 3), "ms_per_call": ms,
                              "tflops": metrics.flops(case) / ms / 1e9, **state}), flush=True)


if __name__ == "__main__":
    main()
