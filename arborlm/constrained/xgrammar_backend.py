"""The xgrammar grammar backend (JSON schema, any JSON, regex, EBNF, structural tags): auto's first choice.

The front calls `XGrammarBackend.check` (a parse without the tokenizer) before a
request is queued; the grammar worker thread calls `compile`; the scheduler
drives one `XGrammarMatcher` per constrained request (fill its bitmask row,
accept the sampled token, jump forward).

A JSON schema arrives as its schema policy (`XGRAMMAR_POLICY`) wrote it:
normalised and lowered to the subset xgrammar enforces (`json_schema.lower`
lists what xgrammar 0.2.9 enforces and ignores).

JSON is generated with fixed separators (``", "`` and ``": "``, one line, as
``json.dumps`` writes it) so that a weak model cannot stall in free whitespace;
JSON inside structural tags gets at most `TAG_MAX_WHITESPACE` whitespace
characters per gap unless the tag says otherwise. Number literals have
bounded digits (`number_bounds`: what an int64 or a double needs), so that a
weak model cannot write digits until ``max_new_tokens``.

Special tokens are never text (`build_tokenizer_info`): xgrammar reads
``<|endoftext|>`` as 13 characters a JSON string may hold, and a model pushed
towards it (a ``logit_bias``) would fill the string with tokens the
detokenizer drops. Every EOS id is a stop token, allowed only where the
grammar may end; a request's own ``stop_token_ids`` are held back until then
too (`XGrammarMatcher`). In a ``regex``, ``.`` does not match a newline, as
in Python's ``re`` (`regex_constraint`).

A grammar that reaches a rule deriving no finite string (``root ::= "a" root``)
is refused when compiled: its output could never end, and xgrammar's
forced-text search would run until memory is exhausted. A grammar the analysis
cannot read compiles with jump-forward off (see `grammar_analysis`).

After SGLang's ``sglang/srt/constrained/xgrammar_backend.py``; the API is
xgrammar's (``xgr.Grammar``, ``xgr.GrammarCompiler``, ``xgr.GrammarMatcher``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from arborlm.constrained.base import (
    ANY_JSON,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarKey,
    GrammarMatcher,
)
from arborlm.constrained.grammar_analysis import UnknownGrammarSyntax, unproductive_reachable_rules
from arborlm.constrained.json_schema import XGRAMMAR_POLICY
from arborlm.constrained.number_bounds import bound_ebnf_digits
from arborlm.constrained.regex_constraint import RegexDialect, dot_as_class
from arborlm.constrained.structural_tags import from_legacy_structural_tag
from arborlm.constrained.vocab import special_token_ids

logger = logging.getLogger(__name__)

# The whitespace JSON may put between its tokens: json.dumps's default, on one line.
JSON_SEPARATORS = (", ", ": ")
# Longest run of whitespace allowed inside a structural tag's JSON (xgrammar's
# ``max_whitespace_cnt``) when the tag does not set one; unbounded by default there.
TAG_MAX_WHITESPACE = 4

_KIND_LABELS = {
    "json_schema": "JSON schema",
    "json_object": "JSON grammar",
    "regex": "regex",
    "ebnf": "EBNF grammar",
    "structural_tag": "structural tag",
}
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes
# "Check failed: (cond) is false: " or "Invalid structural tag error: ", and a JSON
# error ends by repeating the whole input; none of it helps a user.
_LOG_PREFIX = re.compile(
    r"^(?:\[\d\d:\d\d:\d\d\] \S+?:\d+: )?(?:Check failed: \(.*?\) is false: )?"
    r"(?:Invalid (?:structural tag|JSON) error: )?"
)
_INPUT_ECHO = re.compile(r"\s*The JSON string is:.*", re.DOTALL)
MAX_ERROR_CHARS = 500
# Largest compiled grammar (``memory_size_bytes``) a compile worker ships as JSON (about 0.1 MB of it).
MAX_SHIPPED_BYTES = 64 * 1024
# Rules named in a "can never finish" error; the rest are counted.
MAX_RULES_NAMED = 3


class XGrammarMatcher(GrammarMatcher):
    """One request's state over an xgrammar `CompiledGrammar`.

    Rollback is unbounded: xgrammar 0.2.9 deprecated ``max_rollback_tokens``
    (its Earley parser keeps the whole history), so none is passed.
    ``jump_forward=False`` (a grammar `grammar_analysis` could not read) makes
    `find_jump_forward_string` always return "".

    ``stop_token_ids``: the request's own stop ids. Those that are not the
    grammar's stop tokens are allowed exactly where an EOS is (where the
    grammar may end, and then whatever text they stand for), and accepting
    one ends the grammar as its EOS would.
    """

    def __init__(self, matcher: xgr.GrammarMatcher, jump_forward: bool = True, stop_token_ids: Sequence[int] = ()):
        self._matcher = matcher
        self._jump_forward = jump_forward
        self._eos_id = matcher.stop_token_ids[0]
        self._request_stop_ids = tuple(sorted(set(stop_token_ids) - set(matcher.stop_token_ids)))

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens into ``vocab_mask[row]``.

        vocab_mask: (batch, ceil(vocab_size / 32)) int32 on the CPU. Once the
        grammar has terminated only the stop tokens are allowed, so a caller
        that asks one step too late samples a stop token instead of NaNs.
        """
        if self._matcher.is_terminated():
            _allow_only(vocab_mask[row], self._matcher.stop_token_ids)
            return
        self._matcher.fill_next_token_bitmask(vocab_mask, row)
        if self._request_stop_ids:
            mask_row = vocab_mask[row]
            _set_bits(mask_row, self._request_stop_ids, _is_allowed(mask_row, self._eos_id))

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) when rejected or already terminated.

        A request stop id is taken as the grammar's EOS: accepted (and the
        grammar terminated) only where the grammar may end.
        """
        if self._matcher.is_terminated():
            return False  # xgrammar would log a warning for every such call
        if token_id in self._request_stop_ids:
            token_id = self._eos_id
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (stop token included).

        Raises
        ------
        RuntimeError
            ``num_tokens`` exceeds the number of accepted tokens (a caller bug).
        """
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def find_jump_forward_string(self) -> str:
        """The text every continuation must start with ("" when none, terminated or jump-forward is off)."""
        if not self._jump_forward or self._matcher.is_terminated():
            return ""
        return self._matcher.find_jump_forward_string()


