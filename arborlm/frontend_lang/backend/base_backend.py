"""The interface between the interpreter and whatever serves the model.

A backend turns "continue this text with these sampling settings" into text
plus SGLang-shaped meta info. The interpreter sends the whole program text on
every call; a backend over arborlm's runtime gets the shared prefix from the
radix cache, so it costs nothing after the first call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from arborlm.frontend_lang.chat_template import ChatTemplate


class BaseBackend(ABC):
    """What the interpreter needs from a model server."""

    @abstractmethod
    def get_chat_template(self) -> ChatTemplate:
        """Role markers of the served model."""

    @abstractmethod
    def generate(self, text: str, sampling_params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Continue `text`.

        Parameters
        ----------
        text: the full program text so far.
        sampling_params: `SamplingParams` fields.

        Returns
        -------
        (generated text, meta info with at least "prompt_tokens",
        "completion_tokens", "cached_tokens", "finish_reason").

        Raises
        ------
        arborlm.errors.InvalidRequestError for bad sampling fields.
        """

    def shutdown(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what the backend holds (nothing by default)."""
