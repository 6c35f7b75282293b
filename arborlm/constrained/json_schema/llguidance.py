"""What llguidance receives of a user's JSON schema: the schema as written, with the keywords
llguidance does not implement rewritten into equivalent ones it does, where such exist.

llguidance enforces JSON Schema itself, keyword by keyword, and refuses (naming
them) the keywords it does not implement, so its `SchemaPolicy` compiles the
schema as the user wrote it after `llguidance_rewrite`. Each rewrite below
keeps the schema's language exactly (the same instances validate), except the
``format`` one, which only widens an annotation:

- Keywords beside a ``$ref`` that cannot constrain: up to draft 7 all of them
  (the drafts ignore them) but the definitions, later only annotations
  (``title``, ``description``...). llguidance refuses a cycle of references
  through a ``$ref`` with siblings (13 of the 60 WashingtonPost schemas).
- A ``type`` beside ``anyOf`` / ``oneOf`` whose branches are local references
  to schemas of that type already: removed (llguidance intersects each
  branch with it, and cannot on a cycle of references).
- ``format`` llguidance does not know: left out. ``format`` is an annotation in
  JSON Schema 2020-12 and arborlm validates outputs without a format checker,
  so refusing the schema would refuse something nobody checks.
- ``uniqueItems: false``, ``propertyNames: true`` / ``{}``: no constraint; removed.
- ``dependentRequired`` / ``dependencies`` (names) ``{"a": ["b"]}``: "a is absent,
  or a and b are present", ``anyOf [{"properties": {"a": false}}, {"required": ["a", "b"]}]``.
- ``dependentSchemas`` / ``dependencies`` (schema) ``{"a": S}``: ``anyOf
  [{"properties": {"a": false}}, {"required": ["a"], "allOf": [S]}]``.
- ``not`` of ``required`` names: an object lacking one of them (``anyOf`` of
  ``{"type": "object", "properties": {name: false}}``; ``required`` holds for
  non-objects, so its negation does not).
- ``not`` of types (``{"not": {"type": T}}``): the other JSON types (``integer``
  counted inside ``number``: not number leaves integers out, not integer keeps
  the non-integral numbers only where the schema says number, which is
  inexpressible, so that case stays refused); ``not: {}`` is ``false``.
- ``propertyNames`` of a ``pattern``, of ``const`` / ``enum`` names, or of
  ``maxLength`` / ``minLength``, on an object without ``patternProperties``:
  the undeclared names allowed move from ``additionalProperties`` to a
  ``patternProperties`` entry, declared properties whose names break it
  become ``false`` (only where no declared name matching it would then owe
  ``additionalProperties`` too); ``propertyNames: false`` is ``maxProperties: 0``.
- ``uniqueItems: true`` over items of finitely many values (``enum``,
  ``const``, ``boolean``, ``null``) with no ``prefixItems`` or ``contains``: the
  ``enum`` of every array of distinct values within ``minItems``/``maxItems``,
  when there are at most `MAX_UNIQUE_ARRAYS`.
- ``unevaluatedProperties`` / ``unevaluatedItems`` in a subschema with no
  in-place applicator (``allOf``, ``anyOf``, ``oneOf``, ``not``, ``if``,
  ``$ref``, ``$dynamicRef``, dependent schemas): what it then means, an
  ``additionalProperties`` / ``items`` (or nothing, when those are there).

Last, `close_objects` closes object schemas that leave ``additionalProperties``
out, as xgrammar's strict mode does (a narrowing: outputs stay valid).

What stays unimplemented (``if``/``then``/``else``, ``contains``, other ``not``s and
``uniqueItems``, ``$dynamicRef``, ...) is refused by llguidance naming the
keyword, or, in lenient mode, ignored by it; the output is validated either way.

Where it runs: `llguidance_rewrite` is the ``rewrite`` of `LLGUIDANCE_POLICY`,
called by `prepare_json_schema` in the front on a fresh copy of the schema;
`relax_for_llguidance`, its ``relax``, names in lenient mode what llguidance
will ignore.
"""

from __future__ import annotations

import itertools
import re
import urllib.parse
from typing import Any

import llguidance

from arborlm.constrained.json_schema.nodes import TYPES, Problem, Relaxed
from arborlm.constrained.json_schema.property_names import names_as_properties
from arborlm.constrained.json_schema.values import unique

