"""Gemma 3 and Phi-3 from GGUF files: a tiny model written with the `gguf` package as
llama.cpp's `convert_hf_to_gguf.py` lays it out, converted by the loader (through
transformers' GGUF reader) and served, against the original model.

transformers' reader keeps only some of these families' metadata: for Gemma 3 the
sliding window, head_dim and the global rope base, not `query_pre_attn_scalar`,
the local base, the layer pattern or rope scaling; for Phi-3 neither the LongRoPE
factors (tensors `rope_factors_long` / `rope_factors_short`), the partial rotary
(`rope.dimension_count`) nor the sliding window. So the tiny models that must agree
keep the config defaults of what is lost, and the strict xfails below state what a
real file loses (Gemma 3 4B+'s linear rope scaling, Phi-3.5 / Phi-4-mini's LongRoPE).
"""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.runtime.model_loader import check_architecture, resolve_checkpoint
from tests.runtime.agreement_helpers import check_greedy, check_prompt_logits, save_tiny
from tests.runtime.gguf_writer import byte_tokens

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)
# model_type -> (gguf.MODEL_ARCH member, architecture, config on top of TINY)
CASES = {
    # Six layers: the default pattern makes the last one global.
    "gemma3_text": ("GEMMA3", "Gemma3ForCausalLM", dict(num_hidden_layers=6, head_dim=32, sliding_window=5)),
    "phi3": ("PHI3", "Phi3ForCausalLM", dict(num_hidden_layers=2)),
}
PROMPTS = [[5, 17, 99, 3, 250, 8, 41, 77, 12, 6, 9, 31, 4], [200, 1, 2], list(range(30, 60))]


def tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY, **CASES[model_type][2], **overrides})


def write_gguf(model, path, rope_extras: dict | None = None):
    """Write a transformers Gemma 3 / Phi-3 of vocabulary 256 as a float32 GGUF file.

    `rope_extras`: llama.cpp's rope metadata of the family beyond the base, e.g.
    {"scaling_factor": 8.0} (Gemma 3 linear) or {"dimension_count": 12,
    "factors": (short, long), "original_context": 64} (Phi-3 LongRoPE).
    """
    import gguf

    config, extras = model.config, rope_extras or {}
    arch = getattr(gguf.MODEL_ARCH, CASES[config.model_type][0])
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _write_hparams(writer, config, extras)
    _write_tokenizer(writer)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for a tied head
        if config.model_type == "gemma3_text" and "norm" in name:
            tensor = tensor + 1  # llama.cpp stores Gemma's norms as the 1 + weight they scale by
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), tensor.float().contiguous().numpy())
    if "factors" in extras:
        short, long = extras["factors"]
        writer.add_tensor("rope_factors_short.weight", torch.tensor(short).numpy())
        writer.add_tensor("rope_factors_long.weight", torch.tensor(long).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hparams(writer, config, extras: dict) -> None:
    import gguf

    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if config.model_type == "gemma3_text":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    if "scaling_factor" in extras:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(extras["scaling_factor"])
    if "dimension_count" in extras:
        writer.add_rope_dimension_count(extras["dimension_count"])
    if "original_context" in extras:
        writer.add_rope_scaling_orig_ctx_len(extras["original_context"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def _write_tokenizer(writer) -> None:
    """A byte-level BPE of exactly the 256 byte tokens, no merges; token 0 is BOS, EOS and pad."""
    tokens = byte_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)  # Phi-3's config default (32000) lies outside the vocabulary


def converted(folder, reference, rope_extras: dict | None = None):
    """The checkpoint folder the loader converts the GGUF file of `reference` into."""
    gguf_file = write_gguf(reference, folder / "tiny.gguf", rope_extras)
    return resolve_checkpoint(str(gguf_file), cache_dir=folder / "cache", progress=False)


@pytest.fixture(scope="module", params=sorted(CASES))
def gguf_checkpoint(request, tmp_path_factory):
    """(the converted checkpoint folder, the transformers model the GGUF file was written from)."""
    folder = tmp_path_factory.mktemp(f"{request.param}_gguf")
    reference = save_tiny(folder / "hf", tiny_config(request.param))
    return converted(folder, reference), reference


def test_gguf_converts_to_the_family(gguf_checkpoint):
    folder, reference = gguf_checkpoint
    assert check_architecture(folder) == CASES[reference.config.model_type][1]


def test_gguf_prompt_logits_match_the_original(gguf_checkpoint):
    check_prompt_logits(*gguf_checkpoint, PROMPTS)


def test_gguf_greedy_tokens_match_the_original(gguf_checkpoint):
    check_greedy(*gguf_checkpoint, PROMPTS, max_new_tokens=32)


@pytest.mark.xfail(strict=True, reason="transformers' GGUF reader drops Gemma 3's rope scaling")
def test_gemma3_gguf_keeps_linear_rope_scaling(tmp_path):
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    reference = save_tiny(tmp_path / "hf", tiny_config("gemma3_text", rope_parameters=rope))
    config = json.loads((converted(tmp_path, reference, {"scaling_factor": 8.0}) / "config.json").read_text())
    assert config["rope_parameters"]["full_attention"].get("factor") == 8.0


@pytest.mark.xfail(strict=True, reason="transformers' GGUF reader drops Phi-3's LongRoPE, partial rotary and window")
def test_phi3_gguf_keeps_longrope_partial_rotary_and_window(tmp_path):
    short, long = [1.0 + i / 10 for i in range(4)], [2.0 + i for i in range(4)]
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
            "short_factor": short, "long_factor": long}
    reference = save_tiny(tmp_path / "hf", tiny_config(
        "phi3", rope_parameters=rope, original_max_position_embeddings=64, sliding_window=6,
    ))
    extras = {"dimension_count": 8, "factors": (short, long), "original_context": 64}
    config = json.loads((converted(tmp_path, reference, extras) / "config.json").read_text())
    assert config["rope_parameters"].get("rope_type") == "longrope"
    assert config["rope_parameters"].get("partial_rotary_factor") == 0.5
    assert config.get("sliding_window") == 6
