"""What a request is constrained by, and the error a grammar that cannot be used raises.

Torch-free, so that the front (the HTTP process: `grammar_spec`, `json_schema`,
the OpenAI tool calls, the tokenizer manager) can build keys and raise
`GrammarError` without importing torch; `base` (the backend interface, which
does import torch) imports them from here, and both spellings name the same
objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from arborlm.errors import InvalidRequestError

# The kinds a request can ask for. "json_object" is any JSON value (OpenAI's json mode).
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")

# `json_schema` spelling of "any JSON value", as SGLang accepts it.
ANY_JSON = "$$ANY$$"


class GrammarError(InvalidRequestError):
    """A grammar that cannot be used: bad syntax, an unsupported kind or keyword, a compile timeout.

    `param` names the sampling field (``json_schema``, ``regex``, ``ebnf``, ...).
    """


@dataclass(frozen=True)
class GrammarKey:
    """What a request is constrained by.

    kind: one of `GRAMMAR_KINDS`.
    text: the grammar source (a JSON schema serialised with sorted keys, a
        regex, an EBNF/GBNF grammar, a structural-tag JSON); "" for json_object.
    lenient: a `json_schema_lenient` schema: besides dropping what a backend cannot
        enforce, it lifts the default bound on number literals' digits (`number_bounds`).
    backend: the grammar backend the front chose for this key under
        ``grammar_backend="auto"`` (`auto_backend`), which the scheduler's
        `AutoGrammarBackend` compiles it on; "" means the server's backend (under
        "auto" its first choice, xgrammar).
    """

    kind: str
    text: str
    lenient: bool = False
    backend: str = ""

    @property
    def param(self) -> str:
        """The sampling field this key came from (for error messages)."""
        return "json_schema" if self.kind == "json_object" else self.kind
