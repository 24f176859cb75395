"""Triton's paged decode (``impls/triton_fa/paged.py``) against the oracle, and what its tuner tries.

fp8 caches (bf16 queries of any magnitude, values read as 32-bit words), the split plans and the combine, the
mask-free loop, programmatic dependent launch and its prefetch; the tuner leaves out configs beyond shared memory
and times a step that fits in the L2 cold. Under Triton's interpreter on CPU; the tests of compiled code skip
without a GPU.
"""

import dataclasses
import itertools

import pytest
import torch

import impls
from suite.checks import Oracle
from suite.presets import PRESETS, case_by_id, paged
from tests.serving_helpers import EXTREME_MAGNITUDES, TINY, extreme_fp8_inputs, fp8_inputs, paged_inputs
from tests.tiers import only_fast


def test_triton_decode_over_fp8_keeps_bf16_queries_of_any_magnitude():
    """Under bf16 queries the Triton decode over an fp8 cache runs its dots in fp16 (F16_DOT), each query row
    scaled by a power of two first: queries of EXTREME_MAGNITUDES still give the oracle's output. Compiled on a
    GPU; under the interpreter on CPU (its fp32 dots still take the scaled rows). tests/test_gpu_candidates.py checks
    cuTile's decode forms the same way."""
    pytest.importorskip("triton")
    from impls.triton_fa.paged import DECODE_TILES, INTERPRETER_DECODE_CONFIG, paged_launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, w, st = DECODE_TILES[0]
    config = INTERPRETER_DECODE_CONFIG if device == "cpu" else {"BLOCK_N": n, "num_warps": w, "num_stages": st}
    for magnitude in EXTREME_MAGNITUDES:
        inputs, scale = extreme_fp8_inputs(device, magnitude)
        run, _ = paged_launch(inputs, scale, config)
        result = Oracle.serving(inputs, scale=scale).check(run())
        assert result.passed, f"queries of {magnitude}: {result.message}"


def off_word(cache: torch.Tensor) -> torch.Tensor:
    """The same cache one byte past a 32-bit word boundary (its unused slots' NaN too)."""
    shifted = torch.empty(cache.numel() + 1, dtype=cache.dtype, device=cache.device)[1:].view(cache.shape)
    return shifted.copy_(cache)


def test_triton_reads_fp8_values_as_words_only_where_it_can():
    """V_WORDS (decode.py): the values come as 32-bit words under fp16 dots in compiled code, over a word-aligned
    cache; bf16 dots, the interpreter or a cache off word alignment keep the byte path."""
    from impls.triton_fa.paged import word_values

    inputs = fp8_inputs()
    assert word_values(inputs, interp=False) and not word_values(inputs, interp=True)
    assert word_values(dataclasses.replace(inputs, q=inputs.q.half()), interp=False)  # fp16 queries: fp16 dots
    assert not word_values(inputs, interp=False, f16_dot=False)  # bf16 queries with F16_DOT off: bf16 dots
    assert not word_values(dataclasses.replace(inputs, v_cache=off_word(inputs.v_cache)), interp=False)
    assert not word_values(paged_inputs(), interp=False)  # a bf16 cache


