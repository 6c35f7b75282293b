"""``jsonschema`` validators whose regex keywords match through a `RegexBudget`.

``jsonschema`` evaluates ``pattern``, ``patternProperties`` and the keys
that ``additionalProperties`` and ``unevaluatedProperties`` leave over with
Python's `re`, which can backtrack for seconds while holding the GIL (see
`regex_budget`). `budgeted_validator_class` swaps those four keywords for
versions that search through the job's budget, so validating against a
user's schema (enum filtering in `lower`, output validation in `validate`)
is bounded like every other search of a user pattern.

``multipleOf`` is replaced too, by a decimal one (`_exact_multiple_of`):
``jsonschema`` divides binary floats, so ``71.13`` is "not a multiple of
0.01" (71.13 / 0.01 = 7112.999...), and a grammar that enforces two decimals
exactly (llguidance) had its outputs aborted by this check.

The keyword functions follow ``jsonschema`` 4.x (``_keywords.py``,
``_utils.py`` and ``_legacy_keywords.py``, MIT licence) line for line, with
``re.search`` replaced; their messages are the same.

A subschema that declares ``$schema`` makes ``jsonschema`` switch to that
dialect's stock validator (``validator_for`` in ``evolve``); callers that
validate a user's document strip ``$schema`` first (`without_dialects`) and
pick the class themselves.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import referencing.jsonschema
from jsonschema import validators as js_validators
from jsonschema.exceptions import ValidationError

from arborlm.constrained.json_schema.regex_budget import RegexBudget


def budgeted_validator_class(cls: type, budget: RegexBudget) -> type:
    """``cls`` (a ``jsonschema`` validator class) with its regex keywords searching through ``budget``.

    ``multipleOf`` is decided in decimal (`_exact_multiple_of`). Only keywords
    ``cls``'s dialect has are replaced (draft 4 to 7 have no
    ``unevaluatedProperties``). Building a class costs about 0.7 ms.

    Raises (from the validator's methods)
    -------------------------------------
    PatternTimeout
        A search outlived ``budget``.
    """
    keywords = {
        "pattern": _pattern_keyword(budget),
        "patternProperties": _pattern_properties_keyword(budget),
        "additionalProperties": _additional_properties_keyword(budget),
        "unevaluatedProperties": _unevaluated_properties_keyword(budget, legacy=cls is js_validators.Draft201909Validator),
        "multipleOf": _exact_multiple_of,
    }
    return js_validators.extend(cls, {k: f for k, f in keywords.items() if k in cls.VALIDATORS})


def without_dialects(schema: Any, cls: type) -> Any:
    """``schema`` (a fresh value, changed in place) without ``$schema`` in any of its subschemas.

    The dialect is ``cls``'s throughout, as `prepare_json_schema` read it;
    the subschemas are found as ``referencing`` finds them, so a property
    called ``$schema`` or an ``enum`` value that holds one is left alone.
    """
    if not isinstance(schema, dict):
        return schema
    specification = referencing.jsonschema.specification_with(
        cls.META_SCHEMA.get("$id", cls.META_SCHEMA.get("id", "")))
    todo = [specification.create_resource(schema)]
    while todo:
        resource = todo.pop()
        if isinstance(resource.contents, dict):
            resource.contents.pop("$schema", None)
        todo.extend(resource.subresources())
    return schema


def _exact_multiple_of(validator, divisor, instance, schema):
    """``multipleOf`` on the numbers' shortest decimal forms (``repr``), exactly, as written in JSON.

    A JSON number of at most 17 significant digits reads back from its float
    as the text it was written as, so ``71.13`` is 7113/100 here, a multiple
    of 0.01 (1/100); ``jsonschema``'s float division says it is not.
    """
    if not validator.is_type(instance, "number"):
        return
    if (Fraction(repr(instance)) / Fraction(repr(divisor))).denominator != 1:
        yield ValidationError(f"{instance!r} is not a multiple of {divisor}")


def _pattern_keyword(budget: RegexBudget):
    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and not budget.search(patrn, instance):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    return pattern


def _pattern_properties_keyword(budget: RegexBudget):
    def pattern_properties(validator, pattern_properties, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        for pattern, subschema in pattern_properties.items():
            for k, v in instance.items():
                if budget.search(pattern, k):
                    yield from validator.descend(v, subschema, path=k, schema_path=pattern)

    return pattern_properties


def _additional_properties_keyword(budget: RegexBudget):
    def additional_properties(validator, additional, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        extras = set(_additional_keys(instance, schema, budget))
        if validator.is_type(additional, "object"):
            for extra in extras:
                yield from validator.descend(instance[extra], additional, path=extra)
        elif not additional and extras:
            if "patternProperties" in schema:
                verb = "does" if len(extras) == 1 else "do"
                joined = ", ".join(repr(each) for each in sorted(extras))
                patterns = ", ".join(repr(each) for each in sorted(schema["patternProperties"]))
                yield ValidationError(f"{joined} {verb} not match any of the regexes: {patterns}")
            else:
                yield ValidationError(
                    f"Additional properties are not allowed ({_extras(sorted(extras, key=str))} unexpected)")

    return additional_properties


def _unevaluated_properties_keyword(budget: RegexBudget, *, legacy: bool):
    def unevaluated_properties(validator, unevaluated, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        evaluated = _evaluated_keys(validator, instance, schema, budget, legacy)
        bad = [p for p in instance if p not in evaluated
               and next(validator.descend(instance[p], unevaluated, path=p, schema_path=p), None) is not None]
        if not bad:
            return
        if unevaluated is False:
            yield ValidationError(f"Unevaluated properties are not allowed ({_extras(sorted(bad, key=str))} unexpected)")
        else:
            yield ValidationError("Unevaluated properties are not valid under the given schema "
                                  f"({_extras(bad)} unevaluated and invalid)")

    return unevaluated_properties


def _additional_keys(instance: dict, schema: dict, budget: RegexBudget):
    """The keys of ``instance`` neither listed in ``properties`` nor matching a ``patternProperties`` pattern."""
    properties = schema.get("properties", {})
    patterns = "|".join(schema.get("patternProperties", {}))
    for key in instance:
        if key not in properties and not (patterns and budget.search(patterns, key)):
            yield key


def _evaluated_keys(validator, instance: dict, schema: Any, budget: RegexBudget, legacy: bool) -> list:
    """The keys of ``instance`` that ``schema``'s in-place keywords evaluate (``unevaluatedProperties``).

    ``legacy``: draft 2019-09 (``$recursiveRef``; ``properties``,
    ``additionalProperties`` and ``unevaluatedProperties`` count as written,
    not by the validity of the values), as ``jsonschema`` does.
    """
    if validator.is_type(schema, "boolean"):
        return []
    keys: list = []
    for ref_keyword in ("$ref", "$recursiveRef" if legacy else "$dynamicRef"):
        if ref_keyword not in schema:
            continue
        if ref_keyword == "$recursiveRef":
            resolved = referencing.jsonschema.lookup_recursive_ref(validator._resolver)
        else:
            resolved = validator._resolver.lookup(schema[ref_keyword])
        target = validator.evolve(schema=resolved.contents, _resolver=resolved.resolver)
        keys += _evaluated_keys(target, instance, resolved.contents, budget, legacy)
    keys += _evaluated_by_properties(validator, instance, schema, legacy)
    for pattern in schema.get("patternProperties", ()):
        keys += [k for k in instance if budget.search(pattern, k)]
    for name, subschema in schema.get("dependentSchemas", {}).items():
        if name in instance:
            keys += _evaluated_keys(validator, instance, subschema, budget, legacy)
    for keyword in ("allOf", "oneOf", "anyOf"):
        for subschema in schema.get(keyword, ()):
            if next(validator.descend(instance, subschema), None) is None:
                keys += _evaluated_keys(validator, instance, subschema, budget, legacy)
    if "if" in schema:
        if validator.evolve(schema=schema["if"]).is_valid(instance):
            keys += _evaluated_keys(validator, instance, schema["if"], budget, legacy)
            if "then" in schema:
                keys += _evaluated_keys(validator, instance, schema["then"], budget, legacy)
        elif "else" in schema:
            keys += _evaluated_keys(validator, instance, schema["else"], budget, legacy)
    return keys


def _evaluated_by_properties(validator, instance: dict, schema: dict, legacy: bool) -> list:
    """The keys ``properties``, ``additionalProperties`` and ``unevaluatedProperties`` evaluate."""
    if legacy:
        keys: list = []
        for keyword in ("properties", "additionalProperties", "unevaluatedProperties"):
            value = schema.get(keyword)
            if validator.is_type(value, "boolean") and value:
                keys += instance.keys()
            elif validator.is_type(value, "object"):
                keys += [p for p in value if p in instance]
        return keys
    properties = schema.get("properties")
    keys = list(properties.keys() & instance.keys()) if validator.is_type(properties, "object") else []
    for keyword in ("additionalProperties", "unevaluatedProperties"):
        if (subschema := schema.get(keyword)) is not None:
            keys += [k for k, v in instance.items() if next(validator.descend(v, subschema), None) is None]
    return keys


def _extras(extras: list) -> str:
    """``'a' was`` or ``'a', 'b' were`` (``jsonschema``'s wording)."""
    verb = "was" if len(extras) == 1 else "were"
    return f"{', '.join(repr(extra) for extra in extras)} {verb}"
