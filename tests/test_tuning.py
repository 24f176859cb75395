"""The tuning cache (modes, a GPU shared with other processes, keys, source digests, re-keying) and how the tuners
rank their candidates, on CPU."""

import hashlib
import importlib
import json
import multiprocessing
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from impls import tuning

TUNING_MODULES = {"cutile": "impls.cutile.tuner", "triton_fa": "impls.triton_fa.config"}  # where each family's cache is


def test_tuning_cache_modes(tmp_path, monkeypatch):
    """By default nothing is tuned: the cache's pick, else (no table here) the fixed config. ``tune`` tunes what the
    cache lacks and stores it, ``retune`` tunes again and overwrites, ``off`` neither reads, writes nor tunes."""
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
    assert cache.lookup("k", tune, fixed) == ({"BLOCK": 16}, tuning.FIXED) and not calls  # no call waits for a tuner
    monkeypatch.setenv("FMHA_TUNING", "tune")
    assert cache.lookup("k", tune, fixed) == ({"BLOCK": 64}, tuning.TUNED)
    assert cache.lookup("k", tune, fixed) == ({"BLOCK": 64}, tuning.CACHED) and len(calls) == 1  # tuned once
    monkeypatch.setenv("FMHA_TUNING", "on")
    assert cache.lookup("k", tune, fixed) == ({"BLOCK": 64}, tuning.CACHED)  # this machine's tune, by default
    monkeypatch.setenv("FMHA_TUNING", "retune")
    assert cache.lookup("k", tune, fixed) == ({"BLOCK": 128}, tuning.TUNED)  # tuned again, overwritten
    monkeypatch.setenv("FMHA_TUNING", "on")
    assert cache.get("k") == {"BLOCK": 128}
    monkeypatch.setenv("FMHA_TUNING", "off")
    assert cache.lookup("k", tune, fixed) == ({"BLOCK": 16}, tuning.FIXED) and len(calls) == 2
    cache.put("k", {"BLOCK": 999})
    monkeypatch.setenv("FMHA_TUNING", "on")
    assert cache.get("k") == {"BLOCK": 128}  # off neither read nor wrote
    (tmp_path / "toy.json").write_text("{torn")
    assert cache.get("k") is None  # an unreadable file is ignored
    monkeypatch.setenv("FMHA_TUNING", "sometimes")
    with pytest.raises(ValueError, match="FMHA_TUNING='sometimes'"):
        cache.get("k")


def test_a_process_sharing_its_gpu_neither_tunes_nor_stores(tmp_path, monkeypatch):
    """Beside other processes on its GPU (xdist workers outnumbering the GPUs) a tuner would time their load: even
    when tuning is asked for, the cache's pick where there is one, else the fixed config, and nothing stored."""
    monkeypatch.setenv("FMHA_TUNING_CACHE", str(tmp_path))
    monkeypatch.setenv("FMHA_TUNING", "tune")
    monkeypatch.setenv("FMHA_GPU_SHARED", "1")
    cache = tuning.TuningCache("toy", [Path(__file__)], ["torch"])
    assert cache.lookup("k", lambda: pytest.fail("tuned on a shared GPU"), lambda: {"BLOCK": 16}) == (
        {"BLOCK": 16}, tuning.FIXED)
    assert cache.get("k") is None and not (tmp_path / "toy.json").exists()
    cache.put("k", {"BLOCK": 64})  # tuned earlier, alone
    assert cache.lookup("k", lambda: pytest.fail("tuned"), lambda: {"BLOCK": 16}) == ({"BLOCK": 64}, tuning.CACHED)


def test_a_process_sharing_its_gpu_compiles_the_candidates_when_asked(tmp_path, monkeypatch):
    """A tuning run's prime (--compile-candidates): workers that share the GPU compile the tuners' candidates,
    untimed, for the one process that tunes after them; they still run the fixed config and store nothing, and a
    class the cache already holds compiles nothing."""
    monkeypatch.setenv("FMHA_TUNING_CACHE", str(tmp_path))
    monkeypatch.setenv("FMHA_TUNING", "tune")
    monkeypatch.setenv("FMHA_GPU_SHARED", "1")
    cache = tuning.TuningCache("toy", [Path(__file__)], ["torch"])
    compiled = []

    def lookup(key: str) -> tuple[dict, str]:
        return cache.lookup(key, lambda: pytest.fail("tuned on a shared GPU"), lambda: {"BLOCK": 16},
                            lambda: compiled.append(key))

    assert lookup("k") == ({"BLOCK": 16}, tuning.FIXED) and compiled == []  # not asked: nothing compiled
    monkeypatch.setenv("FMHA_COMPILE_CANDIDATES", "1")
    assert lookup("k") == ({"BLOCK": 16}, tuning.FIXED) and compiled == ["k"]
    assert cache.get("k") is None
    cache.put("cached", {"BLOCK": 64})
    assert lookup("cached") == ({"BLOCK": 64}, tuning.CACHED) and compiled == ["k"]
    monkeypatch.setenv("FMHA_GPU_SHARED", "0")  # alone on its GPU it tunes, and the tune compiles for itself
    assert cache.lookup("alone", lambda: {"BLOCK": 32}, lambda: {"BLOCK": 16},
                        lambda: compiled.append("alone")) == ({"BLOCK": 32}, tuning.TUNED) and compiled == ["k"]


