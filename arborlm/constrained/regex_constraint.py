"""What a constraint's regex means: ``.`` spelled out for the grammar backends,
and the final check of a regex-constrained output.

A regex constraint follows Python's ``re.fullmatch`` (the finished output is
checked with it, `validate_regex_output`), and a JSON Schema ``pattern``
follows ECMA-262, as JSON Schema says. In neither does ``.`` match a line
end: Python's leaves out ``\\n`` only; ECMA-262's leaves out the line
terminators ``\\n``, ``\\r``, U+2028 and U+2029. The backends disagree with
both: xgrammar compiles ``.`` to any character (``[\\0-\\U0010ffff]``), and
outlines-core's Rust regex leaves out ``\\n`` only. So before a backend sees a
regex, every ``.`` that stands for "any character" is written as the class
of its dialect (`dot_as_class`); the backends then agree with the validator.

Only a bare ``.`` changes: ``\\.`` and a dot inside a character class
(``[.]``) are literal dots and stay. Python's DOTALL, given inline (``(?s)``
at the start, or a scoped ``(?s:...)`` group; ``(?-s:...)`` turns it off
inside), is honoured: a ``.`` it covers stays, matching every character.

Whatever a backend lets through, no output that breaks the regex is
returned: the front checks every output the grammar ended with
`validate_regex_output` (``GrammarSpec.validate_output``), as it checks JSON
against its schema; a failure becomes an ``abort`` finish and counts in
``num_grammar_violations``.

Torch-free; `dot_as_class` is called by `xgrammar_backend` and
`outlines_backend` for the ``regex`` kind (Python) and by `json_schema.lower`
for ``pattern`` (ECMA); `validate_regex_output` by the front.
"""

from __future__ import annotations

import enum
import re

import regex as regex_module

# Seconds one output's check may take. The front validates on its event loop, which must keep
# answering; the ``regex`` module releases the GIL while it matches and stops at the timeout.
OUTPUT_MATCH_BUDGET_S = 0.05


class RegexDialect(enum.Enum):
    """Whose ``.`` a regex means; the value is the class it is written as."""

    # Python's `re` without DOTALL: any character but a newline.
    PYTHON = r"[^\n]"
    # ECMA-262 (JSON Schema ``pattern``): any character but a line terminator.
    ECMA = r"[^\n\r\u2028\u2029]"


# An inline flag group's head: "(?" flags ["-" flags] (":" for a scoped group, ")" for a global one).
_FLAGS_HEAD = re.compile(r"\(\?([aiLmsux]*)(?:-([imsx]*))?([:)])")


def dot_as_class(regex: str, dialect: RegexDialect) -> str:
    """``regex`` with each "any character" ``.`` written as ``dialect``'s class.

    Parameters
    ----------
    regex:
        A regex in Python or ECMA-262 syntax (their common core: escapes,
        character classes, groups; no nested classes).
    dialect:
        Which ``.`` the regex means (`RegexDialect`).

    Returns
    -------
    str
        The same regex, but for every ``.`` outside a character class, not
        escaped and not under an inline DOTALL flag, which becomes
        ``dialect.value``. A regex that does not parse the way this scanner
        reads it (an unclosed class) comes back with only the dots it read
        before the problem rewritten; the backend then reports the syntax
        error.
    """
    out: list[str] = []
    dotall = [_starts_dotall(regex)]  # one entry per open group: whether DOTALL holds inside it
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\":
            out.append(regex[i : i + 2])
            i += 2
        elif c == "[":
            end = _class_end(regex, i)
            out.append(regex[i:end])
            i = end
        elif c == "(":
            head = _FLAGS_HEAD.match(regex, i)
            if head is not None and head.group(3) == ":":
                dotall.append(_scoped_dotall(dotall[-1], head.group(1), head.group(2) or ""))
            elif head is None or head.group(3) != ")":
                dotall.append(dotall[-1])  # a plain, non-capturing, named or lookaround group
            end = head.end() if head is not None else i + 1
            out.append(regex[i:end])
            i = end
        elif c == ")":
            if len(dotall) > 1:
                dotall.pop()
            out.append(c)
            i += 1
        else:
            out.append(c if c != "." or dotall[-1] else dialect.value)
            i += 1
    return "".join(out)


def _starts_dotall(regex: str) -> bool:
    """Whether a global inline flag group at the start of ``regex`` sets DOTALL (``(?s)``, ``(?is)``)."""
    head = _FLAGS_HEAD.match(regex)
    return head is not None and head.group(3) == ")" and "s" in head.group(1)


def _scoped_dotall(outer: bool, added: str, removed: str) -> bool:
    """DOTALL inside a scoped flag group ``(?added-removed:...)`` opened where it was ``outer``."""
    if "s" in removed:
        return False
    return outer or "s" in added


def _class_end(regex: str, start: int) -> int:
    """The index after the character class that opens at ``regex[start]`` (``len(regex)`` if unclosed).

    As Python and ECMA-262 read a class: a ``]`` right after ``[`` or ``[^``
    is literal (Python), a backslash escapes the next character, and ``[``
    inside is literal.
    """
    j = start + 1
    if j < len(regex) and regex[j] == "^":
        j += 1
    if j < len(regex) and regex[j] == "]":
        j += 1
    while j < len(regex) and regex[j] != "]":
        j += 2 if regex[j] == "\\" else 1
    return min(j + 1, len(regex))


def validate_regex_output(pattern: str, text: str) -> str | None:
    """Check a finished regex-constrained output against the user's regex.

    Parameters
    ----------
    pattern:
        The request's ``regex``, as the user wrote it.
    text:
        The output, without the EOS's text.

    Returns
    -------
    str | None
        None when ``text`` is a full match of ``pattern`` under Python's
        ``re`` semantics (matched with the ``regex`` module, whose default
        mode reads the same syntax, within `OUTPUT_MATCH_BUDGET_S` with the
        GIL released), or when ``pattern`` is in a syntax Python cannot read
        (Rust's ``\\x{41}`` on the outlines backend: the grammar alone
        enforces it). Else a short reason: no full match, or the match ran out
        of time (a regex that backtracks; the output cannot be vouched for).
    """
    try:
        match = regex_module.fullmatch(pattern, text, timeout=OUTPUT_MATCH_BUDGET_S, concurrent=True)
    except regex_module.error:
        return None
    except TimeoutError:
        return f"output could not be checked against the regex within {OUTPUT_MATCH_BUDGET_S:g} s"
    if match is None:
        return f"output is not a full match of the regex {_shorten(pattern)}: {_shorten(text)}"
    return None


def _shorten(text: str, limit: int = 80) -> str:
    return repr(text) if len(text) <= limit else repr(text[: limit - 3] + "...")
