"""The incremental parser shared by the formats whose calls are JSON: Hermes, Llama 3, Mistral.

A format describes its text with a `JsonCallSyntax`: the literal triggers that
open call markup inside content, then regular expressions for what follows a
trigger up to the first call's arguments (``open`` + ``header``, which names the
function), the end of a call after its arguments (``close``) and, for formats
that write several calls as one list, what separates two calls (``next_call``)
and what ends the list (``close_group``). The arguments themselves are read by
a JSON scanner (strings, escapes, nesting), so a `}` or an end marker inside a
string never ends them.

Matching is incremental: the `regex` module's partial matches tell whether the
text so far can still become a match, so the parser holds back exactly the
text that could still be markup and sends the rest at once. A regex that ends
in optional whitespace waits for one character more (or the end of the output)
before it is taken, so whitespace goes to the same side whatever the chunking.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import regex

from arborlm.entrypoints.openai.tool_parsers.base import (
    Event,
    ToolCallParser,
    json_tag,
    new_call_id,
    partial_marker_len,
)

# A header not matched within this many characters is not a header (bounds the held-back text).
MAX_HEADER_CHARS = 256


@dataclass(frozen=True)
class JsonCallSyntax:
    """The text around JSON calls in one format (see the module docstring).

    triggers: literal texts that start call markup in content.
    open: regex from a trigger up to the first call's header (may be empty).
    header: regex of a call's start up to its arguments, with the group ``name``.
    close: regex after the arguments that ends one call.
    next_call: regex between two calls of one list; None when each call stands alone.
    close_group: regex that ends a list of calls (with `next_call`).
    separator: regex of the text between two stand-alone calls that is not content
        (whitespace, and the format's separator such as Llama's ``;``).
    separator_markup: regex of the markup at the start of that text (Llama's ``;``), dropped
        when content follows it.
    """

    triggers: tuple[str, ...]
    open: str
    header: str
    close: str
    next_call: str | None = None
    close_group: str | None = None
    separator: str = r"\s*"
    separator_markup: str | None = None

    @cached_property
    def first_re(self) -> regex.Pattern:
        return regex.compile(f"(?:{self.open})(?:{self.header})", regex.DOTALL)

    @cached_property
    def next_re(self) -> regex.Pattern | None:
        return None if self.next_call is None else regex.compile(f"(?:{self.next_call})(?:{self.header})")

    @cached_property
    def close_re(self) -> regex.Pattern:
        return regex.compile(self.close)

    @cached_property
    def close_group_re(self) -> regex.Pattern | None:
        return None if self.close_group is None else regex.compile(self.close_group)

    @cached_property
    def separator_re(self) -> regex.Pattern:
        return regex.compile(self.separator)

    @cached_property
    def separator_markup_re(self) -> regex.Pattern | None:
        return None if self.separator_markup is None else regex.compile(self.separator_markup)


class _Match:
    """Matching a regex at the start of the buffer: taken (`match`), `waiting` for more text, or `failed`.

    A match that reaches the end of the text may still grow (optional whitespace, a
    longer alternative), so it waits unless the output has ended; once it has, a
    match that is still only partial is `waiting` for text that will never come (cut).
    """

    def __init__(self, pattern: regex.Pattern, text: str, final: bool):
        m = pattern.match(text, partial=True)
        self.failed = m is None
        self.match = None
        if m is not None and (m.partial or m.end() == len(text)):
            m = pattern.match(text) if final else None
        self.match = m
        self.waiting = not self.failed and m is None


class JsonScanner:
    """Finds where one JSON value ends, fed character by character (strings, escapes, nesting)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them unless it ends inside)."""
        for i, ch in enumerate(text):
            if self._step(ch):
                return i + 1
        return len(text)

    def _step(self, ch: str) -> bool:
        """Take one character; True when it ends the value."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                return self._closed()
            return False
        if ch == '"':
            self.in_string, self.started = True, True
        elif ch in "{[":
            self.depth, self.started = self.depth + 1, True
        elif ch in "}]":
            self.depth -= 1
            return self._closed()
        elif not ch.isspace():
            self.started = True
        return False

    def _closed(self) -> bool:
        self.done = self.depth <= 0
        return self.done


