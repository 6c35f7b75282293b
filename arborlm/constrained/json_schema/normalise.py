"""Phase A of JSON-schema preparation, normalising: the user's schema, of any
draft, becomes an equivalent 2020-12 schema of a few simple shapes that
`lower` then maps to what the grammar compiles.

`Normaliser.run` reads the schema keyword by keyword (`Normaliser.node`);
conjunctions are `merge`'s (`SchemaMerge`), and references are resolved and
hoisted here. Runs in the front, inside `prepare_json_schema`, for a backend
whose `SchemaPolicy` asks for the xgrammar form.

What changes, keeping the meaning: keywords the dialect's validator ignores
are dropped (annotations such as ``title``, ``description``, ``default``,
``examples``, ``$comment``, ``deprecated``, ``readOnly``; unknown keywords;
siblings of ``$ref`` up to draft 7); draft-4/7 forms become 2020-12 ones
(``items`` arrays → ``prefixItems``, boolean exclusive bounds → numeric,
``dependencies`` → dependent required/schemas, ``const`` → ``enum``); every
``$ref`` is resolved (``$id``, anchors and JSON pointers, with
``referencing``, as ``jsonschema`` does) and its target hoisted into the root
``$defs``, so recursive schemas stay recursive; ``allOf`` branches and the
siblings of a ``$ref`` are merged into one schema (types intersect, bounds
tighten, ``properties`` merge recursively, ``required`` unions, a property one
side lists and the other leaves to ``patternProperties``/``additionalProperties``
gets both schemas; a recursive reference merged with other keywords becomes a
new ``$defs`` entry); keywords beside ``anyOf``/``oneOf`` are distributed into
every branch (A ∧ (B ∨ C) = (A ∧ B) ∨ (A ∧ C), and the same for ``oneOf``);
``not`` of ``{}``, of a ``type`` or of ``required`` becomes a positive schema;
each dependency becomes an ``anyOf`` ("trigger absent" or "trigger present and
its requirement holds").

Before this phase `conditionals` rewrites ``if``/``then``/``else``, ``contains`` on arrays
of bounded length and ``$dynamicRef`` in a single-resource document where an equivalent
schema exists; what it leaves is refused here.

Recorded as problems (refused unless lenient): ``not`` other than of ``{}``,
a type or ``required``; ``if``; ``contains`` (and ``minContains``/``maxContains``);
``uniqueItems: true`` (unless at most one item); ``unevaluated*`` beside
in-place applicators; ``$dynamicRef``/``$recursiveRef``; more than
`MAX_BRANCHES` branches after distribution; two different ``pattern``s or
``multipleOf``s that cannot be combined. A ``$ref`` that cannot be resolved
inside the document and a cycle of bare references are errors even when
lenient.
"""

from __future__ import annotations

import re
from typing import Any

import referencing.jsonschema
from referencing import Registry
from referencing.exceptions import Unresolvable

from arborlm.constrained.json_schema.conditionals import MAX_CONTAINS_BRANCHES, MAX_CONTAINS_ITEMS
from arborlm.constrained.json_schema.merge import SchemaMerge
from arborlm.constrained.json_schema.nodes import (
    DEFS_PREFIX,
    DRAFT_YEAR,
    PARAM,
    TYPES,
    Problems,
    Schema,
    canon,
    escape_pointer,
    lower_bound,
    set_bounds,
    type_set,
    upper_bound,
)
from arborlm.constrained.json_schema.property_names import names_as_properties
from arborlm.constrained.json_schema.regex_budget import RegexBudget
from arborlm.constrained.json_schema.values import json_intersection, unique
from arborlm.constrained.keys import GrammarError

