"""A ``propertyNames`` that lists its names, written as declared properties (every backend)."""

from __future__ import annotations

from typing import Any

# Most names a `propertyNames` enum may list to be written out as declared properties.
MAX_NAMES_AS_PROPERTIES = 64


def names_as_properties(schema: Any) -> Any:
    """``schema`` with a ``propertyNames`` of finitely many names written as declared properties.

    ``propertyNames: {"enum": [n1, ...]}`` (or ``const``; at most
    `MAX_NAMES_AS_PROPERTIES` names) on an object without
    ``patternProperties`` allows exactly those names, each under its declared
    schema or else ``additionalProperties``: the same language as
    ``properties`` {each name: its declared schema, else the additional one},
    declared names outside the list ``false``, and ``additionalProperties:
    false``. Written so, a grammar emits each name at most once: an open
    object's grammar cannot remember which names it wrote, and a repeated name
    (``{"r": 9, "r": 1}``) was caught only by validation, as an abort. The
    declared names come first in their order, then the listed ones in theirs.
    Changes ``schema`` in place; returns it.
    """
    if not isinstance(schema, dict) or "patternProperties" in schema:
        return schema
    names = schema.get("propertyNames")
    if not isinstance(names, dict) or set(names) - {"enum", "const", "type"} or len(set(names) - {"type"}) != 1:
        return schema
    listed = names["enum"] if "enum" in names else [names["const"]]
    if len(listed) > MAX_NAMES_AS_PROPERTIES or not all(isinstance(n, str) for n in listed):
        return schema
    types = names.get("type", "string")
    if "string" not in ([types] if isinstance(types, str) else types):
        return schema
    additional = schema.get("additionalProperties", {})
    properties = dict(schema.get("properties", {}))
    for name in properties:
        if name not in listed:
            properties[name] = False
    for name in listed:
        properties.setdefault(name, additional)
    schema["properties"] = properties
    schema["additionalProperties"] = False
    del schema["propertyNames"]
    return schema
