"""The second grammar backend: outlines-core (regex and JSON schema).

outlines-core turns a regex into a byte-level DFA and precomputes, for every
DFA state, the tokens that keep the text inside the language (its `Index`).
A JSON schema is first turned into a regex (`build_regex_from_schema`). The
front calls `OutlinesBackend.check` before a request is queued; the grammar
worker thread calls `compile`; the scheduler drives one `OutlinesMatcher` per
constrained request.

Four things are done here rather than by outlines-core (version 0.2.14):

- The `Vocabulary` is built from the Hugging Face tokenizer in memory
  (``Vocabulary.from_pretrained`` would download it): every token becomes the
  bytes it stands for (GPT-2 byte-level tokens such as ``"Ġhello"`` →
  ``b" hello"``; SentencePiece ``"▁"`` → ``b" "`` and ``"<0x0A>"`` → ``b"\\n"``).
  Special tokens (`vocab.special_token_ids`) are left out, so never allowed;
  the model's EOS ids are allowed by the matcher itself, in final states only,
  and so are a request's own ``stop_token_ids``.
- The regex is compiled as ``(?:R)`` followed by an end mark (U+10FFFF, read by
  a token of its own). outlines-core 0.2.14 drops every token that ends one
  byte after a point where R already matched (its DFA reports matches one byte
  late), and its leftmost-first DFA cuts alternatives once a shorter one
  matched: ``\\d+(\\.\\d+)?`` could not write ``3.14`` token by token and
  ``(a|ab)`` could not write ``ab``. With the end mark R never matches before
  the text ends, so neither happens; a state is final when the end-mark token
  leads from it to a full match. Tokens holding the byte 0xF4 (U+100000 to
  U+10FFFF, the supplementary private-use plane B) are left out so that no
  sampled text can spell the mark.
- ``\\d`` and ``\\w`` are ASCII, as in JSON Schema (ECMAScript) and xgrammar;
  Rust's regex would take the digits and letters of every script. In a
  ``regex`` constraint ``.`` is Python's (no newline, `regex_constraint`).
- Schemas that outlines-core would enforce only in part are refused with a
  `GrammarError`: a recursive ``$ref`` (outlines unrolls it to a fixed depth),
  a free-form JSON value (a regex nested to a fixed depth, minutes to
  compile), and the keywords and keyword combinations it silently drops
  (see `check_for_outlines`). arborlm never under-constrains without saying so.
  In lenient mode (``json_schema_lenient``) the backend's schema policy
  (`OUTLINES_POLICY`, whose ``relax`` is `relax_for_outlines`) drops those
  keywords instead and lets recursion and free-form objects and arrays
  through at outlines-core's fixed depth, listing each in the request's
  ``dropped``; the finished output is still validated against the whole
  schema. What outlines-core cannot run right at all stays refused: any JSON
  value (minutes to compile), several ``allOf`` subschemas, a ``required``
  name missing from ``properties``.

JSON whitespace is `JSON_WHITESPACE` (at most one space per gap), so that a weak
model cannot stall in whitespace; xgrammar's ``", "`` / ``": "`` output fits it.
Number literals have bounded digits (`number_bounds`), as on xgrammar.

After SGLang's ``sglang/srt/constrained/outlines_backend.py``; the API is
outlines-core's (``Vocabulary``, ``Index``, ``Guide``).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence

import outlines_core
import torch
from outlines_core.json_schema import INTEGER, NUMBER, build_regex_from_schema

from arborlm.constrained.base import (
    ANY_JSON,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarKey,
    GrammarMatcher,
)
from arborlm.constrained.json_schema import LENIENT_MARK, OUTLINES_POLICY, check_for_outlines
from arborlm.constrained.number_bounds import bound_regex_digits
from arborlm.constrained.regex_constraint import RegexDialect, dot_as_class
from arborlm.constrained.regex_size import regex_shape
from arborlm.constrained.vocab import special_token_ids

# Most positions a regex may have with its counted repetitions written out (`regex_shape`).
# Building the DFA over single bytes here: 25k positions 1.7 s, 112k 12 s, 197k 14 s, 399k
# and 745k past 20 s; over the tokenizer's vocabulary a compile costs more still.
MAX_EXPANDED_REGEX_SIZE = 250_000
# What JSON may put between its tokens (outlines-core's ``whitespace_pattern``).
JSON_WHITESPACE = r"[ ]?"
# Tokens a matcher can roll back (outlines-core's ``Guide`` keeps this many states).
MAX_ROLLBACK_TOKENS = 1024
# Longest forced text `find_jump_forward_string` looks for, in bytes.
MAX_JUMP_FORWARD_BYTES = 4096

# The end mark: a noncharacter no sampled token can spell (tokens with its lead byte are left out).
_END_MARK = "\U0010ffff"
_END_MARK_REGEX = r"\x{10FFFF}"
_END_MARK_LEAD_BYTE = 0xF4

# ASCII meanings of the shorthand classes (ECMAScript's, as in JSON Schema and xgrammar);
# Rust's regex, which outlines-core uses, makes them Unicode-wide. Rust allows nested classes.
_ASCII_SHORTHANDS = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}


class OutlinesMatcher(GrammarMatcher):
    """One request's state over an `OutlinesGrammar`: an outlines-core ``Guide`` plus the EOS step.

    The ``Guide`` holds the DFA state and the last `MAX_ROLLBACK_TOKENS` states
    before it; an accepted EOS is tracked here (outlines-core cannot advance by EOS).
    ``stop_token_ids``: the request's own stop ids, which end the grammar as
    an EOS does: allowed in final states only, and then whatever text they
    stand for.
    """

    def __init__(self, grammar: OutlinesGrammar, stop_token_ids: Sequence[int] = ()):
        self._grammar = grammar
        self._guide = outlines_core.Guide(grammar.index, max_rollback=MAX_ROLLBACK_TOKENS)
        self._terminated = False  # an EOS was accepted
        self._stop_ids = grammar.eos_token_ids | frozenset(stop_token_ids)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens of the current state into ``vocab_mask[row]``.

        vocab_mask: (batch, ceil(vocab_size / 32)) int32, contiguous, on the CPU;
        bit ``j % 32`` of word ``j // 32`` is set when token ``j`` is allowed.
        EOS (and a request stop id) is allowed only in final states; ids the
        tokenizer lacks (up to the model's vocab_size) and special tokens never
        are. Once terminated only EOS is allowed.
        """
        grammar = self._grammar
        assert vocab_mask.dtype == torch.int32 and vocab_mask.device.type == "cpu" and vocab_mask.is_contiguous()
        assert vocab_mask.shape[1] == grammar.mask_words, (vocab_mask.shape, grammar.mask_words)
        mask_row = vocab_mask[row]
        if self._terminated:
            mask_row.zero_()
            _set_bits(mask_row, grammar.eos_token_ids, True)
            return
        # Zeroes the whole row, then sets the bit of every token with a transition (end mark included).
        self._guide.write_mask_into(mask_row.data_ptr(), mask_row.numel(), mask_row.element_size())
        _set_bits(mask_row, (grammar.end_mark_id,), False)
        _set_bits(mask_row, self._stop_ids, grammar.is_final(self._guide.get_state()))

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) when the grammar rejects it or has terminated."""
        grammar = self._grammar
        if self._terminated or not 0 <= token_id < grammar.vocab_size or token_id == grammar.end_mark_id:
            return False
        state = self._guide.get_state()
        if token_id in self._stop_ids:
            self._terminated = grammar.is_final(state)
            return self._terminated
        if grammar.index.get_next_state(state, token_id) is None:
            return False
        self._guide.advance(token_id, return_tokens=False)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (an accepted EOS included).

        Raises
        ------
        RuntimeError
            More tokens than were accepted, or more than `MAX_ROLLBACK_TOKENS` (a caller bug).
        """
        if num_tokens > 0 and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens > self._guide.get_allowed_rollback():
            raise RuntimeError(
                f"cannot roll back {num_tokens} tokens: {self._guide.get_allowed_rollback()} are kept "
                f"(at most {MAX_ROLLBACK_TOKENS})"
            )
        if num_tokens > 0:
            self._guide.rollback_state(num_tokens)

    def is_terminated(self) -> bool:
        """True after an accepted EOS.

        A final state from which no token leads on is not terminated: its mask
        allows only EOS, which the next step samples, as xgrammar does. So both
        backends end a request on the EOS token (``matched_stop`` is its id),
        never on the last content token.
        """
        return self._terminated

    def find_jump_forward_string(self) -> str:
        """The text every continuation must start with ("" when none or terminated).

        Follows `OutlinesGrammar.forced_step` from the current state without
        moving the matcher; a UTF-8 character cut at the end is left out.
        """
        if self._terminated:
            return ""
        grammar, state, forced = self._grammar, self._guide.get_state(), bytearray()
        while len(forced) < MAX_JUMP_FORWARD_BYTES:
            step = grammar.forced_step(state)
            if step is None:
                break
            piece, state = step
            forced += piece
        return _decode_complete_utf8(bytes(forced))


