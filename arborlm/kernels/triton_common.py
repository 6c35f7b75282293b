"""Small pieces the Triton attention kernels share."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh from exp (portable to the interpreter): 2 * sigmoid(2x) - 1, saturates to +-1."""
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """`tl.dot(a, b)` accumulating in float32; with UPCAST the operands go to float32 first."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact "ieee" for float32 (TF32 would miss 1e-4), else the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether `dot` must upcast: Triton's interpreter (TRITON_INTERPRET=1) multiplies
    bfloat16 operands as raw integers (Triton 3.9), so there bfloat16 goes through float32.
    On a GPU bfloat16 stays native."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def check_head_dim_contiguous(*tensors: torch.Tensor) -> None:
    """The kernels index the last dimension with unit stride.

    Raises
    ------
    ValueError
        If a tensor's last dimension is not contiguous.
    """
    for tensor in tensors:
        if tensor.stride(-1) != 1:
            raise ValueError(f"attention input with strides {tensor.stride()} must have a contiguous last dimension")


@triton.jit
def attend_kv_tile(
    acc, m_i, l_i, q, q_pos,
    K_Buffer, V_Buffer, Row_to_token, kv_head, block_start, hi,
    scale, logit_cap, sliding_window,
    stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    offs_d, d_mask,
    BLOCK_N: tl.constexpr,
    USE_LOGIT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """One FlashAttention step: fold the keys at positions `[block_start, block_start +
    BLOCK_N) ∩ [0, hi)` of one request into the running softmax state of a block of queries.

    q: (R, BLOCK_D) queries at positions `q_pos` (R,); `acc` (R, BLOCK_D), `m_i`, `l_i`
    (R,) float32: the unnormalised output, running max and running sum. K/V rows are read
    through `Row_to_token` (the request's row of `req_to_token`). A key is visible when
    `pos <= q_pos` and, with a window, `pos > q_pos - sliding_window`. Returns the new
    (acc, m_i, l_i). Online softmax: Milakov & Gimelshein (2018); FlashAttention-2 (Dao, 2023).
    """
    pos = block_start + tl.arange(0, BLOCK_N)
    pos_mask = pos < hi
    slots = tl.load(Row_to_token + pos, mask=pos_mask, other=0).to(tl.int64)
    kv_mask = pos_mask[:, None] & d_mask[None, :]
    k = tl.load(
        K_Buffer + slots[:, None] * stride_k_slot + kv_head * stride_k_head + offs_d[None, :],
        mask=kv_mask, other=0.0,
    )
    scores = dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * scale
    if USE_LOGIT_CAP:
        scores = logit_cap * tanh(scores / logit_cap)
    visible = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
    scores = tl.where(visible, scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row that has seen no key yet keeps m = -inf; shift it by 0 instead (no nan).
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_shift)
    p = tl.exp(scores - m_shift[:, None])
    v = tl.load(
        V_Buffer + slots[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :],
        mask=kv_mask, other=0.0,
    )
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)