class XGrammarCompiledGrammar(CompiledGrammar):
    """An ``xgr.CompiledGrammar`` (token masks precomputed for one tokenizer).

    ``jump_forward``: whether its matchers may search for forced text (False
    when the grammar could not be shown to always be able to finish).
    """

    def __init__(self, compiled: xgr.CompiledGrammar, jump_forward: bool = True):
        self.compiled = compiled
        self.jump_forward = jump_forward

    def new_matcher(self, stop_token_ids: Sequence[int] = ()) -> XGrammarMatcher:
        """A matcher at the start; ``stop_token_ids``: the request's own stop ids (see `XGrammarMatcher`)."""
        return XGrammarMatcher(xgr.GrammarMatcher(self.compiled), self.jump_forward, stop_token_ids)

    @property
    def memory_size_bytes(self) -> int:
        return self.compiled.memory_size_bytes


class XGrammarBackend(GrammarBackend):
    """Compiles grammars with xgrammar for one Hugging Face tokenizer.

    Parameters
    ----------
    tokenizer:
        The Hugging Face tokenizer the model was trained with.
    vocab_size:
        Rows of the model's logits (may exceed ``len(tokenizer)``; the extra
        ids are never allowed).
    eos_token_ids:
        Every id that ends a request (the model config's, the generation
        config's and the tokenizer's EOS): xgrammar's stop tokens, allowed
        only where the grammar may end and the only tokens allowed once it has.
    max_threads:
        Threads xgrammar uses inside one compile (token-mask precomputation).
    """

    name = "xgrammar"
    kinds = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
    schema_policy = XGRAMMAR_POLICY

    # Large compiled grammars serialize slowly (884 MB of JSON for one WashingtonPost schema),
    # so a worker would ship them only by compiling twice; by default compile once on a thread.
    compile_in_worker_by_default = False

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], *, max_threads: int | None = None):
        self.vocab_size = vocab_size
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, eos_token_ids)
        # GrammarManager caches compiled grammars (bounded); xgrammar's own cache
        # would be a second, unbounded one.
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads or min(8, os.cpu_count() or 1), cache_enabled=False
        )

    @classmethod
    def _check_syntax(cls, key: GrammarKey) -> None:
        """Parse ``key`` into an ``xgr.Grammar`` (sub-millisecond for typical grammars).

        Raises
        ------
        GrammarError
            The text does not parse, with xgrammar's reason, ``param`` = ``key.param``.
        """
        build_grammar(key)

    def compile(self, key: GrammarKey) -> XGrammarCompiledGrammar:
        """Compile ``key`` against the tokenizer (milliseconds to seconds).

        Raises
        ------
        GrammarError
            Unsupported kind, a grammar xgrammar rejects, a grammar whose output
            could never end, or a failure while compiling.
        """
        if key.kind not in self.kinds:
            self.check(key)  # raises the unsupported-kind error
        grammar = build_grammar(key)
        if key.kind in ("json_schema", "json_object", "structural_tag"):
            grammar = rewrite_json_grammar(grammar, bound_digits=key.kind != "structural_tag" and not key.lenient)
        jump_forward = can_always_finish(key, grammar)
        try:
            return XGrammarCompiledGrammar(self.compiler.compile_grammar(grammar), jump_forward)
        except Exception as e:
            raise _grammar_error(key, e) from e

    def compile_serialized(self, key: GrammarKey) -> tuple[str, bool] | None:
        """`compile` in a compile worker process; (xgrammar's JSON, jump_forward) for a small grammar, else None.

        xgrammar's JSON repeats its whole FSM per rule, so writing and reading
        it costs far more than compiling again for all but small grammars
        (SmolLM2, 49152 tokens: a 3.8 KB schema compiles in 15 ms, 0.05 MB of
        JSON, 2 + 5 ms; a Github_medium schema in 36 ms, 0.3 MB, 106 + 46 ms;
        WashingtonPost wp_17 in 5.7 s, 884 MB, 94 + 56 s). Above
        `MAX_SHIPPED_BYTES` compiled bytes the serving process compiles again (None).

        Raises
        ------
        GrammarError
            As `compile`.
        """
        compiled = self.compile(key)
        if compiled.memory_size_bytes > MAX_SHIPPED_BYTES:
            return None
        return compiled.compiled.serialize_json(), compiled.jump_forward

    def load_compiled(self, key: GrammarKey, payload: tuple[str, bool]) -> XGrammarCompiledGrammar:
        """The grammar of a `compile_serialized` payload, bound to this backend's tokenizer info."""
        text, jump_forward = payload
        return XGrammarCompiledGrammar(xgr.CompiledGrammar.deserialize_json(text, self.tokenizer_info), jump_forward)


