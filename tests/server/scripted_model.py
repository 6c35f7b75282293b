"""A tiny Llama checkpoint whose greedy next token is scripted: after token A comes token B.

The model's only layer adds nothing (`o_proj` and `down_proj` are zero), so the hidden state at
each position is the current token's embedding and the logits depend on that token alone. Each
scripted token gets its own axis of the embedding and the head row of its successor points along
it, so `transitions` ({"Ċ": "<tool_call>", ...}, token strings) decide greedy decoding wherever the
grammar allows the successor; elsewhere the small random rest decides. A real model run through
the real server: the way to make a tiny model think, call a tool in `auto`, or stop.
"""

from __future__ import annotations

from pathlib import Path

import torch

SCRIPT_SCALE = 30.0  # logit of a scripted successor (random logits stay well below 1)
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # Qwen's added, non-special tokens


def scripted_tokenizer(base_dir: Path):
    """SmolLM2's tokenizer with Qwen's think and tool-call tokens added (one token each, as in Qwen)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    tokenizer.add_tokens(ADDED_TOKENS)
    return tokenizer


def write_scripted_model(folder: Path, base_dir: Path, transitions: dict[str, str], seed: int = 0) -> Path:
    """Save the scripted checkpoint (and its tokenizer) to `folder`; returns it.

    Raises
    ------
    ValueError: a token string that is not one token, or more scripted tokens than axes.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = scripted_tokenizer(base_dir)
    ids = {t: _token_id(tokenizer, t) for pair in transitions.items() for t in pair}
    hidden = 64
    sources = list(transitions)
    if len(sources) > hidden // 2:
        raise ValueError(f"at most {hidden // 2} scripted tokens, got {len(sources)}")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        axes = len(sources)
        embed[:, :axes] = 0.0  # unscripted tokens live in the other axes
        head.normal_(0.0, 0.02)
        for axis, source in enumerate(sources):
            embed[ids[source]] = 0.0
            embed[ids[source], axis] = 1.0
            head[ids[transitions[source]], axis] = SCRIPT_SCALE / (hidden ** 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _token_id(tokenizer, token: str) -> int:
    if token == tokenizer.eos_token:
        return tokenizer.eos_token_id
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{token!r} is {len(ids)} tokens: {tokenizer.convert_ids_to_tokens(ids)}")
    return ids[0]


def token_pieces(tokenizer, text: str) -> list[str]:
    """`text` as the token strings the transitions are written with (each piece decodes to its text)."""
    return [tokenizer.decode([i]) for i in tokenizer.encode(text, add_special_tokens=False)]


def chain(*pieces: str) -> dict[str, str]:
    """Transitions that make the model write `pieces` one after the other."""
    return dict(zip(pieces, pieces[1:], strict=False))
