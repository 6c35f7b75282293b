"""Phase A of JSON-schema preparation, conjunction: the phase A form of an
`allOf` of phase A schemas (`SchemaMerge.merge`), distributing sibling keywords
over `anyOf`/`oneOf` and intersecting keyword by keyword.

`normalise` merges while it reads the user's schema, and `lower` merges the
schemas a property name falls under; parts that hold a ``$ref`` go back to the
`References` (the normaliser), which unfolds or defers them.
"""

from __future__ import annotations

import math
from typing import Protocol

from arborlm.constrained.json_schema.nodes import (
    MAX_BRANCHES,
    Problems,
    Schema,
    canon,
    intersect_types,
    lower_bound,
    mixed,
    set_bounds,
    tighter,
    upper_bound,
)
from arborlm.constrained.json_schema.regex_budget import RegexBudget
from arborlm.constrained.json_schema.values import json_intersection


class References(Protocol):
    """What `SchemaMerge` asks about ``$ref``s: the document's hoisted ``$defs`` (`Normaliser`)."""

    def merge_refs(self, flat: list[dict], path: str) -> Schema:
        """The conjunction of ``flat``, some of which are (or hold) a ``$ref``; may add a ``$defs`` entry."""
        ...

    def defer(self, flat: list[dict], path: str) -> Schema:
        """The conjunction of ``flat`` (some hold a ``$ref``) as a reference to a new or equal ``$defs`` entry."""
        ...


