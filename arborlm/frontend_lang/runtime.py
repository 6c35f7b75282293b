"""`Runtime`: a local `arborlm serve` started from Python, for frontend programs (SGLang's wrapper).

``runtime = sgl.Runtime(model_path=..., ...)`` starts the HTTP server in a child
process (the same `launch_server` that ``arborlm serve`` runs, with the same
`ServerArgs` keywords), waits until ``GET /health`` answers, and exposes a
`RuntimeEndpoint` to it as ``runtime.endpoint``; `set_default_backend(runtime)` and
``backend=runtime`` use that endpoint. ``runtime.shutdown()`` (also at interpreter
exit, and on leaving a ``with`` block) stops the server cleanly.

After SGLang's ``sglang/lang/backend/runtime_endpoint.py`` (``Runtime``).
"""

from __future__ import annotations

import atexit
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from arborlm.errors import ArborError
from arborlm.frontend_lang.backend.base_backend import TokenUsage
from arborlm.frontend_lang.backend.runtime_endpoint import RuntimeEndpoint

POLL_INTERVAL_S = 0.25
STOP_TIMEOUT_S = 30.0
# Exit status of a server child that re-ran the script's top level and met `Runtime()` there
# (no `if __name__ == "__main__":` guard); the parent turns it into a clear error.
MAIN_GUARD_EXIT = 87
MAIN_GUARD_HINT = (
    "sgl.Runtime() was called at the top level of a script without an `if __name__ == \"__main__\":` guard: "
    "the server runs in a child process started with multiprocessing's 'spawn', which imports the script "
    "again, so every Runtime() at its top level would start another server. Create the Runtime under "
    "`if __name__ == \"__main__\":` (as SGLang's Runtime needs too).")


def _in_spawned_main_import() -> bool:
    """True inside a spawned child while it re-imports the parent's script. ``_inheriting`` is the
    flag multiprocessing itself checks for its "bootstrapping phase" error (there is no public one)."""
    return bool(getattr(mp.current_process(), "_inheriting", False))


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _serve(server_args) -> None:
    """The child process: serve until SIGTERM (imported there, so the parent loads no server code)."""
    from arborlm.entrypoints.launch_server import launch_server

    launch_server(server_args)


class Runtime:
    """An arborlm server in a child process, with a `RuntimeEndpoint` to it.

    Parameters
    ----------
    log_level: the server's log level (SGLang's default: "error").
    launch_timeout: seconds to wait for the server to answer ``/health``.
    kwargs: `ServerArgs` fields (`model_path`, `dtype`, `max_total_tokens`, `api_key`, ...);
        without `port`, a free port is chosen.

    Attributes
    ----------
    url: the server's address; endpoint: the `RuntimeEndpoint`; server_args: what it runs.

    Raises
    ------
    TypeError, ValueError: an unknown or invalid server argument (before anything starts).
    ArborError: the server exited while starting (its log is on stderr), or the script made the
        Runtime at its top level without an ``if __name__ == "__main__":`` guard (the message says so).
    TimeoutError: it did not answer within `launch_timeout`.
    """

    def __init__(self, log_level: str = "error", launch_timeout: float = 300.0, **kwargs: Any):
        if _in_spawned_main_import():  # the child of a Runtime made at a script's top level
            print(f"arborlm: {MAIN_GUARD_HINT}", file=sys.stderr, flush=True)
            # A hard exit: a script that catches BaseException around Runtime() would otherwise go on
            # running its top level in the child; the parent reads the status and says why.
            os._exit(MAIN_GUARD_EXIT)
        from arborlm.entrypoints.sglang_kwargs import sglang_server_kwargs
        from arborlm.runtime.config import ServerArgs

        server_args = ServerArgs.from_kwargs(log_level=log_level, **sglang_server_kwargs(kwargs))
        if "port" not in kwargs:
            server_args = server_args.replace(port=_free_port(server_args.server.host))
        self.server_args = server_args
        host = server_args.server.host
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{server_args.server.port}"
        self.generate_url = self.url + "/generate"
        self.endpoint: RuntimeEndpoint | None = None
        self._process = mp.get_context("spawn").Process(target=_serve, args=(server_args,), name="arborlm-runtime")
        self._process.start()
        self.pid = self._process.pid
        atexit.register(self.shutdown)
        try:
            self._wait_healthy(launch_timeout)
            self.endpoint = RuntimeEndpoint(self.url, api_key=server_args.server.api_key)
        except BaseException:
            self.shutdown()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._process.is_alive():
                if self._process.exitcode == MAIN_GUARD_EXIT:
                    raise ArborError(MAIN_GUARD_HINT)
                raise ArborError(f"the arborlm server exited with {self._process.exitcode} while starting "
                                 "(its log is above)")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(POLL_INTERVAL_S)
        raise TimeoutError(f"the arborlm server did not answer /health within {timeout_s} s")

    # ---- lifecycle --------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the server (SIGTERM: in-flight requests are aborted, the scheduler exits); idempotent."""
        process = self._process
        if process is None:
            return
        self._process = None
        if self.endpoint is not None:
            self.endpoint.shutdown()
        if process.is_alive():
            process.terminate()
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        atexit.unregister(self.shutdown)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- SGLang's conveniences ----------------------------------------------------------

    @property
    def token_usage(self) -> TokenUsage:
        """The endpoint's token usage (programs run on this runtime count there)."""
        return self.endpoint.token_usage

    def cache_prefix(self, prefix: str) -> None:
        """Prefill `prefix` on the server so later requests start from a cache hit."""
        self.endpoint.prefill(prefix)

    def flush_cache(self) -> bool:
        return self.endpoint.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        """The server's `/get_server_info` (a plain call; SGLang's Runtime has an async one)."""
        return self.endpoint.get_server_info()

    def get_tokenizer(self):
        """The served model's Hugging Face tokenizer, loaded from its local folder."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.endpoint.model_info["tokenizer_path"])

    def generate(self, prompt: str | list[str], sampling_params: dict[str, Any] | None = None,
                 return_logprob: bool = False, logprob_start_len: int | None = None,
                 top_logprobs_num: int | None = None) -> str:
        """One `/generate` call; its JSON answer as text (SGLang's Runtime returns ``json.dumps`` of it).

        Raises
        ------
        InvalidRequestError: the server answered 400; ArborError: another error.
        """
        body = {"text": prompt, "sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        if top_logprobs_num is not None:
            body["top_logprobs_num"] = top_logprobs_num
        return json.dumps(self.endpoint._request("POST", "/generate", body))

    async def async_generate(self, prompt: str, sampling_params: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """Stream one generation: yields the new text of each server event."""
        headers = {"Authorization": f"Bearer {self.server_args.server.api_key}"} if self.server_args.server.api_key \
            else {}
        body = {"text": prompt, "sampling_params": sampling_params or {}, "stream": True}
        sent = 0
        async with httpx.AsyncClient(base_url=self.url, headers=headers, timeout=None) as client:
            async with client.stream("POST", "/generate", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        raise ArborError(event["error"].get("message", "the server reported an error"))
                    new = event["text"][sent:]
                    sent = len(event["text"])
                    if new:
                        yield new

    add_request = async_generate
