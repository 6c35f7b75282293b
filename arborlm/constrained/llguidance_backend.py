"""The llguidance grammar backend (JSON schema, any JSON, regex, Lark / EBNF, structural tags).

llguidance (guidance-ai; vLLM's default structured-output engine) compiles
every constraint into a lexer of derivative-based regexes under an Earley
parser and computes each step's token mask by walking the tokenizer's trie
(``LLMatcher``); a grammar is ready in milliseconds, with no per-tokenizer
precomputation. The front calls `LLGuidanceBackend.check` (llguidance's own
grammar check, no tokenizer) before a request is queued; the grammar worker
thread calls `compile`; the scheduler drives one `LLGuidanceMatcher` per
constrained request. The grammar texts are built by `llguidance_grammar`.

A JSON schema arrives as written (`LLGUIDANCE_POLICY`): llguidance enforces
JSON Schema keyword by keyword and refuses, naming them, the keywords it does
not implement (unless the request is ``json_schema_lenient``); the finished
output is still validated against the whole schema in the front.

Contracts kept as in the other backends:

- Special tokens are never text: llguidance's tokenizer keeps them apart from
  the byte trie, so no grammar's text can contain them; EOS is allowed only
  where the grammar may end, and a request's own ``stop_token_ids`` exactly
  there too (accepting one ends the grammar as EOS would).
- A rejected token leaves the matcher as it was: llguidance's ``consume_token``
  would put the matcher in a permanent error state, so each token is checked
  with ``validate_tokens`` first.
- Rollback is unbounded (llguidance keeps the whole parse), an accepted EOS
  included (tracked here: the EOS is never fed to llguidance).

After SGLang's ``sglang/srt/constrained/llguidance_backend.py`` and vLLM's
``vllm/v1/structured_output/backend_guidance.py``; the API is llguidance's
(``LLTokenizer``, ``LLMatcher``, ``llguidance.torch.fill_next_token_bitmask``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import llguidance
import llguidance.hf
import torch

from arborlm.constrained.base import CompiledGrammar, GrammarBackend, GrammarKey, GrammarMatcher
from arborlm.constrained.json_schema import LLGUIDANCE_POLICY
from arborlm.constrained.llguidance_grammar import build_grammar, grammar_error, validate

logger = logging.getLogger(__name__)


class LLGuidanceMatcher(GrammarMatcher):
    """One request's state over an `LLGuidanceGrammar`: an ``llguidance.LLMatcher`` plus the stop ids.

    ``stop_token_ids``: the request's own stop ids, allowed exactly where EOS
    is (where the grammar may end) and, once accepted, ending the grammar as
    EOS does. Not thread-safe; lives in the scheduler thread.
    """

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int], stop_token_ids: Sequence[int]):
        self._matcher = matcher
        self._eos_token_ids = eos_token_ids
        self._request_stop_ids = tuple(sorted(set(stop_token_ids) - eos_token_ids))
        self._terminated = False  # a stop token was accepted

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens into ``vocab_mask[row]``.

        vocab_mask: (batch, ceil(vocab_size / 32)) int32, contiguous, on the CPU.
        Once terminated (or in llguidance's error state, logged) only the
        EOS ids are allowed, so a step taken too late samples a stop token.
        """
        mask_row = vocab_mask[row]
        if self._terminated or self._matcher.is_error():
            if self._matcher.is_error():
                logger.warning("llguidance matcher in error state: %s", self._matcher.get_error())
            _allow_only(mask_row, self._eos_token_ids)
            return
        self._matcher.unsafe_compute_mask_ptr(mask_row.data_ptr(), mask_row.numel() * mask_row.element_size())
        if self._request_stop_ids:
            _set_bits(mask_row, self._request_stop_ids, self._matcher.is_accepting())

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) when the grammar rejects it or has terminated."""
        if self._terminated or self._matcher.is_error():
            return False
        if token_id in self._eos_token_ids or token_id in self._request_stop_ids:
            # Tracked here, not fed to llguidance: its rollback of an EOS taken in a stopped
            # state (nothing can follow) undoes the token before it instead.
            self._terminated = self._matcher.is_accepting()
            return self._terminated
        if self._matcher.validate_tokens([token_id]) != 1:
            return False
        return self._matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (an accepted stop token included).

        Raises
        ------
        RuntimeError
            llguidance could not roll back that far (more tokens than were accepted: a caller bug).
        """
        if num_tokens > 0 and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens > 0 and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def is_terminated(self) -> bool:
        """True after an accepted stop token.

        A state from which nothing can follow is not terminated: its mask
        allows only EOS, which the next step samples, as on the other backends.
        """
        return self._terminated

    def find_jump_forward_string(self) -> str:
        """The text every continuation must start with ("" when none or terminated).

        llguidance's forced bytes, a UTF-8 character cut at the end left out.
        """
        if self._terminated or self._matcher.is_error() or self._matcher.is_stopped():
            return ""
        return _decode_complete_utf8(self._matcher.compute_ff_bytes())


