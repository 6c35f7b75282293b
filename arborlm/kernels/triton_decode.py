"""Triton decode attention over the paged KV pool: two-stage flash-decoding.

One new token per request attends over all of that request's keys, read straight
from the pool through `req_to_token` (no gather into dense tensors). The key range
of each request is cut into `num_kv_splits` parts that are computed in parallel
(stage 1: one program per request, KV head and split, holding every query head
of that KV head's group, so each K/V row is loaded once per group); stage 2
merges the parts with their log-sum-exp.

Algorithm: Flash-Decoding (Dao, Haziza, Massa, Sizov, 2023,
"Flash-Decoding for long-context inference"), online softmax from FlashAttention
(Dao et al., 2022). Same contract and masking as `reference.decode_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from arborlm.kernels.triton_common import (
    attend_kv_tile,
    check_head_dim_contiguous,
    dot_precision,
    dot_upcast,
    kv_kernel_args,
)


@triton.jit
def _decode_split_kernel(
    Q, K_Buffer, V_Buffer, K_Scale, V_Scale, Req_to_token, Req_pool_indices, Seq_lens,
    Mid_O, Mid_lse,
    scale, logit_cap, sliding_window,
    stride_q_token, stride_q_head,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_scale_slot,
    stride_r2t_row,
    stride_mo_token, stride_mo_head, stride_mo_split,
    stride_ml_token, stride_ml_head,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_LOGIT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_KIND: tl.constexpr,
):
    """Stage 1: the partial output and log-sum-exp of one (request, KV head, split)."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(Seq_lens + req)
    row = tl.load(Req_pool_indices + req).to(tl.int64)
    start = 0
    if USE_WINDOW:
        start = tl.maximum(seq_len - sliding_window, 0)
    split_len = tl.cdiv(seq_len - start, NUM_SPLITS)
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * KV_GROUP + offs_h
    head_mask = offs_h < KV_GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + req * stride_q_token + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=head_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    q_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + (seq_len - 1)  # the new token sees every key up to itself
    for block_start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = attend_kv_tile(
            acc, m_i, l_i, q, q_pos,
            K_Buffer, V_Buffer, K_Scale, V_Scale, Req_to_token + row * stride_r2t_row, kv_head, block_start, hi,
            scale, logit_cap, sliding_window,
            stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_scale_slot,
            offs_d, d_mask,
            BLOCK_N, USE_LOGIT_CAP, USE_WINDOW, DOT_PRECISION, DOT_UPCAST, KV_KIND,
        )

    # An empty split (short request, many splits) leaves l_i = 0: it reports lse = -inf
    # and stage 2 gives it weight 0.
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(
        Mid_O + req * stride_mo_token + heads[:, None] * stride_mo_head + split * stride_mo_split + offs_d[None, :],
        out,
        mask=head_mask[:, None] & d_mask[None, :],
    )
    tl.store(Mid_lse + req * stride_ml_token + heads * stride_ml_head + split, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    Mid_O, Mid_lse, Out,
    stride_mo_token, stride_mo_head, stride_mo_split,
    stride_ml_token, stride_ml_head,
    stride_o_token, stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Stage 2: merge the splits of one (request, query head) by their log-sum-exp."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(Mid_lse + req * stride_ml_token + head * stride_ml_head + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)  # finite: split 0 always holds a key
    weights = tl.exp(lse - lse_max)
    parts = tl.load(
        Mid_O + req * stride_mo_token + head * stride_mo_head + offs_s[:, None] * stride_mo_split + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(Out + req * stride_o_token + head * stride_o_head + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


_decode_split_kernel_autotuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st)
        for n, w, st in [(32, 2, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3)]
    ],
    key=["HEAD_DIM", "KV_GROUP", "NUM_SPLITS"],
)(_decode_split_kernel)


def default_num_kv_splits(batch_size: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """How many parts to cut each request's keys into.

    Enough (request, KV head, split) programs to fill the GPU about twice over, at
    most one split per 64 keys and at most 64 splits; 1 off CUDA (the interpreter).
    """
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * num_sms, max(batch_size * num_kv_heads, 1))
    return int(max(1, min(wanted, triton.cdiv(max_len, 64), 64)))


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
    num_kv_splits: int | None = None,
    max_len: int | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of one new token per request over all of that request's tokens.

    Parameters
    ----------
    q: (batch, num_q_heads, head_dim) float16, bfloat16 or float32, the token at
        position `seq_len - 1`.
    k_buffer, v_buffer: (slots, num_kv_heads, head_dim), one layer of the pool in
        q's dtype or in one byte per value (float8_e4m3fn, float8_e5m2, or int8 with
        `kv_scales`; widened in the kernel), already holding the new tokens' K/V.
    req_to_token: (rows, max_context_len) int32/int64, slot of each position.
    req_pool_indices: (batch,) int, each request's row.
    seq_lens: (batch,) int, tokens per request (all >= 1).
    scale: softmax scale.
    sliding_window: attend only to the last `sliding_window` positions; None = all.
    logit_cap: if > 0, scores become `logit_cap * tanh(scores / logit_cap)`.
    num_kv_splits: parts per request (stage 1 parallelism); default from
        `default_num_kv_splits`.
    max_len: the longest `seq_len` if the caller knows it (saves a device sync).

    kv_scales: an int8 pool's (k_scale, v_scale), (slots, num_kv_heads) float16 or
        float32 with heads contiguous: K = k_buffer * k_scale[..., None]; None otherwise.

    Returns
    -------
    (batch, num_q_heads, head_dim) tensor in q's dtype.

    Raises
    ------
    ValueError
        If q or the buffers do not have a contiguous last dimension, or `kv_scales` does
        not go with the pool's dtype (`triton_common.kv_kind`).
    """
    check_head_dim_contiguous(q, k_buffer, v_buffer)
    k_buffer, v_buffer, k_scale, v_scale, stride_scale_slot, kind = kv_kernel_args(k_buffer, v_buffer, kv_scales)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    kv_group = num_q_heads // num_kv_heads
    if num_kv_splits is None:
        if max_len is None:
            max_len = int(seq_lens.max())
        num_kv_splits = default_num_kv_splits(batch, num_kv_heads, max_len, q.device)
    block_d = triton.next_power_of_2(head_dim)
    mid_o = torch.empty((batch, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_q_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    on_cuda = q.device.type == "cuda"
    kernel = _decode_split_kernel_autotuned if on_cuda else _decode_split_kernel
    tiles = {} if on_cuda else {"BLOCK_N": 64 if q.element_size() < 4 else 32}
    kernel[(batch, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices, seq_lens,
        mid_o, mid_lse,
        scale, float(logit_cap), int(sliding_window or 0),
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        stride_scale_slot,
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        KV_GROUP=kv_group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(kv_group)),  # tl.dot needs >= 16 rows
        NUM_SPLITS=num_kv_splits,
        USE_LOGIT_CAP=logit_cap > 0,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        DOT_UPCAST=dot_upcast(q.dtype),
        KV_KIND=kind,
        **tiles,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_kv_splits,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
    )
    return out
