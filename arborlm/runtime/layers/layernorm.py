"""RMSNorm, the normalisation of the Llama-style decoder layers.

Each decoder layer normalises before attention and before its MLP; with SGLang's
residual layout the norm also adds the previous block's output to the residual
(`fused_add_rms_norm`), done by one native kernel on the CPU (`kernels/cpu_ops.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from arborlm.kernels.cpu_ops import LayerOps
from arborlm.runtime.layers.parameter import empty_parameter


class RMSNorm(nn.Module):
    """Root-mean-square norm (Hugging Face `LlamaRMSNorm`), accumulated in float32.

    `forward(x)`: x (num_tokens, hidden_size) -> the normalised x, x's dtype.
    `forward(x, residual)` returns `(norm(x + residual), x + residual)` (see
    `LayerOps.rms_norm`; the native version updates `residual` in place).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device, ops: LayerOps):
        super().__init__()
        self.weight = empty_parameter((hidden_size,), dtype, device)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
