"""Tree of thought: fork into candidate thoughts, score them with `select`, expand the best.

At each level the program forks `num_branches` copies of its state. Every
branch samples one candidate next step (its own seed), and all branches start
from the parent's cached text: `fork` prefills it once, so each branch computes
only its own tokens. `join` gathers the candidates back on the parent, which
lists them and asks which is most promising with `select`: every candidate
number is scored by its log probability in one request, and those scores are
in the select's meta info. The parent then expands the winner, and the next
level branches from there. Run: `python examples/agents/tree_of_thought.py`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import arborlm as sgl

SYSTEM_PROMPT = (
    "You are a practical planner. You solve problems one step at a time. Each step you "
    "propose is a single concrete sentence, and when asked to expand a step you explain "
    "in two short sentences how to carry it out."
)


@sgl.function
def tree_of_thought(s, problem, num_branches, depth, thought_tokens=24, expansion_tokens=32):
    s += sgl.system(SYSTEM_PROMPT)
    s += sgl.user(f"Problem: {problem}\nPropose the next step of the plan in one sentence.")
    for level in range(depth):
        forks = s.fork(num_branches)
        # Each branch samples its own candidate (seeded, so runs repeat).
        forks += lambda i, level=level: sgl.assistant(sgl.gen(
            f"thought_{level}", max_tokens=thought_tokens, stop=["\n"], temperature=0.8, top_p=0.95,
            seed=1000 * level + i))
        forks.join()  # s[f"thought_{level}"] is now the list of candidates
        candidates = "\n".join(f"{i + 1}. {t.strip()}" for i, t in enumerate(s[f"thought_{level}"]))
        s += sgl.user(f"Candidate next steps:\n{candidates}\nWhich candidate is the most useful next step?")
        s += sgl.assistant("The most useful is candidate " + sgl.select(
            f"best_{level}", choices=[str(i + 1) for i in range(num_branches)]))
        s += sgl.user("Expand that step: how exactly do we carry it out?")
        s += sgl.assistant(sgl.gen(f"expansion_{level}", max_tokens=expansion_tokens, stop=["\n\n"]))
        if level + 1 < depth:
            s += sgl.user("Propose the next step of the plan in one sentence.")


@dataclass
class Level:
    candidates: list[str]
    scores: list[float]  # select's normalized_prompt_logprobs, one per candidate
    best: int  # index into candidates
    expansion: str
    branch_cached_tokens: list[int]  # each branch's cached prompt tokens (the parent's text)


PROBLEM = "Plan a science fair project for a ten-year-old, with a budget of 20 dollars and one weekend."


def main(backend=None, *, model: str | None = None, problem: str = PROBLEM, num_branches: int = 3,
         depth: int = 1, thought_tokens: int = 24, expansion_tokens: int = 32) -> list[Level]:
    """Grow the tree `depth` levels deep; print and return every level's candidates, scores and expansion.

    `backend`: an `arborlm.Engine` or DSL backend; None starts an Engine on `model`.
    """
    if backend is None:
        start = time.perf_counter()
        with sgl.Engine(model=model) as engine:
            print(f"engine ready in {time.perf_counter() - start:.1f} s\n")
            return main(engine, problem=problem, num_branches=num_branches, depth=depth,
                        thought_tokens=thought_tokens, expansion_tokens=expansion_tokens)
    start = time.perf_counter()
    # The selects and expansions are greedy with a mild repetition penalty (a 135M model loops
    # without it); the branches override the temperature to sample different candidates.
    state = tree_of_thought.run(problem=problem, num_branches=num_branches, depth=depth,
                                thought_tokens=thought_tokens, expansion_tokens=expansion_tokens, backend=backend,
                                temperature=0, repetition_penalty=1.1)
    print(f"Problem: {problem}\n")
    levels = []
    for level in range(depth):
        select_meta = state.get_meta_info(f"best_{level}")
        candidates = [t.strip() for t in state[f"thought_{level}"]]
        best = int(state[f"best_{level}"]) - 1
        branch_metas = state.get_meta_info(f"thought_{level}")
        levels.append(Level(candidates, list(select_meta["normalized_prompt_logprobs"]), best,
                            state[f"expansion_{level}"].strip(), [m["cached_tokens"] for m in branch_metas]))
    for level, lv in enumerate(levels):
        print(f"=== level {level + 1}: {len(lv.candidates)} branches")
        for i, (text, score, meta_cached) in enumerate(zip(lv.candidates, lv.scores, lv.branch_cached_tokens)):
            mark = "*" if i == lv.best else " "
            print(f" {mark} {i + 1}. [score {score:.3f}, cached {meta_cached} tokens] {text}")
        print(f"--- expanding candidate {lv.best + 1}: {lv.expansion}\n")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return levels


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--branches", type=int, default=3)
    parser.add_argument("--depth", type=int, default=1)
    args = parser.parse_args()
    main(model=args.model, num_branches=args.branches, depth=args.depth)
