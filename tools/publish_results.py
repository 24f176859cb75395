"""Copy a suite results JSON into ``docs/results/`` compactly: the same pytest-benchmark file, without the
``params`` reprs (each benchmark's ``extra_info`` holds the same facts), gzipped when the name ends in ``.gz``
(``python -m reports`` reads either). Several sources, the JSONs of one run's parts, become one file.

    python scripts/publish_results.py results/serving-all.json docs/results/serving-varlen-h200.json.gz
    python scripts/publish_results.py results/models.json results/models-rest.json docs/results/models-h200.json.gz
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from suite.isolation import merge_files


def main(*paths: str) -> None:
    *sources, dst = map(Path, paths)
    data = json.loads(sources[0].read_text())
    if len(sources) > 1:  # the first file's settings (schema, device, baseline) stand; its lists and tables unite
        settings = {key: value for key, value in data.get("fmha", {}).items() if not isinstance(value, (dict, list))}
        data = merge_files(sources, settings)
    for bench in data.get("benchmarks", []):
        bench.pop("params", None)
    dst.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, separators=(",", ":"), default=str).encode()
    dst.write_bytes(gzip.compress(text, mtime=0) if dst.suffix == ".gz" else text)
    print(f"{dst}: {dst.stat().st_size / 1024:.0f} KiB, {len(data.get('benchmarks', []))} benchmarks")


if __name__ == "__main__":
    main(*sys.argv[1:])
