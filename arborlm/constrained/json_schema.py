"""Turn a user's JSON Schema into one the grammar backend enforces, and check outputs against it.

`prepare_json_schema` parses and checks the schema, rewrites it into a form
xgrammar enforces without losing meaning, and refuses (a 400-style
`GrammarError`, ``param="json_schema"``) every keyword the grammar would
silently ignore, naming the keyword and its JSON pointer. With
``lenient=True`` (the ``json_schema_lenient`` sampling field) such keywords
are left out of the grammar instead and listed in `PreparedSchema.dropped`.
`validate_json_output` checks a finished output against the user's original
schema with ``jsonschema``, so whatever the grammar lets through, arborlm never
returns JSON the schema rejects.

Pipeline
--------
1. Parse. The dialect is the schema's ``$schema``; without one (or with one
   ``jsonschema`` does not know) it is the newest of 2020-12, 2019-09, 7, 6, 4
   whose metaschema accepts the schema, so a draft-4 style schema without
   ``$schema`` (boolean ``exclusiveMinimum``, ``items`` arrays) is read as
   draft 4 rather than refused. Validation uses the same dialect.
2. Normalise, keeping the meaning (phase A; the result is a 2020-12 schema):
   keywords the dialect's validator ignores are dropped (annotations such as
   ``title``, ``description``, ``default``, ``examples``, ``$comment``,
   ``deprecated``, ``readOnly``; unknown keywords; siblings of ``$ref`` up to
   draft 7); draft-4/7 forms become 2020-12 ones (``items`` arrays →
   ``prefixItems``, boolean exclusive bounds → numeric, ``dependencies`` →
   dependent required/schemas, ``const`` → ``enum``); every ``$ref`` is
   resolved (``$id``, anchors and JSON pointers, with ``referencing``, as
   ``jsonschema`` does) and its target hoisted into the root ``$defs``, so
   recursive schemas stay recursive; ``allOf`` branches and the siblings of a
   ``$ref`` are merged into one schema (types intersect, bounds tighten,
   ``properties`` merge recursively, ``required`` unions, a property one side
   lists and the other leaves to ``patternProperties``/``additionalProperties``
   gets both schemas; a recursive reference merged with other keywords becomes
   a new ``$defs`` entry); keywords beside ``anyOf``/``oneOf`` are
   distributed into every branch (A ∧ (B ∨ C) = (A ∧ B) ∨ (A ∧ C), and the
   same for ``oneOf``); ``not`` of ``{}``, of a ``type`` or of ``required``
   becomes a positive schema; each dependency becomes an ``anyOf`` ("trigger
   absent" or "trigger present and its requirement holds").
3. Lower for xgrammar (phase B): ``enum``/``const`` keep only the values the
   rest of their schema accepts; a name in ``required`` but not in
   ``properties`` gets a ``properties`` entry; ``false`` subschemas are
   removed (a forbidden property is dropped and kept out of the patterns and
   additionalProperties that would admit it, an unreachable item position
   lowers ``maxItems``, a false branch goes, a type no value can have is
   removed); integer bounds are rounded; ``pattern`` goes from JSON Schema's
   search semantics to xgrammar's full match (``abc`` → ``^.*abc.*$``);
   ``(...)?`` is written ``(...){0,1}``; ``minLength``/``maxLength`` beside
   a pattern are dropped when the pattern implies them, or folded into a
   pattern of one repeated atom (``^[a-z]+$`` → ``^[a-z]{1,64}$``);
   ``format`` beside a pattern or lengths is dropped (it is an annotation);
   a key pattern that also matches a listed property with another schema is
   rewritten to exclude that name (a trie of the names, for the pattern shapes
   ``^.*$``, ``^prefix.*$`` and ``^[class]*$``); ``propertyNames`` with a
   pattern beside ``properties`` and ``additionalProperties`` becomes such a
   key pattern.
   Narrowing steps (outputs stay valid for the user; some valid values can no
   longer be generated): an untyped schema with type-specific keywords gets
   the types those keywords belong to (xgrammar does so itself for objects
   and arrays); a ``number`` with an integral ``multipleOf`` becomes an
   ``integer``; integer bounds are clamped to int64; a pattern with a
   ``maxLength`` it does not imply has every unbounded repeat capped (at
   least `MIN_REPEAT_CAP`) so the longest match fits; ``.`` never matches a
   newline; an unset additionalProperties becomes false where a forbidden
   property is dropped.
4. Refuse (or, when lenient, drop and list) what is left that xgrammar does
   not enforce.

xgrammar 0.2.9, measured
------------------------
``Grammar.from_json_schema(s, any_whitespace=False, strict_mode=True)`` and
``GrammarMatcher.accept_string`` on violating and satisfying strings
("ignored": a violating string is accepted; "error": compiling raises).
tests/constrained/test_json_schema.py pins these facts.

=====================================  ==========================================================
keyword                                xgrammar 0.2.9
=====================================  ==========================================================
type (one or a list), enum, const      enforced; ``enum``/``const`` ignore every sibling
properties, required,                  enforced; a ``required`` name not in ``properties`` is
additionalProperties                   ignored; with ``properties`` listed, unset
                                       additionalProperties means false (strict mode); additional
                                       keys exclude the listed names
patternProperties                      enforced as a full match, but a key may take a pattern's
                                       schema although it is listed in ``properties``, a key
                                       matching two patterns gets either schema, and beside
                                       listed properties additionalProperties may take a key
                                       that matches a pattern
propertyNames                          enforced alone; ignored beside patternProperties; admits
                                       the names it matches despite ``additionalProperties:
                                       false``; lets listed names take the additionalProperties
                                       schema
min/maxProperties                      enforced; ``minProperties`` above the listed properties
                                       without additionalProperties is an error
unevaluatedProperties/Items (simple)   enforced like additionalProperties / items
prefixItems, items, min/maxItems       enforced; a draft-4 ``items`` array is an error; no
                                       ``items`` allows only ``[]`` (strict mode); maxItems below
                                       the prefixItems is an error
minimum, maximum, exclusive*           enforced; ignored on an untyped schema; integer bounds
                                       beyond int64 or fractional, boolean exclusive* and empty
                                       ranges are errors
multipleOf                             enforced on integers without bounds or with both bounds
                                       less than 10000 apart; ignored (warning) with one bound, a
                                       wider span, or on ``number``
minLength/maxLength                    enforced; ignored (warning) beside pattern or format
pattern                                enforced as a full match; ``(...)?`` is mis-compiled
                                       (``^(a.*)?$`` accepts "b"); lookahead ignored (warning);
                                       backreferences, lookbehind, ``\\b``, ``\\p{..}`` are
                                       errors; ignored beside format
format                                 date-time, date, time, email, uuid, ipv4, ipv6, uri,
                                       hostname, duration... enforced (narrower); others ignored
anyOf                                  enforced; keywords beside it ignored
oneOf                                  enforced as anyOf (warning when branches may overlap)
allOf                                  one branch enforced; several: any value (warning);
                                       keywords beside it ignored
$ref                                   ``#`` and ``#/...`` pointers enforced, recursion works;
                                       keywords beside it ignored; anchors and ``$id`` URIs:
                                       any value (warning)
not, if/then/else, uniqueItems,        ignored
contains, maxContains,
dependentRequired, dependentSchemas,
dependencies
false (anywhere), empty enum           error
=====================================  ==========================================================

Decisions
---------
- ``oneOf``: accepted and compiled as ``anyOf``, which is what grammar
  engines enforce; exclusivity is left to the final validation. Refusing a
  ``oneOf`` whose branches might overlap would cost coverage (it is in 13% of
  the JSONSchemaBench sample, mostly with disjoint branches) for a case the
  validation catches. Branches shown pairwise disjoint (different JSON types,
  disjoint ``enum``s, or objects with a required ``const`` / ``enum``
  discriminator) are written as ``anyOf``, the same language, so xgrammar
  does not warn that it falls back to ``anyOf``.
- ``format``: validation runs without a format checker, as JSON Schema
  2020-12 and ``jsonschema`` do by default (``format`` is an annotation).
  xgrammar enforces the formats it knows, which only narrows the strings it
  emits, so every output it allows is valid either way.
- Duplicate object keys: a grammar cannot forbid them (additional and
  pattern keys may repeat); the final validation rejects an output with a
  duplicate key, NaN or Infinity.
- Refused: ``not`` other than of ``{}``, a type or ``required``; ``if``;
  ``contains`` (and ``minContains``/``maxContains``); ``uniqueItems: true``
  (unless at most one item); ``unevaluated*`` beside in-place applicators;
  ``$dynamicRef``/``$recursiveRef``; ``multipleOf`` that is fractional or
  beside an unsupported range; two different ``pattern``s on one string;
  ``minLength``/``maxLength`` beside a pattern that cannot take them; a
  pattern with lookaround, inline flags or a construct xgrammar cannot
  compile; ``patternProperties`` with different schemas for several patterns,
  or that must leave out names and have no supported shape;
  ``additionalProperties`` beside patterns that do not cover every key;
  ``propertyNames`` beside ``patternProperties``; more than `MAX_BRANCHES`
  branches after distribution. A ``$ref`` that cannot be resolved inside the
  document, a cycle of bare references, and a schema that accepts no value
  are errors even when lenient.

Sources: the JSON Schema 2020-12 core and validation specifications
(json-schema.org) and earlier drafts, ``jsonschema`` 4.x and ``referencing``
(Python), xgrammar's ``Grammar.from_json_schema`` documentation and the
measurements above, and Geng et al., "Generating Structured Outputs from
Language Models: Benchmark and Studies" (JSONSchemaBench, arXiv:2501.10868) for
the coverage measure.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import referencing.jsonschema
from jsonschema import exceptions as js_exceptions
from jsonschema import validators as js_validators
from referencing import Registry
from referencing.exceptions import Unresolvable

from arborlm.constrained.base import GrammarError
from arborlm.constrained.json_values import json_intersection, mutually_exclusive, unique
from arborlm.constrained.schema_patterns import (
    exclude_words,
    full_match_pattern,
    has_lookaround,
    is_vacuous,
    pattern_search,
    pattern_with_lengths,
    separator_first_repeat,
    strip_lookarounds,
    xgrammar_regex_error,
)

PARAM = "json_schema"
# Most anyOf/oneOf branches one schema may have after distributing sibling keywords.
MAX_BRANCHES = 64
# Most refused keywords named in one error message.
MAX_NAMED_PROBLEMS = 8
# Most conjunctions of recursive references one schema may defer into new $defs entries.
MAX_DEFERRED = 256
# xgrammar enforces integer multipleOf with both bounds only when max - min is below this.
XGRAMMAR_MULTIPLE_OF_SPAN = 10000
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# A schema after normalisation: a dict, or False (accepts nothing). True is written {}.
Schema = dict | bool

_VALIDATORS = (
    js_validators.Draft202012Validator,
    js_validators.Draft201909Validator,
    js_validators.Draft7Validator,
    js_validators.Draft6Validator,
    js_validators.Draft4Validator,
)
_DRAFT_YEAR = {
    js_validators.Draft202012Validator: 2020,
    js_validators.Draft201909Validator: 2019,
    js_validators.Draft7Validator: 7,
    js_validators.Draft6Validator: 6,
    js_validators.Draft4Validator: 4,
}
_SPECIFICATIONS = {
    2020: referencing.jsonschema.DRAFT202012,
    2019: referencing.jsonschema.DRAFT201909,
    7: referencing.jsonschema.DRAFT7,
    6: referencing.jsonschema.DRAFT6,
    4: referencing.jsonschema.DRAFT4,
}
_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
_NON_OBJECT = ["array", "boolean", "null", "number", "string"]
# Keywords that only constrain values of one type (`format` is left out: an annotation).
_FAMILY_KEYWORDS = {
    "object": ("properties", "required", "additionalProperties", "patternProperties",
               "propertyNames", "minProperties", "maxProperties"),
    "array": ("prefixItems", "items", "minItems", "maxItems"),
    "string": ("minLength", "maxLength", "pattern"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}
# Keywords that evaluate the instance in place (they change what "unevaluated" means).
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "$ref", "$dynamicRef", "$recursiveRef",
             "dependentSchemas", "dependencies")
_DEFS_PREFIX = "#/$defs/"
# Keywords a validator function reads beside the keyword it is registered under.
_COMPANIONS = {"if": ("then", "else"), "contains": ("minContains", "maxContains"),
               "minimum": ("exclusiveMinimum",), "maximum": ("exclusiveMaximum",)}


@dataclass(frozen=True)
class PreparedSchema:
    """A JSON schema ready to compile, with what is needed to validate outputs.

    text: the normalised schema to compile, ``json.dumps`` in the user's property order
        (a 2020-12 schema; every ``$ref`` points into its root ``$defs``).
    original: the user's schema, the same way serialised; outputs are validated
        against it.
    dropped: keywords the grammar does not enforce, ignored because of lenient
        mode, as ``"keyword at /json/pointer"`` (``/`` is the root); empty
        unless lenient.
    dialect: the metaschema URI `original` is validated under.
    """

    text: str
    original: str
    dropped: tuple[str, ...] = ()
    dialect: str = js_validators.Draft202012Validator.META_SCHEMA["$id"]


def prepare_json_schema(schema: str | dict | bool, *, lenient: bool = False) -> PreparedSchema:
    """Check ``schema`` and rewrite it into the schema the grammar backend compiles.

    Parameters
    ----------
    schema:
        The user's JSON Schema: its JSON text, a dict, or a boolean schema.
    lenient:
        Drop keywords the grammar cannot enforce (listed in ``dropped``)
        instead of refusing the schema; the finished output is still
        validated against the whole schema by `validate_json_output`.

    Returns
    -------
    PreparedSchema

    Raises
    ------
    GrammarError
        (``param="json_schema"``) The text is not JSON (with line and column),
        the value is not an object or boolean, it is not a valid JSON Schema of
        its dialect (with the path), a ``$ref`` cannot be resolved inside the
        schema, the schema accepts no value, or (unless ``lenient``) it uses
        keywords the grammar cannot enforce (each named with its JSON pointer).
    """
    raw = _load_schema(schema)
    cls = _validator_class(raw)
    original = json.dumps(raw, sort_keys=True)
    dialect = _dialect_of(cls)
    if raw is True:
        return PreparedSchema("{}", original, (), dialect)
    if raw is False:
        raise GrammarError("json_schema is `false`, which accepts no value", PARAM)
    normaliser = _Normaliser(raw, cls)
    doc = normaliser.run()
    problems = normaliser.problems()
    if problems and not lenient:
        raise GrammarError(_refusal_message(problems), PARAM)
    dropped = tuple(f"{keyword} at {path or '/'}" for keyword, path, _ in problems)
    # Property order is kept: backends emit properties in schema order, and users rely on it.
    return PreparedSchema(json.dumps(doc), original, dropped, dialect)


def validate_json_output(prepared: PreparedSchema, text: str) -> str | None:
    """Check a finished constrained output against the user's original schema.

    Returns None when ``text`` is one JSON value (no duplicate keys, no NaN or
    Infinity) that the original schema accepts under its dialect, without a
    format checker; else a short message: the parse error, or the first
    validation error and the JSON pointer of the failing part of the output.
    """
    try:
        instance = _strict_json_loads(text)
    except ValueError as e:
        return f"output is not valid JSON: {e}"
    validator = _output_validator(prepared.original, prepared.dialect)
    try:
        error = js_exceptions.best_match(validator.iter_errors(instance))
    except RecursionError:
        return "output could not be validated: the JSON schema recurses without end"
    if error is None:
        return None
    where = _pointer(error.absolute_path) or "/"
    return f"output does not match the JSON schema at {where}: {_shorten(error.message)}"


# ---------------------------------------------------------------------------
# Parsing, dialects, messages


def _load_schema(schema: Any) -> Any:
    if isinstance(schema, str):
        try:
            value = _strict_json_loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(
                f"json_schema is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", PARAM
            ) from e
        except ValueError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}", PARAM) from e
    else:
        try:  # a private copy, with JSON types only
            value = json.loads(json.dumps(schema, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise GrammarError(f"json_schema is not JSON-serialisable: {e}", PARAM) from e
    if not isinstance(value, (dict, bool)):
        raise GrammarError(
            f"json_schema must be a JSON object or a boolean, got {type(value).__name__}", PARAM
        )
    return value


def _strict_json_loads(text: str) -> Any:
    """json.loads that refuses duplicate object keys, NaN and Infinity."""

    def pairs(items: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for key, value in items:
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = value
        return out

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)


def _validator_class(raw: Any) -> type:
    """The validator class of the schema's dialect (see the module docstring)."""
    declared = raw.get("$schema") if isinstance(raw, dict) else None
    if isinstance(declared, str) and _known_dialect(declared):
        candidates: tuple = (js_validators.validator_for(raw),)
    else:
        candidates = _VALIDATORS
    first_error = None
    for cls in candidates:
        try:
            cls.check_schema(raw)
            return cls
        except js_exceptions.SchemaError as e:
            first_error = first_error or (cls, e)
        except re.error as e:  # a pattern jsonschema's metaschema does not check
            first_error = first_error or (cls, e)
    cls, error = first_error
    if isinstance(error, re.error):
        raise GrammarError(f"json_schema has an invalid regular expression: {error}", PARAM)
    where = _pointer(error.path) or "/"
    raise GrammarError(
        f"json_schema is not a valid JSON Schema ({_dialect_name(cls)}): "
        f"{_shorten(error.message)} at {where}",
        PARAM,
    )


