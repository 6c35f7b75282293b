"""A multi-turn chat whose every turn reuses the KV cache of the turns before it.

Like a client of a stateless chat API, each turn is a separate program run that
resends the whole history (system prompt, earlier questions and replies). The
radix cache still holds the KV of that history from the earlier runs, so each
turn computes only its new user message: the printed `cached` count of turn k
covers the whole prompt of turn k-1. Run: `python examples/agents/multi_turn_chat.py`
(add `--interactive` to type the user turns yourself).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import arborlm as sgl

SYSTEM_PROMPT = (
    "You are a friendly travel assistant. You answer in English, in one or two short sentences, "
    "you remember what the traveller told you earlier in the conversation, and you "
    "never make up prices."
)

USER_TURNS = [
    "Hi! I am planning a three-day trip to Edinburgh in May.",
    "What should I see on the first day?",
    "And where could I go on a day trip from the city?",
    "Thanks. Remind me: how long is my trip?",
]


@sgl.function
def chat_turn(s, history, message, reply_tokens):
    """One turn: the history as chat messages, the new user message, the reply."""
    s += sgl.system(SYSTEM_PROMPT)
    for question, reply in history:
        s += sgl.user(question)
        s += sgl.assistant(reply)
    s += sgl.user(message)
    s += sgl.assistant(sgl.gen("reply", max_tokens=reply_tokens, stop=["\n\n"]))


@dataclass
class Turn:
    message: str
    reply: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def main(backend=None, *, model: str | None = None, user_turns: list[str] | None = None,
         interactive: bool = False, reply_tokens: int = 32) -> list[Turn]:
    """Chat through `user_turns` (or stdin); print and return every turn's reply and token counts.

    `backend`: an `arborlm.Engine` or DSL backend; None starts an Engine on `model`.
    """
    if backend is None:
        start = time.perf_counter()
        with sgl.Engine(model=model) as engine:
            print(f"engine ready in {time.perf_counter() - start:.1f} s\n")
            return main(engine, user_turns=user_turns, interactive=interactive, reply_tokens=reply_tokens)
    turns: list[Turn] = []
    for message in _messages(USER_TURNS if user_turns is None else user_turns, interactive):
        history = [(t.message, t.reply) for t in turns]
        # Greedy with mild penalties: a 135M model loops within a reply without the frequency
        # penalty (over the reply's tokens) and repeats its earlier replies without the
        # repetition penalty (over the prompt's tokens too); a stronger one drives it off topic.
        state = chat_turn.run(history=history, message=message, reply_tokens=reply_tokens, backend=backend,
                              temperature=0, repetition_penalty=1.1, frequency_penalty=0.3)
        meta = state.get_meta_info("reply")
        turn = Turn(message, state["reply"].strip(), meta["prompt_tokens"], meta["cached_tokens"],
                    meta["completion_tokens"])
        turns.append(turn)
        print(f"user: {message}\nassistant: {turn.reply}")
        print(f"  [turn {len(turns)}: prompt {turn.prompt_tokens} tokens, cached {turn.cached_tokens}, "
              f"computed {turn.prompt_tokens - turn.cached_tokens}, generated {turn.completion_tokens}, "
              f"{meta['e2e_latency']:.1f} s]\n")
    return turns


def _messages(scripted: list[str], interactive: bool):
    if not interactive:
        yield from scripted
        return
    while (line := input("you> ").strip()) not in ("", "quit", "exit"):
        yield line


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--interactive", action="store_true", help="type the user turns (empty line ends)")
    args = parser.parse_args()
    main(model=args.model, interactive=args.interactive)
