"""The model registry: architecture names (config.json, GGUF) to our model classes."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from arborlm.errors import ModelLoadError
from arborlm.runtime import model_loader
from arborlm.runtime.model_loader import (
    default_model_path,
    gguf_architecture,
    load_model,
    resolve_checkpoint,
)
from arborlm.runtime.models import registry
from arborlm.runtime.models.registry import MODELS, SUPPORTED_ARCHITECTURES, SUPPORTED_GGUF_ARCHS
from tests.runtime.model_helpers import ModelHarness


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_every_registered_architecture_resolves_to_a_class(architecture):
    cls = registry.model_class(architecture)
    assert isinstance(cls, type) and issubclass(cls, torch.nn.Module)
    assert callable(cls.load_weights) and callable(cls.forward)


def test_registry_names_are_unique():
    for attribute in ("architecture", "model_type", "gguf_arch"):
        names = [getattr(e, attribute) for e in MODELS if getattr(e, attribute) is not None]
        assert len(names) == len(set(names)), attribute


def test_unknown_architecture_names_it_and_the_supported_ones():
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as info:
        registry.model_class("GPT2LMHeadModel")
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)


CONFIG_CASES = [  # (config.json, architecture)
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "LlamaForCausalLM"),
    ({"architectures": ["Qwen2ForCausalLM"]}, "Qwen2ForCausalLM"),
    ({"architectures": ["SomethingElse", "MistralForCausalLM"]}, "MistralForCausalLM"),
    ({"model_type": "llama"}, "LlamaForCausalLM"),
    ({"model_type": "qwen2", "architectures": []}, "Qwen2ForCausalLM"),
    ({"model_type": "mistral"}, "MistralForCausalLM"),
]


@pytest.mark.parametrize("config, expected", CONFIG_CASES)
def test_config_json_lookup(config, expected):
    assert registry.architecture_from_config(config, "config.json") == expected


@pytest.mark.parametrize("config, found", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"model_type": "gpt2"}, "gpt2"),
    ({}, "None"),
])
def test_unsupported_config_names_what_it_found(config, found):
    with pytest.raises(ModelLoadError, match=found) as info:
        registry.architecture_from_config(config, "/some/config.json")
    assert "/some/config.json" in str(info.value) and "LlamaForCausalLM" in str(info.value)


@pytest.mark.parametrize("entry", [e for e in MODELS if e.gguf_arch], ids=lambda e: e.gguf_arch)
def test_gguf_arch_lookup(entry):
    assert registry.architecture_from_gguf(entry.gguf_arch, "x.gguf") == entry.architecture


def test_unsupported_gguf_arch_names_it_and_the_supported_ones():
    with pytest.raises(ModelLoadError, match="'gpt2' in 'x.gguf'") as info:
        registry.architecture_from_gguf("gpt2", "x.gguf")
    for name in SUPPORTED_GGUF_ARCHS:
        assert repr(name)[1:-1] in str(info.value)


# ---------------------------------------------------------------- GGUF headers


def _gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def write_gguf_header(path, metadata: list[tuple[str, int, bytes]], magic: bytes = b"GGUF", version: int = 3):
    """A GGUF file of no tensors whose metadata is `(key, value type, encoded value)` triples."""
    body = b"".join(_gguf_string(key) + struct.pack("<I", vtype) + value for key, vtype, value in metadata)
    path.write_bytes(struct.pack("<4sIQQ", magic, version, 0, len(metadata)) + body)
    return path


STRING, ARRAY, UINT32, FLOAT32 = 8, 9, 4, 6
BEFORE_ARCH = [  # values of every shape a reader must skip to reach general.architecture
    ("general.type", STRING, _gguf_string("model")),
    ("general.alignment", UINT32, struct.pack("<I", 32)),
    ("x.scale", FLOAT32, struct.pack("<f", 0.5)),
    ("x.tokens", ARRAY, struct.pack("<IQ", STRING, 2) + _gguf_string("a") + _gguf_string("bc")),
    ("x.ids", ARRAY, struct.pack("<IQ", UINT32, 3) + struct.pack("<3I", 1, 2, 3)),
]


def test_gguf_architecture_skips_earlier_metadata(tmp_path):
    path = write_gguf_header(tmp_path / "m.gguf", [*BEFORE_ARCH, ("general.architecture", STRING, _gguf_string("qwen2"))])
    assert gguf_architecture(path) == "qwen2"


def test_gguf_architecture_of_the_default_model():
    assert gguf_architecture(default_model_path()) == "llama"


@pytest.mark.parametrize("magic, version, metadata, match", [
    (b"GGML", 3, [], "not a GGUF"),
    (b"GGUF", 1, [], "not a GGUF"),
    (b"GGUF", 3, BEFORE_ARCH, "no general.architecture"),
    (b"GGUF", 3, [("x", 99, b"")], "cannot read the header"),
])
def test_unreadable_gguf_header_is_a_model_load_error(tmp_path, magic, version, metadata, match):
    path = write_gguf_header(tmp_path / "m.gguf", metadata, magic, version)
    with pytest.raises(ModelLoadError, match=match):
        gguf_architecture(path)


def test_unsupported_gguf_is_refused_before_conversion(tmp_path, monkeypatch):
    def no_conversion(*args):
        raise AssertionError("converted a GGUF file of an unsupported architecture")

    monkeypatch.setattr(model_loader, "_convert", no_conversion)
    path = write_gguf_header(tmp_path / "gpt.gguf", [("general.architecture", STRING, _gguf_string("gpt2"))])
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        resolve_checkpoint(str(path), cache_dir=tmp_path / "cache")


# ---------------------------------------------------------------- each architecture end to end

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=96, max_position_embeddings=256, tie_word_embeddings=False,
)
# What sets a family apart, small enough to show in a short prompt (Qwen2's q/k/v biases are on by default).
TINY_EXTRA = {
    "mistral": {"sliding_window": 4},
    "gemma3_text": {"sliding_window": 4},
    # Phi-3's default token ids (32000) lie outside the tiny vocabulary.
    "phi3": {"sliding_window": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
}


def tiny_checkpoint(folder, model_type: str):
    """A random 2-layer checkpoint of `model_type` (float32), as transformers writes it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **TINY, **TINY_EXTRA.get(model_type, {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("entry", MODELS, ids=lambda e: e.architecture)
def test_each_architecture_loads_and_agrees_with_transformers(tmp_path, entry):
    """The registered class of each architecture builds from its config, loads its weights
    and gives transformers' prompt logits."""
    reference = tiny_checkpoint(tmp_path, entry.model_type)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [entry.architecture]
    loaded = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert loaded.architecture == entry.architecture
    assert isinstance(loaded.model, registry.model_class(entry.architecture))
    prompts = [[5, 17, 99, 3, 250, 8, 41, 77, 12, 6], [200, 1, 2]]
    harness = ModelHarness(loaded.model, loaded.hf_config)
    out = harness.extend([harness.new_req() for _ in prompts], prompts, return_full_logits=True)
    with torch.no_grad():
        expected = torch.cat([reference(torch.tensor([ids])).logits[0].float() for ids in prompts])
    torch.testing.assert_close(out.full_logits, expected, atol=1e-4, rtol=0)
