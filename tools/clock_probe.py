"""How a GPU's clocks move under sustained attention work, and how long they take to settle (GPU).

For each implementation on one dense case: rest (idle) for ``--rest`` seconds, then replay a CUDA graph of calls
back to back in rounds of about ``--round-ms``, for ``--seconds``; after each round print its time per call (CUDA
events) with NVML's SM clock, power and throttle reasons, a JSON line each. A benchmark is a few hundred
milliseconds of such rounds: if the clocks are still falling then, its median depends on how long the GPU rested
before it. This is what ``--settle-ms`` and ``--rest-ms`` of the suite are sized by: see docs/design.md#timing.
"""

from __future__ import annotations

import argparse
import json
import time

EPILOG = """example:
  python -m tools.clock_probe --case llama3-8b-bf16-causal-h32:8-s4096x4096-d128-b4 --impl cutile --impl sdpa-cudnn
"""


def probe(case_id: str, names: list[str], rest: float, seconds: float, round_ms: float) -> None:
    """The rounds of each implementation in turn, each after ``rest`` idle seconds."""
    import torch

    import impls
    from impls.timing import GraphTarget, graph_repeats, iterations_for, time_once
    from suite import metrics
    from suite.presets import case_by_id
    from suite.telemetry import gpu_state

    case = case_by_id(case_id)
    q, k, v = case.make_inputs("cuda")
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    for name in names:
        run = impls.get(name).prepare(q, k, v, causal=case.causal, **case.variants)
        graph = GraphTarget([run], graph_repeats(time_once(run, q.device), 1))  # a replay of about a millisecond
        rounds = iterations_for(time_once(graph, q.device), round_ms / 1e3)
        torch.cuda.synchronize()
        time.sleep(rest)
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(rounds):
                graph()
            end.record()
            end.synchronize()
            ms = begin.elapsed_time(end) / (rounds * graph.calls_per_replay)
            print(json.dumps({"impl": name, "t_s": round(time.perf_counter() - start, 3), "ms_per_call": ms,
                              "tflops": metrics.flops(case) / ms / 1e9, **gpu_state(uuid)}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.clock_probe", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", required=True, help="a dense case id of any preset")
    parser.add_argument("--impl", action="append", required=True, help="an implementation (repeatable)")
    parser.add_argument("--rest", type=float, default=3.0, help="idle seconds before each implementation's rounds")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds of rounds per implementation")
    parser.add_argument("--round-ms", type=float, default=10.0, help="the length of one round (default 10 ms)")
    args = parser.parse_args(argv)
    probe(args.case, args.impl, args.rest, args.seconds, args.round_ms)


if __name__ == "__main__":
    main()
