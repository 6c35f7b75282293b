"""gguf_config: the config.json fields of a GGUF file from its metadata, on small files of
metadata (and the few tensors that carry settings) written with the `gguf` package, for what
the model tests cannot reach cheaply: Gemma 3 27B's attention scale, older files without a
local rope base, layer patterns, Phi-4-mini's rotary, and every refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest

from arborlm.errors import ModelLoadError
from arborlm.runtime.gguf_config import patch_config, read_settings
from arborlm.runtime.gguf_metadata import read_metadata

GEMMA3 = {  # Gemma 3 27B as llama.cpp writes it (transformers' config: query_pre_attn_scalar 168)
    "block_count": 62, "context_length": 131072, "embedding_length": 5376, "attention.head_count": 32,
    "attention.head_count_kv": 16, "attention.key_length": 128, "attention.value_length": 128,
    "rope.freq_base": 1e6, "attention.sliding_window": 1024,
}
PHI4_MINI = {  # hidden 3072 / 24 heads = head_dim 128, partial rotary 0.75
    "block_count": 32, "context_length": 131072, "embedding_length": 3072, "attention.head_count": 24,
    "rope.dimension_count": 96, "rope.freq_base": 1e4, "rope.scaling.original_context_length": 4096,
    "attention.sliding_window": 262144,
}
QWEN3_MOE = {
    "block_count": 2, "embedding_length": 64, "attention.head_count": 4, "attention.key_length": 16,
    "attention.value_length": 16, "expert_count": 4, "expert_used_count": 2,
}
MIXTRAL = {
    "block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 96,
    "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5,
    "rope.freq_base": 1e6, "expert_count": 8, "expert_used_count": 2, "rope.dimension_count": 16,
}


def write_metadata(path, arch: str, keys: dict, tensors: dict | None = None):
    """A GGUF file of `arch` with `{arch}.key` metadata (typed from the Python values) and tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        name = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        elif isinstance(value, str):
            writer.add_string(name, value)
        else:
            writer.add_array(name, value)
    for name, data in (tensors or {}).items():
        writer.add_tensor(name, np.asarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def settings_of(tmp_path, arch: str, keys: dict, tensors: dict | None = None):
    return read_settings(write_metadata(tmp_path / "m.gguf", arch, keys, tensors))


def factors(n: int) -> dict:
    return {"rope_factors_short.weight": np.ones(n), "rope_factors_long.weight": np.full(n, 4.0)}


# ---------------------------------------------------------------- what is read


def test_gemma3_27b_scales_queries_by_hidden_over_heads(tmp_path):
    config = settings_of(tmp_path, "gemma3", GEMMA3).config
    assert config["query_pre_attn_scalar"] == 168 and config["head_dim"] == 128
    assert config["sliding_window"] == 1024
    assert config["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]


def test_gemma3_without_a_local_base_takes_llama_cpp_s_10k(tmp_path):
    rope = settings_of(tmp_path, "gemma3", {**GEMMA3, "block_count": 26}).config["rope_parameters"]
    assert rope == {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


@pytest.mark.parametrize("extra, layer_types", [
    ({"attention.sliding_window": 0}, ["full_attention"] * 4),
    ({"attention.sliding_window_pattern": 2}, ["sliding_attention", "full_attention"] * 2),
    ({"attention.sliding_window_pattern": [True, False, True, True]},
     ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]),
], ids=["no_window", "period", "flags"])
def test_gemma3_layer_pattern(tmp_path, extra, layer_types):
    config = settings_of(tmp_path, "gemma3", {**GEMMA3, "block_count": 4, **extra}).config
    assert config["layer_types"] == layer_types
    assert config["query_pre_attn_scalar"] == 128  # head_dim below 62 layers


def test_phi4_mini_partial_rotary_longrope_and_window(tmp_path):
    config = settings_of(tmp_path, "phi3", PHI4_MINI, factors(48)).config
    rope = config["rope_parameters"]
    assert rope["partial_rotary_factor"] == 0.75 and rope["rope_type"] == "longrope"
    assert rope["short_factor"] == [1.0] * 48 and rope["long_factor"] == [4.0] * 48
    assert "attention_factor" not in rope  # none written: transformers' default
    assert config["original_max_position_embeddings"] == 4096 and config["sliding_window"] == 262144


@pytest.mark.parametrize("attn_factor, expected", [(1.19024, None), (1.5, 1.5)])
def test_phi3_attention_factor_only_where_not_the_default(tmp_path, attn_factor, expected):
    # sqrt(1 + ln(32) / ln(4096)) = 1.190238
    keys = {**PHI4_MINI, "rope.scaling.attn_factor": attn_factor}
    rope = settings_of(tmp_path, "phi3", keys, factors(48)).config["rope_parameters"]
    assert rope.get("attention_factor") == expected


def test_phi3_without_factors_or_window(tmp_path):
    keys = {**PHI4_MINI, "attention.sliding_window": 0, "rope.dimension_count": 128}
    config = settings_of(tmp_path, "phi3", keys).config
    assert config["rope_parameters"] == {"rope_type": "default", "partial_rotary_factor": 1.0, "rope_theta": 1e4}
    assert config["sliding_window"] is None


def test_qwen3_moe_expert_width_from_its_tensors_without_the_key(tmp_path):
    tensors = {"blk.0.ffn_down_exps.weight": np.zeros((4, 64, 40))}
    config = settings_of(tmp_path, "qwen3moe", QWEN3_MOE, tensors).config
    assert config["moe_intermediate_size"] == 40 and config["norm_topk_prob"] is True
    assert (config["num_experts"], config["num_experts_per_tok"], config["head_dim"]) == (4, 2, 16)


@pytest.mark.parametrize("keys, rope", [
    ({}, None),  # SmolLM2: nothing to add
    ({"rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),  # llama.cpp's default type
    ({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, None),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32768},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
], ids=["none", "linear", "type_none", "yarn"])
def test_rope_scaling(tmp_path, keys, rope):
    config = settings_of(tmp_path, "qwen3", {"rope.freq_base": 1e6, **keys}).config
    if rope is None:
        assert "rope_parameters" not in config
    else:
        assert config["rope_parameters"] == {**rope, "rope_theta": 1e6}


def test_a_llama_file_with_experts_gets_a_whole_mixtral_config(tmp_path):
    keys, tensors = {**MIXTRAL, "tokenizer.ggml.bos_token_id": 1}, {"token_embd.weight": np.zeros((32, 64))}
    settings = settings_of(tmp_path, "llama", keys, tensors)
    config = settings.config
    assert settings.architecture == "MixtralForCausalLM" and config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (8, 2, 96)
    assert config["vocab_size"] == 32 and config["tie_word_embeddings"] is True and config["bos_token_id"] == 1
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}


def test_patch_merges_nested_dicts_and_replaces_the_rest(tmp_path):
    from arborlm.runtime.gguf_config import GGUFSettings

    (tmp_path / "config.json").write_text(json.dumps({
        "head_dim": 128, "layer_types": ["a", "b"], "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    }))
    linear = {"rope_type": "linear", "factor": 8.0}
    patch_config(tmp_path, GGUFSettings("X", {"head_dim": 24, "layer_types": ["c"], "rope_parameters": linear}))
    assert json.loads((tmp_path / "config.json").read_text()) == {
        "head_dim": 24, "layer_types": ["c"], "rope_parameters": {"rope_theta": 1e6, **linear},
    }


# ---------------------------------------------------------------- what is refused

REFUSED = {
    "key_value_lengths": ("gemma3", {**GEMMA3, "attention.value_length": 256}, None, "value_length 256"),
    "gemma3_flags": ("gemma3", {**GEMMA3, "block_count": 3, "attention.sliding_window_pattern": [True, False]}, None,
                     "2 flags, 3 layers"),
    "one_factor_tensor": ("phi3", PHI4_MINI, {"rope_factors_long.weight": np.ones(48)}, "only"),
    "factor_length": ("phi3", PHI4_MINI, factors(64), "needs 48"),
    "factors_without_original": ("phi3", {k: v for k, v in PHI4_MINI.items() if "original" not in k}, factors(48),
                                 "phi3.rope.scaling.original_context_length"),
    "shared_experts": ("qwen3moe", {**QWEN3_MOE, "expert_shared_count": 1}, None, "shared experts"),
    "no_expert_width": ("qwen3moe", QWEN3_MOE, None, "qwen3moe.expert_feed_forward_length"),
    "scaling_type": ("qwen3", {"rope.scaling.type": "longrope"}, None, "'longrope' is not a scaling"),
    "partial_mixtral": ("llama", {**MIXTRAL, "rope.dimension_count": 8}, None, "rotates whole heads"),
    "architecture": ("gpt2", {}, None, "unsupported architecture 'gpt2'"),
}


@pytest.mark.parametrize("arch, keys, tensors, match", REFUSED.values(), ids=list(REFUSED))
def test_what_config_json_cannot_say_is_refused(tmp_path, arch, keys, tensors, match):
    with pytest.raises(ModelLoadError, match=match) as info:
        settings_of(tmp_path, arch, keys, tensors)
    assert "m.gguf" in str(info.value)


def test_a_file_that_is_not_gguf_is_a_model_load_error(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read the metadata"):
        read_metadata(tmp_path / "x.gguf")
