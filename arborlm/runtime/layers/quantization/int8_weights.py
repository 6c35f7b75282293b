"""Weight-only int8 for any float checkpoint: the `quantization="int8"` load path.

After the model's float weights are loaded, `quantize_linears_int8` replaces every
`Linear` / `MergedLinear` (a tied lm_head too: it gets its own int8 copy, the
embedding keeps the float table) by a `QuantizedLinear` whose weight is quantized
symmetrically per output channel (`kernels/quant_layout.quantize_per_channel_int8`,
torchao's `Int8WeightOnlyConfig` scheme, SGLang's `--torchao-config int8wo`) and
packed as Q8_0 tiles, so the int8 VNNI kernels of `kernels/quant_ops.py` serve it:
decode steps take int8 dot products with activations rounded per block of 32,
prefills dequantize to the activations' dtype and run one GEMM. A MoE block's
experts (`FusedMoE`) become a `QuantizedFusedMoE`, each expert's gate, up and down
quantized the same way. Layers whose input width is not a multiple of 32 stay in
float (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from arborlm.kernels.quant_layout import QuantWeight, pack_int8_per_channel
from arborlm.kernels.quant_ops import QuantOps
from arborlm.runtime.layers.linear import Linear
from arborlm.runtime.layers.moe import DOWN, GATE, UP, FusedMoE
from arborlm.runtime.layers.quantization.quant_linear import WHOLE, QuantizedLinear
from arborlm.runtime.layers.quantization.quant_moe import QuantizedFusedMoE

logger = logging.getLogger(__name__)
INT8_BLOCK = 32  # the kernels' block of input values


@dataclass
class Int8Report:
    """Module paths quantized, and those kept in float (input width not a multiple of 32)."""

    quantized: list[str] = field(default_factory=list)
    kept_float: list[str] = field(default_factory=list)


def quantize_linears_int8(model: nn.Module, ops: QuantOps) -> Int8Report:
    """Replace the loaded `Linear`s of `model` by per-channel int8 `QuantizedLinear`s.

    Parameters
    ----------
    model: with its float weights loaded.
    ops: the quantized ops the new layers run on (`kernels.quant_ops.quant_ops`).

    Returns
    -------
    Int8Report naming what was quantized and what stayed in float.
    """
    report = Int8Report()
    for path, module in list(model.named_modules()):
        if isinstance(module, FusedMoE):
            _quantize_experts(model, path, module, ops, report)
            continue
        if not isinstance(module, Linear):
            continue
        if module.weight.shape[1] % INT8_BLOCK:
            report.kept_float.append(path)
            continue
        replace_linear(model, path, module, ops, pack_int8_per_channel(module.weight))
        report.quantized.append(path)
    if report.kept_float:
        logger.warning("int8 weights: %d linear layers kept in float (input width not a multiple of %d): %s",
                       len(report.kept_float), INT8_BLOCK, ", ".join(report.kept_float[:4]))
    logger.info("int8 weights: %d linear layers quantized per channel", len(report.quantized))
    return report


def _quantize_experts(model: nn.Module, path: str, experts: FusedMoE, ops: QuantOps, report: Int8Report) -> None:
    """`experts` replaced by a `QuantizedFusedMoE` of per-channel int8 expert weights."""
    hidden, inter = experts.down_proj.shape[1], experts.intermediate_size
    if hidden % INT8_BLOCK or inter % INT8_BLOCK:
        report.kept_float.append(path)
        return
    replace_experts(model, path, experts, ops, pack_int8_per_channel)
    report.quantized.append(path)


def replace_linear(model: nn.Module, path: str, linear: Linear, ops: QuantOps, weight: QuantWeight) -> None:
    """The `Linear` at `path` of `model` replaced by a `QuantizedLinear` serving `weight`
    (its packed weight, one shard of all rows) and the float layer's bias."""
    layer = QuantizedLinear.replacing(linear, ops, whole=True)
    layer.load_shard(WHOLE, weight, f"{path}.weight")
    if linear.bias is not None:
        layer.load_bias(WHOLE, linear.bias.detach().to(layer.bias.dtype), f"{path}.bias")
    layer.finish(path)
    model.set_submodule(path, layer)


def replace_experts(
    model: nn.Module, path: str, experts: FusedMoE, ops: QuantOps, pack: Callable[[torch.Tensor], QuantWeight]
) -> None:
    """The `FusedMoE` at `path` replaced by a `QuantizedFusedMoE` whose every expert's gate,
    up and down weight is `pack(weight)` (a float (out, in) tensor -> its packed weight)."""
    layer = QuantizedFusedMoE.replacing(experts, ops)
    inter = experts.intermediate_size
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    for shard, weights in ((GATE, gate_up[:, :inter]), (UP, gate_up[:, inter:]), (DOWN, down)):
        layer.load_shard(shard, [pack(w) for w in weights], f"{path}.{shard}")
    layer.finish(path)
    model.set_submodule(path, layer)
