"""Backend over any OpenAI-compatible server, through the `openai` client.

A `gen` inside an assistant turn is a chat completion of the program's
messages so far; a `gen` outside roles is a text completion of the program
text. `json_schema` becomes `response_format` (chat). What OpenAI's API cannot
express is refused with `UnsupportedByBackendError` before anything is sent:
`select` / `gen(choices=...)` (the API returns no prompt log probabilities to
score choices with), `regex` and `dtype` (no regex constraint), prompt
logprobs, and a `gen` after text already written in the assistant turn.
SGLang's sampling extras (`top_k`, `min_p`, `repetition_penalty`, ...) go in
the request's extra body, which SGLang-style servers (arborlm, SGLang, vLLM) read.

After SGLang's ``sglang/lang/backend/openai.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from arborlm.chat_template import ChatTemplate
from arborlm.errors import ArborError, InvalidRequestError
from arborlm.frontend_lang.backend.base_backend import (
    BaseBackend,
    StreamChunk,
    UnsupportedByBackendError,
)

# SamplingParams field -> OpenAI request field.
_OPENAI_FIELDS = {"max_new_tokens": "max_tokens", "stop": "stop", "temperature": "temperature", "top_p": "top_p",
                  "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "seed": "seed"}
_UNSUPPORTED = {"regex": "a regex constraint", "ebnf": "a grammar constraint"}


class OpenAI(BaseBackend):
    """Runs generation calls on an OpenAI-compatible server (SGLang's signature).

    Parameters
    ----------
    model_name: the model to ask for.
    is_chat_model: True: every gen is a chat completion, so it must open an assistant
        turn (anything else is refused); False: every gen is a text completion of the
        program text (an instruct model); None (default): a chat completion inside an
        assistant turn, a text completion elsewhere.
    chat_template: role markers for the program's text (the messages sent
        are built from roles, not from this text); plain "Role: " by default.
    is_azure: use `openai.AzureOpenAI` (give `azure_endpoint=` and `api_version=` in
        `client_kwargs`; the key also comes from ``AZURE_OPENAI_API_KEY``).
    base_url: the server's ``/v1`` address; None for api.openai.com.
    api_key: the key; None reads ``OPENAI_API_KEY`` (or sends "EMPTY").
    client_kwargs: further `openai.OpenAI` arguments (timeout, max_retries...).
    """

    def __init__(self, model_name: str, is_chat_model: bool | None = None, chat_template: ChatTemplate | None = None,
                 is_azure: bool = False, *, base_url: str | None = None, api_key: str | None = None,
                 **client_kwargs: Any):
        import openai

        if is_chat_model not in (None, True, False):
            raise TypeError(f"is_chat_model must be True, False or None, got {is_chat_model!r}")
        self.model_name = model_name
        self.is_chat_model = is_chat_model
        # An instance attribute: the interpreter sends messages only to chat-capable backends.
        self.uses_chat_messages = is_chat_model is not False
        if is_azure:
            given = {k: v for k, v in (("base_url", base_url), ("api_key", api_key)) if v is not None}
            self.client = openai.AzureOpenAI(**given, **client_kwargs)
        else:
            self.client = openai.OpenAI(base_url=base_url,
                                        api_key=api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"),
                                        **client_kwargs)
        self._chat_template = chat_template or ChatTemplate.plain()

    def get_chat_template(self) -> ChatTemplate:
        return self._chat_template

    def generate(self, text: str, sampling_params: dict[str, Any], messages: list[dict[str, str]] | None = None,
                 **options: Any) -> tuple[str, dict[str, Any]]:
        """A chat completion of `messages` when given, else a text completion of `text`.

        Raises
        ------
        UnsupportedByBackendError: a constraint or option the API cannot serve, or a gen
            outside an assistant turn with ``is_chat_model=True``.
        InvalidRequestError: the server answered 400; ArborError: any other API error.
        """
        request = self._request(sampling_params, messages, options)
        response = self._call(text, messages, request)
        choice = response.choices[0]
        out = choice.message.content if messages is not None else choice.text
        return out or "", self._meta(response.id, response.usage, choice.finish_reason)

    def stream(self, text: str, sampling_params: dict[str, Any], messages: list[dict[str, str]] | None = None,
               **options: Any) -> Iterator[StreamChunk]:
        request = self._request(sampling_params, messages, options)
        request.update(stream=True, stream_options={"include_usage": True})
        rid, finish, usage = None, None, None
        for event in self._call(text, messages, request):
            rid = event.id
            usage = event.usage or usage
            for choice in event.choices:
                finish = choice.finish_reason or finish
                piece = (choice.delta.content if messages is not None else choice.text) or ""
                if piece:
                    yield StreamChunk(piece, None)
        yield StreamChunk("", self._meta(rid, usage, finish))

    # ---- requests ---------------------------------------------------------------------

    def _request(self, sampling: dict[str, Any], messages: list | None, options: dict[str, Any]) -> dict[str, Any]:
        """The OpenAI request fields for `sampling`, refusing what the API cannot serve."""
        if messages is None and self.is_chat_model:
            raise UnsupportedByBackendError(
                "a chat model (is_chat_model=True) generates only as an assistant turn: put sgl.gen right "
                "after sgl.assistant, or use @function(num_api_spec_tokens=...) for text around it", "messages")
        for key, what in _UNSUPPORTED.items():
            if sampling.get(key) is not None:
                raise UnsupportedByBackendError(
                    f"the OpenAI API cannot enforce {what} ({key}=...); use an arborlm Engine or RuntimeEndpoint", key)
        if options:
            raise UnsupportedByBackendError(
                f"the OpenAI backend does not return logprobs ({', '.join(sorted(options))})", sorted(options)[0])
        request: dict[str, Any] = {"model": self.model_name}
        extra: dict[str, Any] = {}
        for key, value in sampling.items():
            if key in _OPENAI_FIELDS:
                request[_OPENAI_FIELDS[key]] = value
            elif key == "json_schema":
                if messages is None:
                    raise UnsupportedByBackendError(
                        "the OpenAI API takes json_schema only in chat completions: put gen() in an assistant turn",
                        key)
                request["response_format"] = {"type": "json_schema",
                                              "json_schema": {"name": "output", "schema": _as_dict(value)}}
            else:
                extra[key] = value
        if extra:
            request["extra_body"] = extra
        return request

    def _call(self, text: str, messages: list | None, request: dict[str, Any]):
        import openai

        try:
            if messages is not None:
                return self.client.chat.completions.create(messages=messages, **request)
            return self.client.completions.create(prompt=text, **request)
        except openai.BadRequestError as e:
            raise InvalidRequestError(f"the server refused the request: {e.message}",
                                      (e.body or {}).get("param") if isinstance(e.body, dict) else None) from e
        except openai.OpenAIError as e:
            raise ArborError(f"OpenAI API error: {e}") from e

    @staticmethod
    def _meta(rid: str | None, usage: Any, finish_reason: str | None) -> dict[str, Any]:
        details = getattr(usage, "prompt_tokens_details", None)
        return {
            "id": rid,
            "prompt_tokens": getattr(usage, "prompt_tokens", 0) or 0,
            "completion_tokens": getattr(usage, "completion_tokens", 0) or 0,
            "cached_tokens": (getattr(details, "cached_tokens", 0) or 0) if details else 0,
            "finish_reason": {"type": finish_reason} if finish_reason else None,
        }


def _as_dict(schema: Any) -> dict[str, Any]:
    if isinstance(schema, str):
        import json

        return json.loads(schema)
    return schema
