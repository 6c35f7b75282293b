"""N-gram drafts: what followed the same last tokens before, in this request or in others.

Two sources, tried in order for each request of a decode step:

1. **Prompt lookup** (Saxena 2023, vLLM's ``ngram`` proposer, SGLang's NGRAM): the
   longest suffix of the request's own prompt + output, between
   ``min_match`` and ``max_match`` tokens, that occurred earlier in it; the draft
   is what followed its latest earlier occurrence. Copy-heavy outputs (quoted
   passages, JSON that repeats spans of the input, an agent repeating its
   own lines) hit here.
2. **Recent outputs of other requests** (SuffixDecoding, Oliaro et al. 2024,
   arXiv 2411.04975, reduced to a bounded n-gram table): what another finished
   request generated after the same ``max_match``..``min_match`` tokens.

3. **Prompt lookup on text**, for constrained requests when neither found anything
   (`scheduling.Speculator` gives it those only): the longest suffix (at
   least `TextLookup.min_chars` characters) of the request's last tokens decoded
   that occurs in its prompt's text; the draft is what followed it there,
   tokenized. A value copied from the prompt into JSON or code is often tokenized
   differently from the prompt (``"Alan`` after a quote against `` Alan`` after a
   space), so no token n-gram recurs although the text does.

   Before the three, a constrained request whose output ends with a JSON key (``"city":``,
   or ``"city": "`` with the value opened) drafts the value that follows the same label in its prompt (``city: London`` drafts
   `` "London`` ...; `TextLookup.propose_value`): at a value's start neither the token
   n-grams nor the text suffix can know it (the suffix is the key's syntax), and the
   other requests' outputs after the same key hold their own values.

The first two indexes are plain dicts from an n-gram (a tuple of token ids) to where it
ended, so a lookup costs a few dict probes per request and step; the per-request
index is extended incrementally as the request's tokens grow.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class PromptLookupIndex:
    """Per-request index of every n-gram (``min_match <= n <= max_match``) of its tokens.

    ``ends[key]`` is the latest position ``i`` such that ``tokens[i - n : i] == key``
    and ``tokens[i]`` exists (so something followed it). Built lazily and
    extended by `update` as tokens are appended; tokens are never removed (a
    request only grows, retraction keeps its output).
    """

    min_match: int
    max_match: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed_upto: int = 0  # positions i < indexed_upto are in `ends`

    def update(self, tokens: Sequence[int]) -> None:
        """Index every n-gram ending at a position that has a following token."""
        last = len(tokens) - 1
        for i in range(max(self.indexed_upto, self.min_match), last + 1):
            for n in range(self.min_match, min(self.max_match, i) + 1):
                self.ends[tuple(tokens[i - n : i])] = i
        self.indexed_upto = max(self.indexed_upto, last + 1)

    def propose(self, tokens: Sequence[int], num_draft_tokens: int) -> tuple[list[int], int]:
        """Up to ``num_draft_tokens`` tokens that followed the longest matching suffix of
        ``tokens`` earlier in ``tokens``, and that suffix's length (([], 0) when no suffix of
        ``min_match`` tokens recurs)."""
        self.update(tokens)
        for n in range(min(self.max_match, len(tokens)), self.min_match - 1, -1):
            end = self.ends.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return list(tokens[end : end + num_draft_tokens]), n
        return [], 0


class RecentOutputIndex:
    """What finished requests generated after each n-gram: a bounded, least-recently-added table.

    Keys are n-grams (``min_match <= n <= max_match``) of a finished request's
    prompt tail + output; values are the ``continuation_len`` tokens that
    followed them. ``capacity`` bounds the number of keys (oldest dropped first),
    so memory stays bounded whatever the traffic. Only outputs are indexed
    (with the last ``max_match`` prompt tokens before them, so the first output
    tokens are keyed too): prompts are each request's own lookup's business.
    """

    def __init__(self, min_match: int, max_match: int, capacity: int, continuation_len: int):
        self.min_match = min_match
        self.max_match = max_match
        self.capacity = capacity
        self.continuation_len = continuation_len
        self._table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def clear(self) -> None:
        """Forget every indexed output."""
        self._table.clear()

    def add(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Index a finished request's output (newest continuations win)."""
        if self.capacity == 0 or not output_ids:
            return
        tail = list(prompt_ids[-self.max_match :])
        tokens = tail + list(output_ids)
        for i in range(max(len(tail), self.min_match), len(tokens)):
            cont = tuple(tokens[i : i + self.continuation_len])
            for n in range(self.min_match, min(self.max_match, i) + 1):
                key = tuple(tokens[i - n : i])
                self._table[key] = cont
                self._table.move_to_end(key)
        while len(self._table) > self.capacity:
            self._table.popitem(last=False)

    def propose(self, tokens: Sequence[int], num_draft_tokens: int) -> tuple[list[int], int]:
        """The continuation of the longest suffix of ``tokens`` in the table, and that
        suffix's length (([], 0) when none)."""
        for n in range(min(self.max_match, len(tokens)), self.min_match - 1, -1):
            cont = self._table.get(tuple(tokens[len(tokens) - n :]))
            if cont is not None:
                return list(cont[:num_draft_tokens]), n
        return [], 0


