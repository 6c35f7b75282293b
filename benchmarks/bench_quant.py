"""GGUF weights served as stored (`--quantization gguf`) and weight-only int8 (`int8`) against
dequantized (`none`), one process.

For each batch size, builds one scheduler per quantization on the default model (or
`--model`, a GGUF file), gives each the same greedy requests, runs their
prefill, then alternates blocks of decode steps between them so that the
machine's drift hits both alike. Prints a markdown table: the median and minimum
decode step (ms), the bytes of the weights held in memory, and the ratios.

    .venv/bin/python benchmarks/bench_quant.py --batch-sizes 1 8 [--threads 1]

`--threads` pins torch's and OpenMP's thread counts (the model runner takes every
core otherwise): on a shared machine one thread per step times steadier.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--threads" in sys.argv:  # OpenMP reads it once, when the kernels' library loads
    os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import torch  # noqa: E402

from arborlm.runtime.config import ServerArgs  # noqa: E402
from arborlm.runtime.io_struct import TokenizedGenerateReqInput  # noqa: E402
from arborlm.runtime.layers.quantization.gguf_loader import weight_bytes  # noqa: E402
from arborlm.runtime.scheduler import Scheduler  # noqa: E402
from arborlm.sampling_params import SamplingParams  # noqa: E402

VARIANTS = ("gguf", "int8", "none")


def make_scheduler(quantization: str, batch_size: int, args: argparse.Namespace) -> Scheduler:
    """A scheduler holding `batch_size` greedy requests of `prompt_len` tokens each."""
    sched = Scheduler(ServerArgs.from_kwargs(model_path=args.model, quantization=quantization, log_level="warning"))
    params = SamplingParams(max_new_tokens=args.warmup + args.rounds * args.block + 8, ignore_eos=True, temperature=0)
    for i in range(batch_size):
        ids = list(range(100 + i, 100 + i + args.prompt_len))
        sched.handle(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=ids, sampling_params=params, seed=i))
    return sched


def decode_steps_ms(schedulers: dict[str, Scheduler], args: argparse.Namespace) -> dict[str, list[float]]:
    """Per variant, the mean step time of each block of decode steps (ms), blocks interleaved."""
    for sched in schedulers.values():
        for _ in range(1 + args.warmup):  # the prefill, then warm-up decode steps
            sched.step()
    step_ms: dict[str, list[float]] = {name: [] for name in schedulers}
    for _ in range(args.rounds):
        for name, sched in schedulers.items():
            start = time.perf_counter()
            for _ in range(args.block):
                sched.step()
            step_ms[name].append((time.perf_counter() - start) / args.block * 1e3)
    return step_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file; default SmolLM2-135M-Instruct (Q4_1)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--warmup", type=int, default=5, help="decode steps before timing")
    parser.add_argument("--rounds", type=int, default=15, help="blocks of decode steps per variant")
    parser.add_argument("--block", type=int, default=4, help="decode steps per block")
    parser.add_argument("--threads", type=int, default=None, help="torch and OpenMP threads; default every core")
    args = parser.parse_args()

    print("| batch | quantization | weights (MB) | decode step, median (ms) | decode step, min (ms) |")
    print("|---:|---|---:|---:|---:|")
    ratios = []
    for batch_size in args.batch_sizes:
        schedulers = {name: make_scheduler(name, batch_size, args) for name in VARIANTS}
        if args.threads is not None:  # after the model runners, which set every core
            torch.set_num_threads(args.threads)
        step_ms = decode_steps_ms(schedulers, args)
        median = {name: statistics.median(times) for name, times in step_ms.items()}
        for name, sched in schedulers.items():
            mb = weight_bytes(sched.model_runner.model) / 1e6
            print(f"| {batch_size} | {name} | {mb:.1f} | {median[name]:.2f} | {min(step_ms[name]):.2f} |")
        ratios.append((batch_size, median["gguf"] / median["none"], median["int8"] / median["none"]))
        weights = [weight_bytes(s.model_runner.model) for s in schedulers.values()]
        del schedulers
    for batch_size, gguf_ratio, int8_ratio in ratios:
        print(f"batch {batch_size}: decode step gguf / none = {gguf_ratio:.2f}x, int8 / none = {int8_ratio:.2f}x")
    print(f"weights held: gguf / none = {weights[0] / weights[2]:.2f}x, int8 / none = {weights[1] / weights[2]:.2f}x")


if __name__ == "__main__":
    main()