def _table(folder: Path, gpu: str, capability: str, picks: dict[tuple, dict]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / tuning.gpu_file(gpu)).write_text(json.dumps({
        "gpu": gpu, "capability": capability,
        "picks": [{"shape": list(shape), "config": config, "tuned_with": {}} for shape, config in picks.items()]}))


def test_shipped_tables_answer_exactly_then_by_the_nearest_class_then_by_kin(tmp_path, monkeypatch):
    """A shape class in this GPU's table runs its pick; one that is not runs the pick of the nearest class that
    differs only where ``near`` allows (lengths a power of two apart count 1; a tie goes to the longer), then a
    GPU's of the same compute capability; a pick ``valid`` refuses is passed over; nothing near: the fixed
    config."""
    monkeypatch.setenv("FMHA_TUNING_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FMHA_TUNING", "on")
    monkeypatch.delenv("FMHA_GPU_SHARED", raising=False)
    tables = tmp_path / "tuned"
    _table(tables, "GPU A", "9.0", {("fp16", "128", "4096", "64"): {"tile": 1},
                                     ("fp16", "128", "16384", "64"): {"tile": 2},
                                     ("fp16", "64", "4096", "64"): {"tile": 3}})
    _table(tables, "GPU B", "9.0", {("bf16", "128", "4096", "64"): {"tile": 4}})
    _table(tables, "GPU C", "8.0", {("fp32", "128", "4096", "64"): {"tile": 5}})
    cache = tuning.TuningCache("toy", [Path(__file__)], ["torch"], tables=tables)

    def key(gpu: str, *shape: str) -> str:
        return json.dumps({"gpu": gpu, "capability": "9.0", "shape": list(shape)})

    def lookup(k: str, valid=None) -> tuple[dict, str]:
        return cache.lookup(k, lambda: pytest.fail("tuned"), lambda: {"tile": 0}, near=(2, 3), valid=valid)

    assert lookup(key("GPU A", "fp16", "128", "16384", "64")) == ({"tile": 2}, "shipped (GPU A)")
    assert lookup(key("GPU A", "fp16", "128", "8192", "64")) == ({"tile": 2}, f"{tuning.NEAREST} (GPU A)")  # a tie
    assert lookup(key("GPU A", "fp16", "128", "2048", "64")) == ({"tile": 1}, f"{tuning.NEAREST} (GPU A)")
    assert lookup(key("GPU A", "fp16", "128", "32768", "256")) == ({"tile": 2}, f"{tuning.NEAREST} (GPU A)")
    assert lookup(key("GPU A", "fp16", "128", "16384", "64"), valid=lambda c: c["tile"] != 2) == (
        {"tile": 1}, f"{tuning.NEAREST} (GPU A)")
    assert lookup(key("GPU A", "fp16", "96", "4096", "64")) == ({"tile": 0}, tuning.FIXED)  # a head dim is not near
    assert lookup(key("GPU A", "bf16", "128", "4096", "64")) == ({"tile": 4}, f"{tuning.NEAREST} (GPU B)")
    assert lookup(key("GPU D", "fp16", "64", "2048", "64")) == ({"tile": 3}, f"{tuning.NEAREST} (GPU A)")
    assert lookup(key("GPU D", "fp32", "128", "4096", "64")) == ({"tile": 0}, tuning.FIXED)  # sm_80's is no kin
    assert lookup("not a key's JSON") == ({"tile": 0}, tuning.FIXED)


def test_the_tune_command_exports_this_codes_picks_as_a_table(tmp_path):
    """``python -m impls.tune --export-only``: the cache's entries of one source digest, evidence dropped, merged
    into a table per GPU that the lookup then reads."""
    from impls.tune import export

    def entry(gpu: str, source: str, shape: list[str], config: dict) -> tuple[str, dict]:
        return json.dumps({"gpu": gpu, "capability": "9.0", "source": source, "torch": "2.11.0",
                           "shape": shape}, sort_keys=True), config

    cache_file = tmp_path / "toy.json"
    cache_file.write_text(json.dumps(dict([
        entry("NVIDIA H200", "new", ["fp16", "64"], {"tile": 1, tuning.EVIDENCE: [{"variant": "x"}]}),
        entry("NVIDIA H200", "old", ["fp16", "128"], {"tile": 2}),
        entry("NVIDIA H100 80GB HBM3", "new", ["fp16", "64"], {"tile": 3})])))
    folder = tmp_path / "tuned"
    assert export(cache_file, folder, source="new") == {"nvidia-h200.json": 1, "nvidia-h100-80gb-hbm3.json": 1}
    table = json.loads((folder / "nvidia-h200.json").read_text())
    assert table["picks"] == [{"shape": ["fp16", "64"], "config": {"tile": 1}, "tuned_with": {"torch": "2.11.0"}}]
    assert export(cache_file, folder, source=None, gpu="NVIDIA H200") == {"nvidia-h200.json": 2}  # merged
    picks = tuning.ShippedTables(folder)
    assert picks.pick(json.dumps({"gpu": "NVIDIA H200", "capability": "9.0", "shape": ["fp16", "128"]})) == (
        {"tile": 2}, "shipped (NVIDIA H200)")


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
    assert {"decode.py", "kernel.py", "_plans.py"} <= {path.name for path in sources}
    contract = {path.name for path in sources if path.parent.name == "contract"}
    assert {"dense.py", "serving.py", "backward.py"} <= contract


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