class JsonCallParser(ToolCallParser):
    """`ToolCallParser` for a `JsonCallSyntax` (see the module docstring for the states).

    Text before, between or after calls is content, except a run of separator
    text alone between or after calls. A call cut inside its header is
    dropped: under the tool grammar that text can only be call markup. A call
    cut inside its arguments keeps what came; it is `complete` only when they
    are whole JSON. A trigger not followed by a header is content.
    """

    _TEXT, _OPEN, _ARGS, _CLOSE, _NEXT = range(5)

    def __init__(self, syntax: JsonCallSyntax, call_id: Callable[[], str] = new_call_id):
        super().__init__(call_id)
        self.syntax = syntax
        self._buffer = ""
        self._mode = self._TEXT
        self._scanner = JsonScanner()
        self._trigger = ""
        # Whether the text since the last call has been sent as content (then all of it is).
        self._segment_sent = False

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        events = self._run(final=True)
        if self._mode == self._ARGS:
            call = self.calls[-1]
            call.complete = self._scanner.done or _is_json(call.arguments)
        elif self._mode == self._CLOSE:
            self.calls[-1].complete = True  # the arguments were whole; the end marker was cut
        elif self._mode == self._TEXT:
            self._emit_segment(events, self._buffer)
        self._buffer, self._mode = "", self._TEXT
        return events

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        steps = {self._TEXT: self._step_text, self._OPEN: self._step_open, self._ARGS: self._step_args,
                 self._CLOSE: self._step_close, self._NEXT: self._step_next}
        while steps[self._mode](events, final):
            pass
        return events

    # ---- one state at a time; True when another step may follow

    def _step_text(self, events: list[Event], final: bool) -> bool:
        start, trigger = _earliest(self._buffer, self.syntax.triggers)
        if start >= 0:
            self._emit_segment(events, self._buffer[:start])
            self._buffer, self._trigger, self._mode = self._buffer[start:], trigger, self._OPEN
            return True
        held = 0 if final else max(partial_marker_len(self._buffer, t) for t in self.syntax.triggers)
        safe = len(self._buffer) - held
        if final or (self.calls and not self._segment_sent and self._is_separator(self._buffer[:safe])):
            return False  # separator text after a call: content only if more text follows
        self._emit_text(events, self._buffer[:safe])
        self._buffer = self._buffer[safe:]
        return False

    def _step_open(self, events: list[Event], final: bool) -> bool:
        m = _Match(self.syntax.first_re, self._buffer, final)
        if m.match is not None:
            return self._start_call(events, m.match)
        if m.failed or len(self._buffer) > MAX_HEADER_CHARS:
            # not a call after all: the trigger is text, and scanning goes on after it
            self._emit_text(events, self._trigger)
            self._segment_sent = True
            self._buffer, self._mode = self._buffer[len(self._trigger):], self._TEXT
            return True
        if final:  # cut inside the header: call markup, neither content nor a call
            self._buffer, self._mode = "", self._TEXT
        return False

    def _step_args(self, events: list[Event], final: bool) -> bool:
        taken = self._scanner.feed(self._buffer)
        self._emit_arguments(events, self._buffer[:taken])
        self._buffer = self._buffer[taken:]
        if not self._scanner.done:
            return False
        self._mode = self._CLOSE
        return True

    def _step_close(self, events: list[Event], final: bool) -> bool:
        m = _Match(self.syntax.close_re, self._buffer, final)
        if m.waiting:
            return False
        self.calls[-1].complete = True
        self._segment_sent = False
        if m.failed:  # text the grammar would not write after a call: content
            self._mode = self._TEXT
            return True
        self._buffer = self._buffer[m.match.end():]
        self._mode = self._NEXT if self.syntax.next_re is not None else self._TEXT
        return True

    def _step_next(self, events: list[Event], final: bool) -> bool:
        following = _Match(self.syntax.next_re, self._buffer, final)
        if following.match is not None:
            return self._start_call(events, following.match)
        closing = _Match(self.syntax.close_group_re, self._buffer, final)
        if closing.match is not None:
            self._buffer, self._mode = self._buffer[closing.match.end():], self._TEXT
            return True
        if following.waiting or closing.waiting:
            if final:  # cut between calls: markup
                self._buffer, self._mode = "", self._TEXT
            return False
        self._mode = self._TEXT  # neither another call nor the list's end: content
        return True

    def _start_call(self, events: list[Event], match: regex.Match) -> bool:
        self._open_call(events, match["name"])
        self._buffer = self._buffer[match.end():]
        self._scanner, self._mode = JsonScanner(), self._ARGS
        return True

    # ---- content

    def _is_separator(self, text: str) -> bool:
        return self.syntax.separator_re.fullmatch(text) is not None

    def _emit_segment(self, events: list[Event], text: str) -> None:
        """The end of a run of text: dropped when it is only separator text after a call."""
        if self.calls and not self._segment_sent and self._is_separator(text):
            return
        self._emit_text(events, text)
        self._segment_sent = self._segment_sent or bool(text)

    def _emit_text(self, events: list[Event], text: str) -> None:
        markup = self.syntax.separator_markup_re
        if markup is not None and self.calls and not self._segment_sent and (m := markup.match(text)):
            text = text[m.end():]  # the separator's markup before content that follows a call
            self._segment_sent = True
        super()._emit_text(events, text)
        if text:
            self._segment_sent = True


def _earliest(text: str, markers: Sequence[str]) -> tuple[int, str]:
    """(index, marker) of the first of `markers` in `text`; (-1, "") when none is there."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found, key=lambda f: (f[0], -len(f[1]))) if found else (-1, "")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# ---- grammars ----------------------------------------------------------------------------

# Whitespace characters allowed in a row inside the arguments (xgrammar's least; it refuses 0).
ARGUMENTS_MAX_WHITESPACE = 1


def call_tag(begin: str, schema: dict, end: str) -> dict:
    """One call: the fixed `begin`, arguments valid for `schema`, the fixed `end`."""
    return {"type": "tag", "begin": begin, "content": json_tag(schema, ARGUMENTS_MAX_WHITESPACE), "end": end}


def standalone_calls_tag(tags: dict[str, list[dict]], triggers: Sequence[str], separator: str, choice: str,
                         parallel: bool, named: str | None) -> dict:
    """The grammar of formats whose calls stand alone (Hermes blocks, Llama JSON objects).

    `tags` maps each function to its call tags, the forced spelling first (a format
    that reads two spellings, such as Llama's with and without ``<|python_tag|>``,
    lists both; `auto` accepts either, forced modes write the first).
    ``named``: that function's call alone; ``required``: calls separated by
    `separator`, at least one; ``auto``: free text in which each trigger opens a call.
    """
    if choice == "named":
        return tags[named][0]
    if choice == "required":
        return {"type": "tags_with_separator", "tags": [t[0] for t in tags.values()], "separator": separator,
                "at_least_one": True, "stop_after_first": not parallel}
    return {"type": "triggered_tags", "triggers": list(triggers), "tags": [t for ts in tags.values() for t in ts],
            "stop_after_first": not parallel}
