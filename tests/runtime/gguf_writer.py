"""Write a tiny transformers model as a float32 GGUF file (the `gguf` package) the way llama.cpp's
`convert_hf_to_gguf.py` writes it, for the loader's GGUF path to convert back.

Families: Qwen3, Qwen3-MoE, Mixtral (a "llama" file with experts, q/k rows permuted), Gemma 3
(norms stored as 1 + weight), Phi-3 (LongRoPE factors as tensors), Llama (q/k rows permuted,
Llama 3.x's llama3 rope scaling as the `rope_freqs` tensor). Metadata as the converter's
classes write it: `TextModel.set_gguf_parameters` for most keys, `LlamaModel` (vocab size, rope
dimension count), `Qwen2MoeModel` (expert width), `Gemma3Model`, `Phi3MiniModel` (which writes
its own keys and no key length). No output tensor for a tied head.

The tokenizer is byte-level BPE over exactly 256 tokens (one per byte, GPT-2's byte-to-unicode
alphabet, no merges), so it fits the tiny models' vocabulary of 256; token 0 is BOS, EOS and pad.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

# model_type -> gguf.MODEL_ARCH member
ARCHES = {
    "qwen3": "QWEN3", "qwen3_moe": "QWEN3MOE", "mixtral": "LLAMA", "gemma3_text": "GEMMA3", "phi3": "PHI3",
    "llama": "LLAMA",
}
# model types whose q/k rows llama.cpp permutes (LlamaModel.modify_tensors)
PERMUTED = ("mixtral", "llama")


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (`bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_gguf(model, path: Path, qtype=None) -> Path:
    """Write `model` (a transformers model of a family in ARCHES, vocabulary 256) to `path`.

    qtype: a `gguf.GGMLQuantizationType` (e.g. Q8_0) for every matrix whose rows are whole
    blocks, quantized with `gguf.quants.quantize` (llama.cpp's quantize keeps norms, biases,
    the router and rope factors in float32 too); None writes float32 throughout.
    """
    import gguf

    config = model.config
    arch = getattr(gguf.MODEL_ARCH, ARCHES[config.model_type])
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    if config.model_type == "phi3":
        _write_phi3_hparams(writer, config)
    else:
        _write_hparams(writer, config)
    _write_tokenizer(writer)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for a tied head
        for gguf_name, data in _gguf_tensors(names, config, name, tensor.float()):
            _add_tensor(writer, gguf_name, data.contiguous().numpy(), qtype)
    for gguf_name, data in [*_rope_factor_tensors(config), *_rope_freqs_tensor(config)]:
        writer.add_tensor(gguf_name, data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer, name: str, data, qtype) -> None:
    """Add one tensor, quantized to `qtype` where it is a matrix of whole blocks (not the router)."""
    import gguf

    if qtype is None or data.ndim < 2 or "ffn_gate_inp" in name or data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _rope(config) -> tuple[dict, dict | None]:
    """(the global layers' rope parameters, the sliding layers' or None), transformers 5 style."""
    rope = config.rope_parameters
    if "full_attention" in rope:
        return rope["full_attention"], rope.get("sliding_attention")
    return rope, None


def _write_hparams(writer, config) -> None:
    """`TextModel.set_gguf_parameters` and the family's additions (all families but Phi-3)."""
    import gguf

    hparams = config.to_dict()
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    full, sliding = _rope(config)
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_freq_base(full["rope_theta"])
    if sliding is not None:
        writer.add_rope_freq_base_swa(sliding["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    experts = hparams.get("num_local_experts") or hparams.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if hparams.get("head_dim") is not None:
        writer.add_key_length(hparams["head_dim"])
        writer.add_value_length(hparams["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if config.model_type == "qwen3_moe":  # Qwen2MoeModel
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.model_type in PERMUTED:  # LlamaModel
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(hparams.get("head_dim") or config.hidden_size // config.num_attention_heads)
    if config.model_type == "gemma3_text":  # Gemma3Model
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)


def _write_phi3_hparams(writer, config) -> None:
    """`Phi3MiniModel.set_gguf_parameters` (it does not call the base class's)."""
    import gguf

    rope = config.rope_parameters
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size) // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(rope_dims)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_sliding_window(config.sliding_window or 0)  # 0: no window (Phi-4)
    if rope.get("long_factor"):  # Phi3MiniModel.generate_extra_tensors
        scale = config.max_position_embeddings / config.original_max_position_embeddings
        original = config.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _rope_factor_tensors(config):
    """Phi-3's LongRoPE factors, as `rope_factors_long` / `rope_factors_short` tensors."""
    rope = config.rope_parameters
    if config.model_type != "phi3" or not rope.get("long_factor"):
        return []
    return [
        ("rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32)),
        ("rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32)),
    ]


def _rope_freqs_tensor(config):
    """Llama 3.x's llama3 scaling as `LlamaModel.generate_extra_tensors` writes it: the
    `rope_freqs` divisor of each rotary pair (no scaling key)."""
    rope = config.rope_parameters
    if config.model_type != "llama" or rope.get("rope_type") != "llama3":
        return []
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return [("rope_freqs.weight", torch.tensor(factors, dtype=torch.float32))]


def _write_tokenizer(writer) -> None:
    tokens = byte_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))  # all normal
    writer.add_token_scores([0.0] * len(tokens))  # transformers reads merges from scores when none are given
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)  # Phi-3's config default (32000) lies outside the vocabulary


def permute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute`: each head's q/k rows from halves to adjacent pairs."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


def _gguf_tensors(names, config, name: str, tensor: torch.Tensor):
    """GGUF (name, tensor) pairs of one transformers weight; stacked experts split into
    llama.cpp's gate / up / down expert tensors."""
    block = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith("mlp.experts.gate_up_proj"):
        gate, up = tensor.chunk(2, dim=1)
        return [(f"blk.{block}.ffn_gate_exps.weight", gate), (f"blk.{block}.ffn_up_exps.weight", up)]
    if name.endswith("mlp.experts.down_proj"):
        return [(f"blk.{block}.ffn_down_exps.weight", tensor)]
    if config.model_type == "gemma3_text" and "norm" in name:
        tensor = tensor + 1  # llama.cpp stores Gemma's norms as the 1 + weight they scale by
    if config.model_type in PERMUTED and name.endswith("q_proj.weight"):
        tensor = permute_rotary_rows(tensor, config.num_attention_heads)
    if config.model_type in PERMUTED and name.endswith("k_proj.weight"):
        tensor = permute_rotary_rows(tensor, config.num_key_value_heads)
    gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
        raise ValueError(f"no GGUF name for {name!r}")
    return [(gguf_name, tensor)]
