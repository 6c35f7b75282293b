"""Backend over an in-process `Engine`."""

from __future__ import annotations

from typing import Any

from arborlm.frontend_lang.backend.base_backend import BaseBackend
from arborlm.frontend_lang.chat_template import ChatTemplate


class EngineBackend(BaseBackend):
    """Runs generation calls on an `arborlm.Engine` in this process."""

    def __init__(self, engine):
        self.engine = engine
        self._chat_template = ChatTemplate.from_tokenizer(engine.tokenizer)

    def get_chat_template(self) -> ChatTemplate:
        return self._chat_template

    def generate(self, text: str, sampling_params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        result = self.engine.generate(prompt=text, sampling_params=sampling_params)
        return result["text"], result["meta_info"]

    def shutdown(self) -> None:
        self.engine.shutdown()