def build_tokenizer_info(tokenizer, vocab_size: int, eos_token_ids) -> xgr.TokenizerInfo:
    """xgrammar's view of ``tokenizer``, in which no special token is text.

    xgrammar detects the vocabulary's encoding (``TokenizerInfo.from_huggingface``)
    but reads special tokens as the text they are spelled with, so
    ``<|endoftext|>`` could fill a JSON string. Here the decoded vocabulary
    is passed on (as raw bytes) with the special tokens that are not EOS ids
    blanked: xgrammar treats an empty token as special and never allows it.

    Parameters
    ----------
    tokenizer:
        The Hugging Face tokenizer.
    vocab_size:
        Rows of the model's logits (ids the tokenizer lacks are empty, so never allowed).
    eos_token_ids:
        The stop tokens (at least one).

    Raises
    ------
    ValueError
        ``eos_token_ids`` is empty (xgrammar's own check).
    """
    stop_ids = sorted(set(eos_token_ids))
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
    vocab = list(detected.decoded_vocab[:vocab_size])
    vocab += [b""] * (vocab_size - len(vocab))
    for token_id in special_token_ids(tokenizer, vocab_size) - set(stop_ids):
        vocab[token_id] = b""
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids)


# xgrammar 0.2.9 writes the characters of a string with minLength/maxLength (and no pattern)
# as LENGTH_STRING_CLASS, which lets raw control characters other than CR and LF into a JSON
# string (invalid JSON, "Invalid control character"); its other strings use JSON_STRING_CLASS.
# Found by bench_structured.py's random walks. Neither class allows an escape: that costs
# coverage (no quote in a length-bounded string), not validity.
LENGTH_STRING_CLASS = r'[^\"\\\r\n]'
JSON_STRING_CLASS = r'[^\0-\x1f\"\\\r\n]'