class LLGuidanceGrammar(CompiledGrammar):
    """A checked llguidance grammar and a matcher at its start, which new matchers copy."""

    def __init__(self, grammar: str, start: llguidance.LLMatcher, eos_token_ids: frozenset[int]):
        self.grammar = grammar
        self._start = start
        self._eos_token_ids = eos_token_ids

    def new_matcher(self, stop_token_ids: Sequence[int] = ()) -> LLGuidanceMatcher:
        """A matcher at the start; ``stop_token_ids``: the request's own stop ids (see `LLGuidanceMatcher`)."""
        return LLGuidanceMatcher(self._start.deep_copy(), self._eos_token_ids, stop_token_ids)


class LLGuidanceBackend(GrammarBackend):
    """Compiles grammars with llguidance for one Hugging Face tokenizer.

    Parameters
    ----------
    tokenizer:
        The Hugging Face tokenizer (a fast one: llguidance reads its ``tokenizer.json``).
    vocab_size:
        Rows of the model's logits (may exceed ``len(tokenizer)``; the extra
        ids are never allowed).
    eos_token_ids:
        Every id that ends a request (at least one): allowed only where the
        grammar may end, and the only tokens allowed once it has.

    Raises
    ------
    ValueError
        No EOS id, or a tokenizer llguidance cannot read (a slow one).
    """

    name = "llguidance"
    kinds = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
    schema_policy = LLGUIDANCE_POLICY

    # Compiles take milliseconds and llguidance bounds its own work (lexer fuel, parser items),
    # so a compile worker process costs more than it protects; `compile_serialized` still works.
    compile_in_worker_by_default = False

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        if not eos_token_ids:
            raise ValueError("the llguidance grammar backend needs at least one EOS token id")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))

    @classmethod
    def _check_syntax(cls, key: GrammarKey) -> None:
        """llguidance's check of ``key``'s grammar without the tokenizer (about a millisecond).

        Raises
        ------
        GrammarError
            The text does not parse or uses what llguidance does not implement; ``param`` = ``key.param``.
        """
        validate(key, build_grammar(key))

    def compile(self, key: GrammarKey) -> LLGuidanceGrammar:
        """``key``'s grammar, checked against the tokenizer, with a start matcher (milliseconds).

        Raises
        ------
        GrammarError
            Unsupported kind, a grammar llguidance rejects, or one whose start state is already an error.
        """
        if key.kind not in self.kinds:
            self.check(key)  # raises the unsupported-kind error
        return self.load_compiled(key, self.compile_serialized(key))

    def compile_serialized(self, key: GrammarKey) -> str:
        """`compile`'s checked grammar text (the payload a compile worker ships; a few KB).

        Raises
        ------
        GrammarError
            As `compile`.
        """
        grammar = build_grammar(key)
        validate(key, grammar, self.tokenizer)
        return grammar

    def load_compiled(self, key: GrammarKey, payload: str) -> LLGuidanceGrammar:
        """The grammar of a `compile_serialized` text, with its start matcher built here.

        Raises
        ------
        GrammarError
            llguidance's matcher is in error at the start (a grammar too large for its limits).
        """
        start = llguidance.LLMatcher(self.tokenizer, payload, log_level=0)
        if start.is_error():
            raise grammar_error(key, start.get_error())
        return LLGuidanceGrammar(payload, start, self.eos_token_ids)


def _allow_only(mask_row: torch.Tensor, token_ids) -> None:
    """Set ``mask_row`` (ceil(V / 32) int32) so that only ``token_ids`` are allowed."""
    mask_row.zero_()
    _set_bits(mask_row, token_ids, True)


def _set_bits(mask_row: torch.Tensor, token_ids, allowed: bool) -> None:
    """Set (``allowed``) or clear the bits of ``token_ids`` in one int32 mask row (ids past it are skipped)."""
    for token_id in token_ids:
        if token_id >= mask_row.numel() * 32:
            continue
        word, bit = int(mask_row[token_id // 32]), 1 << (token_id % 32)
        word = ((word | bit) if allowed else (word & ~bit)) & 0xFFFFFFFF
        mask_row[token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word


def _decode_complete_utf8(data: bytes) -> str:
    """``data`` as text, leaving out a UTF-8 character cut at the end."""
    for cut in range(4):
        try:
            return data[: len(data) - cut].decode()
        except UnicodeDecodeError:
            continue
    return data.decode(errors="replace")

