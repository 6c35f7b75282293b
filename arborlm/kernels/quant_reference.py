"""Torch versions of the quantized kernels: the fallback path and the kernels' oracle.

`dequantize` turns a packed `QuantWeight` back into float values (ggml's
`dequantize_row_*` math, the same float operations in the same order: Q8_0 d * q,
Q4_0 d * (q - 8), Q4_1 d * q + m, Q4_K / Q5_K (d * sc) * q - dmin * m, Q6_K
(d * sc) * (q - 32)), so `quant_linear` is a plain matmul over the dequantized
weight; it serves where the C++ kernels do not build and for prefills.
`quantize_activations` and `int8_linear` spell out what the C++ decode kernel
computes (activations rounded per block of 32 to int8, as ggml's Q8_0), so tests
can hold it to float rounding rather than to quantization noise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from arborlm.kernels.ggml_blocks import BLOCK
from arborlm.kernels.quant_layout import SUPER, QuantWeight, unpack_rows


class WeightTerms(NamedTuple):
    """A weight's rows as the kernels see them: quants (n, nb, 32) int32 minus the offset,
    scales (n, nb, 2) float32 per half block, mins (n, nb) float32 added per unit of the
    block's input sum (Q4_1's m, minus a K-quant's dmin * m; zeros where none)."""

    quants: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor


def weight_terms(weight: QuantWeight, rows: torch.Tensor | None = None) -> WeightTerms:
    """Rows `rows` ((n,) int64; None = all) of a packed weight as `WeightTerms`."""
    f = weight.format
    found = unpack_rows(weight, rows)
    q = found.quants.to(torch.int32)
    if f.nibbles:
        q = torch.cat([q & 0x0F, q >> 4], dim=-1)
    if found.high is not None:
        q = q | (found.high.to(torch.int32) << 4)
    d = found.scales.to(torch.float32)
    if f.k_quant:
        d = d.repeat_interleave(SUPER, dim=1)  # super-block d per block
        sub = found.sub_scales.to(torch.float32)
        scales = d.unsqueeze(-1) * (sub if sub.dim() == 3 else sub.unsqueeze(-1).expand(-1, -1, 2))
    else:
        scales = d.unsqueeze(-1).expand(-1, -1, 2)
    if found.mins is None:
        mins = torch.zeros(d.shape)
    elif f.k_quant:
        mins = -(found.mins.to(torch.float32).repeat_interleave(SUPER, dim=1) * found.sub_mins.to(torch.float32))
    else:
        mins = found.mins.to(torch.float32)
    return WeightTerms(q - f.offset, scales.contiguous(), mins)


def dequantize(weight: QuantWeight, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight's values, (out_features or len(rows), in_features) in `dtype` (computed in float32)."""
    terms = weight_terms(weight, rows)
    per_value = terms.scales.repeat_interleave(BLOCK // 2, dim=-1)  # (n, nb, 32)
    values = per_value * terms.quants.to(torch.float32) + terms.mins.unsqueeze(-1)
    return values.reshape(values.shape[0], weight.in_features).to(dtype)


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
    """What the C++ decode kernel computes, in float64: per half block, the integer dot
    product of the weight's quants with x's int8 quants times both scales, plus the
    block's min times the activation quants' sum and scale. Returns (rows, out_features) float64."""
    act = quantize_activations(x)
    w = weight_terms(weight)
    q_w = w.quants.to(torch.float64).reshape(*w.quants.shape[:2], 2, BLOCK // 2)  # (out, nb, half, 16)
    q_a = act.quants.to(torch.float64).reshape(*act.quants.shape[:2], 2, BLOCK // 2)  # (rows, nb, half, 16)
    dots = torch.einsum("mbhi,nbhi->mnbh", q_a, q_w)
    d_a = act.scales.to(torch.float64)  # (rows, nb)
    out = (dots * w.scales.to(torch.float64).unsqueeze(0)).sum(-1)  # (rows, out, nb)
    out = (out * d_a.unsqueeze(1)).sum(-1)
    sums = q_a.sum((-1, -2)) * d_a  # (rows, nb)
    out = out + sums @ w.mins.to(torch.float64).T
    return out if bias is None else out + bias.to(torch.float64)
