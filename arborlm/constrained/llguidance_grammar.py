"""A `GrammarKey` as the grammar llguidance compiles (its JSON grammar text), without a tokenizer.

llguidance (guidance-ai, PyPI ``llguidance``) takes every constraint as one
grammar definition: a Lark grammar, or a JSON object of grammars in which a
JSON schema, a regex or a Lark grammar may refer to the others. This module
builds that definition for each kind a request may ask for:

- ``json_schema``: the user's schema as written (`LLGUIDANCE_POLICY`), with the
  JSON options of the other backends: json.dumps's separators on one line
  (``", "``, ``": "``, no free whitespace), integers without a range bounded
  to 19 digits (`bound_integer_digits`) and, for a ``json_schema_lenient``
  request, instead of that bound llguidance's ``lenient`` (keywords it does not implement are
  ignored instead of refused). Keywords llguidance does not implement are
  otherwise refused by llguidance itself, naming them.
- ``json_object``: any JSON value (the empty schema).
- ``regex``: ``.`` as Python's (no newline, `regex_constraint`), and ``\\d``,
  ``\\w`` (and their negations) ASCII as in the other backends; llguidance's
  regex engine makes them Unicode-wide.
- ``ebnf``: a Lark grammar (llguidance's syntax, ``start`` rule) or a GBNF /
  xgrammar-style EBNF grammar (``root ::= ...``), which llguidance's
  ``gbnf_to_lark`` converts.
- ``structural_tag``: xgrammar's structural-tag formats (what the OpenAI tool
  calls build; `structural_tag_lark`) written as Lark: ``const_string``,
  ``json_schema``, ``regex``, ``grammar``, ``sequence``, ``or``, ``optional``,
  ``tag``, ``tags_with_separator``, ``triggered_tags`` and ``any_text``. Free
  text up to a trigger is a lazy lexeme (llguidance's tool-calling idiom,
  ``docs/syntax.md``), so the first occurrence of a trigger opens a tag.

Grammar errors are found by `validate` (llguidance's own check, a millisecond
for typical grammars) and raised as `GrammarError` naming the request field.

Torch-free: the front calls `validate` through `LLGuidanceBackend.check`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from arborlm.constrained.json_schema.llguidance import bound_integer_digits, unimplemented_keywords
from arborlm.constrained.json_schema.nodes import refusal_message
from arborlm.constrained.keys import ANY_JSON, GrammarError, GrammarKey
from arborlm.constrained.regex_constraint import RegexDialect, dot_as_class
from arborlm.constrained.structural_tags import from_legacy_structural_tag

# llguidance's JSON options: json.dumps's separators, on one line (as xgrammar's and outlines' output).
# ``oneOf`` as ``anyOf`` where llguidance cannot show the branches disjoint (as on the other backends:
# exclusivity is left to the final validation, see `json_schema`'s decisions).
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "coerce_one_of": True}
# Longest error text passed on to a client.
MAX_ERROR_CHARS = 500

_KIND_LABELS = {
    "json_schema": "JSON schema",
    "json_object": "JSON grammar",
    "regex": "regex",
    "ebnf": "grammar",
    "structural_tag": "structural tag",
}
# ASCII meanings of the shorthand classes (ECMAScript's and the other backends'); llguidance's are Unicode.
_ASCII_SHORTHANDS = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}


def build_grammar(key: GrammarKey) -> str:
    """llguidance's grammar definition of ``key`` (not yet checked; see `validate`).

    Raises
    ------
    GrammarError
        Unknown kind, a JSON schema or structural tag that is not JSON, an EBNF
        grammar the GBNF converter cannot read, or a structural tag of a form
        `structural_tag_lark` does not know; ``param`` = ``key.param``.
    """
    if key.kind == "json_object" or (key.kind == "json_schema" and key.text == ANY_JSON):
        return _json_grammar("{}", lenient=False, param=key.param)
    if key.kind == "json_schema":
        return _json_grammar(key.text, key.lenient, key.param)
    if key.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(ascii_shorthands(dot_as_class(key.text, RegexDialect.PYTHON)))
    if key.kind == "ebnf":
        try:
            return llguidance.grammar_from("ebnf", gbnf_escapes(key.text))
        except ValueError as e:
            raise GrammarError(f"invalid grammar: {_shorten(str(e))}", key.param) from e
    if key.kind == "structural_tag":
        return structural_tag_grammar(key.text)
    raise GrammarError(f"unknown grammar kind {key.kind!r}", key.param)


def validate(key: GrammarKey, grammar: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """Refuse ``grammar`` (built by `build_grammar`) when llguidance cannot use it.

    With a ``tokenizer`` the check includes what needs one (special tokens named in Lark).

    Raises
    ------
    GrammarError
        llguidance's error (a keyword it does not implement, named with its path in the schema, a ``$ref`` it
        cannot resolve, an unknown ``format``, a Lark or regex syntax error),
        ``param`` = ``key.param``.
    """
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if not is_error:
        return
    detail = messages[0] if messages else "rejected by llguidance"
    if key.kind == "json_schema" and key.text != ANY_JSON:
        unimplemented = unimplemented_keywords(json.loads(key.text), detail)
        if unimplemented is not None:  # named with their paths, as the other backends' refusals
            raise GrammarError(refusal_message(unimplemented), key.param)
    raise grammar_error(key, detail)


def grammar_error(key: GrammarKey, detail: str) -> GrammarError:
    """The `GrammarError` of ``key`` with llguidance's ``detail`` (shortened)."""
    label = _KIND_LABELS.get(key.kind, key.kind)
    return GrammarError(f"invalid {label} (llguidance): {_shorten(detail)}", key.param)


