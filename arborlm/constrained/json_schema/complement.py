"""The complement of a small JSON schema as a positive schema: what ``not: S`` means, written
with the keywords every backend enforces (``type``, ``enum``, numeric bounds, string lengths
and ``pattern``, ``properties``, ``required``, ``anyOf``).

Used by `conditionals` for ``if`` (``else`` applies where the ``if`` schema fails) and for
``maxContains`` (items that do not match ``contains``). Only schemas built from ``type``,
``const``, ``enum`` of scalars, ``required`` and ``properties`` of such schemas have a
complement here; `complement` returns None for the rest, and the caller leaves the keyword
to the backend's refusal.

The rules, for a conjunction S = C1 ∧ ... ∧ Cn: ¬S = ¬C1 ∨ ... ∨ ¬Cn, with
- ¬type T: the other JSON types ("integer" without "number" has no complement: a grammar
  cannot write "a number that is not an integer" as a type);
- ¬required [n, ...]: an object lacking one of them (``properties: {n: false}``);
- ¬properties {p: P}: an object with p present whose value fails P (¬P again);
- ¬enum V (V finite, scalar): the values of the other types, the other booleans, numbers
  in the open intervals between V's numbers, and strings that are none of V's strings (a
  regular language: `not_strings_pattern` writes its regex from V's trie).
Non-objects satisfy ``required`` and ``properties``, so their complements are objects only.
"""

from __future__ import annotations

from typing import Any

# Annotations the complement may ignore (they never change which instances are valid).
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated",
                          "readOnly", "writeOnly"})
_ALL_TYPES = ("array", "boolean", "null", "number", "object", "string")
# Most strings an enum complement writes into one pattern (its regex grows with their total length).
MAX_COMPLEMENT_STRINGS = 64
MAX_COMPLEMENT_CHARS = 2048
# Any character, the line terminators included (an ECMA-262 `.` leaves them out).
_ANY_CHAR = r"[\s\S]"
_SYNTAX_CHARS = frozenset("^$\\.*+?()[]{}|/")


def complement(schema: Any, year: int) -> Any | None:
    """A schema that accepts exactly the JSON values ``schema`` rejects, or None when this
    module cannot write one (see the module docstring for the forms it takes).

    Parameters
    ----------
    schema:
        A raw JSON Schema value (a dict or a boolean) of dialect ``year`` (2020, 2019, 7, 6 or 4).
    year:
        The dialect (`nodes.DRAFT_YEAR`); draft 4 has no numeric exclusive bounds, so its
        numbers have no complement here.

    Returns
    -------
    A dict or boolean schema of the same dialect, or None.
    """
    if schema is True or schema == {}:
        return False
    if schema is False:
        return True
    if not isinstance(schema, dict) or set(schema) - _ANNOTATIONS - {"type", "const", "enum", "required",
                                                                     "properties"}:
        return None
    pieces: list = []
    for keyword, value in schema.items():
        piece = _complement_of(keyword, value, year)
        if piece is None:
            return None
        if piece is not False:
            pieces.append(piece)
    if not pieces:
        return False
    return pieces[0] if len(pieces) == 1 else {"anyOf": pieces}


def _complement_of(keyword: str, value: Any, year: int) -> Any | None:
    """The complement of one keyword of a schema (False: it accepts every value)."""
    if keyword in _ANNOTATIONS:
        return False
    if keyword == "type":
        return _not_types(value)
    if keyword == "const":
        return not_values([value], year)
    if keyword == "enum":
        return not_values(value, year) if isinstance(value, list) else None
    if keyword == "required":
        if not isinstance(value, list) or not value:
            return False
        lacking = [{"type": "object", "properties": {name: False}} for name in value]
        return lacking[0] if len(lacking) == 1 else {"anyOf": lacking}
    if keyword == "properties":
        if not isinstance(value, dict):
            return None
        failing = []
        for name, sub in value.items():
            negated = complement(sub, year)
            if negated is None:
                return None
            if negated is not False:
                failing.append({"type": "object", "required": [name], "properties": {name: negated}})
        if not failing:
            return False
        return failing[0] if len(failing) == 1 else {"anyOf": failing}
    return None


