"""Fixtures shared by the grammar tests: the default model's tokenizer and its EOS id."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_dir))


@pytest.fixture(scope="module")
def eos(tokenizer) -> int:
    return tokenizer.eos_token_id
