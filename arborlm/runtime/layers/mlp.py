"""The gated feed-forward block of a decoder layer (SwiGLU).

Gate and up projections are one `MergedLinear` (one matrix product per step), the
activation one `LayerOps.silu_and_mul` (a native kernel on the CPU); layout as in
SGLang's `LlamaMLP`.
"""

from __future__ import annotations

import torch
from torch import nn

from arborlm.kernels.cpu_ops import LayerOps
from arborlm.runtime.layers.linear import Linear, MergedLinear

# Shard ids of `gate_up_proj`: the checkpoint's gate_proj and up_proj, in that order.
GATE_SHARD, UP_SHARD = 0, 1


class GatedMLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))` with gate and up fused.

    `forward(x)`: x (num_tokens, hidden_size) -> (num_tokens, hidden_size), x's dtype.
    Weights: `gate_up_proj` (2 * intermediate_size, hidden_size), shards
    `GATE_SHARD` / `UP_SHARD`; `down_proj` (hidden_size, intermediate_size).
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype, device: torch.device,
        ops: LayerOps,
    ):
        super().__init__()
        self.ops = ops
        self.intermediate_size = intermediate_size
        shards = {GATE_SHARD: intermediate_size, UP_SHARD: intermediate_size}
        self.gate_up_proj = MergedLinear(hidden_size, shards, bias, dtype, device, ops)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
