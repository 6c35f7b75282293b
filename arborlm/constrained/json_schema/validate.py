"""The last check of a constrained output: does it satisfy the user's original schema?

Whatever a grammar lets through (a backend enforces less than the schema says,
or lenient mode dropped keywords), arborlm never returns JSON the schema
rejects: the front calls `validate_json_output` on every output the grammar
ended (`GrammarSpec.validate_output`), with ``jsonschema`` under the schema's
own dialect. The searches of the schema's patterns share one `RegexBudget`
(`OUTPUT_REGEX_BUDGET_S`): the front validates on its event loop, and a
pattern that backtracks must not stall it; such an output is reported as
not validated, and the request is aborted alone.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

from jsonschema import exceptions as js_exceptions
from jsonschema import validators as js_validators

from arborlm.constrained.json_schema.budgeted_validator import (
    budgeted_validator_class,
    without_dialects,
)
from arborlm.constrained.json_schema.parse import (
    json_pointer,
    ran_out_of_stack,
    shorten,
    strict_json_loads,
)
from arborlm.constrained.json_schema.regex_budget import (
    OUTPUT_REGEX_BUDGET_S,
    PatternTimeout,
    RegexBudget,
)

if TYPE_CHECKING:
    from arborlm.constrained.json_schema.prepare import PreparedSchema


def validate_json_output(prepared: PreparedSchema, text: str,
                         regex_budget_s: float = OUTPUT_REGEX_BUDGET_S) -> str | None:
    """Check a finished constrained output against the user's original schema.

    Parameters
    ----------
    prepared:
        The request's schema, from `prepare_json_schema`.
    text:
        The output, without the EOS's text.
    regex_budget_s:
        Seconds all the searches of the schema's patterns may take together.

    Returns
    -------
    str | None
        None when ``text`` is one JSON value (no duplicate keys, no NaN or
        Infinity) that the original schema accepts under its dialect, without
        a format checker; else a short message: the parse error, the first
        validation error and the JSON pointer of the failing part of the
        output, the pattern whose matching outlived ``regex_budget_s``, or
        why the validator failed (a schema that recurses without end).
    """
    try:
        instance = strict_json_loads(text)
    except ValueError as e:
        return f"output is not valid JSON: {e}"
    validator = _output_validator(prepared.original, prepared.dialect, RegexBudget(regex_budget_s))
    try:
        error = js_exceptions.best_match(validator.iter_errors(instance))
    except PatternTimeout as e:
        return (f"output could not be validated: matching the pattern {shorten(repr(e.pattern), 100)} "
                f"took longer than {e.budget_s:g} s")
    except BaseException as e:  # noqa: BLE001 — this runs on the front's event loop: it reports, never raises
        if ran_out_of_stack(e):  # a schema that applies itself to the same value (`if: {"$dynamicRef": "#"}`)
            return "output could not be validated: the JSON schema recurses without end"
        if not isinstance(e, Exception):
            raise  # KeyboardInterrupt, SystemExit
        return f"output could not be validated: {type(e).__name__}: {shorten(str(e), 200)}"
    if error is None:
        return None
    where = json_pointer(error.absolute_path) or "/"
    return f"output does not match the JSON schema at {where}: {shorten(error.message)}"


def _output_validator(original: str, dialect: str, budget: RegexBudget):
    """A validator of ``original`` under ``dialect`` whose pattern searches go through ``budget``."""
    cls = js_validators.validator_for({"$schema": dialect})
    return budgeted_validator_class(cls, budget)(_schema_for_validation(original, dialect))


@functools.lru_cache(maxsize=256)
def _schema_for_validation(original: str, dialect: str) -> dict | bool:
    """The user's schema without ``$schema`` keys: read in ``dialect`` throughout, by the budgeted
    class (a ``$schema`` would switch a subschema to ``jsonschema``'s stock validator). Shared, read-only."""
    return without_dialects(json.loads(original), js_validators.validator_for({"$schema": dialect}))
