"""One model step: forward pass, prompt logprobs, grammar masks and sampling.

The scheduler decides what runs and keeps every request's bookkeeping; it
hands `ModelWorker.forward_batch_generation` a `ModelWorkerBatch` (the step's
`ForwardBatch`, its slots already allocated and written into `req_to_token`)
and gets a `GenerationResult` back: the next token of every request that takes
one this step, with logprobs when asked. The worker owns the `ModelRunner`
(model and KV pools) and the sampler (SGLang's TpModelWorker; one per tensor
parallel rank once there are several). Speculative verification lives here, and
the draft model of STANDALONE speculation (`speculative.draft_worker`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from arborlm.constrained.base import allocate_vocab_mask, apply_vocab_mask
from arborlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from arborlm.runtime.embedding import Embedder
from arborlm.runtime.forward_batch_info import ForwardBatch, LogitsOutput
from arborlm.runtime.io_struct import ModelInfo
from arborlm.runtime.model_runner import ModelRunner
from arborlm.runtime.pooling_config import read_pooling_config
from arborlm.runtime.sampling import Sampler, SamplingInfoCache, compute_logprobs, make_generator
from arborlm.runtime.schedule_batch import Req
from arborlm.runtime.speculative.draft_worker import make_draft_worker
from arborlm.runtime.speculative.verify import DraftVerifier
from arborlm.runtime.speculative.verify_batch import draft_rows, uses_verify_rows, verify_rows

# Mask fill times kept for the structured-output benchmark (one entry per constrained request and step).
MASK_FILL_SAMPLES = 1 << 16


@dataclass
class LogprobInfo:
    """Logprob of one sampled token and, when asked, its top alternatives (logprob, token id)."""

    logprob: float
    token_id: int
    top: list[tuple[float, int]]


class Sampled(NamedTuple):
    """Sampler output of one step: a token per request and its `LogprobInfo` (None unless asked);
    `invalid_rows`: indices of the requests whose logits were not finite (their token is meaningless)."""

    token_ids: list[int]
    logprob_infos: list[LogprobInfo | None]
    invalid_rows: tuple[int, ...] = ()


@dataclass
class PromptLogprobs:
    """Prompt-token logprobs of one request's chunk, in prompt order.

    token_logprobs: (logprob, token id) per scored prompt position; the logprob
        is None for the first prompt token, which nothing scores.
    top_logprobs: the top (logprob, token id) alternatives per position, None
        when none were asked for.
    """

    token_logprobs: list[tuple[float | None, int]]
    top_logprobs: list[list[tuple[float, int]] | None]


@dataclass
class ModelWorkerBatch:
    """One step as the worker sees it.

    forward_batch: the tensors; `out_cache_loc` is allocated and already in
        `req_to_token`.
    reqs: the step's requests in `forward_batch` row order. The worker reads
        them and changes nothing but `generator` (created on first sampling).
    sample_rows: indices into `reqs` of the requests that take a next token
        this step (not a chunked prompt with tokens left, nor `max_new_tokens` 0).
    draft_tokens: a speculative verify step: per request, the draft run after
        its last token (`speculative.scheduling.build_verify_batch`: `forward_batch`
        is then its extend chains, which the worker may run as decode rows,
        `speculative.verify_batch`); None otherwise.
    """

    forward_batch: ForwardBatch
    reqs: list[Req]
    sample_rows: list[int]
    draft_tokens: list[list[int]] | None = None


@dataclass
class GenerationResult:
    """What one step produced.

    next_token_ids: the token of each request in `sample_rows`, in that order.
    logprob_infos: per sampled request, its `LogprobInfo` when it asked
        (`return_logprob`), else None.
    prompt_logprobs: per request of the batch, the logprobs of the prompt
        tokens this step scored when it asked, else None.
    accept_lens: on a speculative verify step, the tokens each request emitted
        (`next_token_ids` and `logprob_infos` then hold them all, request after
        request, and `invalid_rows` indexes requests); None means one token per
        sampled request.
    invalid_rows: positions in `next_token_ids` whose logits or probabilities
        were not finite (NaN, inf, every token masked): the scheduler aborts
        those requests alone and ignores their token.
    embeddings: an embedding server's step (`--is-embedding`): per request of the
        batch, its pooled vector when this step ended its prompt, else None.
    draw_states: on a speculative verify step, per request, its generator's states after
        each draw when it samples under a grammar (`speculative.verify.VerifyOutput`).
    """

    next_token_ids: list[int]
    logprob_infos: list[LogprobInfo | None]
    prompt_logprobs: list[PromptLogprobs | None]
    accept_lens: list[int] | None = None
    invalid_rows: tuple[int, ...] = ()
    embeddings: list[list[float] | None] | None = None
    draw_states: list | None = None

    def check_shape(self, num_sampled: int, num_reqs: int) -> None:
        """Raise RuntimeError unless there is a token per sampled row and a prompt-logprob
        entry per request (a worker bug must not desynchronise the scheduler's bookkeeping)."""
        if len(self.next_token_ids) != num_sampled or len(self.logprob_infos) != num_sampled:
            raise RuntimeError(f"worker returned {len(self.next_token_ids)} tokens for {num_sampled} sampled requests")
        if len(self.prompt_logprobs) != num_reqs:
            raise RuntimeError(f"worker returned {len(self.prompt_logprobs)} prompt logprob entries for {num_reqs} "
                               "requests")


class Worker(Protocol):
    """What the scheduler needs of a model worker (`ModelWorker`, or a fake in tests).

    The pools are the worker's (they live where the model runs); the scheduler
    allocates and frees in them through its `KVManager`, and the worker only
    writes K/V at a step's `out_cache_loc`. `forward_batch_generation` raises
    on any failure; the scheduler then aborts that step's requests alone.
    """

    model_info: ModelInfo
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationResult: ...


class GrammarMasker:
    """Masks, in the logits, every token the grammar of each constrained request forbids.

    Keeps one (batch, ceil(V / 32)) int32 bitmask between steps: allocating it
    anew each step (page faults for a large batch) cost about as much as filling it.
    `mask_fill_seconds` holds the fill time of each constrained request at each
    step (with its share of the bitmask reset); the structured benchmark reads it.
    """

    def __init__(self):
        self.mask_fill_seconds: deque[float] = deque(maxlen=MASK_FILL_SAMPLES)
        self._vocab_mask: torch.Tensor | None = None

    def apply_grammar_masks(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Mask `logits`, (len(reqs), V) float32, in place by each request's `grammar`.

        The first len(reqs) rows of the kept bitmask are reset to "all allowed"
        and filled row by row, then applied in one call. Requests without a
        grammar keep their row as it is.
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


class ModelWorker:
    """Runs the model on a step's batch and samples each request's next token.

    Parameters
    ----------
    model_runner: the loaded model and its KV pools.
    tokenizer: for the EOS ids of `model_info`; loaded from the checkpoint when None.
    """

    def __init__(self, model_runner: ModelRunner, tokenizer=None):
        self.model_runner = model_runner
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_runner.checkpoint))
        self.tokenizer = tokenizer
        self.model_info = model_runner.model_info(tokenizer)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.token_to_kv_pool_allocator = model_runner.token_to_kv_pool_allocator
        # `--disable-cpu-kernels` also keeps sampling and penalties on the torch ops.
        native = not model_runner.server_args.model.disable_cpu_kernels
        self.sampler = Sampler(native)
        # The batch's sampling tensors, kept while the same requests decode on.
        self.sampling_info_cache = SamplingInfoCache()
        self.grammar_masker = GrammarMasker()
        self.draft_verifier = DraftVerifier(self.model_info.vocab_size, self._eos_ids, native)
        # Verify steps as decode rows (TARGET_VERIFY) where the attention backend takes them, else the
        # scheduler's extend chains (`speculative/verify_batch.py`); tests set it False for the oracle.
        self.verify_as_rows = uses_verify_rows(model_runner.model)
        # STANDALONE speculation: the draft model and its own KV pool (`speculative/draft_worker.py`)
        self.draft_worker = make_draft_worker(model_runner.server_args, self.model_info.vocab_size,
                                              model_runner.context_length, model_runner.max_total_tokens, tokenizer)
        # --is-embedding: every step pools hidden states instead of sampling (`runtime/embedding.py`)
        self.embedder = (Embedder(model_runner.model, read_pooling_config(model_runner.checkpoint))
                         if model_runner.server_args.model.is_embedding else None)

    @property
    def mask_fill_seconds(self) -> deque[float]:
        """Grammar mask fill time per constrained request and step, seconds (see `GrammarMasker`)."""
        return self.grammar_masker.mask_fill_seconds

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationResult:
        """Forward `batch`, collect prompt logprobs, mask and sample the rows that take a token.

        Raises whatever the model or the sampler raises; the step's K/V may
        then be partly written, and the scheduler frees its slots.
        """
        if self.embedder is not None:
            return self.embed(batch)
        if batch.draft_tokens is not None:
            return self.verify_drafts(batch)
        logits_output = self.model_runner.forward(batch.forward_batch)
        prompt_logprobs = [None] * len(batch.reqs)
        if batch.forward_batch.forward_mode.is_extend():
            prompt_logprobs = self.collect_prompt_logprobs(batch, logits_output)
            if self.draft_worker is not None:  # the draft prefills the same tokens in the same step
                self.draft_worker.prefill(batch.reqs, batch.forward_batch.seq_lens_cpu)
        logits = logits_output.next_token_logits
        if len(batch.sample_rows) != len(batch.reqs):
            logits = logits[batch.sample_rows]
        sampled = self.sample([batch.reqs[i] for i in batch.sample_rows], logits)
        return GenerationResult(
            sampled.token_ids, sampled.logprob_infos, prompt_logprobs, invalid_rows=sampled.invalid_rows
        )

    def embed(self, batch: ModelWorkerBatch) -> GenerationResult:
        """An embedding server's step: no token sampled; the vector of each request whose prompt ends here.

        Raises
        ------
        RuntimeError: a decode step (embedding requests are prefill-only; the front refuses others).
        """
        if not batch.forward_batch.forward_mode.is_extend():
            raise RuntimeError("an embedding server runs extend steps only")
        vectors = self.embedder.forward(batch.forward_batch, [r.rid for r in batch.reqs],
                                        [len(r.origin_input_ids) for r in batch.reqs])
        return GenerationResult([], [], [None] * len(batch.reqs), embeddings=vectors)

    def verify_drafts(self, batch: ModelWorkerBatch) -> GenerationResult:
        """A speculative verify step: the target's logits at every chain position, as decode
        rows when `verify_as_rows` (`speculative.verify_batch`) else as the scheduler's extend
        chains (the same rows in the same order either way), then greedy acceptance or
        rejection sampling (`speculative.verify`); `accept_lens` says how many each request took."""
        forward_batch = verify_rows(batch.forward_batch) if self.verify_as_rows else batch.forward_batch
        logits_output = self.model_runner.forward(forward_batch)
        full_logits = logits_output.full_logits
        rows = draft_rows(batch.forward_batch.extend_seq_lens_cpu, batch.draft_tokens)
        if rows is not None:  # a jump's forced tokens ran before some drafts
            full_logits = full_logits[torch.tensor(rows, device=full_logits.device)]
        with torch.inference_mode():  # the verifier masks the forward's (inference) logits in place
            out = self.draft_verifier.verify(batch.reqs, batch.draft_tokens, full_logits)
        infos = [None if lp is None else LogprobInfo(*lp) for lp in out.logprobs]
        return GenerationResult(out.token_ids, infos, [None] * len(batch.reqs), out.accept_lens, out.invalid_rows,
                                draw_states=out.draw_states)

    def sample(self, reqs: list[Req], logits: torch.Tensor) -> Sampled:
        """Pick one token per request: `logits` (len(reqs), V) float32, grammar-masked in place first."""
        if not reqs:
            return Sampled([], [])
        for req in reqs:
            if req.generator is None:
                req.generator = make_generator(req.seed, logits.device)
        self.grammar_masker.apply_grammar_masks(reqs, logits)
        params = [r.sampling_params for r in reqs]
        info = self.sampling_info_cache.get(
            params, [r.seed for r in reqs], self.model_info.vocab_size, logits.device, [r.generator for r in reqs]
        )
        return_logprob = any(r.return_logprob for r in reqs)
        top_n = max(r.top_logprobs_num for r in reqs if r.return_logprob) if return_logprob else 0
        out = self.sampler(
            logits,
            info,
            output_ids_list=[r.output_ids for r in reqs],
            prompt_ids_list=[r.prompt_id_array() for r in reqs] if info.need_repetition_penalty else None,
            eos_ids_list=[self._eos_ids(r) for r in reqs] if info.need_min_new_tokens else None,
            top_logprobs_num=top_n,
            return_logprob=return_logprob,
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
                top = out.top_logprobs.top_pairs(i, k)  # masked (-inf) alternatives are left out
            infos.append(LogprobInfo(float(out.logprobs[i]), token_ids[i], top))
        return Sampled(token_ids, infos, out.invalid_rows)

    def _eos_ids(self, req: Req) -> list[int]:
        # A grammar decides itself when EOS may come; min_new_tokens must not mask the only legal token.
        if req.sampling_params.ignore_eos or req.grammar is not None:
            return []
        return list(self.model_info.eos_token_ids)

    def collect_prompt_logprobs(self, batch: ModelWorkerBatch, logits_output: LogitsOutput) -> list[PromptLogprobs | None]:
        """Prompt-token logprobs of the requests that asked (`logprob_start_len` >= 0), per request.

        Row j of a request's chunk in `full_logits` holds the logits at position
        `start + j` (start: its cached prefix length), which score the token at
        position `start + j + 1`.
        """
        if logits_output.full_logits is None:
            return [None] * len(batch.reqs)
        fb = batch.forward_batch
        result: list[PromptLogprobs | None] = []
        offset = 0
        for req, start, n in zip(batch.reqs, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            rows = logits_output.full_logits[offset : offset + n]
            offset += n
            result.append(_prompt_logprobs(req, rows, start) if req.wants_prompt_logprobs() else None)
        return result


def _prompt_logprobs(req: Req, rows: torch.Tensor, start: int) -> PromptLogprobs:
    """Logprobs of the prompt tokens `rows` (n, V) float32 score, the chunk starting at `start`."""
    n = rows.shape[0]
    prompt = req.origin_input_ids
    out = PromptLogprobs([], [])
    if start == 0 and req.logprob_start_len == 0:
        out.token_logprobs.append((None, prompt[0]))
        out.top_logprobs.append(None)
    targets = [p for p in range(start + 1, min(start + n + 1, len(prompt))) if p >= req.logprob_start_len]
    if not targets:
        return out
    idx = torch.tensor([p - 1 - start for p in targets])
    ids = torch.tensor([prompt[p] for p in targets])
    lp = compute_logprobs(rows[idx], ids, req.top_logprobs_num)
    for j, p in enumerate(targets):
        out.token_logprobs.append((float(lp.logprobs[j]), prompt[p]))
        top = None
        if lp.top_values is not None:
            top = list(zip(lp.top_values[j].tolist(), lp.top_ids[j].tolist()))
        out.top_logprobs.append(top)
    return out