def ascii_shorthands(regex: str) -> str:
    """``regex`` with ``\\d``, ``\\D``, ``\\w`` and ``\\W`` spelled as ASCII classes.

    Escapes are read pairwise, so ``\\\\d`` (a backslash, then ``d``) stays.
    """
    parts, i = [], 0
    while i < len(regex):
        if regex[i] == "\\" and i + 1 < len(regex):
            parts.append(_ASCII_SHORTHANDS.get(regex[i + 1], regex[i : i + 2]))
            i += 2
        else:
            parts.append(regex[i])
            i += 1
    return "".join(parts)


def gbnf_escapes(text: str) -> str:
    """``text`` (GBNF / xgrammar EBNF) with the escapes xgrammar prints and llguidance's GBNF
    reader does not know written as ``\\xHH``: ``\\0`` (in ``[^\\0-\\x1f...]``) and a
    backslash before punctuation (``[+\\-]``).

    Escapes are read pairwise, so ``\\\\0`` (a backslash, then 0) stays.
    """
    parts, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            pair = text[i : i + 2]
            if pair == "\\0" and not text[i + 2 : i + 3].isdigit():
                pair = "\\x00"
            elif pair[1] not in _GBNF_ESCAPES and pair[1].isascii() and not pair[1].isalnum():
                pair = f"\\x{ord(pair[1]):02x}"  # xgrammar's \- or \. in a class: the character itself
            parts.append(pair)
            i += 2
        else:
            parts.append(text[i])
            i += 1
    return "".join(parts)


