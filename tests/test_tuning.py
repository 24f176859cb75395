"""The tuning cache (modes, a GPU shared with other processes, keys, source digests, re-keying) and how the tuners
rank their candidates, on CPU."""

import hashlib
import importlib
import json
import multiprocessing
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from impls import tuning

TUNING_MODULES = {"cutile": "impls.cutile.tuner", "triton_fa": "impls.triton_fa.config"}  # where each family's cache is


def test_tuning_cache_modes(tmp_path, monkeypatch):
    monkeypatch.setenv("FMHA_TUNING_CACHE", str(tmp_path))
    cache = tuning.TuningCache("toy", [Path(__file__)], ["torch"])
    calls = []

    def tune():
        calls.append(1)
        return {"BLOCK": 64 * len(calls)}

    def fixed():
        return {"BLOCK": 16}

    monkeypatch.delenv("FMHA_GPU_SHARED", raising=False)
    monkeypatch.setenv("FMHA_TUNING", "on")
    assert cache.lookup("k", tune, fixed) == ({"BLOCK": 64}, tuning.TUNED)
    assert cache.lookup("k", tune, fixed) == ({"BLOCK": 64}, tuning.CACHED) and len(calls) == 1  # tuned once
    monkeypatch.setenv("FMHA_TUNING", "retune")
    assert cache.lookup("k", tune, fixed) == ({"BLOCK": 128}, tuning.TUNED)  # tuned again, overwritten
    monkeypatch.setenv("FMHA_TUNING", "on")
    assert cache.get("k") == {"BLOCK": 128}
    monkeypatch.setenv("FMHA_TUNING", "off")
    assert cache.lookup("k", tune, fixed) == ({"BLOCK": 192}, tuning.TUNED)
    monkeypatch.setenv("FMHA_TUNING", "on")
    assert cache.get("k") == {"BLOCK": 128}  # off neither read nor wrote
    (tmp_path / "toy.json").write_text("{torn")
    assert cache.get("k") is None  # an unreadable file is ignored
    monkeypatch.setenv("FMHA_TUNING", "sometimes")
    with pytest.raises(ValueError, match="FMHA_TUNING='sometimes'"):
        cache.get("k")


def test_a_process_sharing_its_gpu_neither_tunes_nor_stores(tmp_path, monkeypatch):
    """Beside other processes on its GPU (xdist workers outnumbering the GPUs) a tuner would time their load: the
    cache's pick where there is one, else the fixed config, and nothing stored for the processes after it."""
    monkeypatch.setenv("FMHA_TUNING_CACHE", str(tmp_path))
    monkeypatch.setenv("FMHA_TUNING", "on")
    monkeypatch.setenv("FMHA_GPU_SHARED", "1")
    cache = tuning.TuningCache("toy", [Path(__file__)], ["torch"])
    assert cache.lookup("k", lambda: pytest.fail("tuned on a shared GPU"), lambda: {"BLOCK": 16}) == (
        {"BLOCK": 16}, tuning.UNTUNED)
    assert cache.get("k") is None and not (tmp_path / "toy.json").exists()
    cache.put("k", {"BLOCK": 64})  # tuned earlier, alone
    assert cache.lookup("k", lambda: pytest.fail("tuned"), lambda: {"BLOCK": 16}) == ({"BLOCK": 64}, tuning.CACHED)


def test_a_process_sharing_its_gpu_compiles_the_candidates_when_asked(tmp_path, monkeypatch):
    """A chain's prime (--compile-candidates): workers that share the GPU compile the tuners' candidates, untimed,
    for the one process that tunes after them; they still run the fixed config and store nothing, and a class the
    cache already holds compiles nothing."""
    monkeypatch.setenv("FMHA_TUNING_CACHE", str(tmp_path))
    monkeypatch.setenv("FMHA_TUNING", "on")
    monkeypatch.setenv("FMHA_GPU_SHARED", "1")
    cache = tuning.TuningCache("toy", [Path(__file__)], ["torch"])
    compiled = []

    def lookup(key: str) -> tuple[dict, str]:
        return cache.lookup(key, lambda: pytest.fail("tuned on a shared GPU"), lambda: {"BLOCK": 16},
                            lambda: compiled.append(key))

    assert lookup("k") == ({"BLOCK": 16}, tuning.UNTUNED) and compiled == []  # not asked: nothing compiled
    monkeypatch.setenv("FMHA_COMPILE_CANDIDATES", "1")
    assert lookup("k") == ({"BLOCK": 16}, tuning.UNTUNED) and compiled == ["k"]
    assert cache.get("k") is None
    cache.put("cached", {"BLOCK": 64})
    assert lookup("cached") == ({"BLOCK": 64}, tuning.CACHED) and compiled == ["k"]
    monkeypatch.setenv("FMHA_GPU_SHARED", "0")  # alone on its GPU it tunes, and the tune compiles for itself
    assert cache.lookup("alone", lambda: {"BLOCK": 32}, lambda: {"BLOCK": 16},
                        lambda: compiled.append("alone")) == ({"BLOCK": 32}, tuning.TUNED) and compiled == ["k"]


