"""Reasoning output (`--reasoning-parser`, SGLang's names): the model's thinking → `reasoning_content`.

A reasoning model writes its thinking between think markers, then its answer::

    <think>
    The user wants the weather...
    </think>

    {"city": "Paris"}

`ReasoningParser` splits one output, fed whole or as it streams, into
reasoning (what lies between the markers) and content (what follows the end
marker, without the whitespace that separates them); the markers themselves go
to neither. Parsers:

- ``qwen3``: the reasoning opens with `<think>` in the output (Qwen3, QwQ);
  an output that does not open with it has no reasoning;
- ``deepseek-r1``: the output may start inside the reasoning (DeepSeek-R1's
  template ends the prompt with `<think>`; R1-0528 writes it again): all text
  up to `</think>` is reasoning.

Which applies to one answer comes from its rendered prompt (`reasoning_mode`):
a prompt that ends with the end marker turned thinking off
(``chat_template_kwargs: {"enable_thinking": false}`` on Qwen3's template), so
the output is all content; one that ends with the start marker has opened the
reasoning. With a `response_format` or tools, the grammar constrains only what
follows the reasoning (`reasoning_sampling`, `runtime/reasoning_grammar.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from arborlm.entrypoints.openai.tool_parsers.base import partial_marker_len
from arborlm.runtime.config import REASONING_PARSERS

THINK_START, THINK_END = "<think>", "</think>"
# What the grammar writes between the end marker and the answer (what both families write).
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class ReasoningSyntax:
    """One family's think markers; `starts_inside`: the output may begin inside the reasoning."""

    name: str
    start: str = THINK_START
    end: str = THINK_END
    starts_inside: bool = False


SYNTAXES = {"qwen3": ReasoningSyntax("qwen3"), "deepseek-r1": ReasoningSyntax("deepseek-r1", starts_inside=True)}
assert set(SYNTAXES) == set(REASONING_PARSERS)  # one list of names: the config's


@dataclass(frozen=True)
class ReasoningMode:
    """How one answer's output begins: `inside` the reasoning already, or opening it with the start marker."""

    syntax: ReasoningSyntax
    inside: bool

    def grammar_reasoning(self) -> dict[str, str]:
        """`SamplingParams.reasoning`: where a grammar constraint starts (after the end marker)."""
        return {"begin": "" if self.inside else self.syntax.start, "end": self.syntax.end, "separator": SEPARATOR}


def reasoning_mode(name: str | None, prompt_text: str) -> ReasoningMode | None:
    """The reasoning of an answer to `prompt_text` under the parser `name`; None when there is none
    (no parser, or the prompt closed the reasoning: thinking turned off).

    Raises
    ------
    KeyError: `name` is not a reasoning parser (the config checks it first).
    """
    if name is None:
        return None
    syntax = SYNTAXES[name]
    tail = prompt_text.rstrip()
    if tail.endswith(syntax.end):
        return None
    return ReasoningMode(syntax, inside=syntax.starts_inside or tail.endswith(syntax.start))


@dataclass(frozen=True)
class ReasoningDelta:
    """What one piece of output added to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits one output into reasoning and content, incrementally (see the module docstring).

    Call `feed` with each new piece of text and `finish` once at the end; each
    returns what became certain, holding back only text that could still be a
    marker (or the whitespace after the end marker). Fed in any pieces, the
    joined deltas equal the output parsed whole. `reasoning` is None while no
    reasoning has been seen.
    """

    _BEFORE, _INSIDE, _AFTER_END, _CONTENT = range(4)

    def __init__(self, mode: ReasoningMode):
        self.syntax = mode.syntax
        self._state = self._INSIDE if mode.inside else self._BEFORE
        self._strip_start = mode.inside  # a start marker right at the beginning is dropped
        self._buffer = ""
        self.reasoning: str | None = "" if mode.inside else None
        self.content = ""

    def feed(self, text: str) -> ReasoningDelta:
        """What `text`, appended to what came before, makes certain."""
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> ReasoningDelta:
        """The held-back rest once the output has ended: a partial marker is text of its side."""
        return self._run(final=True)

    def _run(self, final: bool) -> ReasoningDelta:
        reasoning, content = [], []
        while self._step(reasoning, content, final):
            pass
        delta = ReasoningDelta("".join(reasoning), "".join(content))
        if delta.reasoning:
            self.reasoning = (self.reasoning or "") + delta.reasoning
        self.content += delta.content
        return delta

    def _step(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        """One state's work; True when another step may follow."""
        if self._state == self._BEFORE:
            return self._step_before(final)
        if self._state == self._INSIDE:
            return self._step_inside(reasoning, final)
        if self._state == self._AFTER_END:
            return self._step_after_end(final)
        content.append(self._buffer)
        self._buffer = ""
        return False

    def _step_before(self, final: bool) -> bool:
        """Leading whitespace then the start marker open the reasoning; anything else is content."""
        head = self._buffer.lstrip()
        if head.startswith(self.syntax.start):
            self._buffer = head[len(self.syntax.start):]
            self._state, self.reasoning = self._INSIDE, ""
            return True
        if not final and self.syntax.start.startswith(head):
            return False
        self._state = self._CONTENT
        return True

    def _step_inside(self, reasoning: list[str], final: bool) -> bool:
        if self._strip_start:
            if not final and self._buffer and self.syntax.start.startswith(self._buffer):
                return False
            self._buffer = self._buffer.removeprefix(self.syntax.start)
            self._strip_start = not self._buffer and not final
        end = self._buffer.find(self.syntax.end)
        if end >= 0:
            reasoning.append(self._buffer[:end])
            self._buffer = self._buffer[end + len(self.syntax.end):]
            self._state = self._AFTER_END
            return True
        held = 0 if final else partial_marker_len(self._buffer, self.syntax.end)
        reasoning.append(self._buffer[:len(self._buffer) - held])
        self._buffer = self._buffer[len(self._buffer) - held:]
        return False

    def _step_after_end(self, final: bool) -> bool:
        """The whitespace between the end marker and the answer belongs to neither."""
        self._buffer = self._buffer.lstrip()
        if not self._buffer:
            return False
        self._state = self._CONTENT
        return True


def split_reasoning(mode: ReasoningMode, text: str) -> ReasoningParser:
    """A whole output split at once (the parser, for its `reasoning` and `content`)."""
    parser = ReasoningParser(mode)
    parser.feed(text)
    parser.finish()
    return parser


def output_reasoning(name: str, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole output under the parser `name`, with no prompt to read
    (the DSL's `separate_reasoning`): qwen3 looks for `<think>` at the start, deepseek-r1 starts
    inside; the reasoning is "" when there is none, as in SGLang.

    Raises
    ------
    ValueError: `name` is not a reasoning parser.
    """
    if name not in SYNTAXES:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of {REASONING_PARSERS}")
    syntax = SYNTAXES[name]
    parser = split_reasoning(ReasoningMode(syntax, inside=syntax.starts_inside), text)
    return parser.reasoning or "", parser.content

