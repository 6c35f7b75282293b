"""API speculative execution (`@function(num_api_spec_tokens=N)`), after SGLang's interpreter.

Programs that alternate fixed text and short gens ("Name:" gen "\\nBirthday:" gen ...)
make one request per gen, each resending the whole prompt. With speculation, one
request generates N tokens ahead, and the program's gens are cut from that text:

- **completion** (any backend; SGLang's ``_spec_gen``): a gen with a `stop` takes the
  speculated text up to its first stop string; text the program appends next must be
  what the model speculated (then it is consumed) or the speculation is dropped and
  the next gen makes a new request. A gen without a stop string, with a constraint,
  `stop_regex` or logprobs, or whose stop never comes in a speculation cut short by
  the length limit, is generated normally.
- **chat** (backends with `uses_chat_messages`, inside an assistant turn; SGLang's
  ``role_end_generate``): the turn's text and gens are collected, and when the turn
  ends one chat completion of N tokens is matched against them: each text piece must
  follow literally and each gen ends at its stop string (the last gen may take the
  rest). A completion that does not match is retried (3 tries), then refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from arborlm.errors import ArborError

SPEC_MAX_NUM_TRIES = 3  # SGLang's `spec_max_num_tries`
# Gen options that need the gen's own request: its constraint or its logprobs.
_OWN_REQUEST_FIELDS = ("regex", "json_schema", "ebnf")


def stop_strings(sampling: dict[str, Any]) -> list[str]:
    """The gen's stop strings as a list (empty when none)."""
    stop = sampling.get("stop")
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if s]


def can_speculate(sampling: dict[str, Any], logprobs: dict[str, Any], stop_regex: list[str] | None) -> bool:
    """Whether a gen can be cut from speculated text: it ends at a stop string and needs nothing of its own."""
    return (bool(stop_strings(sampling)) and not stop_regex and not logprobs
            and not any(sampling.get(k) is not None for k in _OWN_REQUEST_FIELDS))


def first_stop(text: str, stops: list[str]) -> int:
    """Position of the earliest stop string in `text`, -1 when none occurs."""
    positions = [p for p in (text.find(s) for s in stops) if p != -1]
    return min(positions) if positions else -1


@dataclass
class Speculation:
    """The completion path's state: text the model generated ahead, not yet used by the program.

    text: the speculated text left.
    truncated: the speculation ended at its length limit (so what follows `text` is unknown).
    """

    text: str = ""
    truncated: bool = False

    def fill(self, value: str) -> None:
        """The program appends `value`: consume it from the speculation if it follows, else drop it."""
        if value and self.text.startswith(value):
            self.text = self.text[len(value):]
        else:
            self.text = ""

    def take(self, stops: list[str]) -> str | None:
        """The next gen's text: up to its first stop string; None when the speculation cannot tell."""
        pos = first_stop(self.text, stops)
        if pos == -1:
            if self.truncated or not self.text:
                return None
            pos = len(self.text)  # the model ended here (EOS or a stop token)
        out, self.text = self.text[:pos], self.text[pos:]
        return out

    def reset(self, text: str, meta: dict[str, Any] | None) -> None:
        self.text = text
        reason = (meta or {}).get("finish_reason") or {}
        self.truncated = reason.get("type") == "length"


def speculated_meta(stops: list[str]) -> dict[str, Any]:
    """Meta info of a gen cut from speculated text (its tokens are counted on the request that made it)."""
    return {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "speculated": True,
            "finish_reason": {"type": "stop", "matched": stops[0] if len(stops) == 1 else None}}


@dataclass
class ChatTerm:
    """One piece of a speculated assistant turn: fixed text, or a gen (name, stop strings)."""

    text: str = ""
    name: str | None = None
    stops: list[str] = field(default_factory=list)
    is_gen: bool = False


def match_terms(terms: list[ChatTerm], completion: str) -> list[str] | None:
    """The text of each term when `completion` follows the pattern, else None.

    A text term must come next literally; a gen ends at its first stop string (kept for
    what follows, as a stop is not part of the gen's text); the last term, if a gen, takes the rest.
    """
    out = []
    rest = completion
    for i, term in enumerate(terms):
        if not term.is_gen:
            if not rest.startswith(term.text):
                return None
            out.append(term.text)
            rest = rest[len(term.text):]
            continue
        pos = first_stop(rest, term.stops)
        if pos == -1:
            if i != len(terms) - 1 and any(t.is_gen or t.text for t in terms[i + 1:]):
                return None
            pos = len(rest)
        out.append(rest[:pos])
        rest = rest[pos:]
    return out


class SpeculationMismatch(ArborError):
    """A speculated assistant turn did not follow the program's text and gens after every try."""
