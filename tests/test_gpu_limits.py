"""Our kernels' index arithmetic past 2**31 elements (GPU only).

B=1, Hq=Hkv=512, S=32768, D=128 in fp16: each of q, k, v, o holds 2**31 elements (4 GiB), so the offset of
the last head (511 * 32768 * 128) exceeds what a 32-bit index holds. The last head's last 128 query rows are
checked: with bottom-right causal alignment they are exactly the problem q[..., -128:, :] against all keys.
"""

import pytest
import torch

import impls
from suite.checks import Oracle

SHAPE = (1, 512, 32768, 128)
ROWS = 128


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["triton", "cutile"])
def test_more_than_2_31_elements(name, causal):
    impl = impls.get(name)
    reason = impl.availability("cuda")
    if reason:
        pytest.skip(reason)
    needed = 4 * torch.Size(SHAPE).numel() * 2
    if torch.cuda.mem_get_info()[0] < 1.2 * needed:
        pytest.skip(f"needs {needed / 2**30:.0f} GiB of free device memory")
    gen = torch.Generator(device="cuda").manual_seed(31)
    q, k, v = (torch.randn(SHAPE, generator=gen, device="cuda", dtype=torch.float16) for _ in range(3))
    assert q.numel() >= 2**31
    out = impl(q, k, v, causal=causal)
    last = slice(SHAPE[1] - 1, SHAPE[1])
    q_rows = q[:, last, -ROWS:]
    oracle = Oracle.dense(q_rows.contiguous(), k[:, last], v[:, last], causal=causal)
    result = oracle.check(out[:, last, -ROWS:].contiguous())
    assert result.passed, result.message
    del q, k, v, out
    torch.cuda.empty_cache()
