"""A grammar constraint that applies after the model's reasoning (`SamplingParams.reasoning`).

A reasoning model first thinks in free text between its think markers, then
answers; a `response_format` schema or the tool-call grammar is about the
answer. `after_reasoning` turns the request's constraint into one structural
tag::

    <think> any text </think> separator  <the constraint, as its own grammar>

(`begin` is empty when the prompt already opened the reasoning, as DeepSeek-R1's
template does.) The constraint keeps the exact grammar the backend compiles
for it alone (its xgrammar EBNF is embedded), and the reasoning is bounded only
by `max_new_tokens`. The front validates a finished output with
`AfterReasoning.validate_output`: only the text after the end marker and the
separator is held to the constraint.

Runs in the front (tokenizer manager), before the request is queued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from arborlm.constrained.grammar_spec import GrammarSpec
from arborlm.constrained.keys import GrammarError, GrammarKey
from arborlm.constrained.registry import backend_class


@dataclass(frozen=True)
class Reasoning:
    """Where the reasoning is: `begin` (empty when the prompt opened it), `end`, then `separator`."""

    begin: str
    end: str
    separator: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> Reasoning:
        return cls(d.get("begin", ""), d["end"], d.get("separator", ""))


@dataclass(frozen=True)
class AfterReasoning(GrammarSpec):
    """The request's constraint (`inner`) after free reasoning; `key` is the combined grammar.

    `schema` and `dropped` are the inner constraint's, so what the front reports
    about the schema is unchanged.
    """

    inner: GrammarSpec | None = None
    reasoning: Reasoning | None = None

    @property
    def param(self) -> str:
        """The sampling field of the inner constraint (for error messages)."""
        return self.inner.key.param

    def answer_text(self, text: str) -> str | None:
        """The part of a finished output the constraint is about; None when the reasoning never ended."""
        _, found, rest = text.partition(self.reasoning.end)
        return rest.removeprefix(self.reasoning.separator) if found else None

    def validate_output(self, text: str) -> str | None:
        """None when the answer after the reasoning satisfies the inner constraint, else why not."""
        answer = self.answer_text(text)
        if answer is None:
            return f"the output has no end of reasoning ({self.reasoning.end!r})"
        return self.inner.validate_output(answer)


def after_reasoning(spec: GrammarSpec | None, reasoning: dict | None, backend: str) -> GrammarSpec | None:
    """`spec` moved after the reasoning described by `reasoning` (`SamplingParams.reasoning`).

    Unchanged when there is no constraint or no reasoning.

    Raises
    ------
    GrammarError: ``backend`` (the one that takes the constraint) is not xgrammar, or
        the combined grammar does not compile; ``param`` is the constraint's field.
    """
    if spec is None or reasoning is None:
        return spec
    where = Reasoning.from_dict(reasoning)
    if backend != "xgrammar":  # the inner grammar is embedded as xgrammar's EBNF
        raise GrammarError(f"a {spec.key.param} constraint after reasoning is compiled on xgrammar (the "
                           f"constraint's grammar is embedded as xgrammar's EBNF), but this one goes to the "
                           f"{backend} backend; xgrammar must accept it, on --grammar-backend xgrammar or auto",
                           spec.key.param)
    key = GrammarKey("structural_tag", json.dumps(_combined_tag(spec.key, where)))
    try:
        backend_class(backend).check(key)
    except GrammarError as e:
        raise GrammarError(str(e), spec.key.param) from None
    return AfterReasoning(key, spec.schema, spec.dropped, inner=spec, reasoning=where)


def _combined_tag(inner: GrammarKey, where: Reasoning) -> dict:
    """The structural tag: the reasoning block, the separator, then the inner grammar's EBNF."""
    # imports xgrammar (and torch): on the first constrained request after reasoning only
    from arborlm.constrained.xgrammar_backend import build_grammar

    elements: list[dict] = [{"type": "tag", "begin": where.begin, "content": {"type": "any_text"}, "end": where.end}]
    if where.separator:
        elements.append({"type": "const_string", "value": where.separator})
    elements.append({"type": "grammar", "grammar": str(build_grammar(inner))})
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}
