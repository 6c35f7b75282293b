"""A chat or completions request's output constraint, in whichever dialect the client speaks.

Clients ask for constrained output in four dialects, and each field becomes one of
arborlm's native constraints (`SamplingParams.json_schema`, `regex`, `ebnf`,
`structural_tag`):

- SGLang's extra fields `json_schema`, `regex`, `ebnf`, `structural_tag` (the native ones);
- OpenAI's `response_format` (`json_object`, `json_schema`);
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- vLLM's `structured_outputs` object: `json`, `regex`, `choice`, `grammar`,
  `json_object`, `structural_tag`.

The meanings are vLLM's: `json` a JSON schema (every keyword enforced, as `strict`),
`choice` exactly one of the listed strings (an alternation of the escaped literals, a
regex both grammar backends compile), `grammar` an EBNF grammar with root rule `root`
(xgrammar's dialect, which vLLM's xgrammar backend takes too; a Lark grammar does not
parse and is refused naming the field), `json_object` any JSON object. A field that
would change what output is allowed but cannot be served (a whitespace pattern, the
JSON options `disable_any_whitespace` / `disable_additional_properties`) is refused
with a 400 naming it, never ignored; so are two constraints at once. Picking a backend
(`guided_decoding_backend`, `disable_fallback`) does not change the output and has no
effect.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from arborlm.entrypoints.http_errors import bad_request
from arborlm.entrypoints.openai.protocol import ResponseFormat, SamplingRequest, StructuredOutputs

# SGLang's grammar fields, spelled as the native sampling fields.
NATIVE_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
# Characters with a meaning in a regex outside a class, in xgrammar's and Rust's (outlines-core's)
# syntax alike; both take each escaped. Others are not escaped: Rust refuses `\ ` or `\/`.
_REGEX_META = frozenset("\\^$.|?*+()[]{}")
# vLLM's JSON options that narrow the output, and the value that leaves it as it is.
_JSON_OPTIONS = {"disable_any_whitespace": False, "disable_additional_properties": False,
                 "whitespace_pattern": None}


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint.

    param: the request field it came from, as the request spells it
        (``guided_choice``, ``structured_outputs.json``, ``response_format``).
    params: the native sampling fields it sets (``{"regex": ...}``).
    names: native field name -> the request's, for errors (a choice regex that
        does not compile names ``guided_choice``).
    """

    param: str
    params: dict[str, Any]
    names: dict[str, str]


def request_constraint(req: SamplingRequest) -> Constraint | None:
    """The request's one output constraint, or None when its output is free.

    Raises
    ------
    APIError: 400 for two constraints at once (naming the second), an empty
        `guided_choice`, a `structured_outputs` without a constraint, or an option
        that would change the output but is not served.
    """
    check_unserved(req)
    given = list(_constraints(req))
    if len(given) > 1:
        raise bad_request(f"give only one of {' and '.join(c.param for c in given)}: each is an output constraint",
                          param=given[1].param)
    if req.structured_outputs is not None and not any(c.param.startswith("structured_outputs.") for c in given):
        raise bad_request("structured_outputs must give one of json, regex, choice, grammar, json_object "
                          "and structural_tag", param="structured_outputs")
    return given[0] if given else None


def check_unserved(req: SamplingRequest) -> None:
    """Refuse the vLLM options that change what output is allowed in ways arborlm's grammars cannot.

    Raises
    ------
    APIError: 400 naming the option.
    """
    if req.guided_whitespace_pattern is not None:
        raise _unserved("guided_whitespace_pattern")
    outputs = req.structured_outputs
    for name, neutral in _JSON_OPTIONS.items():
        if outputs is not None and getattr(outputs, name) != neutral:
            raise _unserved(f"structured_outputs.{name}")


def _unserved(param: str) -> Exception:
    return bad_request(f"{param} is not supported by this server: it changes the JSON grammar's whitespace or "
                       "properties, which arborlm's grammars do not let a request set; leave it out", param=param)


def _constraints(req: SamplingRequest) -> Iterator[Constraint]:
    """Every constraint the request gives, in a fixed order (OpenAI's, SGLang's, then vLLM's)."""
    fmt = response_format_constraint(req.response_format)
    if fmt is not None:
        yield fmt
    for name in NATIVE_FIELDS:
        if getattr(req, name) is not None:
            yield Constraint(name, {name: getattr(req, name)}, {})
    yield from _vllm_constraints("guided_", req.guided_json, req.guided_regex, req.guided_choice,
                                 req.guided_grammar)
    if req.structured_outputs is not None:
        yield from _structured_outputs(req.structured_outputs)


def response_format_constraint(fmt: ResponseFormat | None) -> Constraint | None:
    """`response_format` as a constraint.

    `json_object` -> any JSON object (OpenAI's JSON mode answers an object);
    `json_schema` -> that schema, every keyword enforced when `strict` is true,
    else unsupported keywords are dropped from the grammar and the output is
    still validated (the native `json_schema_lenient`).
    """
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("response_format", {"json_schema": {"type": "object"}}, {"json_schema": "response_format"})
    spec = fmt.json_schema
    return Constraint("response_format", {"json_schema": spec.schema_, "json_schema_lenient": not spec.strict},
                      {"json_schema": "response_format.json_schema.schema"})


def _vllm_constraints(prefix: str, json_schema: Any, regex: str | None, choice: list[str] | None,
                      grammar: str | None) -> Iterator[Constraint]:
    """vLLM's four classic constraints, each field named `prefix` + its vLLM name."""
    for name, native, value in (("json", "json_schema", json_schema), ("regex", "regex", regex),
                                ("choice", "regex", choice), ("grammar", "ebnf", grammar)):
        if value is None:
            continue
        spelled = prefix + name
        if name == "choice":
            value = choice_regex(value, spelled)
        yield Constraint(spelled, {native: value}, {native: spelled})


def _structured_outputs(outputs: StructuredOutputs) -> Iterator[Constraint]:
    """The constraints of vLLM's `structured_outputs` object."""
    yield from _vllm_constraints("structured_outputs.", outputs.json_, outputs.regex, outputs.choice, outputs.grammar)
    if outputs.json_object is not None:
        if not outputs.json_object:
            raise bad_request("structured_outputs.json_object must be true (leave it out for free text)",
                              param="structured_outputs.json_object")
        yield Constraint("structured_outputs.json_object", {"json_schema": {"type": "object"}},
                         {"json_schema": "structured_outputs.json_object"})
    if outputs.structural_tag is not None:
        yield Constraint("structured_outputs.structural_tag", {"structural_tag": outputs.structural_tag},
                         {"structural_tag": "structured_outputs.structural_tag"})


def choice_regex(choices: list[str], param: str) -> str:
    """A regex that fully matches exactly the strings of `choices` (vLLM's `choice`).

    Raises
    ------
    APIError: 400 naming `param` for an empty list.
    """
    if not choices:
        raise bad_request(f"{param} must list at least one choice", param=param)
    return "(" + "|".join(_regex_literal(choice) for choice in choices) + ")"


def _regex_literal(text: str) -> str:
    """`text` as a regex that matches just it."""
    return "".join("\\" + char if char in _REGEX_META else char for char in text)
