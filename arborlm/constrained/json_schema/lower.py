"""Phase B of JSON-schema preparation, lowering: maps the phase A schema
(`normalise`) to what xgrammar 0.2.9 compiles and enforces, recording what it
would silently ignore as problems (refused, or when lenient dropped, by
`prepare_json_schema`).

`lower_document` lowers the whole document; each pass is a `SchemaLowering`.
Runs for a backend whose `SchemaPolicy` asks for the xgrammar form.

What changes, keeping the meaning: ``enum``/``const`` keep only the values
the rest of their schema accepts; a name in ``required`` but not in
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
least `MIN_REPEAT_CAP`) so the longest match fits; ``.`` in a
``pattern`` is ECMA-262's, never a line terminator (``[^\\n\\r\\u2028\\u2029]``,
`regex_constraint.dot_as_class`; `jsonschema` validates with Python's ``.``,
which is wider); an unset additionalProperties becomes false where a forbidden
property is dropped.

Recorded as problems: ``multipleOf`` that is fractional or beside an
unsupported range; ``minLength``/``maxLength`` beside a pattern that cannot
take them; a pattern with lookaround, inline flags or a construct xgrammar
cannot compile; ``patternProperties`` with different schemas for several
patterns, or that must leave out names and have no supported shape;
``additionalProperties`` beside patterns that do not cover every key;
``propertyNames`` beside ``patternProperties``. A schema that accepts no
value is an error even when lenient.

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
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from jsonschema import validators as js_validators

from arborlm.constrained.json_schema.budgeted_validator import budgeted_validator_class
from arborlm.constrained.json_schema.merge import SchemaMerge
from arborlm.constrained.json_schema.nodes import (
    DEFS_PREFIX,
    FAMILY_KEYWORDS,
    INT64_MAX,
    INT64_MIN,
    PARAM,
    XGRAMMAR_MULTIPLE_OF_SPAN,
    Problem,
    Problems,
    Schema,
    canon,
    escape_pointer,
    lower_bound,
    set_bounds,
    type_set,
    upper_bound,
)
from arborlm.constrained.json_schema.normalise import Normaliser
from arborlm.constrained.json_schema.patterns import (
    exclude_words,
    full_match_pattern,
    has_lookaround,
    is_vacuous,
    pattern_with_lengths,
    separator_first_repeat,
    strip_lookarounds,
    xgrammar_regex_error,
)
from arborlm.constrained.json_schema.values import mutually_exclusive
from arborlm.constrained.keys import GrammarError
from arborlm.constrained.regex_constraint import RegexDialect, dot_as_class


@dataclass(frozen=True)
class Lowered:
    """The document xgrammar compiles, and the `Problem`s of the lowering pass that made it."""

    doc: dict
    problems: list[Problem]


def lower_document(root_a: Schema, normaliser: Normaliser) -> Lowered:
    """Phase B of a whole document: its root (``root_a``, from `Normaliser.run`) and every def it reaches.

    A pass lowers the root, then each ``$defs`` entry it reaches; a def that
    lowers to False makes the references to it False, so passes rerun until
    the set of such defs stops growing. The problems are the last pass's (the
    merges a pass makes record theirs in ``normaliser.problems``).

    Raises
    ------
    GrammarError
        The schema accepts no value.
    """
    doc_a = dict(root_a) if isinstance(root_a, dict) else {}
    doc_a["$defs"] = normaliser.defs_a  # the live table: merges during phase B may add entries
    # Enum values and property names are checked with the budget's searches, not `re`'s.
    checker = budgeted_validator_class(js_validators.Draft202012Validator, normaliser.merger.budget)(doc_a)
    false_defs: set[str] = set()
    while True:
        lowering = SchemaLowering(normaliser.merger, checker, false_defs)
        root_b = lowering.lower(root_a, "")
        while lowering.pending:
            name = lowering.pending.pop()
            # `def_a`, not `defs_a[name]`: a merge during this pass may have deferred a new entry.
            lowering.defs[name] = lowering.lower(normaliser.def_a(name), normaliser.def_path(name))
        newly_false = {n for n, s in lowering.defs.items() if s is False} - false_defs
        if not newly_false:
            break
        false_defs |= newly_false
    if root_b is False:
        raise GrammarError("json_schema accepts no value (its constraints contradict each other)"
                           + "".join(f"; {why}" for why in lowering.emptied_enums[:1]), PARAM)
    doc = dict(root_b)
    if lowering.defs:
        doc["$defs"] = {name: lowering.defs[name] for name in sorted(lowering.defs)}
    return Lowered(doc, lowering.problems.items)


class SchemaLowering:
    """One pass of phase B: lowers phase A schemas to what xgrammar compiles.

    merger: the phase A conjunction (`merge`, `combine`, `governing`); its
        `RegexBudget` matches user patterns here too.
    checker: a validator over the phase A document.
    false_defs: names of the ``$defs`` known to accept nothing (lowered to False).

    `defs` collects the lowered ``$defs`` a pass reached, `pending` the names still
    to lower, `problems` what it could not enforce, `emptied_enums` the ``enum``s
    none of whose values the keywords beside them accept (why a schema may accept
    no value). It never mutates phase A's nodes.
    """

    def __init__(self, merger: SchemaMerge, checker: Any, false_defs: set[str]):
        self.merger = merger
        self.budget = merger.budget
        self.checker = checker
        self.false_defs = false_defs
        self.defs: dict[str, Schema] = {}
        self.pending: list[str] = []
        self.problems = Problems()
        self.emptied_enums: list[str] = []

    # -- phase B: lowering ---------------------------------------------------

    def lower(self, node: Schema, path: str) -> Schema:
        """The form xgrammar compiles of the phase A schema ``node``."""
        if node is False or node == {}:
            return node
        if "$ref" in node:
            name = node["$ref"][len(DEFS_PREFIX) :]
            if name in self.false_defs:
                return False
            if name not in self.defs and name not in self.pending:
                self.defs[name] = {}  # placeholder, so each def is queued once
                self.pending.append(name)
            return {"$ref": node["$ref"]}
        for key in ("anyOf", "oneOf"):
            if key in node:
                branches = [self.lower(b, f"{path}/{key}/{i}") for i, b in enumerate(node[key])]
                if key == "oneOf" and mutually_exclusive(branches):
                    key = "anyOf"  # the same language, without xgrammar's "falling back to anyOf" warning
                return self.merger.combine(key, branches, path)
        if "enum" in node:
            return self._lower_enum(node, path)
        return self._lower_plain(node, path)

    def _lower_enum(self, node: dict, path: str) -> Schema:
        rest = {k: v for k, v in node.items() if k != "enum"}
        values = node["enum"]
        if rest:
            check = self.checker.evolve(schema=rest)
            values = [v for v in values if check.is_valid(v)]
            if not values:
                self.emptied_enums.append(_emptied_enum(rest, path))
        return {"enum": values} if values else False

    def _lower_plain(self, node: dict, path: str) -> Schema:
        types = node.get("type")
        if types is None:
            families = [f for f, keys in FAMILY_KEYWORDS.items() if any(k in node for k in keys)]
            if not families:
                return {}
            types = type_set(families)
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
        out["type"] = alive[0] if len(alive) == 1 else type_set(alive)
        return out

    def _lower_number(self, node: dict, t: str, out: dict, path: str) -> str | None:
        """Write the numeric keywords into ``out``; the type kept ("number", "integer") or None."""
        lower, upper = lower_bound(node), upper_bound(node)
        step = node.get("multipleOf")
        if step is not None and t == "number":
            if float(step).is_integer():
                t = "integer"  # narrower: multiples of an integer that are not integers are lost
            else:
                self.problems.add("multipleOf", path, "xgrammar enforces multipleOf on integers only")
                step = None
        if t == "number":
            if lower is not None and upper is not None:
                if lower[0] > upper[0] or (lower[0] == upper[0] and (lower[1] or upper[1])):
                    return None
            set_bounds(out, lower, upper)
            return t
        low = None if lower is None else (math.floor(lower[0]) + 1 if lower[1] else math.ceil(lower[0]))
        high = None if upper is None else (math.ceil(upper[0]) - 1 if upper[1] else math.floor(upper[0]))
        low = None if low is None else max(low, INT64_MIN)  # narrower beyond int64
        high = None if high is None else min(high, INT64_MAX)
        if low is not None and high is not None and low > high:
            return None
        set_bounds(out, None if low is None else (low, False), None if high is None else (high, False))
        if step is None:
            return t
        if not float(step).is_integer():
            self.problems.add("multipleOf", path, "a fractional multipleOf on integers")
        elif int(step) != 1:
            if (low is None) != (high is None) or (low is not None and high - low >= XGRAMMAR_MULTIPLE_OF_SPAN):
                self.problems.add("multipleOf", path, "xgrammar ignores multipleOf with one bound or with a span "
                                                      f"of {XGRAMMAR_MULTIPLE_OF_SPAN} or more")
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
                    self.problems.add("minLength" if min_length > 0 else "maxLength", path,
                                      f"xgrammar ignores string lengths beside a pattern ({pattern!r})")
                else:
                    pattern = combined
                min_length, max_length = 0, None
            # Last: the rewrites above read "." tokens; the class is what ECMA-262 means by one.
            out["pattern"] = dot_as_class(separator_first_repeat(pattern), RegexDialect.ECMA)
        if min_length > 0:
            out["minLength"] = min_length
        if max_length is not None:
            out["maxLength"] = max_length
        if "format" in node and only_string and pattern is None and min_length == 0 and max_length is None:
            out["format"] = node["format"]
        return True

    def _usable_pattern(self, pattern: str, path: str) -> str | None:
        """The pattern xgrammar can enforce; None when it says nothing or has to be dropped."""
        if is_vacuous(pattern, self.budget):
            return None
        if re.match(r"\(\?[a-zA-Z]+\)", pattern):
            self.problems.add("pattern", path, f"inline flags in {pattern!r} are not ECMA-262 syntax")
            return None
        if has_lookaround(pattern):
            self.problems.add("pattern", path, f"lookaround in {pattern!r} is not supported")
            pattern = strip_lookarounds(pattern)
        error = xgrammar_regex_error(full_match_pattern(pattern))
        if error is not None:
            self.problems.add("pattern", path, f"{pattern!r}: {error}")
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
                names[name] = self.merger.governing(node, name, path, by_reference=True)
        for name in node.get("properties", {}):
            matching = [s for p, s in patterns.items() if self.budget.search(p, name)]
            if matching:
                # By reference: two recursive $refs merged in place would unfold in their own lowering.
                names[name] = self.merger.merge_by_reference([names[name], *matching], path)
        property_names = self.lower(node.get("propertyNames", {}), f"{path}/propertyNames")
        bad_names: set[str] = set()  # excluded by propertyNames itself
        if property_names not in ({}, False):
            check = self.checker.evolve(schema=node["propertyNames"])
            bad_names = {n for n in names if not check.is_valid(n)}
        listed = {n: False if n in bad_names else self.lower(s, f"{path}/properties/{escape_pointer(n)}")
                  for n, s in names.items()}
        if any(listed[n] is False for n in required):
            return False
        max_properties = 0 if property_names is False else node.get("maxProperties")
        if max_properties is not None and len(required) > max_properties:
            return False
        additional = node.get("additionalProperties")
        additional = None if additional is None else self.lower(additional, f"{path}/additionalProperties")
        lowered_patterns = {p: self.lower(s, f"{path}/patternProperties/{escape_pointer(p)}")
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
                self.problems.add("patternProperties", f"{path}/patternProperties/{escape_pointer(p)}",
                                  "properties matching it must be absent, but other keywords admit them")
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
            if any(full_match_pattern(p) == "^.*$" or is_vacuous(p, self.budget) for p in patterns):
                additional = None  # every key matches a pattern: none is left for it
            else:
                self.problems.add("additionalProperties", path, "beside patternProperties, xgrammar may give "
                                  "a key that matches a pattern the additionalProperties schema")
        open_names = [n for n in forbidden if not any(self.budget.search(p, n) for p in patterns)]
        if open_names and additional is None and (listed or patterns):
            additional = False  # xgrammar's strict mode admits no unlisted name there anyway
        elif open_names and additional is None:
            patterns = {exclude_words(".*", open_names): {}}  # any other name stays allowed
            additional = False
        elif open_names and additional is not False:
            if patterns:
                self.problems.add("properties", path, f"properties {open_names} must be absent, but "
                                                      "additionalProperties admits them")
            else:  # the additional keys become a pattern that leaves out the forbidden (and listed) names
                patterns = {exclude_words(".*", open_names + list(listed)): additional}
                additional = False
        by_pattern: dict[str, list[str]] = {}
        for p, schema in patterns.items():
            clash = [n for n, s in listed.items() if self.budget.search(p, n) and canon(s) != canon(schema)]
            by_pattern[p] = clash + [n for n in forbidden if self.budget.search(p, n)]
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
                    self.problems.add("patternProperties", f"{path}/patternProperties/{escape_pointer(p)}",
                                      f"it matches properties {by_pattern[p]} that must keep their own schema "
                                      "(or be absent), and the grammar cannot exclude them from this pattern")
                else:
                    full = narrowed
            kept[full] = schema
        if len({canon(s) for s in kept.values()}) > 1:
            self.problems.add("patternProperties", path, "several patterns with different schemas: xgrammar checks "
                                                         "a key against one of them")
        return additional, kept

    def _lower_property_names(self, listed: dict, property_names: dict, additional: Schema | None,
                              patterns: dict, path: str) -> tuple[Schema | None, dict, Schema]:
        """xgrammar ignores propertyNames beside patternProperties, and lets a listed name take
        the additionalProperties schema when propertyNames is given; so propertyNames with a
        pattern becomes a pattern of its own that leaves out the listed names."""
        if patterns:
            self.problems.add("propertyNames", path, "xgrammar ignores propertyNames beside patternProperties")
            return additional, patterns, {}
        if not listed or additional is None:
            return additional, patterns, property_names
        own = {k: v for k, v in property_names.items() if k != "type"}
        narrowed = exclude_words(own["pattern"], list(listed)) if set(own) == {"pattern"} else None
        if narrowed is None:
            self.problems.add("propertyNames", path, "beside properties and additionalProperties, xgrammar would let "
                                                     "a listed property take the additionalProperties schema")
            return additional, patterns, property_names
        return False, {narrowed: additional}, {}


def _emptied_enum(rest: dict, path: str) -> str:
    """Why an ``enum`` at ``path`` lost every value to the keywords beside it (``rest``), for the error."""
    pattern = f", pattern {rest['pattern']!r}" if "pattern" in rest else ""
    return (f"no value of the enum at {path or '/'} satisfies the keywords beside it "
            f"({', '.join(sorted(rest))}{pattern})")
