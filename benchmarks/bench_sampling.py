"""The sampled rows of a decode step: the native CPU sampler against the torch ops, in one run.

Two tables. Draws: `SampledRows(...).draw` (temperature, softmax, top-k / top-p / min-p and the
seeded inverse-CDF draw) with ``native=True`` (`kernels/cpu_sampling.py`, one pass per
row) and ``native=False`` (`sampling_probs` then `draw_from_probs`), alternating block by
block so this machine's drift falls on both, on rows of SmolLM2's vocabulary (49152):
``peaked`` rows (a few tokens far above the rest, as most of a chat model's steps) and
``flat`` ones (plain normal logits: top-p keeps thousands of tokens). Both must draw the
same tokens for the same uniforms; the table says whether they did. Penalties:
`apply_penalties` with ``native=True`` (the seen tokens only) and ``native=False`` ((B, V)
counts and masks) on rows whose requests have ``--prompt-len`` prompt and ``--output-len``
output tokens; both must give the same bits.

    flock /tmp/arborlm-timing.lock .venv/bin/python benchmarks/bench_sampling.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from array import array
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arborlm.runtime.sampling import SamplingBatchInfo, apply_penalties  # noqa: E402
from arborlm.runtime.sampling_filters import SampledRows  # noqa: E402
from arborlm.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {
    "T 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "T 1.0, top_p 0.95, top_k 50": {"temperature": 1.0, "top_p": 0.95, "top_k": 50},
    "T 0.8, min_p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "T 1.0": {"temperature": 1.0},
}


def make_rows(kind: str, batch: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g) * (3.0 if kind == "peaked" else 1.0)
    if kind == "peaked":
        logits[:, torch.randint(0, vocab, (50,), generator=g)] += 8.0
    return logits


PENALTIES = {
    "repetition_penalty 1.1": {"repetition_penalty": 1.1},
    "frequency 0.5, presence 0.3": {"frequency_penalty": 0.5, "presence_penalty": 0.3},
}


def draw_call(logits, info, rows, u, native: bool):
    """One step's draw of every row, on the native sampler or the torch ops."""
    return lambda: SampledRows(logits, info, native=native).draw(rows, u)


def penalty_call(logits, info, outputs, prompts, native: bool):
    """One step's penalties of every row, native or torch, in place on a copy of the logits
    made once (timing a clone of 32 x 49152 floats would hide the difference); returns it."""
    out = logits.clone()

    def call():
        apply_penalties(out, info, outputs, prompts, native=native)
        return out
    return call


def alternate(paths, rounds: int, calls: int) -> tuple[float, float]:
    """Median ms per call of paths[False] and paths[True], alternating block by block."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for native in ((False, True) if r % 2 == 0 else (True, False)):
            times[native].append(time_block(paths[native], calls))
    return statistics.median(times[False]), statistics.median(times[True])


def time_block(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rounds", type=int, default=5, help="alternating blocks per path")
    ap.add_argument("--calls", type=int, default=5, help="calls per block")
    ap.add_argument("--prompt-len", type=int, default=800, help="penalties: prompt tokens a row")
    ap.add_argument("--output-len", type=int, default=200, help="penalties: output tokens a row")
    args = ap.parse_args(argv)
    print(f"{torch.get_num_threads()} threads, vocabulary {args.vocab}, median of {args.rounds} blocks of "
          f"{args.calls} calls per path", flush=True)
    print("| sampling | rows | batch | torch ops (ms) | native (ms) | torch / native | same tokens |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name, sampling in SETTINGS.items():
        for kind in ("peaked", "flat"):
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                logits = make_rows(kind, batch, args.vocab, seed=batch)
                params = [SamplingParams(**sampling)] * batch
                info = SamplingBatchInfo.from_params(params, list(range(batch)), args.vocab)
                rows = list(range(batch))
                u = torch.rand(batch, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
                paths = {native: draw_call(logits, info, rows, u, native) for native in (False, True)}
                same = paths[False]() == paths[True]()
                slow, fast = alternate(paths, args.rounds, args.calls)
                print(f"| {name} | {kind} | {batch} | {slow:.2f} | {fast:.3f} | {slow / fast:.1f}x | "
                      f"{'yes' if same else 'NO'} |", flush=True)
    print(f"\n| penalties ({args.prompt_len} prompt + {args.output_len} output tokens a row) | batch | "
          "torch ops (ms) | native (ms) | torch / native | same bits |")
    print("|---|---:|---:|---:|---:|---|")
    for name, penalties in PENALTIES.items():
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            g = torch.Generator().manual_seed(batch)
            logits = make_rows("peaked", batch, args.vocab, seed=batch)
            outputs = [torch.randint(0, args.vocab, (args.output_len,), generator=g).tolist() for _ in range(batch)]
            # prompts as the worker passes them (`Req.prompt_id_array`), outputs as lists
            prompts = [array("i", torch.randint(0, args.vocab, (args.prompt_len,), generator=g).tolist())
                       for _ in range(batch)]
            params = [SamplingParams(temperature=0.7, **penalties)] * batch
            info = SamplingBatchInfo.from_params(params, list(range(batch)), args.vocab)
            paths = {native: penalty_call(logits, info, outputs, prompts, native) for native in (False, True)}
            same = torch.equal(paths[False](), paths[True]())  # each applied once to the same logits
            slow, fast = alternate(paths, args.rounds, args.calls)
            print(f"| {name} | {batch} | {slow:.2f} | {fast:.3f} | {slow / fast:.1f}x | {'yes' if same else 'NO'} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
