"""Weight-only int4 for any float checkpoint: the `quantization="int4"` load path.

After the model's float weights are loaded, `quantize_linears_int4` replaces every
`Linear` / `MergedLinear` (a tied lm_head too: it gets its own int4 copy, the
embedding keeps the float table) by a `QuantizedLinear` whose weight is quantized
asymmetrically per group of 32 or 128 input values
(`kernels/quant_layout.quantize_groupwise_int4`: a scale and a float zero point per
group, as torchao's `Int4WeightOnlyConfig`, SGLang's `--torchao-config int4wo-<group>`)
and packed as Q4_1 tiles, so the Q4_1 kernels of `kernels/quant_ops.py` serve it: VNNI
int8 dot products with activations rounded per block of 32 at decode, a dequantized
GEMM at prefill. A MoE block's experts become a `QuantizedFusedMoE` the same way.

Unlike int8 (which keeps an odd-width layer in float), a model with a linear whose
input width is not a multiple of the group is refused before anything is replaced:
`ValueError` naming the layer and the dimension.
"""

from __future__ import annotations

import functools
import logging

from torch import nn

from arborlm.kernels.quant_layout import INT4_GROUP_SIZES, pack_int4_groupwise
from arborlm.kernels.quant_ops import QuantOps
from arborlm.runtime.layers.linear import Linear
from arborlm.runtime.layers.moe import FusedMoE
from arborlm.runtime.layers.quantization.int8_weights import replace_experts, replace_linear

logger = logging.getLogger(__name__)

# `quantization` values served here -> their group size (the torchao-config names of SGLang too).
INT4_QUANTIZATIONS = {"int4": 32, "int4wo-32": 32, "int4wo-128": 128}


def check_int4_dims(model: nn.Module, group_size: int) -> None:
    """Refuse a model that int4 with `group_size` cannot quantize whole.

    Raises
    ------
    ValueError
        For a group size not in `INT4_GROUP_SIZES`, or naming the first linear (or MoE block)
        whose input width (in_features / the experts' hidden or intermediate size) is not a
        multiple of `group_size`.
    """
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    for path, module in model.named_modules():
        if isinstance(module, FusedMoE):
            widths = {"hidden_size": module.down_proj.shape[1], "intermediate_size": module.intermediate_size}
        elif isinstance(module, Linear):
            widths = {"in_features": module.weight.shape[1]}
        else:
            continue
        for dim, width in widths.items():
            if width % group_size:
                raise ValueError(
                    f"quantization=int4 with group size {group_size} needs every linear's input width to be a "
                    f"multiple of {group_size}: {path} has {dim}={width}"
                )


def quantize_linears_int4(model: nn.Module, ops: QuantOps, group_size: int = 32) -> list[str]:
    """Replace the loaded `Linear`s (and `FusedMoE` experts) of `model` by group-wise int4 ones.

    Parameters
    ----------
    model: with its float weights loaded.
    ops: the quantized ops the new layers run on (`kernels.quant_ops.quant_ops`).
    group_size: input values per scale and zero point, 32 or 128.

    Returns
    -------
    The module paths quantized.

    Raises
    ------
    ValueError
        As `check_int4_dims`, before any layer is replaced.
    """
    check_int4_dims(model, group_size)
    pack = functools.partial(pack_int4_groupwise, group_size=group_size)
    quantized = []
    for path, module in list(model.named_modules()):
        if isinstance(module, FusedMoE):
            replace_experts(model, path, module, ops, pack)
        elif isinstance(module, Linear):
            replace_linear(model, path, module, ops, pack(module.weight))
        else:
            continue
        quantized.append(path)
    logger.info("int4 weights: %d layers quantized, group size %d", len(quantized), group_size)
    return quantized
