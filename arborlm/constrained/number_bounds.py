"""How long a JSON number literal may be: as long as a 64-bit integer or a double needs.

JSON Schema puts no bound on a number's digits, and both backends' JSON
grammars allow any number of them. A weak model under greedy decoding then
writes ``"population": 11111111...`` until ``max_new_tokens``, and the client
gets a cut, unparsable object. So an integer, or the integer part of a
number, has at most `MAX_INTEGER_DIGITS` digits (19: every int64; the sign
aside), a fraction at most `MAX_FRACTION_DIGITS` (17: a double's precision)
and an exponent at most `MAX_EXPONENT_DIGITS` (3: a double's range, 1e308).
Every value a double holds can be written within these bounds, so no value a
client can parse is lost, only ways of writing it (20 digits where an
exponent would do).

The bound applies to the digit repeats the backend's JSON grammar leaves
unbounded. A schema's own range keeps its form: xgrammar writes ``minimum``
and ``maximum`` as a bounded grammar of its own (integers are clamped to
int64 by `json_schema.lower`), and a repeat the schema needs longer than the
bound (``minimum: 1e25`` on a number: at least 26 digits) keeps its minimum.
Not bounded: integers with a ``multipleOf`` and no range (xgrammar writes
them as a recursive rule), and JSON inside structural tags.

- xgrammar: `bound_ebnf_digits` rewrites the EBNF that
  ``Grammar.from_json_schema`` prints (its repeats of ``[0-9]`` and of
  rules that are one ``[0-9]``), which the backend parses back.
- outlines-core: `bound_regex_digits` rewrites its integer and number
  regexes (``outlines_core.json_schema.INTEGER`` / ``NUMBER``) in the regex
  of a schema. A string ``pattern`` spelled exactly like one of them is
  bounded too (narrower, still valid).

Torch-free; called by the backends when they compile a JSON schema.
"""

from __future__ import annotations

import re

MAX_INTEGER_DIGITS = 19
MAX_FRACTION_DIGITS = 17
MAX_EXPONENT_DIGITS = 3

# EBNF tokens as xgrammar prints them: string literals and character classes (both with
# backslash escapes, and either may hold the other's delimiters), unbounded repeats, names.
_EBNF_TOKEN = re.compile(
    r'(?P<string>"(?:\\.|[^"\\])*")'
    r"|(?P<cls>\[(?:\\.|[^\]\\])*\])"
    r"|(?P<repeat>\*|\+|\{\s*(?P<min>\d+)\s*,\s*-1\s*\})"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<space>\s+)"
    r"|(?P<other>.)",
    re.DOTALL,
)
# A rule that is one decimal digit, as xgrammar prints ``basic_number_digits`` and its range helpers.
_DIGIT_RULE = re.compile(r"^(\w+) ::= \(\(\[0-9\]\)\)$", re.MULTILINE)
_DIGIT_CLASS = "[0-9]"
_EXPONENT_MARK = "[eE]"
_DECIMAL_POINT = '"."'


def bound_ebnf_digits(ebnf: str) -> str:
    """xgrammar EBNF with every unbounded repeat of one decimal digit bounded.

    Parameters
    ----------
    ebnf:
        A grammar as ``str(xgr.Grammar)`` prints it (from ``from_json_schema``).

    Returns
    -------
    str
        The same grammar where ``D*``, ``D+`` and ``D{m, -1}`` (``D`` being
        ``[0-9]`` or a rule that is one ``[0-9]``) become ``D{m, max(m, cap)}``:
        the cap is `MAX_FRACTION_DIGITS` after ``"."``, `MAX_EXPONENT_DIGITS`
        after ``[eE]`` (and its sign rule), and `MAX_INTEGER_DIGITS` - 1 else
        (an integer part's digits after its leading ``[1-9]``). String literals
        and classes are left as they are.
    """
    digit_atoms = {_DIGIT_CLASS, *_DIGIT_RULE.findall(ebnf)}
    out: list[str] = []
    recent: list[str] = []  # the last few non-space tokens, oldest first
    for token in _EBNF_TOKEN.finditer(ebnf):
        text = token.group()
        if token.lastgroup == "repeat" and recent and recent[-1] in digit_atoms:
            low = int(token.group("min")) if token.group("min") else (1 if text == "+" else 0)
            high = max(low, _digit_cap(recent[:-1]))
            text = f"{{{low}, {high}}}"
        out.append(text)
        if token.lastgroup != "space":
            recent = [*recent[-2:], token.group()]
    return "".join(out)


def _digit_cap(before: list[str]) -> int:
    """The digits a repeat may take, from the tokens just before its digit atom (oldest first)."""
    if before and before[-1] == _DECIMAL_POINT:
        return MAX_FRACTION_DIGITS
    if _EXPONENT_MARK in before[-2:]:
        return MAX_EXPONENT_DIGITS
    return MAX_INTEGER_DIGITS - 1


def bound_regex_digits(regex: str, integer: str, number: str) -> str:
    """outlines-core's regex of a schema with its integer and number regexes bounded.

    Parameters
    ----------
    regex:
        What ``build_regex_from_schema`` returned.
    integer, number:
        outlines-core's own integer and number regexes
        (``outlines_core.json_schema.INTEGER`` and ``NUMBER``), which it
        pastes into the regex of every ``integer`` and ``number``.

    Returns
    -------
    str
        ``regex`` with each occurrence of ``number``, then of ``integer``
        (which ``number`` contains), written with bounded repeats (see
        `bounded_number_regex`).
    """
    return regex.replace(number, bounded_number_regex(number)).replace(integer, bounded_number_regex(integer))


def bounded_number_regex(number: str) -> str:
    """An integer or number regex in outlines-core's spelling with its digit repeats bounded.

    ``[1-9][0-9]*`` (the integer part) → ``[1-9][0-9]{0,18}``;
    ``\\.[0-9]+`` → ``\\.[0-9]{1,17}``; ``[eE][+-][0-9]+`` → ``[eE][+-][0-9]{1,3}``.
    """
    number = number.replace("[1-9][0-9]*", f"[1-9][0-9]{{0,{MAX_INTEGER_DIGITS - 1}}}")
    number = number.replace(r"\.[0-9]+", rf"\.[0-9]{{1,{MAX_FRACTION_DIGITS}}}")
    return number.replace("[eE][+-][0-9]+", f"[eE][+-][0-9]{{1,{MAX_EXPONENT_DIGITS}}}")
