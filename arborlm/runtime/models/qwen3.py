"""Qwen3 (dense) over the paged KV layout: the Llama decoder with q/k norms.

Qwen3 differs from Llama in its attention only: q and k are RMS-normalised per head
(over `head_dim`, one weight for all q heads and one for all k heads) before the
rotary embedding, `head_dim` comes from the config (it need not be hidden / heads),
and there are no q/k/v biases unless `attention_bias`. Structure as transformers'
`modeling_qwen3.py` (`Qwen3Attention`) and SGLang's `models/qwen3.py`; everything
else is `models/llama.py`. Per-layer sliding windows come from `layer_types`. The
model runner calls `forward(forward_batch)` once per step; `models/registry.py`
maps `Qwen3ForCausalLM` here.
"""

from __future__ import annotations

import torch

from arborlm.kernels.cpu_ops import LayerOps
from arborlm.runtime.layers.attention.base import AttentionBackend
from arborlm.runtime.layers.layernorm import RMSNorm
from arborlm.runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """`LlamaAttention` with per-head RMSNorm of q and k before rotary.

    Weights beyond Llama's: `q_norm`, `k_norm` (head_dim,).
    """

    def __init__(
        self, config, layer_id: int, head_dim: int, dtype, device, attn_backend: AttentionBackend, ops: LayerOps
    ):
        super().__init__(config, layer_id, head_dim, dtype, device, attn_backend, ops)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype, device, ops)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype, device, ops)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """qk (num_tokens, heads + kv_heads, head_dim) -> the same shape, each head
        normalised (transformers' `q_norm(q_proj(x).view(..., head_dim))`)."""
        num_tokens = qk.shape[0]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        # The norms take rows of head_dim: every head of every token is one row.
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.num_kv_heads, self.head_dim)
        return torch.cat([q, k], dim=1)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer with `Qwen3Attention`."""

    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """A Qwen3 causal LM over the paged KV pools.

    Parameters, `forward` and `load_weights` as `LlamaForCausalLM`; `config` is a
    transformers `Qwen3Config` (tied or untied head).
    """

    decoder_layer_cls = Qwen3DecoderLayer