# The prompt tokens `TextLookup` searches (the last ones): decoding them costs the scheduler
# about 0.4 ms per thousand tokens once per request (SmolLM2's tokenizer), and each probe of a
# lookup scans their text (~7 us per 10k characters).
TEXT_LOOKUP_MAX_PROMPT_TOKENS = 16384


@dataclass
class TextLookup:
    """Per-request prompt lookup on text (source 3 of the module docstring).

    prompt_text: the request's prompt, decoded once; the draft comes from it.
    min_chars: the shortest text suffix that may match (shorter ones match too
        often by chance: every draft costs verify work).
    tail_tokens: how many of the last tokens are decoded for the suffix.
    """

    prompt_text: str
    min_chars: int = 3
    tail_tokens: int = 3
    chars_per_token: int = 8  # continuation text taken per draft token wanted
    key_tail_tokens: int = 8  # last tokens decoded to find a JSON key (`propose_value`)

    def propose(self, tokenizer, tokens: Sequence[int], num_draft_tokens: int) -> list[int]:
        """Up to ``num_draft_tokens`` tokens of what followed, in the prompt's text, the longest
        suffix of ``tokens``' last `tail_tokens` decoded ([] when none of ``min_chars`` occurs).

        The continuation is tokenized after the tail's own text, so that a token merging
        across the boundary drafts as the model would write it; when the tail itself
        re-tokenizes differently, the continuation alone.
        """
        tail = list(tokens[-self.tail_tokens :])
        tail_text = tokenizer.decode(tail, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if "\ufffd" in tail_text:  # the tail ends inside a UTF-8 character
            return []
        # Longest suffix first would scan the prompt once per length; a suffix that does not
        # occur has no longer one that does, so grow from the shortest while it still occurs.
        best = -1
        n = self.min_chars
        while n <= len(tail_text):
            at = self.prompt_text.rfind(tail_text[-n:])
            if at < 0:
                break
            best, n = at + n, n + 1
        if best < 0:
            return []
        cont = self.prompt_text[best : best + self.chars_per_token * num_draft_tokens]
        if not cont:
            return []
        ids = tokenizer.encode(tail_text + cont, add_special_tokens=False)
        draft = ids[len(tail) :] if ids[: len(tail)] == tail else tokenizer.encode(cont, add_special_tokens=False)
        if best + len(cont) < len(self.prompt_text):
            draft = draft[:-1]  # the text was cut: its last token may be part of a longer one
        return draft[:num_draft_tokens]

    def propose_value(self, tokenizer, tokens: Sequence[int], num_draft_tokens: int) -> list[int]:
        """Up to ``num_draft_tokens`` tokens of the value that follows, in the prompt's text, the
        label of the JSON key ``tokens`` end with, or of the key whose string value they have just
        opened ([] otherwise, or when the prompt has no such label).

        A label is the key's text followed by ``:`` or ``=`` (``name: Ada``, ``year = 1815``),
        matched case-insensitively, the last one in the prompt; the value is drafted after
        `` "`` (a string) or a space (a number, true, false or null). The grammar cuts
        whatever the schema does not allow (`scheduling.grammatical_prefix`).
        """
        last = list(tokens[-1:])
        last_text = tokenizer.decode(last, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not last_text.rstrip().endswith((":", '"')) and not (
                last_text.isspace() and tokenizer.decode(list(tokens[-2:-1])).rstrip().endswith(":")):
            return []  # the common case, for the price of one or two tokens' decode
        tail_text = tokenizer.decode(list(tokens[-self.key_tail_tokens :]), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
        key = _KEY_AT_END.search(tail_text)
        if key is None:
            return []
        labels = re.finditer(rf"(?<![\w]){re.escape(key.group(1))}\s*[:=][ \t]*", self.prompt_text, re.IGNORECASE)
        label = next(reversed(list(labels)), None)  # the last one: the record nearest the question
        if label is None:
            return []
        budget = self.chars_per_token * num_draft_tokens
        value = self.prompt_text[label.end() : label.end() + budget]
        cut = label.end() + len(value) < len(self.prompt_text) and "\n" not in value
        value = value.split("\n", 1)[0]  # a label's value ends with its line
        if not value.strip():
            return []
        if key.group(2):  # the output has opened the string already
            lead = ""
        else:
            lead = " " if _BARE_VALUE.match(value) else ' "'
            if last_text.endswith((" ", "\t")):
                lead = lead[1:]
        # Tokenized after the last token's text (the key's end): the value's first token as the
        # model would write it there; none when the two would merge.
        ids = tokenizer.encode(last_text + lead + value, add_special_tokens=False)
        if ids[:1] != last:
            return []
        draft = ids[1:]
        if cut:
            draft = draft[:-1]  # the text was cut: its last token may be part of a longer one
        return draft[:num_draft_tokens]


# A JSON object key at the end of the output text: `"city":` (and whitespace after it), or
# `"city": "` (its string value opened: group 2).
_KEY_AT_END = re.compile(r'"([^"\\\n]{1,64})"\s*:\s*("?)$')
# A JSON scalar that is not a string, at the start of a prompt's value: drafted bare.
_BARE_VALUE = re.compile(r"(-?\d|true\b|false\b|null\b)")


class NgramDrafter:
    """Drafts for one request: its own prompt lookup first, then other requests' outputs, then
    its prompt's text.

    Parameters
    ----------
    min_match, max_match: suffix lengths tried, longest first (SGLang's
        ``speculative_ngram_{min,max}_match_window_size``).
    capacity: keys kept in the cross-request `RecentOutputIndex` (0: off).
    num_draft_tokens: the longest draft (``speculative_num_draft_tokens``).
    tokenizer: the model's Hugging Face tokenizer, for `TextLookup` (None: no text lookup).
    """

    def __init__(self, min_match: int, max_match: int, capacity: int, num_draft_tokens: int, tokenizer=None):
        self.min_match = min_match
        self.max_match = max_match
        self.num_draft_tokens = num_draft_tokens
        self.recent = RecentOutputIndex(min_match, max_match, capacity, num_draft_tokens)
        self.tokenizer = tokenizer

    def new_index(self) -> PromptLookupIndex:
        """An empty per-request index (kept on the request, `Req.spec_state`)."""
        return PromptLookupIndex(self.min_match, self.max_match)

    def new_text_lookup(self, prompt_ids: Sequence[int]) -> TextLookup | None:
        """A request's `TextLookup` over its prompt (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        ids = list(prompt_ids[-TEXT_LOOKUP_MAX_PROMPT_TOKENS:])
        try:
            text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except Exception:  # noqa: BLE001 - drafts are optional: a prompt the tokenizer cannot decode drafts without it
            logger.debug("prompt lookup on text off for a prompt the tokenizer cannot decode", exc_info=True)
            return None
        return TextLookup(text)

    def propose(self, index: PromptLookupIndex, tokens: Sequence[int], max_len: int,
                text: TextLookup | None = None) -> tuple[list[int], str | None]:
        """At most ``min(max_len, num_draft_tokens)`` draft tokens to follow ``tokens``, from the
        first source of the module docstring that has some (``text``: the request's source 3),
        and that source's name (None with no draft): ``"value"``, ``"text"``, or
        ``"prompt:n"`` / ``"recent:n"`` for a token n-gram suffix of n tokens matched in the
        request's own tokens / in other requests' outputs. How often a draft is accepted
        follows its source far more than the request (docs/speculative.md, "Acceptance by
        draft source"): on bench_spec's workloads, drafts of a 4-token match were kept at
        85-97 %, of a 2-token match at 16-43 %."""
        limit = min(max_len, self.num_draft_tokens)
        if limit <= 0:
            return [], None
        if text is not None:
            draft = self._from_text(text.propose_value, tokens, limit)
            if draft:
                return draft, "value"
        draft, n = index.propose(tokens, limit)
        if draft:
            return draft, f"prompt:{n}"
        draft, n = self.recent.propose(tokens, limit)
        if draft:
            return draft, f"recent:{n}"
        if text is not None:
            draft = self._from_text(text.propose, tokens, limit)
            if draft:
                return draft, "text"
        return [], None

    def _from_text(self, propose, tokens: Sequence[int], limit: int) -> list[int]:
        """A `TextLookup` source's draft; [] when the tokenizer raises on these tokens."""
        try:
            return propose(self.tokenizer, tokens, limit)
        except Exception:  # noqa: BLE001 - drafts are optional: never fail a step over one
            logger.debug("a lookup on the prompt's text failed; no draft from it this step", exc_info=True)
            return []

    def on_finished(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Remember a finished request's output for the others."""
        self.recent.add(prompt_ids, output_ids)
