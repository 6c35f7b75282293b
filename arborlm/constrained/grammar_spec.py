"""From a request's sampling fields to the grammar it is constrained by.

Runs in the front (tokenizer manager) before a request is queued, so every
problem that can be found without the tokenizer (bad JSON, an invalid or
unenforceable schema, a regex or EBNF syntax error, a kind the backend lacks)
is a 400-style `GrammarError` at once and never reaches the scheduler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from arborlm.constrained.base import ANY_JSON, GrammarError, GrammarKey
from arborlm.constrained.grammar_manager import backend_class
from arborlm.constrained.json_schema import (
    PreparedSchema,
    prepare_json_schema,
    validate_json_output,
)
from arborlm.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class GrammarSpec:
    """The constraint of one request.

    key: what the scheduler compiles (cached by backend, kind and text).
    schema: for ``json_schema`` requests, the user's schema, against which the
        finished output is validated (None for other kinds).
    dropped: schema keywords ignored in lenient mode ("keyword at /path").
    """

    key: GrammarKey
    schema: PreparedSchema | None = None
    dropped: tuple[str, ...] = ()

    def validate_output(self, text: str) -> str | None:
        """None when ``text`` satisfies the user's schema (or there is none), else why not."""
        if self.key.kind == "json_object":
            try:
                json.loads(text)
            except ValueError as e:
                return f"output is not JSON: {e}"
            return None
        if self.schema is None:
            return None
        return validate_json_output(self.schema, text)


def grammar_spec_from_params(params: SamplingParams, backend: str) -> GrammarSpec | None:
    """The request's `GrammarSpec`, or None when it is unconstrained.

    ``params`` must have passed `SamplingParams.verify` (at most one constraint).

    Raises
    ------
    GrammarError
        The constraint does not parse, uses a schema keyword that cannot be
        enforced (unless ``json_schema_lenient``), or ``backend`` cannot
        compile its kind.
    """
    spec = _spec(params)
    if spec is not None:
        backend_class(backend).check(spec.key)
    return spec


def _spec(params: SamplingParams) -> GrammarSpec | None:
    if params.json_schema is not None:
        if params.json_schema == ANY_JSON:
            return GrammarSpec(GrammarKey("json_object", ""))
        prepared = prepare_json_schema(params.json_schema, lenient=params.json_schema_lenient)
        return GrammarSpec(GrammarKey("json_schema", prepared.text), prepared, tuple(prepared.dropped))
    if params.regex is not None:
        return GrammarSpec(GrammarKey("regex", params.regex))
    if params.ebnf is not None:
        return GrammarSpec(GrammarKey("ebnf", params.ebnf))
    if params.structural_tag is not None:
        tag = params.structural_tag
        if isinstance(tag, str):
            try:
                tag = json.loads(tag)
            except ValueError as e:
                raise GrammarError(f"structural_tag is not valid JSON: {e}", "structural_tag") from e
        return GrammarSpec(GrammarKey("structural_tag", json.dumps(tag)))
    return None