def _not_types(value: Any) -> Any | None:
    types = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else None
    if types is None:
        return None
    if "integer" in types and "number" not in types:
        return None
    left = [t for t in _ALL_TYPES if t not in types]
    return {"type": left} if left else False


def not_values(values: list, year: int) -> Any | None:
    """A schema for every JSON value that is none of ``values`` (scalars), or None.

    None when a value is an array or object, when there are more strings than
    `MAX_COMPLEMENT_STRINGS` (or longer than `MAX_COMPLEMENT_CHARS` in all), or
    when numbers are excluded under draft 4 (no numeric exclusive bounds).
    """
    if any(isinstance(v, (list, dict)) for v in values):
        return None
    booleans = {v for v in values if isinstance(v, bool)}
    numbers = sorted({v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)})
    strings = sorted({v for v in values if isinstance(v, str)})
    pieces: list = [{"type": ["array", "object"]}]
    if None not in values:
        pieces.append({"type": "null"})
    other_booleans = [b for b in (False, True) if b not in booleans]
    if other_booleans:
        pieces.append({"type": "boolean"} if len(other_booleans) == 2 else {"enum": other_booleans})
    if not numbers:
        pieces.append({"type": "number"})
    elif year == 4:
        return None
    else:
        pieces.extend(_number_gaps(numbers))
    if not strings:
        pieces.append({"type": "string"})
    elif len(strings) > MAX_COMPLEMENT_STRINGS or sum(map(len, strings)) > MAX_COMPLEMENT_CHARS:
        return None
    else:
        pieces.append({"type": "string", "pattern": not_strings_pattern(strings)})
    return {"anyOf": pieces}


def _number_gaps(numbers: list) -> list[dict]:
    """The open intervals between (and beyond) the sorted distinct ``numbers``.

    JSON Schema compares numbers by value (1 and 1.0 are one number), so the
    excluded values are exactly the interval ends.
    """
    gaps = [{"type": "number", "exclusiveMaximum": numbers[0]}]
    gaps += [{"type": "number", "exclusiveMinimum": lo, "exclusiveMaximum": hi} for lo, hi in zip(numbers, numbers[1:])]
    gaps.append({"type": "number", "exclusiveMinimum": numbers[-1]})
    return gaps


def not_strings_pattern(strings: list[str]) -> str:
    """An anchored ECMA-262 pattern matching exactly the strings that are none of ``strings``.

    Built over the trie of ``strings``: at a trie node a string may end there
    (when no excluded string does), go on with a character that leaves the
    trie (then anything), or follow a child. The regex has one alternative per
    trie edge, so its length is linear in the strings' total length.
    """
    trie: dict = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}  # the end of an excluded string
    return "^" + _not_in_trie(trie) + "$"


def _not_in_trie(node: dict) -> str:
    children = sorted(k for k in node if k)
    alternatives = [] if "" in node else [""]
    if children:
        others = "".join(_class_char(c) for c in children)
        alternatives.append(f"[^{others}]{_ANY_CHAR}*")
        alternatives.extend(_literal_char(c) + _not_in_trie(node[c]) for c in children)
    else:
        alternatives.append(f"{_ANY_CHAR}+")  # longer than the excluded string that ends here
    return "(?:" + "|".join(alternatives) + ")"


def _literal_char(ch: str) -> str:
    """``ch`` as a regex literal: only the syntax characters are escaped (an escaped letter or
    ``~`` is an error in some engines' ECMA-262 modes)."""
    return "\\" + ch if ch in _SYNTAX_CHARS else ch


def _class_char(ch: str) -> str:
    """``ch`` written safely inside a character class."""
    return "\\" + ch if ch in "\\]^-[" else ch
