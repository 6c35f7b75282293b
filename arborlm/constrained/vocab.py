"""Which token ids a grammar may ever allow as text.

A grammar backend matches tokens by the text they stand for. A special token
(``<|endoftext|>``, ``<|im_start|>``, ``<repo_name>``) also has a text, and
``<|endoftext|>`` is valid inside a JSON string; but the detokenizer drops it
(``skip_special_tokens``), and it is a control symbol, not content. So the
backends never allow a special token as text: only the EOS ids, and only
where the grammar may end (each backend's ``eos_token_ids``). Both backends
build their vocabulary through `special_token_ids`, so they agree on which
ids those are.

Torch-free; read by `xgrammar_backend` and `outlines_backend` when they are built.
"""

from __future__ import annotations


def special_token_ids(tokenizer, vocab_size: int) -> frozenset[int]:
    """The ids below ``vocab_size`` of the tokenizer's special tokens.

    Parameters
    ----------
    tokenizer:
        A Hugging Face tokenizer.
    vocab_size:
        Rows of the model's logits; larger ids are left out.

    Returns
    -------
    frozenset[int]
        ``tokenizer.all_special_ids`` (BOS, EOS, PAD, UNK and the additional
        special tokens) and every added token marked ``special`` (chat and
        tool-call markers that are not in ``all_special_ids``). Added tokens
        that are not special (``special=False``) are ordinary text.
    """
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(token_id)
    return frozenset(i for i in ids if 0 <= i < vocab_size)
