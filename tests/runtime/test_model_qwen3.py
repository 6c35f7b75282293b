"""Qwen3 (dense) against transformers: q/k norms, a head_dim of its own, biases, windows, tied heads."""

from __future__ import annotations

import pytest

from arborlm.runtime.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM
from tests.runtime.family_helpers import (
    check_greedy,
    check_prompt_logits,
    load_ours,
    tiny_checkpoint,
)

CASES = {  # name -> Qwen3Config on top of TINY
    # head_dim 32 with 4 heads over hidden 64: q is wider than the hidden state.
    "untied": dict(head_dim=32),
    "tied": dict(head_dim=32, tie_word_embeddings=True),
    # q/k/v/o biases; layers from max_window_layers on attend to the last 4 positions only.
    "bias_window": dict(attention_bias=True, use_sliding_window=True, sliding_window=4, max_window_layers=1),
}


@pytest.fixture(scope="module", params=list(CASES))
def qwen3_checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"qwen3_{request.param}")
    return folder, tiny_checkpoint(folder, "qwen3", **CASES[request.param])


def test_loads_as_qwen3_with_qk_norms(qwen3_checkpoint):
    folder, reference = qwen3_checkpoint
    config = reference.config
    loaded = load_ours(folder)
    assert loaded.architecture == "Qwen3ForCausalLM"
    assert isinstance(loaded.model, Qwen3ForCausalLM)
    layers = loaded.model.model.layers
    assert all(isinstance(layer.self_attn, Qwen3Attention) for layer in layers)
    assert layers[0].self_attn.q_norm.weight.shape == (config.head_dim,)
    assert (layers[0].self_attn.qkv_proj.bias is not None) == config.attention_bias
    tied = loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert tied == config.tie_word_embeddings
    windows = [config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types]
    assert [layer.self_attn.attn.sliding_window for layer in layers] == windows


def test_prompt_logits_match_transformers(qwen3_checkpoint):
    check_prompt_logits(*qwen3_checkpoint)


def test_greedy_tokens_match_transformers(qwen3_checkpoint):
    check_greedy(*qwen3_checkpoint)
