"""Speculative decoding: draft several tokens per request, verify them in one step.

`ngram` proposes drafts (prompt lookup over the request's own tokens, then
what other requests generated after the same tokens); `scheduling` is the
scheduler's side (who drafts, the verify batch, the KV of rejected tokens,
the adaptive off-switch, statistics); `verify` is the model worker's (target
tokens under the same masks and penalties, greedy acceptance). Greedy output
is token-identical to speculation off. See docs/speculative.md.
"""
