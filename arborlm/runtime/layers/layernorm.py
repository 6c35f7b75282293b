"""RMSNorm, the normalisation of the Llama-style decoder layers.

Each decoder layer normalises before attention and before its MLP; with SGLang's
residual layout the norm also adds the previous block's output to the residual
(`fused_add_rms_norm`), done by one native kernel on the CPU (`kernels/cpu_ops.py`).
Gemma's variant scales by `1 + weight` (its checkpoints store the weight centred on
zero); `unit_offset=True` selects it, with the offset folded in once after loading.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from arborlm.kernels.cpu_ops import LayerOps
from arborlm.runtime.layers.parameter import empty_parameter


class RMSNorm(nn.Module):
    """Root-mean-square norm (Hugging Face `LlamaRMSNorm`), accumulated in float32.

    `forward(x)`: x (num_tokens, hidden_size) -> the normalised x, x's dtype.
    `forward(x, residual)` returns `(norm(x + residual), x + residual)` (see
    `LayerOps.rms_norm`; the native version updates `residual` in place).

    With `unit_offset` (Gemma's `Gemma3RMSNorm`), the scale is `1 + weight`, where
    `weight` is the checkpoint's; call `prepare()` once it is loaded (`prepare_norms`
    does every norm of a model). The scale is float32, as transformers computes it
    (`1 + weight.float()`): rounding it to bf16 would skew every channel by up to
    2^-8 on every token. float32 models take `ops.rms_norm` (the native kernel);
    other dtypes a torch norm in float32 with one rounding, as transformers (the
    native kernels take a weight of x's dtype only).
    """

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device, ops: LayerOps,
        unit_offset: bool = False,
    ):
        super().__init__()
        self.weight = empty_parameter((hidden_size,), dtype, device)
        self.eps = eps
        self.ops = ops
        self.unit_offset = unit_offset
        # `1 + weight` once `prepare()` ran (unit_offset only); follows the module across devices.
        self.register_buffer("scale", None, persistent=False)

    def prepare(self) -> None:
        """Compute the scale forward reads from the loaded weight (float32 `1 + weight`
        with `unit_offset`); call again after changing `weight`."""
        if self.unit_offset:
            self.scale = 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not self.unit_offset:
            return self.ops.rms_norm(x, self.weight, self.eps, residual)
        assert self.scale is not None, "a unit-offset RMSNorm is used before prepare()"
        if x.dtype == self.scale.dtype:
            return self.ops.rms_norm(x, self.scale, self.eps, residual)
        return float32_scale_rms_norm(x, self.scale, self.eps, residual)


def float32_scale_rms_norm(
    x: torch.Tensor, scale: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of a low-precision x with a float32 scale, as transformers' `Gemma3RMSNorm`.

    x: (num_tokens, hidden) in any float dtype; scale: (hidden,) float32. Returns
    `norm(x) * scale` in x's dtype, computed in float32 and rounded once; with
    `residual`, `(norm(x + residual) * scale, x + residual)` where the sum is rounded
    to x's dtype first, as transformers' `residual + hidden` is.
    """
    if residual is not None:
        residual = x + residual
        x = residual
    out = F.rms_norm(x.float(), scale.shape, scale, eps).to(x.dtype)
    return out if residual is None else (out, residual)


def prepare_norms(module: nn.Module) -> None:
    """`prepare()` every `RMSNorm` inside `module` (call once its weights are loaded)."""
    for sub in module.modules():
        if isinstance(sub, RMSNorm):
            sub.prepare()
