"""What llguidance receives of a user's JSON schema: the schema as written, less annotations it refuses.

llguidance enforces JSON Schema itself, keyword by keyword, and refuses (naming
them) the keywords it does not implement, so its `SchemaPolicy` compiles the
schema as the user wrote it. One rewrite runs first, `drop_unknown_formats`:
llguidance refuses a ``format`` it does not know, but ``format`` is an
annotation in JSON Schema 2020-12 (and arborlm validates outputs without a
format checker), so a format llguidance does not know is left out rather than
refusing the schema; the output allowed is a superset only of what the format
would narrow, and every output is valid either way.

Where it runs: `llguidance_rewrite` is the ``rewrite`` of `LLGUIDANCE_POLICY`,
called by `prepare_json_schema` in the front.
"""

from __future__ import annotations

from typing import Any

# The formats llguidance 1.9 enforces (its `Unknown format` error names any other).
LLGUIDANCE_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
})  # fmt: skip

# Keywords whose value is one subschema; a list of subschemas; a name -> subschema map.
_ONE = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not", "if", "then",
        "else", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


def llguidance_rewrite(schema: Any) -> Any:
    """``schema`` (parsed JSON, changed in place) as llguidance compiles it (see the module docstring)."""
    drop_unknown_formats(schema)
    return schema


def drop_unknown_formats(schema: Any) -> None:
    """Remove, in place, every ``format`` of a subschema that llguidance does not know (`LLGUIDANCE_FORMATS`).

    Only schema positions are visited (``properties`` values, ``items``, ...),
    never ``enum``/``const``/``default`` values nor property names.
    """
    if not isinstance(schema, dict):
        return
    if isinstance(schema.get("format"), str) and schema["format"] not in LLGUIDANCE_FORMATS:
        del schema["format"]
    for keyword in _ONE:
        if isinstance(schema.get(keyword), dict):
            drop_unknown_formats(schema[keyword])
    for keyword in _LIST:
        if isinstance(schema.get(keyword), list):
            for sub in schema[keyword]:
                drop_unknown_formats(sub)
    for keyword in _MAP:
        if isinstance(schema.get(keyword), dict):
            for sub in schema[keyword].values():
                drop_unknown_formats(sub)
