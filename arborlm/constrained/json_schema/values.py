"""JSON values as JSON Schema compares them, and a cheap proof that schemas are disjoint.

`json_key` makes JSON-equal values equal keys (1 == 1.0, true != 1, objects
regardless of key order), so enums can be deduplicated and intersected in
linear time. `mutually_exclusive` proves that no value matches two of a
`oneOf`'s lowered branches, in which case the `oneOf` is their `anyOf`
(used by `lower`). `normalise` and `merge` deduplicate and intersect ``enum``s
with `unique` and `json_intersection`.
"""

from __future__ import annotations

from typing import Any

from arborlm.constrained.json_schema.nodes import Schema


def json_key(value: Any) -> Any:
    """A hashable key of a JSON value: equal keys exactly when the values are equal in JSON
    Schema's sense (1 == 1.0, but true != 1; objects regardless of key order).

    Numbers keep Python's own int/float equality and hash (exact, so 2**53 + 1 != 2.0**53);
    booleans, strings and null are tagged apart from them.
    """
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, (int, float)):
        return ("num", value)
    if isinstance(value, list):
        return ("arr", tuple(json_key(v) for v in value))
    if isinstance(value, dict):
        return ("obj", frozenset((k, json_key(v)) for k, v in value.items()))
    return (type(value).__name__, value)


def unique(values: list) -> list:
    """``values`` without JSON-equal repeats, first occurrences in order (linear time)."""
    seen: set = set()
    out: list = []
    for v in values:
        key = json_key(v)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def json_intersection(values: list, others: list) -> list:
    """The members of ``values`` JSON-equal to a member of ``others``, in order (linear time)."""
    keys = {json_key(w) for w in others}
    return [v for v in values if json_key(v) in keys]


def mutually_exclusive(branches: list[Schema]) -> bool:
    """Whether no JSON value matches two of ``branches`` (lowered schemas), by a cheap pairwise proof.

    Two branches are disjoint when their JSON types are (``integer`` lies
    inside ``number``; an ``enum``'s types are its values'), when both are
    ``enum``s without a common value, or when both are objects only and
    require one property whose ``enum`` values (``const`` is lowered to an
    ``enum``) are disjoint: a discriminator. Anything else (``$ref``, nested
    ``anyOf``, no ``type``) counts as overlapping. A ``oneOf`` of such
    branches is their ``anyOf``.
    """
    live = [b for b in branches if b is not False]
    return all(_disjoint(a, b) for i, a in enumerate(live) for b in live[i + 1 :])


def _disjoint(a: Schema, b: Schema) -> bool:
    types_a, types_b = _value_types(a), _value_types(b)
    if types_a is not None and types_b is not None and not _types_overlap(types_a, types_b):
        return True
    values_a, values_b = _enum_keys(a), _enum_keys(b)
    if values_a is not None and values_b is not None:
        return not values_a & values_b
    if types_a != {"object"} or types_b != {"object"}:
        return False
    common = set(a.get("required", ())) & set(b.get("required", ()))
    for name in common:
        tags_a = _enum_keys(a.get("properties", {}).get(name, {}))
        tags_b = _enum_keys(b.get("properties", {}).get(name, {}))
        if tags_a is not None and tags_b is not None and not tags_a & tags_b:
            return True
    return False


def _value_types(node: Schema) -> set[str] | None:
    """The JSON types ``node`` admits, or None when not known from its own keywords."""
    if not isinstance(node, dict) or any(k in node for k in ("$ref", "anyOf", "oneOf", "allOf")):
        return None
    if "enum" in node:
        return {_json_type(v) for v in node["enum"]}
    if "type" in node:
        return {node["type"]} if isinstance(node["type"], str) else set(node["type"])
    return None


def _enum_keys(node: Schema) -> set | None:
    """The `json_key`s of ``node``'s ``enum`` values, or None when it is not an ``enum``."""
    if not isinstance(node, dict) or "enum" not in node or any(k in node for k in ("$ref", "anyOf", "oneOf")):
        return None
    return {json_key(v) for v in node["enum"]}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def _types_overlap(a: set[str], b: set[str]) -> bool:
    def widen(types: set[str]) -> set[str]:
        return types | {"integer"} if "number" in types else types

    return bool(widen(a) & widen(b))
