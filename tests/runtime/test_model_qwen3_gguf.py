"""Qwen3 and Qwen3-MoE from GGUF files: a tiny model written with the `gguf` package as
llama.cpp writes it, converted by the loader (transformers' GGUF reader, then the settings
it drops from `gguf_config`) and served, against the original model.

The sizes transformers' reader does not read are not its defaults here: Qwen3's head_dim
(`attention.key_length`; the reader falls back to 128) and Qwen3-MoE's expert width
(`expert_feed_forward_length`; 768). A qwen3moe file means every layer sparse and
renormalised top-k (llama.cpp's qwen3moe graph), so the MoE original has norm_topk_prob.
"""

from __future__ import annotations

import json

import pytest

from arborlm.runtime.model_loader import check_architecture, resolve_checkpoint
from tests.runtime.family_helpers import check_greedy, check_prompt_logits, tiny_checkpoint
from tests.runtime.gguf_writer import write_gguf

CASES = {  # model_type -> config on top of TINY (hidden 64, 4 heads)
    "qwen3": dict(head_dim=24),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, head_dim=16, moe_intermediate_size=40, norm_topk_prob=True),
}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module", params=list(CASES))
def gguf_checkpoint(request, tmp_path_factory):
    """(the converted checkpoint folder, the transformers model the GGUF file was written from)."""
    folder = tmp_path_factory.mktemp(f"{request.param}_gguf")
    reference = tiny_checkpoint(folder / "hf", request.param, **CASES[request.param])
    gguf_file = write_gguf(reference, folder / "tiny.gguf")
    converted = resolve_checkpoint(str(gguf_file), cache_dir=folder / "cache", progress=False)
    return converted, reference


def test_gguf_converts_to_the_family(gguf_checkpoint):
    converted, reference = gguf_checkpoint
    assert check_architecture(converted) == ARCHITECTURES[reference.config.model_type]
    config = json.loads((converted / "config.json").read_text())
    for name, value in CASES[reference.config.model_type].items():
        assert config[name] == value, name


def test_gguf_prompt_logits_match_the_original(gguf_checkpoint):
    check_prompt_logits(*gguf_checkpoint)


def test_gguf_greedy_tokens_match_the_original(gguf_checkpoint):
    check_greedy(*gguf_checkpoint)
