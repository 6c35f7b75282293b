"""Keywords no backend enforces, rewritten into equivalent schemas of keywords they do:
``if``/``then``/``else``, ``contains``/``minContains``/``maxContains`` on arrays of bounded
length, ``not`` of ``const`` / ``enum``, and ``$dynamicRef`` in a document of one schema resource.

Runs first in `prepare_json_schema`'s rewrite, for every backend's form, on a fresh copy
of the user's schema; the outputs are still validated against the user's schema as
written. Where a rewrite would not be equivalent the keyword is left as it is, and the
backend's own refusal names it (a 400, or dropped when lenient).

- ``if: I, then: T, else: E`` ≡ ``anyOf: [allOf: [I, T], allOf: [¬I, E]]`` (JSON Schema
  2020-12 core, 10.2.2: ``then`` applies where ``if`` validates, ``else`` where it does
  not), written where `complement` can write ¬I (``if`` over ``type``, ``const``,
  ``enum``, ``required`` and ``properties`` of those).
- ``contains: C`` with ``minContains: m`` (default 1) and ``maxContains: M``, on an array
  of at most `MAX_CONTAINS_ITEMS` items (``maxItems``, or a tuple closed by ``items:
  false``): an ``anyOf`` over the lengths n and the sets of positions P that match C, each
  branch a tuple of length n whose positions in P satisfy C and, when M is given, whose
  others satisfy ¬C (so exactly |P| match; without M, "at least m" needs only |P| = m).
  At most `MAX_CONTAINS_BRANCHES` branches.
- ``not: {const | enum: V}`` (scalars) ≡ `complement`'s schema of every value outside V.
- ``$dynamicRef`` (2020-12): in a document with no embedded ``$id``, the dynamic scope
  holds one schema resource, so a ``$dynamicRef`` resolves as a ``$ref`` to the same
  fragment (core, 8.2.3.2): each ``$dynamicAnchor`` becomes an ``$anchor`` of the same
  name and each ``$dynamicRef`` a ``$ref`` (refused, by the backends, where a name is
  declared twice or a nested ``$id`` opens a second resource).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from arborlm.constrained.json_schema.complement import complement

# The longest array whose `contains` is written out position by position, and the most branches.
MAX_CONTAINS_ITEMS = 6
MAX_CONTAINS_BRANCHES = 64
# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("additionalItems", "additionalProperties", "contains", "else", "if", "items", "not",
        "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# `not` is rewritten only over these (types, `required` and `{}` are the policies' own rewrites).
_VALUE_KEYWORDS = frozenset({"const", "enum"})
_NOT_ARRAY = ("boolean", "null", "number", "object", "string")
_MAP = ("$defs", "definitions", "dependentSchemas", "dependencies", "patternProperties", "properties")


def rewrite_conditionals(schema: Any, year: int) -> Any:
    """``schema`` with ``if``, bounded ``contains`` and single-resource ``$dynamicRef`` rewritten.

    Parameters
    ----------
    schema:
        A fresh copy of the user's schema (changed in place and returned).
    year:
        Its dialect (`nodes.DRAFT_YEAR`): ``if`` exists from draft 7, ``minContains``
        and ``maxContains`` from 2019-09, ``$dynamicRef`` in 2020-12.

    Returns
    -------
    The rewritten schema (equivalent: it accepts exactly the values ``schema`` accepts).
    """
    if year >= 2020 and _single_resource(schema):
        _static_dynamic_refs(schema)
    return _walk(schema, year)


def _walk(node: Any, year: int) -> Any:
    """Rewrite ``node``'s subschemas, then ``node`` itself."""
    if not isinstance(node, dict):
        return node
    for key in _ONE:
        if isinstance(node.get(key), (dict, bool)):
            node[key] = _walk(node[key], year)
    for key in _LIST:
        if isinstance(node.get(key), list):
            node[key] = [_walk(s, year) for s in node[key]]
    for key in _MAP:
        if isinstance(node.get(key), dict):
            node[key] = {name: _walk(s, year) if isinstance(s, (dict, bool)) else s for name, s in node[key].items()}
    if year <= 7 and "$ref" in node:
        return node  # up to draft 7 a $ref's siblings are ignored
    if year >= 7 and "if" in node and ("then" in node or "else" in node):
        _rewrite_if(node, year)
    if "contains" in node:
        _rewrite_contains(node, year)
    if isinstance(node.get("not"), dict) and node["not"] and set(node["not"]) <= _VALUE_KEYWORDS:
        _rewrite_not_values(node, year)
    return node


def _rewrite_not_values(node: dict, year: int) -> None:
    """``not`` of ``const`` / ``enum`` (of scalars) as the positive schema of every other value."""
    negated = complement(node["not"], year)
    if negated is not None:
        del node["not"]
        _add_branches(node, [negated])


