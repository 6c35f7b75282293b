"""Phi-3 against transformers on tiny random checkpoints (float32).

The checkpoints store q/k/v and gate/up fused, as Phi-3's do, and switch on its
rotary: partial (`partial_rotary_factor` 0.5 of a head of 24) with LongRoPE
(short and long factors, `original_max_position_embeddings` 64 below
`max_position_embeddings` 512, so the attention factor is not 1). One batch mixes
prompts below and above 64 tokens, which take different factor sets in the same
step; a second checkpoint has a sliding window (6) shorter than the prompts.
"""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.errors import ModelLoadError
from arborlm.runtime.models import registry
from arborlm.runtime.models.phi3 import Phi3ForCausalLM, split_fused_weights
from tests.runtime.agreement_helpers import check_greedy, check_prompt_logits, load, save_tiny

HIDDEN, HEADS, PARTIAL = 96, 4, 0.5
ROTARY_DIM = int(HIDDEN // HEADS * PARTIAL)
ORIGINAL_MAX = 64


def longrope(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": PARTIAL,
        "short_factor": (1 + torch.rand(ROTARY_DIM // 2, generator=g)).tolist(),
        "long_factor": (1 + 8 * torch.rand(ROTARY_DIM // 2, generator=g)).tolist(),
        "factor": 512 / ORIGINAL_MAX,
    }


BASE = dict(
    vocab_size=256, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=HEADS,
    num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=ORIGINAL_MAX,
    rope_parameters=longrope(), pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
CASES = {"longrope_partial": {}, "sliding_window": {"sliding_window": 6}}
SHORT = [[5, 17, 99, 3, 250, 8, 41, 77, 12, 6, 9, 31, 4], [200, 1, 2, 7]]  # + 32 tokens stay below 64
LONG = [list(range(30, 110))]  # above 64 from the start
BACKENDS = ["torch", "reference"]


def phi3_config(**overrides):
    from transformers import Phi3Config

    return Phi3Config(**{**BASE, **overrides})


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_phi3(request, tmp_path_factory):
    """(folder, transformers model) of one case of CASES."""
    folder = tmp_path_factory.mktemp(f"phi3_{request.param}")
    return folder, save_tiny(folder, phi3_config(**CASES[request.param]))


def test_the_checkpoint_is_fused_and_served(tiny_phi3):
    from safetensors import safe_open

    folder, _ = tiny_phi3
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert registry.architecture_from_config({"model_type": "phi3"}, "c") == "Phi3ForCausalLM"
    assert registry.architecture_from_gguf("phi3", "g") == "Phi3ForCausalLM"
    assert isinstance(load(folder).model, Phi3ForCausalLM)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logits_short_and_long_in_one_batch(tiny_phi3, backend):
    folder, reference = tiny_phi3
    check_prompt_logits(folder, reference, SHORT + LONG, attention_backend=backend)


@pytest.mark.parametrize("prompts", [SHORT, LONG], ids=["short", "long"])
def test_greedy_32_tokens(tiny_phi3, prompts):
    folder, reference = tiny_phi3
    check_greedy(folder, reference, prompts, max_new_tokens=32)


def test_split_fused_weights_yields_views_in_stacking_order():
    qkv = torch.arange(10.0)[:, None].expand(10, 3)
    parts = dict(split_fused_weights(
        [("m.layers.0.self_attn.qkv_proj.weight", qkv), ("m.norm.weight", torch.ones(3))],
        {"self_attn.qkv_proj": (4, 3, 3)},
    ))
    assert list(parts) == ["m.layers.0.self_attn.q_proj.weight", "m.layers.0.self_attn.k_proj.weight",
                           "m.layers.0.self_attn.v_proj.weight", "m.norm.weight"]
    assert parts["m.layers.0.self_attn.k_proj.weight"][:, 0].tolist() == [4.0, 5.0, 6.0]
    assert parts["m.layers.0.self_attn.v_proj.weight"].data_ptr() == qkv[7:].data_ptr()


def test_fused_weight_of_the_wrong_height_is_a_load_error():
    weights = [("model.layers.0.mlp.gate_up_proj.weight", torch.zeros(7, 3))]
    with pytest.raises(ModelLoadError, match="gate_up_proj.*7 rows, expected 8"):
        list(split_fused_weights(weights, {"mlp.gate_up_proj": (4, 4)}))


def test_longrope_factors_of_the_wrong_length_are_refused():
    from arborlm.runtime.layers.attention.reference_backend import ReferenceAttentionBackend

    config = phi3_config()
    config.rope_parameters = {**config.rope_parameters, "long_factor": [1.0, 2.0]}
    with pytest.raises(ModelLoadError, match=f"long_factor must list {ROTARY_DIM // 2} numbers"):
        Phi3ForCausalLM(config, torch.float32, torch.device("cpu"), ReferenceAttentionBackend())
