"""Tune our kernels on this GPU and write the picks as the tables shipped beside them.

    python -m impls.tune --grid blog --grid serving          # tune every shape class of the presets, then export
    python -m impls.tune --export-only                       # export what this machine's tuning cache holds

The tune is the suite's correctness run of the presets for ``cutile`` and ``triton`` under ``FMHA_TUNING=tune`` (one
process per GPU: a tuner alone on its GPU), so each pick is also checked against the float64 oracle. The export
takes every entry of the tuning cache tuned with the code and libraries installed here (``--any-source``: with any),
drops the tuner's evidence, and merges it into ``impls/<family>/tuned/<gpu>.json``: one readable file per GPU model,
each pick keyed on its shape class (dtype, head dims, mask, GQA ratio, length and batch classes, variants). Commit
those files to ship the picks. See docs/design.md#tuning.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from impls.tuning import EVIDENCE, TuningCache, gpu_file, source_hash

FAMILIES = {"cutile": ("impls.cutile.tuner", "cutile"), "triton": ("impls.triton_fa.config", "triton_fa")}
PACKAGE = Path(__file__).parent


def family_cache(module: str) -> TuningCache:
    """A family's TuningCache, imported from its module (which may need the family's compiler)."""
    import importlib

    return importlib.import_module(module).TUNING


def cache_entries(path: Path) -> list[tuple[dict, dict]]:
    """(key fields, config) of every entry of a tuning cache file; none where it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [(json.loads(key), config) for key, config in data.items()]


def export(cache_file: Path, folder: Path, *, source: str | None, gpu: str | None = None) -> dict[str, int]:
    """Merge the cache file's entries (of ``source``'s digest unless None; of ``gpu`` unless None) into one table
    per GPU in ``folder``. Returns the number of picks written per table file."""
    tables: dict[str, dict[str, Any]] = {}
    for fields, config in cache_entries(cache_file):
        if (source and fields.get("source") != source) or (gpu and fields.get("gpu") != gpu):
            continue
        name = gpu_file(fields["gpu"])
        if name not in tables:
            path = folder / name
            table = json.loads(path.read_text()) if path.exists() else {
                "gpu": fields["gpu"], "capability": fields["capability"], "picks": []}
            table["by_shape"] = {json.dumps(pick["shape"]): pick for pick in table["picks"]}
            tables[name] = table
        versions = {k: v for k, v in fields.items() if k not in ("gpu", "capability", "source", "shape")}
        pick = {"shape": fields["shape"], "config": {k: v for k, v in config.items() if k != EVIDENCE},
                "tuned_with": versions}
        tables[name]["by_shape"][json.dumps(fields["shape"])] = pick
    written = {}
    for name, table in tables.items():
        picks = sorted(table.pop("by_shape").values(), key=lambda pick: pick["shape"])
        folder.mkdir(parents=True, exist_ok=True)
        write_table(folder / name, {**table, "picks": picks})
        written[name] = len(picks)
    return written


def write_table(path: Path, table: dict) -> None:
    """One pick a line, sorted by shape: a new tune shows in review as the lines it changed."""
    fields = [f" {json.dumps(key)}: {json.dumps(value)}" for key, value in table.items() if key != "picks"]
    picks = ",\n  ".join(json.dumps({"shape": pick["shape"], "config": dict(sorted(pick["config"].items())),
                                      "tuned_with": pick["tuned_with"]}) for pick in table["picks"])
    path.write_text("{\n" + ",\n".join([*fields, f' "picks": [\n  {picks}\n ]']) + "\n}\n")


def tune(grids: list[str], impls: list[str], workers: int, retune: bool) -> int:
    """The suite's correctness run of ``grids`` for ``impls`` with tuning on; returns pytest's exit status."""
    command = [sys.executable, "-m", "pytest", "suite", "-k", "correctness", "-q", "-p", "no:cacheprovider",
               *(f"--grid={grid}" for grid in grids), *(f"--impl={impl}" for impl in impls)]
    if workers > 1:
        command += ["-n", str(workers), "--dist", "loadgroup"]
    env = {**os.environ, "FMHA_TUNING": "retune" if retune else "tune"}
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m impls.tune", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python -m impls.tune --grid blog --grid fa3 --workers 2   # on a node of two GPUs")
    parser.add_argument("--grid", action="append", default=[], help="a preset to tune (repeatable)")
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), default=[],
                        help="kernel family to tune and export (repeatable; default both)")
    parser.add_argument("--workers", type=int, default=1, help="one per GPU of this machine (default 1)")
    parser.add_argument("--retune", action="store_true", help="tune again the classes this machine has tuned")
    parser.add_argument("--export-only", action="store_true", help="export the tuning cache without tuning")
    parser.add_argument("--cache", type=Path, help="the tuning cache folder (default: FMHA_TUNING_CACHE or "
                        "~/.cache/fmha-bench)")
    parser.add_argument("--gpu", help="export this GPU model's entries only (default: every GPU in the cache)")
    parser.add_argument("--any-source", action="store_true",
                        help="export entries tuned with any version of the kernels (default: this code's only)")
    args = parser.parse_args(argv)
    families = args.family or sorted(FAMILIES)
    if args.cache:
        os.environ["FMHA_TUNING_CACHE"] = str(args.cache)
    if not args.export_only:
        if not args.grid:
            parser.error("--grid PRESET is needed to tune (or --export-only)")
        status = tune(args.grid, families, args.workers, args.retune)
        if status not in (0, 5):
            print(f"the tuning run failed (pytest exit {status}); exporting what it stored", file=sys.stderr)
    for family in families:
        module, package = FAMILIES[family]
        cache = family_cache(module)
        source = None if args.any_source else source_hash(cache.sources)
        written = export(cache.path, PACKAGE / package / "tuned", source=source, gpu=args.gpu)
        for name, count in written.items():
            print(f"{family}: {count} picks in impls/{package}/tuned/{name}")
        if not written:
            print(f"{family}: no entries to export in {cache.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
