"""Verify drafts in one step: the target's distribution at every draft position, then acceptance.

The model worker ran each request's last token and its draft ``d`` (k tokens)
as ``1 + k`` decode rows over its paged KV (`ForwardMode.TARGET_VERIFY`, where
the attention backend takes them) or as one extend chain of ``1 + k`` tokens
(the causal mask of the ordinary extend kernels is exactly a chain's verify
mask), with logits at every position, in the same row order either way
(`verify_batch.py`). Row ``j`` of a request's chain scores the token after
``d[:j]``, processed as a plain decode step there would process it: the same
grammar mask (the matcher advanced over ``d[:j]``, then rolled back), the same
penalties, logit bias and ``min_new_tokens`` (over ``output_ids + d[:j]``),
the same temperature and top-k / top-p / min-p.

* Greedy requests keep ``t[0..n]`` (``t[j]`` the argmax of row j) where ``n``
  is the longest prefix with ``d[:n] == t[:n]``: token-identical to speculation off.
* Sampled requests use rejection sampling (Leviathan et al. 2023, Chen et al.
  2023) with each draft token as a point mass ``q = δ(d[j])`` (n-gram drafts and
  a draft model's greedy ones both are): ``d[j]`` is accepted with probability
  ``p_j(d[j])``; on the first rejection the token comes from the residual
  ``max(p_j - q, 0)``, i.e. ``p_j`` without ``d[j]``, renormalised, and the chain
  ends; when all are accepted the next token comes from ``p_k``. Every emitted
  token is then distributed exactly as ``p`` (the target's sampling distribution).
  The acceptance and the residual draw are coupled through one draw: row j draws
  ``t_j ~ p_j`` with the request's generator exactly as a plain decode step at
  that position would (`SampledRows`, one uniform per emitted token), and ``d[j]`` is
  accepted iff ``t_j == d[j]`` (probability ``p_j(d[j])``; given a rejection,
  ``t_j`` follows the residual). So the emitted tokens are the ones speculation off
  draws with the same seed, whatever was drafted: drafts depend on the batch (other
  requests' outputs in the n-gram index, the step's draft budget, the adaptive
  switch), and the same seed still gives the same output whatever the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from arborlm.constrained.base import allocate_vocab_mask, apply_vocab_mask
from arborlm.runtime.sampling import (
    SamplingBatchInfo,
    apply_logit_bias,
    apply_min_new_tokens,
    apply_penalties,
    compute_logprobs,
    invalid_logit_rows,
    make_generator,
    row_max,
)
from arborlm.runtime.sampling_filters import SampledRows, draw_uniforms
from arborlm.runtime.schedule_batch import Req


@dataclass
class VerifyOutput:
    """What one verify step produced, per request of the step (all of them sample).

    token_ids: the emitted tokens of every request, concatenated
        (``accept_lens[i]`` of them for request i: its accepted drafts + one).
    accept_lens: tokens emitted per request, >= 1 (1 when its draft was empty,
        wholly rejected, or its row was invalid).
    logprobs: per emitted token, (logprob, token id, top alternatives) when its
        request asked for logprobs, else None (the logprob is the target's, at
        temperature 1 after penalties and masks, as the sampler reports it).
    invalid_rows: requests whose first row was not finite (aborted by the scheduler).
    draw_states: per request, for a sampled request with a grammar, its generator's state
        after each of its draws (one per emitted token), else None: when a token forces a
        jump, the scheduler keeps the tokens up to it and rewinds the generator to the
        state after their draws, as if the rest had not been drawn (speculation off draws
        nothing for the forced tokens that replace them).
    """

    token_ids: list[int]
    accept_lens: list[int]
    logprobs: list[tuple[float, int, list[tuple[float, int]]] | None]
    invalid_rows: tuple[int, ...]
    draw_states: list[list[torch.Tensor] | None]


def _takes(grammar, token_id: int) -> bool:
    """Whether ``grammar`` accepts ``token_id`` now; the matcher is left as it was."""
    if not grammar.accept_token(token_id):
        return False
    grammar.rollback(1)
    return True


def accept_greedy(draft: list[int], targets: list[int], first_invalid: int | None = None) -> int:
    """Tokens to emit of ``targets`` (len(draft) + 1 of them): the longest prefix of the
    draft that equals the targets, plus the target after it.

    ``first_invalid``: the first row whose logits were not finite; emission stops
    before it (at least one token is always counted; the caller aborts on row 0).
    """
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    emitted = n + 1
    if first_invalid is not None:
        emitted = min(emitted, max(first_invalid, 1))
    return emitted


def rejection_sample(draft: list[int], draw: Callable[[int, torch.Tensor], int], generator: torch.Generator,
                     states: list[torch.Tensor] | None = None) -> list[int]:
    """Tokens emitted for one sampled request (see the module docstring).

    Parameters
    ----------
    draft: the k draft tokens (a point-mass proposal each).
    draw: ``draw(j, u)``, the token chain row j (0..k) takes for the uniform ``u`` ((1,)
        float64), or -1 where that row cannot be drawn from: what the sampler of a plain
        decode step would draw there (`SampledRows.draw`).
    generator: the request's generator; it advances by one uniform per row drawn
        (`draw_uniforms`), as plain decode steps emitting those tokens would.
    states: when given, the generator's state after each draw is appended to it
        (`torch.Generator.get_state`, a few KB each).

    Returns
    -------
    list[int]
        The accepted draft tokens, then the first draw that differs from its draft token
        (a rejection) or the draw after the last one (all accepted): 1 to k + 1 tokens;
        fewer (none at all) when a row cannot be drawn from, ending before it.
    """
    out: list[int] = []
    for j in range(len(draft) + 1):
        token_id = draw(j, draw_uniforms([generator]))
        if token_id < 0:
            break
        out.append(token_id)
        if states is not None:
            states.append(generator.get_state())
        if j == len(draft) or token_id != draft[j]:
            break
    return out


class DraftVerifier:
    """Target tokens at each draft position and their acceptance (see the module docstring).

    Parameters
    ----------
    vocab_size: the model's vocabulary (logits width).
    eos_ids: a request's EOS ids for ``min_new_tokens`` masking (the worker's rule).
    native: penalties and draws in the native CPU sampler where it applies (as `Sampler`).
    """

    def __init__(self, vocab_size: int, eos_ids: Callable[[Req], list[int]], native: bool = True):
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.native = native

    def verify(self, reqs: list[Req], drafts: list[list[int]], full_logits: torch.Tensor) -> VerifyOutput:
        """Process every chain row as a decode step would, then accept per request.

        Parameters
        ----------
        reqs: the step's requests, in row order.
        drafts: per request, its draft tokens.
        full_logits: (sum(1 + len(d)), V) float32, the chain rows of each request in turn;
            processed in place (masks, penalties), as `ModelWorker.sample` does with a decode
            step's logits: at 8 requests of 7 rows a copy was 11 MB a step.

        Raises
        ------
        ValueError: ``full_logits`` has not one row per chain token.
        RuntimeError: a grammar rejects a draft token (the scheduler cuts drafts before one).
        """
        num_rows = sum(len(d) + 1 for d in drafts)
        if full_logits is None or full_logits.shape[0] != num_rows:
            raise ValueError(f"full_logits: one row per chain token ({num_rows}) is needed, got "
                             f"{None if full_logits is None else tuple(full_logits.shape)}")
        logits = full_logits.float()
        # Greedy constrained chains without logprobs check their targets against the matcher
        # instead of masking every row first (`_check_greedy_targets`).
        lazy = [req.grammar is not None and req.sampling_params.is_greedy and not req.return_logprob
                for req in reqs]
        self._apply_grammar_masks(reqs, drafts, logits, skip=lazy)
        row_reqs = [req for req, d in zip(reqs, drafts) for _ in range(len(d) + 1)]
        info = self._batch_info(row_reqs, logits.device)
        logits = self._process_logits(logits, info, row_reqs, reqs, drafts)
        maxima, argmax_ids = row_max(logits, self.native)
        if any(lazy):
            self._check_greedy_targets(reqs, drafts, lazy, logits, maxima, argmax_ids, self.native)
        invalid = set(invalid_logit_rows(logits, maxima))
        argmax = argmax_ids.tolist()
        sampled = None if info.all_greedy else SampledRows(self._finite_rows(logits, invalid), info, self.native)
        emitted_ids: list[int] = []
        emitted_rows: list[int] = []
        accept_lens: list[int] = []
        draw_states: list[list[torch.Tensor] | None] = []
        invalid_reqs = []
        offset = 0
        for i, (req, d) in enumerate(zip(reqs, drafts)):
            rows = range(offset, offset + len(d) + 1)
            bad = [j for j, r in enumerate(rows) if r in invalid]
            states = None
            if bad and bad[0] == 0:
                invalid_reqs.append(i)
                tokens = [argmax[offset]]  # meaningless: the scheduler aborts the request
            elif req.sampling_params.is_greedy:
                targets = argmax[offset : offset + len(d) + 1]
                tokens = targets[: accept_greedy(d, targets, bad[0] if bad else None)]
            else:
                usable = bad[0] if bad else len(d) + 1  # rows before the first invalid one
                states = [] if req.grammar is not None else None
                tokens = rejection_sample(d[: usable - 1], lambda j, u, first=offset: sampled.draw([first + j], u)[0],
                                          req.generator, states)
                if not tokens:  # its first row cannot be drawn from
                    invalid_reqs.append(i)
                    tokens = [argmax[offset]]  # meaningless: the scheduler aborts the request
            draw_states.append(states)
            emitted_ids.extend(tokens)
            emitted_rows.extend(range(offset, offset + len(tokens)))
            accept_lens.append(len(tokens))
            offset += len(d) + 1
        logprobs = self._logprobs(row_reqs, logits, emitted_rows, emitted_ids)
        return VerifyOutput(emitted_ids, accept_lens, logprobs, tuple(invalid_reqs), draw_states)

    def _apply_grammar_masks(self, reqs: list[Req], drafts: list[list[int]], logits: torch.Tensor,
                             skip: list[bool] | None = None) -> None:
        """Mask row j of each constrained chain by its matcher after ``d[:j]``, then roll back
        (chains whose ``skip`` is True are left to `_check_greedy_targets`).

        The scheduler cut each draft before the first token its matcher rejects
        or that ends the grammar, so every ``accept_token`` here succeeds.
        """
        rows, offset = [], 0
        mask = None
        skip = skip or [False] * len(reqs)
        for req, d, skipped in zip(reqs, drafts, skip):
            if req.grammar is not None and not skipped:
                if mask is None:
                    mask = allocate_vocab_mask(logits.shape[0], logits.shape[-1])
                accepted = 0
                for j in range(len(d) + 1):
                    req.grammar.fill_vocab_mask(mask, offset + j)
                    rows.append(offset + j)
                    if j < len(d):
                        if not req.grammar.accept_token(d[j]):
                            req.grammar.rollback(accepted)
                            raise RuntimeError(f"request {req.rid}: the grammar rejected draft token {d[j]}")
                        accepted += 1
                req.grammar.rollback(accepted)
            offset += len(d) + 1
        if mask is not None:
            apply_vocab_mask(logits, mask, rows)

    @staticmethod
    def _check_greedy_targets(reqs: list[Req], drafts: list[list[int]], lazy: list[bool], logits: torch.Tensor,
                              maxima: torch.Tensor, argmax_ids: torch.Tensor, native: bool = True) -> None:
        """The greedy targets of the ``lazy`` chains (constrained, greedy, no logprobs) as if their
        rows had been masked, updating ``logits``, ``maxima`` and ``argmax_ids`` in place
        (``native``: a masked row's maximum by the native sampler, as `row_max`).

        Row j's unmasked argmax is its masked argmax whenever the matcher after ``d[:j]``
        accepts it: it is the row's first maximum and stays one when the other tokens are
        set to -inf (the penalties, logit bias and min_new_tokens the rows went through map
        -inf to -inf, so masking after them is masking before). Only a rejected target or
        a row without a finite maximum is masked and searched again. That is a token check
        (microseconds) where a mask fills a word per 32 tokens of the vocabulary for every
        row (0.3-1.7 ms a step in bench_spec's json runs); llama.cpp samples before it masks
        for the same reason. Rows after a chain's first target that differs from its draft
        do not change a greedy answer and are left unmasked. The matchers end as they began.

        Raises
        ------
        RuntimeError: a grammar rejects a draft token (the scheduler cuts drafts before one).
        """
        mask = None
        offset = 0
        for req, d, is_lazy in zip(reqs, drafts, lazy):
            if is_lazy:
                grammar, accepted = req.grammar, 0
                try:
                    for j in range(len(d) + 1):
                        row = offset + j
                        target = int(argmax_ids[row])
                        if not (math.isfinite(float(maxima[row])) and _takes(grammar, target)):
                            if mask is None:
                                mask = allocate_vocab_mask(logits.shape[0], logits.shape[-1])
                            grammar.fill_vocab_mask(mask, row)
                            apply_vocab_mask(logits, mask, [row])
                            row_maxima, row_argmax = row_max(logits[row : row + 1], native)
                            maxima[row], argmax_ids[row] = row_maxima[0], row_argmax[0]
                            target = int(row_argmax[0])
                        if j == len(d) or target != d[j]:
                            break
                        if not grammar.accept_token(d[j]):
                            raise RuntimeError(f"request {req.rid}: the grammar rejected draft token {d[j]}")
                        accepted += 1
                finally:
                    grammar.rollback(accepted)
            offset += len(d) + 1

    def _batch_info(self, row_reqs: list[Req], device: torch.device) -> SamplingBatchInfo:
        for req in row_reqs:
            if req.generator is None:
                req.generator = make_generator(req.seed, device)
        return SamplingBatchInfo.from_params(
            [r.sampling_params for r in row_reqs], [r.seed for r in row_reqs], self.vocab_size, device,
            [r.generator for r in row_reqs],
        )

    def _process_logits(self, logits: torch.Tensor, info: SamplingBatchInfo, row_reqs: list[Req],
                        reqs: list[Req], drafts: list[list[int]]) -> torch.Tensor:
        """Penalties, logit bias and min_new_tokens per row, in the sampler's order (in place).
        Row j of a chain sees its request's output followed by the draft's first j tokens."""
        if not (info.need_repetition_penalty or info.need_frequency_presence_penalty or info.need_logit_bias
                or info.need_min_new_tokens):
            return logits
        outputs = [req.output_ids + d[:j] for req, d in zip(reqs, drafts) for j in range(len(d) + 1)]
        if info.need_repetition_penalty or info.need_frequency_presence_penalty:
            prompts = [r.prompt_id_array() for r in row_reqs] if info.need_repetition_penalty else None
            apply_penalties(logits, info, outputs, prompts, native=self.native)
        if info.need_logit_bias:
            apply_logit_bias(logits, info)
        if info.need_min_new_tokens:
            apply_min_new_tokens(logits, info, [self.eos_ids(r) for r in row_reqs], [len(o) for o in outputs])
        return logits

    @staticmethod
    def _finite_rows(logits: torch.Tensor, invalid: set[int]) -> torch.Tensor:
        """``logits`` with the `invalid` rows zeroed (on a copy when there are any), so that no
        row's sampling sees another's NaN or inf."""
        if not invalid:
            return logits
        safe = logits.clone()
        safe[list(invalid)] = 0.0
        return safe

    @staticmethod
    def _logprobs(row_reqs: list[Req], logits: torch.Tensor, rows: list[int], token_ids: list[int]):
        wanted = [r for r in rows if row_reqs[r].return_logprob]
        if not wanted:
            return [None] * len(rows)
        top_n = max(row_reqs[r].top_logprobs_num for r in wanted)
        index = {r: i for i, r in enumerate(wanted)}
        ids = torch.tensor([t for r, t in zip(rows, token_ids) if row_reqs[r].return_logprob])
        lp = compute_logprobs(logits[wanted], ids, top_n)
        out = []
        for r, t in zip(rows, token_ids):
            req = row_reqs[r]
            if not req.return_logprob:
                out.append(None)
                continue
            i = index[r]
            top = lp.top_pairs(i, req.top_logprobs_num) if req.top_logprobs_num else []
            out.append((float(lp.logprobs[i]), t, top))
        return out
