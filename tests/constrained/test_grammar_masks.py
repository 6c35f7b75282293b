"""GrammarMasker.apply_grammar_masks (the model worker's): the bitmask kept between steps is reset each step."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from arborlm.constrained.base import GrammarMatcher
from arborlm.runtime.model_worker import GrammarMasker

VOCAB = 100  # 4 words per row, the last one partly padding


class ForbidOnly(GrammarMatcher):
    """Clears only the bits of ``forbidden`` (relies on a row that starts all allowed)."""

    def __init__(self, *forbidden: int):
        self.forbidden = forbidden

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        for token_id in self.forbidden:
            vocab_mask[row, token_id // 32] &= ~(1 << (token_id % 32))

    def accept_token(self, token_id: int) -> bool:
        return True

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def find_jump_forward_string(self) -> str:
        return ""


def processor() -> GrammarMasker:
    return GrammarMasker()


def masked(proc: GrammarMasker, grammars: list) -> list[set[int]]:
    """The token ids masked to -inf per row after one step with requests of these grammars."""
    logits = torch.zeros(len(grammars), VOCAB)
    proc.apply_grammar_masks([SimpleNamespace(grammar=g) for g in grammars], logits)
    return [set(torch.nonzero(row == float("-inf")).flatten().tolist()) for row in logits]


def test_no_bit_leaks_from_the_previous_step():
    proc = processor()
    assert masked(proc, [ForbidOnly(5), ForbidOnly(40, 99)]) == [{5}, {40, 99}]
    assert masked(proc, [ForbidOnly(7), None]) == [{7}, set()]  # row 0 is another request's now
    assert masked(proc, [None, ForbidOnly()]) == [set(), set()]  # 40 and 99 were row 1's last step
    assert len(proc.mask_fill_seconds) == 4  # one per constrained request and step


def test_the_bitmask_is_kept_and_grows_with_the_batch():
    proc = processor()
    masked(proc, [ForbidOnly(1), ForbidOnly(2)])
    kept = proc._vocab_mask
    assert masked(proc, [ForbidOnly(3)]) == [{3}]
    assert proc._vocab_mask is kept  # a smaller batch reuses it
    assert masked(proc, [ForbidOnly(4), ForbidOnly(), ForbidOnly(70)]) == [{4}, set(), {70}]
    assert proc._vocab_mask.shape == (3, (VOCAB + 31) // 32)
