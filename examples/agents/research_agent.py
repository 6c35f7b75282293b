"""A multi-step agent on SmolLM2-135M-Instruct: plan, research, answer, critique.

Every call sends the whole conversation so far; the radix cache serves the
shared system prompt and the earlier turns from KV computed by the earlier
calls, so each later call computes only its new tokens. Run: `make demo`.
"""

from __future__ import annotations

import argparse
import time

import arborlm as sgl

SYSTEM_PROMPT = (
    "You are a careful research assistant working for an engineering team. "
    "You think step by step, you keep every answer short and factual, and you "
    "never invent sources. When asked for a plan you give at most three numbered "
    "steps. When asked for facts you give at most three bullet points. When asked "
    "for a final answer you write two sentences. When asked to critique you name "
    "one weakness and one fix."
)


@sgl.function
def research_agent(s, question):
    s += sgl.system(SYSTEM_PROMPT)
    s += sgl.user(f"Question: {question}\nFirst, write a short plan.")
    s += sgl.assistant(sgl.gen("plan", max_tokens=64))
    s += sgl.user("Now list the key facts you need, following your plan.")
    s += sgl.assistant(sgl.gen("facts", max_tokens=64))
    s += sgl.user("Write the final answer in two sentences.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=64))
    s += sgl.user("Critique your answer: one weakness and one fix.")
    s += sgl.assistant(sgl.gen("critique", max_tokens=48))


QUESTIONS = [
    "Why does sharing a KV cache between requests speed up an LLM server?",
    "What makes a JSON output valid against a schema?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    start = time.perf_counter()
    with sgl.Engine(model=args.model) as engine:
        print(f"engine ready in {time.perf_counter() - start:.1f} s ({engine.model_info.dtype}, "
              f"KV pool {engine.model_info.max_total_tokens} tokens)\n")
        sgl.set_default_backend(engine)
        for question in QUESTIONS:
            print(f"=== {question}")
            # Greedy with a mild repetition penalty: a 135M model loops without it.
            state = research_agent.run(question=question, temperature=0, repetition_penalty=1.2)
            for name in ("plan", "facts", "answer", "critique"):
                meta = state.get_meta_info(name)
                print(f"--- {name}: prompt {meta['prompt_tokens']} tokens, cached {meta['cached_tokens']}, "
                      f"generated {meta['completion_tokens']}, {meta['e2e_latency']:.2f} s")
                print(state[name].strip())
            print()
        info = engine.get_server_info()
        print(f"cache hit rate over the run: {info['cache_hit_rate']:.0%} "
              f"({info['num_cached_tokens']} of {info['num_prompt_tokens']} prompt tokens served from the radix cache)")


if __name__ == "__main__":
    main()
