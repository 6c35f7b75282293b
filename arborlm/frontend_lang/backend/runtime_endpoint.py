"""Backend over a running arborlm server, through its native HTTP API.

Each `gen` of a program is one `POST /generate` with the program text so far
and the sampling fields; the server tokenizes and serves it exactly as the
in-process `Engine` would, and its radix cache shares the program's prefix
across calls. Role markers come from `/get_model_info` (`chat_template_roles`,
cut from the served model's chat template the way `EngineBackend` cuts them);
for a server that does not report them, the tokenizer at the `tokenizer_path`
it reports is loaded when that folder exists on this machine (nothing is
downloaded), else plain "Role: " markers are used.

After SGLang's ``sglang/lang/backend/runtime_endpoint.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx

from arborlm.chat_template import ChatTemplate
from arborlm.errors import (
    ArborError,
    EngineDeadError,
    InvalidRequestError,
    RequestAbortedError,
    ServerOverloadedError,
)
from arborlm.frontend_lang.backend.base_backend import BaseBackend, StreamChunk

CONNECT_TIMEOUT_S = 10.0
# The server's error `code` → the typed error the in-process Engine raises for it.
_ERRORS_BY_CODE = {
    "server_overloaded": ServerOverloadedError,
    "request_aborted": RequestAbortedError,
    "engine_dead": EngineDeadError,
    "unavailable": EngineDeadError,
}


class RuntimeEndpoint(BaseBackend):
    """Runs generation calls on an arborlm server (`arborlm serve`) at `base_url`.

    Parameters
    ----------
    base_url: the server's address, e.g. ``"http://127.0.0.1:30000"``.
    api_key: the server's ``--api-key``, sent as a bearer token.
    verify: TLS verification for an https server, as SGLang's (and httpx's) `verify`:
        a CA bundle path, True (the system's CAs, the default) or False.
    chat_template_name: role markers from this chat template instead of the served
        model's: a built-in name (`arborlm.chat_template.BUILTIN_CHAT_TEMPLATES`, e.g.
        "chatml", "llama-3-instruct") or a Jinja file.
    timeout_s: seconds to wait for one generation (None: no limit).

    Raises
    ------
    ArborError: the server cannot be reached or refuses the key.
    ValueError: an unknown `chat_template_name`.
    """

    def __init__(self, base_url: str, api_key: str | None = None, verify: str | bool | None = None,
                 chat_template_name: str | None = None, timeout_s: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.verify = True if verify is None else verify
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, verify=self.verify,
                                    timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S))
        self.model_info = self._request("GET", "/get_model_info")
        if chat_template_name is not None:
            self._chat_template = named_chat_template(chat_template_name)
        else:
            self._chat_template = chat_template_of(self.model_info)

    def get_model_name(self) -> str:
        """The served model's path (SGLang's `get_model_name`)."""
        return self.model_info.get("model_path") or self.model_info.get("served_model_name") or ""

    def get_chat_template(self) -> ChatTemplate:
        return self._chat_template

    def generate(self, text: str, sampling_params: dict[str, Any], **options: Any) -> tuple[str, dict[str, Any]]:
        """Continue `text` with one `/generate` call; (generated text, SGLang's meta info).

        `options` are further `/generate` fields (`return_logprob`, `logprob_start_len`, ...).

        Raises
        ------
        InvalidRequestError: the server answered 400 (its message and `param`).
        ServerOverloadedError, RequestAbortedError, EngineDeadError, ArborError: as the server says.
        """
        body = {"text": text, "sampling_params": dict(sampling_params), **options}
        result = self._request("POST", "/generate", body)
        return result["text"], result["meta_info"]

    def stream(self, text: str, sampling_params: dict[str, Any], **options: Any) -> Iterator[StreamChunk]:
        """Continue `text`, yielding each event's new text with the meta info so far."""
        body = {"text": text, "sampling_params": dict(sampling_params), "stream": True, **options}
        sent = 0
        for event in self._events("/generate", body):
            new = event["text"][sent:]
            sent = len(event["text"])
            yield StreamChunk(new, event.get("meta_info"))

    def cache_prefix(self, prefix_str: str) -> None:
        """SGLang's name for `prefill`: cache the KV of `prefix_str` on the server."""
        self.prefill(prefix_str)

    def prefill(self, text: str) -> dict[str, Any]:
        """Cache `text`'s KV on the server (`max_new_tokens=0`); its meta info."""
        return self._request("POST", "/generate", {"text": text, "sampling_params": {"max_new_tokens": 0}})["meta_info"]

    def score(self, prompts: list[str] | list[list[int]], logprob_start_len: int) -> list[dict[str, Any]]:
        """Prompt logprobs of a batch of texts or token-id lists, in one `/generate` call."""
        key = "input_ids" if prompts and isinstance(prompts[0], list) else "text"
        body = {key: list(prompts), "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                "logprob_start_len": logprob_start_len}
        return [r["meta_info"] for r in self._request("POST", "/generate", body)]

    def generate_stream(self, text: str, sampling_params: dict[str, Any]) -> Iterator[str]:
        """Continue `text`, yielding the new text as it is generated.

        The server's stream events carry the text so far (SGLang's convention);
        this yields the part each event adds, so the pieces join to `generate`'s text.

        Raises
        ------
        The errors of `generate`, also when the server reports one mid-stream.
        """
        for chunk in self.stream(text, sampling_params):
            if chunk.text:
                yield chunk.text

    def get_server_info(self) -> dict[str, Any]:
        """The server's `/get_server_info` (KV slots, running and queued requests, cache hit rate...)."""
        return self._request("GET", "/get_server_info")

    def flush_cache(self) -> bool:
        """Empty the server's radix cache; False while requests are in flight."""
        try:
            self._request("POST", "/flush_cache")
        except InvalidRequestError:
            return False
        return True

    def shutdown(self) -> None:
        """Close the connection (the server keeps running)."""
        self._client.close()

    # ---- HTTP ------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = self._client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise ArborError(f"cannot reach the arborlm server at {self.base_url}: {e}") from e
        raise_for_error(response)
        return response.json()

    def _events(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON payloads of a server-sent-event response, up to `data: [DONE]`."""
        try:
            with self._client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise_for_error(response)
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        return
                    event = json.loads(payload)
                    if "error" in event:
                        raise error_of(response.status_code, event["error"])
                    yield event
        except httpx.HTTPError as e:
            raise ArborError(f"cannot reach the arborlm server at {self.base_url}: {e}") from e


def raise_for_error(response: httpx.Response) -> None:
    """Raise the typed error of a non-2xx answer (OpenAI's error body: message, type, param, code)."""
    if response.is_success:
        return
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": response.text or response.reason_phrase}
    raise error_of(response.status_code, error)


def error_of(status: int, error: dict[str, Any]) -> ArborError:
    """The typed error for an HTTP status and an error body."""
    message = error.get("message") or f"HTTP {status}"
    if status == 400:
        return InvalidRequestError(message, error.get("param"))
    cls = _ERRORS_BY_CODE.get(error.get("code"))
    if cls is not None:
        return cls(message)
    return ArborError(f"the server answered {status}: {message}")


def chat_template_of(model_info: dict[str, Any]) -> ChatTemplate:
    """Role markers from `/get_model_info`: reported, else the local tokenizer at `tokenizer_path`, else plain."""
    roles = model_info.get("chat_template_roles")
    if roles:
        return ChatTemplate({role: (pair[0], pair[1]) for role, pair in roles.items()})
    path = model_info.get("tokenizer_path")
    if path and os.path.isdir(path):
        from transformers import AutoTokenizer

        return ChatTemplate.from_tokenizer(AutoTokenizer.from_pretrained(path))
    return ChatTemplate.plain()


class _NamedTemplate:
    """What `ChatTemplate.from_tokenizer` needs of a tokenizer, for a chat template given by name."""

    def __init__(self, template: str):
        self.chat_template = template

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = False) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template([messages], chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt, bos_token="", eos_token="")
        return rendered[0]


def named_chat_template(name_or_path: str) -> ChatTemplate:
    """Role markers of a built-in chat template or a Jinja file (rendered without BOS/EOS text).

    Raises
    ------
    ValueError: neither a built-in name nor a readable file.
    """
    from arborlm.chat_template import load_chat_template

    return ChatTemplate.from_tokenizer(_NamedTemplate(load_chat_template(name_or_path)))
