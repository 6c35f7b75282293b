"""Typed gens (`gen(dtype=...)`, `gen_int`, `gen_string`): the regex each one is constrained to,
the stop strings that let the model end a number, and the completion of a literal cut short.

A grammar-constrained generation cut by `max_new_tokens` is only a *prefix* of the literal
(``"Paris, the capit``); a program that appends ``",\\n"`` after it would put that text inside
an open string and ``json.loads`` of the object fails. So the interpreter closes a cut literal
(`complete_literal`), appending only, which also works on text already streamed:

- str: an open escape is finished (``\\`` becomes ``\\\\``, ``\\u12`` becomes ``\\u1200``), then
  the closing quote; the value is the text generated so far (a truncated JSON string).
- int / float: ``-`` or ``1.`` get a ``0``.

Numbers end where the model writes one of `NUMBER_END` (space, newline, ``,`` ...): the regex
allows one such character after the digits and the same characters are stop strings, so the
runtime stops there and trims it (SGLang's ``REGEX_INT`` ends in ``[ \\n]*`` and its programs
pair it with ``stop=[" ", "\\n"]``; this is that pairing, built in). Without it a small model,
which rarely ends a number with EOS in the middle of a text, writes digits up to the bound.
"""

from __future__ import annotations

import re

# A JSON string literal (RFC 8259: no raw control character, only JSON's escapes), so that
# text built from `gen_string()` pieces parses with `json.loads`.
JSON_STRING_REGEX = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
# int and float are JSON number literals (no leading zero, no "+") that Python's int()/float()
# also read, bounded to 18 digits (int64's range) so the grammar always ends.
_JSON_INT = r"-?(0|[1-9][0-9]{0,17})"
_JSON_FLOAT = _JSON_INT + r"(\.[0-9]{1,17})?"
# Characters that end a number: each is a stop string of an int/float gen (trimmed by the
# runtime, so the variable holds the digits only). "." ends an int ("24."), not a float.
INT_END = (" ", "\n", ",", ".", ";", ")", "]", "}")
FLOAT_END = tuple(c for c in INT_END if c != ".")


DTYPE_REGEX = {
    int: _JSON_INT + r"[ \n,.;)\]}]?",  # INT_END, at most once
    float: _JSON_FLOAT + r"[ \n,;)\]}]?",  # FLOAT_END
    bool: r"(True|False)",
    str: JSON_STRING_REGEX,
}
# The stop strings each dtype adds to the gen's own.
DTYPE_STOPS = {int: INT_END, float: FLOAT_END}

_OPEN_ESCAPE = re.compile(r"(\\+)(u[0-9a-fA-F]{0,3})?$")


def _is_complete_string(text: str) -> bool:
    return re.fullmatch(JSON_STRING_REGEX, text) is not None


def complete_literal(dtype: type, text: str) -> str:
    """The text to append to `text`, a prefix of `dtype`'s literal, so that it is a whole one.

    Returns "" when `text` is already complete (or, for str, does not open with a quote). For str, `text` is assumed to be a prefix of a
    JSON string literal (what the grammar lets through); an open escape is finished, then the
    quote closes (an even number of backslashes before the end is a finished escape).
    """
    if dtype is str:
        if _is_complete_string(text) or (text and not text.startswith('"')):  # not a prefix: leave it
            return ""
        prefix = '"' if not text else ""
        escape = _OPEN_ESCAPE.search(text)
        if escape is not None and len(escape.group(1)) % 2 == 1:  # an odd backslash run opens an escape
            if escape.group(2):
                return "0" * (5 - len(escape.group(2))) + '"'
            return '\\"'
        return prefix + '"'
    if dtype in (int, float):
        return "0" if text in ("", "-") or text.endswith(".") else ""
    return ""


def strip_number_end(dtype: type, text: str) -> str:
    """`text` without a trailing number terminator (the runtime trims the stop; a backend that
    keeps stop strings would leave it)."""
    ends = DTYPE_STOPS.get(dtype)
    return text[:-1] if ends and text and text[-1] in ends else text
