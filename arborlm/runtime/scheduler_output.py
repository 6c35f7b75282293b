"""After the model step: finish checks, stop strings and the outputs sent to the front.

`SchedulerOutputProcessor` holds what these need (tokenizer for stop strings,
EOS ids, the context length) so the scheduler's `process_batch_result` stays
short. It does bookkeeping only: the forward pass, grammar masks and sampling
are the model worker's (`model_worker.py`).
"""

from __future__ import annotations

import logging

from arborlm.runtime.detokenizer import RequestDecoder
from arborlm.runtime.io_struct import ReqOutput
from arborlm.runtime.model_worker import LogprobInfo, PromptLogprobs
from arborlm.runtime.schedule_batch import Req

logger = logging.getLogger(__name__)


class SchedulerOutputProcessor:
    """Decides when requests finish and builds their `ReqOutput`s.

    Parameters
    ----------
    tokenizer: used to find stop strings in the generated text.
    eos_token_ids: ids that end a request unless `ignore_eos`.
    context_length: max tokens of one request (prompt + output).
    """

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], context_length: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.context_length = context_length
        self._stop_decoders: dict[str, RequestDecoder] = {}

    def check_finished(self, req: Req, num_new_tokens: int = 1) -> None:
        """Set `req.finish_reason` when its last tokens end it (SGLang's order of checks).

        num_new_tokens: tokens appended since the last check; more than one
        only for tokens a grammar forced (jump-forward), which are never stop tokens.
        """
        params = req.sampling_params
        last = req.output_ids[-1]
        if req.to_abort:
            req.finish_reason = {"type": "abort", "message": "aborted by request"}
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finish_reason = {"type": "length", "length": params.max_new_tokens}
        elif req.seqlen >= self.context_length:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}
        elif num_new_tokens == 1 and len(req.output_ids) >= params.min_new_tokens and self._is_stop_token(req, last):
            req.finish_reason = {"type": "stop", "matched": last}
        elif num_new_tokens == 1 and req.grammar is not None and req.grammar.is_terminated():
            req.finish_reason = {"type": "stop", "matched": last}
        else:
            matched = self._matched_stop_string(req, num_new_tokens)
            if matched is not None:
                req.finish_reason = {"type": "stop", "matched": matched}
        if req.finished:
            self._stop_decoders.pop(req.rid, None)

    def accept_grammar_token(self, req: Req, token_id: int) -> None:
        """Advance a constrained request's matcher by its sampled token.

        The mask allowed only grammatical tokens, so a rejection is a bug in a
        backend; the request then aborts rather than return ungrammatical text.
        """
        if req.grammar is None or req.grammar.accept_token(token_id):
            return
        logger.error("request %s: grammar rejected sampled token %d", req.rid, token_id)
        req.finish_reason = {"type": "abort", "message": f"internal error: the grammar rejected token {token_id}"}

    def _is_stop_token(self, req: Req, token_id: int) -> bool:
        if token_id in (req.sampling_params.stop_token_ids or ()):
            return True
        return not req.sampling_params.ignore_eos and token_id in self.eos_token_ids

    def _matched_stop_string(self, req: Req, num_new_tokens: int = 1) -> str | None:
        stops = req.sampling_params.stop
        if not stops:
            return None
        decoder = self._stop_decoders.get(req.rid)
        if decoder is None:
            # A retracted request replays its output so the decoder sees the same text.
            decoder = RequestDecoder(self.tokenizer, list(stops), req.origin_input_ids)
            self._stop_decoders[req.rid] = decoder
            decoder.step(req.output_ids[:-num_new_tokens])
        check = decoder.step(req.output_ids[-num_new_tokens:])
        return check.matched

    def forget(self, req: Req) -> None:
        """Drop per-request state of a request that leaves the scheduler (stop decoder, matcher)."""
        self._stop_decoders.pop(req.rid, None)
        req.grammar = None

    def add_prompt_logprobs(self, req: Req, chunk: PromptLogprobs | None) -> None:
        """Append the prompt logprobs the worker scored this step (None: none asked)."""
        if chunk is None:
            return
        req.input_token_logprobs.extend(chunk.token_logprobs)
        req.input_top_logprobs.extend(chunk.top_logprobs)

    def make_output(self, req: Req, new_token_ids: list[int], logprob_info: LogprobInfo | None = None) -> ReqOutput:
        """The message for the front about `req` after this step."""
        out = ReqOutput(
            rid=req.rid,
            new_token_ids=list(new_token_ids),
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            spec_verify_ct=req.spec_verify_ct,
            spec_accepted_tokens=req.spec_accepted_tokens,
            queue_time_s=req.admitted_time - req.created_time if req.admitted_time else None,
        )
        if logprob_info is not None:
            # Tokens after the sampled one were forced by the grammar: probability 1 under the mask.
            forced = new_token_ids[1:]
            out.output_token_logprobs = [(logprob_info.logprob, logprob_info.token_id)] + [(0.0, t) for t in forced]
            out.output_top_logprobs = [logprob_info.top] + [[(0.0, t)] for t in forced]
        if req.return_logprob and not req.input_logprobs_sent and (new_token_ids or req.finished):
            out.input_token_logprobs = req.input_token_logprobs if req.logprob_start_len >= 0 else []
            out.input_top_logprobs = req.input_top_logprobs if req.logprob_start_len >= 0 else []
            req.input_logprobs_sent = True
        if req.finished:
            self.forget(req)
        return out
