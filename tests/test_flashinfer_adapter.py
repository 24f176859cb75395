"""The FlashInfer adapter without FlashInfer: its page list, and the reason it gives where it cannot run."""

from dataclasses import replace

import torch

from impls import load_all
from impls._registry import REGISTRY
from impls.flashinfer import page_table_csr
from suite.cases import Case


def test_block_table_becomes_flashinfer_page_list():
    # Lengths that end inside a page, exactly at its end, and within the first page; the table's spare entries
    # (past each sequence's pages) must not reach the list.
    table = torch.tensor([[5, 2, 9, 7], [1, 3, 7, 7], [4, 7, 7, 7]], dtype=torch.int32)
    indptr, indices, last = page_table_csr(table, (40, 32, 3), page_size=16)
    assert indptr.tolist() == [0, 3, 5, 6]
    assert indices.tolist() == [5, 2, 9, 1, 3, 4]
    assert last.tolist() == [8, 16, 3]
    assert {t.dtype for t in (indptr, indices, last)} == {torch.int32}


def test_page_list_of_a_serving_case_covers_every_cached_token():
    case = Case(3, 8, 2, 1, 100, 64, "fp16", True, op="paged", page_size=16, lengths="longtail")
    inputs = case.make_inputs("cpu")
    indptr, indices, last = page_table_csr(inputs.block_table, inputs.seqlens, inputs.page_size)
    for b, n in enumerate(inputs.seqlens):
        pages = indices[indptr[b]:indptr[b + 1]]
        assert (len(pages) - 1) * inputs.page_size + int(last[b]) == n
        assert not torch.isnan(inputs.k_cache[pages.long()].flatten(0, 1)[:n]).any()  # no spare page is listed


def test_every_operation_says_why_it_cannot_run_here():
    load_all()
    for op in ("dense", "paged", "varlen"):
        impl = REGISTRY[op, "flashinfer"]
        reason = impl.availability("cpu")
        assert reason and "cuda" in reason
        if not torch.cuda.is_available():
            assert impl.availability("cuda")


def test_head_dims_that_read_out_of_bounds_are_refused_with_the_reason():
    # FlashInfer's prefill kernels take any head dim and read out of bounds below multiples of 64 (an illegal
    # memory access on an H200 at D=96, which ends the process's CUDA context): refused before any launch.
    load_all()
    for op in ("dense", "paged", "varlen"):
        impl = replace(REGISTRY[op, "flashinfer"], devices=("cpu",), requires=None)  # as if it were installed
        assert "head dim 96 not supported" in impl.support_reason(torch.bfloat16, "cpu", 96)
        assert impl.support_reason(torch.bfloat16, "cpu", 128) is None
