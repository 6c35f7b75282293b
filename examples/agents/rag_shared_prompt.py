"""Retrieval-augmented answers behind one long shared system prompt.

Every question gets the same long system prompt (a ranger's answering policy)
and the three passages of a small local corpus that BM25 ranks highest for it.
The questions run as one `run_batch`: tracing the program finds the text every
item starts with (the system prompt), which is prefilled once before the batch;
every item then starts from a radix-cache hit and computes only its passages
and question. The printed cache hit rate is the batch's cached prompt tokens
over its prompt tokens, from the server's counters. Run:
`python examples/agents/rag_shared_prompt.py`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import arborlm as sgl

CORPUS_PATH = Path(__file__).parent / "data" / "trail_handbook.jsonl"

SYSTEM_PROMPT = """You are the virtual ranger of Cedar Ridge Park. Visitors ask you practical questions before and during their trips, and you answer them from the park handbook.

How to answer:
1. Read the handbook passages given with the question. They are the only source you may use. Each passage starts with its name in square brackets.
2. Answer in one or two short sentences. Give numbers exactly as the passage states them, with their units: distances in kilometres or metres, prices in dollars, times of day as written.
3. Name the passage you used at the end of the answer, in square brackets, for example [permits].
4. If the passages do not contain the answer, say that the handbook does not cover it and suggest asking at the visitor centre. Never guess, and never invent rules, prices or opening hours.
5. Put safety first. When a question touches on weather, wildlife, water or emergencies, include the safety rule from the passage even if the visitor did not ask for it.
6. Be friendly and direct. Do not greet the visitor, do not repeat the question, and do not add advice that is not in the handbook.
7. Rules apply to everyone: do not make exceptions for groups, children, guides or local residents unless a passage says so.

About the park: Cedar Ridge Park covers mountain forest, alpine meadows and the shores of Lake Verna. It has two campgrounds, Pine Hollow and Lake Verna, a visitor centre at the main entrance, and three marked trails: the Lakeshore Loop, the Meadow Trail and the Summit Trail to Cedar Peak. The park is open all year; services are reduced in winter. Visitors include families with small children, experienced mountaineers and people with limited mobility, so say clearly when something is difficult or not accessible."""


def load_corpus(path: Path = CORPUS_PATH) -> list[dict[str, str]]:
    """The passages: one JSON object per line with `id` and `text`."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _words(text: str) -> list[str]:
    """Lower-case words with a crude stemmer ("drones" and "drone", "parking" and "park" meet)."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return [w[:-3] if w.endswith("ing") and len(w) > 5 else w[:-1] if w.endswith("s") and len(w) > 3 else w
            for w in words]


class BM25:
    """Okapi BM25 over whole passages (Robertson and Zaragoza, 2009), with k1=1.5, b=0.75."""

    def __init__(self, passages: list[dict[str, str]], k1: float = 1.5, b: float = 0.75):
        self.passages = passages
        self.docs = [Counter(_words(p["text"])) for p in passages]
        self.lengths = [sum(d.values()) for d in self.docs]
        self.avg_len = sum(self.lengths) / len(self.docs)
        df = Counter(w for d in self.docs for w in d)
        n = len(self.docs)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in df.items()}
        self.k1, self.b = k1, b

    def score(self, query: str, i: int) -> float:
        doc, norm = self.docs[i], self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avg_len)
        return sum(self.idf.get(w, 0.0) * doc[w] * (self.k1 + 1) / (doc[w] + norm) for w in _words(query))

    def top(self, query: str, k: int) -> list[dict[str, str]]:
        ranked = sorted(range(len(self.docs)), key=lambda i: self.score(query, i), reverse=True)
        return [self.passages[i] for i in ranked[:k]]


@sgl.function
def ranger(s, question, passages, answer_tokens):
    s += sgl.system(SYSTEM_PROMPT)
    context = "\n".join(f"[{p['id']}] {p['text']}" for p in passages)
    s += sgl.user(f"Handbook passages:\n{context}\n\nQuestion: {question}")
    s += sgl.assistant(sgl.gen("answer", max_tokens=answer_tokens, stop=["\n"]))


QUESTIONS = [
    "Do I need a permit to camp overnight?",
    "Can I bring my dog on the Summit Trail?",
    "How long does the Lakeshore Loop take?",
    "Is it safe to drink water from the lake?",
    "How much does parking at the Summit trailhead cost?",
    "Can I fly a drone at the campground?",
]


@dataclass
class Answer:
    question: str
    passage_ids: list[str]
    answer: str
    prompt_tokens: int
    cached_tokens: int


@dataclass
class RagRun:
    answers: list[Answer]
    batch_prompt_tokens: int  # the server's counters over the batch, prefix prefill included
    batch_cached_tokens: int

    @property
    def cache_hit_rate(self) -> float:
        return self.batch_cached_tokens / self.batch_prompt_tokens if self.batch_prompt_tokens else 0.0


def main(backend=None, *, model: str | None = None, questions: list[str] | None = None,
         top_k: int = 3, answer_tokens: int = 40) -> RagRun:
    """Answer `questions` from the corpus in one batch; print the answers and the cache hit rate.

    `backend`: an `arborlm.Engine` or DSL backend; None starts an Engine on `model`.
    """
    if backend is None:
        start = time.perf_counter()
        with sgl.Engine(model=model) as engine:
            print(f"engine ready in {time.perf_counter() - start:.1f} s\n")
            return main(engine, questions=questions, top_k=top_k, answer_tokens=answer_tokens)
    questions = QUESTIONS if questions is None else questions
    retriever = BM25(load_corpus())
    batch = [{"question": q, "passages": retriever.top(q, top_k), "answer_tokens": answer_tokens}
             for q in questions]
    before = sgl.get_server_info(backend)
    start = time.perf_counter()
    # Greedy with a mild repetition penalty: a 135M model loops without it.
    states = ranger.run_batch(batch, backend=backend, temperature=0, repetition_penalty=1.1)
    elapsed = time.perf_counter() - start
    after = sgl.get_server_info(backend)
    answers = []
    for item, state in zip(batch, states):
        if state.error() is not None:
            raise state.error()
        meta = state.get_meta_info("answer")
        answers.append(Answer(item["question"], [p["id"] for p in item["passages"]], state["answer"].strip(),
                              meta["prompt_tokens"], meta["cached_tokens"]))
    run = RagRun(answers, after["num_prompt_tokens"] - before["num_prompt_tokens"],
                 after["num_cached_tokens"] - before["num_cached_tokens"])
    for a in answers:
        print(f"Q: {a.question}   (passages: {', '.join(a.passage_ids)})\nA: {a.answer}")
        print(f"   [prompt {a.prompt_tokens} tokens, cached {a.cached_tokens}]\n")
    print(f"{len(answers)} questions in {elapsed:.1f} s; cache hit rate over the batch: {run.cache_hit_rate:.0%} "
          f"({run.batch_cached_tokens} of {run.batch_prompt_tokens} prompt tokens served from the radix cache, "
          f"the shared system prompt computed once)")
    return run


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2-135M-Instruct)")
    main(model=parser.parse_args().model)
