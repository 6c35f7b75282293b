"""Prepacked bf16 linear layers for the CPU: `y = x W^T + b` through oneDNN.

`F.linear` on a bf16 CPU tensor reorders W into oneDNN's blocked (AMX) layout on
every call; for decode-sized inputs that reorder costs as much as the product.
Packing W once after loading, as torch.compile's CPU freezing pass does
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`), makes every
linear layer of a decode step ~1.6x faster with bit-identical results. float32
stays on `F.linear`: there, packing is not faster and changes the rounding.

On a CPU without native bf16 (neither AVX512-BF16 nor AMX-BF16 in its flags, e.g. Intel
Ice Lake) oneDNN emulates bf16, and there it takes a matrix-vector kernel for a single row
of a large weight (from ~8192 x 576 elements up, measured with oneDNN in torch 2.13) whose
sums round unlike its GEMM's: a request's tokens would then depend on whether it decodes
alone or in a batch. `packed_linear` runs one row as two there (the GEMM; one extra row of
compute on a read of the same weight).
"""

from __future__ import annotations

import functools
from pathlib import Path

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


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (its flags list `avx512_bf16` or `amx_bf16`);
    a fact of the machine, read once. False where /proc/cpuinfo cannot be read."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  emulated_bf16: bool | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x (tokens, in) bf16 and `packed = pack_weight(weight)`.

    Each row's output is the same whatever the other rows (batch-invariant): where
    oneDNN emulates bf16 (`emulated_bf16`, default: not `cpu_has_native_bf16()`) a
    single row runs as two (see the module docstring).
    """
    if emulated_bf16 is None:
        emulated_bf16 = not cpu_has_native_bf16()
    if emulated_bf16 and x.dim() == 2 and x.shape[0] == 1:
        return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), packed, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
