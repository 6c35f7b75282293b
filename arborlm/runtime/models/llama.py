"""The Llama family (Llama 2/3, SmolLM, Qwen2, Mistral) over the paged KV layout.

One decoder serves them all; they differ only in config: Qwen2 has q/k/v biases,
Mistral a sliding window, Llama 3 scaled rotary frequencies, SmolLM tied
embeddings. The structure follows Hugging Face `modeling_llama.py` (and SGLang's
`models/llama.py` for the fused q/k/v and gate/up projections); the layers come
from `runtime/layers/` (norms, rotary, gated MLP and linears through `LayerOps`,
attention through `RadixAttention` and an `AttentionBackend`). The residual stream
follows SGLang: each norm takes the previous block's output and the residual, adds
them and normalises (`fused_add_rms_norm`). The model runner calls
`forward(forward_batch)` once per step; `models/registry.py` maps the config's
architecture names here. Qwen3, Qwen3-MoE and Mixtral (`qwen3.py`, `qwen3_moe.py`,
`mixtral.py`) reuse it through the decoder layer's `attention_cls` / `make_mlp`
hooks and `LlamaForCausalLM.decoder_layer_cls`. Phi-3 (`phi3.py`) is this model
with its fused checkpoint split at load; its partial and LongRoPE rotary come from
`get_rope` / `apply_rotary_` like every family's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from arborlm.kernels.cpu_ops import LayerOps, RotaryStep, layer_ops
from arborlm.runtime.distributed.parallel_state import ParallelState
from arborlm.runtime.forward_batch_info import ForwardBatch, LogitsOutput
from arborlm.runtime.layers.attention.base import AttentionBackend
from arborlm.runtime.layers.fused_decode import FusedDecode
from arborlm.runtime.layers.layernorm import RMSNorm
from arborlm.runtime.layers.linear import make_qkv_linear, make_row_linear
from arborlm.runtime.layers.logits_processor import logits_output
from arborlm.runtime.layers.mlp import GATE_SHARD, UP_SHARD, GatedMLP
from arborlm.runtime.layers.radix_attention import RadixAttention
from arborlm.runtime.layers.rotary_embedding import apply_rotary_, get_rope
from arborlm.runtime.layers.vocab_embedding import make_lm_head, make_vocab_embedding
from arborlm.runtime.models.weight_utils import load_stacked_weights

# config.json architectures this module serves with tensor_parallel (`parallel`); other families
# (their own attention or MoE blocks, not split yet) refuse tp_size > 1 in the model runner.
TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def head_dim_of(config) -> int:
    """The attention head width: `head_dim` where the config sets it, else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, rotary embedding, paged attention, output projection.

    `forward(hidden, rotary, forward_batch)`: (num_tokens, hidden_size) ->
    (num_tokens, hidden_size); writes this layer's K/V of the new tokens to the pool.
    Under tensor parallelism (`parallel`) `num_heads` / `num_kv_heads` are this rank's heads.
    """

    def __init__(
        self, config, layer_id: int, head_dim: int, dtype, device, attn_backend: AttentionBackend, ops: LayerOps,
        parallel: ParallelState | None = None,
    ):
        super().__init__()
        hidden = config.hidden_size
        self.ops = ops
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        tp = parallel or ParallelState()
        self.num_heads = tp.split(total_heads, "num_attention_heads").size
        self.num_kv_heads = tp.kv_head_range(total_kv_heads).size
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        qkv_bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.qkv_proj = make_qkv_linear(hidden, total_heads, total_kv_heads, head_dim, qkv_bias, dtype, device, ops,
                                        parallel)
        self.o_proj = make_row_linear(total_heads * head_dim, hidden, o_bias, dtype, device, ops, parallel,
                                      "num_attention_heads")
        self.attn = RadixAttention(
            self.num_heads, self.num_kv_heads, head_dim, layer_id, attn_backend,
            sliding_window=_layer_sliding_window(config, layer_id),
        )

    def forward(self, hidden: torch.Tensor, rotary: RotaryStep, forward_batch: ForwardBatch) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k rotate together: one kernel call over (num_tokens, heads + kv_heads, head_dim).
        qk = apply_rotary_(self.ops, self.norm_qk(qk.view(num_tokens, -1, self.head_dim)), rotary)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v, forward_batch))

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Hook before rotary for families that normalise q and k (Qwen3); identity here.

        qk: (num_tokens, num_heads + num_kv_heads, head_dim), q heads first.
        """
        return qk


# Families whose `sliding_window` (when set) covers every layer; in the others (Qwen2, whose
# config keeps a window it does not use unless `layer_types` says so) only `layer_types` counts.
# Qwen3-MoE's config nulls the window itself unless `use_sliding_window`.
_WHOLE_MODEL_WINDOW = ("mistral", "mixtral", "qwen3_moe", "phi3")