# Most conjunctions of recursive references one schema may defer into new $defs entries.
MAX_DEFERRED = 256
# Most conjunctions of references unfolded one inside the other; a deeper one is deferred into
# a $defs entry, computed later from the top of the stack. Each level takes a few Python frames:
# a chain of 400 definitions, each merged with its siblings, ran out of stack (a RecursionError,
# or a panic inside `referencing`'s Rust maps) before.
MAX_UNFOLD_DEPTH = 32
_SPECIFICATIONS = {
    2020: referencing.jsonschema.DRAFT202012,
    2019: referencing.jsonschema.DRAFT201909,
    7: referencing.jsonschema.DRAFT7,
    6: referencing.jsonschema.DRAFT6,
    4: referencing.jsonschema.DRAFT4,
}
_NON_OBJECT = ["array", "boolean", "null", "number", "string"]
# Keywords that evaluate the instance in place (they change what "unevaluated" means).
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "$ref", "$dynamicRef", "$recursiveRef",
             "dependentSchemas", "dependencies")
# Keywords a validator function reads beside the keyword it is registered under.
_COMPANIONS = {"if": ("then", "else"), "contains": ("minContains", "maxContains"),
               "minimum": ("exclusiveMinimum",), "maximum": ("exclusiveMaximum",)}


