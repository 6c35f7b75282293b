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
import re
from dataclasses import dataclass
from typing import Any

import referencing.jsonschema
from jsonschema import exceptions as js_exceptions
from jsonschema import validators as js_validators

from arborlm.constrained.base import GrammarError
from arborlm.constrained.json_schema.nodes import DRAFT_YEAR, PARAM
from arborlm.constrained.json_schema.normalise import Normaliser

# Most refused keywords named in one error message.
MAX_NAMED_PROBLEMS = 8
# Longest schema accepted, in characters of its JSON text: far above real schemas (a
# 20000-value enum is ~300k), and it bounds the work a request can make the front do.
MAX_SCHEMA_CHARS = 1 << 20

_VALIDATORS = (
    js_validators.Draft202012Validator,
    js_validators.Draft201909Validator,
    js_validators.Draft7Validator,
    js_validators.Draft6Validator,
    js_validators.Draft4Validator,
)


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
        (``param="json_schema"``) The JSON text is longer than `MAX_SCHEMA_CHARS`
        or not JSON (with line and column),
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
    normaliser = Normaliser(raw, cls)
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
    if not isinstance(schema, (str, bool)):
        try:  # a private copy, with JSON types only
            schema = json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"json_schema is not JSON-serialisable: {e}", PARAM) from e
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_CHARS:
            raise GrammarError(
                f"json_schema is {len(schema)} characters of JSON; the limit is {MAX_SCHEMA_CHARS}", PARAM
            )
        try:
            value = _strict_json_loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(
                f"json_schema is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", PARAM
            ) from e
        except ValueError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}", PARAM) from e
    else:
        value = schema
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
    year = DRAFT_YEAR[cls]
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
