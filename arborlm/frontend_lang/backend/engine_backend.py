"""Backend over an in-process `Engine`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from arborlm.chat_template import ChatTemplate
from arborlm.frontend_lang.backend.base_backend import BaseBackend, StreamChunk

_TRIPLE_KEYS = ("output_token_logprobs", "input_token_logprobs")
_TOP_KEYS = ("output_top_logprobs", "input_top_logprobs")


class EngineBackend(BaseBackend):
    """Runs generation calls on an `arborlm.Engine` in this process."""

    def __init__(self, engine):
        self.engine = engine
        self._chat_template = ChatTemplate.from_tokenizer(engine.tokenizer)
        self._token_text = None

    def get_chat_template(self) -> ChatTemplate:
        return self._chat_template

    def generate(self, text: str, sampling_params: dict[str, Any], **options: Any) -> tuple[str, dict[str, Any]]:
        """Continue `text` on the engine; `return_text_in_logprobs` fills the logprob triples' token text
        (the server's `/generate` does the same)."""
        with_text = options.pop("return_text_in_logprobs", False)
        result = self.engine.generate(prompt=text, sampling_params=sampling_params, **options)
        return result["text"], self._with_text(result["meta_info"], with_text)

    def stream(self, text: str, sampling_params: dict[str, Any], **options: Any) -> Iterator[StreamChunk]:
        with_text = options.pop("return_text_in_logprobs", False)
        for chunk in self.engine.generate(prompt=text, sampling_params=sampling_params, stream=True, **options):
            yield StreamChunk(chunk["text"], self._with_text(chunk["meta_info"], with_text))

    def _with_text(self, meta: dict[str, Any] | None, with_text: bool) -> dict[str, Any] | None:
        """`meta` with each (logprob, token_id, None) triple's text decoded, when asked for."""
        if not with_text or not meta:
            return meta
        if self._token_text is None:
            from arborlm.entrypoints.openai.common import TokenText

            self._token_text = TokenText(self.engine.tokenizer)
        text = self._token_text
        meta = dict(meta)
        for key in _TRIPLE_KEYS:
            if meta.get(key):
                meta[key] = [(lp, tid, text(tid)) for lp, tid, _ in meta[key]]
        for key in _TOP_KEYS:
            if meta.get(key):
                meta[key] = [None if top is None else [(lp, tid, text(tid)) for lp, tid, _ in top]
                             for top in meta[key]]
        return meta

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
