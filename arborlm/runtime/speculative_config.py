"""Speculative decoding's arguments (SGLang's names), one dataclass of `ServerArgs`.

Torch-free, like `runtime/config.py`, which composes it; the algorithms are in
`arborlm.runtime.speculative`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from arborlm.runtime.config_checks import check_field as _check
from arborlm.runtime.config_checks import check_types as _check_types

# SGLang's --speculative-algorithm names served here (see docs/speculative.md).
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
# Drafts longer than this cost more verify compute than they can win back on one chip.
MAX_SPECULATIVE_DRAFT_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (SGLang's argument names; see `arborlm.runtime.speculative`)."""

    speculative_algorithm: str | None = field(
        default=None, metadata={"help": "draft tokens and verify them in one step: NGRAM, or STANDALONE (a draft "
                                        "model, speculative_draft_model_path); off when unset"}
    )
    speculative_draft_model_path: str | None = field(
        default=None, metadata={"help": "STANDALONE: the draft model (HF folder or GGUF file) sharing the "
                                        "target's tokenizer"}
    )
    speculative_num_steps: int = field(
        default=3, metadata={"help": "STANDALONE: draft model decode steps (draft tokens) per verify step"}
    )
    speculative_num_draft_tokens: int = field(
        default=6, metadata={"help": "draft tokens verified per request and step"}
    )
    speculative_ngram_min_match_window_size: int = field(
        default=2, metadata={"help": "shortest suffix (tokens) an n-gram draft must match"}
    )
    speculative_ngram_max_match_window_size: int = field(
        default=4, metadata={"help": "longest suffix (tokens) an n-gram draft tries to match"}
    )
    speculative_ngram_capacity: int = field(
        default=200_000, metadata={"help": "n-grams kept in the cross-request index of recent outputs"}
    )
    speculative_disable_by_batch_size: int = field(
        default=16, metadata={"help": "no drafting while this many requests or more decode (0: never off)"}
    )
    speculative_adaptive: bool = field(
        default=True,
        metadata={"help": "cost-aware switch: a decode step drafts only the tokens that raise the expected "
                          "tokens per second, from measured step times and acceptance (off: every draft "
                          "found is verified, below speculative_disable_by_batch_size)"},
    )

    def __post_init__(self):
        _check_types(self)
        if self.speculative_algorithm is not None:
            _check(self.speculative_algorithm in SPECULATIVE_ALGORITHMS, "speculative_algorithm",
                   self.speculative_algorithm, f"one of {SPECULATIVE_ALGORITHMS} or None")
        standalone = self.speculative_algorithm == "STANDALONE"
        _check((self.speculative_draft_model_path is not None) == standalone, "speculative_draft_model_path",
               self.speculative_draft_model_path, "a draft model path with speculative_algorithm='STANDALONE', "
               "None otherwise")
        _check(1 <= self.speculative_num_steps <= MAX_SPECULATIVE_DRAFT_TOKENS, "speculative_num_steps",
               self.speculative_num_steps, f"1..{MAX_SPECULATIVE_DRAFT_TOKENS}")
        _check(1 <= self.speculative_num_draft_tokens <= MAX_SPECULATIVE_DRAFT_TOKENS,
               "speculative_num_draft_tokens", self.speculative_num_draft_tokens,
               f"1..{MAX_SPECULATIVE_DRAFT_TOKENS}")
        _check(self.speculative_ngram_min_match_window_size >= 1, "speculative_ngram_min_match_window_size",
               self.speculative_ngram_min_match_window_size, ">= 1")
        _check(self.speculative_ngram_max_match_window_size >= self.speculative_ngram_min_match_window_size,
               "speculative_ngram_max_match_window_size", self.speculative_ngram_max_match_window_size,
               ">= speculative_ngram_min_match_window_size")
        _check(self.speculative_ngram_max_match_window_size <= 32, "speculative_ngram_max_match_window_size",
               self.speculative_ngram_max_match_window_size, "<= 32")
        _check(self.speculative_ngram_capacity >= 0, "speculative_ngram_capacity",
               self.speculative_ngram_capacity, ">= 0")
        _check(self.speculative_disable_by_batch_size >= 0, "speculative_disable_by_batch_size",
               self.speculative_disable_by_batch_size, ">= 0 (0: never off)")