def drop_lookaheads(text: str) -> str:
    """``text`` (xgrammar EBNF) without xgrammar's lookahead assertions ``(= ...)``, and its
    unbounded repeat ``{n, -1}`` written ``{n,}``.

    xgrammar prints them after rules whose continuation the rest of the grammar fixes
    anyway (a speed hint for its matcher), so the language stays; llguidance's GBNF
    reader does not know them. Quoted strings and character classes are skipped over.
    """
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"[":
            end = _skip_literal(text, i)
            out.append(text[i:end])
            i = end
        elif text.startswith("(=", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text[i] in "\"[":
                    i = _skip_literal(text, i)
                    continue
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
        elif c == "{" and (unbounded := _UNBOUNDED_REPEAT.match(text, i)):
            out.append(f"{{{unbounded.group(1)},}}")
            i = unbounded.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


# Escapes llguidance's GBNF reader knows (others, such as xgrammar's "\-", are written as "\xHH").
_GBNF_ESCAPES = frozenset('nrt\\"[]xuU')
# xgrammar's unbounded repetition, "{0, -1}".
_UNBOUNDED_REPEAT = re.compile(r"\{\s*(\d+)\s*,\s*-1\s*\}")


def _skip_literal(text: str, start: int) -> int:
    """The index after the string literal or character class opening at ``start``."""
    close = '"' if text[start] == '"' else "]"
    i = start + 1
    while i < len(text) and text[i] != close:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _json_grammar(text: str, lenient: bool, param: str) -> str:
    options = {**JSON_OPTIONS, "lenient": lenient}
    if not lenient:  # integers' digits bounded, as on the other backends (lenient lifts it)
        try:
            text = json.dumps(bound_integer_digits(json.loads(text)))
        except ValueError as e:
            raise GrammarError(f"json_schema is not valid JSON: {_shorten(str(e))}", param) from e
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=options)
    except ValueError as e:
        raise GrammarError(f"json_schema is not a JSON object: {_shorten(str(e))}", param) from e


def structural_tag_grammar(text: str) -> str:
    """llguidance's grammar of a structural tag (forms as `xgrammar_backend.structural_tag_json` accepts).

    Raises
    ------
    GrammarError
        Not JSON, not an object, a malformed legacy form or an unknown format
        (``param`` = ``"structural_tag"``).
    """
    try:
        tag = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"structural_tag is not valid JSON: {e}", "structural_tag") from e
    if not isinstance(tag, dict):
        raise GrammarError("structural_tag must be a JSON object", "structural_tag")
    if "structures" in tag:
        tag = from_legacy_structural_tag(tag)
    fmt = tag.get("format") if tag.get("type") == "structural_tag" else tag
    writer = _LarkWriter()
    start = writer.element(fmt)
    lark = "%llguidance {}\n" + f"start: {start}\n" + "".join(writer.rules)
    return json.dumps({"grammars": [{"lark_grammar": lark}, *writer.grammars]})