def rewrite_json_grammar(grammar: xgr.Grammar, bound_digits: bool) -> xgr.Grammar:
    """``grammar`` (JSON, or a structural tag holding JSON) with no raw U+0000-U+001F inside a string
    and, with ``bound_digits``, its number literals' digits bounded (`number_bounds`).

    The printed grammar is rewritten and parsed again, once for both (about a
    millisecond per 10 KB of grammar); a grammar neither rewrite changes is
    returned as it is. Should xgrammar not read back what it printed, the
    grammar is kept and a warning logged (validation still judges the output).
    """
    text = str(grammar)
    rewritten = text.replace(LENGTH_STRING_CLASS, JSON_STRING_CLASS)
    if bound_digits:
        rewritten = bound_ebnf_digits(rewritten)
    if rewritten == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(rewritten, root_rule_name="root")
    except Exception as e:  # xgrammar raises RuntimeError with a C++ log prefix
        logger.warning("raw control characters left allowed or number digits left unbounded: xgrammar cannot "
                       "read its grammar back (%s)", _first_line(e))
        return grammar


def can_always_finish(key: GrammarKey, grammar: xgr.Grammar) -> bool:
    """Whether every rule reachable in ``grammar`` derives a finite string (milliseconds).

    Returns
    -------
    True when so; False when the printed grammar holds a construct
    `grammar_analysis` does not know (the caller then turns jump-forward off).

    Raises
    ------
    GrammarError
        Some reachable rule derives no finite string: the output could never end.
    """
    try:
        unproductive = unproductive_reachable_rules(str(grammar))
    except UnknownGrammarSyntax as e:
        logger.warning("jump-forward off for a %s: its grammar could not be analysed (%s)",
                       _KIND_LABELS.get(key.kind, key.kind), e)
        return False
    if unproductive:
        raise GrammarError(_never_ends_message(key, unproductive), key.param)
    return True


def _never_ends_message(key: GrammarKey, rules: list[str]) -> str:
    named = ", ".join(repr(name) for name in rules[:MAX_RULES_NAMED])
    if len(rules) > MAX_RULES_NAMED:
        named += f" and {len(rules) - MAX_RULES_NAMED} more"
    subject = f"rule {named} derives" if len(rules) == 1 else f"rules {named} derive"
    label = _KIND_LABELS.get(key.kind, key.kind)
    return f"the {label} can never finish: {subject} no finite string; the output could never end"


def build_grammar(key: GrammarKey) -> xgr.Grammar:
    """The ``xgr.Grammar`` of ``key``, without a tokenizer.

    json_schema: ``Grammar.from_json_schema`` with fixed separators and
    ``strict_mode=True`` (no properties or items beyond the schema's);
    ``"$$ANY$$"`` is any JSON value. json_object: any JSON value (not
    ``builtin_json_grammar``, which allows only an object or array and
    unbounded whitespace). regex: ``Grammar.from_regex``, ``.`` excluding
    a newline (`dot_as_class`). ebnf:
    ``Grammar.from_ebnf`` with root rule ``root``. structural_tag: see
    `structural_tag_json`.

    Raises
    ------
    GrammarError
        Unknown kind or text xgrammar cannot parse; ``param`` = ``key.param``.
    """
    try:
        if key.kind == "json_object" or (key.kind == "json_schema" and key.text == ANY_JSON):
            return _json_grammar("true")
        if key.kind == "json_schema":
            return _json_grammar(key.text)
        if key.kind == "regex":
            return xgr.Grammar.from_regex(dot_as_class(key.text, RegexDialect.PYTHON))
        if key.kind == "ebnf":
            return xgr.Grammar.from_ebnf(key.text, root_rule_name="root")
        if key.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(structural_tag_json(key.text))
    except GrammarError:
        raise
    except Exception as e:
        raise _grammar_error(key, e) from e
    raise GrammarError(f"unknown grammar kind {key.kind!r}", key.param)