# The formats llguidance 1.9 enforces (its `Unknown format` error names any other).
LLGUIDANCE_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
})  # fmt: skip
# llguidance's refusal of the keywords it does not implement.
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
LLGUIDANCE_LACKS = "llguidance does not implement it"
# Largest |integer| a JSON integer without a range may be written as on llguidance (1 and 18 zeros:
# llguidance cannot build the range regex of int64's bounds).
INTEGER_BOUND = 10**18
_NUMBER_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# Most arrays `uniqueItems` over finitely many values is written as (an enum of them).
MAX_UNIQUE_ARRAYS = 256

# Keywords whose value is one subschema; a list of subschemas; a name -> subschema map.
_ONE = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not", "if", "then",
        "else", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
# Drafts in which a $ref's siblings are ignored (04, 06, 07; 03 too).
_LEGACY_DIALECT = re.compile(r"draft-0[3-7]/")
# Keywords that only annotate.
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated", "readOnly",
                          "writeOnly"})
# Keywords whose value is a JSON value, not a schema.
_VALUE_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# Keywords applying other subschemas to the same instance (unevaluated* sees what they evaluate).
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
             "dependentSchemas", "dependencies")


def llguidance_rewrite(schema: Any) -> Any:
    """``schema`` (parsed JSON, changed in place) as llguidance compiles it (see the module docstring)."""
    drop_unknown_formats(schema)
    legacy = isinstance(schema, dict) and bool(_LEGACY_DIALECT.search(str(schema.get("$schema", ""))))
    _visit(schema, legacy)
    if isinstance(schema, dict):
        _visit_all(schema, lambda node: drop_implied_type(node, schema))
        close_objects(schema)
    return schema


def close_objects(root: dict) -> None:
    """Set ``additionalProperties: false`` on object schemas that leave it out, as xgrammar's strict mode does.

    A narrowing, not an equivalence: every output stays valid, and a weak model
    can no longer wander into keys the schema never names (or repeat a key as an
    additional one, which only the final validation would catch). Only schemas
    whose closing cannot cut into a conjunction are closed: none whose in-place
    branches (``allOf``, ``anyOf``, ...) name a property it does not declare or
    refer elsewhere, none that is itself such a branch of a schema with
    object keywords or an ``allOf`` conjunct, no ``$ref`` target reached from
    one of those (nothing at all when such a target is named other than by a
    local JSON pointer), and none requiring a name it does not declare.
    """
    unsafe_refs: set[str] = set()
    _collect_unsafe_refs(root, False, unsafe_refs)
    if any(not ref.startswith("#/") for ref in unsafe_refs):
        return  # a target named by $id or anchor: which schema it is, is not worked out here
    _close(root, "#", False, unsafe_refs)


def _close(schema: Any, pointer: str, in_conjunction: bool, unsafe_refs: set[str]) -> None:
    if not isinstance(schema, dict):
        return
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    if (not in_conjunction and pointer not in unsafe_refs and isinstance(schema.get("properties"), dict)
            and all(name in schema["properties"] for name in required)
            and not any(k in schema for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))
            and _branches_name_nothing_new(schema, schema["properties"])):
        schema["additionalProperties"] = False
    for keyword, sub, conjunct in _children(schema):
        _close(sub, f"{pointer}/{keyword}", in_conjunction or conjunct, unsafe_refs)


def _branches_name_nothing_new(schema: dict, declared: dict) -> bool:
    """Whether every schema ``schema`` applies in place (``allOf``, ``anyOf``, ...) names only
    properties in ``declared`` and no ``$ref`` (so closing ``schema`` cuts nothing they allow)."""
    for keyword in _IN_PLACE:
        value = schema.get(keyword)
        if value is None:
            continue
        if keyword in ("$ref", "$dynamicRef", "$recursiveRef"):
            return False
        branches = value if isinstance(value, list) else list(value.values()) if keyword in _MAP else [value]
        for branch in branches:
            if isinstance(branch, bool) or isinstance(branch, list):  # a boolean schema; draft-7 names
                continue
            if not isinstance(branch, dict) or any(k in branch for k in ("additionalProperties", "patternProperties",
                                                                          "unevaluatedProperties")):
                return False
            names = branch.get("properties", {})
            required = branch.get("required", [])
            if not isinstance(names, dict) or not isinstance(required, list):
                return False
            if not set(names) <= set(declared) or not set(required) <= set(declared):
                return False
            if not _branches_name_nothing_new(branch, declared):
                return False
    return True


def _collect_unsafe_refs(schema: Any, in_conjunction: bool, refs: set[str]) -> None:
    if not isinstance(schema, dict):
        return
    if in_conjunction and isinstance(schema.get("$ref"), str):
        refs.add(schema["$ref"])
    for _, sub, conjunct in _children(schema):
        _collect_unsafe_refs(sub, in_conjunction or conjunct, refs)


