"""The front of the runtime: tokenizes and validates requests, sends them to the
scheduler over zmq, and turns the token ids that come back into text.

Runs in the caller's process, on an asyncio loop. Each request's outputs arrive
in its `ReqState` queue; `generate` yields them as SGLang-shaped dicts.
Detokenization is incremental and UTF-8 safe (`detokenizer.RequestDecoder`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
import zmq.asyncio

from arborlm.constrained.grammar_spec import GrammarSpec, grammar_spec_from_params
from arborlm.constrained.registry import resolved_backend
from arborlm.errors import (
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    RequestAbortedError,
    SchedulerTimeoutError,
    ServerOverloadedError,
)
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.detokenizer import RequestDecoder
from arborlm.runtime.io_struct import (
    AbortReq,
    BatchTokenOut,
    FlushCacheReq,
    GenerateReqInput,
    GetInfoReq,
    InfoOut,
    ModelInfo,
    ReqOutput,
    TokenizedGenerateReqInput,
    finish_reason_to_matched_stop,
)
from arborlm.runtime.reasoning_grammar import AfterReasoning, after_reasoning
from arborlm.sampling_params import INT64_MAX, MAX_TOP_LOGPROBS, SamplingParams, shown

logger = logging.getLogger(__name__)


@dataclass
class ReqState:
    """Front-side state of one in-flight request."""

    rid: str
    decoder: RequestDecoder
    prompt_tokens: int
    created_time: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token_time: float | None = None
    last_output_time: float | None = None
    finished: bool = False
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    grammar: GrammarSpec | None = None
    stop_token_ids: tuple[int, ...] = ()  # the request's own stop ids (not the model's EOS)


class OutputObserver(Protocol):
    """Told about every request's outputs as they arrive (the HTTP server's metrics).

    Called on the manager's loop; must not block.
    """

    def on_tokens(self, num_tokens: int, interval_s: float, first: bool) -> None:
        """`num_tokens` new tokens arrived `interval_s` seconds after the previous
        output, or after the request was sent when `first` (its TTFT)."""

    def on_finish(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                  e2e_latency_s: float, finish_reason: dict[str, Any], ttft_s: float | None = None,
                  queue_time_s: float | None = None) -> None:
        """A request finished (any reason, aborts included); `ttft_s`: its time to first token
        (None when it produced none); `queue_time_s`: its wait in the scheduler before admission."""


class TokenizerManager:
    """Tokenize, validate, dispatch and detokenize.

    Parameters
    ----------
    server_args: the runtime settings.
    model_info: what the scheduler reported when it became ready.
    tokenizer: the model's Hugging Face tokenizer.
    port_args: zmq addresses (`scheduler_process.PortArgs`).
    observer: told about every output (metrics); None for none.
    """

    def __init__(self, server_args: ServerArgs, model_info: ModelInfo, tokenizer, port_args,
                 observer: OutputObserver | None = None):
        self.server_args = server_args
        self.observer = observer
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.context = zmq.asyncio.Context()
        self.send_sock = self.context.socket(zmq.PUSH)
        self.send_sock.bind(port_args.scheduler_input)
        self.recv_sock = self.context.socket(zmq.PULL)
        self.recv_sock.bind(port_args.scheduler_output)
        self.rid_to_state: dict[str, ReqState] = {}
        # Callers waiting for an `InfoOut`, oldest first: the scheduler answers in the order asked.
        self._pending_replies: deque[asyncio.Future] = deque()
        self.reply_timeout_s = server_args.scheduler.reply_timeout_s
        self._seed_counter = server_args.scheduler.random_seed
        self.dead_reason: str | None = None
        self.stats = {"num_grammar_violations": 0}
        self._loop_task: asyncio.Task | None = None
        queued = server_args.scheduler.max_queued_requests
        self.max_in_flight = None if queued is None else model_info.max_running_requests + queued

    def start(self) -> None:
        """Start receiving scheduler outputs (call on the running loop)."""
        self._loop_task = asyncio.get_running_loop().create_task(self._handle_loop())

    # ---- validation ---------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def build_request(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        """Validate and tokenize one request.

        The grammar is checked last, so a `GrammarError` means every other
        field is fine (an Engine batch reports such an item alone, `entrypoints.request_builder.build_batch`).

        Raises
        ------
        InvalidRequestError
            Empty prompt, prompt too long for the context, bad token ids or a bad
            sampling field; generation on an embedding server (naming `model`).
        GrammarError
            (an `InvalidRequestError`) the constraint cannot be used.
        """
        input_ids = self.prompt_ids(obj)
        params = self._sampling_params(obj.sampling_params)
        if self.server_args.model.is_embedding and params.max_new_tokens != 0:
            raise InvalidRequestError("this server serves an embedding model (--is-embedding): it answers "
                                      "/v1/embeddings and /encode, not generation", param="model")
        self._check_logprob_fields(obj)
        rid = obj.rid or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise InvalidRequestError("rid must be a string", param="rid")
        if rid in self.rid_to_state:
            raise InvalidRequestError(f"request id {rid!r} is already in flight", param="rid")
        self._check_cache_salt(obj.cache_salt)
        backend = self.server_args.grammar.grammar_backend
        grammar = grammar_spec_from_params(params, backend)
        # Under grammar_backend auto the constraint's own backend (the one the front chose) decides.
        chosen = resolved_backend(grammar.key.backend, backend) if grammar is not None else backend
        grammar = after_reasoning(grammar, params.reasoning, chosen)
        return TokenizedGenerateReqInput(
            rid=rid,
            input_ids=input_ids,
            sampling_params=params,
            seed=params.seed if params.seed is not None else self._next_seed(),
            return_logprob=bool(obj.return_logprob),
            logprob_start_len=obj.logprob_start_len,
            top_logprobs_num=obj.top_logprobs_num,
            stream=obj.stream,
            grammar=grammar,
            cache_salt=obj.cache_salt,
        )

    def prompt_ids(self, obj: GenerateReqInput) -> list[int]:
        """The request's prompt as token ids, checked against the vocabulary and the context.

        Raises
        ------
        InvalidRequestError
            Both or neither of text and input_ids, an empty prompt, bad token
            ids, a prompt that leaves no room for a generated token.
        """
        if (obj.text is None) == (obj.input_ids is None):
            raise InvalidRequestError("give exactly one of text and input_ids", param="text")
        if obj.text is not None:
            if not isinstance(obj.text, str):
                raise InvalidRequestError("text must be a string", param="text")
            input_ids = self.tokenize(obj.text)
        else:
            input_ids = self._check_input_ids(obj.input_ids)
        prompt_param = "text" if obj.text is not None else "input_ids"
        if not input_ids:
            raise InvalidRequestError("the prompt is empty", param=prompt_param)
        context = self.model_info.context_length
        if len(input_ids) >= context:
            raise ContextLengthError(
                f"the prompt has {len(input_ids)} tokens; this server's context is {context} tokens "
                "(prompt + at least one generated token)",
                param=prompt_param,
            )
        return input_ids

    @staticmethod
    def _check_cache_salt(salt: Any) -> None:
        """A salt namespaces the request's radix-cache paths: only requests with the same salt share them."""
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequestError("cache_salt must be a string", param="cache_salt")

    def _sampling_params(self, params: Any) -> SamplingParams:
        if params is None:
            params = {}
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling_params must be a dict or SamplingParams, got {type(params).__name__}",
                param="sampling_params",
            )
        params.verify(self.model_info.vocab_size)
        return params.normalized()

    def _check_logprob_fields(self, obj: GenerateReqInput) -> None:
        """`top_logprobs_num` in [0, `MAX_TOP_LOGPROBS`] (each is kept for every token of the
        output); `logprob_start_len` -1 (the output only) or a position in int64."""
        top_max = min(MAX_TOP_LOGPROBS, self.model_info.vocab_size)
        top = obj.top_logprobs_num
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= top_max:
            raise InvalidRequestError(f"top_logprobs_num must be an integer in [0, {top_max}]",
                                      param="top_logprobs_num")
        start = obj.logprob_start_len
        if not isinstance(start, int) or isinstance(start, bool) or not -1 <= start <= INT64_MAX:
            raise InvalidRequestError("logprob_start_len must be an integer >= -1 (and below 2**63)",
                                      param="logprob_start_len")

    def _check_input_ids(self, input_ids: Any) -> list[int]:
        vocab = self.model_info.vocab_size
        if not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids
        ):
            raise InvalidRequestError("input_ids must be a list of integers", param="input_ids")
        bad = [t for t in input_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids {shown(bad[:5])} are outside the vocabulary [0, {vocab})",
                                      param="input_ids")
        return list(input_ids)

    def _next_seed(self) -> int:
        self._seed_counter += 1
        return hash((self.server_args.scheduler.random_seed, self._seed_counter, uuid.uuid4().int)) % (2**63)

    # ---- requests -----------------------------------------------------------

    async def generate(
        self, obj: GenerateReqInput | TokenizedGenerateReqInput
    ) -> AsyncIterator[dict[str, Any]]:
        """Run one request; yields one dict per step when streaming, else the final dict.

        `obj` is validated and tokenized here, unless it already is (the output
        of `build_request`, as a batch is checked whole before anything runs).

        A stream chunk's `text` is the new text since the previous chunk; the
        chunks concatenate to the final text. Aborting the consumer (closing the
        generator, cancelling the task) aborts the request in the scheduler.

        Raises
        ------
        InvalidRequestError, EngineDeadError
        """
        self._check_alive()
        recv = obj if isinstance(obj, TokenizedGenerateReqInput) else self.build_request(obj)
        if recv.rid in self.rid_to_state:  # a pre-built request is checked again here, atomically
            raise InvalidRequestError(f"request id {recv.rid!r} is already in flight", param="rid")
        self.check_capacity(1)
        params = recv.sampling_params
        state = ReqState(
            rid=recv.rid,
            decoder=RequestDecoder(
                self.tokenizer,
                params.stop or [],
                recv.input_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                no_stop_trim=params.no_stop_trim,
            ),
            prompt_tokens=len(recv.input_ids),
            created_time=time.perf_counter(),
            grammar=recv.grammar,
            stop_token_ids=tuple(params.stop_token_ids or ()),
        )
        self.rid_to_state[recv.rid] = state
        self.send_sock.send_pyobj(recv)
        try:
            while True:
                out = await state.queue.get()
                if isinstance(out, BaseException):
                    raise out
                _raise_if_rejected(out)
                delta = self._apply_output(state, out)
                if recv.stream:
                    yield self._make_result(state, out, delta, out.new_token_ids)
                if state.finished:
                    if not recv.stream:
                        yield self._make_result(state, out, state.text, state.output_ids)
                    return
        finally:
            if not state.finished:
                self.send_sock.send_pyobj(AbortReq(recv.rid))
                self._observe_abort(state)
            self.rid_to_state.pop(recv.rid, None)

    def check_capacity(self, num_new: int) -> None:
        """Refuse `num_new` more requests when `max_queued_requests` would be exceeded.

        Raises
        ------
        ServerOverloadedError: more than `max_running_requests + max_queued_requests`
            requests would be in flight.
        """
        if self.max_in_flight is not None and len(self.rid_to_state) + num_new > self.max_in_flight:
            raise ServerOverloadedError(
                f"the server is at capacity ({len(self.rid_to_state)} requests in flight, "
                f"max_running_requests={self.model_info.max_running_requests}, "
                f"max_queued_requests={self.server_args.scheduler.max_queued_requests}); retry later"
            )

    def _apply_output(self, state: ReqState, out: ReqOutput) -> str:
        """Fold one scheduler output into the request's state; returns the new text."""
        now = time.perf_counter()
        if state.first_token_time is None and out.new_token_ids:
            state.first_token_time = now
        self._observe(state, out, now)
        state.output_ids.extend(out.new_token_ids)
        check = state.decoder.step(out.new_token_ids)
        delta = check.text
        if out.finish_reason is not None:
            state.finished = True
            delta += state.decoder.finish()
        state.text += delta
        if state.finished and state.grammar is not None:
            self._check_grammar_output(state, out)
        state.output_token_logprobs.extend((lp, tid, None) for lp, tid in out.output_token_logprobs)
        state.output_top_logprobs.extend(
            [(lp, tid, None) for lp, tid in top] for top in out.output_top_logprobs
        )
        if out.input_token_logprobs is not None:
            state.input_token_logprobs = [(lp, tid, None) for lp, tid in out.input_token_logprobs]
            state.input_top_logprobs = [
                None if top is None else [(lp, tid, None) for lp, tid in top] for top in (out.input_top_logprobs or [])
            ]
        return delta

    def _observe(self, state: ReqState, out: ReqOutput, now: float) -> None:
        if self.observer is None:
            return
        if out.new_token_ids:
            first = state.last_output_time is None
            since = state.created_time if first else state.last_output_time
            self.observer.on_tokens(len(out.new_token_ids), now - since, first)
            state.last_output_time = now
        if out.finish_reason is not None:
            ttft = state.first_token_time - state.created_time if state.first_token_time is not None else None
            self.observer.on_finish(out.prompt_tokens, out.cached_tokens, out.completion_tokens,
                                    now - state.created_time, out.finish_reason, ttft_s=ttft,
                                    queue_time_s=out.queue_time_s)

    def _observe_abort(self, state: ReqState) -> None:
        """Count a request that ends without a scheduler finish (its client went away, shutdown, a
        rejection, the engine died) as one `abort`: the scheduler's own finish for it, if any, arrives
        after its state is gone and is never counted, so this is the only count."""
        if self.observer is None:
            return
        now = time.perf_counter()
        ttft = state.first_token_time - state.created_time if state.first_token_time is not None else None
        self.observer.on_finish(state.prompt_tokens, 0, len(state.output_ids), now - state.created_time,
                                {"type": "abort"}, ttft_s=ttft)

    def _check_grammar_output(self, state: ReqState, out: ReqOutput) -> None:
        """A constrained output that the grammar ended must satisfy the user's schema.

        A backend that under-constrains would otherwise return invalid JSON
        marked "stop"; this turns it into an abort that says why, and counts it.

        Only an output the grammar ended (by its EOS) is checked, and without
        the EOS's text (``skip_special_tokens=False`` keeps it in the returned
        text, but it is not part of the value). An output cut by the user's
        stop string or stop token id is, like a ``length`` finish, a prefix of
        a valid one: it keeps its ``stop`` finish with the stop in
        ``matched_stop``, and is not validated. After reasoning
        (`AfterReasoning`), only the answer that follows the reasoning is.
        """
        reason = out.finish_reason
        if reason is None or reason.get("type") != "stop" or not self._ended_by_grammar(state, reason.get("matched")):
            return
        problem = state.grammar.validate_output(self._value_text(state.text, reason.get("matched")))
        if problem is None:
            return
        self.stats["num_grammar_violations"] += 1
        logger.warning("request %s: constrained output failed validation: %s", state.rid, problem)
        param = state.grammar.param if isinstance(state.grammar, AfterReasoning) else state.grammar.key.param
        out.finish_reason = {
            "type": "abort",
            "message": f"the output does not satisfy the requested {param}: {problem}",
        }

    def _ended_by_grammar(self, state: ReqState, matched: Any) -> bool:
        """True when a "stop" finish came from the grammar's end, not from a stop the user set.

        A grammar allows EOS only once its output is complete, so an EOS id
        (even one the user also listed in ``stop_token_ids``) is the grammar's end.
        """
        if isinstance(matched, str):
            return False
        return matched in self.model_info.eos_token_ids or matched not in state.stop_token_ids

    def _value_text(self, text: str, matched: Any) -> str:
        """``text`` without the text of the EOS token that ended it (present when special tokens are kept)."""
        if not isinstance(matched, int):
            return text
        eos_text = self.tokenizer.decode([matched], skip_special_tokens=False)
        return text.removesuffix(eos_text) if eos_text else text

    def _make_result(self, state: ReqState, out: ReqOutput, text: str, output_ids: list[int]) -> dict[str, Any]:
        now = time.perf_counter()
        meta: dict[str, Any] = {
            "id": state.rid,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "finish_reason": out.finish_reason,
            "matched_stop": finish_reason_to_matched_stop(out.finish_reason),
            "e2e_latency": now - state.created_time,
            "ttft": (state.first_token_time - state.created_time) if state.first_token_time else None,
        }
        if state.grammar is not None:
            # The backend that compiled the request's grammar (under grammar_backend auto, per request).
            meta["grammar_backend"] = resolved_backend(state.grammar.key.backend, self.server_args.grammar.grammar_backend)
        if out.spec_verify_ct or self.server_args.speculative.speculative_algorithm is not None:
            # SGLang's field: verify steps (0 for a request no step verified, as SGLang gives it
            # whenever speculation is on); accepted draft tokens beside it (docs/speculative.md).
            meta["spec_verify_ct"] = out.spec_verify_ct
            meta["spec_accepted_tokens"] = out.spec_accepted_tokens
        if state.output_token_logprobs or state.input_token_logprobs is not None:
            meta["output_token_logprobs"] = list(state.output_token_logprobs)
            meta["output_top_logprobs"] = list(state.output_top_logprobs)
            meta["input_token_logprobs"] = state.input_token_logprobs or []
            meta["input_top_logprobs"] = state.input_top_logprobs or []
        result = {"text": text, "output_ids": list(output_ids), "meta_info": meta}
        if out.embedding is not None:
            result["embedding"] = out.embedding  # SGLang's /encode key
        return result

    async def abort_request(self, rid: str) -> None:
        """Abort an in-flight request; its caller receives the `abort` finish."""
        self.send_sock.send_pyobj(AbortReq(rid))

    async def get_info(self, check_invariants: bool = False) -> dict[str, Any]:
        """Live figures from the scheduler (optionally asserting pool invariants there).

        Raises
        ------
        EngineDeadError, SchedulerTimeoutError: as `_ask`.
        """
        return {**await self._ask(GetInfoReq(check_invariants=check_invariants)), **self.stats}

    async def flush_cache(self) -> bool:
        """Empty the radix cache; False when requests are in flight.

        Raises
        ------
        EngineDeadError, SchedulerTimeoutError: as `_ask` (after a timeout the flush may
            still happen).
        """
        return bool((await self._ask(FlushCacheReq()))["success"])

    async def _ask(self, message) -> dict[str, Any]:
        """Send `message` to the scheduler and wait, at most `reply_timeout_s` seconds, for its `InfoOut`.

        A caller that gives up leaves its (cancelled) future in `_pending_replies`, so
        the late reply settles that one and never a later caller's.

        Raises
        ------
        EngineDeadError: the scheduler is gone, or dies while we wait.
        SchedulerTimeoutError: no reply in time: the scheduler is inside a long step,
            or a stuck one that its watchdog will end.
        """
        self._check_alive()
        future = asyncio.get_running_loop().create_future()
        self._pending_replies.append(future)
        self.send_sock.send_pyobj(message)
        try:
            return await asyncio.wait_for(future, self.reply_timeout_s)
        except TimeoutError:
            raise SchedulerTimeoutError(
                f"the scheduler did not answer in {self.reply_timeout_s:g} s (it is inside a long or stuck "
                "step; a stuck one is ended by its watchdog); retry later"
            ) from None

    # ---- receiving ----------------------------------------------------------

    async def _handle_loop(self) -> None:
        while True:
            message = await self.recv_sock.recv_pyobj()
            if isinstance(message, InfoOut):
                self._settle_oldest_reply(message.info)
                continue
            assert isinstance(message, BatchTokenOut)
            for out in message.outputs:
                state = self.rid_to_state.get(out.rid)
                if state is not None:
                    state.queue.put_nowait(out)

    def _settle_oldest_reply(self, info: dict[str, Any]) -> None:
        """Hand a scheduler reply to the oldest caller still waiting for one."""
        if not self._pending_replies:
            logger.warning("a scheduler reply arrived that no caller asked for")
            return
        future = self._pending_replies.popleft()
        if not future.done():  # done: its caller timed out or was cancelled
            future.set_result(info)

    def abort_all(self, message: str) -> None:
        """Every in-flight caller gets `RequestAbortedError(message)`; the scheduler is told to stop them."""
        for state in self.rid_to_state.values():
            state.queue.put_nowait(RequestAbortedError(message))

    def fail_all(self, reason: str) -> None:
        """The scheduler died: every waiting caller gets `EngineDeadError`."""
        self.dead_reason = reason
        for state in self.rid_to_state.values():
            state.queue.put_nowait(EngineDeadError(reason))
        while self._pending_replies:
            future = self._pending_replies.popleft()
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        for state in self.rid_to_state.values():
            state.queue.put_nowait(RequestAbortedError("the engine is shutting down"))
        # destroy() closes every socket first, so term() cannot block (also not later, in __del__).
        self.context.destroy(linger=0)


def _raise_if_rejected(out: ReqOutput) -> None:
    """The scheduler refused the request: its grammar failed to compile (a 400-style error), or
    compiles are overloaded (`GrammarCompilesOverloaded`, code server_overloaded: a 503)."""
    reason = out.finish_reason
    if reason and reason.get("type") == "abort" and reason.get("param") is not None:
        if reason.get("code") == "server_overloaded":
            raise ServerOverloadedError(reason["message"])
        raise InvalidRequestError(reason["message"], param=reason["param"])
