"""The HTTP side of the serving benchmark: request bodies, SSE parsing, timing one call.

Three APIs, all streamed:

- `chat`: OpenAI `/v1/chat/completions` (messages; JSON via `response_format`).
- `completions`: OpenAI `/v1/completions` (the messages rendered with the model's
  chat template; JSON via `response_format`).
- `generate`: SGLang's native `/generate` (rendered text; `sampling_params`,
  cumulative text per event, counts in `meta_info`).

Token counts come from the server when it reports them: OpenAI `usage` (asked
for with `stream_options.include_usage`; `prompt_tokens_details.cached_tokens`),
llama.cpp's `timings.cache_n`, or `/generate`'s `meta_info`. When it does not,
they are counted with the local tokenizer and the result says so.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from benchmarks.serving.metrics import RequestResult
from benchmarks.serving.workloads import Call, Message

APIS = ("chat", "completions", "generate")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate"}


class NotLoopbackError(ValueError):
    """The target is not on this machine."""


def check_loopback(base_url: str) -> None:
    """Refuse any host but localhost, 127.0.0.0/8 and ::1 (no name is resolved).

    Raises
    ------
    NotLoopbackError
        For any other host, or a URL without one.
    """
    host = urlsplit(base_url).hostname
    if host == "localhost":
        return
    try:
        if host and ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise NotLoopbackError(f"{base_url!r} is not a loopback address: the benchmark only targets 127.0.0.1, ::1 or localhost")


def build_payload(api: str, call: Call, model: str, render: Callable[[list[Message]], str], *,
                  ignore_eos: bool = True, temperature: float = 0.0,
                  extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The streamed request body of `call` for `api`.

    `render` turns messages into prompt text (for `completions` and `generate`).
    `ignore_eos=False` leaves the field out even where the call asks for it (for
    servers that refuse unknown fields).
    """
    send_ignore_eos = ignore_eos and call.ignore_eos
    if api == "generate":
        params: dict[str, Any] = {"max_new_tokens": call.max_tokens, "temperature": temperature}
        if send_ignore_eos:
            params["ignore_eos"] = True
        if call.stop:
            params["stop"] = list(call.stop)
        if call.json_schema is not None:
            params["json_schema"] = json.dumps(call.json_schema)
        body: dict[str, Any] = {"text": render(list(call.messages)), "sampling_params": params, "stream": True}
    else:
        body = {"model": model, "max_tokens": call.max_tokens, "temperature": temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if api == "chat":
            body["messages"] = [dict(m) for m in call.messages]
        else:
            body["prompt"] = render(list(call.messages))
        if send_ignore_eos:
            body["ignore_eos"] = True
        if call.stop:
            body["stop"] = list(call.stop)
        if call.json_schema is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": call.json_schema}}
    return {**body, **(extra_body or {})}


class StreamParser:
    """Reads one request's SSE events: the new text of each, and the counts at the end.

    prompt_tokens, completion_tokens, cached_tokens: None until the server says.
    """

    def __init__(self, api: str) -> None:
        self.api = api
        self.text = ""
        self.finish_reason: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None

    def feed(self, event: dict[str, Any]) -> str:
        """The output text this event adds ("" for none).

        Raises
        ------
        RuntimeError
            For an error event.
        """
        if "error" in event:
            error = event["error"]
            raise RuntimeError(str(error.get("message", error) if isinstance(error, dict) else error)[:300])
        if self.api == "generate":
            return self._feed_generate(event)
        self._read_usage(event.get("usage"))
        if isinstance(event.get("timings"), dict) and "cache_n" in event["timings"]:
            self.cached_tokens = int(event["timings"]["cache_n"])  # llama.cpp
        delta = ""
        for choice in event.get("choices") or []:
            if self.api == "chat":
                delta += (choice.get("delta") or {}).get("content") or ""
            else:
                delta += choice.get("text") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.text += delta
        return delta

    def _read_usage(self, usage: dict[str, Any] | None) -> None:
        if not usage:
            return
        self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            self.cached_tokens = int(details["cached_tokens"])

    def _feed_generate(self, event: dict[str, Any]) -> str:
        text = event.get("text", "")
        delta = text[len(self.text):] if text.startswith(self.text) else text
        self.text = text
        meta = event.get("meta_info") or {}
        self.prompt_tokens = meta.get("prompt_tokens", self.prompt_tokens)
        self.completion_tokens = meta.get("completion_tokens", self.completion_tokens)
        if meta.get("cached_tokens") is not None:
            self.cached_tokens = int(meta["cached_tokens"])
        finish = meta.get("finish_reason")
        if finish:
            self.finish_reason = finish.get("type") if isinstance(finish, dict) else str(finish)
        return delta


async def send_call(client: httpx.AsyncClient, base_url: str, api: str, workload: str, call: Call,
                    payload: dict[str, Any], count_tokens: Callable[[str], int],
                    render: Callable[[list[Message]], str], run_start: float) -> RequestResult:
    """Send one streamed request and time it; never raises (a failure is a result with `error`)."""
    parser = StreamParser(api)
    start = time.perf_counter()
    result = RequestResult(workload=workload, ok=False, start_s=start - run_start)
    last = None
    try:
        async with client.stream("POST", base_url.rstrip("/") + PATHS[api], json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                if not parser.feed(json.loads(data)):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except Exception as e:  # noqa: BLE001 - any failure of one request is counted, the run goes on
        result.error = f"{type(e).__name__}: {e}"[:300]
        return result
    result.e2e_s = time.perf_counter() - start
    result.ok = True
    result.text = parser.text
    result.finish_reason = parser.finish_reason
    result.usage_reported = parser.prompt_tokens is not None and parser.completion_tokens is not None
    result.prompt_tokens = (parser.prompt_tokens if parser.prompt_tokens is not None
                            else count_tokens(render(list(call.messages))))
    result.completion_tokens = (parser.completion_tokens if parser.completion_tokens is not None
                                else count_tokens(parser.text))
    result.cached_tokens = parser.cached_tokens
    if call.json_schema is not None and parser.finish_reason != "length":
        result.json_valid = _is_json_object(parser.text)  # an answer cut by max_tokens is not judged
    return result


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
