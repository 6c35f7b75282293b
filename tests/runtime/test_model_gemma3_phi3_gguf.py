"""Gemma 3 and Phi-3 from GGUF files: a tiny model written with the `gguf` package as
llama.cpp's `convert_hf_to_gguf.py` writes it (`gguf_writer.py`), converted by the loader
(transformers' GGUF reader, then the settings it drops from `gguf_config`) and served,
against the original model.

transformers' reader keeps only some of these families' metadata: for Gemma 3 the
sliding window, head_dim and the global rope base, not the attention scale, the local
base (`rope.freq_base_swa`), the layer pattern or rope scaling; for Phi-3 neither the
LongRoPE factors (tensors `rope_factors_long` / `rope_factors_short`), the original
context, the partial rotary (`rope.dimension_count`) nor the sliding window. The tiny
models set each of these away from its default: Gemma 3 4B+'s linear rope scaling (8)
with a local base of 20k and query_pre_attn_scalar = head_dim (llama.cpp's rule for all
but the 27B); Phi-3.5 / Phi-4-mini's LongRoPE with partial rotary and a window.
"""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.runtime.model_loader import check_architecture, resolve_checkpoint
from tests.runtime.agreement_helpers import check_greedy, check_prompt_logits, save_tiny
from tests.runtime.gguf_writer import write_gguf

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}
PHI3_ROTARY_DIM = 8  # half of a head of 16
ORIGINAL_MAX = 64


def phi3_longrope() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": PHI3_ROTARY_DIM / 16,
        "short_factor": (1 + torch.rand(PHI3_ROTARY_DIM // 2, generator=g)).tolist(),
        "long_factor": (1 + 8 * torch.rand(PHI3_ROTARY_DIM // 2, generator=g)).tolist(),
    }


# model_type -> (architecture, config on top of TINY)
CASES = {
    # Six layers: the default pattern makes the last one global.
    "gemma3_text": ("Gemma3ForCausalLM", dict(
        num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=5, rope_parameters=GEMMA3_ROPE,
    )),
    "phi3": ("Phi3ForCausalLM", dict(
        num_hidden_layers=2, rope_parameters=phi3_longrope(), original_max_position_embeddings=ORIGINAL_MAX,
        sliding_window=6,
    )),
}
# Ragged, longer than the windows; the last is above Phi-3's original 64 from the start (long
# factors), the others stay below it with 32 generated tokens (short factors).
PROMPTS = [[5, 17, 99, 3, 250, 8, 41, 77, 12, 6, 9, 31, 4], [200, 1, 2], list(range(30, 110))]


def tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY, **CASES[model_type][1], **overrides})


def converted(folder, reference):
    """The checkpoint folder the loader converts the GGUF file of `reference` into."""
    gguf_file = write_gguf(reference, folder / "tiny.gguf")
    return resolve_checkpoint(str(gguf_file), cache_dir=folder / "cache", progress=False)


@pytest.fixture(scope="module", params=sorted(CASES))
def gguf_checkpoint(request, tmp_path_factory):
    """(the converted checkpoint folder, the transformers model the GGUF file was written from)."""
    folder = tmp_path_factory.mktemp(f"{request.param}_gguf")
    reference = save_tiny(folder / "hf", tiny_config(request.param))
    return converted(folder, reference), reference


def test_gguf_converts_to_the_family(gguf_checkpoint):
    folder, reference = gguf_checkpoint
    assert check_architecture(folder) == CASES[reference.config.model_type][0]


def test_gguf_prompt_logits_match_the_original(gguf_checkpoint):
    check_prompt_logits(*gguf_checkpoint, PROMPTS)


def test_gguf_greedy_tokens_match_the_original(gguf_checkpoint):
    check_greedy(*gguf_checkpoint, PROMPTS, max_new_tokens=32)


# model_type -> config.json fields transformers' reader drops, as the converted checkpoint must have them.
KEPT = {
    "gemma3_text": {
        "rope_parameters": GEMMA3_ROPE, "query_pre_attn_scalar": 32, "sliding_window": 5,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    },
    "phi3": {"rope_parameters": phi3_longrope(), "original_max_position_embeddings": ORIGINAL_MAX, "sliding_window": 6},
}


def test_gguf_keeps_what_transformers_reader_drops(gguf_checkpoint):
    folder, reference = gguf_checkpoint
    config = json.loads((folder / "config.json").read_text())
    for name, expected in KEPT[reference.config.model_type].items():
        if name == "rope_parameters":
            _check_rope(config[name], expected)
        else:
            assert config[name] == expected, name


def _check_rope(got: dict, expected: dict) -> None:
    """Same keys and values, lists of factors to float32 (the file stores them so)."""
    assert got.keys() >= expected.keys(), (got, expected)
    for key, value in expected.items():
        if isinstance(value, dict):
            _check_rope(got[key], value)
        elif isinstance(value, str):
            assert got[key] == value, key
        else:
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(value), msg=key)
