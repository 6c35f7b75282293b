"""From a request's sampling fields to the grammar it is constrained by.

Runs in the front (tokenizer manager) before a request is queued, so every
problem that can be found without the tokenizer (bad JSON, an invalid or
unenforceable schema, a regex or EBNF syntax error, a kind the backend lacks)
is a 400-style `GrammarError` at once and never reaches the scheduler.

What a grammar decides: its end. A grammar allows EOS only once its output is
complete and nothing else then, so ``min_new_tokens`` (EOS is not held back
under a grammar) and ``ignore_eos`` (the EOS the grammar forces still ends the
request) never extend a constrained output, as in SGLang; ``max_new_tokens``
and the user's stop strings and stop token ids can still cut it short, which
leaves a prefix that is not validated (see `GrammarSpec.validate_output`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace

from arborlm.constrained.json_schema import (
    PreparedSchema,
    prepare_json_schema,
    validate_json_output,
)
from arborlm.constrained.keys import ANY_JSON, GrammarError, GrammarKey
from arborlm.constrained.regex_constraint import validate_regex_output
from arborlm.constrained.registry import AUTO_BACKEND_ORDER, backend_class
from arborlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrammarSpec:
    """The constraint of one request.

    key: what the scheduler compiles (cached by backend, kind and text).
    schema: for ``json_schema`` requests, the user's schema, against which the
        finished output is validated (None for other kinds).
    dropped: what the grammar does not enforce because of lenient mode, as
        "keyword at /json/pointer" (`PreparedSchema.dropped`): keywords the
        backend's schema form cannot enforce, then what its policy relaxed (on
        the outlines backend, keywords outlines-core would enforce only in part
        and what it writes at a fixed depth).
    """

    key: GrammarKey
    schema: PreparedSchema | None = None
    dropped: tuple[str, ...] = ()

    def validate_output(self, text: str) -> str | None:
        """None when ``text`` satisfies the user's schema or regex (or there is none), else why not.

        ``text`` is an output the grammar ended, without the EOS's text; the
        front does not validate outputs cut by ``max_new_tokens`` or a user stop.
        """
        if self.key.kind == "json_object":
            try:
                json.loads(text)
            except ValueError as e:
                return f"output is not JSON: {e}"
            return None
        if self.key.kind == "regex":
            return validate_regex_output(self.key.text, text)
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
        enforced (unless ``json_schema_lenient``, which drops it), or
        ``backend`` cannot compile its kind or this schema even when lenient;
        with ``backend="auto"``: no backend of `AUTO_BACKEND_ORDER` accepts it
        (otherwise the key names the one that does, see `_auto_spec`).
    ValueError
        ``backend`` is not a known grammar backend.
    """
    if backend == "auto":
        return _auto_spec(params)
    spec = _spec(params, backend)
    if spec is None:
        return None
    backend_class(backend).check(spec.key)
    return spec


def _auto_spec(params: SamplingParams) -> GrammarSpec | None:
    """``grammar_backend="auto"``: the spec of the first backend of `AUTO_BACKEND_ORDER` that accepts
    the constraint, that backend written into its key (`GrammarKey.backend`).

    A lenient schema goes to the first backend that enforces all of it (drops
    nothing), else to the one that drops the fewest keywords: lenient mode
    means "enforce what you can", and one backend may enforce what the other drops.

    Raises
    ------
    GrammarError
        Every backend refuses it: the first backend's error, the others' reasons appended.
    """
    accepted: list[GrammarSpec] = []
    errors: list[tuple[str, GrammarError]] = []
    for name in AUTO_BACKEND_ORDER:
        try:
            spec = _spec(params, name)
            if spec is None:
                return None
            backend_class(name).check(spec.key)
        except GrammarError as e:
            errors.append((name, e))
            continue
        accepted.append(replace(spec, key=replace(spec.key, backend=name)))
        if not spec.dropped:
            break
    if accepted:
        return min(accepted, key=lambda spec: len(spec.dropped))  # the first among the fewest drops
    first = errors[0][1]
    others = "; ".join(f"the {name} backend refuses it too: {e.message}" for name, e in errors[1:])
    raise GrammarError(f"{first.message} ({others})" if others else first.message, first.param)


def _prepare_or_refuse(params: SamplingParams, policy):
    """`prepare_json_schema`, with any failure it did not foresee refused as a 400.

    A schema valid under draft 2020-12 must never give a 5xx (issue 16): a value no
    phase expected (a bound of ``1e999`` overflowing an int conversion, say) ends as
    a `GrammarError` naming the exception's kind, and the log has the traceback.
    """
    try:
        return prepare_json_schema(params.json_schema, lenient=params.json_schema_lenient, policy=policy)
    except GrammarError:
        raise
    except (ArithmeticError, ValueError, TypeError, KeyError, IndexError, RecursionError) as e:
        logger.warning("json_schema preparation failed unexpectedly", exc_info=e)
        raise GrammarError(
            f"json_schema cannot be prepared: a value in it is out of what arborlm can enforce "
            f"({type(e).__name__})", "json_schema") from e


def _spec(params: SamplingParams, backend: str) -> GrammarSpec | None:
    if params.json_schema is not None:
        if params.json_schema == ANY_JSON:
            return GrammarSpec(GrammarKey("json_object", ""))
        policy = backend_class(backend).schema_policy
        prepared = _prepare_or_refuse(params, policy)
        key = GrammarKey("json_schema", prepared.text, lenient=params.json_schema_lenient)
        return GrammarSpec(key, prepared, tuple(prepared.dropped))
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
