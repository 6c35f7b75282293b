"""Torch attention over the paged KV layout: the CPU path and the kernels' oracle.

Both functions read each request's K/V through `req_to_token`, gather them into a
padded `(batch, max_len, kv_heads, head_dim)` block with a mask, and attend with
`torch.nn.functional.scaled_dot_product_attention` (softmax accumulated in float32
by the CPU kernels), or with explicit float32 matmuls when `logit_cap` is set.
The Triton kernels in this package keep these signatures and are tested against them.

Masking follows SGLang / Hugging Face: a query at position `p` sees keys at
positions `<= p`, and with `sliding_window = w` only those `> p - w`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix and themselves.

    Parameters
    ----------
    q: (num_tokens, num_q_heads, head_dim), new tokens request after request.
    k_buffer, v_buffer: (slots, num_kv_heads, head_dim), one layer of the pool,
        already holding the new tokens' K/V.
    req_to_token: (rows, max_context_len) int, slot of each position.
    req_pool_indices: (batch,) int64, each request's row.
    seq_lens: (batch,) int64, prefix + new tokens.
    extend_prefix_lens: (batch,) int64, cached tokens before the new ones.
    extend_seq_lens: (batch,) int64, new tokens (sum = num_tokens).
    scale: softmax scale, usually `head_dim ** -0.5`.
    sliding_window: attend only to the last `sliding_window` positions; None = all.
    logit_cap: if > 0, scores become `logit_cap * tanh(scores / logit_cap)`.

    Returns
    -------
    (num_tokens, num_q_heads, head_dim) tensor in q's dtype.
    """
    batch = int(req_pool_indices.shape[0])
    num_tokens = int(q.shape[0])
    device = q.device
    max_new = int(extend_seq_lens.max())
    max_len = int(seq_lens.max())
    # Where each new token sits in the padded (batch, max_new) query block.
    token_req = torch.repeat_interleave(torch.arange(batch, device=device), extend_seq_lens)
    starts = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens
    token_col = torch.arange(num_tokens, device=device) - starts[token_req]
    q_pad = q.new_zeros((batch, max_new) + tuple(q.shape[1:]))
    q_pad[token_req, token_col] = q

    k, v, key_valid = _gather_kv(k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, max_len)
    q_pos = extend_prefix_lens[:, None] + torch.arange(max_new, device=device)  # (B, Lq)
    k_pos = torch.arange(max_len, device=device)  # (Lk,)
    mask = key_valid[:, None, :] & (k_pos[None, None, :] <= q_pos[:, :, None])  # (B, Lq, Lk)
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    o = attend(q_pad.transpose(1, 2), k, v, mask[:, None], scale, logit_cap)  # (B, Hq, Lq, D)
    return o.transpose(1, 2)[token_req, token_col]


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """Attention of one new token per request over all of that request's tokens.

    Parameters
    ----------
    q: (batch, num_q_heads, head_dim), the token at position `seq_len - 1`.
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale,
    sliding_window, logit_cap: as in `extend_attention`.

    Returns
    -------
    (batch, num_q_heads, head_dim) tensor in q's dtype.
    """
    max_len = int(seq_lens.max())
    k, v, mask = _gather_kv(k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, max_len)
    if sliding_window is not None:
        k_pos = torch.arange(max_len, device=q.device)
        mask &= k_pos[None, :] > (seq_lens[:, None] - 1 - sliding_window)
    o = attend(q[:, :, None, :], k, v, mask[:, None, None, :], scale, logit_cap)  # (B, Hq, 1, D)
    return o[:, :, 0, :]


def _gather_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded K and V `(B, kv_heads, max_len, D)` and the valid-key mask `(B, max_len)`."""
    key_valid = torch.arange(max_len, device=seq_lens.device)[None, :] < seq_lens[:, None]
    slots = req_to_token[req_pool_indices, :max_len].to(torch.int64)
    slots = slots.masked_fill(~key_valid, 0)  # padding slot 0: stale rows past seq_len are ignored
    # index_select copies whole rows; it is several times faster than k_buffer[slots] on CPU.
    flat = slots.view(-1)
    shape = (slots.shape[0], max_len) + tuple(k_buffer.shape[1:])
    k = k_buffer.index_select(0, flat).view(shape).transpose(1, 2)
    v = v_buffer.index_select(0, flat).view(shape).transpose(1, 2)
    return k, v, key_valid


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, logit_cap: float
) -> torch.Tensor:
    """Masked attention with GQA.

    q: (B, Hq, Lq, D); k, v: (B, Hkv, Lk, D); mask: (B, 1, Lq, Lk) bool, True = attend.
    Query head `h` uses KV head `h // (Hq // Hkv)`, as in Hugging Face's `repeat_kv`.
    """
    if logit_cap <= 0:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.float().reshape(batch, num_kv_heads, group * q_len, head_dim)
    scores = (qg @ k.float().transpose(-1, -2)) * scale  # (B, Hkv, G*Lq, Lk)
    scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.view(batch, num_kv_heads, group, q_len, -1)
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # mask: (B, 1, 1, Lq, Lk)
    probs = torch.softmax(scores, dim=-1).view(batch, num_kv_heads, group * q_len, -1)
    o = probs @ v.float()
    return o.view(batch, num_q_heads, q_len, head_dim).to(q.dtype)