class OutlinesGrammar(CompiledGrammar):
    """An outlines-core ``Index`` for one regex and vocabulary, with per-state caches.

    The caches are filled by the matchers, all in the scheduler thread.
    """

    def __init__(self, index: outlines_core.Index, backend: OutlinesBackend):
        self.index = index
        self.vocab_size = backend.vocab_size
        self.mask_words = (backend.vocab_size + 31) // 32
        self.eos_token_ids = backend.eos_token_ids
        self.end_mark_id = backend.end_mark_id
        self._token_bytes = backend.token_bytes
        self._token_ids_by_bytes = backend.token_ids_by_bytes
        self._forced_steps: dict[int, tuple[bytes, int] | None] = {}

    def new_matcher(self, stop_token_ids: Sequence[int] = ()) -> OutlinesMatcher:
        """A matcher at the start; ``stop_token_ids``: the request's own stop ids (see `OutlinesMatcher`)."""
        return OutlinesMatcher(self, stop_token_ids)

    def is_final(self, state: int) -> bool:
        """True when the text so far is in the language: the end mark leads to a full match.

        (R itself may read the end mark, as ``.`` does, so a transition alone is not enough.)
        """
        after_mark = self.index.get_next_state(state, self.end_mark_id)
        return after_mark is not None and self.index.is_final_state(after_mark)

    def forced_step(self, state: int) -> tuple[bytes, int] | None:
        """(bytes every continuation starts with, the state after them), or None.

        The bytes are the longest common prefix of the allowed tokens of a
        non-final ``state``; the step needs a token spelling exactly them. With
        all 256 single-byte tokens (byte-level BPE, byte fallback) this walks
        the forced text one byte at a time.
        """
        if state in self._forced_steps:
            return self._forced_steps[state]
        step = None
        if not self.is_final(state):
            prefix = _common_prefix(self._token_bytes[t] for t in self.index.get_allowed_tokens(state) or ())
            for token_id in self._token_ids_by_bytes.get(prefix, ()) if prefix else ():
                next_state = self.index.get_next_state(state, token_id)
                if next_state is not None:
                    step = (prefix, next_state)
                    break
        self._forced_steps[state] = step
        return step


