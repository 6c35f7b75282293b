"""Mixtral over the paged KV layout: Llama's attention with a sparse MoE block in every layer.

Each layer routes every token to `num_experts_per_tok` of `num_local_experts` SwiGLU
experts of width `intermediate_size`, always renormalising the chosen weights
(transformers' `MixtralSparseMoeBlock`; `layers/moe.py`). Attention is Llama's, with
`sliding_window` (when set) on every layer, as Mistral. The checkpoint names the
block `block_sparse_moe` and the experts' projections `w1` (gate), `w3` (up), `w2`
(down), as SGLang's `models/mixtral.py` reads them; the module is `mlp` here, as in
the other families. The model runner calls `forward(forward_batch)` once per step;
`models/registry.py` maps `MixtralForCausalLM` here.
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
from arborlm.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# `model.layers.{i}.block_sparse_moe.experts.{e}.w{1,2,3}.weight`, after `_CHECKPOINT_BLOCK`
# is renamed to `.mlp.`.
MIXTRAL_EXPERTS = ExpertNames(
    re.compile(r"(?P<block>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>w[123])\.weight"),
    {"w1": GATE, "w3": UP, "w2": DOWN},
)
_CHECKPOINT_BLOCK = ".block_sparse_moe."


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer with a `SparseMoeBlock` as its feed-forward block."""

    def make_mlp(self, config, layer_id: int, dtype, device, ops: LayerOps) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok,
            True, dtype, device, ops,
        )


class MixtralForCausalLM(LlamaForCausalLM):
    """A Mixtral causal LM over the paged KV pools.

    Parameters and `forward` as `LlamaForCausalLM`; `config` is a transformers
    `MixtralConfig`.
    """

    decoder_layer_cls = MixtralDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named weights: `block_sparse_moe` read as `mlp`, per-expert
        `w1`/`w3`/`w2` stacked into each `FusedMoE`.

        Raises
        ------
        ModelLoadError
            For an unknown name, a shape mismatch, or a weight left unloaded.
        """
        renamed = ((name.replace(_CHECKPOINT_BLOCK, ".mlp."), tensor) for name, tensor in weights)
        super().load_weights(fold_expert_weights(self, renamed, MIXTRAL_EXPERTS))
