"""Gemma 3, text only (`Gemma3ForCausalLM`), over the paged KV layout.

Structure as transformers' `modeling_gemma3.py` (`Gemma3TextModel`) and SGLang's
`models/gemma3_causal.py`; what sets it apart from the Llama decoder:

- every norm scales by `1 + weight` (`RMSNorm(unit_offset=True)`), and each layer
  has four: before and after attention, before and after the MLP; the residual
  add is fused into the pre-attention and pre-MLP norms, as in SGLang;
- q and k are RMS-normalised per head (`q_norm`, `k_norm`) before rotary;
- the embedding is scaled by `sqrt(hidden_size)`, rounded to the model dtype first
  as transformers does (bf16 turns sqrt(3072) = 55.43 into 55.5);
- the softmax scale is `query_pre_attn_scalar ** -0.5`, not `head_dim ** -0.5`;
- layers alternate sliding-window ("sliding_attention") and global
  ("full_attention") attention, each kind with its own rotary base
  (`rope_local_base_freq`, default 10k, and `rope_theta`, default 1M, with the
  checkpoint's scaling);
- the MLP is GeGLU (`hidden_activation` "gelu_pytorch_tanh");
- logits are soft-capped when `final_logit_softcapping` is set; the head is tied.

Gemma 3 replaced Gemma 2's attention soft-capping with the q/k norms:
transformers' and SGLang's Gemma 3 ignore `attn_logit_softcapping`, and so does
this model (it stays an exact match of the reference). The model runner calls
`forward(forward_batch)` once per step; `models/registry.py` maps
`Gemma3ForCausalLM` here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from arborlm.errors import ModelLoadError
from arborlm.kernels.cpu_ops import LayerOps, RotaryStep, layer_ops
from arborlm.runtime.forward_batch_info import ForwardBatch, LogitsOutput
from arborlm.runtime.layers.attention.base import AttentionBackend
from arborlm.runtime.layers.layernorm import RMSNorm, prepare_norms
from arborlm.runtime.layers.linear import Linear, MergedLinear
from arborlm.runtime.layers.logits_processor import logits_output
from arborlm.runtime.layers.mlp import GATE_SHARD, UP_SHARD, GatedMLP
from arborlm.runtime.layers.radix_attention import RadixAttention
from arborlm.runtime.layers.rotary_embedding import apply_rotary_, get_rope, rope_parameters
from arborlm.runtime.layers.vocab_embedding import VocabEmbedding
from arborlm.runtime.models.weight_utils import load_stacked_weights

SLIDING, FULL = "sliding_attention", "full_attention"
# Before `layer_types`, configs said every n-th layer is global (transformers' default n).
DEFAULT_SLIDING_WINDOW_PATTERN = 6
DEFAULT_LOCAL_ROPE_THETA = 10_000.0


def layer_types_of(config) -> list[str]:
    """Each layer's attention kind, SLIDING or FULL: `config.layer_types` (transformers
    >= 4.53), else derived from the older `sliding_window_pattern` as transformers does
    (layer i is global when `(i + 1) % pattern == 0`)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return list(layer_types)
    pattern = getattr(config, "sliding_window_pattern", None) or DEFAULT_SLIDING_WINDOW_PATTERN
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


def layer_rope(config, layer_type: str) -> tuple[float, dict]:
    """`(rope_theta, scaling)` of one attention kind.

    transformers 5 nests `rope_parameters` by kind; older configs give the global
    layers `rope_theta` and `rope_scaling` and the sliding ones `rope_local_base_freq`
    with no scaling.
    """
    nested = getattr(config, "rope_parameters", None) or {}
    if isinstance(nested.get(layer_type), dict) or layer_type == FULL:
        return rope_parameters(config, layer_type)
    theta = getattr(config, "rope_local_base_freq", None) or DEFAULT_LOCAL_ROPE_THETA
    return float(theta), {"rope_type": "default"}


class Gemma3Attention(nn.Module):
    """Fused q/k/v projection, per-head q/k norms, rotary, paged attention, output projection.

    `forward(hidden, rotary, forward_batch)`: (num_tokens, hidden_size) ->
    (num_tokens, hidden_size); writes this layer's K/V of the new tokens to the pool.
    `rotary` is the step of this layer's kind. Weights: `qkv_proj` (shards q, k, v),
    `o_proj`, `q_norm`, `k_norm` (head_dim,).
    """

    def __init__(
        self, config, layer_id: int, layer_type: str, dtype, device, attn_backend: AttentionBackend, ops: LayerOps
    ):
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim = config.head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        bias = bool(config.attention_bias)
        shards = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        self.qkv_proj = MergedLinear(config.hidden_size, shards, bias, dtype, device, ops)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias, dtype, device, ops)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype, device, ops, unit_offset=True)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype, device, ops, unit_offset=True)
        self.attn = RadixAttention(
            self.num_heads, self.num_kv_heads, head_dim, layer_id, attn_backend,
            scale=config.query_pre_attn_scalar**-0.5,
            sliding_window=config.sliding_window if layer_type == SLIDING else None,
        )

    def forward(self, hidden: torch.Tensor, rotary: RotaryStep, forward_batch: ForwardBatch) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # The norms take rows of head_dim: every head of every token is one row.
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rotary_(self.ops, q, rotary)
        k = apply_rotary_(self.ops, k, rotary)
        return self.o_proj(self.attn(q, k, v, forward_batch))