def _add_branches(node: dict, branches: list) -> None:
    """Make ``node`` also require one of ``branches`` (an ``anyOf``, or one more ``allOf`` entry)."""
    either = branches[0] if len(branches) == 1 else {"anyOf": branches}
    if "anyOf" not in node and len(branches) > 1:
        node["anyOf"] = branches
    else:
        node["allOf"] = [*node.get("allOf", []), either]


def _both(a: Any, b: Any) -> Any:
    """The conjunction of two schemas, without an ``allOf`` where one side is ``true``."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    return {"allOf": [a, b]}


def _rewrite_if(node: dict, year: int) -> None:
    negated = complement(node["if"], year)
    if negated is None:
        return  # left to the backends' refusal, which names `if`
    condition = node.pop("if")
    then, otherwise = node.pop("then", True), node.pop("else", True)
    _add_branches(node, [_both(condition, then), _both(negated, otherwise)])


def _rewrite_contains(node: dict, year: int) -> None:
    contains = node["contains"]
    minimum = node.get("minContains", 1) if year >= 2019 else 1
    maximum = node.get("maxContains") if year >= 2019 else None
    positions = _positions(node, year)
    if positions is None or not isinstance(minimum, int) or not isinstance(maximum, (int, type(None))):
        return
    negated = complement(contains, year) if maximum is not None else True
    if negated is None:
        return
    shortest = max(node.get("minItems", 0), minimum) if isinstance(node.get("minItems", 0), int) else minimum
    branches: list = []
    for length in range(shortest, len(positions) + 1):
        sizes = [minimum] if maximum is None else range(minimum, min(maximum, length) + 1)
        for size in sizes:
            if len(branches) + math.comb(length, size) > MAX_CONTAINS_BRANCHES:
                return
            for chosen in itertools.combinations(range(length), size):
                items = [_both(positions[i], contains if i in chosen else negated) for i in range(length)]
                branches.append(_tuple(items, year))
    if node.get("type") not in ("array", ["array"]):
        branches.append({"type": list(_NOT_ARRAY)})  # `contains` constrains arrays only
    for key in ("contains", "minContains", "maxContains"):
        node.pop(key, None)
    _add_branches(node, branches or [False])


def _positions(node: dict, year: int) -> list | None:
    """Each position's schema of an array of bounded length, or None when its length is not bounded
    (or bounded above `MAX_CONTAINS_ITEMS`)."""
    if year >= 2020:
        prefix, rest = node.get("prefixItems", []), node.get("items", True)
    elif isinstance(node.get("items"), list):
        prefix, rest = node["items"], node.get("additionalItems", True)
    else:
        prefix, rest = [], node.get("items", True)
    if not isinstance(prefix, list):
        return None
    longest = node.get("maxItems")
    if rest is False:
        longest = len(prefix) if not isinstance(longest, int) else min(longest, len(prefix))
    if not isinstance(longest, int) or longest > MAX_CONTAINS_ITEMS:
        return None
    return [prefix[i] if i < len(prefix) else rest for i in range(longest)]


def _tuple(items: list, year: int) -> dict:
    """An array of exactly ``items``' length whose positions satisfy ``items``."""
    if year >= 2020:
        return {"type": "array", "prefixItems": items, "items": False, "minItems": len(items)}
    return {"type": "array", "items": items, "additionalItems": False, "minItems": len(items)}


def _single_resource(schema: Any) -> bool:
    """True when no subschema below the root declares an ``$id`` (one schema resource)."""
    stack = [(schema, True)]
    while stack:
        node, is_root = stack.pop()
        if isinstance(node, dict):
            if not is_root and "$id" in node:
                return False
            stack.extend((v, False) for k, v in node.items() if k not in ("enum", "const"))
        elif isinstance(node, list):
            stack.extend((v, False) for v in node)
    return True


def _static_dynamic_refs(schema: Any) -> None:
    """``$dynamicAnchor`` → ``$anchor`` and ``$dynamicRef`` → ``$ref``, in place, unless an anchor
    name would then be declared twice (left for the backends to refuse)."""
    anchors: list[str] = []
    nodes = _schema_nodes(schema)
    for node in nodes:
        anchors += [node[k] for k in ("$anchor", "$dynamicAnchor") if isinstance(node.get(k), str)]
    if len(anchors) != len(set(anchors)) or any("$ref" in n and "$dynamicRef" in n for n in nodes):
        return
    for node in nodes:
        if isinstance(node.get("$dynamicAnchor"), str) and "$anchor" not in node:
            node["$anchor"] = node.pop("$dynamicAnchor")
        if isinstance(node.get("$dynamicRef"), str):
            node["$ref"] = node.pop("$dynamicRef")


def _schema_nodes(schema: Any) -> list[dict]:
    """Every subschema object of ``schema`` (by the applicator keywords, not inside ``enum``/``const``)."""
    out, stack = [], [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        out.append(node)
        for key in _ONE:
            stack.append(node.get(key))
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _MAP:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
    return out
