"""JSON-schema preparation (moving in; see `prepare`)."""

from arborlm.constrained.json_schema.prepare import (
    MAX_SCHEMA_CHARS,
    PreparedSchema,
    prepare_json_schema,
    validate_json_output,
)

__all__ = ["MAX_SCHEMA_CHARS", "PreparedSchema", "prepare_json_schema", "validate_json_output"]
