"""The gated feed-forward block of a decoder layer (SwiGLU, GeGLU).

Gate and up projections are one `MergedLinear` (one matrix product per step), the
activation one function of `layers/activation.py` over the fused output: SiLU's is
`LayerOps.silu_and_mul` (a native kernel on the CPU), Gemma's tanh-GELU a torch
op. Layout as in SGLang's `LlamaMLP` / `Gemma3MLP`.
"""

from __future__ import annotations

import torch
from torch import nn

from arborlm.kernels.cpu_ops import LayerOps
from arborlm.runtime.distributed.parallel_state import ParallelState
from arborlm.runtime.layers.activation import gated_activation
from arborlm.runtime.layers.linear import make_merged_column_linear, make_row_linear

# Shard ids of `gate_up_proj`: the checkpoint's gate_proj and up_proj, in that order.
GATE_SHARD, UP_SHARD = 0, 1


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up fused.

    `forward(x)`: x (num_tokens, hidden_size) -> (num_tokens, hidden_size), x's dtype.
    Weights: `gate_up_proj` (2 * intermediate_size, hidden_size), shards
    `GATE_SHARD` / `UP_SHARD`; `down_proj` (hidden_size, intermediate_size).
    `activation`: transformers' name of `act` (`hidden_act`), "silu" by default;
    see `activation.SUPPORTED_ACTIVATIONS`.
    `parallel`: under tensor parallelism, gate/up are column-parallel and down row-parallel
    (this rank holds intermediate_size / tp_size of the columns; None: a single rank).

    Raises
    ------
    ModelLoadError
        For an unsupported activation.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype, device: torch.device,
        ops: LayerOps, activation: str = "silu", parallel: ParallelState | None = None,
    ):
        super().__init__()
        self.act_and_mul = gated_activation(activation, ops)
        shards = {GATE_SHARD: intermediate_size, UP_SHARD: intermediate_size}
        self.gate_up_proj = make_merged_column_linear(hidden_size, shards, bias, dtype, device, ops, parallel,
                                                      "intermediate_size")
        self.down_proj = make_row_linear(intermediate_size, hidden_size, bias, dtype, device, ops, parallel,
                                         "intermediate_size")
        self.intermediate_size = self.down_proj.weight.shape[1]  # this rank's columns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
