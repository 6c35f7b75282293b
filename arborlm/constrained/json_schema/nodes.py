"""Shared vocabulary of JSON-schema preparation: the normalised `Schema`, the
`Problem`s a phase records, a backend's `Relaxed` schema, limits, keyword
families, and helpers on types, numeric bounds and JSON pointers.

Used by `normalise` (phase A reading), `merge` (phase A conjunction), `lower`
(phase B) and `prepare`; see the package docstring for the design.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from jsonschema import validators as js_validators

PARAM = "json_schema"
# Most anyOf/oneOf branches one schema may have after distributing sibling keywords.
MAX_BRANCHES = 64
# xgrammar enforces integer multipleOf with both bounds only when max - min is below this.
XGRAMMAR_MULTIPLE_OF_SPAN = 10000
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# A schema after normalisation: a dict, or False (accepts nothing). True is written {}.
Schema = dict | bool

DRAFT_YEAR = {
    js_validators.Draft202012Validator: 2020,
    js_validators.Draft201909Validator: 2019,
    js_validators.Draft7Validator: 7,
    js_validators.Draft6Validator: 6,
    js_validators.Draft4Validator: 4,
}
TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
# Keywords that only constrain values of one type (`format` is left out: an annotation).
FAMILY_KEYWORDS = {
    "object": ("properties", "required", "additionalProperties", "patternProperties",
               "propertyNames", "minProperties", "maxProperties"),
    "array": ("prefixItems", "items", "minItems", "maxItems"),
    "string": ("minLength", "maxLength", "pattern"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}
DEFS_PREFIX = "#/$defs/"


def canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


# ---------------------------------------------------------------------------
# What a phase could not enforce, and what a backend relaxed


class Problem(NamedTuple):
    """A keyword the grammar cannot enforce: the keyword, its JSON pointer ("" is the root), and why."""

    keyword: str
    path: str
    reason: str


class Problems:
    """The `Problem`s one phase records, in the order it finds them (`items`)."""

    def __init__(self) -> None:
        self.items: list[Problem] = []

    def add(self, keyword: str, path: str, reason: str) -> None:
        """Record that ``keyword`` at ``path`` cannot be enforced, and why."""
        self.items.append(Problem(keyword, path, reason))


# Most problems a refusal names one by one (the rest are counted).
MAX_NAMED_PROBLEMS = 8


def refusal_message(problems: list[Problem]) -> str:
    """The 400's message for a schema whose ``problems`` the grammar cannot enforce (every backend words it so)."""
    named = [f"{keyword} at {path or '/'} ({reason})" for keyword, path, reason in problems[:MAX_NAMED_PROBLEMS]]
    more = len(problems) - len(named)
    tail = f"; and {more} more" if more > 0 else ""
    return (
        "json_schema uses keywords the grammar cannot enforce: " + "; ".join(named) + tail
        + ". Set json_schema_lenient to leave them out of the grammar; the finished output "
        "is still validated against the whole schema"
    )


def first_of_each(problems: Iterable[Problem]) -> list[Problem]:
    """``problems`` keeping the first of each (keyword, path): phases and reruns may repeat one."""
    seen: set[tuple[str, str]] = set()
    out = []
    for problem in problems:
        if problem[:2] not in seen:
            seen.add(problem[:2])
            out.append(problem)
    return out


@dataclass(frozen=True)
class Relaxed:
    """A schema a backend relaxed for lenient mode (`SchemaPolicy.relax`).

    schema: the schema to compile (used only when ``dropped`` is not empty).
    dropped: what the relaxation left out or let through, as ``"keyword at /json/pointer"``
        (with the reason for what is let through).
    """

    schema: dict
    dropped: tuple[str, ...] = ()


# ---------------------------------------------------------------------------
# Types and bounds


def type_set(value: Any) -> list[str] | None:
    """A schema's ``type`` as a canonical list (``number`` absorbs ``integer``)."""
    if value is None:
        return None
    names = {value} if isinstance(value, str) else set(value)
    if "number" in names:
        names.discard("integer")
    return [t for t in TYPES if t in names]


def intersect_types(a: list[str] | None, b: list[str] | None) -> list[str] | None:
    if a is None or b is None:
        return b if a is None else a
    out = []
    for t in TYPES:
        in_a = t in a or (t == "integer" and "number" in a)
        in_b = t in b or (t == "integer" and "number" in b)
        if in_a and in_b:
            out.append(t)
    return type_set(out)


def lower_bound(node: dict) -> tuple[float, bool] | None:
    """(value, exclusive) of the tightest lower bound, or None."""
    bounds = []
    if "minimum" in node:
        bounds.append((node["minimum"], False))
    if "exclusiveMinimum" in node:
        bounds.append((node["exclusiveMinimum"], True))
    return max(bounds, default=None, key=lambda b: (b[0], b[1]))


def upper_bound(node: dict) -> tuple[float, bool] | None:
    bounds = []
    if "maximum" in node:
        bounds.append((node["maximum"], False))
    if "exclusiveMaximum" in node:
        bounds.append((node["exclusiveMaximum"], True))
    return min(bounds, default=None, key=lambda b: (b[0], not b[1]))


def set_bounds(node: dict, lower: tuple | None, upper: tuple | None) -> None:
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        node.pop(key, None)
    if lower is not None:
        node["exclusiveMinimum" if lower[1] else "minimum"] = lower[0]
    if upper is not None:
        node["exclusiveMaximum" if upper[1] else "maximum"] = upper[0]


def tighter(a: tuple | None, b: tuple | None, pick: Callable) -> tuple | None:
    if a is None or b is None:
        return b if a is None else a
    return pick([a, b])


# ---------------------------------------------------------------------------
# Pointers and node shapes


def escape_pointer(segment: str) -> str:
    return str(segment).replace("~", "~0").replace("/", "~1")


def mixed(p: dict) -> bool:
    """True when a phase A candidate has $ref or a combinator beside other keywords."""
    if len(p) <= 1:
        return False
    return "$ref" in p or "anyOf" in p or "oneOf" in p
