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
