"""Tests of arborlm.runtime.detokenizer on the real SmolLM2 tokenizer."""


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arborlm.runtime.detokenizer import (
    IncrementalDetokenizer,
    RequestDecoder,
    StopStringMatcher,
    find_earliest_stop,
)
from arborlm.runtime.model_loader import default_model_path

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    # `make install` always installs the default model; a missing package fails with install advice.
    gguf = default_model_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def stream(tokenizer, ids, prompt_ids=None, skip_special_tokens=True, chunk=1):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    return deltas, detok


TEXTS = [
    "Hello, world! This is plain ASCII.",
    "Café crème, naïve façade, Ångström, señor.",
    "😀🎉👍🏽 family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇯🇵",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "mixed: αβγ → ∑ ∞ ≠ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and emoji 🧪 at the end 🚀",
    "  leading spaces\n\ttabs\nand newlines\n\n",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_matches_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    deltas, detok = stream(tokenizer, ids, chunk=chunk)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert detok.output_text == text and detok.output_ids == ids


def test_split_characters_are_held_back(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1  # the emoji's bytes are split across tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.step([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step(ids[-1:]) == "😀"


def test_prompt_context(tokenizer):
    prompt = tokenizer.encode("Tell me something in French: ")
    ids = tokenizer.encode("Voilà, c'est très bien 👍")
    deltas, _ = stream(tokenizer, ids, prompt_ids=prompt)
    assert "".join(deltas) == tokenizer.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    ids = tokenizer.encode("<|im_start|>assistant\nSure ✓<|im_end|>")
    deltas, _ = stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(deltas)) is not skip


def test_incomplete_tail_flushed_at_finish(tokenizer):
    ids = tokenizer.encode("ok 😀")[:-1]  # stop in the middle of the emoji's bytes
    deltas, _ = stream(tokenizer, ids)
    assert all(REPLACEMENT not in d for d in deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(ids)


def test_window_stays_short(tokenizer):
    ids = tokenizer.encode("word " * 300)
    detok = IncrementalDetokenizer(tokenizer)
    for i in ids:
        detok.step([i])
        assert len(detok.output_ids) - detok.surr_offset <= 3


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(min_size=0, max_size=40), chunk=st.integers(1, 4))
def test_property_random_unicode(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    deltas, _ = stream(tokenizer, ids, chunk=chunk)
    full = tokenizer.decode(ids)
    assert "".join(deltas) == full
    if REPLACEMENT not in full:
        assert all(REPLACEMENT not in d for d in deltas)


# ---------------------------------------------------------------- stop strings


def feed_all(matcher, pieces):
    out = []
    for piece in pieces:
        check = matcher.feed(piece)
        out.append(check.text)
        if check.finished:
            return out, check.matched
    out.append(matcher.finish())
    return out, None


STOP_CASES = [
    # (pieces, stops, no_stop_trim, expected text, expected match)
    (["Hello", " wor", "ld", "!"], ["world"], False, "Hello ", "world"),
    (["Hello", " wor", "ld", "!"], ["world"], True, "Hello world", "world"),
    (["STOP", "after"], ["STOP"], False, "", "STOP"),
    (["S", "T", "OP", "after"], ["STOP"], False, "", "STOP"),
    (["a b c d"], ["d", "b", "c"], False, "a ", "b"),
    (["one two three"], ["three", "two"], True, "one two", "two"),
    (["xxab", "c"], ["abc", "b"], False, "xxa", "b"),
    (["abcab", "d"], ["abd"], False, "abc", "abd"),
    (["no stop here"], ["zzz"], False, "no stop here", None),
    (["ends with st"], ["stop"], False, "ends with st", None),
    (["anything"], [], False, "anything", None),
]


@pytest.mark.parametrize("pieces, stops, keep, text, matched", STOP_CASES)
def test_stop_string_matcher(pieces, stops, keep, text, matched):
    matcher = StopStringMatcher(stops, no_stop_trim=keep)
    out, got = feed_all(matcher, pieces)
    assert "".join(out) == text == matcher.text
    assert got == matched


def test_held_tail_never_streams_part_of_a_stop():
    matcher = StopStringMatcher(["</answer>"])
    first = matcher.feed("42 </ans")
    assert first.text == "42 " and not first.finished
    second = matcher.feed("wer> trailing")
    assert second.text == "" and second.matched == "</answer>"
    assert matcher.feed("more").text == ""


def test_held_tail_released_when_not_a_stop():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("x </an").text == "x "
    assert matcher.feed("swer").text == ""
    assert matcher.feed("!").text == "</answer!"
    assert matcher.finish() == ""
    assert matcher.text == "x </answer!"


def test_held_tail_released_at_finish():
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("done #").text == "done "
    assert matcher.feed("#").text == ""
    assert matcher.finish() == "##"
    assert matcher.text == "done ##"


def test_find_earliest_stop():
    assert find_earliest_stop("a STOP b END", ["END", "STOP"]).stop == "STOP"
    assert find_earliest_stop("abc", ["bc", "abc"]).start == 0
    assert find_earliest_stop("abc", ["x"]) is None


@pytest.mark.parametrize(
    "text, stops, expected",
    [
        ("The answer is 42.\nObservation: done", ["Observation:"], "The answer is 42.\n"),
        ("世界你好😀再见", ["😀"], "世界你好"),
        ("Stop right at the start", ["Stop"], ""),
        ("café au lait", ["au", "é"], "caf"),
    ],
)
def test_request_decoder_stops_spanning_tokens(tokenizer, text, stops, expected):
    ids = tokenizer.encode(text)
    decoder = RequestDecoder(tokenizer, stops)
    pieces = []
    for i in ids:
        check = decoder.step([i])
        pieces.append(check.text)
        assert not any(stop in "".join(pieces) for stop in stops)
        if check.finished:
            break
    else:
        pieces.append(decoder.finish())
    assert decoder.finished
    assert "".join(pieces) == expected == decoder.text
    assert all(REPLACEMENT not in p for p in pieces)


def test_request_decoder_without_stop_flushes_everything(tokenizer):
    text = "No stop string in this one: ###"
    ids = tokenizer.encode(text)
    decoder = RequestDecoder(tokenizer, ["####"])
    pieces = [decoder.step([i]).text for i in ids] + [decoder.finish()]
    assert not decoder.finished
    assert "".join(pieces) == text == decoder.text


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(alphabet="ab😀é ", max_size=30),
    stop=st.text(alphabet="ab😀é ", min_size=1, max_size=3),
)
def test_property_stop_matches_whole_text_search(tokenizer, text, stop):
    ids = tokenizer.encode(text)
    decoder = RequestDecoder(tokenizer, [stop])
    pieces = []
    for i in ids:
        check = decoder.step([i])
        pieces.append(check.text)
        if check.finished:
            break
    else:
        pieces.append(decoder.finish())
    streamed = "".join(pieces)
    pos = text.find(stop)
    assert streamed == (text if pos < 0 else text[:pos])
    assert decoder.finished == (pos >= 0)
