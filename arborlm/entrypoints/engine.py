"""The in-process Engine: the runtime without an HTTP server.

`Engine` starts the scheduler process (model, pools, radix cache) and a
`TokenizerManager` on a private asyncio loop thread, and offers `generate`,
`async_generate`, streaming iterators and `shutdown`, as SGLang's `sgl.Engine`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from arborlm.entrypoints.request_builder import (
    ENGINE_RULES,
    build_batch,
    expand_requests,
    generate_batch,
)
from arborlm.entrypoints.sglang_kwargs import sglang_server_kwargs
from arborlm.errors import EngineDeadError, InvalidRequestError
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.io_struct import GenerateReqInput
from arborlm.runtime.launcher import close_front, launch_scheduler, load_tokenizer
from arborlm.runtime.tokenizer_manager import TokenizerManager
from arborlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_STREAM_END = object()


class Engine:
    """Serve a model in this process's caller, with the scheduler in a child process.

    Parameters
    ----------
    model: HF checkpoint folder or GGUF file; None serves SmolLM2-135M-Instruct.
    **server_args: any `ServerArgs` field (`dtype`, `max_total_tokens`,
        `schedule_policy`, `disable_radix_cache`, ...).

    Raises
    ------
    TypeError: an unknown server argument.
    ValueError: a server argument out of range.
    ModelLoadError: a missing model path or an unsupported architecture.
    """

    def __init__(self, model: str | None = None, **server_args: Any):
        self.server_args = ServerArgs.from_kwargs(model=model, **sglang_server_kwargs(server_args))
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="arborlm-engine", daemon=True)
        self._loop_thread.start()
        try:
            self._scheduler = launch_scheduler(self.server_args)
        except BaseException:
            self._closed = True
            self._stop_loop()
            raise
        self.model_info = self._scheduler.model_info
        self.tokenizer = load_tokenizer(self.model_info, self.server_args.chat.chat_template)
        self.tokenizer_manager = self._call(self._make_manager())
        self._scheduler.watch(self._on_scheduler_exit)
        atexit.register(self.shutdown)

    async def _make_manager(self) -> TokenizerManager:
        manager = TokenizerManager(self.server_args, self.model_info, self.tokenizer, self._scheduler.port_args)
        manager.start()
        return manager

    def _on_scheduler_exit(self, reason: str) -> None:
        """Watchdog callback: every waiting caller gets `EngineDeadError`."""
        self._loop.call_soon_threadsafe(self.tokenizer_manager.fail_all, reason)

    def _call(self, coro):
        """Run a coroutine on the engine's loop and wait for its result."""
        if self._closed:
            coro.close()
            raise EngineDeadError("the engine is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ---- generation ---------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | SamplingParams | list | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        rid: str | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt or a batch; blocks until done.

        Returns SGLang's shape, `{"text", "output_ids", "meta_info": {"id",
        "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
        "matched_stop", "e2e_latency", ...}}`, or a list of them for a batch or
        `n > 1`. With `stream=True` (one prompt), an iterator of chunks whose
        `text` pieces concatenate to the final text.

        One rule for errors in a batch: a malformed item (bad prompt or
        sampling field) rejects the whole batch before anything runs; a grammar
        that cannot be used (a bad schema, regex or EBNF, a keyword the backend
        cannot enforce, a compile failure or timeout) fails that item alone:
        its result has no output and ``finish_reason`` ``{"type": "abort",
        "message", "param"}``, and the others complete. A single request raises.

        Raises
        ------
        InvalidRequestError: bad prompt or sampling field (nothing is run); for a
            single request, also a grammar refused before or after queueing.
        EngineDeadError: the scheduler process is gone.
        """
        kwargs = dict(return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                      top_logprobs_num=top_logprobs_num, rid=rid)
        if stream:
            return self._stream_sync(prompt, input_ids, sampling_params, kwargs)
        return self._call(self.async_generate(prompt, sampling_params, input_ids, **kwargs))

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | SamplingParams | list | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        rid: str | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """`generate` for asyncio callers, on any event loop (see `generate`)."""
        kwargs = dict(return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                      top_logprobs_num=top_logprobs_num, rid=rid)
        if stream:
            return self._stream_async(prompt, input_ids, sampling_params, kwargs)
        reqs, is_batch = expand_requests(prompt, input_ids, sampling_params, max_reqs=None, **kwargs)
        if is_batch and rid is not None:
            raise InvalidRequestError("rid applies to a single request", param="rid")
        results = await self._run_on_loop(generate_batch(self.tokenizer_manager, reqs))
        return results if is_batch else results[0]

    async def _run_on_loop(self, coro):
        if self._closed:
            coro.close()
            raise EngineDeadError("the engine is shut down")
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def _generate_one(self, req: GenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        """One streamed request, built as every batch is (`build_batch`); runs on the engine's loop."""
        built = await build_batch(self.tokenizer_manager, [req], ENGINE_RULES)
        async for chunk in self.tokenizer_manager.generate(built[0]):
            yield chunk

    def _stream_sync(self, prompt, input_ids, sampling_params, kwargs) -> Iterator[dict[str, Any]]:
        reqs, is_batch = expand_requests(prompt, input_ids, sampling_params, max_reqs=None, stream=True, **kwargs)
        if is_batch:
            raise InvalidRequestError("stream=True takes one prompt with n=1", param="stream")
        chunks: queue.Queue = queue.Queue()

        async def pump():
            try:
                async for chunk in self._generate_one(reqs[0]):
                    chunks.put(chunk)
            except BaseException as e:  # noqa: BLE001 - handed to the consuming thread
                chunks.put(e)
            finally:
                chunks.put(_STREAM_END)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := chunks.get()) is not _STREAM_END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    async def _stream_async(self, prompt, input_ids, sampling_params, kwargs) -> AsyncIterator[dict[str, Any]]:
        reqs, is_batch = expand_requests(prompt, input_ids, sampling_params, max_reqs=None, stream=True, **kwargs)
        if is_batch:
            raise InvalidRequestError("stream=True takes one prompt with n=1", param="stream")
        if asyncio.get_running_loop() is self._loop:
            async for chunk in self._generate_one(reqs[0]):
                yield chunk
            return
        chunks: asyncio.Queue = asyncio.Queue()
        caller_loop = asyncio.get_running_loop()

        async def pump():
            try:
                async for chunk in self._generate_one(reqs[0]):
                    caller_loop.call_soon_threadsafe(chunks.put_nowait, chunk)
            except BaseException as e:  # noqa: BLE001 - handed to the consuming loop
                caller_loop.call_soon_threadsafe(chunks.put_nowait, e)
            finally:
                caller_loop.call_soon_threadsafe(chunks.put_nowait, _STREAM_END)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await chunks.get()) is not _STREAM_END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    # ---- control ------------------------------------------------------------

    def abort_request(self, rid: str) -> None:
        """Abort an in-flight request by id."""
        self._call(self.tokenizer_manager.abort_request(rid))

    def get_server_info(self, check_invariants: bool = False) -> dict[str, Any]:
        """Server args, model facts and live scheduler figures (KV slots, cache hit rate)."""
        live = self._call(self.tokenizer_manager.get_info(check_invariants))
        return {**self.server_args.to_dict(), **self.model_info.__dict__, **live}

    def flush_cache(self) -> bool:
        """Empty the radix cache; False while requests are in flight."""
        return self._call(self.tokenizer_manager.flush_cache())

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render chat messages with the model's chat template."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def shutdown(self) -> None:
        """Abort in-flight requests, stop the scheduler process and the loop thread."""
        if self._closed:
            return
        self._closed = True
        self._scheduler.begin_stop()
        try:
            asyncio.run_coroutine_threadsafe(close_front(self.tokenizer_manager), self._loop).result(10)
        except Exception:  # noqa: BLE001 - best effort while shutting down
            logger.debug("error while closing the tokenizer manager", exc_info=True)
        self._scheduler.stop()
        self._stop_loop()
        atexit.unregister(self.shutdown)

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        # An engine dropped without shutdown() must not leave its scheduler process behind.
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.shutdown()

