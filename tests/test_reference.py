import torch

from impls.reference import attention_ref, causal_visible


def test_causal_is_bottom_right_aligned():
    visible = causal_visible(2, 4)
    assert visible.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert causal_visible(3, 2).tolist() == [[False, False], [True, False], [True, True]]


def test_rows_that_see_no_key_are_zero():
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    out = attention_ref(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    assert (out[:, :, :2] == 0).all()
    assert (out[:, :, 2:] != 0).any()


def test_gqa_query_head_reads_kv_head_h_over_group():
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out = attention_ref(q, k, v)
    for h in range(6):
        alone = attention_ref(q[:, h : h + 1], k[:, h // 3 : h // 3 + 1], v[:, h // 3 : h // 3 + 1])
        torch.testing.assert_close(out[:, h : h + 1], alone)


def test_chunking_does_not_change_the_result():
    q, k, v = torch.randn(2, 2, 37, 8), torch.randn(2, 2, 41, 8), torch.randn(2, 2, 41, 8)
    whole = attention_ref(q, k, v, causal=True, chunk_bytes=None)
    chunked = attention_ref(q, k, v, causal=True, chunk_bytes=2 * 2 * 41 * 16 * 5)
    torch.testing.assert_close(whole, chunked, rtol=0, atol=0)


def test_matches_the_textbook_formula():
    q, k, v = (torch.randn(1, 1, 6, 4, dtype=torch.float64) for _ in range(3))
    expected = torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1) @ v
    torch.testing.assert_close(attention_ref(q, k, v, scale=0.5), expected)
