"""The fast torch attention (CPU serving path) against the reference oracle."""

from __future__ import annotations

import pytest
import torch

from arborlm.kernels import reference, torch_native
from tests.kernels.test_reference import CASES, make_pool

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap", CASES)
def test_extend_matches_reference(prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap, dtype):
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = make_pool(
        prefix_lens, extend_lens, num_kv_heads, HEAD_DIM
    )
    k_buffer, v_buffer = k_buffer.to(dtype), v_buffer.to(dtype)
    prefix, new = torch.tensor(prefix_lens), torch.tensor(extend_lens)
    q = torch.randn(sum(extend_lens), num_q_heads, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = reference.extend_attention(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, prefix, new, SCALE, sliding_window, logit_cap
    )
    metadata = torch_native.build_extend_metadata(
        req_to_token, req_pool_indices, seq_lens, prefix, new, max(extend_lens), int(seq_lens.max())
    )
    out = torch_native.extend_attention(q, k_buffer, v_buffer, metadata, SCALE, sliding_window, logit_cap)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap", CASES)
def test_decode_matches_reference(prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap, dtype):
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = make_pool(
        prefix_lens, extend_lens, num_kv_heads, HEAD_DIM
    )
    k_buffer, v_buffer = k_buffer.to(dtype), v_buffer.to(dtype)
    q = torch.randn(len(extend_lens), num_q_heads, HEAD_DIM, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = reference.decode_attention(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, SCALE, sliding_window, logit_cap
    )
    metadata = torch_native.build_decode_metadata(
        req_to_token, req_pool_indices, seq_lens, int(seq_lens.max()), num_kv_heads
    )
    out = torch_native.decode_attention(q, k_buffer, v_buffer, metadata, SCALE, sliding_window, logit_cap)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)