class _LarkWriter:
    """Writes xgrammar structural-tag formats as Lark rules (one rule per tag, sub-grammars by name)."""

    def __init__(self):
        self.rules: list[str] = []
        self.grammars: list[dict[str, Any]] = []

    def element(self, fmt: Any) -> str:
        """The Lark expression of one format (rules it needs are appended to `rules`)."""
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise GrammarError("structural_tag: each format must be an object with a 'type'", "structural_tag")
        kind = fmt["type"]
        method = getattr(self, f"_fmt_{kind}", None)
        if method is None:
            raise GrammarError(f"structural_tag: the llguidance grammar backend does not know the format {kind!r}",
                               "structural_tag")
        try:
            return method(fmt)
        except KeyError as e:
            raise GrammarError(f"structural_tag: a {kind!r} format needs {e.args[0]!r}", "structural_tag") from None

    def _rule(self, body: str, lazy: bool = False) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}\n")
        return name

    def _grammar(self, entry: dict[str, Any]) -> str:
        name = f"g{len(self.grammars)}"
        self.grammars.append({"name": name, **entry})
        return f"@{name}"

    def _fmt_const_string(self, fmt: dict) -> str:
        return _literal(fmt["value"]) or '""'

    def _fmt_json_schema(self, fmt: dict) -> str:
        schema = fmt["json_schema"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"structural_tag: a schema is not valid JSON: {e}", "structural_tag") from e
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError("structural_tag: a json_schema must be a JSON object", "structural_tag")
        return self._grammar({"json_schema": {**schema, "x-guidance": JSON_OPTIONS}})

    def _fmt_regex(self, fmt: dict) -> str:
        pattern = ascii_shorthands(dot_as_class(fmt["pattern"], RegexDialect.PYTHON))
        return self._grammar({"lark_grammar": f"start: /{_lark_regex(pattern)}/\n"})

    def _fmt_grammar(self, fmt: dict) -> str:
        text = fmt["grammar"]
        try:
            lark = any_to_lark(gbnf_escapes(drop_lookaheads(text)))
        except Exception as e:  # the converter raises its own error types
            raise GrammarError(f"structural_tag: a grammar cannot be read: {_shorten(str(e))}",
                               "structural_tag") from e
        return self._grammar({"lark_grammar": lark})

    def _fmt_any_text(self, fmt: dict) -> str:
        return self._rule(r"/(.|\n)*/")

    def _fmt_sequence(self, fmt: dict) -> str:
        return "(" + " ".join(self.element(e) for e in fmt["elements"]) + ")" if fmt["elements"] else '""'

    def _fmt_or(self, fmt: dict) -> str:
        return "(" + " | ".join(self.element(e) for e in fmt["elements"]) + ")"

    def _fmt_optional(self, fmt: dict) -> str:
        return f"({self.element(fmt['content'])})?"

    def _fmt_tag(self, fmt: dict) -> str:
        parts = [_literal(fmt["begin"]), self.element(fmt["content"]), _literal(fmt["end"])]
        return self._rule(" ".join(p for p in parts if p))

    def _fmt_tags_with_separator(self, fmt: dict) -> str:
        tags = self._rule(" | ".join(self.element(t) for t in fmt["tags"]))
        if fmt.get("stop_after_first"):
            return tags if fmt.get("at_least_one") else f"({tags})?"
        more = f"({tags} ({_literal(fmt['separator'])} {tags})*)"
        return more if fmt.get("at_least_one") else f"{more}?"

    def _fmt_triggered_tags(self, fmt: dict) -> str:
        triggers = fmt["triggers"]
        if not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise GrammarError("structural_tag: triggered_tags needs non-empty triggers", "structural_tag")
        # Text before a trigger: a lazy lexeme ends at the trigger's first occurrence.
        text_then_tag = []
        for tag in fmt["tags"]:
            begin = tag.get("begin", "") if isinstance(tag, dict) else ""
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise GrammarError(f"structural_tag: the tag beginning {begin!r} starts with no trigger",
                                   "structural_tag")
            head = self._rule(f"/{_lark_regex(_ANY_TEXT)}/ {_literal(trigger)}", lazy=True)
            rest = {**tag, "begin": begin[len(trigger):]}
            text_then_tag.append(f"{head} {self.element(rest)}")
        one = self._rule(" | ".join(text_then_tag))
        tail = self._rule(f"/{_lark_regex(_ANY_TEXT)}/")
        if fmt.get("stop_after_first"):
            return f"({one} | {tail})" if not fmt.get("at_least_one") else one
        return f"{one}+ {tail}" if fmt.get("at_least_one") else f"{one}* {tail}"


# Free text (any characters, newlines included).
_ANY_TEXT = r"(.|\n)*"


def _literal(text: str) -> str:
    """``text`` as a Lark string literal ("" for the empty string: nothing to match)."""
    if not isinstance(text, str):
        raise GrammarError("structural_tag: begin, end, separator and const_string values must be strings",
                           "structural_tag")
    return json.dumps(text) if text else ""


def _lark_regex(pattern: str) -> str:
    """``pattern`` inside Lark's ``/.../`` (an unescaped ``/`` would end it)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            out.append(pattern[i : i + 2])
            i += 2
            continue
        out.append("\\/" if pattern[i] == "/" else pattern[i])
        i += 1
    return "".join(out)


def _shorten(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
