"""The contract every tool-call format keeps: a parser ABC, the format ABC, and the events they share.

A format (`ToolCallFormat`) knows three things about one family's way of
calling tools: the grammar that makes a model write valid calls
(`structural_tag`, an xgrammar structural tag per `tool_choice` mode), how to
read them back (`new_parser`, an incremental `ToolCallParser`) and how to write
past calls into a prompt whose template cannot (`history_text`). The grammar
and the parser of a format are written from the same constants, so whatever
the grammar lets the model write, the parser reads as intended: the text of a
call never reaches `content`, and the events of a streamed answer join into
exactly the non-streamed answer (`parse_whole` is the parser fed once).

Formats: `hermes.py` (Hermes / Qwen2.5 `<tool_call>` blocks), `llama3.py`
(Llama 3.x JSON calls), `mistral.py` (`[TOOL_CALLS] [...]`), `pythonic.py`
(`[f(a=1)]`); `registry.py` picks one by name or from the chat template.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

# The modes of `tool_choice` a plan resolves to (see `tool_calls.plan_tools`).
CHOICES = ("auto", "required", "named")


def new_call_id() -> str:
    """A tool-call id in OpenAI's style: `call_` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    """One tool call found in the output; `arguments` is its JSON text.

    `complete`: the arguments are whole (the call's end came, or the output
    ended right after arguments that parse as JSON); a call cut off before
    that is not returned as a tool call.
    """

    name: str
    arguments: str = ""
    complete: bool = False
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class TextDelta:
    """Content text (outside any call)."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """Call number `index` of the answer opened: its id and function name are known."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """More of call `index`'s arguments text (JSON)."""

    index: int
    text: str


Event = TextDelta | CallStart | ArgumentsDelta


@dataclass(frozen=True)
class FunctionSpec:
    """What a format's grammar needs of one offered function.

    name: the function name (already checked: 1-64 of ``[A-Za-z0-9_-]``).
    schema: the JSON Schema of its arguments in the grammar backend's form
        (`PreparedSchema.text` parsed), an object schema.
    """

    name: str
    schema: dict[str, Any]


class ToolCallParser(ABC):
    """Splits one choice's output into content and tool calls, incrementally.

    Contract: call `feed` with each new piece of text and `finish` once at the
    end; each returns the events that became certain, in order, and holds back
    only text that could still turn out to be call markup. Feeding the same
    text in any pieces gives events whose joined texts are the same (content,
    and per call its id, name and arguments). `calls` and `content` hold the
    result so far; a parser is used for one output and is not thread-safe.
    """

    def __init__(self, call_id: Callable[[], str] = new_call_id) -> None:
        self.calls: list[ParsedCall] = []
        self._content: list[str] = []
        self._call_id = call_id

    @property
    def content(self) -> str | None:
        """The content text; None when the answer is only tool calls."""
        text = "".join(self._content)
        return None if self.calls and not text else text

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Events certain once `text` is appended to what came before."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """Events of the held-back rest, once the output has ended."""

    # ---- helpers for subclasses: each appends to the result and to `events`

    def _emit_text(self, events: list[Event], text: str) -> None:
        if text:
            self._content.append(text)
            events.append(TextDelta(text))

    def _open_call(self, events: list[Event], name: str) -> ParsedCall:
        call = ParsedCall(name, id=self._call_id())
        self.calls.append(call)
        events.append(CallStart(len(self.calls) - 1, call.id, name))
        return call

    def _emit_arguments(self, events: list[Event], text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            events.append(ArgumentsDelta(len(self.calls) - 1, text))


class ToolCallFormat(ABC):
    """One family's tool-call text: its grammar, its parser and its history rendering.

    `name` is SGLang's `--tool-call-parser` name. Implementations are frozen
    dataclasses (a format holds only options read from the chat template).
    """

    name: ClassVar[str]

    @abstractmethod
    def structural_tag(self, functions: Sequence[FunctionSpec], choice: str, parallel: bool,
                       named: str | None = None) -> dict[str, Any]:
        """The grammar of an answer, an xgrammar structural-tag format (without the outer wrapper).

        Parameters
        ----------
        functions: every offered function, in request order.
        choice: ``auto`` (free text; a call wherever the model starts one),
            ``required`` (only calls, at least one) or ``named`` (one call of `named`).
        parallel: several calls allowed; False ends the grammar after the first call.
        named: the forced function when `choice` is ``named``.

        Raises
        ------
        GrammarError: a function's schema that this format cannot express
            (``param`` names the schema's location as `ToolPlan` reports it).
        """

    @abstractmethod
    def new_parser(self, names: Sequence[str]) -> ToolCallParser:
        """A fresh parser for one output; `names` are the offered functions' names."""

    @abstractmethod
    def history_text(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Past calls, as (name, arguments object) pairs, written as the model writes them
        (for a template that does not render `tool_calls` itself)."""

    @abstractmethod
    def renders_natively(self, template: str) -> bool:
        """True when the chat template `template` renders `tools` and calls in this format."""

    instructions: ClassVar[str] = ""
    """How to call, for the system prompt of a template without tool support (after the tools)."""

    def marker_texts(self) -> tuple[str, ...]:
        """Markers that open calls and that a family's tokenizer holds as one special token
        (Mistral's `[TOOL_CALLS]`, Llama 3's `<|python_tag|>`); none by default.

        A grammar never writes a special token as text, so in ``auto`` such a token ends
        the free text as a stop token and the calls that follow it are a second, forced
        generation (`tool_markers.py`), constrained by `after_marker_tag`.
        """
        return ()

    def after_marker_tag(self, functions: Sequence[FunctionSpec], parallel: bool) -> dict[str, Any]:
        """The grammar of what follows a marker of `marker_texts` (the calls, without the marker).

        Raises
        ------
        NotImplementedError: for a format without special-token markers.
        """
        raise NotImplementedError(f"the {self.name} format has no special-token markers")


def parse_whole(fmt: ToolCallFormat, text: str, names: Sequence[str]) -> ToolCallParser:
    """The whole output parsed at once (the parser, for its `content` and `calls`)."""
    parser = fmt.new_parser(names)
    parser.feed(text)
    parser.finish()
    return parser


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def json_tag(schema: dict[str, Any], max_whitespace: int) -> dict[str, Any]:
    """A structural-tag `json_schema` element: arguments valid for `schema`, with at most
    `max_whitespace` whitespace characters in a row (room for `{"a": 1, "b": 2}` as
    json.dumps writes it, too little for a weak model to wander in)."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": max_whitespace}
