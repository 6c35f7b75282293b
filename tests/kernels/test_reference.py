"""The torch reference attention against a naive per-token loop."""

from __future__ import annotations

import pytest
import torch

from arborlm.kernels.reference import decode_attention, extend_attention


def naive_attention(q, k, v, scale, q_pos, sliding_window=None, logit_cap=0.0):
    """One query token. q: (Hq, D); k, v: (L, Hkv, D) of positions 0..L-1."""
    group = q.shape[0] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[0]):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = (kh @ q[h].double()) * scale
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        pos = torch.arange(k.shape[0])
        allowed = pos <= q_pos
        if sliding_window is not None:
            allowed &= pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[h] = (torch.softmax(scores, 0) @ vh).to(q.dtype)
    return out


def make_pool(prefix_lens, extend_lens, num_kv_heads, head_dim, seed=0):
    """Random K/V buffers and a shuffled req_to_token mapping for a ragged batch."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_slots = sum(seq_lens) + 1
    k_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    v_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    batch = len(seq_lens)
    req_to_token = torch.zeros(batch + 2, max(seq_lens) + 7, dtype=torch.int32)
    req_pool_indices = torch.randperm(batch + 2, generator=gen)[:batch]
    slots = (torch.randperm(num_slots - 1, generator=gen) + 1).to(torch.int32)
    start = 0
    for row, n in zip(req_pool_indices.tolist(), seq_lens):
        req_to_token[row, :n] = slots[start:start + n]
        start += n
    return k_buffer, v_buffer, req_to_token, req_pool_indices, torch.tensor(seq_lens)


CASES = [  # (prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap)
    ([0], [1], 2, 2, None, 0.0),
    ([0, 0], [5, 3], 4, 4, None, 0.0),
    ([0, 17, 50], [7, 1, 12], 6, 2, None, 0.0),
    ([3, 0, 31, 8], [9, 4, 2, 20], 6, 6, None, 0.0),
    ([49, 12], [3, 25], 9, 3, None, 0.0),
    ([20, 0, 5], [10, 13, 6], 6, 2, 8, 0.0),
    ([11, 2], [6, 9], 4, 2, None, 5.0),
]


@pytest.mark.parametrize("prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap", CASES)
def test_extend_matches_naive(prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap):
    head_dim = 16
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = make_pool(
        prefix_lens, extend_lens, num_kv_heads, head_dim
    )
    q = torch.randn(sum(extend_lens), num_q_heads, head_dim, generator=torch.Generator().manual_seed(1))
    scale = head_dim**-0.5
    out = extend_attention(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
        torch.tensor(prefix_lens), torch.tensor(extend_lens), scale, sliding_window, logit_cap,
    )
    assert out.shape == q.shape
    token = 0
    for row, prefix, n, seq_len in zip(req_pool_indices.tolist(), prefix_lens, extend_lens, seq_lens.tolist()):
        slots = req_to_token[row, :seq_len].long()
        for i in range(n):
            expected = naive_attention(
                q[token], k_buffer[slots], v_buffer[slots], scale, prefix + i, sliding_window, logit_cap
            )
            torch.testing.assert_close(out[token], expected, atol=1e-5, rtol=1e-5)
            token += 1


@pytest.mark.parametrize("prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap", CASES)
def test_decode_matches_naive(prefix_lens, extend_lens, num_q_heads, num_kv_heads, sliding_window, logit_cap):
    head_dim = 16
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = make_pool(
        prefix_lens, extend_lens, num_kv_heads, head_dim
    )
    q = torch.randn(len(prefix_lens), num_q_heads, head_dim, generator=torch.Generator().manual_seed(2))
    scale = head_dim**-0.5
    out = decode_attention(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale, sliding_window, logit_cap
    )
    assert out.shape == q.shape
    for b, (row, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        slots = req_to_token[row, :seq_len].long()
        expected = naive_attention(
            q[b], k_buffer[slots], v_buffer[slots], scale, seq_len - 1, sliding_window, logit_cap
        )
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)


def test_decode_equals_last_extend_token():
    """A decode step computes what an extend of one token computes."""
    prefix_lens, extend_lens = [4, 30, 0], [1, 1, 1]
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = make_pool(prefix_lens, extend_lens, 2, 8)
    q = torch.randn(3, 6, 8)
    extend = extend_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                              torch.tensor(prefix_lens), torch.tensor(extend_lens), 0.3)
    decode = decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, 0.3)
    torch.testing.assert_close(decode, extend, atol=1e-6, rtol=1e-6)


def test_bfloat16_close_to_float32():
    prefix_lens, extend_lens = [40, 3], [1, 1]
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = make_pool(prefix_lens, extend_lens, 3, 64)
    q = torch.randn(2, 9, 64)
    ref = decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, 0.125)
    out = decode_attention(q.bfloat16(), k_buffer.bfloat16(), v_buffer.bfloat16(), req_to_token,
                           req_pool_indices, seq_lens, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
