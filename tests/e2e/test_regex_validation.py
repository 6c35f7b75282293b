"""Every regex-constrained output the grammar ended is checked with Python's ``re.fullmatch``.

The backends read ``\\W`` as ASCII (``[^a-zA-Z0-9_]``), Python as Unicode, where
``é`` is a word character: pushed towards ``é``, the model writes what the
grammar allows and the regex forbids, and the check turns it into an abort
that counts in ``num_grammar_violations``, not text marked ``stop``.
"""

from __future__ import annotations

import re

E_ACUTE = 2756  # SmolLM2's token for "é"


def violations(engine) -> int:
    return engine.get_server_info()["num_grammar_violations"]


def test_output_breaking_the_regex_is_aborted(engine):
    assert engine.tokenizer.decode([E_ACUTE]) == "é"
    before = violations(engine)
    out = engine.generate("x", {"regex": r"\W{2}", "temperature": 0, "max_new_tokens": 8,
                                "logit_bias": {str(E_ACUTE): 100.0}})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort", out
    assert "does not satisfy the requested regex" in reason["message"] and "not a full match" in reason["message"]
    assert violations(engine) == before + 1


def test_output_matching_the_regex_stops(engine):
    before = violations(engine)
    out = engine.generate("x", {"regex": r"[a-c]{2}", "temperature": 0, "max_new_tokens": 8})
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch(r"[a-c]{2}", out["text"])
    assert violations(engine) == before
