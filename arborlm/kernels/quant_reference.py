"""Torch versions of the quantized kernels: the fallback path and the kernels' oracle.

`dequantize` turns a packed `QuantWeight` back into float values (ggml's
`dequantize_row_*` math: Q8_0 d * q, Q4_0 d * (q - 8), Q4_1 d * q + m), so
`quant_linear` is a plain matmul over the dequantized weight; it serves where the
C++ kernels do not build and for prefills. `quantize_activations` and
`int8_linear` spell out what the C++ decode kernel computes (activations rounded
per block of 32 to int8, as ggml's Q8_0), so tests can hold it to float rounding
rather than to quantization noise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from arborlm.kernels.quant_layout import BLOCK, GgmlRows, QuantWeight, unpack_rows


def unpack_quants(weight: QuantWeight, rows: torch.Tensor | None = None) -> GgmlRows:
    """Rows `rows` (None = all) with the quants in value order: (n, in / 32, 32) int32
    (uint8 range, before the offset); scales and mins as `unpack_rows`."""
    found = unpack_rows(weight, rows)
    blocks = found.quants.to(torch.int32)
    if weight.format.nibbles:
        blocks = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)
    return found._replace(quants=blocks)


def dequantize(weight: QuantWeight, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight's values, (out_features or len(rows), in_features) in `dtype` (computed in float32)."""
    found = unpack_quants(weight, rows)
    q = (found.quants - weight.format.offset).to(torch.float32)
    values = q * found.scales.to(torch.float32).unsqueeze(-1)
    if found.mins is not None:
        values = values + found.mins.to(torch.float32).unsqueeze(-1)
    return values.reshape(q.shape[0], weight.in_features).to(dtype)


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T (+ bias)` for x (rows, in_features): W dequantized to x's dtype, then `F.linear`."""
    return F.linear(x, dequantize(weight, x.dtype).to(x.device), bias)


def embedding(weight: QuantWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` ((n,) int64) of the table, dequantized: (n, in_features) in `dtype`."""
    return dequantize(weight, dtype, ids.to(torch.int64).cpu()).to(ids.device)


class QuantizedActivations(NamedTuple):
    """Activations rounded per block of 32: quants (rows, in / 32, 32) int32 in [-127, 127],
    scales (rows, in / 32) float32 (max |x| / 127)."""

    quants: torch.Tensor
    scales: torch.Tensor


def quantize_activations(x: torch.Tensor) -> QuantizedActivations:
    """ggml's Q8_0 rounding of x (rows, in) (in a multiple of 32), in float32."""
    blocks = x.to(torch.float32).reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # A tensor numerator: torch turns `127.0 / amax` into a reciprocal times 127, one ulp off IEEE division.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    quants = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int32)
    return QuantizedActivations(quants, amax / 127.0)


def int8_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the C++ decode kernel computes, in float64: per block, the integer dot
    product of the weight's quants with x's int8 quants, times both scales (plus the
    min times the activation quants' sum). Returns (rows, out_features) float64."""
    act = quantize_activations(x)
    w = unpack_quants(weight)
    q_w = (w.quants - weight.format.offset).to(torch.float64)  # (out, nb, 32)
    q_a = act.quants.to(torch.float64)  # (rows, nb, 32)
    dots = torch.einsum("mbi,nbi->mnb", q_a, q_w)
    d_w = w.scales.to(torch.float64)  # (out, nb)
    d_a = act.scales.to(torch.float64)  # (rows, nb)
    out = (dots * d_w.unsqueeze(0) * d_a.unsqueeze(1)).sum(-1)
    if weight.mins is not None:
        sums = q_a.sum(-1) * d_a  # (rows, nb)
        out = out + sums @ w.mins.to(torch.float64).T
    return out if bias is None else out + bias.to(torch.float64)
