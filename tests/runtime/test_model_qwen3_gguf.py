"""Qwen3 and Qwen3-MoE from GGUF files: a tiny model written with the `gguf` package, converted
by the loader (through transformers' GGUF reader) and served, against the original model."""

from __future__ import annotations

import pytest

from arborlm.runtime.model_loader import check_architecture, resolve_checkpoint
from tests.runtime.family_helpers import check_greedy, check_prompt_logits, tiny_checkpoint
from tests.runtime.gguf_writer import write_gguf

# transformers' GGUF reader does not read Qwen3's attention.key_length nor Qwen3-MoE's
# expert_feed_forward_length: the converted config keeps Qwen3Config's head_dim (128) and
# Qwen3MoeConfig's moe_intermediate_size (768), so the tiny models keep them too. A qwen3moe
# file means every layer sparse and renormalised top-k (llama.cpp's qwen3moe graph).
CASES = {  # model_type -> config on top of TINY
    "qwen3": dict(),  # head_dim 128 over hidden 64 and 4 heads
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, head_dim=16, norm_topk_prob=True),
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


def test_gguf_prompt_logits_match_the_original(gguf_checkpoint):
    check_prompt_logits(*gguf_checkpoint)


def test_gguf_greedy_tokens_match_the_original(gguf_checkpoint):
    check_greedy(*gguf_checkpoint)
