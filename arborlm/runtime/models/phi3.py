"""Phi-3 (Phi-3, Phi-3.5-mini, Phi-4-mini) over the paged KV layout: the Llama decoder.

Phi-3 is Llama's structure (transformers' `modeling_phi3.py`; SGLang serves it as
a subclass of its `LlamaForCausalLM` too) with three differences, all handled
outside this file except the first:

- the checkpoint stores q/k/v fused as `qkv_proj` and gate/up as `gate_up_proj`,
  in our stacking order; `load_weights` splits them into the shards our
  `MergedLinear`s load (views, no copies);
- rotary may be partial (`partial_rotary_factor`, Phi-4-mini) and LongRoPE-scaled
  (`rope_scaling` type "longrope" / "su" with short and long factors): both in
  `layers/rotary_embedding.py` (`get_rope`, `apply_rotary_`);
- `sliding_window`, when set, covers every layer (`llama._WHOLE_MODEL_WINDOW`).

The model runner calls `forward(forward_batch)` once per step; `models/registry.py`
maps `Phi3ForCausalLM` here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from arborlm.errors import ModelLoadError
from arborlm.runtime.models.llama import LlamaForCausalLM, head_dim_of

# Checkpoint suffix of a fused projection -> the suffixes of its parts, in stacking order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class Phi3ForCausalLM(LlamaForCausalLM):
    """A Phi-3 causal LM over the paged KV pools.

    Parameters, `forward` as `LlamaForCausalLM`; `config` is a transformers
    `Phi3Config`. `load_weights` takes the checkpoint's fused projections.

    Raises
    ------
    ModelLoadError
        For an unsupported rope_type or malformed LongRoPE factors.
    """

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named Phi-3 weights in (fused `qkv_proj` / `gate_up_proj`
        split into their q/k/v and gate/up parts first).

        Raises
        ------
        ModelLoadError
            For an unknown name, a fused weight of the wrong height, a shape
            mismatch, or a weight left unloaded.
        """
        super().load_weights(split_fused_weights(weights, self._part_sizes()))

    def _part_sizes(self) -> dict[str, tuple[int, ...]]:
        """Rows of each part of the fused projections (q, k, v; gate, up)."""
        config = self.config
        head_dim = head_dim_of(config)
        q_size = config.num_attention_heads * head_dim
        kv_size = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
        inter = config.intermediate_size
        return {"self_attn.qkv_proj": (q_size, kv_size, kv_size), "mlp.gate_up_proj": (inter, inter)}


def split_fused_weights(
    weights: Iterable[tuple[str, torch.Tensor]], part_sizes: dict[str, tuple[int, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the weights with each fused projection replaced by its parts.

    Parameters
    ----------
    weights: checkpoint `(name, tensor)` pairs, e.g.
        "model.layers.0.self_attn.qkv_proj.weight" (q_size + 2 * kv_size, hidden).
    part_sizes: fused suffix (a key of `_FUSED`) -> rows of each part.

    Yields
    ------
    `(name, tensor)`: "...self_attn.q_proj.weight" and so on, row slices (views)
    of the fused tensor; other weights unchanged.

    Raises
    ------
    ModelLoadError
        For a fused tensor whose rows do not add up to its parts'.
    """
    for name, tensor in weights:
        fused = next((f for f in _FUSED if f".{f}." in f".{name}"), None)
        if fused is None:
            yield name, tensor
            continue
        sizes = part_sizes[fused]
        if tensor.shape[0] != sum(sizes):
            raise ModelLoadError(f"weight {name!r} has {tensor.shape[0]} rows, expected {sum(sizes)} ({sizes})")
        for part, rows in zip(_FUSED[fused], tensor.split(sizes, dim=0)):
            yield name.replace(fused, part), rows
