"""Jump-forward decoding: append the tokens a grammar forces without a decode step.

When every continuation the grammar allows starts with the same text (the
keys and punctuation of a JSON object, say), decoding it token by token is a
waste of forward passes: the scheduler appends its tokens and runs them as one
extend step instead (SGLang, Zheng et al. 2024, "compressed finite state
machine"; xgrammar's ``find_jump_forward_string``).

Token boundaries need care. The forced text must be tokenized the way the
tokenizer would tokenize the whole output, or the model sees a sequence it was
never trained on. So the text is re-tokenized together with the last generated
token: the jump happens only when that token survives unchanged (otherwise the
boundary merges, and the model decodes one more token first); and the last
forced token is left for the model to decode, because it may merge with what
comes after it. Already-streamed tokens are never rolled back.

Bounds: one call asks the matcher once, returns at most ``max_tokens`` tokens
(the request's budget) and tokenizes at most `MAX_CHARS_PER_TOKEN` characters
per token it may return. Grammars whose forced text could be endless are
refused when compiled (`grammar_analysis`), so the matcher's search ends.
"""

from __future__ import annotations

from arborlm.constrained.base import GrammarMatcher

# Output tokens re-tokenized with the forced text to check the boundary.
BOUNDARY_TOKENS = 2
# Forced text tokenized per token the budget allows; longer tokens are rare, and
# a text cut short only jumps fewer tokens (its last token is left to decode).
MAX_CHARS_PER_TOKEN = 16


def jump_forward_tokens(matcher: GrammarMatcher, tokenizer, output_ids: list[int], max_tokens: int) -> list[int]:
    """Tokens to append to ``output_ids`` now, already accepted by ``matcher`` ([] for none).

    Parameters
    ----------
    matcher: the request's matcher, positioned after ``output_ids``.
    tokenizer: the model's Hugging Face tokenizer.
    output_ids: the request's generated tokens (at least one).
    max_tokens: at most this many tokens are returned (the request's budget).
    """
    if max_tokens <= 0 or not output_ids:
        return []
    forced = matcher.find_jump_forward_string()[: (max_tokens + 1) * MAX_CHARS_PER_TOKEN]
    if not forced:
        return []
    tail = output_ids[-BOUNDARY_TOKENS:]
    tail_text = tokenizer.decode(tail, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if "\ufffd" in tail_text:  # the tail ends inside a UTF-8 character: no clean boundary
        return []
    ids = tokenizer.encode(tail_text + forced, add_special_tokens=False)
    if ids[: len(tail)] != tail:
        return []
    new_ids = ids[len(tail) : -1][:max_tokens]
    for accepted, token_id in enumerate(new_ids):
        if not matcher.accept_token(token_id):
            matcher.rollback(accepted)
            return []
    return new_ids
