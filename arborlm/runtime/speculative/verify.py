"""Verify drafts in one step: the target's token at every draft position, then greedy acceptance.

The scheduler ran each request's last token and its draft ``d`` (k tokens) as
one extend chain of ``1 + k`` tokens over its paged KV (the causal mask of the
ordinary extend kernels is exactly a chain's verify mask), with logits at
every position. Row ``j`` of a request's chain scores the token after
``d[:j]``; the target token ``t[j]`` is what the sampler would have picked
there in a plain decode step: the same grammar mask (the matcher advanced over
``d[:j]``, then rolled back), the same penalties and ``min_new_tokens`` (over
``output_ids + d[:j]``), the same argmax. Greedy acceptance (Leviathan et al.
2023, Chen et al. 2023) keeps ``t[0..n]`` where ``n`` is the longest prefix
with ``d[:n] == t[:n]``: the output equals speculation off, token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from arborlm.constrained.base import allocate_vocab_mask, apply_vocab_mask
from arborlm.runtime.sampling import Sampler, SamplingBatchInfo, make_generator
from arborlm.runtime.schedule_batch import Req


@dataclass
class VerifyOutput:
    """What one verify step produced, per request of the step (all of them sample).

    token_ids: the emitted tokens of every request, concatenated
        (``accept_lens[i]`` of them for request i: its accepted drafts + one).
    accept_lens: tokens emitted per request, >= 1 (1 when its draft was empty,
        wholly rejected, or its row was invalid).
    logprobs: per emitted token, (logprob, token id, top alternatives) when its
        request asked for logprobs, else None.
    invalid_rows: requests whose first row was not finite (aborted by the scheduler).
    """

    token_ids: list[int]
    accept_lens: list[int]
    logprobs: list[tuple[float, int, list[tuple[float, int]]] | None]
    invalid_rows: tuple[int, ...]


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


class DraftVerifier:
    """Target tokens at each draft position and greedy acceptance (see the module docstring).

    Parameters
    ----------
    sampler: the worker's sampler (the target's own choice rules).
    vocab_size: the model's vocabulary (logits width).
    eos_ids: a request's EOS ids for ``min_new_tokens`` masking (the worker's rule).
    """

    def __init__(self, sampler: Sampler, vocab_size: int, eos_ids: Callable[[Req], list[int]]):
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def verify(self, reqs: list[Req], drafts: list[list[int]], full_logits: torch.Tensor) -> VerifyOutput:
        """Pick the target token at every row and accept greedily.

        Parameters
        ----------
        reqs: the step's requests, in row order.
        drafts: per request, its draft tokens (greedy requests only may have any).
        full_logits: (sum(1 + len(d)), V) float32, the chain rows of each request in turn.
        """
        rows = [len(d) + 1 for d in drafts]
        assert full_logits.shape[0] == sum(rows), "one logits row per chain token"
        logits = full_logits.float().clone()
        self._apply_grammar_masks(reqs, drafts, logits)
        row_reqs = [req for req, n in zip(reqs, rows) for _ in range(n)]
        virtual_outputs = [req.output_ids + d[:j] for req, d in zip(reqs, drafts) for j in range(len(d) + 1)]
        out = self._sample(row_reqs, virtual_outputs, logits)
        token_ids = out.next_token_ids.tolist()
        invalid = set(out.invalid_rows)
        emitted_ids: list[int] = []
        accept_lens: list[int] = []
        logprobs: list[tuple[float, int, list[tuple[float, int]]] | None] = []
        invalid_reqs = []
        offset = 0
        for i, (req, d) in enumerate(zip(reqs, drafts)):
            targets = token_ids[offset : offset + len(d) + 1]
            bad = [j for j in range(len(d) + 1) if offset + j in invalid]
            if bad and bad[0] == 0:
                invalid_reqs.append(i)
            n = accept_greedy(d, targets, bad[0] if bad else None)
            emitted_ids.extend(targets[:n])
            accept_lens.append(n)
            for j in range(n):
                logprobs.append(self._logprob(req, out, offset + j, targets[j]))
            offset += len(d) + 1
        return VerifyOutput(emitted_ids, accept_lens, logprobs, tuple(invalid_reqs))

    def _apply_grammar_masks(self, reqs: list[Req], drafts: list[list[int]], logits: torch.Tensor) -> None:
        """Mask row j of each constrained chain by its matcher after ``d[:j]``, then roll back.

        The scheduler cut each draft before the first token its matcher rejects
        or that ends the grammar, so every ``accept_token`` here succeeds.
        """
        rows, offset = [], 0
        mask = None
        for req, d in zip(reqs, drafts):
            if req.grammar is not None:
                if mask is None:
                    mask = allocate_vocab_mask(logits.shape[0], logits.shape[-1])
                accepted = 0
                for j in range(len(d) + 1):
                    req.grammar.fill_vocab_mask(mask, offset + j)
                    rows.append(offset + j)
                    if j < len(d):
                        if not req.grammar.accept_token(d[j]):
                            raise RuntimeError(f"request {req.rid}: the grammar rejected draft token {d[j]}")
                        accepted += 1
                req.grammar.rollback(accepted)
            offset += len(d) + 1
        if mask is not None:
            apply_vocab_mask(logits, mask, rows)

    def _sample(self, row_reqs: list[Req], outputs: list[list[int]], logits: torch.Tensor):
        """The sampler over every chain row, each with its request's params and the output
        it would have had there (penalties, min_new_tokens)."""
        for req in row_reqs:
            if req.generator is None:
                req.generator = make_generator(req.seed, logits.device)
        info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in row_reqs], [r.seed for r in row_reqs], self.vocab_size, logits.device,
            [r.generator for r in row_reqs],
        )
        return_logprob = any(r.return_logprob for r in row_reqs)
        top_n = max((r.top_logprobs_num for r in row_reqs if r.return_logprob), default=0)
        return self.sampler(
            logits,
            info,
            output_ids_list=outputs,
            prompt_ids_list=[r.origin_input_ids for r in row_reqs] if info.need_repetition_penalty else None,
            eos_ids_list=[self.eos_ids(r) for r in row_reqs] if info.need_min_new_tokens else None,
            top_logprobs_num=top_n,
            return_logprob=return_logprob,
        )

    @staticmethod
    def _logprob(req: Req, out, row: int, token_id: int) -> tuple[float, int, list[tuple[float, int]]] | None:
        if not req.return_logprob:
            return None
        top = out.top_logprobs.top_pairs(row, req.top_logprobs_num) if req.top_logprobs_num else []
        return float(out.logprobs[row]), token_id, top
