"""The tool-call text format, and the incremental parser that turns model text into tool calls.

arborlm's models call tools in the Hermes / Qwen2.5 format, one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammar (`tool_calls.py`) forces each block to begin with `call_begin(name)`
and to end with `CALL_END`, so the arguments are exactly the text between the
two, and parsing is a scan for fixed strings. `ToolCallParser` does that scan
incrementally: fed the text as it streams, it sends content text, each call's
start (id and name) and its argument fragments as soon as they are certain,
holding back only the few characters that could still start a marker.
Parsing the whole text at once is the same parser fed once, so streamed and
non-streamed answers agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

CALL_TRIGGER = "<tool_call>"
CALL_END = "}\n</tool_call>"
# Between two calls of one answer (what the grammar allows when it forces calls).
CALL_SEPARATOR = "\n"
_NAME_PREFIX = '\n{"name": "'
_ARGUMENTS_PREFIX = '", "arguments": '
# The header after the trigger, as the grammar writes it (whitespace tolerated for other writers).
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*')
# A header not matched within this many characters is not a header.
_MAX_HEADER_CHARS = 256


def call_begin(name: str) -> str:
    """The text that opens a call of `name`, up to its arguments: `<tool_call>\\n{"name": "NAME", "arguments": `."""
    return f"{CALL_TRIGGER}{_NAME_PREFIX}{name}{_ARGUMENTS_PREFIX}"


def new_call_id() -> str:
    """A tool-call id in OpenAI's style: `call_` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    """One tool call found in the output; `arguments` is the raw JSON text the model wrote.

    `complete`: the arguments are whole (the end marker came, or the output
    ended right after the arguments and they parse as JSON); a call cut off
    before that is not returned as a tool call.
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
    """More of call `index`'s arguments text."""

    index: int
    text: str


Event = TextDelta | CallStart | ArgumentsDelta


class ToolCallParser:
    """Splits one choice's output into content and tool calls, incrementally.

    Call `feed` with each new piece of text and `finish` once at the end; each
    returns the events that became certain. `content` and `calls` hold the
    result so far. Text the model writes before, between or after calls is
    content, except a run of whitespace alone after a call (the separator).
    """

    _TEXT, _HEADER, _ARGUMENTS = range(3)

    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self._content: list[str] = []
        self._buffer = ""
        self._mode = self._TEXT
        # Whether the text since the last call has been sent as content (then all of it is).
        self._segment_sent = False

    @property
    def content(self) -> str | None:
        """The content text; None when the answer is only tool calls."""
        text = "".join(self._content)
        return None if self.calls and not text else text

    def feed(self, text: str) -> list[Event]:
        """Events certain once `text` is appended to what came before."""
        self._buffer += text
        events: list[Event] = []
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[Event]:
        """Events of the held-back rest, once the output has ended.

        A partial marker after text is text. A call cut inside its header
        (``<tool_call>`` and part of ``{"name": ...``) is dropped: under the
        tool grammar that text can only be call markup, so it is neither
        content nor a call. A call cut inside its arguments keeps them without
        the cut end marker; it is `complete` only if they are whole JSON (the
        output ended between the arguments and ``}\n</tool_call>``).
        """
        events: list[Event] = []
        while self._step(events, final=True):
            pass
        if self._mode == self._ARGUMENTS:
            self._finish_arguments(events)
        elif self._mode == self._TEXT:
            self._emit_segment(events, self._buffer)
        self._buffer = ""
        self._mode = self._TEXT
        return events

    def _finish_arguments(self, events: list[Event]) -> None:
        """The output ended inside the last call. The held-back rest (a prefix of ``}\n</tool_call>``)
        is the start of the end marker when the arguments before it are whole JSON (the grammar
        writes the marker only after them); else it is theirs (``{"a": {"b": 1}`` + ``}``)."""
        call = self.calls[-1]
        if not _is_json(call.arguments):
            self._emit_arguments(events, self._buffer)
        call.complete = _is_json(call.arguments)

    # ---- one state at a time; True when another step may follow

    def _step(self, events: list[Event], final: bool) -> bool:
        if self._mode == self._TEXT:
            return self._step_text(events)
        if self._mode == self._HEADER:
            return self._step_header(events, final)
        return self._step_arguments(events, final)

    def _step_text(self, events: list[Event]) -> bool:
        start = self._buffer.find(CALL_TRIGGER)
        if start >= 0:
            self._emit_segment(events, self._buffer[:start])
            self._buffer = self._buffer[start + len(CALL_TRIGGER):]
            self._mode = self._HEADER
            return True
        safe = len(self._buffer) - _partial_marker_len(self._buffer, CALL_TRIGGER)
        if self.calls and not self._segment_sent and not self._buffer[:safe].strip():
            return False  # whitespace after a call: content only if more text follows
        self._emit_text(events, self._buffer[:safe])
        self._buffer = self._buffer[safe:]
        return False

    def _step_header(self, events: list[Event], final: bool) -> bool:
        match = _HEADER.match(self._buffer)
        # Wait for a character after the header, so that whitespace is the header's, not the arguments'.
        if match is not None and (match.end() < len(self._buffer) or final):
            call = ParsedCall(match[1])
            self.calls.append(call)
            events.append(CallStart(len(self.calls) - 1, call.id, call.name))
            self._buffer = self._buffer[match.end():]
            self._mode = self._ARGUMENTS
            self._segment_sent = False
            return True
        if "</tool_call>" in self._buffer or len(self._buffer) > _MAX_HEADER_CHARS:
            self._emit_text(events, CALL_TRIGGER)  # not a call after all: the marker is text
            self._mode = self._TEXT
            return True
        return False

    def _step_arguments(self, events: list[Event], final: bool) -> bool:
        end = self._buffer.find(CALL_END)
        if end >= 0:
            self._emit_arguments(events, self._buffer[:end])
            self.calls[-1].complete = True
            self._buffer = self._buffer[end + len(CALL_END):]
            self._mode = self._TEXT
            return True
        if not final:
            safe = len(self._buffer) - _partial_marker_len(self._buffer, CALL_END)
            self._emit_arguments(events, self._buffer[:safe])
            self._buffer = self._buffer[safe:]
        return False

    def _emit_segment(self, events: list[Event], text: str) -> None:
        """The end of a run of text: dropped when it is only whitespace after a call."""
        if self.calls and not self._segment_sent and not text.strip():
            return
        self._emit_text(events, text)

    def _emit_text(self, events: list[Event], text: str) -> None:
        if text:
            self._content.append(text)
            events.append(TextDelta(text))
            self._segment_sent = True

    def _emit_arguments(self, events: list[Event], text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            events.append(ArgumentsDelta(len(self.calls) - 1, text))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def parse_tool_calls(text: str) -> ToolCallParser:
    """The whole output parsed at once (the parser, for its `content` and `calls`)."""
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    return parser
