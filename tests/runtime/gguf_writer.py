"""Write a tiny transformers Qwen3 / Qwen3-MoE model as a float32 GGUF file (the `gguf` package),
as llama.cpp's `convert_hf_to_gguf.py` lays it out, for the loader's GGUF path to convert back.

The tokenizer is byte-level BPE over exactly 256 tokens (one per byte, GPT-2's byte-to-unicode
alphabet, no merges), so it fits the tiny models' vocabulary of 256.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHES = {"qwen3": "QWEN3", "qwen3_moe": "QWEN3MOE"}  # model_type -> gguf.MODEL_ARCH member


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


def write_gguf(model, path: Path) -> Path:
    """Write `model` (a transformers Qwen3 / Qwen3-MoE of vocabulary 256) to `path`."""
    import gguf

    config = model.config
    arch = getattr(gguf.MODEL_ARCH, ARCHES[config.model_type])
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _write_hparams(writer, config)
    _write_tokenizer(writer)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        for gguf_name, data in _gguf_tensors(names, name, tensor.float()):
            writer.add_tensor(gguf_name, data.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hparams(writer, config) -> None:
    import gguf

    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if config.model_type == "qwen3_moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


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


def _gguf_tensors(names, name: str, tensor: torch.Tensor):
    """GGUF (name, tensor) pairs of one transformers weight; stacked experts split into
    llama.cpp's gate / up / down expert tensors."""
    if name.endswith("mlp.experts.gate_up_proj"):
        block = name.split(".")[2]
        gate, up = tensor.chunk(2, dim=1)
        return [(f"blk.{block}.ffn_gate_exps.weight", gate), (f"blk.{block}.ffn_up_exps.weight", up)]
    if name.endswith("mlp.experts.down_proj"):
        return [(f"blk.{name.split('.')[2]}.ffn_down_exps.weight", tensor)]
    gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
        raise ValueError(f"no GGUF name for {name!r}")
    return [(gguf_name, tensor)]
