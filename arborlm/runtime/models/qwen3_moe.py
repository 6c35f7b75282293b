"""Qwen3-MoE over the paged KV layout: Qwen3's attention with sparse MoE feed-forward blocks.

A layer is sparse unless it is listed in `mlp_only_layers`, and then only every
`decoder_sparse_step`-th layer (transformers' `Qwen3MoeDecoderLayer`); sparse layers
route each token to `num_experts_per_tok` of `num_experts` experts of width
`moe_intermediate_size`, renormalising the chosen weights when `norm_topk_prob`
(`layers/moe.py`); the others keep a dense gated MLP of `intermediate_size`.
Attention is `models/qwen3.py`'s (q/k norms), the rest `models/llama.py`; a
`sliding_window` (set only with `use_sliding_window`) covers every layer. The model
runner calls `forward(forward_batch)` once per step; `models/registry.py` maps
`Qwen3MoeForCausalLM` here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from arborlm.kernels.cpu_ops import LayerOps
from arborlm.runtime.layers.moe import (
    DOWN,
    GATE,
    UP,
    ExpertNames,
    SparseMoeBlock,
    fold_expert_weights,
)
from arborlm.runtime.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM

# `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`, as transformers saves them.
QWEN3_MOE_EXPERTS = ExpertNames(
    re.compile(r"(?P<block>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight"),
    {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN},
)


def is_sparse_layer(config, layer_id: int) -> bool:
    """Whether layer `layer_id` has a MoE block (transformers' `Qwen3MoeDecoderLayer` rule)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_id not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_id + 1) % step == 0
    )


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's decoder layer whose feed-forward block is sparse where `is_sparse_layer`."""

    def make_mlp(self, config, layer_id: int, dtype, device, ops: LayerOps) -> nn.Module:
        if not is_sparse_layer(config, layer_id):
            return super().make_mlp(config, layer_id, dtype, device, ops)
        return SparseMoeBlock(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
            bool(config.norm_topk_prob), dtype, device, ops,
        )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """A Qwen3-MoE causal LM over the paged KV pools.

    Parameters and `forward` as `LlamaForCausalLM`; `config` is a transformers
    `Qwen3MoeConfig`.
    """

    decoder_layer_cls = Qwen3MoeDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named weights, per-expert ones stacked into each `FusedMoE`.

        Raises
        ------
        ModelLoadError
            For an unknown name, a shape mismatch, or a weight left unloaded.
        """
        super().load_weights(fold_expert_weights(self, weights, QWEN3_MOE_EXPERTS))
