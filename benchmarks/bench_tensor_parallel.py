"""Tensor parallelism (`--tp-size`): greedy tokens and output throughput of tp_size=1 against tp_size=N.

Two Engines on the same checkpoint (float32 weights, `quantization="none"`, so both run
the same float model), alive at once, answer the same batches in alternation (tp1, tpN,
tp1, ... for `--rounds` rounds), so the machine's drift hits both alike. Per mode:
output tok/s over the rounds (median), and whether every greedy output equals tp_size=1's
token for token. The default model (SmolLM2-135M: 9 query heads, 3 K/V heads) splits over
3 ranks; `--tp-size` must divide its num_attention_heads. On a CPU the ranks share the
cores (each gets cores / tp_size threads), so this measures the cost of the split
(collectives, a process per rank), not a speed-up. Timing runs go under
`flock /tmp/arborlm-timing.lock` on a shared machine.

Example (the table in docs/deploy.md)::

    flock /tmp/arborlm-timing.lock .venv/bin/python benchmarks/bench_tensor_parallel.py --tp-size 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import arborlm

PROMPTS = [
    "Explain what a radix tree is in two sentences.",
    "Write a Python function that reverses a string.",
    "List three prime numbers and say why they are prime.",
    "What does tensor parallelism split across devices?",
]


def run_round(engine, prompts: list[str], max_new_tokens: int) -> tuple[list[list[int]], float]:
    """One batch of greedy requests: every output's token ids and the output tok/s."""
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    ids = [o["output_ids"] for o in outs]
    return ids, sum(len(i) for i in ids) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default SmolLM2-135M-Instruct)")
    parser.add_argument("--tp-size", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch_size)]
    common = {"model": args.model, "dtype": "float32", "quantization": "none", "max_total_tokens": 8192,
              "log_level": "warning"}
    engines = {1: arborlm.Engine(tp_size=1, **common), args.tp_size: arborlm.Engine(tp_size=args.tp_size, **common)}
    try:
        for engine in engines.values():
            run_round(engine, prompts[:1], 4)  # warm-up: first-step allocations, native kernel builds
        tok_s: dict[int, list[float]] = {tp: [] for tp in engines}
        equal = True
        for _ in range(args.rounds):
            reference = None
            for tp, engine in engines.items():
                ids, rate = run_round(engine, prompts, args.max_new_tokens)
                tok_s[tp].append(rate)
                reference = ids if reference is None else reference
                equal = equal and ids == reference
    finally:
        for engine in engines.values():
            engine.shutdown()
    base = statistics.median(tok_s[1])
    print(f"batch {args.batch_size} x {args.max_new_tokens} greedy tokens, float32, {args.rounds} interleaved rounds")
    print("| tp_size | output tok/s (median) | ratio to tp_size=1 | tokens equal to tp_size=1 |")
    print("|---|---|---|---|")
    for tp, rates in tok_s.items():
        median = statistics.median(rates)
        print(f"| {tp} | {median:.1f} | {median / base:.2f} | {'yes' if equal or tp == 1 else 'no'} |")


if __name__ == "__main__":
    main()