def structural_tag_json(text: str) -> str:
    """Normalise a structural tag to the JSON ``xgr.Grammar.from_structural_tag`` reads.

    Accepted forms:

    - xgrammar's: ``{"type": "structural_tag", "format": {...}}`` where the
      format is one of xgrammar's (``triggered_tags``, ``tag``, ``sequence``,
      ``json_schema``, ``regex``, ``const_string``, ...);
    - a bare format (``{"type": "triggered_tags", ...}``), wrapped as above;
    - SGLang's / OpenAI-style legacy form ``{"structures": [{"begin", "schema",
      "end"}, ...], "triggers": [...]}``, turned into ``triggered_tags``.

    Every ``json_schema`` format (JSON style) without ``max_whitespace_cnt``
    gets `TAG_MAX_WHITESPACE`.

    Raises
    ------
    GrammarError
        Not JSON, not an object, or a malformed legacy form (``param`` =
        ``"structural_tag"``). Errors inside the format are xgrammar's to find.
    """
    try:
        tag = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"structural_tag is not valid JSON: {e}", "structural_tag") from e
    if not isinstance(tag, dict):
        raise GrammarError("structural_tag must be a JSON object", "structural_tag")
    if "structures" in tag:
        tag = from_legacy_structural_tag(tag)
    elif tag.get("type") != "structural_tag":
        tag = {"type": "structural_tag", "format": tag}
    _bound_json_whitespace(tag)
    return json.dumps(tag)


def _json_grammar(schema: str) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(
        schema, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True
    )


def _bound_json_whitespace(node: Any) -> None:
    """Set ``max_whitespace_cnt`` on every JSON-style ``json_schema`` format under ``node``."""
    if isinstance(node, list):
        for item in node:
            _bound_json_whitespace(item)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        node.setdefault("max_whitespace_cnt", TAG_MAX_WHITESPACE)
    for name, value in node.items():
        if name != "json_schema":  # the user's schema, not a format
            _bound_json_whitespace(value)


def _grammar_error(key: GrammarKey, error: Exception) -> GrammarError:
    detail = _INPUT_ECHO.sub("", _LOG_PREFIX.sub("", str(error).strip())) or type(error).__name__
    if len(detail) > MAX_ERROR_CHARS:
        detail = detail[: MAX_ERROR_CHARS - 3] + "..."
    return GrammarError(f"invalid {_KIND_LABELS.get(key.kind, key.kind)}: {detail}", key.param)


def _first_line(error: Exception) -> str:
    text = _LOG_PREFIX.sub("", str(error).strip())
    return text.splitlines()[0] if text else type(error).__name__


def _allow_only(mask_row: torch.Tensor, token_ids: list[int]) -> None:
    """Set ``mask_row`` (ceil(V / 32) int32) so that only ``token_ids`` are allowed."""
    mask_row.zero_()
    _set_bits(mask_row, token_ids, True)


def _is_allowed(mask_row: torch.Tensor, token_id: int) -> bool:
    """Whether bit ``token_id`` of one int32 mask row is set."""
    return bool((int(mask_row[token_id // 32]) >> (token_id % 32)) & 1)


def _set_bits(mask_row: torch.Tensor, token_ids, allowed: bool) -> None:
    """Set (``allowed``) or clear the bits of ``token_ids`` in one int32 mask row (ids past it are skipped)."""
    for token_id in token_ids:
        if token_id >= mask_row.numel() * 32:
            continue
        word, bit = int(mask_row[token_id // 32]), 1 << (token_id % 32)
        word = ((word | bit) if allowed else (word & ~bit)) & 0xFFFFFFFF
        mask_row[token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word
