"""Shared fixtures: a tiny random Llama checkpoint (fixed seed), the default SmolLM2,
and one Engine on the tiny model per test module with a pool-leak check after each test."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import arborlm
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

@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir):
    engine = arborlm.Engine(model=str(tiny_llama_dir), dtype="float32", max_total_tokens=8192,
                            random_seed=1234, log_level="warning")
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(tiny_engine):
    """The module's engine; afterwards every KV slot and request row must be back in its pool."""
    yield tiny_engine
    if tiny_engine._closed:
        return
    deadline = time.monotonic() + 10
    while True:  # aborted requests finish on the scheduler's next step
        info = tiny_engine.get_server_info(check_invariants=True)
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert info["free_req_rows"] == info["total_req_rows"]
    assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]
