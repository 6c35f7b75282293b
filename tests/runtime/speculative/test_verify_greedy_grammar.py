"""Greedy constrained verification checks each target against the matcher and masks a row only
when the matcher rejects it (`DraftVerifier._check_greedy_targets`): its emitted tokens must be
those of masking every row first (the path a request asking for logprobs takes), whatever the
logits, penalties and drafts, and every matcher must end as it began."""

from __future__ import annotations

import random

import pytest
import torch

from arborlm.runtime.schedule_batch import Req
from arborlm.runtime.speculative.verify import DraftVerifier
from arborlm.sampling_params import SamplingParams
from tests.runtime.speculative.fake_matchers import HistoryMatcher

VOCAB = 64


class StateMatcher(HistoryMatcher):
    """A grammar over states 0..: state s allows the tokens of ``allowed()`` (random, from its
    seed), and each accepted token moves to state s + 1; token 2 ends it."""

    def __init__(self, seed: int):
        super().__init__()
        self.seed, self.masks_filled = seed, 0

    def allowed(self) -> set[int]:
        rng = random.Random(self.seed * 1000 + len(self.history))
        return set(rng.sample(range(3, VOCAB), 12)) | ({2} if len(self.history) >= 3 else set())

    def allows(self, t: int) -> bool:
        return t in self.allowed()

    def ends(self, t: int) -> bool:
        return t == 2

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        self.masks_filled += 1
        words = torch.zeros(mask.shape[1], dtype=torch.int64)
        for t in self.allowed():
            words[t // 32] |= 1 << (t % 32)
        mask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words.tolist()], dtype=torch.int32)


def _reqs(seed: int, n: int, logprobs: bool, **sampling) -> list[Req]:
    params = SamplingParams(temperature=0.0, **sampling).normalized()
    params.verify(VOCAB)
    reqs = []
    for i in range(n):
        req = Req(rid=f"r{i}", origin_input_ids=[5, 6, 7], sampling_params=params, seed=i)
        req.output_ids = [9, 10]
        req.grammar = StateMatcher(seed * 10 + i)
        req.return_logprob = logprobs
        reqs.append(req)
    return reqs


def _draft(matcher: StateMatcher, rng: random.Random, logits: torch.Tensor) -> list[int]:
    """A grammatical draft: each token the masked argmax (accepted) or another allowed token."""
    draft = []
    for j in range(rng.randint(0, 6)):
        allowed = sorted(matcher.allowed() - {2})
        row = logits[j].clone()
        best = max(allowed, key=lambda t: (float(row[t]), -t))
        token = best if rng.random() < 0.7 else rng.choice(allowed)
        matcher.accept_token(token)
        draft.append(token)
    matcher.rollback(len(draft))
    return draft


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("sampling", [{}, {"repetition_penalty": 1.3, "frequency_penalty": 0.5}])
def test_checked_targets_equal_masked_ones(seed, sampling):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lazy, full = _reqs(seed, 3, False, **sampling), _reqs(seed, 3, True, **sampling)
    chains = [torch.randn(7, VOCAB, generator=gen) * 3 for _ in lazy]
    if seed % 5 == 0:
        chains[0][0, 20] = float("nan")  # a poisoned row outside what the grammar allows
    drafts = [_draft(req.grammar, rng, chain) for req, chain in zip(lazy, chains)]
    logits = torch.cat([chain[: len(d) + 1] for chain, d in zip(chains, drafts)])
    verifier = DraftVerifier(VOCAB, lambda req: [2])
    got = verifier.verify(lazy, drafts, logits.clone())
    want = verifier.verify(full, drafts, logits.clone())
    assert (got.token_ids, got.accept_lens, got.invalid_rows) == (want.token_ids, want.accept_lens, want.invalid_rows)
    assert all(req.grammar.history == [] for req in lazy + full)
    # Masks are filled only where a target was rejected, never more often than by masking every row.
    assert sum(r.grammar.masks_filled for r in lazy) <= sum(r.grammar.masks_filled for r in full)
