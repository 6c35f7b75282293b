"""The interface between the interpreter and whatever serves the model.

A backend turns "continue this text with these sampling settings" into text
plus SGLang-shaped meta info. The interpreter sends the whole program text on
every call; a backend over arborlm's runtime gets the shared prefix from the
radix cache, so it costs nothing after the first call.

Two methods are required (`get_chat_template`, `generate`); the others have
defaults that either fall back (`stream` yields one chunk, `prefill` does
nothing) or raise `UnsupportedByBackendError` (`score`, `flush_cache`,
`get_server_info`), so a new backend starts with two methods and grows.
`select` works on every backend whose `prefill` and `score` work.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from arborlm.chat_template import ChatTemplate
from arborlm.errors import InvalidRequestError


class UnsupportedByBackendError(InvalidRequestError):
    """The program asks for something this backend cannot serve (e.g. `select` over a plain OpenAI API)."""


class StreamChunk(NamedTuple):
    """A piece of streamed text and the meta info so far (None when the backend has none yet)."""

    text: str
    meta_info: dict[str, Any] | None


@dataclass
class TokenUsage:
    """Tokens a backend's requests used since the last `reset` (SGLang's ``backend.token_usage``).

    prompt_tokens: prompt tokens of every request (generations, prefills, `select`'s scoring),
        cached ones included, as the servers' usage counts them.
    completion_tokens: generated tokens.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, meta_info: dict[str, Any] | None) -> None:
        """Count one request from its meta info ("prompt_tokens", "completion_tokens"); None counts nothing."""
        if not meta_info:
            return
        with self._lock:
            self.prompt_tokens += int(meta_info.get("prompt_tokens") or 0)
            self.completion_tokens += int(meta_info.get("completion_tokens") or 0)

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = self.completion_tokens = 0


class BaseBackend(ABC):
    """What the interpreter needs from a model server.

    Thread safety: the interpreter calls a backend from several threads at once
    (one per running program or fork branch); every method must allow that.
    """

    #: True for backends that take chat messages rather than raw text (OpenAI's chat API):
    #: `generate` and `stream` then also get ``messages=[{"role", "content"}, ...]``,
    #: the program's finished messages, when the program generates inside an assistant turn.
    uses_chat_messages: bool = False

    @property
    def token_usage(self) -> TokenUsage:
        """The tokens this backend's requests used (the interpreter counts every request it makes)."""
        usage = self.__dict__.get("_token_usage")
        if usage is None:
            usage = self.__dict__.setdefault("_token_usage", TokenUsage())
        return usage

    @abstractmethod
    def get_chat_template(self) -> ChatTemplate:
        """Role markers of the served model."""

    @abstractmethod
    def generate(self, text: str, sampling_params: dict[str, Any], **options: Any) -> tuple[str, dict[str, Any]]:
        """Continue `text`.

        Parameters
        ----------
        text: the full program text so far.
        sampling_params: `SamplingParams` fields (`max_new_tokens`, `temperature`, `regex`, ...).
        options: SGLang request fields when the program asks for them:
            `return_logprob`, `logprob_start_len`, `top_logprobs_num`; and
            `messages` for backends with `uses_chat_messages`.

        Returns
        -------
        (generated text, meta info with at least "prompt_tokens",
        "completion_tokens", "cached_tokens", "finish_reason").

        Raises
        ------
        InvalidRequestError: bad sampling fields; `UnsupportedByBackendError`
            for a field or option the backend cannot serve.
        """

    def stream(self, text: str, sampling_params: dict[str, Any], **options: Any) -> Iterator[StreamChunk]:
        """Continue `text`, yielding the new text as it is generated; the pieces join to `generate`'s text.

        Default: one chunk with `generate`'s whole answer.
        """
        out, meta = self.generate(text, sampling_params, **options)
        yield StreamChunk(out, meta)

    def prefill(self, text: str) -> dict[str, Any] | None:
        """Compute and cache the KV of `text` (a request with ``max_new_tokens=0``): a prefix hint.

        Returns the request's meta info ("prompt_tokens", "cached_tokens"), or
        None when the backend has no cache to fill (the default).
        """
        return None

    def score(self, prompts: list[str] | list[list[int]], logprob_start_len: int) -> list[dict[str, Any]]:
        """Prompt log probabilities, one request per prompt (text or token ids), nothing generated.

        Returns each request's meta info, whose "input_token_logprobs" holds a
        ``(logprob, token_id, text)`` triple per prompt position from
        `logprob_start_len` on (the logprob of position 0 is None). `select` is built on this.

        Raises
        ------
        UnsupportedByBackendError: by default.
        """
        raise UnsupportedByBackendError(
            f"{type(self).__name__} cannot score prompt tokens, so select() and gen(choices=...) "
            "are not available on it", "choices")

    def flush_cache(self) -> bool:
        """Empty the server's prefix cache; False while requests are in flight."""
        raise UnsupportedByBackendError(f"{type(self).__name__} has no cache to flush")

    def get_server_info(self) -> dict[str, Any]:
        """The server's live figures (KV slots, cache hit rate...)."""
        raise UnsupportedByBackendError(f"{type(self).__name__} reports no server info")

    def shutdown(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what the backend holds (nothing by default)."""
