"""The door of JSON-schema preparation: `prepare_json_schema` runs the phases a
backend's `SchemaPolicy` asks for and returns the `PreparedSchema` it compiles.

Called in the front, before a request is queued (`grammar_spec_from_params`,
and the OpenAI tool calls for each tool's parameters), so that a schema that
cannot be enforced is a 400 at once; the finished output is later checked
against the user's schema by `validate_json_output`.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass

from jsonschema import validators as js_validators

from arborlm.constrained.json_schema.conditionals import rewrite_conditionals
from arborlm.constrained.json_schema.lower import lower_document
from arborlm.constrained.json_schema.nodes import (
    DRAFT_YEAR,
    PARAM,
    Problem,
    first_of_each,
    refusal_message,
)
from arborlm.constrained.json_schema.normalise import Normaliser
from arborlm.constrained.json_schema.parse import (
    dialect_of,
    load_schema,
    ran_out_of_stack,
    shorten,
    validator_class,
)
from arborlm.constrained.json_schema.policy import XGRAMMAR_POLICY, SchemaForm, SchemaPolicy
from arborlm.constrained.json_schema.regex_budget import PREPARE_REGEX_BUDGET_S, RegexBudget
from arborlm.constrained.keys import GrammarError


@dataclass(frozen=True)
class PreparedSchema:
    """A JSON schema ready to compile, with what is needed to validate outputs.

    text: the schema to compile, ``json.dumps`` in the user's property order (in
        the xgrammar form a 2020-12 schema whose every ``$ref`` points into its
        root ``$defs``).
    original: the user's schema, serialised with sorted keys; outputs are
        validated against it.
    dropped: what the grammar does not enforce because of lenient mode, as
        ``"keyword at /json/pointer"`` (``/`` is the root): the keywords the
        policy's form cannot enforce, then what the backend's ``relax`` left
        out or let through; empty unless lenient.
    dialect: the metaschema URI `original` is validated under.
    """

    text: str
    original: str
    dropped: tuple[str, ...] = ()
    dialect: str = js_validators.Draft202012Validator.META_SCHEMA["$id"]


def prepare_json_schema(
    schema: str | dict | bool, *, lenient: bool = False, policy: SchemaPolicy = XGRAMMAR_POLICY,
    regex_budget_s: float = PREPARE_REGEX_BUDGET_S,
) -> PreparedSchema:
    """Check ``schema`` and rewrite it into the schema ``policy``'s backend compiles.

    Parameters
    ----------
    schema:
        The user's JSON Schema: its JSON text, a dict, or a boolean schema.
    lenient:
        Drop keywords the grammar cannot enforce (listed in ``dropped``)
        instead of refusing the schema, and let the backend relax its own
        refusals (``policy.relax``); the finished output is still validated
        against the whole schema by `validate_json_output`.
    policy:
        The grammar backend's `SchemaPolicy` (``GrammarBackend.schema_policy``).
        The default, xgrammar's, is also what tool calls use: they need
        xgrammar's structural tags.
    regex_budget_s:
        Seconds all the searches of the schema's patterns (against its
        ``enum`` values and property names) may take together (`RegexBudget`).

    Returns
    -------
    PreparedSchema

    Raises
    ------
    GrammarError
        (``param="json_schema"``) The JSON text is longer than `MAX_SCHEMA_CHARS`
        or not JSON (with line and column), the value is not an object or
        boolean, or it is not a valid JSON Schema of its dialect (with the
        path). In the xgrammar form also: a ``$ref`` cannot be resolved inside
        the schema, the schema accepts no value, or (unless ``lenient``) it
        uses keywords the grammar cannot enforce (each named with its JSON
        pointer), or matching its patterns outlives ``regex_budget_s``
        (`PatternTimeout`, naming the pattern). When lenient: what
        ``policy.relax`` still refuses. Whatever the schema: its references
        nest or recurse further than the rewrite can follow (naming where).
    """
    try:
        return _prepare(schema, lenient, policy, RegexBudget(regex_budget_s))
    except BaseException as e:  # noqa: BLE001 — only running out of stack is caught, see below
        # The phases recurse per level of the schema and per unfolded reference; the depth
        # of the JSON is bounded (MAX_SCHEMA_DEPTH), chains of references are not.
        if not ran_out_of_stack(e):
            raise
        raise GrammarError(_too_deep_message(e), PARAM) from None


def _prepare(schema: str | dict | bool, lenient: bool, policy: SchemaPolicy, budget: RegexBudget) -> PreparedSchema:
    """`prepare_json_schema`'s work, which may raise `RecursionError`."""
    raw = load_schema(schema)
    cls = validator_class(raw)
    original = json.dumps(raw, sort_keys=True)
    if raw is False:
        raise GrammarError("json_schema is `false`, which accepts no value", PARAM)
    text, problems = _rewrite(raw, cls, policy, budget)
    if problems and not lenient:
        raise GrammarError(refusal_message(problems), PARAM)
    dropped = tuple(f"{keyword} at {path or '/'}" for keyword, path, _ in problems)
    if lenient and policy.relax is not None:
        relaxed = policy.relax(json.loads(text))  # a fresh value, which relax may change
        if relaxed.dropped:
            text, dropped = json.dumps(relaxed.schema), dropped + relaxed.dropped
    return PreparedSchema(text, original, dropped, dialect_of(cls))


def _rewrite(raw: dict | bool, cls: type, policy: SchemaPolicy, budget: RegexBudget) -> tuple[str, list[Problem]]:
    """The text of ``raw`` in the policy's form, and what that form cannot enforce.

    Property order is kept in every form: backends emit properties in schema
    order, and users rely on it.
    """
    if raw is True:
        return "{}", []
    # What no backend enforces, rewritten for all of them where an equivalent schema exists.
    raw = rewrite_conditionals(json.loads(json.dumps(raw)), DRAFT_YEAR[cls])  # a fresh copy to change
    if policy.form is SchemaForm.AS_WRITTEN:
        if policy.rewrite is None:
            return json.dumps(raw), []
        return json.dumps(policy.rewrite(raw)), []
    normaliser = Normaliser(raw, cls, budget)
    root_a = normaliser.run()
    lowered = lower_document(root_a, normaliser)
    # Merges made while lowering record their problems with phase A's, which come first.
    problems = first_of_each(normaliser.problems.items + lowered.problems)
    return json.dumps(lowered.doc), problems


def _too_deep_message(error: BaseException) -> str:
    """The refusal of a schema whose preparation ran out of stack, naming the deepest schema path reached.

    The phases' functions take the JSON pointer they work at as ``path``; the
    deepest frame that has one says where the rewrite gave up.
    """
    paths = [frame.f_locals.get("path") for frame, _ in traceback.walk_tb(error.__traceback__)]
    paths = [p for p in paths if isinstance(p, str) and (p == "" or p.startswith("/"))]
    where = f" (it gave up at {shorten(paths[-1] or '/', 200)})" if paths else ""
    return ("json_schema nests or recurses further than the schema rewrite can follow (deeply nested "
            f"regex groups, or $refs combined one inside the other){where}")
