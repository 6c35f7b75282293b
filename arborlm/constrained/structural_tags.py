"""Structural tags in the legacy form SGLang and OpenAI-style clients send, as xgrammar's format.

A structural tag (the grammar of tool calls) is xgrammar's JSON format
(``{"type": "structural_tag", "format": {...}}``). SGLang also accepts an older
form, ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``;
`from_legacy_structural_tag` turns it into xgrammar's ``triggered_tags``. Both
the xgrammar and the llguidance backends read structural tags through it.

Torch-free.
"""

from __future__ import annotations

import json

from arborlm.constrained.keys import GrammarError


def from_legacy_structural_tag(tag: dict) -> dict:
    """``{"structures": [...], "triggers": [...]}`` as ``{"type": "structural_tag", "format": triggered_tags}``.

    Raises
    ------
    GrammarError
        ``structures`` or ``triggers`` is not a list, a structure lacks ``begin``,
        ``schema`` or ``end``, or a schema given as text is not JSON
        (``param`` = ``"structural_tag"``).
    """
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise GrammarError("structural_tag: 'structures' and 'triggers' must be lists", "structural_tag")
    tags = []
    for item in structures:
        if not isinstance(item, dict) or not {"begin", "schema", "end"} <= item.keys():
            raise GrammarError(
                "structural_tag: each structure needs 'begin', 'schema' and 'end'", "structural_tag"
            )
        schema = item["schema"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"structural_tag: a schema is not valid JSON: {e}", "structural_tag") from e
        content = {"type": "json_schema", "json_schema": schema}
        tags.append({"type": "tag", "begin": item["begin"], "content": content, "end": item["end"]})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
