"""The last check of a constrained output: does it satisfy the user's original schema?

Whatever a grammar lets through (a backend enforces less than the schema says,
or lenient mode dropped keywords), arborlm never returns JSON the schema
rejects: the front calls `validate_json_output` on every output the grammar
ended (`GrammarSpec.validate_output`), with ``jsonschema`` under the schema's
own dialect.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

from jsonschema import exceptions as js_exceptions
from jsonschema import validators as js_validators

from arborlm.constrained.json_schema.parse import json_pointer, shorten, strict_json_loads

if TYPE_CHECKING:
    from arborlm.constrained.json_schema.prepare import PreparedSchema


def validate_json_output(prepared: PreparedSchema, text: str) -> str | None:
    """Check a finished constrained output against the user's original schema.

    Parameters
    ----------
    prepared:
        The request's schema, from `prepare_json_schema`.
    text:
        The output, without the EOS's text.

    Returns
    -------
    str | None
        None when ``text`` is one JSON value (no duplicate keys, no NaN or
        Infinity) that the original schema accepts under its dialect, without
        a format checker; else a short message: the parse error, or the first
        validation error and the JSON pointer of the failing part of the output.
    """
    try:
        instance = strict_json_loads(text)
    except ValueError as e:
        return f"output is not valid JSON: {e}"
    validator = _output_validator(prepared.original, prepared.dialect)
    try:
        error = js_exceptions.best_match(validator.iter_errors(instance))
    except RecursionError:
        return "output could not be validated: the JSON schema recurses without end"
    if error is None:
        return None
    where = json_pointer(error.absolute_path) or "/"
    return f"output does not match the JSON schema at {where}: {shorten(error.message)}"


@functools.lru_cache(maxsize=256)
def _output_validator(original: str, dialect: str):
    cls = js_validators.validator_for({"$schema": dialect})
    return cls(json.loads(original))
