"""Reading a user's JSON schema: its JSON text to a value, and the dialect it is read under.

The first step of `prepare_json_schema` (in the front, before a request is
queued), whatever the backend; `validate` reads finished outputs with the same
strict JSON rules and messages.

The dialect is the schema's ``$schema``; without one (or with one
``jsonschema`` does not know) it is the newest of 2020-12, 2019-09, 7, 6, 4
whose metaschema accepts the schema, so a draft-4 style schema without
``$schema`` (boolean ``exclusiveMinimum``, ``items`` arrays) is read as draft
4 rather than refused. Outputs are validated under the same dialect.
"""

from __future__ import annotations

import json
import re
from typing import Any

import referencing.jsonschema
from jsonschema import exceptions as js_exceptions
from jsonschema import validators as js_validators

from arborlm.constrained.json_schema.nodes import DRAFT_YEAR, PARAM
from arborlm.constrained.keys import GrammarError

# Longest schema accepted, in characters of its JSON text: far above real schemas (a
# 20000-value enum is ~300k), and it bounds the work a request can make the front do.
MAX_SCHEMA_CHARS = 1 << 20
# Deepest nesting of JSON objects and arrays accepted in a schema. The phases recurse per
# level (jsonschema's metaschema check takes about ten frames per schema level), so a schema
# 100 object levels deep ran out of Python's stack; the deepest of the JSONSchemaBench sample
# nests 23 levels.
MAX_SCHEMA_DEPTH = 64

_VALIDATORS = (
    js_validators.Draft202012Validator,
    js_validators.Draft201909Validator,
    js_validators.Draft7Validator,
    js_validators.Draft6Validator,
    js_validators.Draft4Validator,
)


def load_schema(schema: Any) -> Any:
    """A private copy of the user's schema, with JSON types only: a dict or a boolean.

    Parameters
    ----------
    schema:
        The schema's JSON text, or a JSON-serialisable value.

    Raises
    ------
    GrammarError
        (``param="json_schema"``) Not JSON-serialisable, longer than
        `MAX_SCHEMA_CHARS`, not JSON (with line and column, duplicate keys,
        NaN and Infinity refused), nested deeper than `MAX_SCHEMA_DEPTH`
        (with the path), or neither an object nor a boolean.
    """
    if not isinstance(schema, (str, bool)):
        try:
            schema = json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"json_schema is not JSON-serialisable: {e}", PARAM) from e
        except RecursionError:
            raise GrammarError(f"json_schema nests deeper than the limit of {MAX_SCHEMA_DEPTH} levels", PARAM) from None
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_CHARS:
            raise GrammarError(
                f"json_schema is {len(schema)} characters of JSON; the limit is {MAX_SCHEMA_CHARS}", PARAM
            )
        try:
            value = strict_json_loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(
                f"json_schema is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", PARAM
            ) from e
        except ValueError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}", PARAM) from e
        except RecursionError:  # the decoder recurses per level
            raise GrammarError(f"json_schema nests deeper than the limit of {MAX_SCHEMA_DEPTH} levels", PARAM) from None
    else:
        value = schema
    _check_depth(value)
    if not isinstance(value, (dict, bool)):
        raise GrammarError(
            f"json_schema must be a JSON object or a boolean, got {type(value).__name__}", PARAM
        )
    return value


def _check_depth(value: Any) -> None:
    """Raise `GrammarError` naming the first place where ``value`` nests deeper than `MAX_SCHEMA_DEPTH`."""
    stack: list[tuple[Any, list]] = [(value, [])]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if len(path) >= MAX_SCHEMA_DEPTH:
            raise GrammarError(f"json_schema nests deeper than the limit of {MAX_SCHEMA_DEPTH} levels, "
                               f"at {shorten(json_pointer(path), 200)}", PARAM)
        children = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend((child, [*path, key]) for key, child in children)


def strict_json_loads(text: str) -> Any:
    """json.loads that refuses duplicate object keys, NaN and Infinity (ValueError)."""

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


def validator_class(raw: Any) -> type:
    """The ``jsonschema`` validator class of the schema's dialect (see the module docstring).

    Raises
    ------
    GrammarError
        (``param="json_schema"``) The schema is not valid under its declared
        dialect, or under any of the known ones (named with the path), or it
        holds a regular expression Python cannot compile.
    """
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
    where = json_pointer(error.path) or "/"
    raise GrammarError(
        f"json_schema is not a valid JSON Schema ({_dialect_name(cls)}): "
        f"{shorten(error.message)} at {where}",
        PARAM,
    )


def ran_out_of_stack(error: BaseException) -> bool:
    """Whether ``error`` is Python's stack running out: a `RecursionError`, or the panic that
    ``referencing``'s Rust maps (``rpds``) raise when one reaches them (a ``PanicException``,
    which derives from `BaseException` only, wrapping the RecursionError)."""
    if isinstance(error, RecursionError):
        return True
    return type(error).__name__ == "PanicException" and "RecursionError" in str(error)


def dialect_of(cls: type) -> str:
    """The metaschema URI of validator class ``cls``."""
    meta = cls.META_SCHEMA
    return meta.get("$id", meta.get("id", ""))


def json_pointer(parts) -> str:
    """The JSON pointer of a path of keys and indices ("" for the root)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def shorten(message: str, limit: int = 300) -> str:
    """``message`` cut to ``limit`` characters (an ellipsis marks the cut)."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _known_dialect(uri: str) -> bool:
    try:
        referencing.jsonschema.specification_with(uri)
    except referencing.jsonschema.UnknownDialect:
        return False
    return True


def _dialect_name(cls: type) -> str:
    year = DRAFT_YEAR[cls]
    return f"draft {year}" if year < 2019 else f"draft {year}-{'09' if year == 2019 else '12'}"