def _children(schema: dict):
    """(pointer tail, subschema, whether it is intersected with object keywords) of each direct subschema."""
    has_object_keywords = any(k in schema for k in ("properties", "required", "additionalProperties",
                                                     "patternProperties", "minProperties", "maxProperties"))
    for keyword in _ONE:
        if isinstance(schema.get(keyword), dict):
            yield keyword, schema[keyword], keyword in _IN_PLACE and has_object_keywords
    for keyword in _LIST:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield f"{keyword}/{i}", sub, keyword == "allOf" or (keyword in _IN_PLACE and has_object_keywords)
    for keyword in _MAP:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                tail = name.replace("~", "~0").replace("/", "~1")
                yield f"{keyword}/{tail}", sub, keyword in _IN_PLACE


def bound_integer_digits(schema: Any) -> Any:
    """``schema`` (changed in place) with every ``type: integer`` that has no range nor
    ``multipleOf`` bounded to ±`INTEGER_BOUND` (at most 19 digits; what an int64 holds, about).

    llguidance has no option bounding a number literal's digits, and a weak model
    pushed towards a digit would otherwise write it until ``max_new_tokens`` (xgrammar
    and outlines bound digits in their grammars, `number_bounds`). A narrowing, as there;
    the grammar builder applies it unless the request is lenient. Numbers that may have
    fractions stay unbounded.
    """
    def bound(node: dict) -> None:
        if node.get("type") == "integer" and not any(k in node for k in _NUMBER_RANGE):
            node["minimum"], node["maximum"] = -INTEGER_BOUND, INTEGER_BOUND

    _visit_all(schema, bound)
    return schema


def _visit_all(schema: Any, action) -> None:
    """``action`` on every subschema of ``schema`` (schema positions, as `_visit`), innermost first."""
    if not isinstance(schema, dict):
        return
    for sub in _subschemas(schema):
        _visit_all(sub, action)
    action(schema)


def drop_implied_type(schema: dict, root: dict) -> None:
    """Remove a ``type`` beside ``anyOf`` / ``oneOf`` when every branch is a local ``$ref`` whose
    target has that type already (the intersection changes nothing).

    llguidance intersects each branch with the sibling, and refuses it on a cycle
    of references ("circular references with sibling keys").
    """
    if "type" not in schema or set(schema) - {"type", "anyOf", "oneOf"} - _ANNOTATIONS:
        return
    allowed = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    branches = [b for k in ("anyOf", "oneOf") for b in (schema.get(k) or [])]
    if not branches:
        return
    for branch in branches:
        target = _local_target(root, branch.get("$ref")) if isinstance(branch, dict) and set(branch) == {"$ref"} \
            else None
        types = target.get("type") if isinstance(target, dict) else None
        types = types if isinstance(types, list) else [types]
        if types == [None] or not all(t in allowed or (t == "integer" and "number" in allowed) for t in types):
            return
    del schema["type"]


