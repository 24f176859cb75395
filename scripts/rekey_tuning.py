"""Re-key a tuning cache from the source digests of an earlier commit to the working tree's.

A cache entry's key digests its kernel family's code (``impls._tuning.family_sources``), so any edit to one of
the family's modules sends every pick back to a tune: on an H200 20-30 s for each decode shape class, minutes for
a dense one, and a chain that carried ``.gpu-tune/`` finds none of it (sessions 53-57 re-keyed by hand; session 56
lost a tune to a key left stale). Where an edit leaves every pick as it was (plumbing, not kernels, launches or
search spaces; say why in the commit or the notes), re-key the carried cache instead of tuning again:

    python scripts/rekey_tuning.py .gpu-tune --base 9ca8469

Entries keyed on any other digest stay as they are. Prints, per family, the two digests and how many entries moved.
Without ``--base`` it only says how many of each file's entries this code's digest would find (``gpu_session.sh``
prints it when it seeds a machine's cache, so that a stale carry shows before a tune runs out of time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from impls._tuning import contents_hash, family_sources, source_hash

ROOT = Path(__file__).resolve().parent.parent
# Each kernel family's tuning cache file and package, as its TuningCache names them (a test checks), without
# importing the packages (cuda.tile, triton) to read them
FAMILIES = {"cutile": ROOT / "impls" / "cutile", "triton": ROOT / "impls" / "triton_fa"}


def sources(family: str) -> tuple[Path, ...]:
    return tuple(sorted(family_sources(str(FAMILIES[family] / "__init__.py"))))


def digest_at(commit: str, paths: tuple[Path, ...], root: Path = ROOT) -> str:
    """The source digest of ``paths`` (under ``root``, a git work tree) as they were at ``commit``; a path that did
    not exist there is left out, as the family's glob would have left it."""
    def at_commit(path: Path) -> bytes | None:
        done = subprocess.run(["git", "show", f"{commit}:{path.relative_to(root).as_posix()}"], cwd=root,
                              capture_output=True, check=False)
        return done.stdout if done.returncode == 0 else None

    return contents_hash(source for source in map(at_commit, paths) if source is not None)


def rekey(path: Path, old: str, new: str) -> int:
    """Rewrite the entries of the cache file ``path`` keyed on source digest ``old`` to ``new``; how many."""
    entries, count = {}, 0
    for key, config in json.loads(path.read_text()).items():
        fields = json.loads(key)
        if fields.get("source") == old:
            fields["source"], count = new, count + 1
        entries[json.dumps(fields, sort_keys=True)] = config  # the form TuningCache.key writes
    path.write_text(json.dumps(entries, indent=1, sort_keys=True))
    return count


def matching(path: Path, digest: str) -> tuple[int, int]:
    """(entries keyed on ``digest``, entries) of the cache file ``path``."""
    keys = [json.loads(key) for key in json.loads(path.read_text())]
    return sum(key.get("source") == digest for key in keys), len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="the tuning cache's folder (FMHA_TUNING_CACHE, .gpu-tune)")
    parser.add_argument("--base", help="the commit the cache's entries were tuned at (without it: only report)")
    args = parser.parse_args()
    for family in FAMILIES:
        path, new = args.directory / f"{family}.json", source_hash(sources(family))
        if not path.exists():
            print(f"{family}: no file")
        elif args.base is None:
            found, total = matching(path, new)
            print(f"{family}: {found} of {total} entries at this code's digest ({new})")
        elif (old := digest_at(args.base, sources(family))) == new:
            print(f"{family}: digest unchanged ({new})")
        else:
            print(f"{family}: {old} -> {new}, {rekey(path, old, new)} entries re-keyed")


if __name__ == "__main__":
    main()
