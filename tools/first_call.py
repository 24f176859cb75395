"""Time to a first answer, and what a pick without a tune costs: our kernels on shapes of any size, from cold.

For each implementation and case, a fresh process with an empty tuning cache (``FMHA_TUNING_CACHE`` in a new
temporary folder, default ``FMHA_TUNING=on``: this machine's tune, else the GPU's shipped table, else the nearest
shipped class, else a fixed config) makes the case's inputs, then times ``prepare`` plus the first call to its
synchronised end: what a serving engine or training job waits for on a shape it did not announce. It checks the
answer against the float64 oracle and records how the config was chosen (``chosen``) and its graph time.

``--against-tune`` then prepares the same shape with ``FMHA_TUNING=retune`` in the same process and times both
picks alternately (``--rounds`` medians of graph time): the pick's time over the tuned pick's time, above 1 where
the tune found faster. ``--grid`` takes a preset's cases; ``--case FIELD=VALUE,...`` builds one from
``suite.cases.Case``'s fields; without either, the shapes no preset has that docs/results.md's first-call table
lists. One JSON line per row, printed and appended to ``--out``. See docs/design.md#tuning.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Shapes no preset has: an odd head count and length, a head dim with a tail tile, decode over one-token pages and
# over a long-tailed batch, a packed batch.
DEFAULT_CASES = (
    "batch=3,hq=20,hkv=5,sq=1500,skv=1500,d=128,dtype=bf16,causal=1",
    "batch=2,hq=24,hkv=24,sq=3000,skv=3000,d=64,dtype=fp16,causal=0",
    "batch=5,hq=16,hkv=4,sq=700,skv=2100,d=96,dtype=bf16,causal=1",
    "op=paged,batch=3,hq=32,hkv=8,sq=1,skv=5000,d=128,dtype=bf16,causal=1,page_size=1,lengths=longtail",
    "op=paged,batch=24,hq=32,hkv=8,sq=1,skv=12000,d=128,dtype=bf16,causal=1,page_size=16,lengths=longtail",
    "op=varlen,batch=6,hq=28,hkv=4,sq=9000,skv=9000,d=128,dtype=bf16,causal=1,lengths=random",
)

EPILOG = """examples:
  python -m tools.first_call --impl triton --impl cutile --out first-call.jsonl
  python -m tools.first_call --impl triton --grid blog --against-tune --out blog-picks.jsonl
  python -m tools.first_call --impl cutile --case op=paged,batch=3,hq=32,hkv=8,sq=1,skv=5000,d=128,causal=1,page_size=1
