"""A multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`, model_type "gemma3",
the 4B+ releases) served text-only: a tiny random one saved by transformers (a SigLIP tower
of one layer beside a 2-layer language model), loaded through the loader (text_config
unwrapped, `language_model.` prefix stripped, vision weights skipped), against transformers'
multimodal model on text prompts."""

from __future__ import annotations

import pytest
import torch

from arborlm.runtime.model_loader import check_architecture, load_model
from arborlm.runtime.models.gemma3 import Gemma3ForCausalLM
from arborlm.runtime.models.gemma3_mm import text_model_name
from tests.runtime.agreement_helpers import check_greedy, check_prompt_logits, save_tiny

TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=5, max_position_embeddings=512,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    layer_types=["sliding_attention", "full_attention"], bos_token_id=2, eos_token_id=1, pad_token_id=0,
)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
PROMPTS = [[5, 17, 99, 3, 250, 8, 41, 77, 12, 6, 9, 31, 4], [200, 3, 2], list(range(30, 60))]


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory):
    """(folder, transformers Gemma3ForConditionalGeneration) of a tiny random checkpoint."""
    from transformers import Gemma3Config

    folder = tmp_path_factory.mktemp("gemma3_multimodal")
    config = Gemma3Config(
        text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
        image_token_index=255, boi_token_index=253, eoi_token_index=254,
    )
    return folder, save_tiny(folder, config)


def test_the_language_model_is_served(multimodal_checkpoint):
    folder, _ = multimodal_checkpoint
    assert check_architecture(folder) == "Gemma3ForConditionalGeneration"
    loaded = load_model(folder, torch.float32, torch.device("cpu"))
    assert isinstance(loaded.model, Gemma3ForCausalLM)
    assert loaded.hf_config.model_type == "gemma3_text" and loaded.hf_config.num_hidden_layers == 2


def test_prompt_logits_match_transformers(multimodal_checkpoint):
    check_prompt_logits(*multimodal_checkpoint, PROMPTS)


def test_greedy_tokens_match_transformers(multimodal_checkpoint):
    check_greedy(*multimodal_checkpoint, PROMPTS, max_new_tokens=32)


@pytest.mark.parametrize("name, text_name", [
    ("language_model.model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("language_model.lm_head.weight", "lm_head.weight"),
    ("model.language_model.norm.weight", "model.norm.weight"),  # transformers' in-memory names
    ("lm_head.weight", "lm_head.weight"),
    ("vision_tower.vision_model.embeddings.patch_embedding.weight", None),
    ("multi_modal_projector.mm_input_projection_weight", None),
    ("model.vision_tower.encoder.layers.0.mlp.fc1.weight", None),
    ("model.multi_modal_projector.mm_soft_emb_norm.weight", None),
])
def test_weight_names_of_both_layouts(name, text_name):
    assert text_model_name(name) == text_name
