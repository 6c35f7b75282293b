"""The fast torch attention (CPU serving path) against the reference oracle."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from arborlm.kernels import reference, torch_native
from tests.kernels.test_reference import CASES, make_pool

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass
class ExtendCase:
    """A ragged extend step on a random pool, with the oracle's output."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix: torch.Tensor
    new: torch.Tensor
    q: torch.Tensor
    expected: torch.Tensor


def extend_case(prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap, dtype, seed):
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = make_pool(
        prefix_lens, extend_lens, num_kv_heads, HEAD_DIM
    )
    k_buffer, v_buffer = k_buffer.to(dtype), v_buffer.to(dtype)
    prefix, new = torch.tensor(prefix_lens), torch.tensor(extend_lens)
    q = torch.randn(sum(extend_lens), num_q_heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)
    expected = reference.extend_attention(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, prefix, new, SCALE, sliding_window, logit_cap
    )
    return ExtendCase(k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, prefix, new, q, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap", CASES)
def test_extend_matches_reference(prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap, dtype):
    c = extend_case(prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap, dtype, seed=1)
    metadata = torch_native.build_extend_metadata(
        c.req_to_token, c.req_pool_indices, c.seq_lens, c.prefix, c.new, max(extend_lens), int(c.seq_lens.max())
    )
    out = torch_native.extend_attention(c.q, c.k_buffer, c.v_buffer, metadata, SCALE, sliding_window, logit_cap)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), c.expected.float(), atol=TOLERANCE[dtype], rtol=0)


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


MIXED_CASES = [  # (prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap)
    ([40, 0, 17], [1, 30, 1], 6, 2, None, 0.0),  # decode tokens riding along a prefill
    ([5, 60, 0, 9], [1, 1, 12, 1], 4, 4, None, 0.0),
    ([30, 3], [1, 20], 6, 2, 8, 0.0),  # sliding window
    ([25, 2, 7], [1, 9, 1], 4, 2, None, 5.0),  # logit cap
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap", MIXED_CASES)
def test_mixed_extend_matches_reference(
    prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap, dtype
):
    """One-token requests in an extend step take the decode path; results equal the oracle's."""
    c = extend_case(prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap, dtype, seed=3)
    metadata = torch_native.build_extend_step_metadata(
        c.req_to_token, c.req_pool_indices, c.seq_lens, c.prefix, c.new, list(extend_lens), c.seq_lens.tolist(),
        num_kv_heads,
    )
    assert isinstance(metadata, torch_native.MixedMetadata)
    # Only the longer requests are padded: the extend part's query block is theirs alone.
    assert metadata.extend.batch_size == sum(1 for n in extend_lens if n > 1)
    out = torch_native.mixed_attention(c.q, c.k_buffer, c.v_buffer, metadata, SCALE, sliding_window, logit_cap)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), c.expected.float(), atol=TOLERANCE[dtype], rtol=0)


def test_unmixed_extend_keeps_the_padded_path():
    """All-long or all-one-token steps use the plain extend metadata."""
    for extend_lens in ([3, 5], [1, 1]):
        prefix_lens = [4, 6]
        _, _, req_to_token, req_pool_indices, seq_lens = make_pool(prefix_lens, extend_lens, 2, HEAD_DIM)
        metadata = torch_native.build_extend_step_metadata(
            req_to_token, req_pool_indices, seq_lens, torch.tensor(prefix_lens), torch.tensor(extend_lens),
            extend_lens, seq_lens.tolist(), 2,
        )
        assert isinstance(metadata, torch_native.ExtendMetadata)
