"""Attention backends by name: one torch-free list (config.py reads it), one factory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from arborlm.runtime import config
from arborlm.runtime.config import ModelConfig
from arborlm.runtime.layers.attention import factory
from arborlm.runtime.layers.attention.base import AttentionBackend
from arborlm.runtime.layers.attention.names import ATTENTION_BACKEND_NAMES, ATTENTION_BACKENDS, AUTO
from arborlm.runtime.layers.attention.reference_backend import ReferenceAttentionBackend
from arborlm.runtime.layers.attention.torch_native_backend import TorchAttentionBackend

REPO = Path(__file__).resolve().parents[2]


def test_config_validates_against_the_same_names():
    assert config.ATTENTION_BACKENDS == ATTENTION_BACKEND_NAMES == (AUTO, *ATTENTION_BACKENDS)
    for name in ATTENTION_BACKEND_NAMES:
        if name != "triton":  # needs CUDA or the interpreter here
            assert ModelConfig(attention_backend=name).attention_backend == name
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        ModelConfig(attention_backend="flash")


@pytest.mark.parametrize("name", sorted(ATTENTION_BACKENDS))
def test_every_name_maps_to_a_backend_class(name):
    cls = factory.backend_class(name)
    assert issubclass(cls, AttentionBackend) and cls.__module__ + ":" + cls.__qualname__ == ATTENTION_BACKENDS[name]


@pytest.mark.parametrize("name, cls", [("auto", TorchAttentionBackend), ("torch", TorchAttentionBackend),
                                       ("reference", ReferenceAttentionBackend)])
def test_factory_on_cpu(name, cls):
    assert type(factory.create_attention_backend(name, "cpu")) is cls


def test_torch_backend_gets_the_native_kernels():
    native = object()  # stands in for NativeLayerOps: the factory only passes it on
    assert factory.create_attention_backend("torch", "cpu", native).native is native


@pytest.mark.parametrize("name", ["flash", "", "AUTO"])
def test_unknown_name_lists_the_known_ones(name):
    with pytest.raises(ValueError, match=f"attention_backend={name!r} is invalid") as info:
        factory.create_attention_backend(name, "cpu")
    for known in ATTENTION_BACKEND_NAMES:
        assert repr(known) in str(info.value)


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'triton' cannot run on cpu"):
        factory.create_attention_backend("triton", "cpu")


def test_config_and_the_name_tables_import_no_torch():
    """The front process validates config without torch: config.py, the attention names
    and the model registry (lookups, not classes) import none of it. The package's
    `__init__` is bypassed (it imports the Engine)."""
    code = f"""
import sys, types
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported")
sys.meta_path.insert(0, NoTorch())
package = types.ModuleType("arborlm")
package.__path__ = [{str(REPO / "arborlm")!r}]
sys.modules["arborlm"] = package
import arborlm.runtime.config as config
import arborlm.runtime.models.registry as registry
config.ServerArgs.from_kwargs(attention_backend="reference")
assert registry.architecture_from_config({{"model_type": "qwen2"}}, "c") == "Qwen2ForCausalLM"
assert registry.architecture_from_gguf("llama", "g") == "LlamaForCausalLM"
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
