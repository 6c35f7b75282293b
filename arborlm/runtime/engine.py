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
import multiprocessing as mp
import queue
import shutil
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from arborlm.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.io_struct import TokenizedGenerateReqInput
from arborlm.runtime.sampling import SamplingParams
from arborlm.runtime.scheduler_process import PortArgs, Shutdown, run_scheduler_process
from arborlm.runtime.tokenizer_manager import GenerateReqInput, TokenizerManager

logger = logging.getLogger(__name__)

SCHEDULER_START_TIMEOUT_S = 900.0
WATCHDOG_INTERVAL_S = 1.0
_STREAM_END = object()


@contextlib.contextmanager
def _main_module_not_reimported():
    """Keep `spawn` from re-running the caller's script in the scheduler process.

    The scheduler's entry point and arguments live in arborlm, so the child does
    not need `__main__`; without this, a script that builds an Engine at module
    level (no `if __name__ == "__main__":` guard) would start engines recursively,
    and `python - < script` or `python -c` could not start one at all.
    """
    main = sys.modules.get("__main__")
    saved_spec = getattr(main, "__spec__", None)
    saved_file = getattr(main, "__file__", None)
    main.__spec__ = None
    if saved_file is not None:
        del main.__file__
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not None:
            main.__file__ = saved_file


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
        self.server_args = ServerArgs.from_kwargs(model=model, **server_args)
        self._ipc_dir = tempfile.mkdtemp(prefix="arborlm-")
        port_args = PortArgs(
            scheduler_input=f"ipc://{self._ipc_dir}/scheduler_input",
            scheduler_output=f"ipc://{self._ipc_dir}/scheduler_output",
        )
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="arborlm-engine", daemon=True)
        self._loop_thread.start()
        self._process, model_info = self._start_scheduler(port_args)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_info.checkpoint)
        self.model_info = model_info
        self.tokenizer_manager = self._call(self._make_manager(model_info, port_args))
        self._watchdog = threading.Thread(target=self._watch_scheduler, name="arborlm-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self.shutdown)

    def _start_scheduler(self, port_args: PortArgs):
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=run_scheduler_process, args=(self.server_args, port_args, writer), daemon=True
        )
        with _main_module_not_reimported():
            process.start()
        writer.close()
        if not reader.poll(SCHEDULER_START_TIMEOUT_S):
            process.kill()
            raise EngineDeadError("the scheduler did not start in time")
        try:
            msg = reader.recv()
        except EOFError as e:
            process.join(5)
            raise EngineDeadError(f"the scheduler exited while starting (code {process.exitcode})") from e
        if msg["status"] != "ready":
            process.join(5)
            self._stop_loop()
            error = msg["error"]
            if isinstance(error, (ModelLoadError, ValueError, TypeError)):
                raise error
            raise EngineDeadError(f"the scheduler failed to start: {error}\n{msg['traceback']}")
        return process, msg["model_info"]

    async def _make_manager(self, model_info, port_args) -> TokenizerManager:
        manager = TokenizerManager(self.server_args, model_info, self.tokenizer, port_args)
        manager.start()
        return manager

    def _watch_scheduler(self) -> None:
        while not self._closed:
            self._process.join(WATCHDOG_INTERVAL_S)
            if not self._process.is_alive() and not self._closed:
                reason = f"the scheduler process exited (code {self._process.exitcode})"
                logger.error(reason)
                self._loop.call_soon_threadsafe(self.tokenizer_manager.fail_all, reason)
                return

    def _call(self, coro):
        """Run a coroutine on the engine's loop and wait for its result."""
        if self._closed:
            coro.close()
            raise EngineDeadError("the engine is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ---- generation ---------------------------------------------------------

    def _requests(
        self,
        prompt: str | list[str] | None,
        input_ids: list[int] | list[list[int]] | None,
        sampling_params: dict | SamplingParams | list | None,
        **kwargs: Any,
    ) -> tuple[list[GenerateReqInput], bool]:
        """Normalise one request or a batch (a list of prompts or of id lists) into single requests.

        `n > 1` expands each prompt into n requests (distinct seeds when one is given).
        """
        if prompt is not None and input_ids is not None:
            raise InvalidRequestError("give prompt or input_ids, not both", param="prompt")
        if prompt is None and input_ids is None:
            raise InvalidRequestError("give prompt or input_ids", param="prompt")
        is_batch = isinstance(prompt, list) or (
            isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        )
        items = (prompt if prompt is not None else input_ids) if is_batch else [prompt if prompt is not None else input_ids]
        if is_batch and not items:
            raise InvalidRequestError("the batch is empty", param="prompt")
        if prompt is not None and not all(isinstance(p, str) for p in items):
            raise InvalidRequestError("prompt must be a string or a list of strings", param="prompt")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(items):
                raise InvalidRequestError("one sampling_params per prompt, or a single dict", param="sampling_params")
            params_list = sampling_params
        else:
            params_list = [sampling_params] * len(items)
        reqs = []
        for item, params in zip(items, params_list):
            if isinstance(params, SamplingParams):
                params_dict = dict(params.__dict__)
            elif params is None or isinstance(params, dict):
                params_dict = dict(params or {})
            else:
                raise InvalidRequestError(
                    f"sampling_params must be a dict or SamplingParams, got {type(params).__name__}",
                    param="sampling_params",
                )
            n = params_dict.pop("n", 1)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise InvalidRequestError("n must be an integer >= 1", param="n")
            for i in range(n):
                p = dict(params_dict)
                if n > 1 and p.get("seed") is not None:
                    p["seed"] = p["seed"] + i
                text, ids = (item, None) if prompt is not None else (None, item)
                reqs.append(GenerateReqInput(text=text, input_ids=ids, sampling_params=p, **kwargs))
        return reqs, is_batch or len(reqs) > 1

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

        Raises
        ------
        InvalidRequestError: bad prompt or sampling field (nothing is run).
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
        reqs, is_batch = self._requests(prompt, input_ids, sampling_params, **kwargs)
        if is_batch and rid is not None:
            raise InvalidRequestError("rid applies to a single request", param="rid")
        results = await self._run_on_loop(self._gather(reqs))
        return results if is_batch else results[0]

    async def _run_on_loop(self, coro):
        if self._closed:
            coro.close()
            raise EngineDeadError("the engine is shut down")
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def _gather(self, reqs: list[GenerateReqInput]) -> list[dict[str, Any]]:
        manager = self.tokenizer_manager
        # Validate and tokenize every item first, so a bad one rejects the batch before anything runs.
        built = [manager.build_request(req) for req in reqs]

        async def one(req: TokenizedGenerateReqInput) -> dict[str, Any]:
            async for result in manager.generate(req):
                return result
            raise EngineDeadError("no result")

        return list(await asyncio.gather(*(one(r) for r in built)))

    def _stream_sync(self, prompt, input_ids, sampling_params, kwargs) -> Iterator[dict[str, Any]]:
        reqs, is_batch = self._requests(prompt, input_ids, sampling_params, stream=True, **kwargs)
        if is_batch:
            raise InvalidRequestError("stream=True takes one prompt with n=1", param="stream")
        chunks: queue.Queue = queue.Queue()

        async def pump():
            try:
                async for chunk in self.tokenizer_manager.generate(reqs[0]):
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
        reqs, is_batch = self._requests(prompt, input_ids, sampling_params, stream=True, **kwargs)
        if is_batch:
            raise InvalidRequestError("stream=True takes one prompt with n=1", param="stream")
        if asyncio.get_running_loop() is self._loop:
            async for chunk in self.tokenizer_manager.generate(reqs[0]):
                yield chunk
            return
        chunks: asyncio.Queue = asyncio.Queue()
        caller_loop = asyncio.get_running_loop()

        async def pump():
            try:
                async for chunk in self.tokenizer_manager.generate(reqs[0]):
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
        try:
            asyncio.run_coroutine_threadsafe(self._close_manager(self.tokenizer_manager), self._loop).result(10)
        except Exception:  # noqa: BLE001 - best effort while shutting down
            logger.debug("error while closing the tokenizer manager", exc_info=True)
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._stop_loop()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        atexit.unregister(self.shutdown)

    async def _close_manager(self, manager: TokenizerManager) -> None:
        # zmq sockets belong to the loop's thread: send and close from there.
        manager.send_sock.send_pyobj(Shutdown())
        await asyncio.sleep(0.05)  # let the shutdown message leave the socket
        manager.close()

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
