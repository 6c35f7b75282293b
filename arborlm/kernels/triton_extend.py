"""Triton extend (prefill) attention over the paged KV pool: FlashAttention tiles.

For a ragged batch, the new tokens of each request attend causally to the
request's cached prefix and to themselves. Keys and values are read straight
from the pool through `req_to_token` (the new tokens' K/V are already stored
there), one `BLOCK_N` tile at a time, with an online softmax in float32; each
program owns `BLOCK_M` queries of one request and one query head. Tiles past the
causal diagonal (and before a sliding window) are never loaded.

Algorithm: FlashAttention (Dao, Fu, Ermon, Rudra, Re, 2022) and FlashAttention-2
(Dao, 2023) tiling with online softmax (Milakov & Gimelshein, 2018). Same
contract and masking as `reference.extend_attention`.
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
def _extend_kernel(
    Q, K_Buffer, V_Buffer, K_Scale, V_Scale, Out,
    Req_to_token, Req_pool_indices, Seq_lens, Extend_prefix_lens, Extend_seq_lens, Extend_start_loc,
    scale, logit_cap, sliding_window,
    stride_q_token, stride_q_head,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_scale_slot,
    stride_o_token, stride_o_head,
    stride_r2t_row,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_LOGIT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_KIND: tl.constexpr,
):
    """Output of `BLOCK_M` new tokens of one request for one query head."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)

    extend_len = tl.load(Extend_seq_lens + req)
    if block_m * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(Extend_prefix_lens + req)
    seq_len = tl.load(Seq_lens + req)
    q_start = tl.load(Extend_start_loc + req)
    row = tl.load(Req_pool_indices + req).to(tl.int64)
    kv_head = head // KV_GROUP

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < extend_len
    q_pos = prefix_len + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + tokens[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    # Keys this block can see: up to its last query's position (causal), and from
    # its first query's window start.
    hi = tl.minimum(seq_len, prefix_len + (block_m + 1) * BLOCK_M)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(prefix_len + block_m * BLOCK_M - sliding_window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for block_start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = attend_kv_tile(
            acc, m_i, l_i, q, q_pos,
            K_Buffer, V_Buffer, K_Scale, V_Scale, Req_to_token + row * stride_r2t_row, kv_head, block_start, hi,
            scale, logit_cap, sliding_window,
            stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_scale_slot,
            offs_d, d_mask,
            BLOCK_N, USE_LOGIT_CAP, USE_WINDOW, DOT_PRECISION, DOT_UPCAST, KV_KIND,
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every real query sees at least itself
    tl.store(
        Out + tokens[:, None] * stride_o_token + head * stride_o_head + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


# Tile shapes tried on CUDA (the first call per head dim / group / dtype times each).
_CUDA_CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
    for m, n, w, st in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (64, 32, 4, 2)]
]
_extend_kernel_autotuned = triton.autotune(configs=_CUDA_CONFIGS, key=["HEAD_DIM", "KV_GROUP", "USE_WINDOW"])(
    _extend_kernel
)


def extend_block_sizes(dtype: torch.dtype, head_dim: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) tile sizes: 64x64 for half precision, 32x32 for float32 or
    head_dim > 128 (more registers per element); 64x64 in the interpreter, whose
    cost is mostly per-tile overhead."""
    if device.type != "cuda":
        return 64, 64
    if dtype == torch.float32 or head_dim > 128:
        return 32, 32
    return 64, 64


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
    extend_start_loc: torch.Tensor | None = None,
    max_extend_len: int | None = None,
    block_sizes: tuple[int, int] | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix and themselves.

    Parameters
    ----------
    q: (num_tokens, num_q_heads, head_dim) float16, bfloat16 or float32, new
        tokens request after request.
    k_buffer, v_buffer: (slots, num_kv_heads, head_dim), one layer of the pool in
        q's dtype or in one byte per value (float8_e4m3fn, float8_e5m2, or int8 with
        `kv_scales`; widened in the kernel), already holding the new tokens' K/V.
    req_to_token: (rows, max_context_len) int32/int64, slot of each position.
    req_pool_indices: (batch,) int, each request's row.
    seq_lens: (batch,) int, prefix + new tokens.
    extend_prefix_lens: (batch,) int, cached tokens before the new ones.
    extend_seq_lens: (batch,) int, new tokens (sum = num_tokens).
    scale: softmax scale.
    sliding_window: attend only to the last `sliding_window` positions; None = all.
    logit_cap: if > 0, scores become `logit_cap * tanh(scores / logit_cap)`.
    extend_start_loc: (batch,) int, index in q of each request's first new token;
        computed from `extend_seq_lens` when None.
    max_extend_len: the largest `extend_seq_lens` if the caller knows it (saves a
        device sync).
    block_sizes: (BLOCK_M, BLOCK_N) powers of two >= 16; default: autotuned on
        CUDA, `extend_block_sizes` elsewhere.

    kv_scales: an int8 pool's (k_scale, v_scale), (slots, num_kv_heads) float16 or
        float32 with heads contiguous: K = k_buffer * k_scale[..., None]; None otherwise.

    Returns
    -------
    (num_tokens, num_q_heads, head_dim) tensor in q's dtype.

    Raises
    ------
    ValueError
        If q or the buffers do not have a contiguous last dimension, or `kv_scales` does
        not go with the pool's dtype (`triton_common.kv_kind`).
    """
    check_head_dim_contiguous(q, k_buffer, v_buffer)
    k_buffer, v_buffer, k_scale, v_scale, stride_scale_slot, kind = kv_kernel_args(k_buffer, v_buffer, kv_scales)
    num_tokens, num_q_heads, head_dim = q.shape
    batch = int(req_pool_indices.shape[0])
    if extend_start_loc is None:
        extend_start_loc = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens
    if max_extend_len is None:
        max_extend_len = int(extend_seq_lens.max())
    out = torch.empty_like(q)
    if block_sizes is None and q.device.type == "cuda":
        kernel, tiles = _extend_kernel_autotuned, {}
        grid = lambda meta: (batch, num_q_heads, triton.cdiv(max_extend_len, meta["BLOCK_M"]))  # noqa: E731
    else:
        block_m, block_n = block_sizes or extend_block_sizes(q.dtype, head_dim, q.device)
        kernel, tiles = _extend_kernel, {"BLOCK_M": block_m, "BLOCK_N": block_n}
        grid = (batch, num_q_heads, triton.cdiv(max_extend_len, block_m))
    kernel[grid](
        q, k_buffer, v_buffer, k_scale, v_scale, out,
        req_to_token, req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens, extend_start_loc,
        scale, float(logit_cap), int(sliding_window or 0),
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        stride_scale_slot,
        out.stride(0), out.stride(1),
        req_to_token.stride(0),
        KV_GROUP=num_q_heads // k_buffer.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        USE_LOGIT_CAP=logit_cap > 0,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        DOT_UPCAST=dot_upcast(q.dtype),
        KV_KIND=kind,
        **tiles,
    )
    return out