def _known_dialect(uri: str) -> bool:
    try:
        referencing.jsonschema.specification_with(uri)
    except referencing.jsonschema.UnknownDialect:
        return False
    return True


def _dialect_of(cls: type) -> str:
    meta = cls.META_SCHEMA
    return meta.get("$id", meta.get("id", ""))


def _dialect_name(cls: type) -> str:
    year = _DRAFT_YEAR[cls]
    return f"draft {year}" if year < 2019 else f"draft {year}-{'09' if year == 2019 else '12'}"


@functools.lru_cache(maxsize=256)
def _output_validator(original: str, dialect: str):
    cls = js_validators.validator_for({"$schema": dialect})
    return cls(json.loads(original))


def _pointer(parts) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _shorten(message: str, limit: int = 300) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _refusal_message(problems: list[tuple[str, str, str]]) -> str:
    named = [f"{keyword} at {path or '/'} ({reason})" for keyword, path, reason in problems[:MAX_NAMED_PROBLEMS]]
    more = len(problems) - len(named)
    tail = f"; and {more} more" if more > 0 else ""
    return (
        "json_schema uses keywords the grammar cannot enforce: " + "; ".join(named) + tail
        + ". Set json_schema_lenient to leave them out of the grammar; the finished output "
        "is still validated against the whole schema"
    )


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