def test_words_widen_into_their_columns_in_order():
    """V_WORDS' four values of a word land in its four columns, lowest byte first (``interleave_columns``; the
    widening itself is inline PTX, which only a GPU runs: the next test)."""
    kernels = pytest.importorskip("tests._triton_kernels")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(2, 16, dtype=torch.int32, device=device)
    kernels.spread_words[(1,)](out, ROWS=2, WORDS=4)
    assert out.flatten().tolist() == list(range(32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="V_WORDS runs inline PTX: compiled code on a GPU")
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.bfloat16, 64), (torch.float16, 64), (torch.bfloat16, 96)])
def test_triton_fp8_values_as_words_on_every_decode_tile(dtype, head_dim):
    """Every tile of the decode tuner over the fp8 twin (ragged pages, NaN in unused slots), its values read as
    words (bf16 queries with the fp16 dots, and fp16 queries; a head dim of 96 pads the tile to 128, its last
    words masked), then as bytes from a cache off word alignment: the oracle's output each time."""
    from impls.triton_fa.paged import DECODE_TILES, paged_launch, word_values

    inputs = paged((*TINY[:3], head_dim), 3, 100, lengths="longtail", kv_dtype="fp8").make_inputs("cuda")
    inputs = dataclasses.replace(inputs, q=inputs.q.to(dtype))
    shifted = dataclasses.replace(inputs, v_cache=off_word(inputs.v_cache))
    for case, words in ((inputs, True), (shifted, False)):
        assert word_values(case, interp=False) is words
        for n, w, st in DECODE_TILES:
            run, plan = paged_launch(case, head_dim ** -0.5, {"BLOCK_N": n, "num_warps": w, "num_stages": st})
            assert plan["fp8_values"] == ("words" if words else "bytes")  # recorded with the benchmark's config
            result = Oracle.serving(case).check(run())
            assert result.passed, f"tile {n, w, st}, words {words}: {result.message}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PREFETCH is inline PTX before the PDL wait: a GPU")
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_triton_split_decode_prefetches_under_pdl_and_gives_the_oracle_output(head_dim):
    """Where a step splits on Hopper its kernels run under PDL, and the first chunk's program of each sequence asks
    the L2 for its lookups before the wait (PREFETCH): on every tile of the tuner's space, with 1 and 4 new tokens,
    long-tailed lengths (NaN in unused slots) and a head dim that pads the tile (96), the output is the oracle's, with
    and without it (also worth running under compute-sanitizer's memcheck)."""
    from impls._plans import dependent_launch_available
    from impls.triton_fa.paged import DECODE_TILES, paged_launch

    if not dependent_launch_available(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    for sq in (1, 4):
        inputs = paged((*TINY[:3], head_dim), 3, 300, sq=sq, lengths="longtail").make_inputs("cuda")
        oracle = Oracle.serving(inputs)
        for (n, w, st), prefetch in itertools.product(DECODE_TILES, (True, False)):
            config = {"BLOCK_N": n, "num_warps": w, "num_stages": st, "PLAN_MIN_TILES": 1, "PREFETCH": prefetch}
            run, plan = paged_launch(inputs, head_dim ** -0.5, config)
            assert plan["num_splits"] > 1 and plan["PDL"] and plan["PREFETCH"] is prefetch, plan
            result = oracle.check(run())
            assert result.passed, f"tile {n, w, st}, {sq} new, prefetch {prefetch}: {result.message}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the narrowed combine: CPU")
def test_triton_decode_with_a_narrowed_combine(monkeypatch):
    """The Triton combine with head-dim slices (as many chunks make it) is correct: a small
    ``COMBINE_STEP_ELEMENTS`` narrows the slices of a CPU twin's few chunks."""
    pytest.importorskip("triton")
    import impls._plans

    monkeypatch.setattr(impls._plans, "COMBINE_STEP_ELEMENTS", 64)
    inputs = PRESETS["serving-cpu"][4].make_inputs("cpu")  # MQA, 300 tokens: split under the interpreter
    from impls.triton_fa.paged import INTERPRETER_DECODE_CONFIG, paged_launch

    run, plan = paged_launch(inputs, inputs.head_dim ** -0.5, INTERPRETER_DECODE_CONFIG)
    assert plan["num_splits"] > 4 and impls._plans.combine_plan(plan["num_splits"], inputs.head_dim)[0] == 16
    result = Oracle.serving(inputs).check(run())
    assert result.passed, result.message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the split plans: CPU")
def test_triton_decode_plans_for_more_or_fewer_programs_are_correct():
    """The decode tuner's plan axes (PLAN_PROGRAMS, PLAN_FIT) change the chunk count; each plan is still
    correct."""
    pytest.importorskip("triton")
    from impls.triton_fa.paged import INTERPRETER_DECODE_CONFIG, paged_launch

    inputs = PRESETS["serving-cpu"][4].make_inputs("cpu")  # MQA, 300 tokens
    splits = set()
    for programs, fit in ((2, False), (8, False), (1, True)):
        run, plan = paged_launch(inputs, inputs.head_dim ** -0.5, {**INTERPRETER_DECODE_CONFIG,
                                                                   "PLAN_PROGRAMS": programs, "PLAN_FIT": fit})
        result = Oracle.serving(inputs).check(run())
        assert result.passed, result.message
        splits.add(plan["num_splits"])
    assert len(splits) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the driver's occupancy of a compiled kernel: GPU")
