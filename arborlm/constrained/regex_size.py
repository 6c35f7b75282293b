"""How big a regex is once its counted repetitions are written out, and whether a DFA can hold it.

A DFA builder such as outlines-core's expands ``X{m,n}`` into ``n`` copies of
``X`` (a JSON schema's ``maxLength: 32767`` becomes 32767 copies of the
string-character class), so its time and memory grow with this size, not
with the regex's length: a 291-character regex of three bounded strings took
15 s on this machine. (They grow with ambiguity too, which no cheap measure
sees: a 2.5 KB regex of size 64k took over 5 minutes and 3 GB; a caller that
must answer at once should not build the DFA at all.) The size is found in
microseconds before such a build, so that a caller can refuse what would
take minutes for its repetitions alone.

The regex is read with Python's ``re`` parser (``re._parser``, the standard
library's own), whose syntax covers what JSON-schema converters write; a
pattern it cannot read has no shape (None).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

try:  # Python 3.11 and later
    import re._constants as sre_constants
    import re._parser as sre_parser
except ImportError:  # Python 3.10
    import sre_constants
    import sre_parse as sre_parser

# POSSESSIVE_REPEAT and ATOMIC_GROUP came with Python 3.11; None matches no opcode before it.
_POSSESSIVE_REPEAT = getattr(sre_constants, "POSSESSIVE_REPEAT", None)
_ATOMIC_GROUP = getattr(sre_constants, "ATOMIC_GROUP", None)
_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, _POSSESSIVE_REPEAT)
# What a DFA has no state for: anchors and word boundaries inside, look-arounds, back-references.
_NOT_REGULAR = (sre_constants.AT, sre_constants.ASSERT, sre_constants.ASSERT_NOT, sre_constants.GROUPREF,
                sre_constants.GROUPREF_EXISTS)


@dataclass(frozen=True)
class RegexShape:
    """What `regex_shape` found.

    expanded_size: positions with every counted repetition written out (see `regex_shape`).
    not_regular: the pattern holds an anchor, word boundary, look-around or back-reference.
    """

    expanded_size: int
    not_regular: bool


def regex_shape(pattern: str) -> RegexShape | None:
    """The `RegexShape` of ``pattern``; None when ``re`` cannot parse it. Linear in its length.

    Each literal, class, anchor or escape counts 1; a group its contents; an
    alternation the sum of its branches; ``X{m,n}`` counts ``max(n, 1)`` times
    ``X`` (``n`` unbounded: ``max(m, 1)`` times, as ``X{m}X*``); a look-around
    its contents.
    """
    try:
        parsed = sre_parser.parse(pattern)
    except (re.error, OverflowError, RecursionError, ValueError):
        return None
    return RegexShape(*_shape(parsed))


def _shape(items) -> tuple[int, bool]:
    """(expanded size, not regular) of a parsed sequence, in one walk."""
    size, not_regular = 0, False
    for op, arg in items:
        not_regular = not_regular or op in _NOT_REGULAR
        parts = _parts(op, arg)
        if not parts:
            size += 1
            continue
        copies = 1
        if op in _REPEATS:
            low, high, _ = arg
            copies = max(low, 1) if high == sre_constants.MAXREPEAT else max(high, 1)
        for part in parts:
            part_size, part_not_regular = _shape(part)
            size += copies * part_size
            not_regular = not_regular or part_not_regular
    return size, not_regular


def _parts(op, arg) -> list:
    """The parsed sub-sequences of a group, repeat, alternation or look-around; [] for an atom."""
    if op in _REPEATS:
        return [arg[2]]
    if op == sre_constants.SUBPATTERN:
        return [arg[-1]]
    if op == _ATOMIC_GROUP:
        return [arg]
    if op == sre_constants.BRANCH:
        return list(arg[1])
    if op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
        return [arg[1]]
    return []