def _local_target(root: dict, ref: Any) -> Any:
    """The subschema a ``#/json/pointer`` reference names inside ``root`` (None for any other reference)."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _visit(schema: Any, legacy: bool) -> None:
    """Rewrite ``schema`` and, first, every subschema in it (in place)."""
    if not isinstance(schema, dict):
        return
    for sub in _subschemas(schema):
        _visit(sub, legacy)
    drop_ref_siblings(schema, legacy)
    for rewrite in _REWRITES:
        rewrite(schema)


def drop_ref_siblings(schema: dict, legacy: bool) -> None:
    """Remove the keywords beside a ``$ref`` that do not constrain: all of them up to draft 7 (where
    they are ignored) but the definitions, annotations only in later drafts.

    llguidance refuses a cycle of references through a ``$ref`` with siblings.
    """
    if "$ref" not in schema:
        return
    for key in list(schema):
        if key != "$ref" and key not in ("definitions", "$defs") and (legacy or key in _ANNOTATIONS):
            del schema[key]


def _subschemas(schema: dict):
    for keyword in _ONE:
        if isinstance(schema.get(keyword), dict):
            yield schema[keyword]
    for keyword in _LIST:
        if isinstance(schema.get(keyword), list):
            yield from schema[keyword]
    for keyword in _MAP:
        if isinstance(schema.get(keyword), dict):
            yield from schema[keyword].values()


def relax_for_llguidance(schema: dict) -> Relaxed:
    """Lenient mode: what llguidance's own ``lenient`` option will ignore, as ``"keyword at /pointer"``.

    The schema is compiled unchanged (the backend turns on llguidance's ``lenient``);
    this only names what that leaves out, so that a lenient request lists it in
    ``dropped`` as on the other backends. Other llguidance errors are left to the
    backend's check, which refuses them.
    """
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"coerce_one_of": True})
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    unimplemented = unimplemented_keywords(schema, messages[0]) if is_error and messages else None
    if unimplemented is None:
        return Relaxed(schema)
    return Relaxed(schema, tuple(f"{keyword} at {path or '/'}" for keyword, path, _ in unimplemented))


def unimplemented_keywords(schema: Any, message: str) -> list[Problem] | None:
    """Each keyword llguidance's ``message`` says it does not implement, with its JSON pointer in ``schema``.

    None when ``message`` is not llguidance's "Unimplemented keys" refusal. A
    keyword it names that is not found under ``schema`` is given at the root.
    """
    unimplemented = _UNIMPLEMENTED.search(message)
    if unimplemented is None:
        return None
    keywords = set(re.findall(r'"([^"]+)"', unimplemented.group(1)))
    found: list[tuple[str, str]] = []
    _find_keywords(schema, "", keywords, found)
    return [Problem(keyword, path, LLGUIDANCE_LACKS) for keyword, path in found or [(k, "") for k in sorted(keywords)]]


def _find_keywords(schema: Any, path: str, keywords: set[str], found: list[tuple[str, str]]) -> None:
    if not isinstance(schema, dict):
        return
    found.extend((k, path) for k in schema if k in keywords)
    for tail, sub, _ in _children(schema):
        _find_keywords(sub, f"{path}/{tail}", keywords, found)


def drop_unknown_formats(node: Any) -> None:
    """Remove every string ``format`` llguidance does not know (`LLGUIDANCE_FORMATS`) under ``node``.

    Every object is visited but JSON values (``enum``, ``const``, ``default``,
    ``examples``): a ``$ref`` may point anywhere, into an unknown keyword too. A
    property called ``format`` is a schema (an object), never a string, so it stays.
    """
    if isinstance(node, list):
        for item in node:
            drop_unknown_formats(item)
        return
    if not isinstance(node, dict):
        return
    if isinstance(node.get("format"), str) and node["format"] not in LLGUIDANCE_FORMATS:
        del node["format"]
    for key, value in node.items():
        if key not in _VALUE_KEYWORDS:
            drop_unknown_formats(value)


def drop_no_ops(schema: dict) -> None:
    """Remove ``uniqueItems: false`` and ``propertyNames: true`` / ``{}``, which constrain nothing."""
    if schema.get("uniqueItems") is False:
        del schema["uniqueItems"]
    if schema.get("propertyNames") is True or schema.get("propertyNames") == {}:
        del schema["propertyNames"]


def lower_dependencies(schema: dict) -> None:
    """``dependentRequired``, ``dependentSchemas`` and draft-7 ``dependencies`` as ``allOf`` of ``anyOf``s."""
    conditions = []
    for keyword in ("dependentRequired", "dependentSchemas", "dependencies"):
        value = schema.get(keyword)
        if not isinstance(value, dict):
            continue
        for name, then in value.items():
            absent = {"properties": {name: False}}
            if isinstance(then, list):
                present = {"required": [name, *then]}
            else:
                present = {"required": [name], "allOf": [then]}
            conditions.append({"anyOf": [absent, present]})
        del schema[keyword]
    if conditions:
        schema["allOf"] = [*schema.get("allOf", []), *conditions]


def lower_not(schema: dict) -> None:
    """``not: {}`` as ``false`` (inside ``allOf``), ``not`` of bare ``required`` names as an object
    lacking one, and ``not`` of a bare ``type`` as the other types."""
    negated = schema.get("not")
    if negated == {} or negated is True:
        del schema["not"]
        schema["allOf"] = [*schema.get("allOf", []), False]
        return
    if isinstance(negated, dict) and set(negated) == {"required"} and isinstance(negated["required"], list) \
            and negated["required"] and all(isinstance(n, str) for n in negated["required"]):
        # Not all of them present: an object lacking one (required holds vacuously for non-objects).
        del schema["not"]
        lacking = [{"type": "object", "properties": {name: False}} for name in unique(negated["required"])]
        schema["allOf"] = [*schema.get("allOf", []), {"anyOf": lacking}]
        return
    if not isinstance(negated, dict) or set(negated) != {"type"}:
        return
    types = negated["type"] if isinstance(negated["type"], list) else [negated["type"]]
    if not all(t in TYPES for t in types) or ("integer" in types and "number" not in types):
        return  # "not integer" keeps the non-integral numbers, which no type names
    left = [t for t in TYPES if t not in types and not (t == "integer" and "number" in types)]
    del schema["not"]
    schema["allOf"] = [*schema.get("allOf", []), {"type": left} if left else False]


def lower_property_names(schema: dict) -> None:
    """``propertyNames`` of a pattern, names or lengths as ``patternProperties`` (see the module docstring)."""
    names_as_properties(schema)
    names = schema.get("propertyNames")
    if names is None:
        return
    if names is False:
        del schema["propertyNames"]
        schema["maxProperties"] = 0
        return
    pattern = _names_pattern(names)
    if pattern is None or "patternProperties" in schema:
        return
    properties = schema.get("properties", {})
    additional = schema.get("additionalProperties", True)
    if additional not in (True, {}) and any(re.search(pattern, name) for name in properties):
        return  # a declared name matching the pattern would have to satisfy additionalProperties too
    del schema["propertyNames"]
    for name in properties:
        if not re.search(pattern, name):
            properties[name] = False
    schema["patternProperties"] = {pattern: additional}
    schema["additionalProperties"] = False


def _names_pattern(names: Any) -> str | None:
    """A regex (searched, as ``pattern`` is) matching exactly the names ``names`` allows, or None."""
    if not isinstance(names, dict):
        return None
    extra = set(names) - {"type", "pattern", "const", "enum", "minLength", "maxLength"}
    if extra or names.get("type", "string") != "string":
        return None
    forms = [k for k in ("pattern", "const", "enum") if k in names]
    lengths = "minLength" in names or "maxLength" in names
    if len(forms) + lengths != 1:
        return None  # two conditions at once: their intersection is not one regex we write
    if "pattern" in names:
        return names["pattern"] if isinstance(names["pattern"], str) else None
    if lengths:
        low, high = names.get("minLength", 0), names.get("maxLength", "")
        if not isinstance(low, int) or not (high == "" or isinstance(high, int)):
            return None
        return f"^[\\s\\S]{{{low},{high}}}$"
    values = [names["const"]] if "const" in names else names["enum"]
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        return None
    return "^(?:" + "|".join(re.escape(v) for v in values) + ")$"


def lower_unique_items(schema: dict) -> None:
    """``uniqueItems`` over items of finitely many values as the ``enum`` of the allowed arrays."""
    if schema.get("uniqueItems") is not True or "prefixItems" in schema or "contains" in schema:
        return
    values = _finite_values(schema.get("items", None))
    if values is None:
        return
    low = schema.get("minItems", 0)
    high = min(schema.get("maxItems", len(values)), len(values))
    if not isinstance(low, int) or not isinstance(high, int):
        return
    arrays = []
    for size in range(low, high + 1):
        for combination in itertools.permutations(values, size):
            arrays.append(list(combination))
            if len(arrays) > MAX_UNIQUE_ARRAYS:
                return
    for keyword in ("uniqueItems", "items", "minItems", "maxItems"):
        schema.pop(keyword, None)
    schema["enum"] = arrays


def _finite_values(items: Any) -> list | None:
    """The distinct values an ``items`` subschema allows, when it is an ``enum``, ``const``, boolean or null."""
    if not isinstance(items, dict):
        return None
    if set(items) <= {"enum", "type"} and isinstance(items.get("enum"), list):
        values = items["enum"]
    elif set(items) <= {"const", "type"} and "const" in items:
        values = [items["const"]]
    elif set(items) == {"type"} and items["type"] in ("boolean", "null"):
        return [False, True] if items["type"] == "boolean" else [None]
    else:
        return None
    if "type" in items:  # an enum value of another type is not allowed
        allowed = items["type"] if isinstance(items["type"], list) else [items["type"]]
        values = [v for v in values if _json_type(v) in allowed or (_json_type(v) == "integer" and "number" in allowed)]
    return unique(values)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}[type(value)]


def lower_unevaluated(schema: dict) -> None:
    """``unevaluatedProperties`` / ``unevaluatedItems`` where no in-place applicator can evaluate anything."""
    if any(k in schema for k in _IN_PLACE):
        return
    if "unevaluatedProperties" in schema:
        value = schema.pop("unevaluatedProperties")
        schema.setdefault("additionalProperties", value)  # with additionalProperties, nothing is unevaluated
    if "unevaluatedItems" in schema and not isinstance(schema.get("items"), list) and "additionalItems" not in schema:
        value = schema.pop("unevaluatedItems")
        schema.setdefault("items", value)


_REWRITES = (drop_no_ops, lower_unevaluated, lower_dependencies, lower_not,
             lower_property_names, lower_unique_items)
