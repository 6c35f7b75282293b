"""Shared vocabulary of the JSON schema normaliser: the normalised `Schema`, limits,
keyword families, and helpers on types, numeric bounds and JSON pointers.

Used by `schema_normaliser` (phase A reading), `schema_merge` (phase A
conjunction) and `schema_lowering` (phase B); see `json_schema` for the design.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

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
