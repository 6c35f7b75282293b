"""Detokenization: token ids to streamed text, and stop strings.

Place in the request path: the scheduler sends each request's new token ids
every step; per request, an `IncrementalDetokenizer` turns them into a text
delta, and a `StopStringMatcher` decides how much of that text may be streamed
and whether a stop string finished the request (then the scheduler aborts its
generation). `RequestDecoder` joins the two for one request.

The incremental decode is vLLM's and SGLang's (``detokenize_incrementally``;
``surr_offset`` / ``read_offset``): each step decodes only a short window of
recent tokens, and text is released only when the window's text does not end
in U+FFFD, so a UTF-8 character split across tokens is held back until complete.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as left context of the first window (SGLang's
# INIT_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT_LEN = 5


class IncrementalDetokenizer:
    """Turn a request's output token ids into text deltas, one step at a time.

    Concatenating every `step` result and the final `finish` gives exactly
    ``tokenizer.decode(output_ids, skip_special_tokens=...)`` when no prompt is
    given; with ``prompt_ids`` the text is the output as it reads after the
    prompt (the same thing for byte-level BPE tokenizers such as SmolLM2's;
    SentencePiece tokenizers keep the first token's leading space). No delta
    ever contains a U+FFFD produced by a character split across tokens.

    Each step decodes two windows of tokens, ``ids[surr_offset:read_offset]``
    (text already released) and ``ids[surr_offset:]`` (with the new tokens);
    the delta is the second's text after the first's. Both offsets move forward
    whenever text is released, so a step costs O(window), not O(output).

    Parameters
    ----------
    tokenizer:
        A Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=...)``).
    prompt_ids:
        The request's prompt; its last `PROMPT_CONTEXT_LEN` tokens are context
        for the first window. None: decode the output alone.
    skip_special_tokens, spaces_between_special_tokens:
        Passed to ``tokenizer.decode`` (the second only when False, since fast
        tokenizers ignore it).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self._decode_kwargs: dict[str, bool] = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            self._decode_kwargs["spaces_between_special_tokens"] = False
        context = list(prompt_ids[-PROMPT_CONTEXT_LEN:]) if prompt_ids else []
        self._ids: list[int] = context
        self._num_context = len(context)
        self.surr_offset = 0
        self.read_offset = len(context)
        self.output_text = ""

    @property
    def output_ids(self) -> list[int]:
        """Every output token id seen so far."""
        return self._ids[self._num_context :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self._decode_kwargs)

    def step(self, new_token_ids: list[int]) -> str:
        """Add this step's tokens; return the newly completed text (possibly "")."""
        self._ids.extend(new_token_ids)
        surr_text = self._decode(self._ids[self.surr_offset : self.read_offset])
        new_text = self._decode(self._ids[self.surr_offset :])
        if len(new_text) <= len(surr_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # incomplete character (or no visible text yet): hold back
        delta = new_text[len(surr_text) :]
        self.surr_offset = self.read_offset
        self.read_offset = len(self._ids)
        self.output_text += delta
        return delta

    def finish(self) -> str:
        """Release whatever is held back (an incomplete trailing character decodes as U+FFFD)."""
        surr_text = self._decode(self._ids[self.surr_offset : self.read_offset])
        new_text = self._decode(self._ids[self.surr_offset :])
        delta = new_text[len(surr_text) :]
        self.surr_offset = self.read_offset = len(self._ids)
        self.output_text += delta
        return delta


class StopMatch(NamedTuple):
    """The earliest stop string in a text: its start index and which stop it is."""

    start: int
    stop: str


def find_earliest_stop(text: str, stops: list[str], start: int = 0) -> StopMatch | None:
    """The stop string occurring earliest in ``text[start:]`` (longest on a tie), or None."""
    best: StopMatch | None = None
    for stop in stops:
        pos = text.find(stop, start)
        if pos < 0:
            continue
        if best is None or pos < best.start or (pos == best.start and len(stop) > len(best.stop)):
            best = StopMatch(pos, stop)
    return best


@dataclass
class StopCheck:
    """One `StopStringMatcher.feed` result.

    ``text``: what may be streamed now; ``matched``: the stop string that
    finished the request, or None while it goes on.
    """

    text: str
    matched: str | None = None

    @property
    def finished(self) -> bool:
        return self.matched is not None


class StopStringMatcher:
    """Find stop strings in streamed text without ever streaming part of one.

    Text is fed as it is decoded. The matcher releases all of it except a tail
    that could be the start of a stop string; when a stop string appears (even
    across many deltas) it releases the text before it (plus the stop itself
    with ``no_stop_trim``) and reports the match. Released pieces concatenate
    to the final text. This is the streaming form of what vLLM's
    ``StopChecker`` and SGLang's ``check_finished`` do on the whole text.

    Parameters
    ----------
    stops:
        The request's stop strings (non-empty); an empty list matches nothing.
    no_stop_trim:
        Keep the matched stop string at the end of the output.
    """

    def __init__(self, stops: list[str], no_stop_trim: bool = False):
        assert all(stops), "stop strings are non-empty (SamplingParams.verify)"
        self.stops = list(stops)
        self.no_stop_trim = no_stop_trim
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""  # fed but not yet released
        self.text = ""  # released so far
        self.matched: str | None = None

    def feed(self, delta: str) -> StopCheck:
        """Add decoded text; return what may be streamed and whether a stop matched.

        After a match, further text is ignored (the request is finished).
        """
        if self.matched is not None:
            return StopCheck("", self.matched)
        # Released text never ends in a prefix of a stop, so a stop can only start
        # inside the pending text.
        pending = self._pending + delta
        match = find_earliest_stop(pending, self.stops)
        if match is not None:
            end = match.start + (len(match.stop) if self.no_stop_trim else 0)
            self.matched = match.stop
            self._pending = ""
            return self._release(pending[:end], match.stop)
        hold = self._held_tail_len(pending)
        self._pending = pending[len(pending) - hold :]
        return self._release(pending[: len(pending) - hold], None)

    def finish(self) -> str:
        """Release the held-back tail when the request ends without a stop string."""
        tail, self._pending = self._pending, ""
        self.text += tail
        return tail

    def _release(self, text: str, matched: str | None) -> StopCheck:
        self.text += text
        return StopCheck(text, matched)

    def _held_tail_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        for k in range(min(len(text), self._max_hold), 0, -1):
            suffix = text[-k:]
            if any(stop.startswith(suffix) for stop in self.stops):
                return k
        return 0


class RequestDecoder:
    """One request's detokenizer and stop-string matcher together.

    Each step: ``chunk = decoder.step(new_ids)``; stream ``chunk.text``; if
    ``chunk.finished``, a stop string ended the request (abort its generation).
    When the request ends otherwise, stream ``decoder.finish()``. ``text`` is
    the final output text.
    """

    def __init__(
        self,
        tokenizer: Any,
        stops: list[str],
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ):
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens, spaces_between_special_tokens
        )
        self.matcher = StopStringMatcher(stops, no_stop_trim)

    @property
    def text(self) -> str:
        return self.matcher.text

    @property
    def finished(self) -> bool:
        return self.matcher.matched is not None

    def step(self, new_token_ids: list[int]) -> StopCheck:
        """Decode this step's tokens; the streamable text and any stop match."""
        return self.matcher.feed(self.detokenizer.step(new_token_ids))

    def finish(self) -> str:
        """Flush both stages at the end of the request; the last text to stream."""
        if self.finished:
            return ""
        check = self.matcher.feed(self.detokenizer.finish())
        return check.text + ("" if check.finished else self.matcher.finish())
