"""Gemma 3's multimodal checkpoints (`Gemma3ForConditionalGeneration`, the 4B+ releases),
served text-only by the Gemma 3 text model.

Such a checkpoint holds a `Gemma3ForCausalLM` language model beside a SigLIP vision
tower and a projector. Its config.json nests the language model's config as
`text_config` (model_type "gemma3_text"): the loader gives the model that one
(`get_text_config()`). Its weights carry the language model's prefix: Google's release
and transformers' `save_pretrained` write `language_model.model.layers.*` (the head
tied, no `lm_head`), transformers' in-memory names are `model.language_model.*` with a
top-level `lm_head`; both are read here as the text model's `model.*`, and the vision
tower and projector are skipped. Images are not served. `models/registry.py` maps
`Gemma3ForConditionalGeneration` here (`TEXT_ONLY_MODELS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from arborlm.runtime.models.gemma3 import Gemma3ForCausalLM

# Multimodal parts of the checkpoint, in either naming.
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# Language-model prefix -> what it becomes in the text model's names.
_TEXT_PREFIXES = {"language_model.": "", "model.language_model.": "model."}


def text_model_name(name: str) -> str | None:
    """The text model's name of a `Gemma3ForConditionalGeneration` weight; None for the
    vision tower's and the projector's.

    "language_model.model.norm.weight" and "model.language_model.norm.weight" ->
    "model.norm.weight"; "lm_head.weight" stays.
    """
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, replacement in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def text_model_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's `(name, tensor)` pairs of a multimodal checkpoint, renamed."""
    for name, tensor in weights:
        text_name = text_model_name(name)
        if text_name is not None:
            yield text_name, tensor


class Gemma3TextOnlyForCausalLM(Gemma3ForCausalLM):
    """`Gemma3ForCausalLM` loading the language model of a multimodal Gemma 3 checkpoint.

    Parameters as `Gemma3ForCausalLM`; `config` is the checkpoint's `text_config`
    (a `Gemma3TextConfig`).
    """

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the language model's weights (prefix stripped), skipping the vision tower.

        Raises
        ------
        ModelLoadError
            As `Gemma3ForCausalLM.load_weights`.
        """
        super().load_weights(text_model_weights(weights))
