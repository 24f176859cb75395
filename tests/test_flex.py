"""FlexAttention's adapter: its compiled function must stay compiled over a whole run of cases."""

from __future__ import annotations

import pytest
import torch

from impls import flex
from impls.contract import NO_WINDOW
from tests.tiers import only_fast


def test_compile_per_case_compiles_every_new_shape_past_dynamos_default_limit_of_eight() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append(graph)
        return graph.forward

    doubled = flex.compile_per_case(lambda x: x * 2, backend=counting_backend)
    shapes = range(1, 13)  # 12 cases: dynamo's default limit would run the last 4 eagerly, uncompiled
    for n in shapes:
        assert torch.equal(doubled(torch.ones(n)), torch.full((n,), 2.0))
    assert len(graphs) == len(shapes)
    assert torch._dynamo.config.fail_on_recompile_limit_hit  # past the new limit: an error, never eager


def whole_page_inputs(new_tokens: int, *, keep_nan: bool = False):
    """A paged twin (scattered pages, GQA 2) whose lengths are whole pages of 16 (as flex's paged entry requires).
    Unless ``keep_nan``, every unused slot finite (eager flex on CPU weights every slot of the cache, the unused ones
    by exactly 0) and the table's entries past a sequence's pages far out of range."""
    import dataclasses

    from suite.presets import paged

    inputs = paged(("", 4, 2, 64), 3, 100, lengths="longtail", sq=new_tokens).make_inputs("cpu")
    page = inputs.page_size
    lengths = torch.tensor([max(new_tokens, n) // page * page for n in inputs.seqlens], dtype=torch.int32)
    lengths = torch.clamp(lengths, min=page)
    if keep_nan:
        return dataclasses.replace(inputs, cache_seqlens=lengths)
    table = inputs.block_table.clone()
    for b, n in enumerate(lengths.tolist()):
        table[b, n // page:] = -(10**6)  # entries past a sequence's pages may hold anything
    return dataclasses.replace(inputs, cache_seqlens=lengths, block_table=table,
                               k_cache=inputs.k_cache.nan_to_num(), v_cache=inputs.v_cache.nan_to_num())


@pytest.mark.parametrize("new_tokens", only_fast([1, 4], [1]))
@pytest.mark.parametrize(("window", "softcap"), [(NO_WINDOW, 0.0), ((40, 0), 0.0), (NO_WINDOW, 30.0)])
@pytest.mark.parametrize("full_blocks", only_fast([False, True], [False]))
def test_paged_block_mask_lists_each_sequences_pages_full_or_partial(new_tokens, window, softcap,
                                                                     full_blocks) -> None:
    """The paged block mask (key block = page) gives the oracle's output, and lists a page of a sequence as full
    exactly where every new token sees all its slots (``full_blocks``; else nothing as full), as partial where some
    token sees some (else every page some token sees): on CPU flex runs eagerly, over the mask_mod alone, so the
    lists are checked against the mask_mod slot by slot."""
    from suite.checks import Oracle

    inputs = whole_page_inputs(new_tokens)
    mask = flex.paged_block_mask(inputs, window[0], full_blocks=full_blocks)
    q = inputs.q.transpose(1, 2)
    k, v = flex.physical_cache(inputs)
    out = flex.flex_function("cpu")(q, k, v, block_mask=mask, score_mod=flex._softcap_mod(softcap), enable_gqa=True,
                                    scale=0.125).transpose(1, 2)
    result = Oracle.serving(inputs, scale=0.125, window=window, softcap=softcap).check(out)
    assert result.passed, result.message

    page, slots = inputs.page_size, inputs.k_cache.shape[0] * inputs.page_size
    lean = flex.paged_block_mask(inputs, window[0], full_blocks=full_blocks, listed_only=True).mask_mod

    def slot_by_slot(mask_mod, b: int) -> torch.Tensor:  # (new token, page, slot in page)
        return torch.stack([torch.stack([mask_mod(torch.tensor(b), 0, torch.tensor(i), torch.tensor(s))
                                         for s in range(slots)]) for i in range(new_tokens)]).view(new_tokens, -1, page)

    for b in range(inputs.q.shape[0]):
        seen = slot_by_slot(mask.mask_mod, b)
        listed = [p for p in range(seen.shape[1]) if seen[:, p].any()]
        assert torch.equal(slot_by_slot(lean, b)[:, listed], seen[:, listed])  # the compiled entry's mask_mod
        partial = {int(p) for p in mask.kv_indices[b, 0, 0, :int(mask.kv_num_blocks[b, 0, 0])]}
        whole = {p for p in range(seen.shape[1]) if seen[:, p].all()}
        some = {p for p in range(seen.shape[1]) if seen[:, p].any()}
        if not full_blocks:
            assert mask.full_kv_num_blocks is None
            assert partial == some
            continue
        full = {int(p) for p in mask.full_kv_indices[b, 0, 0, :int(mask.full_kv_num_blocks[b, 0, 0])]}
        assert full == whole
        assert partial == some - whole


@pytest.mark.parametrize(("batch", "length", "kv_heads", "full"), [
    (1, 32768, 8, True),  # one sequence fills the cache: it covers all 32 ranges
    (64, 8192, 8, True),  # 512 kv heads for 132 SMs: one range
    (256, 8192, 1, True),
    (16, 32768, 8, False),  # two ranges, each sequence within one: 128 programs busy of 256
    (16, 32768, 1, False),  # 16 ranges: 16 programs busy of 256
    (64, 8192, 1, False),
])
def test_full_blocks_only_where_flex_decoding_splits_every_sequence(batch, length, kv_heads, full) -> None:
    """The H200's measured cases (132 SMs, a spare page of 64 slots in the cache): full blocks where every sequence
    covers every one of the decoding kernel's key ranges, partial blocks elsewhere."""
    slots = batch * length + 64
    assert flex.full_blocks_split_well([length] * batch, slots, kv_heads, sms=132) is full


def test_paged_kernel_options_narrow_the_main_kernels_key_tile_to_a_page() -> None:
    """Groups that flex's decoding kernel packs (powers of two) keep its own choice; any other group runs the main
    kernel, whose key tile must divide a page."""
    assert flex.paged_kernel_options(1, 16) is None and flex.paged_kernel_options(8, 16) is None
    assert flex.paged_kernel_options(7, 16) == {"BLOCK_N": 16}
    assert flex.paged_kernel_options(7, 128) == {"BLOCK_N": 64}
    assert 128 % flex.paged_kernel_options(3, 128)["BLOCK_N"] == 0


def test_paged_flex_refuses_what_it_would_get_wrong() -> None:
    """A length inside a page (flex would weight the slots past it by 0, and 0 x NaN is NaN) and a page at two
    places of the table are refused with the reason; on CPU the registry refuses it (eager flex scores every slot)."""
    import dataclasses

    import impls

    inputs = whole_page_inputs(1)
    ragged = dataclasses.replace(inputs, cache_seqlens=inputs.cache_seqlens - 1)
    with pytest.raises(impls.Unsupported, match=r"cache_seqlens\[0\] = \d+ ends inside a page of 16"):
        flex.flex_paged(ragged, scale=0.125)
    table = inputs.block_table.clone()
    table[1, 0] = table[0, 1]  # page at place 1 of sequence 0 and place 0 of sequence 1
    with pytest.raises(impls.Unsupported, match="two positions"):
        flex.flex_paged(dataclasses.replace(inputs, block_table=table), scale=0.125)
    with pytest.raises(impls.Unsupported, match="cuda only"):
        impls.get("flex", "paged").prepare(inputs)


@pytest.mark.slow
@pytest.mark.parametrize(("full_blocks", "window"), [(False, NO_WINDOW), (True, (40, 0))])
def test_compiled_paged_flex_reads_only_the_pages_its_block_mask_lists(full_blocks, window) -> None:
    """Compiled (inductor's CPU kernel, as on a GPU), flex visits only the pages the mask lists: the spare pages
    and the table entries past each sequence's pages hold NaN, and the output is the oracle's, with the mask_mod
    the entry compiles (``listed_only``). One compile each, ~20 s."""
    from torch.nn.attention.flex_attention import flex_attention

    from suite.checks import Oracle

    inputs = whole_page_inputs(4, keep_nan=True)
    q = inputs.q.transpose(1, 2)
    k, v = flex.physical_cache(inputs)
    assert torch.isnan(k).any() and torch.isnan(v).any()
    mask = flex.paged_block_mask(inputs, window[0], full_blocks=full_blocks, listed_only=True)
    out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=mask, enable_gqa=True, scale=0.125)
    result = Oracle.serving(inputs, scale=0.125, window=window).check(out.transpose(1, 2))
    assert result.passed, result.message


def test_a_compile_failure_is_reported_by_its_cause():
    """An inductor worker's error arrives as a whole traceback with torch's hints after it: the reason given is
    the last error raised in it, the cause."""
    traceback = ("SubprocException: An exception occurred in a subprocess:\n\nName=triton_tem_fused_flex_attention_0\n"
                 "Traceback (most recent call last):\n  File \"subproc_pool.py\", line 457, in do_job\n"
                 "    result = job()\n"
                 "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 264192\n\n"
                 "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace (please do this especially if you're "
                 "reporting a bug to PyTorch). For even more developer context, set TORCH_LOGS=\"+dynamo\"\n")
    reason = flex.compile_error(RuntimeError(traceback))
    assert reason == ("RuntimeError: triton.runtime.errors.OutOfResources: out of resource: shared memory, "
                      "Required: 264192")
    # torch 2.11 on an H200, a physical cache of 2^31 elements or more: Triton's compile error
    # names the line first and the cause after the source excerpt
    triton_error = ("CompilationError: at 194:23:\n\n    acc, l_i, m_i = forward_inner(\n"
                    "        block_n_start, block_n_end if block_n_end <= block_n_last_valid else block_n_last_valid,\n"
                    "                       ^\nAssertionError('Ternary expression with dynamic condition has "
                    "inconsistent types int64 and int32')\n\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace\n")
    assert flex.compile_error(RuntimeError(triton_error)) == (
        "RuntimeError: AssertionError('Ternary expression with dynamic condition has inconsistent types int64 and "
        "int32')")
    assert flex.compile_error(RuntimeError("no kernel for this shape")) == "RuntimeError: no kernel for this shape"
    assert flex.compile_error(RuntimeError("")) == "RuntimeError: "