def test_the_key_names_the_compiler_where_given(monkeypatch):
    props = SimpleNamespace(name="H200", major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    plain = tuning.TuningCache("toy", [Path(__file__)], ["torch"])
    named = tuning.TuningCache("toy", [Path(__file__)], ["torch"],
                                lambda: {"tileiras": "tileiras 13.5.37", "bytecode": "13.5"})
    key = json.loads(named.key("cuda", ["shape"]))
    assert key["tileiras"] == "tileiras 13.5.37" and key["bytecode"] == "13.5" and key["gpu"] == "H200"
    assert "bytecode" not in json.loads(plain.key("cuda", ["shape"]))


def _store_entries(directory: str, worker: int, count: int) -> None:
    os.environ["FMHA_TUNING_CACHE"] = directory
    cache = tuning.TuningCache("toy", [Path(__file__)], ["torch"])
    for i in range(count):
        cache.put(f"w{worker}-{i}", {"i": i})


def test_processes_storing_side_by_side_lose_no_entry(tmp_path, monkeypatch):
    """Workers tuning at once (pytest-xdist on a node) each add entries to one file: none may be lost to
    another's read-modify-write."""
    monkeypatch.setenv("FMHA_TUNING", "on")
    workers, count = 6, 40
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pool.starmap(_store_entries, [(str(tmp_path), w, count) for w in range(workers)])
    stored = json.loads((tmp_path / "toy.json").read_text())
    assert len(stored) == workers * count


def test_the_source_hash_changes_with_the_kernel_not_with_its_notes(tmp_path):
    kernel = tmp_path / "kernel.py"

    def digest(text: str) -> str:
        kernel.write_text(text)
        tuning.source_hash.cache_clear()
        return tuning.source_hash((kernel,))

    first = digest('"""A space."""\ndef space():\n    """Measured: 500."""\n    return [1, 2]  # the two forms\n')
    # a docstring, a comment and the layout changed: the same code, the same picks
    assert digest('"""A space, again."""\n\ndef space():\n    """Measured: 510."""\n    return [1,  2]\n') == first
    assert digest('def space():\n    return [1, 2]\n') == first
    # the code changed: a value, a string assigned beside the docstring
    assert digest('def space():\n    return [1, 3]\n') != first
    assert digest('def space():\n    """Measured."""\n    x = "b"\n    return [1, 2]\n') != first


def test_the_source_hash_is_the_same_under_every_python():
    # The digest of a kernel module is written where the kernels ran (a GPU machine's Python 3.12) and read where the
    # cache is re-keyed or copied to (CI's 3.11): ast.unparse wrote this f-string's inner quotes one way before 3.12
    # and another from it, so one source had two digests. This value is what 3.11, 3.12 and 3.13 all give.
    source = b'def fail(missing):\n    raise TypeError(f"no value for {\', \'.join(missing)}")\n'
    assert hashlib.sha256(tuning._code_only(source)).hexdigest()[:16] == "4e340604e4fdf8a3"


@pytest.mark.parametrize("family", ["cutile", "triton_fa"])
def test_a_familys_tuning_key_covers_every_module_its_picks_depend_on(family):
    """The decode kernel's module, the serving launches and the shared split plans change a family's picks as
    much as the dense kernel does: an edit to any of them must not reuse the cached choices."""
    package = Path(importlib.import_module(f"impls.{family}").__file__).parent
    sources = importlib.import_module(TUNING_MODULES[family]).TUNING.sources
    assert set(package.glob("*.py")) <= set(sources)
    assert {"decode.py", "kernel.py", "_plans.py", "contract.py"} <= {path.name for path in sources}


def test_the_dense_tuner_is_named_or_refused(monkeypatch):
    monkeypatch.delenv("FMHA_TUNER", raising=False)
    assert tuning.dense_tuner() == "settled"
    monkeypatch.setenv("FMHA_TUNER", "exhaustive")
    assert tuning.dense_tuner() == "exhaustive"
    monkeypatch.setenv("FMHA_TUNER", "sustained")
    assert tuning.dense_tuner() == "sustained"
    monkeypatch.setenv("FMHA_TUNER", "settled")
    assert tuning.dense_tuner() == "settled"
    monkeypatch.setenv("FMHA_TUNER", "fastest")
    with pytest.raises(ValueError, match="FMHA_TUNER='fastest'"):
        tuning.dense_tuner()


def test_sustained_tuner_ranks_by_the_median_of_interleaved_rounds(monkeypatch):
    # Candidate "burst" has one round far below the others (a boost after a pause): ranked by its best round it
    # would win, by its median it does not. Rounds time every candidate in turn, in the order given.
    rounds = iter([[1.0, 2.0, 2.1], [3.0, 2.0, 2.1], [3.0, 2.0, 2.1], [3.0, 2.0, 1.9], [3.0, 2.0, 2.1]])
    calls = []
    monkeypatch.setattr(tuning, "graph_replay", lambda call, replay_ms: (call, 1))
    monkeypatch.setattr(tuning, "settle_gpu", lambda *a, **k: calls.append("settle"))
    monkeypatch.setattr(tuning, "time_replays", lambda replays: calls.append(len(replays)) or next(rounds))
    pick = tuning.sustained_fastest([("burst", None), ("steady", None), ("close", None)], rounds=5)
    assert pick == "steady"
    assert calls == ["settle", 3, 3, 3, 3, 3]  # settled once, after every capture, then five rounds of all three
    assert tuning.interleaved_medians(lambda: [2.0, 1.0], 1) == [2.0, 1.0]


def test_finalists_are_the_candidates_near_the_best_fastest_first():
    timings = [("a", 1.02), ("b", 1.0), ("c", 1.031), ("d", 1.5)]
    assert tuning.finalists(timings, margin=0.03) == ["b", "a"]
    assert tuning.finalists(timings, margin=0.5) == ["b", "a", "c", "d"]
    assert tuning.finalists([]) == []


def test_a_cache_is_rekeyed_from_a_commits_digest_to_the_work_trees(tmp_path):
    """scripts/rekey_tuning.py: the digest of a family's modules at a commit (a module added since left out), the
    commit a digest was tuned at with what changed since, and only the entries keyed on it moved to the working
    tree's digest."""
    from scripts.rekey_tuning import changed_since, digest_at, rekey
    from scripts.rekey_tuning import tuned_at as commit_of

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    kernel, added = tmp_path / "kernel.py", tmp_path / "added.py"
    kernel.write_text("def space():\n    return [1, 2]\n")
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "empty")
    git("add", "kernel.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "kernel")
    tuned_at = tuning.source_hash.__wrapped__((kernel,))
    assert digest_at("HEAD", (kernel,), tmp_path) == tuned_at
    kernel.write_text('def space():\n    """Plumbing changed, not the picks."""\n    return [1, 2]\n')
    added.write_text("X = 1\n")
    assert digest_at("HEAD", (added, kernel), tmp_path) == tuned_at  # not yet at the commit: left out
    assert digest_at("HEAD~1", (kernel,), tmp_path) != tuned_at
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert commit_of(tuned_at, (added, kernel), tmp_path) == head  # the commit whose code was tuned
    assert commit_of("0123456789abcdef", (kernel,), tmp_path) is None
    assert changed_since(head, (added, kernel), tmp_path).startswith("kernel.py: 1 file changed")  # added: untracked
    now = tuning.source_hash.__wrapped__((added, kernel))
    cache = tmp_path / "toy.json"
    stale = {"gpu": "H200", "shape": ["a"], "source": tuned_at}
    other = {"gpu": "H200", "shape": ["b"], "source": "0123456789abcdef"}
    cache.write_text(json.dumps({json.dumps(stale): {"BLOCK": 64}, json.dumps(other): {"BLOCK": 32}}))
    assert rekey(cache, tuned_at, now) == 1
    assert json.loads(cache.read_text()) == {json.dumps({**stale, "source": now}, sort_keys=True): {"BLOCK": 64},
                                             json.dumps(other, sort_keys=True): {"BLOCK": 32}}


def test_the_rekey_script_names_each_familys_sources_as_its_tuning_cache_does():
    from scripts.rekey_tuning import FAMILIES, sources

    from impls.cutile.tuner import TUNING as CUTILE
    from impls.triton_fa.config import TUNING as TRITON

    named = {family: sources(family) for family in FAMILIES}
    assert {cache.family: cache.sources for cache in (CUTILE, TRITON)} == named
