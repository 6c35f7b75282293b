"""Speculative decoding: speculation off vs NGRAM, interleaved A/B in one run.

Two in-process Engines on the same model (``speculative_algorithm=None`` and
``"NGRAM"``) stay loaded side by side; every (workload, batch size) cell runs
``--rounds`` times per engine, alternating which goes first, so the machine's
drift falls on both. Greedy decoding throughout, so the two engines must
produce the same tokens: the table says how many requests did.

Workloads (chat-templated prompts for the default SmolLM2-135M-Instruct):

* ``copy``: repeat a given passage word for word (RAG answers that quote);
* ``json``: extract fields of a given record as JSON under a JSON schema;
* ``code``: rewrite a given function with one variable renamed;
* ``chat``: free-form answers to open questions (little to copy).

Per cell: output tok/s (completion tokens / wall time of the batch), TPOT
p50/p95 ((e2e - ttft) / (tokens - 1) per request), the mean accept length
(tokens emitted per request and verify step) and the ratio on/off of the
medians over rounds. Timing runs take /tmp/arborlm-timing.lock::

    flock /tmp/arborlm-timing.lock .venv/bin/python benchmarks/bench_spec.py \\
        --batch-sizes 1 8 32 --rounds 3 --markdown-out benchmarks/results/spec.md
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import arborlm

SENTENCES = [
    "The radix cache keeps every prompt prefix it has seen, so a second call with the same system prompt starts at once.",
    "Grammar masks remove every token the schema forbids before sampling, which makes the output valid by construction.",
    "Continuous batching lets new requests join the running batch between two decode steps.",
    "A request that runs out of memory is retracted and later resumes from its cached tokens.",
    "The scheduler prefers requests whose prompts share the longest cached prefix.",
    "Chunked prefill splits a long prompt into pieces so decoding requests keep their pace.",
    "Speculative decoding drafts several tokens and checks them all in one forward pass.",
    "The tokenizer manager streams text to clients as soon as the detokenizer emits it.",
]
NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth"]
CITIES = ["London", "Manchester", "New York", "Amsterdam", "Boston", "Stanford"]
QUESTIONS = [
    "What makes a good breakfast?", "Why do cats purr?", "Describe a walk in the forest.",
    "What is your favourite season and why?", "Give advice to a new gardener.", "How do birds find their way?",
]
RECORD_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "year": {"type": "integer"},
                   "summary": {"type": "string"}},
    "required": ["name", "city", "year", "summary"],
}


def workload_prompts(engine, workload: str, n: int, seed: int) -> tuple[list[str], dict[str, Any]]:
    """``n`` chat prompts of ``workload`` and its extra sampling fields."""
    rng = random.Random(seed)
    prompts, extra = [], {}
    for i in range(n):
        if workload == "copy":
            passage = " ".join(rng.sample(SENTENCES, 3))
            content = f"Repeat the following passage word for word.\n\n{passage}"
        elif workload == "json":
            name, city, year = NAMES[i % len(NAMES)], rng.choice(CITIES), rng.randrange(1900, 2000)
            summary = rng.choice(SENTENCES)
            content = (f"Record: name: {name}; city: {city}; year: {year}; summary: {summary}\n"
                       "Give this record as JSON with the keys name, city, year and summary, copying the values.")
            extra = {"json_schema": RECORD_SCHEMA}
        elif workload == "code":
            var = rng.choice(["total", "acc", "result", "value"])
            func = ("def add_all(items):\n    s = 0\n    for item in items:\n        s = s + item\n"
                    "    print('sum so far', s)\n    return s\n")
            content = f"Rewrite this Python function with the variable s renamed to {var}.\n\n```python\n{func}```"
        elif workload == "chat":
            content = QUESTIONS[(i + seed) % len(QUESTIONS)]
        else:
            raise ValueError(f"workload={workload!r} is unknown")
        prompts.append(engine.apply_chat_template([{"role": "user", "content": content}]))
    return prompts, extra


def run_cell(engine, prompts: list[str], params: dict[str, Any]) -> dict[str, Any]:
    """One batch through one engine: throughput, TPOT per request, accept length, output ids."""
    before = engine.get_server_info()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    after = engine.get_server_info()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    tpot = [(o["meta_info"]["e2e_latency"] - o["meta_info"]["ttft"]) / (o["meta_info"]["completion_tokens"] - 1)
            for o in outs if o["meta_info"]["completion_tokens"] > 1 and o["meta_info"]["ttft"] is not None]
    verified = after.get("spec_num_verify_steps", 0) - before.get("spec_num_verify_steps", 0)
    accepted = after.get("spec_num_accepted_tokens", 0) - before.get("spec_num_accepted_tokens", 0)
    spec_reqs = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    return {
        "tok_s": tokens / wall, "wall_s": wall, "tokens": tokens,
        "tpot_p50_ms": 1e3 * statistics.median(tpot) if tpot else 0.0,
        "tpot_p95_ms": 1e3 * sorted(tpot)[max(0, round(0.95 * len(tpot)) - 1)] if tpot else 0.0,
        "accept_len": (spec_reqs + accepted) / spec_reqs if spec_reqs else 1.0,
        "verify_steps": verified,
        "steps": (after["num_decode_steps"] + after["num_extend_steps"]
                  - before["num_decode_steps"] - before["num_extend_steps"]),
        "output_ids": [o["output_ids"] for o in outs],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (float32 keeps greedy identity exact)")
    ap.add_argument("--quantization", default=None, help="gguf | none (default: the model's)")
    ap.add_argument("--workloads", nargs="+", default=["copy", "json", "code", "chat"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--num-draft-tokens", type=int, default=6)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--markdown-out", default=None)
    args = ap.parse_args(argv)

    common = dict(model=args.model, dtype=args.dtype, quantization=args.quantization, log_level="warning",
                  random_seed=0, max_running_requests=64)
    engines = {
        "off": arborlm.Engine(**common),
        "ngram": arborlm.Engine(**common, speculative_algorithm="NGRAM",
                                speculative_num_draft_tokens=args.num_draft_tokens),
    }
    try:
        rows = bench(engines, args)
    finally:
        for e in engines.values():
            e.shutdown()
    table = markdown(rows, args)
    print(table)
    if args.markdown_out:
        Path(args.markdown_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown_out).write_text(table + "\n")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


def bench(engines: dict[str, Any], args) -> list[dict[str, Any]]:
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    warm, _ = workload_prompts(engines["off"], "copy", 2, seed=99)
    for e in engines.values():
        e.generate(warm, {**params, "max_new_tokens": 8})
    rows = []
    for workload in args.workloads:
        for batch in args.batch_sizes:
            prompts, extra = workload_prompts(engines["off"], workload, batch, seed=batch)
            cells: dict[str, list[dict[str, Any]]] = {"off": [], "ngram": []}
            for r in range(args.rounds):
                order = ["off", "ngram"] if r % 2 == 0 else ["ngram", "off"]
                for name in order:
                    engines[name].flush_cache()  # each run prefills its prompts itself
                    cells[name].append(run_cell(engines[name], prompts, {**params, **extra}))
            rows.append(summarise(workload, batch, cells))
            print(json.dumps({k: v for k, v in rows[-1].items()}), flush=True)
    return rows


def summarise(workload: str, batch: int, cells: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def med(name: str, key: str) -> float:
        return statistics.median(c[key] for c in cells[name])

    same = sum(a == b for a, b in zip(cells["off"][0]["output_ids"], cells["ngram"][0]["output_ids"]))
    return {
        "workload": workload, "batch": batch,
        "off_tok_s": med("off", "tok_s"), "ngram_tok_s": med("ngram", "tok_s"),
        "ratio": statistics.median(b["tok_s"] / a["tok_s"] for a, b in zip(cells["off"], cells["ngram"])),
        "off_tpot_p50_ms": med("off", "tpot_p50_ms"), "ngram_tpot_p50_ms": med("ngram", "tpot_p50_ms"),
        "off_tpot_p95_ms": med("off", "tpot_p95_ms"), "ngram_tpot_p95_ms": med("ngram", "tpot_p95_ms"),
        "accept_len": med("ngram", "accept_len"), "identical": f"{same}/{batch}",
        "off_steps": med("off", "steps"), "ngram_steps": med("ngram", "steps"),
    }


def markdown(rows: list[dict[str, Any]], args) -> str:
    head = ("| workload | batch | off tok/s | NGRAM tok/s | NGRAM/off | TPOT p50 off / NGRAM (ms) "
            "| TPOT p95 off / NGRAM (ms) | forward steps off / NGRAM | accept length | greedy identical |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['batch']} | {r['off_tok_s']:.1f} | {r['ngram_tok_s']:.1f} | {r['ratio']:.2f}x "
            f"| {r['off_tpot_p50_ms']:.0f} / {r['ngram_tpot_p50_ms']:.0f} "
            f"| {r['off_tpot_p95_ms']:.0f} / {r['ngram_tpot_p95_ms']:.0f} | {r['off_steps']:.0f} / {r['ngram_steps']:.0f} "
            f"| {r['accept_len']:.2f} | {r['identical']} |")
    lines.append(f"\n{args.rounds} rounds per cell, median ratio of interleaved runs; dtype={args.dtype}, "
                 f"quantization={args.quantization or 'default'}, max_new_tokens={args.max_new_tokens}, "
                 f"speculative_num_draft_tokens={args.num_draft_tokens}.")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