class Normaliser:
    """Phase A over one schema document: `run` gives the root, `defs_a` the hoisted ``$defs``.

    In the result a dict is one of: ``{}``, ``{"$ref": "#/$defs/<name>"}``,
    ``{"anyOf"|"oneOf": [...]}`` alone, or plain keywords with no ``$ref``,
    ``allOf``, ``anyOf``, ``oneOf``, ``not`` or dependencies; False accepts
    nothing. `merger` (the conjunction) is also what phase B merges with, and
    it may add ``$defs`` entries then; `problems` collects what phase A (and
    any later merge) cannot enforce.

    Parameters
    ----------
    root:
        The user's schema (an object), checked against its dialect.
    cls:
        The ``jsonschema`` validator class of its dialect (a key of `DRAFT_YEAR`).
    budget:
        Matches user patterns against user strings, here and in the merges
        (`SchemaMerge.budget`); its `PatternTimeout` passes through.
    """

    def __init__(self, root: dict, cls: type, budget: RegexBudget):
        self.root = root
        self.year = DRAFT_YEAR[cls]
        self.keywords = frozenset(cls.VALIDATORS).union(
            *(_COMPANIONS.get(k, ()) for k in cls.VALIDATORS))
        self.spec = _SPECIFICATIONS[self.year]
        self.root_resolver = Registry().resolver_with_root(self.spec.create_resource(root))
        self.paths: dict[int, str] = {}
        self._index_paths(root, "")
        self.def_names: dict[int, str] = {}  # id(target) -> name
        self.targets: dict[str, tuple[Any, Any, str]] = {}  # name -> (target, resolver, path)
        self.defs_a: dict[str, Schema] = {}
        self.unfolding: set[str] = set()  # defs being normalised
        self.merging: set[tuple] = set()  # conjunctions of references being merged
        self.deferred: dict[str, list[Schema]] = {}  # name -> the parts of a deferred conjunction
        self.deferred_names: dict[tuple, str] = {}
        self.problems = Problems()
        self.merger = SchemaMerge(self.problems, self, budget)

    # -- driver --------------------------------------------------------------

    def run(self) -> Schema:
        """The phase A form of the root; every def it reaches is then in `defs_a`.

        Raises
        ------
        GrammarError
            A ``$ref`` cannot be resolved inside the document, or a cycle of
            references never reaches a schema.
        """
        self._check_references()
        root_a = self.node(self.root, self.root_resolver, "")
        self._close_defs(root_a)
        return root_a

    def def_path(self, name: str) -> str:
        """The JSON pointer of the user's schema that ``$defs`` entry ``name`` stands for."""
        return self.targets[name][2]

    def _index_paths(self, value: Any, path: str) -> None:
        if isinstance(value, dict):
            self.paths.setdefault(id(value), path)
            for k, v in value.items():
                self._index_paths(v, f"{path}/{escape_pointer(k)}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                self._index_paths(v, f"{path}/{i}")

    def _close_defs(self, root_a: Schema) -> None:
        """Normalise every def reachable from ``root_a`` (phase A, before lowering).

        Raises GrammarError for a cycle of references that never reaches a schema.
        """
        todo = list(_refs_in(root_a))
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            todo.extend(_refs_in(self.def_a(name)))
        for name in seen:
            chain = [name]
            while isinstance(self.defs_a[chain[-1]], dict) and set(self.defs_a[chain[-1]]) == {"$ref"}:
                chain.append(self.defs_a[chain[-1]]["$ref"][len(DEFS_PREFIX) :])
                if chain[-1] in chain[:-1]:
                    where = self.targets[name][2] or "/"
                    raise GrammarError(f"json_schema: the $ref at {where} only leads to itself", PARAM)

    # -- phase A: references -------------------------------------------------

    def hoist(self, ref: str, resolver: Any, path: str) -> Schema:
        """``{"$ref": "#/$defs/<name>"}`` for the target of ``ref`` (or the boolean it names)."""
        resolved = self._lookup(ref, resolver, path)
        target = resolved.contents
        if isinstance(target, bool):
            return {} if target else False
        name = self.def_names.get(id(target))
        if name is None:
            target_path = self.paths[id(target)]
            base = re.sub(r"[^A-Za-z0-9_.-]", "_", target_path.rsplit("/", 1)[-1]) or "root"
            name, k = base, 1
            while name in self.targets:
                k += 1
                name = f"{base}_{k}"
            self.def_names[id(target)] = name
            self.targets[name] = (target, resolved.resolver, target_path)
        return {"$ref": DEFS_PREFIX + name}

    def _lookup(self, ref: str, resolver: Any, path: str) -> Any:
        """The resolved target of ``ref``: a boolean, or a schema object of this document.

        Raises
        ------
        GrammarError
            It cannot be resolved, or it points outside the document.
        """
        try:
            resolved = resolver.lookup(ref)
        except Unresolvable as e:
            why = {"PointerToNowhere": "no such location in the schema", "NoSuchAnchor": "no such anchor"}
            raise GrammarError(f"json_schema: $ref {ref!r} at {path or '/'} cannot be resolved: "
                               f"{why.get(type(e).__name__, 'not inside the schema (remote references are not fetched)')}",
                               PARAM) from e
        except (TypeError, ValueError) as e:  # `referencing` walking a pointer through a boolean, or "x" as an index
            raise GrammarError(f"json_schema: $ref {ref!r} at {path or '/'} cannot be resolved: "
                               "no such location in the schema", PARAM) from e
        target = resolved.contents
        if not isinstance(target, bool) and (not isinstance(target, dict) or id(target) not in self.paths):
            raise GrammarError(
                f"json_schema: $ref {ref!r} at {path or '/'} points outside the schema; "
                "only references inside the schema document are supported",
                PARAM,
            )
        return resolved

    def _check_references(self) -> None:
        """Resolve every ``$ref`` of the document, also those in subschemas phase A leaves out
        (an ``if`` without ``then`` or ``else``), which the output validation still follows.

        Raises GrammarError as `_lookup`, for the first that fails.
        """
        todo = [(self.spec.create_resource(self.root), self.root_resolver)]
        while todo:
            resource, resolver = todo.pop()
            resolver = resolver.in_subresource(resource)
            contents = resource.contents
            if isinstance(contents, dict) and isinstance(contents.get("$ref"), str):
                self._lookup(contents["$ref"], resolver, self.paths.get(id(contents), ""))
            todo.extend((sub, resolver) for sub in resource.subresources())

    def def_a(self, name: str) -> Schema:
        """Phase A form of a hoisted target (or of a deferred conjunction), computed once."""
        if name not in self.defs_a:
            target, resolver, path = self.targets[name]
            self.unfolding.add(name)
            try:
                if name in self.deferred:
                    self.defs_a[name] = self.merger.merge(self.deferred[name], path)
                else:
                    self.defs_a[name] = self.node(target, resolver, path)
            finally:
                self.unfolding.discard(name)
        return self.defs_a[name]

    def merge_refs(self, flat: list[dict], path: str) -> Schema:
        """The conjunction of ``flat``, some of which are (or hold) a ``$ref``.

        The targets are unfolded and merged in place, except when the same
        conjunction is already being merged further up, or a target is still
        being normalised (a recursive schema), or `MAX_UNFOLD_DEPTH`
        conjunctions are being merged one inside the other: then the
        conjunction becomes a new ``$defs`` entry, computed later, so the
        recursion stays a reference.
        """
        names = sorted({p["$ref"][len(DEFS_PREFIX) :] for p in flat if "$ref" in p})
        plain = [{k: v for k, v in p.items() if k != "$ref"} for p in flat]
        plain = [p for p in plain if p != {}]
        if len(names) == 1 and not plain:
            return {"$ref": DEFS_PREFIX + names[0]}
        key = (tuple(names), tuple(sorted(canon(p) for p in plain)))
        if key in self.merging or any(n in self.unfolding for n in names) or len(self.merging) >= MAX_UNFOLD_DEPTH:
            return self._deferred_ref(key, names, plain, path)
        self.merging.add(key)
        try:
            return self.merger.merge([self.def_a(n) for n in names] + plain, path)
        finally:
            self.merging.discard(key)

    def defer(self, flat: list[dict], path: str) -> Schema:
        """The conjunction of ``flat`` (some hold a ``$ref``) as a reference to a ``$defs`` entry of its own.

        For phase B, which merges the schemas a property name falls under
        (its ``properties`` entry and the ``patternProperties`` it matches):
        merged in place, a conjunction of recursive references is lowered in
        place again inside itself, without end (a RecursionError before). As
        an entry it is lowered once, like any def. A deferred entry among the
        parts stands for its own parts, so a conjunction is one entry however
        it is reached, and there are finitely many.
        """
        names, plain = self._flat_parts(flat)
        if len(names) == 1 and not plain:
            return {"$ref": DEFS_PREFIX + names[0]}
        key = (tuple(names), tuple(sorted(canon(p) for p in plain)))
        return self._deferred_ref(key, names, plain, path)

    def _flat_parts(self, flat: list[dict]) -> tuple[list[str], list[dict]]:
        """The def names ``flat`` references, deferred entries replaced by their parts, and its other parts."""
        names: set[str] = set()
        plain: dict[str, dict] = {}  # canonical text -> part, so that repeats count once
        expanded: set[str] = set()
        todo = list(flat)
        while todo:
            part = todo.pop()
            ref = part.get("$ref")
            name = ref[len(DEFS_PREFIX) :] if isinstance(ref, str) else None
            if name in self.deferred:
                if name not in expanded:
                    expanded.add(name)
                    todo.extend(self.deferred[name])
            elif name is not None:
                names.add(name)
            rest = {k: v for k, v in part.items() if k != "$ref"}
            if rest:
                plain.setdefault(canon(rest), rest)
        return sorted(names), list(plain.values())

    def _deferred_ref(self, key: tuple, names: list[str], plain: list[dict], path: str) -> Schema:
        name = self.deferred_names.get(key)
        if name is None:
            if len(self.deferred) >= MAX_DEFERRED:
                self.problems.add("$ref", path, "too many recursive references merged with other keywords")
                return {"$ref": DEFS_PREFIX + names[0]}
            name = f"merged_{len(self.deferred) + 1}"
            while name in self.targets:
                name += "_"
            self.deferred_names[key] = name
            self.deferred[name] = [{"$ref": DEFS_PREFIX + n} for n in names] + plain
            self.targets[name] = (None, None, path)
        return {"$ref": DEFS_PREFIX + name}

    # -- phase A: one schema -------------------------------------------------

    def node(self, raw: Any, resolver: Any, path: str) -> Schema:
        """The phase A form of the user's subschema ``raw`` found at ``path``."""
        if raw is True:
            return {}
        if raw is False:
            return False
        resolver = resolver.in_subresource(self.spec.create_resource(raw))
        kw = {k: v for k, v in raw.items() if k in self.keywords}
        if "$ref" in kw and self.year <= 7:
            kw = {"$ref": kw["$ref"]}  # up to draft 7, $ref overrides its siblings
        own: dict = {}
        parts: list[Schema] = []
        self._type_and_values(kw, own)
        self._numbers(kw, own, path)
        self._strings(kw, own)
        self._arrays(kw, own, resolver, path)
        self._objects(kw, own, resolver, path)
        parts.append(own)
        self._applicators(kw, parts, resolver, path)
        self._dependencies(kw, parts, resolver, path)
        return names_as_properties(self.merger.merge(parts, path))

    def _type_and_values(self, kw: dict, own: dict) -> None:
        if "type" in kw:
            own["type"] = type_set(kw["type"])
        values = None
        if "enum" in kw:
            values = unique(kw["enum"])
        if "const" in kw:
            const = [kw["const"]]
            values = const if values is None else json_intersection(const, values)
        if values is not None:
            own["enum"] = values

    def _numbers(self, kw: dict, own: dict, path: str) -> None:
        lower = upper = None
        if self.year == 4:  # boolean exclusive bounds modify minimum / maximum
            if "minimum" in kw:
                lower = (kw["minimum"], kw.get("exclusiveMinimum") is True)
            if "maximum" in kw:
                upper = (kw["maximum"], kw.get("exclusiveMaximum") is True)
        else:
            lower = lower_bound(kw)
            upper = upper_bound(kw)
        set_bounds(own, lower, upper)
        if "multipleOf" in kw:
            own["multipleOf"] = kw["multipleOf"]

    def _strings(self, kw: dict, own: dict) -> None:
        for key in ("minLength", "maxLength", "pattern", "format"):
            if key in kw:
                own[key] = kw[key]

    def _arrays(self, kw: dict, own: dict, resolver: Any, path: str) -> None:
        items = kw.get("items")
        if isinstance(items, list):  # up to 2019-09: a tuple, then additionalItems
            own["prefixItems"] = [self.node(s, resolver, f"{path}/items/{i}") for i, s in enumerate(items)]
            if "additionalItems" in kw:
                own["items"] = self.node(kw["additionalItems"], resolver, f"{path}/additionalItems")
        elif "items" in kw:
            own["items"] = self.node(items, resolver, f"{path}/items")
        if "prefixItems" in kw:
            own["prefixItems"] = [self.node(s, resolver, f"{path}/prefixItems/{i}")
                                  for i, s in enumerate(kw["prefixItems"])]
        for key in ("minItems", "maxItems"):
            if key in kw:
                own[key] = kw[key]
        if kw.get("uniqueItems") is True and kw.get("maxItems", 2) > 1:
            self.problems.add("uniqueItems", path, "a grammar cannot compare items")
        if "contains" in kw and not (kw.get("minContains") == 0 and "maxContains" not in kw and self.year >= 2019):
            self.problems.add("contains", path, "a grammar cannot require an item anywhere in an array of "
                              f"unbounded length (written out only up to {MAX_CONTAINS_ITEMS} items, "
                              f"{MAX_CONTAINS_BRANCHES} branches, and maxContains where contains has a complement)")
        if "unevaluatedItems" in kw:
            if any(k in kw for k in _IN_PLACE):
                self.problems.add("unevaluatedItems", path, "beside in-place applicators")
            elif "items" not in own:
                own["items"] = self.node(kw["unevaluatedItems"], resolver, f"{path}/unevaluatedItems")

    def _objects(self, kw: dict, own: dict, resolver: Any, path: str) -> None:
        if "properties" in kw:
            own["properties"] = {
                name: self.node(s, resolver, f"{path}/properties/{escape_pointer(name)}")
                for name, s in kw["properties"].items()
            }
        if "patternProperties" in kw:
            own["patternProperties"] = {
                pattern: self.node(s, resolver, f"{path}/patternProperties/{escape_pointer(pattern)}")
                for pattern, s in kw["patternProperties"].items()
            }
        if "additionalProperties" in kw:
            own["additionalProperties"] = self.node(kw["additionalProperties"], resolver,
                                                      f"{path}/additionalProperties")
        if "propertyNames" in kw:
            own["propertyNames"] = self.node(kw["propertyNames"], resolver, f"{path}/propertyNames")
        if kw.get("required"):
            own["required"] = list(dict.fromkeys(kw["required"]))
        for key in ("minProperties", "maxProperties"):
            if key in kw:
                own[key] = kw[key]
        if "unevaluatedProperties" in kw:
            if any(k in kw for k in _IN_PLACE):
                self.problems.add("unevaluatedProperties", path, "beside in-place applicators")
            elif "additionalProperties" not in own:
                own["additionalProperties"] = self.node(kw["unevaluatedProperties"], resolver,
                                                          f"{path}/unevaluatedProperties")

    def _applicators(self, kw: dict, parts: list, resolver: Any, path: str) -> None:
        if "$ref" in kw:
            parts.append(self.hoist(kw["$ref"], resolver, path))
        for key in ("$dynamicRef", "$recursiveRef"):
            if key in kw:
                self.problems.add(key, path, "dynamic references are enforced only in a document of one "
                                  "schema resource (no nested $id) with each anchor name declared once")
        for i, branch in enumerate(kw.get("allOf", ())):
            parts.append(self.node(branch, resolver, f"{path}/allOf/{i}"))
        for key in ("anyOf", "oneOf"):
            if key in kw:
                parts.append({key: [self.node(b, resolver, f"{path}/{key}/{i}") for i, b in enumerate(kw[key])]})
        if "not" in kw:
            parts.append(self._negate(kw["not"], resolver, path))
        if "if" in kw and ("then" in kw or "else" in kw):
            self.problems.add("if", path, "enforced only where the if schema's complement can be written: "
                              "if over type, const, enum, required and properties of those")

    def _negate(self, raw: Any, resolver: Any, path: str) -> Schema:
        """A positive schema for ``not: raw``, or {} after recording a problem."""
        negated = self.node(raw, resolver, f"{path}/not")
        if negated is False:
            return {}
        if negated == {}:
            return False
        keys = set(negated)
        if keys == {"type"}:
            present = set(negated["type"])
            if "integer" in present and "number" not in present:
                self.problems.add("not", path, "a grammar cannot exclude integers from numbers")
                return {}
            left = [t for t in TYPES if t not in present and t != "integer"]
            return {"type": left} if left else False
        if keys == {"required"} or (keys == {"required", "type"} and negated["type"] == ["object"]):
            names = negated["required"]
            absent = [{"type": ["object"], "properties": {n: False}} for n in names]
            if keys == {"required"}:  # non-objects satisfy `required`, so fail its negation
                return absent[0] if len(absent) == 1 else {"anyOf": absent}
            others = {"type": [t for t in TYPES if t not in ("object", "integer")]}
            return {"anyOf": [others, *absent]}
        self.problems.add("not", path, "only the negation of {}, of a type or of required is supported")
        return {}

    def _dependencies(self, kw: dict, parts: list, resolver: Any, path: str) -> None:
        triggers: list[tuple[str, Schema]] = []
        for keyword in ("dependencies", "dependentRequired", "dependentSchemas"):
            for name, dep in kw.get(keyword, {}).items():
                if isinstance(dep, list):
                    requirement: Schema = {"required": list(dep)} if dep else {}
                else:  # the schema applies to objects only, and only when `name` is present
                    requirement = self.node(dep, resolver, f"{path}/{keyword}/{escape_pointer(name)}")
                    if name in kw.get("required", ()) and requirement != {}:
                        requirement = self.merger.merge([{"anyOf": [{"type": _NON_OBJECT}, requirement]}], path)
                triggers.append((name, requirement))
        required = set(kw.get("required", ()))
        for name, requirement in triggers:
            if requirement == {}:
                continue
            if name in required:  # present in every object
                parts.append(requirement)
                continue
            present = self.merger.merge([{"required": [name]}, requirement], path)
            parts.append({"anyOf": [{"properties": {name: False}}, present]})


def _refs_in(node: Any) -> list[str]:
    """Names of the $defs referenced anywhere in ``node``."""
    out: list[str] = []
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            ref = x.get("$ref")
            if isinstance(ref, str) and ref.startswith(DEFS_PREFIX):
                out.append(ref[len(DEFS_PREFIX) :])
            stack.extend(v for k, v in x.items() if k != "enum")
        elif isinstance(x, list):
            stack.extend(x)
    return out
