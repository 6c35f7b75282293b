"""Mixtral from a GGUF file: llama.cpp writes it as a "llama" file with experts (q/k rows
permuted, experts stacked per layer, `llama.expert_count` > 0); the loader tells it apart
from a Llama, converts it itself (transformers' reader would build a dense Llama) and serves
it, against the original model."""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.runtime.gguf_mixtral import unpermute_rotary_rows
from arborlm.runtime.model_loader import check_architecture, resolve_checkpoint
from arborlm.runtime.models import registry
from tests.runtime.family_helpers import check_greedy, check_prompt_logits, tiny_checkpoint
from tests.runtime.gguf_writer import permute_rotary_rows, write_gguf

MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def gguf_checkpoint(tmp_path_factory):
    """(the converted checkpoint folder, the transformers Mixtral the GGUF file was written from)."""
    folder = tmp_path_factory.mktemp("mixtral_gguf")
    reference = tiny_checkpoint(folder / "hf", "mixtral", **MIXTRAL)
    gguf_file = write_gguf(reference, folder / "tiny.gguf")
    return resolve_checkpoint(str(gguf_file), cache_dir=folder / "cache", progress=False), reference


def test_a_llama_file_with_experts_is_mixtral():
    assert registry.architecture_from_gguf("llama", "m.gguf", num_experts=8) == "MixtralForCausalLM"
    assert registry.architecture_from_gguf("llama", "m.gguf") == "LlamaForCausalLM"


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_unpermute_undoes_llama_cpp_permutation(num_heads):
    weight = torch.randn(num_heads * 8, 5)
    torch.testing.assert_close(unpermute_rotary_rows(permute_rotary_rows(weight, num_heads), num_heads), weight)


def test_gguf_converts_to_mixtral_with_its_weight_names(gguf_checkpoint):
    """The converted folder names its weights as a Mixtral checkpoint does (transformers' own
    save of the original), so any Mixtral loader reads it."""
    from safetensors import safe_open

    converted, reference = gguf_checkpoint
    assert check_architecture(converted) == "MixtralForCausalLM"
    config = json.loads((converted / "config.json").read_text())
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 96)
    index = json.loads((converted / "model.safetensors.index.json").read_text())["weight_map"]
    original = converted.parents[1] / "hf" / "model.safetensors"  # the fixture's folder / "hf"
    with safe_open(str(original), "pt") as f:
        assert set(index) == set(f.keys())


def test_gguf_prompt_logits_match_the_original(gguf_checkpoint):
    check_prompt_logits(*gguf_checkpoint)


def test_gguf_greedy_tokens_match_the_original(gguf_checkpoint):
    check_greedy(*gguf_checkpoint)
