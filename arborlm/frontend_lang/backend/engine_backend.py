"""Backend over an in-process `Engine`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from arborlm.chat_template import ChatTemplate
from arborlm.frontend_lang.backend.base_backend import BaseBackend, StreamChunk


class EngineBackend(BaseBackend):
    """Runs generation calls on an `arborlm.Engine` in this process."""

    def __init__(self, engine):
        self.engine = engine
        self._chat_template = ChatTemplate.from_tokenizer(engine.tokenizer)

    def get_chat_template(self) -> ChatTemplate:
        return self._chat_template

    def generate(self, text: str, sampling_params: dict[str, Any], **options: Any) -> tuple[str, dict[str, Any]]:
        result = self.engine.generate(prompt=text, sampling_params=sampling_params, **options)
        return result["text"], result["meta_info"]

    def stream(self, text: str, sampling_params: dict[str, Any], **options: Any) -> Iterator[StreamChunk]:
        for chunk in self.engine.generate(prompt=text, sampling_params=sampling_params, stream=True, **options):
            yield StreamChunk(chunk["text"], chunk["meta_info"])

    def prefill(self, text: str) -> dict[str, Any]:
        return self.engine.generate(prompt=text, sampling_params={"max_new_tokens": 0})["meta_info"]

    def score(self, prompts: list[str] | list[list[int]], logprob_start_len: int) -> list[dict[str, Any]]:
        key = "input_ids" if prompts and isinstance(prompts[0], list) else "prompt"
        results = self.engine.generate(**{key: list(prompts)}, sampling_params={"max_new_tokens": 0},
                                       return_logprob=True, logprob_start_len=logprob_start_len)
        return [r["meta_info"] for r in results]

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        self.engine.shutdown()
