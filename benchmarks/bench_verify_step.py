"""One speculative verify step's forward: decode rows (TARGET_VERIFY) against extend chains.

The model forward of a verify step in its two layouts (`arborlm/runtime/speculative/
verify_batch.py`), beside a plain decode step of the same requests, interleaved round by
round so the machine's drift falls on all three: per batch size B, B requests with
`--prompt-len`-token prompts (prefilled once), each verifying a chain of 1 +
`--draft-len` tokens into the same slots every round. Reported: the medians in ms, rows /
chains and rows / decode (what a verify step costs against the decode step it replaces
when every draft is rejected). Model as served by default (SmolLM2-135M-Instruct, bf16,
its GGUF weights as stored) unless `--quantization none` (bf16 dequantized weights).
Results: docs/speculative.md.

    flock /tmp/arborlm-timing.lock .venv/bin/python benchmarks/bench_verify_step.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from arborlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from arborlm.runtime.forward_batch_info import ForwardBatch, ForwardMode
from arborlm.runtime.model_loader import (
    load_model,
    resolve_checkpoint,
    resolve_dtype,
    resolve_quantization,
)
from arborlm.runtime.speculative.verify_batch import verify_rows

CPU = torch.device("cpu")


def setup(model, config, dtype, batch: int, prompt_len: int, draft_len: int, seed: int):
    """Pools with ``batch`` prefilled prompts; the chain step (EXTEND), its rows and a decode step."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    slots = batch * (prompt_len + draft_len + 2) + 8
    req_to_token = ReqToTokenPool(batch, prompt_len + draft_len + 4)
    pool = TokenToKVPool(slots, config.num_hidden_layers, config.num_key_value_heads, head_dim, dtype)
    allocator = TokenToKVPoolAllocator(slots)
    gen = torch.Generator().manual_seed(seed)
    rows = req_to_token.alloc(batch)
    prompts = torch.randint(100, 20000, (batch, prompt_len), generator=gen)
    loc = allocator.alloc(batch * prompt_len)
    for i, r in enumerate(rows):
        req_to_token.req_to_token[r, :prompt_len] = loc[i * prompt_len:(i + 1) * prompt_len].to(torch.int32)
    model.forward(ForwardBatch.build(ForwardMode.EXTEND, prompts.reshape(-1).tolist(), rows, [0] * batch,
                                     [prompt_len] * batch, loc, req_to_token, pool))
    n = 1 + draft_len
    chain_loc = allocator.alloc(batch * n)
    for i, r in enumerate(rows):
        req_to_token.req_to_token[r, prompt_len:prompt_len + n] = chain_loc[i * n:(i + 1) * n].to(torch.int32)
    ids = torch.randint(100, 20000, (batch * n,), generator=gen).tolist()
    chains = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [prompt_len] * batch, [n] * batch, chain_loc,
                                req_to_token, pool, return_full_logits=True)
    decode_loc = chain_loc.view(batch, n)[:, 0].contiguous()
    decode = ForwardBatch.build(ForwardMode.DECODE, ids[::n], rows, [prompt_len] * batch, [1] * batch, decode_loc,
                                req_to_token, pool)
    return chains, decode


def fresh(fb: ForwardBatch) -> ForwardBatch:
    """A copy without the step metadata the model set on its last run."""
    return ForwardBatch(**{**fb.__dict__, "attn_metadata": None})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--draft-len", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()

    checkpoint = resolve_checkpoint(args.model, progress=False)
    gguf_file = resolve_quantization(args.model, args.quantization)
    dtype = resolve_dtype(args.dtype, CPU)
    loaded = load_model(checkpoint, dtype, CPU, gguf_file=gguf_file, quantization=args.quantization)
    print(f"# {checkpoint.name}, {dtype}, quantization={args.quantization or 'default'}, "
          f"gguf={'yes' if gguf_file else 'no'}, {torch.get_num_threads()} threads")
    print("| batch | verify rows | rows (ms) | extend chains (ms) | decode step (ms) | rows / chains | rows / decode |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for batch in args.batch_sizes:
            chains, decode = setup(loaded.model, loaded.hf_config, dtype, batch, args.prompt_len, args.draft_len, batch)
            steps = {"rows": lambda c=chains: verify_rows(fresh(c)), "chains": lambda c=chains: fresh(c),
                     "decode": lambda d=decode: fresh(d)}
            times: dict[str, list[float]] = {k: [] for k in steps}
            for r in range(args.rounds + 2):
                order = list(steps)[r % 3:] + list(steps)[:r % 3]  # rotate who goes first
                for name in order:
                    fb = steps[name]()
                    start = time.perf_counter()
                    loaded.model.forward(fb)
                    if r >= 2:  # two warm-up rounds
                        times[name].append(time.perf_counter() - start)
            med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            print(f"| {batch} | {chains.num_tokens} | {med['rows']:.2f} | {med['chains']:.2f} | {med['decode']:.2f} | "
                  f"{med['rows'] / med['chains']:.2f}x | {med['rows'] / med['decode']:.2f}x |", flush=True)
            print(json.dumps({"batch": batch, "rows": chains.num_tokens, **med}), flush=True)


if __name__ == "__main__":
    main()
