"""Every cuTile candidate's sm_90 SASS at a git revision against the working tree, without a GPU: registers,
stack, shared memory (the compiler's K/V pipeline) and whether the instructions changed at all.

A kernel edit that keeps every test green can still cost the compiler's pipeline (a run-time ``if`` around a
peeled block once took a causal 128x256 from 225 to 193 KB of shared memory; only this comparison showed it). The
revision is checked out in a temporary git worktree and compiled there by the same ``tileiras`` as the working
tree (``FMHA_CUTILE_BYTECODE`` applies to both). See docs/design.md#cutile-forward.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("reg", "stack", "shared")
EPILOG = """examples:
  python -m tools.sass_diff HEAD~1 --head-dim 128
  python -m tools.sass_diff main --head-dim 64 --no-causal --match '128x*'
  python -m tools.sass_diff HEAD --head-dim 192 --value-dim 128 --window
"""


def emit(args: argparse.Namespace) -> None:
    """One JSON line per candidate of the tree on PYTHONPATH: its label, FIELDS and a digest of its SASS."""
    import torch

    from impls.cutile.export import export_cubin
    from impls.cutile.spaces import search_space
    from impls.sass import find_cuobjdump, sass_summary

    capability = (int(args.arch[3:-1]), int(args.arch[-1]))
    options = {"value_dim": args.value_dim} if args.value_dim else {}
    space = search_space(capability, args.head_dim, causal=args.causal, window=args.window, **options)
    for variant in space:
        if not any(fnmatchcase(variant.label(), glob) for glob in args.match or ["*"]):
            continue
        cubin = export_cubin(variant, arch=args.arch, dtype=torch.bfloat16, head_dim=args.head_dim,
                             causal=args.causal, window=args.window, **options)
        usage = sass_summary(cubin)
        row = {"label": variant.label(), **{f: usage[f] for f in FIELDS}, "digest": digest(cubin, find_cuobjdump())}
        print(json.dumps(row), flush=True)


def digest(cubin: bytes, cuobjdump: str) -> str:
    """A short hash of the SASS instructions, without their addresses and encodings."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    instructions = re.findall(r"/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", sass)
    return hashlib.sha1("\n".join(instructions).encode()).hexdigest()[:12]


def rows_of(tree: Path, argv: list[str]) -> dict[str, dict[str, Any]]:
    """The candidates of ``tree`` (its own ``impls``), compiled in a process of their own."""
    paths = [str(tree), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    out = subprocess.run([sys.executable, __file__, "--emit", *argv], cwd=tree, env=env, capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(f"compiling the candidates of {tree} failed:\n{out.stderr[-2000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {row["label"]: row for row in rows}


def compare(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[str]:
    """A line per candidate of either side: FIELDS before -> after, and whether its SASS changed."""
    lines = []
    for label in [*old, *(label for label in new if label not in old)]:
        before, after = old.get(label), new.get(label)
        if before is None or after is None:
            lines.append(f"{label}: {'only in the working tree' if before is None else 'gone from the working tree'}")
            continue
        moved = [f"{f} {before[f]} -> {after[f]}" for f in FIELDS if before[f] != after[f]]
        same = before["digest"] == after["digest"]
        lines.append(f"{label}: " + (", ".join(moved) if moved else "same " + "/".join(FIELDS))
                     + ("" if same else " (SASS changed)"))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.sass_diff", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", nargs="?", help="the git revision to compare the working tree with")
    parser.add_argument("--arch", default="sm_90", help="the target (default sm_90)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--value-dim", type=int, default=None, help="V's head dim where it differs (MLA)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--window", action="store_true", help="the windowed space and masks")
    parser.add_argument("--match", action="append", default=[], metavar="GLOB", help="candidate labels to keep")
    parser.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.emit:
        emit(args)
        return
    if not args.rev:
        parser.error("a git revision to compare with")
    argv = ["--arch", args.arch, "--head-dim", str(args.head_dim), "--causal" if args.causal else "--no-causal",
            *(["--value-dim", str(args.value_dim)] if args.value_dim else []), *(["--window"] if args.window else []),
            *(option for glob in args.match for option in ("--match", glob))]  # the options, for both trees
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "rev"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(worktree), args.rev],
                       check=True)
        try:
            old = rows_of(worktree, argv)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=True)
    print("\n".join(compare(old, rows_of(ROOT, argv))))


if __name__ == "__main__":
    main()