class OutlinesBackend(GrammarBackend):
    """Compiles regexes and JSON schemas with outlines-core for one Hugging Face tokenizer.

    Parameters
    ----------
    tokenizer:
        The Hugging Face tokenizer: byte-level BPE, SentencePiece (``"▁"``,
        ``"<0xAB>"`` byte tokens) or plain-text vocabularies (`_token_decoder`).
    vocab_size:
        Rows of the model's logits (may exceed ``len(tokenizer)``; the extra
        ids are never allowed).
    eos_token_ids:
        Every id that ends a request (the model config's, the generation
        config's and the tokenizer's EOS; at least one): allowed only where the
        grammar is complete, and the only tokens allowed once it has ended.

    Raises
    ------
    ValueError
        No EOS id, or no token id is free for the end mark.
    """

    name = "outlines"
    kinds = ("regex", "json_schema")
    schema_policy = OUTLINES_POLICY

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        if not eos_token_ids:
            raise ValueError("the outlines grammar backend needs at least one EOS token id")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        # token_bytes[id]: the bytes a grammar token stands for; None for left-out ids.
        self.token_bytes: list[bytes | None] = [None] * vocab_size
        self.token_ids_by_bytes: dict[bytes, list[int]] = {}
        for token_id, text in enumerate(_token_bytes(tokenizer, vocab_size)):
            if text and token_id not in self.eos_token_ids and _END_MARK_LEAD_BYTE not in text:
                self.token_bytes[token_id] = text
                self.token_ids_by_bytes.setdefault(text, []).append(token_id)
        free_ids = [i for i, text in enumerate(self.token_bytes) if text is None and i not in self.eos_token_ids]
        if not free_ids:
            raise ValueError("the outlines grammar backend needs one token id outside the grammar for its end mark")
        self.end_mark_id = free_ids[0]
        token_map = dict(self.token_ids_by_bytes)
        token_map[_END_MARK.encode()] = [self.end_mark_id]
        self.vocabulary = outlines_core.Vocabulary(min(eos_token_ids), token_map)

    @classmethod
    def _check_syntax(cls, key: GrammarKey) -> None:
        """Derive the regex and read it, without building its DFA (microseconds to milliseconds).

        outlines-core's DFA costs grow with written-out repetitions and with
        ambiguity, not with the regex's length (a 2.5 KB JSONSchemaBench
        regex took over 5 minutes and 3 GB), and a native build cannot be
        stopped: the front, which must answer every request at once, only
        reads the regex (`regex_shape`) and leaves the DFA to `compile`,
        which runs in a compile worker process that is killed at
        ``grammar_compile_timeout``. A regex that Python's parser cannot
        read or that holds what a DFA has no state for (anchors inside,
        look-around, back-references) is built over single bytes as before,
        so that outlines-core itself says what is wrong (it refuses those in
        its parser, before any DFA is built).

        Raises
        ------
        GrammarError
            Bad regex, invalid or unsupported schema, a recursive ``$ref``, a
            keyword outlines-core would drop, repetitions that expand past
            `MAX_EXPANDED_REGEX_SIZE`; ``param`` = ``key.param``.
        """
        regex = _regex_of(key)
        shape = regex_shape(_ascii_shorthands(regex))
        if shape is None or shape.not_regular:
            _build_index(key, regex, _byte_vocabulary())
        elif shape.expanded_size > MAX_EXPANDED_REGEX_SIZE:
            what = "regex" if key.kind == "regex" else "regex of the JSON schema"
            raise GrammarError(
                f"the {what} has bounded repetitions (maxLength, maxItems, {{m,n}}) that outlines-core would "
                f"write out as about {shape.expanded_size} positions, over the outlines backend's "
                f"{MAX_EXPANDED_REGEX_SIZE}: its DFA would take minutes and gigabytes to build; lower the "
                "bounds or use grammar_backend xgrammar or llguidance", key.param)

    def compile(self, key: GrammarKey) -> OutlinesGrammar:
        """Build the ``Index`` of ``key`` over the tokenizer's vocabulary.

        On SmolLM2's 49152 tokens: 30 ms for a 2-field object, 0.2 s for a
        date regex, 2 to 4 s for a schema of 5 objects and 15 fields.

        Raises
        ------
        GrammarError
            As `check`, and when the vocabulary cannot spell any text of the language.
        """
        if key.kind not in self.kinds:
            self.check(key)  # raises the unsupported-kind error
        return OutlinesGrammar(_build_index(key, _regex_of(key), self.vocabulary), self)

    def compile_serialized(self, key: GrammarKey) -> outlines_core.Index:
        """`compile` in a compile worker process; the ``Index``, which pickles (0.3 MB in 1 ms for 2 fields).

        Raises
        ------
        GrammarError
            As `compile`.
        """
        return self.compile(key).index

    def load_compiled(self, key: GrammarKey, payload: outlines_core.Index) -> OutlinesGrammar:
        """The grammar of a `compile_serialized` ``Index`` (built over the same vocabulary)."""
        return OutlinesGrammar(payload, self)