"""


def parse_case(text: str):
    """A ``Case`` from ``FIELD=VALUE,...`` (booleans as 0/1; ``window=L:R``)."""
    from suite.cases import Case

    fields = {f.name: f for f in dataclasses.fields(Case)}
    values: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise argparse.ArgumentTypeError(f"{item!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}")
        default = fields[name].default
        kind = int if default is dataclasses.MISSING else type(default)  # the fields without a default are sizes
        if name == "window":
            values[name] = tuple(int(x) for x in value.split(":"))
        elif kind is bool:
            values[name] = value not in ("0", "false", "False", "")
        else:
            values[name] = kind(value)
    try:
        return Case(**values)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def graph_time_ms(prepared) -> float:
    from impls.timing import graph_ms

    return graph_ms(prepared.run)


def measure(impl_name: str, case, against_tune: bool, rounds: int) -> dict[str, Any]:
    """One row, in this process (``main`` runs each in a fresh one)."""
    import torch

    import impls
    from suite.problem import Problem

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    impl = impls.get(impl_name, case.op)
    row: dict[str, Any] = {"impl": impl_name, "case": case.id}
    reason = impl.availability(device.type)
    if reason:
        return {**row, "status": "unavailable", "message": reason}
    problem = Problem(case, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    prepared = problem.prepare(impl)
    out = prepared()
    if device.type == "cuda":
        torch.cuda.synchronize()
    row["first_call_s"] = round(time.perf_counter() - start, 3)
    row["chosen"] = prepared.config.get("chosen", "")
    row["config"] = {k: v for k, v in prepared.config.items() if k != "chosen"}
    result = problem.check(out)
    row["correct"] = result.passed
    if not result.passed:
        return {**row, "status": "wrong", "message": result.message}
    if device.type != "cuda":
        return {**row, "status": "ok", "message": "no GPU: not timed"}
    row["graph_us"] = round(graph_time_ms(prepared) * 1e3, 2)
    if against_tune:
        os.environ["FMHA_TUNING"] = "retune"
        tuned = problem.prepare(impl)
        row["tuned_chosen"] = tuned.config.get("chosen", "")
        row["tuned_config"] = {k: v for k, v in tuned.config.items() if k != "chosen"}  # what the tune found
        ratios = [graph_time_ms(prepared) / graph_time_ms(tuned) for _ in range(rounds)]
        row["pick_over_tuned"] = round(statistics.median(ratios), 4)
        row["pick_over_tuned_spread"] = [round(min(ratios), 4), round(max(ratios), 4)]
    return {**row, "status": "ok"}


def in_fresh_process(impl: str, case_text: str, against_tune: bool, rounds: int, timeout: float) -> dict[str, Any]:
    """``measure`` in a child process with an empty tuning cache; a crash or timeout becomes the row's message."""
    row = {"impl": impl, "case": parse_case(case_text).id}
    with tempfile.TemporaryDirectory(prefix="fmha-first-call-") as cache:
        env = {**os.environ, "FMHA_TUNING_CACHE": cache, "FMHA_TUNING": "on"}
        command = [sys.executable, "-m", "tools.first_call", "--child", "--impl", impl, "--case", case_text,
                   "--rounds", str(rounds)] + ["--against-tune"] * against_tune
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {**row, "status": "timeout", "message": f"no answer in {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {**row, "status": "failed", "message": tail[-300:]}
    return json.loads(lines[-1])


def case_text(case) -> str:
    """``case`` as ``FIELD=VALUE,...``, the form ``parse_case`` reads."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return str(int(v))
        return ":".join(map(str, v)) if isinstance(v, tuple) else str(v)

    return ",".join(f"{k}={value(v)}" for k, v in case.as_dict().items())


def case_texts(grids: list[str], cases: list[str]) -> list[tuple[str, str]]:
    """(preset, case) to run, each case as ``FIELD=VALUE,...`` (a child process rebuilds it); "" for --case."""
    from suite.presets import cases as preset_cases

    texts = [("", text) for text in cases] + [(grid, case_text(case)) for grid, case in preset_cases(grids)]
    return texts or [("", text) for text in DEFAULT_CASES]


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per implementation and preset: the geometric mean and the worst of the picks' time over the tune's."""
    groups: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        if "pick_over_tuned" in row:
            groups.setdefault((row["impl"], row.get("preset", "")), []).append(row["pick_over_tuned"])
    return [f"{impl} {preset or '(cases)'}: {len(r)} cases, pick / tuned geomean {statistics.geometric_mean(r):.4f}, "
            f"worst {max(r):.4f}" for (impl, preset), r in sorted(groups.items())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.first_call", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", action="append", required=True, help="implementation name (repeatable)")
    parser.add_argument("--case", action="append", default=[], type=str,
                        help="FIELD=VALUE,... of suite.cases.Case (repeatable)")
    parser.add_argument("--grid", action="append", default=[], help="a preset's cases (repeatable)")
    parser.add_argument("--against-tune", action="store_true", help="also tune the shape and compare the picks")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timings of pick and tune (default 5)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a row may take (default 600)")
    parser.add_argument("--out", type=Path, help="append the rows here as JSON lines")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for text in args.case:  # a bad case is an error before anything runs
        try:
            parse_case(text)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--case {exc}")
    if args.child:
        print(json.dumps(measure(args.impl[0], parse_case(args.case[0]), args.against_tune, args.rounds)))
        return
    rows = []
    for preset, text in case_texts(args.grid, args.case):
        for impl in args.impl:
            row = {**in_fresh_process(impl, text, args.against_tune, args.rounds, args.timeout), "preset": preset}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    print("\n".join(summary(rows)))

if __name__ == "__main__":
    main()
