"""N-gram drafting (prompt lookup, the cross-request index) and greedy acceptance, table-driven."""

from __future__ import annotations

import pytest

from arborlm.runtime.speculative.ngram import NgramDrafter, PromptLookupIndex, RecentOutputIndex
from arborlm.runtime.speculative.scheduling import grammatical_prefix
from arborlm.runtime.speculative.verify import accept_greedy
from tests.runtime.speculative.fake_matchers import HistoryMatcher


@pytest.mark.parametrize("tokens, k, want", [
    ([1, 2, 3, 4, 9, 1, 2, 3], 3, [4, 9, 1]),  # the 3-gram 1 2 3 recurs: what followed it
    ([1, 2, 3, 4, 5, 6, 2, 3], 4, [4, 5, 6, 2]),  # the 2-gram 2 3 (no longer match)
    ([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, [8, 1]),  # the latest earlier occurrence wins
    ([1, 2, 3, 4], 3, []),  # nothing recurs
    ([7, 7, 7, 7], 3, [7]),  # overlapping: only what exists after the match
    ([3], 3, []),
])
def test_prompt_lookup(tokens, k, want):
    assert PromptLookupIndex(2, 3).propose(tokens, k)[0] == want


def test_prompt_lookup_grows_incrementally():
    """Extending the tokens after a lookup gives the same drafts as a fresh index."""
    index = PromptLookupIndex(1, 4)
    tokens = [4, 8, 15, 16, 23, 42]
    for t in [4, 8, 15, 99, 4, 8]:
        tokens.append(t)
        assert index.propose(tokens, 3) == PromptLookupIndex(1, 4).propose(tokens, 3)
    assert index.propose(tokens, 3)[0] == [15, 99, 4]


def test_recent_outputs_are_shared_and_bounded():
    index = RecentOutputIndex(2, 3, capacity=9, continuation_len=4)
    index.add([1, 2], [10, 11, 12, 13, 14])
    assert index.propose([9, 9, 10, 11], 4)[0] == [12, 13, 14]
    assert index.propose([5, 1, 2], 2)[0] == [10, 11]  # keyed by the prompt's tail too
    assert len(index) == 9  # 1 2 | 2 10, 1 2 10 | ... | 12 13, 11 12 13
    index.add([7], [50, 51, 52, 53, 54, 55, 56])  # the oldest keys make room
    assert len(index) == 9
    assert index.propose([10, 11], 4)[0] == []
    assert index.propose([52, 53], 4)[0] == [54, 55, 56]


def test_drafter_prefers_the_requests_own_tokens():
    drafter = NgramDrafter(2, 3, capacity=100, num_draft_tokens=3)
    drafter.on_finished([0], [1, 2, 60, 61, 62])
    own = drafter.new_index()
    assert drafter.propose(own, [1, 2, 30, 31, 1, 2], max_len=10)[0] == [30, 31, 1]
    assert drafter.propose(drafter.new_index(), [9, 1, 2], max_len=2)[0] == [60, 61]
    assert drafter.propose(drafter.new_index(), [9, 1, 2], max_len=0)[0] == []


def test_drafts_name_their_source():
    """`propose` says where each draft came from, with the suffix length matched: the
    switch keeps an acceptance estimate per source (`Speculator.sources`)."""
    drafter = NgramDrafter(2, 4, capacity=100, num_draft_tokens=3)
    drafter.on_finished([0], [1, 2, 60, 61, 62])
    tokens = [5, 6, 7, 8, 40, 5, 6, 7, 8]
    assert drafter.propose(drafter.new_index(), tokens, 10) == ([40, 5, 6], "prompt:4")
    assert drafter.propose(drafter.new_index(), [9, 6, 7, 8, 41, 3, 7, 8], 10) == ([41, 3, 7], "prompt:2")
    assert drafter.propose(drafter.new_index(), [9, 1, 2], 10) == ([60, 61, 62], "recent:2")
    assert drafter.propose(drafter.new_index(), [9, 3], 10) == ([], None)
    assert drafter.propose(drafter.new_index(), tokens, 0) == ([], None)


@pytest.mark.parametrize("draft, targets, first_invalid, want", [
    ([], [5], None, 1),
    ([5, 6, 7], [5, 6, 7, 8], None, 4),  # all accepted + the bonus token
    ([5, 6, 7], [5, 9, 7, 8], None, 2),  # 5 accepted, then the target's 9
    ([5, 6, 7], [4, 6, 7, 8], None, 1),
    ([5, 6, 7], [5, 6, 7, 8], 2, 2),  # a non-finite row stops emission before it
    ([5, 6, 7], [5, 6, 7, 8], 0, 1),
])
def test_accept_greedy(draft, targets, first_invalid, want):
    assert accept_greedy(draft, targets, first_invalid) == want


class CountingMatcher:
    """A grammar over digits 0..9 ending with token 2 (EOS); records its history."""

    def __init__(self):
        self.history: list[int] = []
        self.ended = False

    def accept_token(self, t: int) -> bool:
        if self.ended or not (t == 2 or 10 <= t < 20):
            return False
        self.history.append(t)
        self.ended = t == 2
        return True

    def rollback(self, n: int) -> None:
        for _ in range(n):
            self.ended = False
            self.history.pop()

    def is_terminated(self) -> bool:
        return self.ended


@pytest.mark.parametrize("draft, want", [
    ([11, 12, 13], [11, 12, 13]),
    ([11, 99, 13], [11]),  # a rejected token ends the draft
    ([11, 2, 13], [11]),  # a token that ends the grammar is left to the target
    ([99], []),
])
def test_grammatical_prefix_leaves_the_matcher_as_it_was(draft, want):
    matcher = CountingMatcher()
    matcher.accept_token(10)
    assert grammatical_prefix(matcher, draft) == want
    assert matcher.history == [10] and not matcher.ended


def copy_trace(prompt: list[int], answer: list[int], min_match: int, max_match: int, k: int) -> list[int]:
    """The draft length of each verify step of a perfect (greedy, script-following) target
    answering ``answer`` to ``prompt`` with prompt lookup alone (the per-step trace bench_spec's
    batch-1 copy cell was diagnosed with on SmolLM2, see docs/speculative.md)."""
    drafter = NgramDrafter(min_match, max_match, capacity=0, num_draft_tokens=k)
    index = drafter.new_index()
    out = [answer[0]]  # the prefill's token
    trace = []
    while len(out) < len(answer):
        draft, _ = drafter.propose(index, prompt + out, len(answer) - len(out) - 1)
        n = accept_greedy(draft, answer[len(out): len(out) + len(draft) + 1])
        trace.append(len(draft))
        out += answer[len(out): len(out) + n]
    return trace


PASSAGE = list(range(100, 140))  # 40 tokens, no n-gram repeated


@pytest.mark.parametrize("preamble, min_match, max_match, k, want", [
    # A word-for-word copy drafts at every step once min_match tokens of it are out (the
    # first comes from the prefill): min_match - 1 undrafted steps, then full drafts; the
    # last draft is cut to the tokens left.
    ([], 2, 4, 6, [0, 6, 6, 6, 6, 6, 2]),
    ([], 1, 1, 6, [6, 6, 6, 6, 6, 3]),
    ([], 3, 4, 6, [0, 0, 6, 6, 6, 6, 6, 1]),
    # "Sure: " before the copy: no draft until min_match tokens of the copy are out.
    ([7, 8], 2, 4, 6, [0, 0, 0, 6, 6, 6, 6, 6, 2]),
])
def test_a_copy_drafts_at_every_step(preamble, min_match, max_match, k, want):
    """No undrafted step inside a copy: each step's draft is the rest of the passage."""
    prompt = [1, 2, 3] + PASSAGE + [4, 5]
    assert copy_trace(prompt, preamble + PASSAGE, min_match, max_match, k) == want


# ---- prompt lookup on text ---------------------------------------------------

RECORD_PROMPT = "Record: name: Alan Turing; city: London; year: 1912\nGive it as JSON."


def test_text_lookup_drafts_a_value_the_token_ngrams_miss(tiny_tokenizer):
    """A value copied into JSON after a quote tokenizes unlike the prompt's: no token n-gram
    recurs, the text does, and the draft is the rest of the value as tokens."""
    tok = tiny_tokenizer
    prompt = tok.encode(RECORD_PROMPT, add_special_tokens=False)
    output = tok.encode('{"name": "Alan', add_special_tokens=False)
    tokens = prompt + output
    drafter = NgramDrafter(2, 4, 0, 6, tok)
    assert drafter.propose(drafter.new_index(), tokens, 6)[0] == []  # token n-grams alone
    draft, source = drafter.propose(drafter.new_index(), tokens, 6, drafter.new_text_lookup(prompt))
    assert source == "text"
    assert draft, "the text ' Turing; city: ...' follows 'Alan' in the prompt"
    assert tok.decode(draft).startswith(" Turing;")
    assert len(draft) <= 6


def test_text_lookup_without_a_match_or_a_tokenizer_drafts_nothing(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = tok.encode(RECORD_PROMPT, add_special_tokens=False)
    tokens = prompt + tok.encode('{"name": "Zq', add_special_tokens=False)
    drafter = NgramDrafter(2, 4, 0, 6, tok)
    assert drafter.propose(drafter.new_index(), tokens, 6, drafter.new_text_lookup(prompt))[0] == []
    assert NgramDrafter(2, 4, 0, 6).new_text_lookup(prompt) is None


def test_text_lookup_tokenizes_across_the_boundary(tiny_tokenizer):
    """The draft is what the tokenizer makes of the tail's text and the continuation together,
    so greedy acceptance compares it with the tokens the model would write."""
    tok = tiny_tokenizer
    prompt = tok.encode("The summary: The radix cache keeps every prefix.", add_special_tokens=False)
    output = tok.encode('{"summary": "The radix', add_special_tokens=False)
    lookup = NgramDrafter(2, 4, 0, 4, tok).new_text_lookup(prompt)
    whole = tok.encode('{"summary": "The radix cache keeps every prefix.', add_special_tokens=False)
    assert whole[: len(output)] == output
    assert lookup.propose(tok, prompt + output, 4) == whole[len(output) : len(output) + 4]
    # A continuation cut mid-text loses its last token (it may be the start of a longer one).
    lookup.chars_per_token = 3  # 12 characters: " cache keeps"
    assert lookup.propose(tok, prompt + output, 4) == whole[len(output) : len(output) + 1]


def test_text_lookup_is_for_constrained_requests_only(tiny_tokenizer):
    """Free text drafts from token n-grams alone (its own text lookups cost more than they won)."""
    from types import SimpleNamespace

    from arborlm.runtime.config import SpeculativeConfig
    from arborlm.runtime.speculative.scheduling import Speculator

    spec = Speculator(SpeculativeConfig(speculative_algorithm="NGRAM"), 1024, tokenizer=tiny_tokenizer)
    prompt = tiny_tokenizer.encode(RECORD_PROMPT, add_special_tokens=False)
    free = SimpleNamespace(spec_state=None, grammar=None, origin_input_ids=prompt)
    constrained = SimpleNamespace(spec_state=None, grammar=object(), origin_input_ids=prompt)
    assert spec._state(free).text is None
    assert spec._state(constrained).text.prompt_text == tiny_tokenizer.decode(prompt)


def test_a_tokenizer_failure_drafts_nothing_instead_of_failing_the_step(tiny_tokenizer):
    """Drafts are optional: a tokenizer that raises on some ids costs the request its text
    drafts, never the step (which would abort every request in it)."""

    class Failing:
        def decode(self, *args, **kwargs):
            raise OverflowError("number too small to fit in target type")

        def encode(self, *args, **kwargs):
            raise AssertionError("not reached")

    prompt = tiny_tokenizer.encode(RECORD_PROMPT, add_special_tokens=False)
    drafter = NgramDrafter(2, 4, 0, 6, Failing())
    assert drafter.new_text_lookup(prompt) is None
    lookup = NgramDrafter(2, 4, 0, 6, tiny_tokenizer).new_text_lookup(prompt)
    tokens = prompt + tiny_tokenizer.encode('{"name": "Alan', add_special_tokens=False)
    assert drafter.propose(drafter.new_index(), tokens, 6, lookup)[0] == []


def _value_draft(tok, output: str, num: int = 6, prompt: str = RECORD_PROMPT) -> str:
    ids = tok.encode(prompt, add_special_tokens=False)
    drafter = NgramDrafter(2, 4, 0, num, tok)
    draft, _ = drafter.propose(drafter.new_index(), ids + tok.encode(output, add_special_tokens=False), num,
                            drafter.new_text_lookup(ids))
    assert len(draft) <= num
    return tok.decode(draft)


def test_a_value_after_a_json_key_drafts_from_the_prompts_label(tiny_tokenizer):
    """At a value's start the draft is what follows the key's label in the prompt: a string
    after ' "', a number bare; the key may be in any case and the label use '=' too."""
    tok = tiny_tokenizer
    assert _value_draft(tok, '{"name":').startswith(' "Alan Turing')
    ids = tok.encode(RECORD_PROMPT + '{"name":', add_special_tokens=False)
    drafter = NgramDrafter(2, 4, 0, 6, tok)
    lookup = drafter.new_text_lookup(tok.encode(RECORD_PROMPT, add_special_tokens=False))
    assert drafter.propose(drafter.new_index(), ids, 6, lookup)[1] == "value"
    assert _value_draft(tok, '{"name": "Alan Turing", "city":').startswith(' "London')
    assert _value_draft(tok, '{"name": "A", "city": "London", "year":').startswith(" 1912")
    assert _value_draft(tok, '{"Name":').startswith(' "Alan')
    assert _value_draft(tok, '{"year":', prompt="Book: title = Emma, year = 1815\nAs JSON.").startswith(" 1815")
    # Whitespace the output already wrote (its own token) is not drafted again.
    assert tok.decode(tok.encode('{"year": ', add_special_tokens=False)[-1:]) == " "
    assert _value_draft(tok, '{"name": "A", "year": ') == "1912"
    # Where the value's first token would merge with the whitespace token, nothing is drafted.
    assert _value_draft(tok, '{"name": ') == ""


def test_a_value_lookup_without_a_label_or_a_key_falls_through(tiny_tokenizer):
    """No label for the key in the prompt, or output that does not end with a key: the other
    sources draft as before (here the text suffix), and a label's value is never invented."""
    tok = tiny_tokenizer
    assert not _value_draft(tok, '{"country":').strip().startswith('"')  # no "country:" in the prompt
    assert _value_draft(tok, '{"name": "Alan').startswith(" Turing")  # the text suffix, as before
    assert _value_draft(tok, "{", prompt="Record: name:\nGive it as JSON.") == ""


def test_a_value_lookup_that_raises_drafts_from_the_other_sources(tiny_tokenizer, monkeypatch):
    from arborlm.runtime.speculative.ngram import TextLookup

    def failing(*args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "bad")

    monkeypatch.setattr(TextLookup, "propose_value", failing)
    assert _value_draft(tiny_tokenizer, '{"name": "Alan').startswith(" Turing")


class SetMatcher(HistoryMatcher):
    """A matcher that accepts one of the tokens of ``allowed`` now; ``ending`` ones end the grammar."""

    def __init__(self, allowed: set[int], ending: frozenset[int] = frozenset()):
        super().__init__()
        self.allowed, self.ending = allowed, ending

    def allows(self, t: int) -> bool:
        return not self.history and t in self.allowed

    def ends(self, t: int) -> bool:
        return t in self.ending


@pytest.mark.parametrize("allowed, ending, want", [
    ({1, 50, 51}, frozenset(), [1]),  # only '}' of the candidates (and whitespace 50, 51)
    ({1, 3}, frozenset(), []),  # '}' or ',': the model decides
    ({1, 2, 3, 4, 50}, frozenset(), []),  # inside a string: every candidate is content
    ({4}, frozenset({4}), []),  # a token that ends the grammar is left to the target
    ({4, 2}, frozenset({4}), [2]),
    (set(), frozenset(), []),
])
def test_structural_draft_is_the_one_structural_token_the_grammar_takes(allowed, ending, want):
    from arborlm.runtime.speculative.scheduling import structural_draft

    matcher = SetMatcher(allowed, ending)
    assert structural_draft(matcher, [1, 2, 3, 4]) == want
    assert matcher.history == []


def test_a_constrained_request_without_other_drafts_gets_the_structural_one(tiny_tokenizer):
    """Speculator._draft: nothing from the n-grams or the text, a grammar that takes only '}'
    of JSON's structural tokens: the draft is '}' (a request without a grammar gets none)."""
    from types import SimpleNamespace

    from arborlm.runtime.config import SpeculativeConfig
    from arborlm.runtime.speculative.scheduling import Speculator

    spec = Speculator(SpeculativeConfig(speculative_algorithm="NGRAM"), 1024, tokenizer=tiny_tokenizer)
    brace = tiny_tokenizer.encode("}", add_special_tokens=False)
    assert len(brace) == 1 and brace[0] in spec._structural_ids()
    prompt = tiny_tokenizer.encode("Say nothing.", add_special_tokens=False)

    def req(grammar):
        return SimpleNamespace(spec_state=None, grammar=grammar, origin_input_ids=prompt, fill_ids=prompt + [7],
                               to_abort=False, remaining_new_tokens=10, seqlen=len(prompt) + 1,
                               sampling_params=SimpleNamespace(is_greedy=True))

    constrained = req(SetMatcher({brace[0]}))
    assert spec._draft(constrained, 8) == brace
    assert spec._draft(req(None), 8) == []


def test_a_string_value_the_output_opened_drafts_from_its_label(tiny_tokenizer):
    """`"city": "` (the quote written by the model, not drafted) drafts the label's value
    without a second quote; a closed value drafts nothing from its label."""
    tok = tiny_tokenizer
    assert _value_draft(tok, '{"name": "').startswith("Alan Turing")
    assert _value_draft(tok, '{"name": "Alan Turing", "city": "').startswith("London")
    assert not _value_draft(tok, '{"name": "Alan Turing"').startswith(("Alan", " \"Alan"))