def _regex_of(key: GrammarKey) -> str:
    """The regex ``key`` stands for (a full match; ``^``/``$`` around a regex are dropped).

    A ``regex``'s ``.`` is Python's (`dot_as_class`); a schema's number
    literals have bounded digits (`bound_regex_digits`).

    Raises
    ------
    GrammarError
        The schema is not JSON, is refused by `check_for_outlines`, or outlines-core cannot convert it.
    """
    if key.kind == "regex":
        text = dot_as_class(key.text, RegexDialect.PYTHON)
        return re.sub(r"(?<!\\)((?:\\\\)*)\$\Z", r"\1", text.removeprefix("^"))
    text = "{}" if key.text == ANY_JSON else key.text
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"json_schema is not valid JSON: {e}", key.param) from e
    if not isinstance(schema, dict):
        raise GrammarError("the outlines grammar backend needs a JSON schema that is an object", key.param)
    lenient = schema.pop(LENIENT_MARK, False) is True
    check_for_outlines(schema, lenient)
    if lenient:
        text = json.dumps(schema)
    try:
        regex = build_regex_from_schema(text, whitespace_pattern=JSON_WHITESPACE)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"outlines-core cannot enforce this JSON schema: {_first_line(e)}", key.param) from e
    return regex if key.lenient else bound_regex_digits(regex, INTEGER, NUMBER)


