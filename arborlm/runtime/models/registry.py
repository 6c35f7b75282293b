"""Which model class serves a checkpoint: architecture names to our implementations.

`model_loader` asks it twice: before converting a GGUF file (by the file's
`general.architecture`) and when loading a checkpoint folder (by config.json's
`architectures`, or its `model_type` when that list is missing). Classes are
imported on first use, so this module (and a lookup) imports no torch. A new family
is its module in this package plus one `ModelEntry` line in `MODELS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from arborlm.errors import ModelLoadError

if TYPE_CHECKING:
    from arborlm.runtime.models.base import CausalLM


@dataclass(frozen=True)
class ModelEntry:
    """One architecture we serve.

    Attributes
    ----------
    architecture: the name in config.json's `architectures` (transformers' class name).
    model_type: config.json's `model_type`, for configs that lack `architectures`.
    gguf_arch: GGUF's `general.architecture` of such files (llama.cpp's name), or None
        where GGUF files of this family carry another family's name.
    target: "module:Class" of our implementation, imported on first use.
    """

    architecture: str
    model_type: str
    gguf_arch: str | None
    target: str


MODELS: tuple[ModelEntry, ...] = (
    ModelEntry("LlamaForCausalLM", "llama", "llama", "arborlm.runtime.models.llama:LlamaForCausalLM"),
    ModelEntry("Qwen2ForCausalLM", "qwen2", "qwen2", "arborlm.runtime.models.llama:LlamaForCausalLM"),
    ModelEntry("MistralForCausalLM", "mistral", "mistral", "arborlm.runtime.models.llama:LlamaForCausalLM"),
    ModelEntry("Qwen3ForCausalLM", "qwen3", "qwen3", "arborlm.runtime.models.qwen3:Qwen3ForCausalLM"),
    ModelEntry("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe", "arborlm.runtime.models.qwen3_moe:Qwen3MoeForCausalLM"),
    # GGUF files of Mixtral say "llama", with experts: see GGUF_MOE_ARCHITECTURES.
    ModelEntry("MixtralForCausalLM", "mixtral", None, "arborlm.runtime.models.mixtral:MixtralForCausalLM"),
    ModelEntry("Gemma3ForCausalLM", "gemma3_text", "gemma3", "arborlm.runtime.models.gemma3:Gemma3ForCausalLM"),
    ModelEntry("Phi3ForCausalLM", "phi3", "phi3", "arborlm.runtime.models.phi3:Phi3ForCausalLM"),
)
# Multimodal checkpoints whose language model is served, text only: the model loader builds
# the class from config.json's `text_config` (`get_text_config()`), the class skips the rest.
TEXT_ONLY_MODELS: tuple[ModelEntry, ...] = (
    ModelEntry(
        "Gemma3ForConditionalGeneration", "gemma3", None,
        "arborlm.runtime.models.gemma3_mm:Gemma3TextOnlyForCausalLM",
    ),
)
_ALL_MODELS = MODELS + TEXT_ONLY_MODELS
# Bare decoders (transformers' `XModel`: no LM head, weight names without "model."), what
# sentence-transformers saves for an embedding model (e5-mistral, Qwen3-Embedding-style
# checkpoints): served by the causal-LM class for embeddings only (`--is-embedding`).
BARE_MODELS: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM",
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(e.architecture for e in _ALL_MODELS)
SUPPORTED_GGUF_ARCHS: tuple[str, ...] = tuple(e.gguf_arch for e in MODELS if e.gguf_arch is not None)
# GGUF architectures whose files with experts (`{arch}.expert_count` > 0) are another family:
# llama.cpp's convert_hf_to_gguf.py writes MixtralForCausalLM with its LlamaModel.
GGUF_MOE_ARCHITECTURES: dict[str, str] = {"llama": "MixtralForCausalLM"}


def _unsupported(found: object, supported: tuple[str, ...], source: str | None = None) -> ModelLoadError:
    """The error for an architecture we do not serve: what was found, where, and what we serve."""
    where = "" if source is None else f" in {source!r}"
    return ModelLoadError(f"unsupported architecture {found!r}{where}; supported: {', '.join(supported)}")


def entry(architecture: str) -> ModelEntry:
    """The entry of a config.json architecture name.

    Raises
    ------
    ModelLoadError
        For a name not in `SUPPORTED_ARCHITECTURES`, naming it and the supported ones.
    """
    for e in _ALL_MODELS:
        if e.architecture == architecture:
            return e
    raise _unsupported(architecture, SUPPORTED_ARCHITECTURES)


def architecture_from_config(config: dict, source: str) -> str:
    """The supported architecture a config.json (as a dict) names.

    The first of `config["architectures"]` that we serve (a bare decoder, `BARE_MODELS`, as
    its causal LM); without that list, the one registered for `config["model_type"]`.

    Parameters
    ----------
    config: the parsed config.json.
    source: where it came from, for the error message (a path).

    Raises
    ------
    ModelLoadError
        When none is supported, naming what the config says and the supported ones.
    """
    names = [BARE_MODELS.get(n, n) for n in config.get("architectures") or []]
    if not names:
        names = [e.architecture for e in _ALL_MODELS if e.model_type == config.get("model_type")]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise _unsupported(names or config.get("model_type"), SUPPORTED_ARCHITECTURES, source)


def architecture_from_gguf(gguf_arch: str, source: str, num_experts: int = 0) -> str:
    """The config.json architecture of a GGUF file whose `general.architecture` is `gguf_arch`.

    `num_experts` is the file's `{arch}.expert_count` (0 when absent): a "llama" file with
    experts is Mixtral (`GGUF_MOE_ARCHITECTURES`).

    Raises
    ------
    ModelLoadError
        For a GGUF architecture not in `SUPPORTED_GGUF_ARCHS`, naming it and the supported ones.
    """
    if num_experts > 0 and gguf_arch in GGUF_MOE_ARCHITECTURES:
        return GGUF_MOE_ARCHITECTURES[gguf_arch]
    for e in MODELS:
        if e.gguf_arch == gguf_arch:
            return e.architecture
    raise _unsupported(gguf_arch, SUPPORTED_GGUF_ARCHS, source)


def model_class(architecture: str) -> type[CausalLM]:
    """Our class serving `architecture` (a config.json name), imported now.

    Raises
    ------
    ModelLoadError
        For an architecture not in `SUPPORTED_ARCHITECTURES`.
    """
    module, _, qualname = entry(architecture).target.partition(":")
    return getattr(importlib.import_module(module), qualname)
