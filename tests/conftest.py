"""Shared fixtures: a tiny random Llama checkpoint (fixed seed) and the default SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from arborlm.runtime.model_loader import resolve_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The default model's checkpoint folder (converted once per machine into $ARBORLM_CACHE)."""
    return resolve_checkpoint(None, progress=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm_dir) -> Path:
    """A 2-layer random LlamaForCausalLM (float32 safetensors) with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (smollm_dir / name).is_file():
            (folder / name).write_bytes((smollm_dir / name).read_bytes())
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_llama_dir):
    """The tiny checkpoint in transformers, the reference implementation."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
