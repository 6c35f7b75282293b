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


# What a KV pool layer stores (`kv_kind`): values as they are, fp8 bits (the pool's
# float8 tensors viewed as uint8, widened in the kernel: Triton's interpreter has no fp8
# type), or int8 with a scale per (slot, KV head).
KV_AS_STORED, KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8 = 0, 1, 2, 3


def kv_kind(k_buffer: torch.Tensor, kv_scales) -> int:
    """The `KV_*` code of a pool layer.

    Raises
    ------
    ValueError
        For an int8 pool without its scales, or scales with a pool that has none.
    """
    kind = {torch.float8_e4m3fn: KV_FP8_E4M3, torch.float8_e5m2: KV_FP8_E5M2, torch.int8: KV_INT8}.get(
        k_buffer.dtype, KV_AS_STORED)
    if (kind == KV_INT8) != (kv_scales is not None):
        raise ValueError(f"kv_scales must be given exactly for an int8 pool (pool dtype {k_buffer.dtype})")
    return kind


def kv_kernel_args(k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_scales) -> tuple:
    """(k_buffer, v_buffer, k_scale, v_scale, scale stride per slot, kv kind) as the kernels
    take them: fp8 pools as uint8 views; pools without scales pass k_buffer in their place
    (never read)."""
    kind = kv_kind(k_buffer, kv_scales)
    if kind in (KV_FP8_E4M3, KV_FP8_E5M2):
        k_buffer, v_buffer = k_buffer.view(torch.uint8), v_buffer.view(torch.uint8)
    if kv_scales is None:
        return k_buffer, v_buffer, k_buffer, k_buffer, 0, kind
    k_scale, v_scale = kv_scales
    if k_scale.stride(-1) != 1 or k_scale.stride() != v_scale.stride():
        raise ValueError(f"kv_scales with strides {k_scale.stride()}, {v_scale.stride()}: one per (slot, head), "
                         "heads contiguous")
    return k_buffer, v_buffer, k_scale, v_scale, k_scale.stride(0), kind


@triton.jit
def widen_kv(raw, scale, KV_KIND: tl.constexpr):
    """K or V rows (N, BLOCK_D) as float32 from what the pool stores (`KV_*` codes); `scale`
    (N,): an int8 row's scale. fp8 bits are widened exactly (subnormals, inf, NaN): a
    normal value's exponent and mantissa move into float32's fields with the bias raised
    (e4m3: bias 7, +120; e5m2: bias 15, +112); a subnormal is its mantissa times the
    smallest step (2^-9, 2^-16)."""
    if KV_KIND == 3:
        return raw.to(tl.float32) * scale[:, None]
    u = raw.to(tl.int32) & 0xFF
    m = u & 0x7F
    if KV_KIND == 1:
        normal = ((m << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        f = tl.where(m < 8, m.to(tl.float32) * 0.001953125, normal)
        f = tl.where(m == 0x7F, float("nan"), f)
    else:
        normal = ((m << 21) + (112 << 23)).to(tl.float32, bitcast=True)
        f = tl.where(m < 4, m.to(tl.float32) * 0.0000152587890625, normal)
        f = tl.where(m == 0x7C, float("inf"), tl.where(m > 0x7C, float("nan"), f))
    return tl.where((u & 0x80) != 0, -f, f)


@triton.jit
def load_kv_rows(Buffer, Scale, slots, kv_head, pos_mask, kv_mask, offs_d, stride_slot, stride_head,
                 stride_scale_slot, compute_dtype, KV_KIND: tl.constexpr):
    """The K or V rows of `slots` (BLOCK_N,) for one KV head, in `compute_dtype` (q's)."""
    raw = tl.load(Buffer + slots[:, None] * stride_slot + kv_head * stride_head + offs_d[None, :],
                  mask=kv_mask, other=0)
    if KV_KIND == 0:
        return raw
    scale = tl.zeros_like(slots).to(tl.float32) + 1.0
    if KV_KIND == 3:
        scale = tl.load(Scale + slots * stride_scale_slot + kv_head, mask=pos_mask, other=1.0).to(tl.float32)
    return widen_kv(raw, scale, KV_KIND).to(compute_dtype)


@triton.jit
def attend_kv_tile(
    acc, m_i, l_i, q, q_pos,
    K_Buffer, V_Buffer, K_Scale, V_Scale, Row_to_token, kv_head, block_start, hi,
    scale, logit_cap, sliding_window,
    stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_scale_slot,
    offs_d, d_mask,
    BLOCK_N: tl.constexpr,
    USE_LOGIT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_KIND: tl.constexpr,
):
    """One FlashAttention step: fold the keys at positions `[block_start, block_start +
    BLOCK_N) ∩ [0, hi)` of one request into the running softmax state of a block of queries.

    q: (R, BLOCK_D) queries at positions `q_pos` (R,); `acc` (R, BLOCK_D), `m_i`, `l_i`
    (R,) float32: the unnormalised output, running max and running sum. K/V rows are read
    through `Row_to_token` (the request's row of `req_to_token`) and widened to q's dtype
    from what the pool stores (`KV_KIND`, `load_kv_rows`). A key is visible when
    `pos <= q_pos` and, with a window, `pos > q_pos - sliding_window`. Returns the new
    (acc, m_i, l_i). Online softmax: Milakov & Gimelshein (2018); FlashAttention-2 (Dao, 2023).
    """
    pos = block_start + tl.arange(0, BLOCK_N)
    pos_mask = pos < hi
    slots = tl.load(Row_to_token + pos, mask=pos_mask, other=0).to(tl.int64)
    kv_mask = pos_mask[:, None] & d_mask[None, :]
    k = load_kv_rows(K_Buffer, K_Scale, slots, kv_head, pos_mask, kv_mask, offs_d, stride_k_slot, stride_k_head,
                     stride_scale_slot, q.dtype, KV_KIND)
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
    v = load_kv_rows(V_Buffer, V_Scale, slots, kv_head, pos_mask, kv_mask, offs_d, stride_v_slot, stride_v_head,
                     stride_scale_slot, q.dtype, KV_KIND)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)