# ---------------------------------------------------------------------------
# Types and bounds


def _type_set(value: Any) -> list[str] | None:
    """A schema's ``type`` as a canonical list (``number`` absorbs ``integer``)."""
    if value is None:
        return None
    names = {value} if isinstance(value, str) else set(value)
    if "number" in names:
        names.discard("integer")
    return [t for t in _TYPES if t in names]


def _intersect_types(a: list[str] | None, b: list[str] | None) -> list[str] | None:
    if a is None or b is None:
        return b if a is None else a
    out = []
    for t in _TYPES:
        in_a = t in a or (t == "integer" and "number" in a)
        in_b = t in b or (t == "integer" and "number" in b)
        if in_a and in_b:
            out.append(t)
    return _type_set(out)


def _lower_bound(node: dict) -> tuple[float, bool] | None:
    """(value, exclusive) of the tightest lower bound, or None."""
    bounds = []
    if "minimum" in node:
        bounds.append((node["minimum"], False))
    if "exclusiveMinimum" in node:
        bounds.append((node["exclusiveMinimum"], True))
    return max(bounds, default=None, key=lambda b: (b[0], b[1]))


def _upper_bound(node: dict) -> tuple[float, bool] | None:
    bounds = []
    if "maximum" in node:
        bounds.append((node["maximum"], False))
    if "exclusiveMaximum" in node:
        bounds.append((node["exclusiveMaximum"], True))
    return min(bounds, default=None, key=lambda b: (b[0], not b[1]))