def _build_index(key: GrammarKey, regex: str, vocabulary: outlines_core.Vocabulary) -> outlines_core.Index:
    """outlines-core's ``Index`` of ``(?:regex)`` + the end mark over ``vocabulary``.

    Raises
    ------
    GrammarError
        The regex does not parse, uses a feature a DFA cannot have (look-around,
        backreferences, Unicode word boundaries, anchors inside), or matches nothing.
    """
    try:
        return outlines_core.Index(f"(?:{_ascii_shorthands(regex)}){_END_MARK_REGEX}", vocabulary)
    except (ValueError, TypeError) as e:
        what = "regex" if key.kind == "regex" else "regex of the JSON schema"
        raise GrammarError(
            f"outlines-core cannot use this {what} (Rust regex syntax without look-around, backreferences "
            f"or anchors inside, matching at least one text): {_first_line(e)}",
            key.param,
        ) from e


def _ascii_shorthands(regex: str) -> str:
    """``regex`` with ``\\d``, ``\\D``, ``\\w`` and ``\\W`` spelled as ASCII classes (`_ASCII_SHORTHANDS`)."""
    parts, i = [], 0
    while i < len(regex):
        if regex[i] == "\\" and i + 1 < len(regex):
            escape = regex[i : i + 2]
            parts.append(_ASCII_SHORTHANDS.get(escape[1], escape))
            i += 2
        else:
            parts.append(regex[i])
            i += 1
    return "".join(parts)


@functools.cache
def _byte_vocabulary() -> outlines_core.Vocabulary:
    """A vocabulary of the single bytes (0xF4 aside) plus the end mark (for `_check_syntax`)."""
    token_map = {bytes([b]): [b] for b in range(256) if b != _END_MARK_LEAD_BYTE}
    token_map[_END_MARK.encode()] = [256]
    return outlines_core.Vocabulary(257, token_map)


def _token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """The bytes each token id < ``vocab_size`` stands for; None for special and unknown ids.

    Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) maps each byte to a printable
    character (`_byte_level_decoder`); SentencePiece writes a space as ``"▁"``
    and a raw byte as ``"<0xAB>"``; added non-special tokens are their text.
    """
    special = special_token_ids(tokenizer, vocab_size)
    added = {}
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if token_id not in special:
            added[token_id] = token.content.encode()
    decode = _token_decoder(tokenizer)
    table: list[bytes | None] = [None] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special:
            table[token_id] = added[token_id] if token_id in added else decode(token)
    return table


def _token_decoder(tokenizer):
    """token string -> bytes for the tokenizer's kind.

    Fast tokenizers: from the decoder of their ``tokenizer.json``. Slow ones:
    byte-level when they have GPT-2's ``byte_encoder``, SentencePiece when the
    vocabulary has ``"<0x0A>"`` or ``"▁"`` tokens, raw text otherwise.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.decoder is not None:
        decoder = json.loads(backend.decoder.__getstate__())
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
    elif hasattr(tokenizer, "byte_encoder"):
        kinds = {"ByteLevel"}
    else:
        vocab = tokenizer.get_vocab()
        kinds = {"ByteFallback"} if "<0x0A>" in vocab or any("\u2581" in token for token in vocab) else set()
    if "ByteLevel" in kinds:
        table = _byte_level_decoder()
        return lambda token: bytes(table[c] for c in token) if all(c in table for c in token) else token.encode()
    if kinds & {"ByteFallback", "Metaspace", "Replace"}:
        byte_token = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

        def sentencepiece(token: str) -> bytes:
            match = byte_token.match(token)
            return bytes([int(match.group(1), 16)]) if match else token.replace("\u2581", " ").encode()

        return sentencepiece
    return lambda token: token.encode()


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable character -> byte table (``bytes_to_unicode`` inverted).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are
    shifted to U+0100 upwards in byte order (space → "Ġ", newline → "Ċ").
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def _set_bits(mask_row: torch.Tensor, token_ids, allowed: bool) -> None:
    """Set (``allowed``) or clear the bits of ``token_ids`` in one int32 mask row."""
    for token_id in token_ids:
        if token_id >= mask_row.numel() * 32:
            continue
        word, bit = int(mask_row[token_id // 32]), 1 << (token_id % 32)
        word = (word | bit) if allowed else (word & ~bit)
        word &= 0xFFFFFFFF
        mask_row[token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word


def _common_prefix(texts) -> bytes:
    prefix = None
    for text in texts:
        if text is None:
            continue
        if prefix is None:
            prefix = text
            continue
        n = 0
        for a, b in zip(prefix, text):
            if a != b:
                break
            n += 1
        prefix = prefix[:n]
        if not prefix:
            break
    return prefix or b""


def _decode_complete_utf8(data: bytes) -> str:
    """``data`` as text, leaving out a UTF-8 character cut at the end."""
    for cut in range(4):
        try:
            return data[: len(data) - cut].decode()
        except UnicodeDecodeError:
            continue
    return data.decode(errors="replace")


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
