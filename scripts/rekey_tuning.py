"""Re-key a tuning cache from the source digests of an earlier commit to the working tree's.

A cache entry's key digests its kernel family's code (``impls.tuning.family_sources``), so any edit to one of
the family's modules sends every pick back to a tune: on an H200 20-30 s for each decode shape class, minutes for
a dense one, and a chain that carried ``.gpu-tune/`` finds none of it (sessions 53-57 re-keyed by hand; session 56
lost a tune to a key left stale). Where an edit leaves every pick as it was (plumbing, not kernels, launches or
search spaces; say why in the commit or the notes), re-key the carried cache instead of tuning again:

    python scripts/rekey_tuning.py .gpu-tune --base 9ca8469

Entries keyed on any other digest stay as they are. Prints, per family, the two digests, how many entries moved and
what changed in the family's modules since ``--base`` (what you declare leaves the picks alone).
Without ``--base`` it only says how many of each file's entries this code's digest would find (``gpu_session.sh``
prints it when it seeds a machine's cache, so that a stale carry shows before a tune runs out of time), and, for
each other digest, the commit whose code it was tuned at and the family's modules changed since. Session 65 re-keyed a
Triton cache by hand across a change of its search space (a tile added) and republished with picks that never saw
the new tile; this line would have named the commit before that change.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from impls.tuning import contents_hash, family_sources, source_hash

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


def tuned_at(digest: str, paths: tuple[Path, ...], root: Path = ROOT, depth: int = 60) -> str | None:
    """The newest commit (of the last ``depth`` that touched ``paths``) whose version of them has source digest
    ``digest``, or None (a tree that was never committed, or older)."""
    log = subprocess.run(["git", "log", "--format=%h", f"-{depth}", "--", *map(str, paths)], cwd=root,
                         capture_output=True, text=True, check=False).stdout.split()
    return next((commit for commit in log if digest_at(commit, paths, root) == digest), None)


def changed_since(commit: str, paths: tuple[Path, ...], root: Path = ROOT) -> str:
    """``git diff --stat`` of ``paths`` from ``commit`` to the working tree, on one line."""
    stat = subprocess.run(["git", "diff", "--shortstat", commit, "--", *map(str, paths)], cwd=root,
                          capture_output=True, text=True, check=False).stdout.strip()
    names = subprocess.run(["git", "diff", "--name-only", commit, "--", *map(str, paths)], cwd=root,
                           capture_output=True, text=True, check=False).stdout.split()
    return f"{', '.join(names)}: {stat}" if names else "nothing"


def digests(path: Path) -> dict[str, int]:
    """How many entries of the cache file ``path`` each source digest keys."""
    counts: dict[str, int] = {}
    for key in json.loads(path.read_text()):
        digest = json.loads(key).get("source", "")
        counts[digest] = counts.get(digest, 0) + 1
    return counts


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
            counts = digests(path)
            print(f"{family}: {counts.get(new, 0)} of {sum(counts.values())} entries at this code's digest ({new})")
            for digest, count in counts.items():
                if digest != new:
                    commit = tuned_at(digest, sources(family))
                    origin = (f"tuned at {commit}; changed since: {changed_since(commit, sources(family))}" if commit
                              else "no commit here has that code (uncommitted edits, or no git history)")
                    print(f"  {count} at {digest}: {origin}")
        elif (old := digest_at(args.base, sources(family))) == new:
            print(f"{family}: digest unchanged ({new})")
        else:
            print(f"{family}: {old} -> {new}, {rekey(path, old, new)} entries re-keyed; "
                  f"changed since {args.base}: {changed_since(args.base, sources(family))}")


if __name__ == "__main__":
    main()