def _layer_sliding_window(config, layer_id: int) -> int | None:
    """The window of one layer: from `layer_types` when the config has it, else the family's."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_id] == "sliding_attention" else None
    return window if config.model_type in _WHOLE_MODEL_WINDOW else None


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual.

    `forward` takes and returns `(hidden, residual)`, where the layer's input is
    `hidden + residual` (residual None for the first layer): the add is fused into
    the next norm, as in SGLang.

    Families change a part by subclassing: `attention_cls` (Qwen3's q/k norms) and
    `make_mlp` (a sparse MoE block in Mixtral and Qwen3-MoE).
    """

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config, layer_id: int, head_dim: int, dtype, device, attn_backend, ops: LayerOps,
                 parallel: ParallelState | None = None):
        super().__init__()
        eps = config.rms_norm_eps
        self.parallel = parallel  # read by `make_mlp`; None (one rank) for every family but this one's
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device, ops)
        tp_kwargs = {} if parallel is None else {"parallel": parallel}
        self.self_attn = self.attention_cls(config, layer_id, head_dim, dtype, device, attn_backend, ops, **tp_kwargs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device, ops)
        self.mlp = self.make_mlp(config, layer_id, dtype, device, ops)
        # Decode steps of few rows run the layer as one native call where it applies (set by LlamaModel).
        self.fused_decode: FusedDecode | None = None

    def make_mlp(self, config, layer_id: int, dtype, device, ops: LayerOps) -> nn.Module:
        """The feed-forward block of layer `layer_id`: (num_tokens, hidden) -> (num_tokens, hidden)."""
        return GatedMLP(
            config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), dtype, device, ops,
            parallel=self.parallel,
        )

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryStep, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_decode is not None:
            fused = self.fused_decode(self, hidden, residual, rotary, forward_batch)
            if fused is not None:
                return fused
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (Hugging Face's `model.*` weights)."""

    def __init__(
        self, config, dtype, device, attn_backend: AttentionBackend, ops: LayerOps,
        layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer, parallel: ParallelState | None = None,
    ):
        super().__init__()
        head_dim = head_dim_of(config)
        self.embed_tokens = make_vocab_embedding(config.vocab_size, config.hidden_size, dtype, device, parallel)
        tp_kwargs = {} if parallel is None else {"parallel": parallel}
        self.layers = nn.ModuleList(
            layer_cls(config, i, head_dim, dtype, device, attn_backend, ops, **tp_kwargs)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops)
        self.rotary_emb = get_rope(config, head_dim, config.max_position_embeddings, dtype, device)
        self.attn_backend = attn_backend
        self.fused_decode = FusedDecode.create(ops, LlamaAttention)
        for layer in self.layers:
            layer.fused_decode = self.fused_decode
        # One native call for all layers only where each layer's forward is this one (which
        # would take the fused call itself): a subclass's own forward keeps its modules.
        self._stack_fused = all(type(layer).forward is LlamaDecoderLayer.forward for layer in self.layers)

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """(num_tokens, hidden_size) hidden states of the new tokens, before the final norm."""
        self.attn_backend.init_forward_metadata(forward_batch)
        hidden = self.embed_tokens(forward_batch.input_ids)
        rotary = self.rotary_emb.step(forward_batch.positions, forward_batch)
        fused = None if self.fused_decode is None or not self._stack_fused else self.fused_decode.run_layers(
            self.layers, hidden, rotary, forward_batch)
        if fused is not None:  # every layer in one native call (decode steps on the CPU kernels)
            hidden, residual = fused
            return hidden + residual
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rotary, forward_batch)
        return hidden if residual is None else hidden + residual


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over the paged KV pools.

    Parameters
    ----------
    config: a transformers `LlamaConfig` / `Qwen2Config` / `MistralConfig`.
    dtype, device: of weights and activations (logits are float32).
    attn_backend: how attention reads and writes the KV pool.
    ops: the norm / activation / rotary / linear implementations; default
        `layer_ops(device)` (the native CPU kernels where they build, else torch ops).
    parallel: this rank's tensor-parallel group (`runtime/distributed/`): heads, MLP columns
        and vocabulary split over its ranks; None for a single rank. Served for the Llama,
        Qwen2 and Mistral architectures (`TENSOR_PARALLEL_ARCHITECTURES`).

    Raises
    ------
    ModelLoadError
        For an unsupported rope_type.
    """

    # The decoder layer of the family (subclasses set their own).
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # Hugging Face projection name -> (our fused module, shard)
    _STACKED = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", GATE_SHARD), "up_proj": ("gate_up_proj", UP_SHARD),
    }

    def __init__(
        self,
        config,
        dtype: torch.dtype,
        device: torch.device,
        attn_backend: AttentionBackend,
        ops: LayerOps | None = None,
        parallel: ParallelState | None = None,
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.ops = ops if ops is not None else layer_ops(device)
        self.parallel = parallel
        self.model = LlamaModel(config, dtype, device, attn_backend, self.ops, self.decoder_layer_cls, parallel)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = make_lm_head(config.hidden_size, config.vocab_size, dtype, device, self.ops, parallel)
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
        return self.lm_head(self.model.norm(hidden)).float()

    @torch.inference_mode()
    def hidden_states(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Run one extend step without the head: (num_new_tokens, hidden_size) states after the
        final norm, what embedding models pool (`runtime/embedding.py`); K/V land in the pool."""
        return self.model.norm(self.model(forward_batch))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up.

        Raises
        ------
        ModelLoadError
            For an unknown name, a shape mismatch, or a weight left unloaded.
        """
        load_stacked_weights(self, weights, self._STACKED, skip=self._skips)

    def _skips(self, name: str) -> bool:
        """Checkpoint entries we do not load: rotary buffers (we compute our own) and a
        tied head (it is the embedding)."""
        return "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings)
