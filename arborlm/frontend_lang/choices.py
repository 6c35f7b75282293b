"""How `select` turns per-choice log probabilities into a decision.

Each method gets, per choice, the log probabilities of the choice's tokens
given the program text (``input_token_logprobs``: ``(logprob, token_id, text)``
triples) and their token-length-normalised mean, and returns the decision plus
the scores it used, which `select` stores as the variable's meta info.

The three methods and their names are SGLang's (``sglang/lang/choices.py``):

- `token_length_normalized` (default): the highest mean log probability per token.
- `greedy_token_selection`: compare choices token by token, keeping those with the
  highest log probability at each position; a shorter choice is padded with its mean.
- `unconditional_likelihood_normalized`: the highest mean of
  ``logprob(token | program) - logprob(token | choice prefix alone)``, which
  discounts choices that are likely whatever the question.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

LogprobTriple = tuple  # (logprob | None, token_id, token text | None)


@dataclass
class ChoicesDecision:
    """The chosen string and the scores behind it."""

    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoicesSamplingMethod(ABC):
    """A rule that picks one choice from its token log probabilities."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        """Whether `select` must also score each choice's tokens without the program text."""
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[LogprobTriple]],
        output_token_logprobs: list[list[LogprobTriple]],
        unconditional_token_logprobs: list[list[LogprobTriple]] | None = None,
    ) -> ChoicesDecision:
        """Pick one of `choices`; list i of every argument belongs to `choices[i]`."""


def _argmax(values: list[float]) -> int:
    """Index of the largest value; the first on ties."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _base_meta(normalized, input_lps, output_lps) -> dict[str, Any]:
    return {
        "normalized_prompt_logprobs": normalized,
        "input_token_logprobs": input_lps,
        "output_token_logprobs": output_lps,
    }


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean log probability per token."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], _base_meta(normalized_prompt_logprobs, input_token_logprobs,
                                                         output_token_logprobs))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token-by-token elimination: at each position keep the choices with the highest log probability.

    A choice shorter than the longest is padded with its own mean log
    probability, so a choice that is a prefix of a longer one competes on equal terms.
    """

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        width = max(len(lps) for lps in input_token_logprobs)
        matrix = []
        for lps in input_token_logprobs:
            row = [lp[0] for lp in lps]
            mean = sum(row) / len(row)
            matrix.append(row + [mean] * (width - len(row)))
        remaining = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[remaining[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The highest mean of conditional minus unconditional token log probabilities.

    The unconditional log probability of a choice's first token has no context
    (None); it counts as 0.
    """

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional token logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs, strict=True):
            diffs = [c[0] - (u[0] or 0.0) for c, u in zip(cond, uncond, strict=True)]
            scores.append(sum(diffs) / len(diffs))
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[_argmax(scores)], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