class Gemma3DecoderLayer(nn.Module):
    """Norm, attention, norm; norm, GeGLU MLP, norm; each block with a residual.

    `forward` takes and returns `(hidden, residual)`, where the layer's input is
    `hidden + residual` (residual None for the first layer): the adds are fused into
    `input_layernorm` and `pre_feedforward_layernorm`, as in SGLang.
    """

    def __init__(self, config, layer_id: int, layer_type: str, dtype, device, attn_backend, ops: LayerOps):
        super().__init__()
        self.layer_type = layer_type

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops, unit_offset=True)

        self.input_layernorm = norm()
        self.self_attn = Gemma3Attention(config, layer_id, layer_type, dtype, device, attn_backend, ops)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, False, dtype, device, ops,
            activation=config.hidden_activation,
        )
        self.post_feedforward_layernorm = norm()

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryStep, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rotary, forward_batch))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    """Scaled embedding, decoder layers, final norm (Hugging Face's `model.*` weights).

    `rotary_emb` holds one rotary embedding per attention kind present.
    """

    def __init__(self, config, dtype, device, attn_backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        layer_types = layer_types_of(config)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device)
        # transformers rounds the scale to the embedding dtype before multiplying.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5).to(dtype))
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, layer_type, dtype, device, attn_backend, ops)
            for i, layer_type in enumerate(layer_types)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops, unit_offset=True)
        self.rotary_emb = nn.ModuleDict({
            kind: get_rope(config, config.head_dim, config.max_position_embeddings, dtype, device,
                           params=layer_rope(config, kind))
            for kind in sorted(set(layer_types))
        })
        self.attn_backend = attn_backend

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """(num_tokens, hidden_size) hidden states of the new tokens, before the final norm."""
        self.attn_backend.init_forward_metadata(forward_batch)
        hidden = self.embed_tokens(forward_batch.input_ids) * self.embed_scale
        rotary = {kind: rope.step(forward_batch.positions, forward_batch) for kind, rope in self.rotary_emb.items()}
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rotary[layer.layer_type], forward_batch)
        return hidden + residual


class Gemma3ForCausalLM(nn.Module):
    """A Gemma 3 text model over the paged KV pools.

    Parameters
    ----------
    config: a transformers `Gemma3TextConfig` (model_type "gemma3_text").
    dtype, device: of weights and activations (logits are float32).
    attn_backend: how attention reads and writes the KV pool.
    ops: the norm / activation / rotary / linear implementations; default
        `layer_ops(device)`.

    Raises
    ------
    ModelLoadError
        For a bidirectional config (EmbeddingGemma), an unsupported activation or
        rope_type.
    """

    # Hugging Face projection name -> (our fused module, shard)
    _STACKED = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", GATE_SHARD), "up_proj": ("gate_up_proj", UP_SHARD),
    }

    def __init__(
        self, config, dtype: torch.dtype, device: torch.device, attn_backend: AttentionBackend,
        ops: LayerOps | None = None,
    ):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ModelLoadError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
        self.config = config
        self.dtype = dtype
        self.ops = ops if ops is not None else layer_ops(device)
        self.model = Gemma3Model(config, dtype, device, attn_backend, self.ops)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device, self.ops)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> LogitsOutput:
        """Run one step; K/V of the new tokens land in the pool.

        Returns float32 logits at each request's last new token, and at every new
        token when `forward_batch.return_full_logits`.
        """
        return logits_output(self.model(forward_batch), forward_batch, self._logits)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, head, then `cap * tanh(logits / cap)` in float32 (transformers caps
        in the model dtype: the same in float32, one rounding less in bf16)."""
        logits = self.lm_head(self.model.norm(hidden)).float()
        cap = self.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up, then fold the
        norms' unit offset (`prepare_norms`).

        Raises
        ------
        ModelLoadError
            For an unknown name, a shape mismatch, or a weight left unloaded.
        """
        load_stacked_weights(self, weights, self._STACKED, skip=self._skips)
        prepare_norms(self)

    def _skips(self, name: str) -> bool:
        """A tied head is the embedding: its checkpoint copy, if any, is not loaded."""
        return name == "lm_head.weight" and self.tie_word_embeddings
