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

Both indexes are plain dicts from an n-gram (a tuple of token ids) to where it
ended, so a lookup costs a few dict probes per request and step; the per-request
index is extended incrementally as the request's tokens grow.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


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

    def propose(self, tokens: Sequence[int], num_draft_tokens: int) -> list[int]:
        """Up to ``num_draft_tokens`` tokens that followed the longest matching suffix of
        ``tokens`` earlier in ``tokens`` ([] when no suffix of ``min_match`` tokens recurs)."""
        self.update(tokens)
        for n in range(min(self.max_match, len(tokens)), self.min_match - 1, -1):
            end = self.ends.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return list(tokens[end : end + num_draft_tokens])
        return []


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

    def propose(self, tokens: Sequence[int], num_draft_tokens: int) -> list[int]:
        """The continuation of the longest suffix of ``tokens`` in the table ([] when none)."""
        for n in range(min(self.max_match, len(tokens)), self.min_match - 1, -1):
            cont = self._table.get(tuple(tokens[len(tokens) - n :]))
            if cont is not None:
                return list(cont[:num_draft_tokens])
        return []


class NgramDrafter:
    """Drafts for one request: its own prompt lookup first, then other requests' outputs.

    Parameters
    ----------
    min_match, max_match: suffix lengths tried, longest first (SGLang's
        ``speculative_ngram_{min,max}_match_window_size``).
    capacity: keys kept in the cross-request `RecentOutputIndex` (0: off).
    num_draft_tokens: the longest draft (``speculative_num_draft_tokens``).
    """

    def __init__(self, min_match: int, max_match: int, capacity: int, num_draft_tokens: int):
        self.min_match = min_match
        self.max_match = max_match
        self.num_draft_tokens = num_draft_tokens
        self.recent = RecentOutputIndex(min_match, max_match, capacity, num_draft_tokens)

    def new_index(self) -> PromptLookupIndex:
        """An empty per-request index (kept on the request, `Req.spec_state`)."""
        return PromptLookupIndex(self.min_match, self.max_match)

    def propose(self, index: PromptLookupIndex, tokens: Sequence[int], max_len: int) -> list[int]:
        """At most ``min(max_len, num_draft_tokens)`` draft tokens to follow ``tokens``."""
        limit = min(max_len, self.num_draft_tokens)
        if limit <= 0:
            return []
        draft = index.propose(tokens, limit)
        if not draft:
            draft = self.recent.propose(tokens, limit)
        return draft

    def on_finished(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Remember a finished request's output for the others."""
        self.recent.add(prompt_ids, output_ids)