class SchemaMerge:
    """Phase A conjunction: `merge` of phase A schemas.

    problems: where a keyword that cannot be enforced is recorded.
    refs: conjoins parts that hold ``$ref``s (the normaliser, which may defer
        them into new ``$defs`` entries).
    budget: matches property names against ``patternProperties`` patterns
        (`governing`); its `PatternTimeout` passes through.
    """

    def __init__(self, problems: Problems, refs: References, budget: RegexBudget):
        self.problems = problems
        self.refs = refs
        self.budget = budget

    # -- phase A: conjunction ------------------------------------------------

    def merge(self, parts: list[Schema], path: str) -> Schema:
        """The phase A form of the conjunction of phase A schemas."""
        flat = []
        for p in parts:
            if p is False:
                return False
            if p is not True and p != {}:
                flat.append(p)
        if not flat:
            return {}
        if len(flat) == 1 and not mixed(flat[0]):
            return flat[0]
        if any("$ref" in p for p in flat):
            return self.refs.merge_refs(flat, path)
        expanded = flat
        combinators = [i for i, p in enumerate(expanded) if "anyOf" in p or "oneOf" in p]
        if combinators:
            return self._distribute(expanded, combinators, path)
        out = expanded[0]
        for p in expanded[1:]:
            out = self._conjoin(out, p, path)
            if out is False:
                return False
        return out

    def merge_by_reference(self, parts: list[Schema], path: str) -> Schema:
        """`merge`, except that a conjunction of several parts, one holding a ``$ref``, becomes a
        reference to a ``$defs`` entry (`References.defer`).

        Phase B merges the schemas a property name falls under with it: merged
        in place, two recursive references would unfold inside their own
        lowering without end.
        """
        flat = [p for p in parts if p is not True and p != {}]
        if any(p is False for p in flat):
            return False
        if len(flat) > 1 and any("$ref" in p for p in flat):
            return self.refs.defer(flat, path)
        return self.merge(parts, path)

    def _distribute(self, parts: list[dict], combinators: list[int], path: str) -> Schema:
        size = 1
        for i in combinators:
            p = parts[i]
            count = len(p.get("anyOf", ())) or len(p.get("oneOf", ()))
            if size * count > MAX_BRANCHES:
                self.problems.add("anyOf" if "anyOf" in p else "oneOf", path,
                                  f"more than {MAX_BRANCHES} branches after distributing the keywords beside it")
                parts = parts[:i] + [{k: v for k, v in p.items() if k not in ("anyOf", "oneOf")}] + parts[i + 1 :]
                return self.merge(parts, path)
            size *= count
        i = combinators[0]
        p = parts[i]
        key = "anyOf" if "anyOf" in p else "oneOf"
        rest_parts = parts[:i] + [{k: v for k, v in p.items() if k != key}] + parts[i + 1 :]
        rest = self.merge(rest_parts, path)
        if rest is False:
            return False
        return self.combine(key, [self.merge([rest, b], path) for b in p[key]], path)

    def combine(self, key: str, branches: list[Schema], path: str) -> Schema:
        """``{key: branches}`` (``key``: "anyOf" or "oneOf") simplified: false branches go, nested
        anyOfs flatten, a ``{}`` branch makes an anyOf ``{}``, repeats go; False when none is left."""
        out: list[Schema] = []
        for b in branches:
            if b is False:
                continue
            if key == "anyOf" and set(b) == {"anyOf"}:
                out.extend(b["anyOf"])
            else:
                out.append(b)
        if key == "anyOf":
            if any(b == {} for b in out):
                return {}
            seen: set[str] = set()
            out = [b for b in out if not (canon(b) in seen or seen.add(canon(b)))]
        if not out:
            return False
        if len(out) == 1:
            return out[0]
        return {key: out}

    def _conjoin(self, a: dict, b: dict, path: str) -> Schema:
        """a ∧ b for two plain phase A dicts (no $ref, anyOf, oneOf)."""
        out: dict = {}
        if "type" in a or "type" in b:
            types = intersect_types(a.get("type"), b.get("type"))
            if not types:
                return False
            out["type"] = types
        if "enum" in a or "enum" in b:
            values = a.get("enum", b.get("enum"))
            if "enum" in a and "enum" in b:
                values = json_intersection(a["enum"], b["enum"])
            if not values:
                return False
            out["enum"] = values
        set_bounds(out, tighter(lower_bound(a), lower_bound(b), max),
                    tighter(upper_bound(a), upper_bound(b), lambda bs: min(bs, key=lambda x: (x[0], not x[1]))))
        if "multipleOf" in a or "multipleOf" in b:
            out["multipleOf"] = self._merge_multiple_of(a.get("multipleOf"), b.get("multipleOf"), path)
        for key, pick in (("minLength", max), ("maxLength", min), ("minItems", max), ("maxItems", min),
                          ("minProperties", max), ("maxProperties", min)):
            values = [x[key] for x in (a, b) if key in x]
            if values:
                out[key] = pick(values)
        if "pattern" in a or "pattern" in b:
            out["pattern"] = a.get("pattern", b.get("pattern"))
            if "pattern" in a and "pattern" in b and a["pattern"] != b["pattern"]:
                self.problems.add("pattern", path, "two different patterns on one string cannot be combined")
        if "format" in a or "format" in b:
            if a.get("format", b.get("format")) == b.get("format", a.get("format")):
                out["format"] = a.get("format", b.get("format"))
        self._conjoin_arrays(a, b, out, path)
        self._conjoin_objects(a, b, out, path)
        return out

    def _merge_multiple_of(self, x: float | None, y: float | None, path: str) -> float:
        if x is None or y is None:
            return y if x is None else x
        if x == y or (x / y).is_integer():
            return x
        if (y / x).is_integer():
            return y
        if isinstance(x, int) and isinstance(y, int):
            return x * y // math.gcd(x, y)
        self.problems.add("multipleOf", path, "two multipleOf values cannot be combined")
        return x

    def _conjoin_arrays(self, a: dict, b: dict, out: dict, path: str) -> None:
        prefix_a, prefix_b = a.get("prefixItems", []), b.get("prefixItems", [])
        if prefix_a or prefix_b:
            out["prefixItems"] = [
                self.merge([prefix_a[i] if i < len(prefix_a) else a.get("items", {}),
                            prefix_b[i] if i < len(prefix_b) else b.get("items", {})], path)
                for i in range(max(len(prefix_a), len(prefix_b)))
            ]
        if "items" in a or "items" in b:
            out["items"] = self.merge([a.get("items", {}), b.get("items", {})], path)

    def _conjoin_objects(self, a: dict, b: dict, out: dict, path: str) -> None:
        names = list(dict.fromkeys([*a.get("properties", {}), *b.get("properties", {})]))
        if names:
            out["properties"] = {
                n: self.merge([self.governing(a, n, path), self.governing(b, n, path)], path) for n in names
            }
        if "required" in a or "required" in b:
            out["required"] = list(dict.fromkeys([*a.get("required", []), *b.get("required", [])]))
        if "additionalProperties" in a or "additionalProperties" in b:
            out["additionalProperties"] = self.merge(
                [a.get("additionalProperties", {}), b.get("additionalProperties", {})], path)
        if "propertyNames" in a or "propertyNames" in b:
            out["propertyNames"] = self.merge([a.get("propertyNames", {}), b.get("propertyNames", {})], path)
        pp_a, pp_b = a.get("patternProperties", {}), b.get("patternProperties", {})
        if pp_a or pp_b:
            out["patternProperties"] = self._conjoin_pattern_properties(a, b, path)

    def _conjoin_pattern_properties(self, a: dict, b: dict, path: str) -> dict:
        pp_a, pp_b = a.get("patternProperties", {}), b.get("patternProperties", {})
        add_a, add_b = a.get("additionalProperties", {}), b.get("additionalProperties", {})
        if not pp_b or not pp_a:  # keys matching the one side's patterns meet the other's additionalProperties
            one, other_add = (pp_a, add_b) if pp_a else (pp_b, add_a)
            return {p: self.merge([s, other_add], path) for p, s in one.items()}
        if pp_a.keys() == pp_b.keys():
            return {p: self.merge([pp_a[p], pp_b[p]], path) for p in pp_a}
        if add_a != {} or add_b != {}:
            self.problems.add("patternProperties", path, "two sets of patternProperties beside additionalProperties "
                                                         "cannot be combined")
        merged = dict(pp_a)
        for p, s in pp_b.items():
            merged[p] = self.merge([merged[p], s], path) if p in merged else s
        return merged

    def governing(self, node: dict, name: str, path: str, *, by_reference: bool = False) -> Schema:
        """The schema ``node`` applies to the value of property ``name``.

        by_reference: several matching patterns are conjoined with
        `merge_by_reference` (phase B), not `merge`.
        """
        if name in node.get("properties", {}):
            return node["properties"][name]
        matching = [s for p, s in node.get("patternProperties", {}).items() if self.budget.search(p, name)]
        if matching:
            return self.merge_by_reference(matching, path) if by_reference else self.merge(matching, path)
        return node.get("additionalProperties", {})
