"""Prepacked bf16 linear layers for the CPU: `y = x W^T + b` through oneDNN.

`F.linear` on a bf16 CPU tensor reorders W into oneDNN's blocked (AMX) layout on
every call; for decode-sized inputs that reorder costs as much as the product.
Packing W once after loading, as torch.compile's CPU freezing pass does
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`), makes every
linear layer of a decode step ~1.6x faster with bit-identical results. float32
stays on `F.linear`: there, packing is not faster and changes the rounding.
"""

from __future__ import annotations

import torch

# Batch size oneDNN tunes the packed layout for; any batch size works at run time.
PACK_BATCH_SIZE = 64


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` (out, in) is a CPU bf16 weight that oneDNN can prepack here."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN copy of `weight` (out, in) for `packed_linear`; `can_pack` must hold."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_SIZE)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x (tokens, in) bf16 and `packed = pack_weight(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
