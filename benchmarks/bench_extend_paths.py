"""Prefill attention on the CPU: EXTEND steps as decode rows against torch's SDPA (and the tiled kernel).

Since the batch-invariance change an EXTEND step on the native CPU path attends as
decode rows (`TorchAttentionBackend`, one row per new token, so a token's bits do not
depend on where its prompt was cut or what else the step holds); before, it took
`torch_native.extend_attention` (SDPA over a gather). Two tables, in one process,
the variants interleaved round by round (best of `--rounds`):

1. the default model's whole prefill of one prompt of N random tokens, decode rows
   against SDPA (`extend_as_decode_rows` flipped on the model's backend);
2. one layer's attention call alone, SmolLM2's shapes (9 query heads, 3 KV heads,
   head_dim 64, float32 pool): decode rows, SDPA, and `extend_attention_tiled` (the
   kernel one-byte pools take; faster, but its rows do not round as a decode step's).

    flock /tmp/arborlm-timing.lock .venv/bin/python benchmarks/bench_extend_paths.py --lengths 300,1024,2048,4000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arborlm.kernels import torch_native  # noqa: E402
from arborlm.kernels.cpu_ops import layer_ops  # noqa: E402
from arborlm.runtime.config import ServerArgs  # noqa: E402
from arborlm.runtime.scheduler import Scheduler  # noqa: E402
from tests.runtime.model_helpers import ModelHarness  # noqa: E402


def best_of(rounds: int, variants: dict) -> dict[str, float]:
    """Seconds of each variant's best call, the variants interleaved round by round."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up: kernel build, allocator
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(ts) for name, ts in times.items()}


def prefill_table(lengths: list[int], rounds: int) -> None:
    scheduler = Scheduler(ServerArgs.from_kwargs(model=None, log_level="warning"))
    runner = scheduler.model_runner
    model, backend = runner.model, runner.model.model.attn_backend
    gen = torch.Generator().manual_seed(0)

    def prefill(n: int, rows: bool):
        def run():
            backend.extend_as_decode_rows = rows
            harness = ModelHarness(model, model.config, num_reqs=2, max_context_len=n + 8, num_slots=n + 8,
                                   dtype=runner.dtype)
            harness.extend([harness.new_req()], [torch.randint(0, 49152, (n,), generator=gen).tolist()])
        return run

    print(f"model prefill ({runner.dtype}, {torch.get_num_threads()} threads), best of {rounds}")
    print("| tokens | decode rows s | SDPA s | rows / SDPA |\n|---|---|---|---|")
    for n in lengths:
        t = best_of(rounds, {"rows": prefill(n, True), "sdpa": prefill(n, False)})
        print(f"| {n} | {t['rows']:.3f} | {t['sdpa']:.3f} | {t['rows'] / t['sdpa']:.2f} |", flush=True)
    backend.extend_as_decode_rows = True


def attention_variants(ops, n: int, heads: int = 3, group: int = 3, dim: int = 64) -> dict:
    """One layer's attention over one request of n new tokens (no prefix), three ways."""
    k, v = torch.randn(n, heads, dim), torch.randn(n, heads, dim)
    req_to_token = torch.arange(n, dtype=torch.int32).view(1, n)
    q = torch.randn(n, heads * group, dim)
    row, total, start = torch.zeros(1, dtype=torch.int64), torch.tensor([n]), torch.zeros(1, dtype=torch.int64)
    rows_rpi, rows_lens = torch.zeros(n, dtype=torch.int64), torch.arange(1, n + 1)
    meta = torch_native.build_extend_step_metadata(req_to_token, row, total, start, total, [n], [n], heads)
    return {
        "rows": lambda: ops.decode_attention(q, k, v, req_to_token, rows_rpi, rows_lens, 0.125),
        "sdpa": lambda: torch_native.extend_attention(q, k, v, meta, 0.125),
        "tiled": lambda: ops.extend_attention_tiled(q, k, v, req_to_token, row, total, total, start, 0.125),
    }


def attention_table(lengths: list[int], rounds: int) -> None:
    ops = layer_ops(torch.device("cpu"), native=True)
    print(f"\none layer's attention call, one request of N new tokens, float32, best of {rounds}")
    print("| tokens | decode rows ms | SDPA ms | tiled ms | rows / SDPA | tiled / SDPA |\n|---|---|---|---|---|---|")
    for n in lengths:
        t = best_of(rounds, attention_variants(ops, n))
        ms = {name: s * 1e3 for name, s in t.items()}
        print(f"| {n} | {ms['rows']:.1f} | {ms['sdpa']:.1f} | {ms['tiled']:.1f} | {t['rows'] / t['sdpa']:.2f} "
              f"| {t['tiled'] / t['sdpa']:.2f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="300,1024,2048,4000", help="prompt tokens, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-model", action="store_true", help="only the attention-call table")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if not args.skip_model:
        prefill_table(lengths, args.rounds)
    attention_table(lengths, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
