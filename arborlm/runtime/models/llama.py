"""The Llama family (Llama 2/3, SmolLM, Qwen2, Mistral) over the paged KV layout.

One decoder serves them all; they differ only in config: Qwen2 has q/k/v biases,
Mistral a sliding window, Llama 3 scaled rotary frequencies, SmolLM tied
embeddings. The layers follow Hugging Face `modeling_llama.py` (and SGLang's
`models/llama.py` for the fused q/k/v and gate/up projections); attention goes
through an `AttentionBackend`, which writes K/V into the pool and reads them back
through `req_to_token`; the norms, the SwiGLU activation and the rotary embedding go
through `LayerOps` (`kernels/cpu_ops.py`: fused C++ kernels on the CPU, torch ops
elsewhere). The residual stream follows SGLang: each norm takes the previous block's
output and the residual, adds them and normalises (`fused_add_rms_norm`). The model
runner calls `forward(forward_batch)` once per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from arborlm.errors import ModelLoadError
from arborlm.kernels.cpu_ops import LayerOps, RotaryStep, layer_ops
from arborlm.runtime.forward_batch_info import ForwardBatch, LogitsOutput
from arborlm.runtime.layers.attention_backend import AttentionBackend


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised weight: `load_weights` fills every one."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """`y = x W^T (+ b)` without random initialisation, through `ops.linear`.

    After loading, `pack()` keeps a copy of W in the layout the ops' fastest kernel
    reads (AMX tiles or oneDNN's blocked layout on a CPU with bf16; nothing
    otherwise).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device, ops: LayerOps):
        super().__init__()
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.ops = ops
        self.packed_weight: object | None = None

    def pack(self) -> None:
        """Prepack the loaded weight (`LayerOps.pack_linear`).

        Keeps `weight` beside it: a second copy of the weights in memory, a third
        on a CPU with AMX (its tile layout for decode steps and oneDNN's for
        prefills). Call again after changing `weight`.
        """
        self.packed_weight = self.ops.pack_linear(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias, self.packed_weight)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Hugging Face `LlamaRMSNorm`), accumulated in float32.

    `forward(x)` returns the normalised x; `forward(x, residual)` returns
    `(norm(x + residual), x + residual)` (see `LayerOps.rms_norm`).
    """

    def __init__(self, hidden_size: int, eps: float, dtype, device, ops: LayerOps):
        super().__init__()
        self.weight = _param((hidden_size,), dtype, device)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def rope_parameters(config) -> tuple[float, dict]:
    """`(rope_theta, scaling)` from a transformers 5 `rope_parameters` dict or the older
    `rope_theta` / `rope_scaling` attributes; `scaling["rope_type"]` defaults to "default"."""
    params = {**(getattr(config, "rope_scaling", None) or {}), **(getattr(config, "rope_parameters", None) or {})}
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    params.setdefault("rope_type", params.get("type", "default"))
    return theta, params


def rotary_inv_freq(config, head_dim: int) -> torch.Tensor:
    """Inverse frequencies `(head_dim // 2,)` float32, with linear or llama3 scaling.

    Raises
    ------
    ModelLoadError
        For a rope_type other than default, linear, llama3.
    """
    theta, scaling = rope_parameters(config)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelLoadError(f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling (transformers `_compute_llama3_parameters`)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to `max_positions`, precomputed once.

    `step(positions)` gives the step's `RotaryStep`, which `LayerOps.rotary_` applies
    to q and k together (Hugging Face's `rotate_half` layout). The sin table carries
    `rotate_half`'s sign (its first half negated), so the rotation is a roll and two
    products instead of slices, a negation and a concat, with bit-identical results
    (negation is exact).
    """

    def __init__(self, config, head_dim: int, max_positions: int, dtype, device):
        super().__init__()
        inv_freq = rotary_inv_freq(config, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_positions, head_dim)
        self.register_buffer("cos", emb.cos().to(device=device, dtype=dtype), persistent=False)
        half = head_dim // 2
        signed_sin = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)
        self.register_buffer("sin", signed_sin.to(device=device, dtype=dtype), persistent=False)

    def step(self, positions: torch.Tensor) -> RotaryStep:
        """The rotary inputs of a step; positions (num_tokens,) int64."""
        return RotaryStep(positions, self.cos, self.sin)


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, rotary embedding, paged attention, output projection."""

    def __init__(
        self, config, layer_id: int, head_dim: int, dtype, device, attn_backend: AttentionBackend, ops: LayerOps
    ):
        super().__init__()
        hidden = config.hidden_size
        self.ops = ops
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = _layer_sliding_window(config, layer_id)
        qkv_bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, qkv_bias, dtype, device, ops)
        self.o_proj = Linear(self.q_size, hidden, o_bias, dtype, device, ops)
        self.attn_backend = attn_backend

    def forward(self, hidden: torch.Tensor, rotary: RotaryStep, forward_batch: ForwardBatch) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = self.ops.rotary_(qk.view(num_tokens, -1, self.head_dim), rotary)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        o = self.attn_backend.forward(
            q, k, v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.layer_id, forward_batch, self.scale, self.sliding_window,
        )
        return self.o_proj(o.reshape(num_tokens, self.q_size))


def _layer_sliding_window(config, layer_id: int) -> int | None:
    """The window of one layer: from `layer_types` when the config has it, else Mistral's."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_id] == "sliding_attention" else None
    return window if config.model_type == "mistral" else None


class LlamaMLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))` with gate and up fused."""

    def __init__(self, config, dtype, device, ops: LayerOps):
        super().__init__()
        self.ops = ops
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias, dtype, device, ops)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias, dtype, device, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual.

    `forward` takes and returns `(hidden, residual)`, where the layer's input is
    `hidden + residual` (residual None for the first layer): the add is fused into
    the next norm, as in SGLang.
    """

    def __init__(self, config, layer_id: int, head_dim: int, dtype, device, attn_backend, ops: LayerOps):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device, ops)
        self.self_attn = LlamaAttention(config, layer_id, head_dim, dtype, device, attn_backend, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device, ops)
        self.mlp = LlamaMLP(config, dtype, device, ops)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryStep, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
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

    def __init__(self, config, dtype, device, attn_backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param((config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, head_dim, dtype, device, attn_backend, ops)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops)
        self.rotary_emb = RotaryEmbedding(config, head_dim, config.max_position_embeddings, dtype, device)
        self.attn_backend = attn_backend

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """(num_tokens, hidden_size) hidden states of the new tokens, before the final norm."""
        self.attn_backend.init_forward_metadata(forward_batch)
        hidden = F.embedding(forward_batch.input_ids, self.embed_tokens.weight)
        rotary = self.rotary_emb.step(forward_batch.positions)
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
    ops: the norm / activation / rotary implementations; default `layer_ops(device)`
        (the native CPU kernels where they build, else torch ops).
    """

    # Hugging Face projection name -> (our fused parameter, shard)
    _STACKED = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config,
        dtype: torch.dtype,
        device: torch.device,
        attn_backend: AttentionBackend,
        ops: LayerOps | None = None,
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.ops = ops if ops is not None else layer_ops(device)
        self.model = LlamaModel(config, dtype, device, attn_backend, self.ops)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device, self.ops)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> LogitsOutput:
        """Run one step; K/V of the new tokens land in the pool.

        Returns float32 logits at each request's last new token, and at every new
        token when `forward_batch.return_full_logits`.
        """
        hidden = self.model(forward_batch)
        if forward_batch.forward_mode.is_decode():
            full = self._logits(hidden)
            return LogitsOutput(next_token_logits=full, full_logits=full if forward_batch.return_full_logits else None)
        last = torch.tensor(forward_batch.extend_seq_lens_cpu, device=hidden.device).cumsum(0) - 1
        if forward_batch.return_full_logits:
            full = self._logits(hidden)
            return LogitsOutput(next_token_logits=full[last], full_logits=full)
        return LogitsOutput(next_token_logits=self._logits(hidden[last]))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up.

        Raises
        ------
        ModelLoadError
            For an unknown name, a shape mismatch, or a weight left unloaded.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, rows = self._target(name, params)
            dst = params[target].data if rows is None else params[target].data[rows]
            if dst.shape != tensor.shape:
                raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(target if rows is None else f"{target}:{rows.start}")
        self._check_loaded(params, loaded)
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    def _target(self, name: str, params: dict) -> tuple[str, slice | None]:
        """Our parameter for a Hugging Face weight name, and the rows it fills."""
        for hf_part, (ours, shard) in self._STACKED.items():
            if f".{hf_part}." in name:
                target = name.replace(hf_part, ours)
                if target in params:
                    return target, self._shard_rows(ours, shard)
        if name in params:
            return name, None
        raise ModelLoadError(f"unexpected weight {name!r} in the checkpoint")

    def _shard_rows(self, fused: str, shard) -> slice:
        attn = self.model.layers[0].self_attn
        if fused == "qkv_proj":
            start = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size}[shard]
            return slice(start, start + (attn.q_size if shard == "q" else attn.kv_size))
        size = self.model.layers[0].mlp.intermediate_size
        return slice(shard * size, (shard + 1) * size)

    def _check_loaded(self, params: dict, loaded: set[str]) -> None:
        shards = {"qkv_proj": 3, "gate_up_proj": 2}
        missing = []
        for name in params:
            fused = next((f for f in shards if f".{f}." in name), None)
            if fused is None:
                if name not in loaded:
                    missing.append(name)
            elif sum(entry.startswith(name + ":") for entry in loaded) != shards[fused]:
                missing.append(name)
        if missing:
            raise ModelLoadError(f"checkpoint lacks weights for {missing[:5]} ({len(missing)} in all)")
