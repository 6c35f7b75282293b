"""Triton GEMM over GGUF-quantized weights (Q8_0, Q4_0, Q4_1; int8 per channel as Q8_0), CUDA.

`quant_linear(x, weight, bias)` has `quant_reference.quant_linear`'s signature and
semantics: `y = x W^T (+ b)` with W a packed `QuantWeight` (`quant_layout.py`),
dequantized inside the kernel, one block of 32 input values at a time, as ggml's
`dequantize_row_*` does (Q8_0 d * q, Q4_0 d * (q - 8), Q4_1 d * q + m), then
multiplied with `tl.dot` and accumulated in float32. The weight is read in the
CPU kernels' tiled layout (tiles of 16 rows; per tile and block, 4-byte chunks of
each row's quants; fp16 scales per tile, block and row), so one packing serves
both. The K-quants are not covered here (the torch path serves them on CUDA).

Tested against the torch oracle under `TRITON_INTERPRET=1` on the CPU
(`tests/kernels/test_triton_quant_linear.py`); not measured on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from arborlm.kernels.quant_layout import TILE, QuantWeight
from arborlm.kernels.triton_common import dot_upcast

# Our format name -> the kernel's FMT code.
TRITON_FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}
BLOCK_K = 32  # one ggml block


@triton.jit
def _quant_linear_kernel(
    X, QS, Scales, Mins, Bias, Out,
    M, N, N_padded, num_blocks, stride_xm, stride_om,
    FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FLOAT32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 32)
    m_mask = offs_m < M
    n_mask = offs_n < N_padded  # padding rows of the last tile exist (zeros) and are not stored
    tile = offs_n // 16
    row = offs_n % 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, num_blocks):
        x = tl.load(X + offs_m[:, None] * stride_xm + b * 32 + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        tile_block = tile * num_blocks + b  # (BLOCK_N,)
        if FMT == 0:
            # 8 chunks of 4 quant bytes, stored + 128: byte j of the block is chunk j // 4, byte j % 4.
            idx = (tile_block[:, None] * 8 + offs_k[None, :] // 4) * 64 + row[:, None] * 4 + offs_k[None, :] % 4
            q = tl.load(QS + idx, mask=n_mask[:, None], other=128).to(tl.int32) - 128
        else:
            # 4 chunks of 4 bytes; value j < 16 is the low nibble of byte j, j >= 16 the high one of byte j - 16.
            byte = offs_k % 16
            idx = (tile_block[:, None] * 4 + byte[None, :] // 4) * 64 + row[:, None] * 4 + byte[None, :] % 4
            raw = tl.load(QS + idx, mask=n_mask[:, None], other=0).to(tl.int32)
            q = tl.where(offs_k[None, :] < 16, raw & 15, raw >> 4)
            if FMT == 1:
                q = q - 8
        d = tl.load(Scales + tile_block * 16 + row, mask=n_mask, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * d[:, None]  # (BLOCK_N, 32)
        if FMT == 2:
            w = w + tl.load(Mins + tile_block * 16 + row, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if FLOAT32_DOT:  # float32 inputs (exact "ieee"), or bf16 under the interpreter (see dot_upcast)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:  # 16-bit inputs: the weight tile rounded to x's dtype, tensor cores
            acc += tl.dot(x, tl.trans(w).to(x.dtype))
    out_mask = m_mask[:, None] & (offs_n[None, :] < N)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty), mask=out_mask)


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T (+ bias)` with W dequantized in the kernel.

    Parameters
    ----------
    x: (rows, in_features) float32 / float16 / bfloat16, unit stride in the last dim.
    weight: a `QuantWeight` of a format in `TRITON_FORMATS`, on x's device.
    bias: (out_features,) or None.

    Returns
    -------
    (rows, out_features) in x's dtype.

    Raises
    ------
    ValueError
        For another format, a width mismatch, or a strided last dim.
    """
    if weight.fmt not in TRITON_FORMATS:
        raise ValueError(f"the Triton quantized GEMM serves {sorted(TRITON_FORMATS)}, not {weight.fmt!r}")
    if x.dim() != 2 or x.shape[1] != weight.in_features or x.stride(1) != 1:
        raise ValueError(
            f"x must be (rows, {weight.in_features}) with unit stride in the last dim, got {tuple(x.shape)} "
            f"strides {x.stride()}"
        )
    rows, out_features = x.shape[0], weight.out_features
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m = 16 if rows <= 16 else 32
    block_n = 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n))
    _quant_linear_kernel[grid](
        x, weight.qs, weight.scales, weight.mins if weight.mins is not None else weight.scales,
        bias if bias is not None else out, out,
        rows, out_features, weight.qs.shape[0] * TILE, weight.num_blocks, x.stride(0), out.stride(0),
        FMT=TRITON_FORMATS[weight.fmt], HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        FLOAT32_DOT=x.dtype == torch.float32 or dot_upcast(x.dtype),
    )
    return out
