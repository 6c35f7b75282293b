"""After the forward step: sampling, finish checks, logprobs and the outputs sent to the front.

`SchedulerOutputProcessor` holds what these need (tokenizer for stop strings,
EOS ids, the sampler) so the scheduler loop stays short.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import torch

from arborlm.constrained.base import allocate_vocab_mask, apply_vocab_mask
from arborlm.runtime.detokenizer import RequestDecoder
from arborlm.runtime.forward_batch_info import ForwardBatch, LogitsOutput
from arborlm.runtime.io_struct import ReqOutput
from arborlm.runtime.sampling import Sampler, SamplingBatchInfo, compute_logprobs, make_generator
from arborlm.runtime.schedule_batch import Req

logger = logging.getLogger(__name__)


@dataclass
class LogprobInfo:
    """Logprob of one sampled token and, when asked, its top alternatives."""

    logprob: float
    token_id: int
    top: list[tuple[float, int]]


class Sampled(NamedTuple):
    token_ids: list[int]
    logprob_infos: list[LogprobInfo | None]


class SchedulerOutputProcessor:
    """Samples next tokens, decides when requests finish and builds `ReqOutput`s.

    Parameters
    ----------
    tokenizer: used to find stop strings in the generated text.
    eos_token_ids: ids that end a request unless `ignore_eos`.
    vocab_size, context_length: model limits (tokens).
    device: where sampling tensors go.
    """

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], vocab_size: int, context_length: int, device):
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.device = device
        self.sampler = Sampler()
        self._stop_decoders: dict[str, RequestDecoder] = {}
        # Mask fill time of each constrained request at each step (one entry per token), seconds,
        # with its share of the bitmask reset; the benchmark reads it.
        self.mask_fill_seconds: deque[float] = deque(maxlen=1 << 16)
        # The bitmask rows are filled in, kept between steps: allocating (B, V / 32) int32 anew
        # each step (page faults for a large batch) cost about as much as filling it.
        self._vocab_mask: torch.Tensor | None = None

    def sample(self, reqs: list[Req], logits: torch.Tensor) -> Sampled:
        """Pick one token per request. `logits`: (len(reqs), vocab) float32."""
        if not reqs:
            return Sampled([], [])
        for req in reqs:
            if req.generator is None:
                req.generator = make_generator(req.seed, logits.device)
        self.apply_grammar_masks(reqs, logits)
        params = [r.sampling_params for r in reqs]
        info = SamplingBatchInfo.from_params(
            params, [r.seed for r in reqs], self.vocab_size, logits.device, [r.generator for r in reqs]
        )
        top_n = max(r.top_logprobs_num for r in reqs if r.return_logprob) if any(r.return_logprob for r in reqs) else 0
        out = self.sampler(
            logits,
            info,
            output_ids_list=[r.output_ids for r in reqs],
            prompt_ids_list=[r.origin_input_ids for r in reqs] if info.need_repetition_penalty else None,
            eos_ids_list=[self._eos_ids(r) for r in reqs] if info.need_min_new_tokens else None,
            top_logprobs_num=top_n,
            return_logprob=any(r.return_logprob for r in reqs),
        )
        token_ids = out.next_token_ids.tolist()
        infos: list[LogprobInfo | None] = []
        for i, req in enumerate(reqs):
            if not req.return_logprob:
                infos.append(None)
                continue
            top: list[tuple[float, int]] = []
            if req.top_logprobs_num and out.top_logprobs is not None:
                k = req.top_logprobs_num
                top = list(zip(out.top_logprobs.top_values[i, :k].tolist(), out.top_logprobs.top_ids[i, :k].tolist()))
            infos.append(LogprobInfo(float(out.logprobs[i]), token_ids[i], top))
        return Sampled(token_ids, infos)

    def apply_grammar_masks(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Mask, in place, every token the grammar of each constrained request forbids.

        logits: (len(reqs), V) float32. The first len(reqs) rows of one
        (batch, ceil(V / 32)) int32 bitmask, kept between steps, are reset to
        "all allowed" and filled row by row, then applied in one call.
        """
        rows = [i for i, req in enumerate(reqs) if req.grammar is not None]
        if not rows:
            return
        start = time.perf_counter()
        mask = self._reset_vocab_mask(len(reqs), logits.shape[-1])
        reset_share = (time.perf_counter() - start) / len(rows)
        # Timed per row, so one slow grammar shows at its full cost, not averaged over the batch.
        for i in rows:
            start = time.perf_counter()
            reqs[i].grammar.fill_vocab_mask(mask, i)
            self.mask_fill_seconds.append(time.perf_counter() - start + reset_share)
        apply_vocab_mask(logits, mask, rows)

    def _reset_vocab_mask(self, batch_size: int, vocab_size: int) -> torch.Tensor:
        """The first ``batch_size`` rows of the kept bitmask, every bit set (grown when too small).

        The reset matters: a matcher may write only the words it forbids, and
        a bit left cleared by last step's request in this row must not leak.
        The reused CPU tensor is pageable, so a ``non_blocking`` copy to the
        GPU in `apply_vocab_mask` is staged before it returns and cannot race
        with the next step's reset.
        """
        mask = self._vocab_mask
        if mask is None or mask.shape[0] < batch_size or mask.shape[1] != (vocab_size + 31) // 32:
            self._vocab_mask = allocate_vocab_mask(batch_size, vocab_size)
            return self._vocab_mask
        mask = mask[:batch_size]
        mask.fill_(-1)
        return mask

    def _eos_ids(self, req: Req) -> list[int]:
        # A grammar decides itself when EOS may come; min_new_tokens must not mask the only legal token.
        return [] if req.sampling_params.ignore_eos or req.grammar is not None else self.eos_token_ids

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

    def collect_prompt_logprobs(self, reqs: list[Req], logits_output: LogitsOutput, forward_batch: ForwardBatch) -> None:
        """Accumulate prompt-token logprobs of requests that asked (`logprob_start_len` >= 0).

        Row j of this request's chunk holds the logits at position `start + j`,
        which score the token at position `start + j + 1`.
        """
        if logits_output.full_logits is None:
            return
        offset = 0
        for req, n in zip(reqs, forward_batch.extend_seq_lens_cpu):
            rows = logits_output.full_logits[offset : offset + n]
            offset += n
            if not req.wants_prompt_logprobs():
                continue
            start = req.kv_len - n  # kv_len was already advanced past this chunk
            prompt = req.origin_input_ids
            if start == 0 and req.logprob_start_len == 0:
                req.input_token_logprobs.append((None, prompt[0]))
                req.input_top_logprobs.append(None)
            targets = [p for p in range(start + 1, min(start + n + 1, len(prompt))) if p >= req.logprob_start_len]
            if not targets:
                continue
            idx = torch.tensor([p - 1 - start for p in targets])
            ids = torch.tensor([prompt[p] for p in targets])
            lp = compute_logprobs(rows[idx], ids, req.top_logprobs_num)
            for j, p in enumerate(targets):
                req.input_token_logprobs.append((float(lp.logprobs[j]), prompt[p]))
                top = None
                if lp.top_values is not None:
                    top = list(zip(lp.top_values[j].tolist(), lp.top_ids[j].tolist()))
                req.input_top_logprobs.append(top)

    def make_output(self, req: Req, new_token_ids: list[int], logprob_info: LogprobInfo | None = None) -> ReqOutput:
        """The message for the front about `req` after this step."""
        out = ReqOutput(
            rid=req.rid,
            new_token_ids=list(new_token_ids),
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
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
