"""The fused CPU kernels against the torch ops, in one process, steps interleaved.

Builds two schedulers on the same model, one with the C++ CPU kernels
(`kernels/cpu_ops.py`) and one with `disable_cpu_kernels=True`, gives both the
same requests, times the prefill step, then alternates blocks of decode steps
between them so that the machine's drift hits both alike. Prints the median
decode step (ms) of each and the ratio.

    .venv/bin/python benchmarks/bench_cpu_kernels.py --batch-size 8 --prompt-len 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arborlm.runtime.config import ServerArgs  # noqa: E402
from arborlm.runtime.io_struct import TokenizedGenerateReqInput  # noqa: E402
from arborlm.runtime.scheduler import Scheduler  # noqa: E402
from arborlm.sampling_params import SamplingParams  # noqa: E402

VARIANTS = {"cpu kernels": False, "torch ops": True}  # name -> disable_cpu_kernels


def make_scheduler(disable: bool, args: argparse.Namespace) -> Scheduler:
    """A scheduler holding `batch_size` greedy requests of `prompt_len` tokens each."""
    sched = Scheduler(ServerArgs.from_kwargs(model_path=args.model, disable_cpu_kernels=disable))
    params = SamplingParams(max_new_tokens=args.warmup + args.rounds * args.block + 8, ignore_eos=True, temperature=0)
    for i in range(args.batch_size):
        ids = list(range(100 + i, 100 + i + args.prompt_len))
        sched.handle(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=ids, sampling_params=params, seed=i))
    return sched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint; default SmolLM2-135M-Instruct")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=200, help="tokens per prompt")
    parser.add_argument("--warmup", type=int, default=5, help="decode steps before timing")
    parser.add_argument("--rounds", type=int, default=15, help="blocks of decode steps per variant")
    parser.add_argument("--block", type=int, default=4, help="decode steps per block")
    args = parser.parse_args()

    schedulers = {name: make_scheduler(disable, args) for name, disable in VARIANTS.items()}
    prefill_ms = {}
    for name, sched in schedulers.items():
        start = time.perf_counter()
        sched.step()  # the whole batch's prefill (chunked prefill may need more steps)
        prefill_ms[name] = (time.perf_counter() - start) * 1e3
        for _ in range(args.warmup):
            sched.step()
    step_ms: dict[str, list[float]] = {name: [] for name in schedulers}
    for done in range(args.rounds):
        for name, sched in schedulers.items():
            start = time.perf_counter()
            for _ in range(args.block):
                sched.step()
            step_ms[name].append((time.perf_counter() - start) / args.block * 1e3)
        print(f"\rround {done + 1}/{args.rounds}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    median = {name: statistics.median(times) for name, times in step_ms.items()}
    print(f"batch {args.batch_size}, prompts of {args.prompt_len} tokens")
    print("| variant | prefill step (ms) | decode step, median (ms) | decode step, min (ms) |")
    print("|---|---:|---:|---:|")
    for name in schedulers:
        print(f"| {name} | {prefill_ms[name]:.0f} | {median[name]:.1f} | {min(step_ms[name]):.1f} |")
    print(f"decode step: cpu kernels / torch ops = {median['cpu kernels'] / median['torch ops']:.2f}x")


if __name__ == "__main__":
    main()