def _set_bounds(node: dict, lower: tuple | None, upper: tuple | None) -> None:
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        node.pop(key, None)
    if lower is not None:
        node["exclusiveMinimum" if lower[1] else "minimum"] = lower[0]
    if upper is not None:
        node["exclusiveMaximum" if upper[1] else "maximum"] = upper[0]


def _tighter(a: tuple | None, b: tuple | None, pick: Callable) -> tuple | None:
    if a is None or b is None:
        return b if a is None else a
    return pick([a, b])


# ---------------------------------------------------------------------------
# The normaliser


def _escape(segment: str) -> str:
    return str(segment).replace("~", "~0").replace("/", "~1")


class _Normaliser:
    """Rewrites one schema document (see the module docstring, steps 2-4).

    Phase A (`node`, `merge`) maps the user's schema to an equivalent 2020-12
    schema in which a dict is one of: ``{}``, ``{"$ref": "#/$defs/<name>"}``,
    ``{"anyOf"|"oneOf": [...]}`` alone, or plain keywords with no ``$ref``,
    ``allOf``, ``anyOf``, ``oneOf``, ``not`` or dependencies; False accepts
    nothing. Phase B (`lower`) maps that to what xgrammar compiles, without
    mutating phase A's nodes; it reruns until the set of ``$defs`` that
    accept nothing stops growing.
    """

    def __init__(self, root: dict, cls: type):
        self.root = root
        self.year = _DRAFT_YEAR[cls]
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
        self.problems_a: list[tuple[str, str, str]] = []
        self.problems_b: list[tuple[str, str, str]] = []
        self.false_defs: set[str] = set()

    # -- driver --------------------------------------------------------------

    def run(self) -> dict:
        root_a = self.node(self.root, self.root_resolver, "")
        self._close_defs(root_a)
        doc_a = dict(root_a) if isinstance(root_a, dict) else {}
        doc_a["$defs"] = self.defs_a
        self.checker = js_validators.Draft202012Validator(doc_a)
        while True:
            self.problems_b = []
            self.defs_b: dict[str, Schema] = {}
            self.pending_b: list[str] = []
            root_b = self.lower(root_a, "")
            while self.pending_b:
                name = self.pending_b.pop()
                self.defs_b[name] = self.lower(self.defs_a[name], self.targets[name][2])
            newly_false = {n for n, s in self.defs_b.items() if s is False} - self.false_defs
            if not newly_false:
                break
            self.false_defs |= newly_false
        if root_b is False:
            raise GrammarError("json_schema accepts no value (its constraints contradict each other)", PARAM)
        doc = dict(root_b)
        if self.defs_b:
            doc["$defs"] = {name: self.defs_b[name] for name in sorted(self.defs_b)}
        return doc

    def problems(self) -> list[tuple[str, str, str]]:
        seen, out = set(), []
        for problem in self.problems_a + self.problems_b:
            if problem[:2] not in seen:
                seen.add(problem[:2])
                out.append(problem)
        return out

    def problem(self, keyword: str, path: str, reason: str, phase_b: bool = False) -> None:
        (self.problems_b if phase_b else self.problems_a).append((keyword, path, reason))

    def _index_paths(self, value: Any, path: str) -> None:
        if isinstance(value, dict):
            self.paths.setdefault(id(value), path)
            for k, v in value.items():
                self._index_paths(v, f"{path}/{_escape(k)}")
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
                chain.append(self.defs_a[chain[-1]]["$ref"][len(_DEFS_PREFIX) :])
                if chain[-1] in chain[:-1]:
                    where = self.targets[name][2] or "/"
                    raise GrammarError(f"json_schema: the $ref at {where} only leads to itself", PARAM)

    # -- phase A: references -------------------------------------------------

    def hoist(self, ref: str, resolver: Any, path: str) -> Schema:
        """``{"$ref": "#/$defs/<name>"}`` for the target of ``ref`` (or the boolean it names)."""
        try:
            resolved = resolver.lookup(ref)
        except Unresolvable as e:
            why = {"PointerToNowhere": "no such location in the schema", "NoSuchAnchor": "no such anchor"}
            raise GrammarError(f"json_schema: $ref {ref!r} at {path or '/'} cannot be resolved: "
                               f"{why.get(type(e).__name__, 'not inside the schema (remote references are not fetched)')}",
                               PARAM) from e
        target = resolved.contents
        if isinstance(target, bool):
            return {} if target else False
        if not isinstance(target, dict) or id(target) not in self.paths:
            raise GrammarError(
                f"json_schema: $ref {ref!r} at {path or '/'} points outside the schema; "
                "only references inside the schema document are supported",
                PARAM,
            )
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
        return {"$ref": _DEFS_PREFIX + name}

    def def_a(self, name: str) -> Schema:
        """Phase A form of a hoisted target (or of a deferred conjunction), computed once."""
        if name not in self.defs_a:
            target, resolver, path = self.targets[name]
            self.unfolding.add(name)
            try:
                if name in self.deferred:
                    self.defs_a[name] = self.merge(self.deferred[name], path)
                else:
                    self.defs_a[name] = self.node(target, resolver, path)
            finally:
                self.unfolding.discard(name)
        return self.defs_a[name]

    def _merge_refs(self, flat: list[dict], path: str) -> Schema:
        """The conjunction of ``flat``, some of which are (or hold) a ``$ref``.

        The targets are unfolded and merged in place, except when the same
        conjunction is already being merged further up, or a target is still
        being normalised (a recursive schema): then the conjunction becomes a
        new ``$defs`` entry, computed later, so the recursion stays a reference.
        """
        names = sorted({p["$ref"][len(_DEFS_PREFIX) :] for p in flat if "$ref" in p})
        plain = [{k: v for k, v in p.items() if k != "$ref"} for p in flat]
        plain = [p for p in plain if p != {}]
        if len(names) == 1 and not plain:
            return {"$ref": _DEFS_PREFIX + names[0]}
        key = (tuple(names), tuple(sorted(_canon(p) for p in plain)))
        if key in self.merging or any(n in self.unfolding for n in names):
            return self._deferred_ref(key, names, plain, path)
        self.merging.add(key)
        try:
            return self.merge([self.def_a(n) for n in names] + plain, path)
        finally:
            self.merging.discard(key)

    def _deferred_ref(self, key: tuple, names: list[str], plain: list[dict], path: str) -> Schema:
        name = self.deferred_names.get(key)
        if name is None:
            if len(self.deferred) >= MAX_DEFERRED:
                self.problem("$ref", path, "too many recursive references merged with other keywords")
                return {"$ref": _DEFS_PREFIX + names[0]}
            name = f"merged_{len(self.deferred) + 1}"
            while name in self.targets:
                name += "_"
            self.deferred_names[key] = name
            self.deferred[name] = [{"$ref": _DEFS_PREFIX + n} for n in names] + plain
            self.targets[name] = (None, None, path)
        return {"$ref": _DEFS_PREFIX + name}

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
        return self.merge(parts, path)

    def _type_and_values(self, kw: dict, own: dict) -> None:
        if "type" in kw:
            own["type"] = _type_set(kw["type"])
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
            lower = _lower_bound(kw)
            upper = _upper_bound(kw)
        _set_bounds(own, lower, upper)
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
            self.problem("uniqueItems", path, "a grammar cannot compare items")
        if "contains" in kw and not (kw.get("minContains") == 0 and "maxContains" not in kw and self.year >= 2019):
            self.problem("contains", path, "a grammar cannot require an item anywhere in the array")
        if "unevaluatedItems" in kw:
            if any(k in kw for k in _IN_PLACE):
                self.problem("unevaluatedItems", path, "beside in-place applicators")
            elif "items" not in own:
                own["items"] = self.node(kw["unevaluatedItems"], resolver, f"{path}/unevaluatedItems")

    def _objects(self, kw: dict, own: dict, resolver: Any, path: str) -> None:
        if "properties" in kw:
            own["properties"] = {
                name: self.node(s, resolver, f"{path}/properties/{_escape(name)}")
                for name, s in kw["properties"].items()
            }
        if "patternProperties" in kw:
            own["patternProperties"] = {
                pattern: self.node(s, resolver, f"{path}/patternProperties/{_escape(pattern)}")
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
                self.problem("unevaluatedProperties", path, "beside in-place applicators")
            elif "additionalProperties" not in own:
                own["additionalProperties"] = self.node(kw["unevaluatedProperties"], resolver,
                                                          f"{path}/unevaluatedProperties")

    def _applicators(self, kw: dict, parts: list, resolver: Any, path: str) -> None:
        if "$ref" in kw:
            parts.append(self.hoist(kw["$ref"], resolver, path))
        for key in ("$dynamicRef", "$recursiveRef"):
            if key in kw:
                self.problem(key, path, "dynamic references are not supported")
        for i, branch in enumerate(kw.get("allOf", ())):
            parts.append(self.node(branch, resolver, f"{path}/allOf/{i}"))
        for key in ("anyOf", "oneOf"):
            if key in kw:
                parts.append({key: [self.node(b, resolver, f"{path}/{key}/{i}") for i, b in enumerate(kw[key])]})
        if "not" in kw:
            parts.append(self._negate(kw["not"], resolver, path))
        if "if" in kw and ("then" in kw or "else" in kw):
            self.problem("if", path, "conditional schemas are not supported")

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
                self.problem("not", path, "a grammar cannot exclude integers from numbers")
                return {}
            left = [t for t in _TYPES if t not in present and t != "integer"]
            return {"type": left} if left else False
        if keys == {"required"} or (keys == {"required", "type"} and negated["type"] == ["object"]):
            names = negated["required"]
            absent = [{"type": ["object"], "properties": {n: False}} for n in names]
            if keys == {"required"}:  # non-objects satisfy `required`, so fail its negation
                return absent[0] if len(absent) == 1 else {"anyOf": absent}
            others = {"type": [t for t in _TYPES if t not in ("object", "integer")]}
            return {"anyOf": [others, *absent]}
        self.problem("not", path, "only the negation of {}, of a type or of required is supported")
        return {}

    def _dependencies(self, kw: dict, parts: list, resolver: Any, path: str) -> None:
        triggers: list[tuple[str, Schema]] = []
        for keyword in ("dependencies", "dependentRequired", "dependentSchemas"):
            for name, dep in kw.get(keyword, {}).items():
                if isinstance(dep, list):
                    requirement: Schema = {"required": list(dep)} if dep else {}
                else:  # the schema applies to objects only, and only when `name` is present
                    requirement = self.node(dep, resolver, f"{path}/{keyword}/{_escape(name)}")
                    if name in kw.get("required", ()) and requirement != {}:
                        requirement = self.merge([{"anyOf": [{"type": _NON_OBJECT}, requirement]}], path)
                triggers.append((name, requirement))
        required = set(kw.get("required", ()))
        for name, requirement in triggers:
            if requirement == {}:
                continue
            if name in required:  # present in every object
                parts.append(requirement)
                continue
            present = self.merge([{"required": [name]}, requirement], path)
            parts.append({"anyOf": [{"properties": {name: False}}, present]})

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
        if len(flat) == 1 and not _mixed(flat[0]):
            return flat[0]
        if any("$ref" in p for p in flat):
            return self._merge_refs(flat, path)
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

    def _distribute(self, parts: list[dict], combinators: list[int], path: str) -> Schema:
        size = 1
        for i in combinators:
            p = parts[i]
            count = len(p.get("anyOf", ())) or len(p.get("oneOf", ()))
            if size * count > MAX_BRANCHES:
                self.problem("anyOf" if "anyOf" in p else "oneOf", path,
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
        return self._combine(key, [self.merge([rest, b], path) for b in p[key]], path)

    def _combine(self, key: str, branches: list[Schema], path: str) -> Schema:
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
            out = [b for b in out if not (_canon(b) in seen or seen.add(_canon(b)))]
        if not out:
            return False
        if len(out) == 1:
            return out[0]
        return {key: out}

    def _conjoin(self, a: dict, b: dict, path: str) -> Schema:
        """a ∧ b for two plain phase A dicts (no $ref, anyOf, oneOf)."""
        out: dict = {}
        if "type" in a or "type" in b:
            types = _intersect_types(a.get("type"), b.get("type"))
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
        _set_bounds(out, _tighter(_lower_bound(a), _lower_bound(b), max),
                    _tighter(_upper_bound(a), _upper_bound(b), lambda bs: min(bs, key=lambda x: (x[0], not x[1]))))
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
                self.problem("pattern", path, "two different patterns on one string cannot be combined")
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
        self.problem("multipleOf", path, "two multipleOf values cannot be combined")
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
            self.problem("patternProperties", path, "two sets of patternProperties beside additionalProperties "
                                                    "cannot be combined")
        merged = dict(pp_a)
        for p, s in pp_b.items():
            merged[p] = self.merge([merged[p], s], path) if p in merged else s
        return merged

    def governing(self, node: dict, name: str, path: str) -> Schema:
        """The schema ``node`` applies to the value of property ``name``."""
        if name in node.get("properties", {}):
            return node["properties"][name]
        matching = [s for p, s in node.get("patternProperties", {}).items() if pattern_search(p, name)]
        if matching:
            return self.merge(matching, path)
        return node.get("additionalProperties", {})

    # -- phase B: lowering ---------------------------------------------------

    def lower(self, node: Schema, path: str) -> Schema:
        """The form xgrammar compiles of the phase A schema ``node``."""
        if node is False or node == {}:
            return node
        if "$ref" in node:
            name = node["$ref"][len(_DEFS_PREFIX) :]
            if name in self.false_defs:
                return False
            if name not in self.defs_b and name not in self.pending_b:
                self.defs_b[name] = {}  # placeholder, so each def is queued once
                self.pending_b.append(name)
            return {"$ref": node["$ref"]}
        for key in ("anyOf", "oneOf"):
            if key in node:
                branches = [self.lower(b, f"{path}/{key}/{i}") for i, b in enumerate(node[key])]
                if key == "oneOf" and mutually_exclusive(branches):
                    key = "anyOf"  # the same language, without xgrammar's "falling back to anyOf" warning
                return self._combine(key, branches, path)
        if "enum" in node:
            return self._lower_enum(node)
        return self._lower_plain(node, path)

    def _lower_enum(self, node: dict) -> Schema:
        rest = {k: v for k, v in node.items() if k != "enum"}
        values = node["enum"]
        if rest:
            check = self.checker.evolve(schema=rest)
            values = [v for v in values if check.is_valid(v)]
        return {"enum": values} if values else False

    def _lower_plain(self, node: dict, path: str) -> Schema:
        types = node.get("type")
        if types is None:
            families = [f for f, keys in _FAMILY_KEYWORDS.items() if any(k in node for k in keys)]
            if not families:
                return {}
            types = _type_set(families)
        out: dict = {}
        alive = []
        for t in types:
            if t in ("number", "integer"):
                kept = self._lower_number(node, t, out, path)
            elif t == "string":
                kept = t if self._lower_string(node, out, path, types == ["string"]) else None
            elif t == "array":
                kept = t if self._lower_array(node, out, path) else None
            elif t == "object":
                kept = t if self._lower_object(node, out, path) else None
            else:
                kept = t
            if kept is not None:
                alive.append(kept)
        if not alive:
            return False
        out["type"] = alive[0] if len(alive) == 1 else _type_set(alive)
        return out

    def _lower_number(self, node: dict, t: str, out: dict, path: str) -> str | None:
        """Write the numeric keywords into ``out``; the type kept ("number", "integer") or None."""
        lower, upper = _lower_bound(node), _upper_bound(node)
        step = node.get("multipleOf")
        if step is not None and t == "number":
            if float(step).is_integer():
                t = "integer"  # narrower: multiples of an integer that are not integers are lost
            else:
                self.problem("multipleOf", path, "xgrammar enforces multipleOf on integers only", True)
                step = None
        if t == "number":
            if lower is not None and upper is not None:
                if lower[0] > upper[0] or (lower[0] == upper[0] and (lower[1] or upper[1])):
                    return None
            _set_bounds(out, lower, upper)
            return t
        low = None if lower is None else (math.floor(lower[0]) + 1 if lower[1] else math.ceil(lower[0]))
        high = None if upper is None else (math.ceil(upper[0]) - 1 if upper[1] else math.floor(upper[0]))
        low = None if low is None else max(low, INT64_MIN)  # narrower beyond int64
        high = None if high is None else min(high, INT64_MAX)
        if low is not None and high is not None and low > high:
            return None
        _set_bounds(out, None if low is None else (low, False), None if high is None else (high, False))
        if step is None:
            return t
        if not float(step).is_integer():
            self.problem("multipleOf", path, "a fractional multipleOf on integers", True)
        elif int(step) != 1:
            if (low is None) != (high is None) or (low is not None and high - low >= XGRAMMAR_MULTIPLE_OF_SPAN):
                self.problem("multipleOf", path, "xgrammar ignores multipleOf with one bound or with a span "
                                                 f"of {XGRAMMAR_MULTIPLE_OF_SPAN} or more", True)
            else:
                out["multipleOf"] = int(step)
        return t

    def _lower_string(self, node: dict, out: dict, path: str, only_string: bool) -> bool:
        min_length, max_length = node.get("minLength", 0), node.get("maxLength")
        if max_length is not None and min_length > max_length:
            return False
        pattern = node.get("pattern")
        if pattern is not None:
            pattern = self._usable_pattern(pattern, path)
        if pattern is not None:
            pattern = full_match_pattern(pattern)
            if min_length > 0 or max_length is not None:
                combined = pattern_with_lengths(pattern, min_length, max_length)
                if combined == "":
                    return False
                if combined is None:
                    self.problem("minLength" if min_length > 0 else "maxLength", path,
                                 f"xgrammar ignores string lengths beside a pattern ({pattern!r})", True)
                else:
                    pattern = combined
                min_length, max_length = 0, None
            out["pattern"] = separator_first_repeat(pattern)
        if min_length > 0:
            out["minLength"] = min_length
        if max_length is not None:
            out["maxLength"] = max_length
        if "format" in node and only_string and pattern is None and min_length == 0 and max_length is None:
            out["format"] = node["format"]
        return True

    def _usable_pattern(self, pattern: str, path: str) -> str | None:
        """The pattern xgrammar can enforce; None when it says nothing or has to be dropped."""
        if is_vacuous(pattern):
            return None
        if re.match(r"\(\?[a-zA-Z]+\)", pattern):
            self.problem("pattern", path, f"inline flags in {pattern!r} are not ECMA-262 syntax", True)
            return None
        if has_lookaround(pattern):
            self.problem("pattern", path, f"lookaround in {pattern!r} is not supported", True)
            pattern = strip_lookarounds(pattern)
        error = xgrammar_regex_error(full_match_pattern(pattern))
        if error is not None:
            self.problem("pattern", path, f"{pattern!r}: {error}", True)
            return None
        return pattern

    def _lower_array(self, node: dict, out: dict, path: str) -> bool:
        prefix = [self.lower(s, f"{path}/prefixItems/{i}") for i, s in enumerate(node.get("prefixItems", []))]
        min_items, max_items = node.get("minItems", 0), node.get("maxItems")
        for i, s in enumerate(prefix):
            if s is False:  # no array reaches position i
                prefix = prefix[:i]
                max_items = i if max_items is None else min(max_items, i)
                break
        if max_items is not None:
            prefix = prefix[:max_items]  # positions no array reaches
        items = self.lower(node["items"], f"{path}/items") if "items" in node else {}
        if items is False:
            max_items = len(prefix) if max_items is None else min(max_items, len(prefix))
        if max_items is not None and min_items > max_items:
            return False
        if prefix:
            out["prefixItems"] = prefix
        if items is False or items != {} or not prefix or min_items > len(prefix):
            out["items"] = items  # strict mode: without `items`, xgrammar allows no (more) items
        if min_items > 0:
            out["minItems"] = min_items
        if max_items is not None:
            out["maxItems"] = max_items
        return True

    def _lower_object(self, node: dict, out: dict, path: str) -> bool:
        """Write the object keywords into ``out``; False when no object satisfies them."""
        patterns = node.get("patternProperties", {})
        required = node.get("required", [])
        names = dict(node.get("properties", {}))
        for name in required:
            if name not in names:
                names[name] = self.governing(node, name, path)
        for name in node.get("properties", {}):
            matching = [s for p, s in patterns.items() if pattern_search(p, name)]
            if matching:
                names[name] = self.merge([names[name], *matching], path)
        property_names = self.lower(node.get("propertyNames", {}), f"{path}/propertyNames")
        bad_names: set[str] = set()  # excluded by propertyNames itself
        if property_names not in ({}, False):
            check = self.checker.evolve(schema=node["propertyNames"])
            bad_names = {n for n in names if not check.is_valid(n)}
        listed = {n: False if n in bad_names else self.lower(s, f"{path}/properties/{_escape(n)}")
                  for n, s in names.items()}
        if any(listed[n] is False for n in required):
            return False
        max_properties = 0 if property_names is False else node.get("maxProperties")
        if max_properties is not None and len(required) > max_properties:
            return False
        additional = node.get("additionalProperties")
        additional = None if additional is None else self.lower(additional, f"{path}/additionalProperties")
        lowered_patterns = {p: self.lower(s, f"{path}/patternProperties/{_escape(p)}")
                            for p, s in patterns.items()}
        additional, lowered_patterns = self._drop_false_patterns(additional, lowered_patterns, path)
        forbidden = [n for n, s in listed.items() if s is False and n not in bad_names]
        listed = {n: s for n, s in listed.items() if s is not False}
        additional, lowered_patterns = self._close_patterns(listed, forbidden, additional, lowered_patterns, path)
        if additional is False and not lowered_patterns:
            property_names = {}  # only listed names remain, and they were checked against it
        if property_names not in ({}, False):
            additional, lowered_patterns, property_names = self._lower_property_names(
                listed, property_names, additional, lowered_patterns, path)
        min_properties = node.get("minProperties", 0)
        if min_properties > len(listed) and not lowered_patterns:
            if additional is False:
                return False
            if additional is None:
                additional = {}  # strict mode would allow only the listed properties
        if listed:
            out["properties"] = listed
        if required:
            out["required"] = list(required)
        if additional is not None:
            out["additionalProperties"] = additional
        if lowered_patterns:
            out["patternProperties"] = lowered_patterns
        if property_names not in ({}, False):
            out["propertyNames"] = property_names
        if min_properties > 0:
            out["minProperties"] = min_properties
        if max_properties is not None:
            out["maxProperties"] = max_properties
        return True

    def _drop_false_patterns(self, additional: Schema | None, patterns: dict,
                             path: str) -> tuple[Schema | None, dict]:
        """Remove ``pattern: false`` entries; keys matching them become additional, which must then be false."""
        false = [p for p, s in patterns.items() if s is False]
        if not false:
            return additional, patterns
        if len(patterns) > 1 or additional not in (None, False):
            for p in false:
                self.problem("patternProperties", f"{path}/patternProperties/{_escape(p)}",
                             "properties matching it must be absent, but other keywords admit them", True)
        elif additional is None:
            additional = False  # narrower: unmatched names were allowed
        return additional, {p: s for p, s in patterns.items() if s is not False}

    def _close_patterns(self, listed: dict, forbidden: list[str], additional: Schema | None,
                        patterns: dict, path: str) -> tuple[Schema | None, dict]:
        """Make the key patterns xgrammar sees exclude what they must not admit.

        xgrammar lets a key matching a pattern take the pattern's schema even
        when the key is also listed in ``properties``; so a pattern is rewritten
        to exclude the listed names it matches whose schema differs, and the
        names that must be absent (``forbidden``, dropped from ``properties``).
        A forbidden name no pattern matches is closed by additionalProperties
        false when unset; additionalProperties that admit it become a pattern
        for every other unlisted name. Returns additionalProperties and the
        patterns (full-match, as xgrammar reads them).
        """
        if patterns and additional not in (None, False):
            if any(full_match_pattern(p) == "^.*$" or is_vacuous(p) for p in patterns):
                additional = None  # every key matches a pattern: none is left for it
            else:
                self.problem("additionalProperties", path, "beside patternProperties, xgrammar may give "
                             "a key that matches a pattern the additionalProperties schema", True)
        open_names = [n for n in forbidden if not any(pattern_search(p, n) for p in patterns)]
        if open_names and additional is None and (listed or patterns):
            additional = False  # xgrammar's strict mode admits no unlisted name there anyway
        elif open_names and additional is None:
            patterns = {exclude_words(".*", open_names): {}}  # any other name stays allowed
            additional = False
        elif open_names and additional is not False:
            if patterns:
                self.problem("properties", path, f"properties {open_names} must be absent, but "
                                                 "additionalProperties admits them", True)
            else:  # the additional keys become a pattern that leaves out the forbidden (and listed) names
                patterns = {exclude_words(".*", open_names + list(listed)): additional}
                additional = False
        by_pattern: dict[str, list[str]] = {}
        for p, schema in patterns.items():
            clash = [n for n, s in listed.items() if pattern_search(p, n) and _canon(s) != _canon(schema)]
            by_pattern[p] = clash + [n for n in forbidden if pattern_search(p, n)]
        if any(n in forbidden for ns in by_pattern.values() for n in ns) and additional is None:
            additional = False  # the excluded names must not fall to an open additionalProperties
        kept = {}
        for p, schema in patterns.items():
            usable = self._usable_pattern(p, f"{path}/patternProperties")
            usable = ".*" if usable is None else usable
            full = full_match_pattern(usable)
            if by_pattern[p]:
                narrowed = exclude_words(full, by_pattern[p])
                if narrowed is None:
                    self.problem("patternProperties", f"{path}/patternProperties/{_escape(p)}",
                                 f"it matches properties {by_pattern[p]} that must keep their own schema "
                                 "(or be absent), and the grammar cannot exclude them from this pattern", True)
                else:
                    full = narrowed
            kept[full] = schema
        if len({_canon(s) for s in kept.values()}) > 1:
            self.problem("patternProperties", path, "several patterns with different schemas: xgrammar checks "
                                                    "a key against one of them", True)
        return additional, kept

    def _lower_property_names(self, listed: dict, property_names: dict, additional: Schema | None,
                              patterns: dict, path: str) -> tuple[Schema | None, dict, Schema]:
        """xgrammar ignores propertyNames beside patternProperties, and lets a listed name take
        the additionalProperties schema when propertyNames is given; so propertyNames with a
        pattern becomes a pattern of its own that leaves out the listed names."""
        if patterns:
            self.problem("propertyNames", path, "xgrammar ignores propertyNames beside patternProperties", True)
            return additional, patterns, {}
        if not listed or additional is None:
            return additional, patterns, property_names
        own = {k: v for k, v in property_names.items() if k != "type"}
        narrowed = exclude_words(own["pattern"], list(listed)) if set(own) == {"pattern"} else None
        if narrowed is None:
            self.problem("propertyNames", path, "beside properties and additionalProperties, xgrammar would let "
                                                "a listed property take the additionalProperties schema", True)
            return additional, patterns, property_names
        return False, {narrowed: additional}, {}


def _mixed(p: dict) -> bool:
    """True when a phase A candidate has $ref or a combinator beside other keywords."""
    if len(p) <= 1:
        return False
    return "$ref" in p or "anyOf" in p or "oneOf" in p


def _refs_in(node: Any) -> list[str]:
    """Names of the $defs referenced anywhere in ``node``."""
    out: list[str] = []
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            ref = x.get("$ref")
            if isinstance(ref, str) and ref.startswith(_DEFS_PREFIX):
                out.append(ref[len(_DEFS_PREFIX) :])
            stack.extend(v for k, v in x.items() if k != "enum")
        elif isinstance(x, list):
            stack.extend(x)
    return out
