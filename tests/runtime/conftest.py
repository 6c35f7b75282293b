"""Fixtures for runtime tests: the tiny model in transformers and its tokenizer."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
