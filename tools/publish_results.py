"""Copy suite results into one compact file for docs/results/ (several parts of one run become one file).

The output is the same pytest-benchmark JSON the suite writes, without each benchmark's ``params`` (its
``extra_info`` holds the same facts), gzipped when the name ends in ``.gz``; ``python -m reports`` reads either.
Where several sources are given, the first one's settings (schema, device, baseline) stand and their benchmarks,
outcomes and tables are united by the suite's own merge (``suite.isolation.merge_files``).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

EPILOG = """examples:
  python -m tools.publish_results results/serving.json docs/results/serving-h200.json.gz
  python -m tools.publish_results results/models.json results/models-rest.json docs/results/models-h200.json.gz
"""


def combine(sources: list[Path]) -> dict[str, Any]:
    """The results files ``sources`` as one: the first file alone as it is, several merged as the suite merges
    its workers' files (the first file's scalar settings kept)."""
    data = json.loads(sources[0].read_text())
    if len(sources) == 1:
        return data
    from suite.isolation import merge_files

    settings = {key: value for key, value in data.get("fmha", {}).items() if not isinstance(value, (dict, list))}
    return merge_files(sources, settings)


def publish(sources: list[Path], dst: Path) -> dict[str, Any]:
    """Write ``combine(sources)`` to ``dst`` compactly (gzip for ``.gz``, a fixed mtime so that the same results
    give the same bytes); returns what was written."""
    data = combine(sources)
    for bench in data.get("benchmarks", []):
        bench.pop("params", None)
    dst.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, separators=(",", ":"), default=str).encode()
    dst.write_bytes(gzip.compress(text, mtime=0) if dst.suffix == ".gz" else text)
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.publish_results", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", type=Path, help="results JSON files of the suite (--benchmark-json)")
    parser.add_argument("destination", type=Path, help="the file to write (.json or .json.gz)")
    args = parser.parse_args(argv)
    data = publish(args.sources, args.destination)
    size = args.destination.stat().st_size / 1024
    print(f"{args.destination}: {size:.0f} KiB, {len(data.get('benchmarks', []))} benchmarks")


if __name__ == "__main__":
    main()
