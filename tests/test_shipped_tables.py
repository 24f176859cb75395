"""The tuned tables shipped beside our kernels (``impls/<family>/tuned/<gpu>.json``): they load, every pick is a
config of its family's space, and the H200's answer the benchmark presets' shape classes with their own picks, so
that no call there waits for a tuner or runs a guess."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from impls import tuning
from impls.contract import NO_WINDOW, PagedKV, binding_window, decode_shaped
from suite.presets import preset

ROOT = Path(__file__).resolve().parents[1]
TABLES = sorted((ROOT / "impls").glob("*/tuned/*.json"))
H200 = SimpleNamespace(name="NVIDIA H200", major=9, minor=0)


def test_tables_ship_for_the_h200():
    assert "nvidia-h200.json" in {path.name for path in TABLES if path.parts[-3] == "cutile"}
    assert "nvidia-h200.json" in {path.name for path in TABLES if path.parts[-3] == "triton_fa"}


def check_pick(family: str, shape: list[str], config: dict) -> None:
    if shape[0] == "dense decode":
        assert config in ({"route": "decode"}, {"route": "dense"})
    elif family == "triton_fa" and shape[0] == "backward":
        from impls.triton_fa.backward import search_space

        dkdv_space, dq_space = search_space(int(shape[2]), getattr(torch, shape[1].removeprefix("torch.")))
        assert set(config) == {"dkdv", "dq"} and config["dkdv"] in dkdv_space and config["dq"] in dq_space
    elif family == "triton_fa":
        from impls.triton_fa.dense import configs
        from impls.triton_fa.paged import DECODE_SPACE

        assert config in (DECODE_SPACE if shape[0] == "paged" else configs(pointer=True, tma=True))
    else:
        pytest.importorskip("cuda.tile")
        from impls.cutile.config import Variant
        from impls.cutile.serving import DecodeVariant

        (DecodeVariant if shape[0] == "paged" else Variant)(**config)  # a config the kernel takes, or it raises


@pytest.mark.parametrize("path", TABLES, ids=lambda path: f"{path.parts[-3]}/{path.name}")
def test_a_table_loads_and_each_pick_is_a_config_of_its_family(path):
    table = json.loads(path.read_text())
    assert path.name == tuning.gpu_file(table["gpu"]) and table["capability"] and table["picks"]
    shapes = [tuple(pick["shape"]) for pick in table["picks"]]
    assert len(shapes) == len(set(shapes)), "one pick per shape class"
    for pick in table["picks"]:
        assert tuning.EVIDENCE not in pick["config"]
        check_pick(path.parts[-3], pick["shape"], pick["config"])


@pytest.fixture
def on_h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H200)


def dense_key(case) -> str:
    from impls.cutile.tuner import TUNING, shape_class

    q, k = (torch.empty(case.batch, h, s, case.d, device="meta", dtype=case.torch_dtype)
            for h, s in ((case.hq, case.sq), (case.hkv, case.skv)))
    variants = {"softcap": case.softcap} if case.softcap else {}
    if case.window != NO_WINDOW:
        variants["window"] = binding_window(case.window, case.causal, case.sq, case.skv)  # as the entry runs it
    return TUNING.key("cuda", shape_class(q, k, case.causal, value_dim=case.value_dim, **variants))


@pytest.mark.parametrize("name", ["blog", "blog-noncausal", "fa3", "gqa", "models"])
def test_the_h200_table_holds_every_dense_preset_class_of_our_cutile_kernel(name, on_h200):
    pytest.importorskip("cuda.tile")
    from impls.cutile.tuner import NEAR_LENGTHS, TUNING

    cases = [case for case in preset(name) if not decode_shaped(case.sq, case.skv, case.causal)]
    picks = {case.id: TUNING.tables.pick(dense_key(case), NEAR_LENGTHS) for case in cases}
    assert cases and all(pick and pick[1] == "shipped (NVIDIA H200)" for pick in picks.values()), picks


def paged_inputs(case) -> PagedKV:
    """The case's decode inputs at their shapes, the caches one page seen as many (nothing of them is read)."""
    lengths = case.seqlens()
    pages = [math.ceil(n / case.page_size) for n in lengths]
    dtype = case.kv_torch_dtype if case.kv_dtype else case.torch_dtype
    cache = torch.empty(1, case.page_size, case.hkv, case.d, dtype=dtype).expand(sum(pages), -1, -1, -1)
    scales = {"k_scale": 1.0, "v_scale": 1.0} if case.kv_dtype else {}
    return PagedKV(torch.empty(case.batch, case.sq, case.hq, case.d, dtype=case.torch_dtype), cache, cache,
                   torch.zeros(case.batch, max(pages), dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32),
                   **scales)


@pytest.mark.parametrize("family", ["cutile", "triton"])
def test_the_h200_table_holds_every_serving_decode_class(family, on_h200):
    from impls._plans import NEAR_DECODE, decode_shape_class

    if family == "cutile":
        pytest.importorskip("cuda.tile")
        from impls.cutile.tuner import TUNING
    else:
        from impls.triton_fa.config import TUNING
    cases = [case for case in preset("serving") if case.op == "paged"]
    picks = {}
    for case in cases:
        inputs = paged_inputs(case)
        shape = decode_shape_class(inputs, inputs.window_left(case.window), case.softcap)
        picks[case.id] = TUNING.tables.pick(TUNING.key("cuda", shape), NEAR_DECODE)
    assert cases and all(pick and pick[1] == "shipped (NVIDIA H200)" for pick in picks.values()), picks


# The backward's shipped picks come from an H200 sweep of fa3-bwd at 2K and 8K (D 64 and 128, causal and not) and
# train's Llama-3-8B 4K and 70B slice 8K (docs/design.md#the-backward-pass): those classes are answered exactly, the
# other dense lengths by the nearest swept length of the same class; no packed class was swept, so train's packed
# documents run the fixed tiles.
SWEPT_BACKWARD = {("fa3-bwd", 2048), ("fa3-bwd", 8192), ("llama3-8b", 4096), ("llama3-70b-tp8", 8192)}


@pytest.mark.parametrize("name", ["train", "fa3-bwd"])
def test_the_h200_table_answers_the_training_presets_backward(name, on_h200):
    from impls.triton_fa.backward import NEAR_LENGTHS, shape_class
    from impls.triton_fa.config import TUNING

    cases = [case for case in preset(name) if case.op == "backward"]  # fwdbwd cases share them
    sources, expected = {}, {}
    for case in cases:
        length = max(case.seqlens()) if case.packed else case.sq  # the packed grid's: the longest document's
        shape = shape_class(case.torch_dtype, case.d, case.causal, case.window, case.softcap, case.packed,
                            case.hq // case.hkv, length, case.skv if not case.packed else length)
        pick = TUNING.tables.pick(TUNING.key("cuda", shape), NEAR_LENGTHS)
        sources[case.id] = pick[1] if pick else tuning.FIXED
        swept = (case.model or name, case.sq) in SWEPT_BACKWARD
        expected[case.id] = (tuning.FIXED if case.packed else
                             "shipped (NVIDIA H200)" if swept else f"{tuning.NEAREST} (NVIDIA H200)")
    assert cases and sources == expected