@pytest.mark.parametrize("waves", [1, 2])
def test_triton_fitted_decode_plans_fill_whole_waves_of_resident_blocks(waves):
    """A fitted plan (PLAN_FIT) counts the compiled split kernel's resident blocks: its programs fit in
    ``waves`` x that x the SMs, and it is correct on every paged CPU twin and on the 70B slice at batch 1 (32K
    tokens: split)."""
    pytest.importorskip("triton")
    from impls.triton_fa.paged import DECODE_TILES, paged_launch

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    long_one = case_by_id("llama3-70b-tp8-paged-bf16-h8:1-q1-kv32768-uniform-p16-d128")
    for case in [c for c in PRESETS["serving-cpu"] if c.op == "paged"] + [long_one]:
        inputs = case.make_inputs("cuda")
        oracle = Oracle.serving(inputs)
        for n, w, st in DECODE_TILES:
            run, plan = paged_launch(inputs, inputs.head_dim ** -0.5, {
                "BLOCK_N": n, "num_warps": w, "num_stages": st, "PLAN_PROGRAMS": waves, "PLAN_FIT": True})
            resident = plan["programs_per_sm"] // waves
            assert plan["programs_per_sm"] == waves * resident and 1 <= resident <= 32
            chunks = sum(-(-length // plan["split_len"]) for length in inputs.seqlens)
            assert plan["num_splits"] == 1 or chunks * inputs.k_cache.shape[2] <= waves * resident * sm_count
            assert plan["num_splits"] > 1 or case is not long_one
            result = oracle.check(run())
            assert result.passed, f"{case.id} {n}x{w}x{st}: {result.message}"


@pytest.mark.parametrize("mask_free", [True, False])
@pytest.mark.parametrize("case", [c for preset in ("serving-cpu", "models-serving-cpu") for c in PRESETS[preset]
                                  if c.op == "paged"], ids=lambda c: c.id)
def test_triton_decode_with_and_without_the_mask_free_loop(case, mask_free):
    """Both forms of the decode tuner's MASK_FREE axis are correct on every paged CPU twin (several new tokens,
    ragged last pages, NaN in the unused slots; the models' windows, softcap and head dims 96 and 256): the
    mask-free loop stops before any position that some new token must not see or that is past the sequence.
    Under the interpreter on CPU; on a GPU compiled, with each tile shape of the tuner's space that fits in
    shared memory (only D=256 leaves one out: the double-buffered 128-key tile, as the tuner does)."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from impls.triton_fa.paged import DECODE_SPACE, DECODE_TILES, INTERPRETER_DECODE_CONFIG, paged_launch

    assert {config["MASK_FREE"] for config in DECODE_SPACE} == {True, False}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = case.make_inputs(device)
    configs = [INTERPRETER_DECODE_CONFIG] if device == "cpu" else [
        {"BLOCK_N": n, "num_warps": w, "num_stages": st} for n, w, st in DECODE_TILES]
    oracle = Oracle.serving(inputs)
    for config in configs:
        run, _ = paged_launch(inputs, inputs.head_dim ** -0.5, {**config, "MASK_FREE": mask_free})
        try:
            out = run()
        except OutOfResources:
            assert inputs.head_dim > 128 and config["num_stages"] >= 5, f"{config} refused at D={inputs.head_dim}"
            continue
        result = oracle.check(out)
        assert result.passed, f"{config}: {result.message}"


def test_triton_decode_tuner_leaves_out_configs_beyond_shared_memory():
    """A decode config whose buffers do not fit (Triton raises OutOfResources when it compiles or launches it: the
    double-buffered 128-key tile at D=256) is left out of the tuning; the others are timed, each kernel and chunk
    length once; with none left the call is refused with the reason."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from impls.triton_fa.paged import DECODE_SPACE, decode_candidates

    calls = []

    def launch(config):
        def run():
            calls.append(config)
            if config["num_stages"] >= 5:
                raise OutOfResources(262144, 232448, "shared memory")
        return run, {"split_len": 1024 if config["PLAN_FIT"] else 2048}

    kept = decode_candidates(DECODE_SPACE, launch)
    assert kept and all(config["num_stages"] < 5 for config, _ in kept)
    assert {config["num_stages"] for config in calls} >= {5}  # tried, then left out
    forms = [(c["BLOCK_N"], c["num_warps"], c["num_stages"], c["MASK_FREE"], c["PLAN_FIT"]) for c, _ in kept]
    assert len(forms) == len(set(forms))  # each kernel and chunk length once
    with pytest.raises(impls.Unsupported, match="shared memory"):
        decode_candidates([c for c in DECODE_SPACE if c["num_stages"] >= 5], launch)


def test_decode_tuners_time_a_step_that_fits_in_the_l2_over_copies_of_its_inputs(monkeypatch):
    """A step whose inputs fit in twice the L2 is timed cold by the decode tuners: each candidate's call runs over the
    inputs and then each copy of them (fresh memory, equal contents), enough copies that the others' bytes evict the
    L2 between a copy's uses; a step of twice the L2 or more, or off CUDA, keeps its calls as they are."""
    from impls import timing

    inputs = paged_inputs()
    size = sum(t.nbytes for t in timing.input_tensors(inputs).values())
    assert size == sum(t.nbytes for t in (inputs.q, inputs.k_cache, inputs.v_cache, inputs.block_table,
                                          inputs.cache_seqlens))
    ran = []
    candidates = [(name, lambda name=name: ran.append((name, inputs))) for name in ("a", "b")]

    def call_on(copy, name):
        return lambda: ran.append((name, copy))

    assert timing.cold_candidates(candidates, inputs, call_on) is candidates  # CPU: no L2 to evict
    monkeypatch.setattr(timing, "l2_bytes", lambda device: size)  # the inputs fit in twice the L2
    cold = timing.cold_candidates(candidates, inputs, call_on)
    assert [name for name, _ in cold] == ["a", "b"]
    cold[1][1]()
    assert [name for name, _ in ran] == ["b"] * 3  # itself and 2 copies, whose bytes are twice the L2
    assert ran[0][1] is inputs and len({id(copy.k_cache) for _, copy in ran}) == 3
    for _, copy in ran[1:]:
        assert copy.k_cache.data_ptr() != inputs.k_cache.data_ptr()
        torch.testing.assert_close(copy.k_cache, inputs.k_cache, rtol=0, atol=0, equal_nan=True)  # NaN in free slots
        assert torch.equal(copy.block_table, inputs.block_table) and copy.page_size == inputs.page_size
    monkeypatch.setattr(timing, "l2_bytes", lambda device: size // 2)  # twice the L2 is the step: it evicts itself
    assert timing.cold_candidates(candidates, inputs, call_on) is candidates


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the unsplit decode: CPU")
def test_triton_decode_without_a_split_writes_the_output_directly(monkeypatch):
    """One chunk per sequence: the split kernel writes the output rows, and no combine is launched."""
    pytest.importorskip("triton")
    import impls.triton_fa.decode
    from impls.triton_fa.paged import INTERPRETER_DECODE_CONFIG, paged_launch

    def no_combine(*args, **kwargs):
        raise AssertionError("the combine was launched for an unsplit decode")

    monkeypatch.setattr(impls.triton_fa.decode, "paged_decode_combine", no_combine)
    inputs = PRESETS["serving-cpu"][4].make_inputs("cpu")  # MQA, 300 tokens: one chunk of 512 keys
    run, plan = paged_launch(inputs, inputs.head_dim ** -0.5, {**INTERPRETER_DECODE_CONFIG, "BLOCK_N": 512})
    assert plan["num_splits"] == 1
    result = Oracle.serving(inputs).check(run())
    assert result.passed, result.message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the split decode: CPU")
def test_triton_decode_asked_to_prefetch_runs_without_it_under_the_interpreter():
    """PREFETCH is inline PTX (prefetch.global.L2) before the PDL wait, neither of which Triton's interpreter runs: a
    config asking for it runs there without it, split and combined, says so, and stays correct
    (tests/test_triton_compile.py has the PTX)."""
    pytest.importorskip("triton")
    from impls.triton_fa.paged import INTERPRETER_DECODE_CONFIG, paged_launch

    inputs = PRESETS["serving-cpu"][0].make_inputs("cpu")
    run, plan = paged_launch(inputs, inputs.head_dim ** -0.5, {**INTERPRETER_DECODE_CONFIG, "PREFETCH": True})
    assert plan["num_splits"] > 1 and plan["PDL"] is False and plan["PREFETCH"] is False, plan
    result = Oracle.serving(inputs).check(run())
    assert result.passed, result.message


@pytest.mark.parametrize("pdl", only_fast([True, False, None], [None]))
def test_triton_decode_with_and_without_programmatic_dependent_launch(pdl):
    """Both launch modes of the decode (config ``PDL``; by default on where the step splits) are correct on every
    paged CPU twin, split and unsplit. On a GPU the steps also run back to back in one CUDA graph, where under PDL
    each kernel starts while the one before it still runs (it waits for it before its first load). Hopper and later
    take it; the interpreter and older GPUs launch as before, and the plan says which ran."""
    pytest.importorskip("triton")
    from impls.triton_fa.paged import INTERPRETER_DECODE_CONFIG, paged_launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hopper = device == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    switch = {} if pdl is None else {"PDL": pdl}
    config = {**INTERPRETER_DECODE_CONFIG, **switch} if device == "cpu" else {
        "BLOCK_N": 16, "num_warps": 4, "num_stages": 3, **switch}  # 300 tokens in 16-key tiles: split
    splits = set()
    for case in [c for c in PRESETS["serving-cpu"] if c.op == "paged"]:
        inputs = case.make_inputs(device)
        run, plan = paged_launch(inputs, inputs.head_dim ** -0.5, config)
        assert plan["PDL"] is (hopper and (plan["num_splits"] > 1 if pdl is None else pdl))
        splits.add(plan["num_splits"] > 1)
        out = run()
        if device == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(4):
                    out = run()
            out.zero_()
            graph.replay()
        result = Oracle.serving(inputs).check(out)
        assert result.passed, f"{case.id}: {result.message}"
    assert splits == {True, False}  # both the two-launch and the one-launch step
