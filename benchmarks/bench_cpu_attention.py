"""The native CPU decode attention kernel: K/V read rate, against an older build of it.

Times `NativeLayerOps.decode_attention` (`kernels/csrc/cpu_kernels.cpp`) on decode
steps shaped as SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, bf16 pool by
default) for each batch size: every request has `--context` tokens whose slots are
contiguous in the pool, as a prefilled request's are, and the pool holds
`--layers` layers' K/V so that one call's K/V is not in the caches from the last
call (each call reads the next layer's pool, as a step's 30 layers do). With
`--baseline-rev REV` the same calls run, interleaved call block by call block, on
the library built from `cpu_kernels.cpp` as it was at git revision REV, and the
table gives the ratio of medians. K/V GB/s counts the K and V bytes the call reads
(each K and V row once per KV head), against the copy bandwidth measured in the
same run (read + write bytes of `copy_` on 512 MiB, as `bench_decode_step.py`).
With `--draft-len N` every request is a speculative verify chain instead: 1 + N rows
of it at lengths context - N .. context (`TARGET_VERIFY` rows); K/V per call still
counts each request's K/V once. The two builds' outputs must be the same bits.

    flock /tmp/arborlm-timing.lock .venv/bin/python benchmarks/bench_cpu_attention.py \\
        --batch-sizes 1,8,32 --baseline-rev HEAD
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arborlm.kernels import cpu_ops  # noqa: E402
from arborlm.kernels.cpu_ops import NativeLayerOps  # noqa: E402
from benchmarks.machine import copy_bandwidth_gbs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def baseline_library(rev: str, workdir: Path):
    """The library built from `cpu_kernels.cpp` at git revision `rev`."""
    source = workdir / "cpu_kernels.cpp"
    rel = cpu_ops.SOURCE.relative_to(REPO)
    source.write_text(subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=REPO, check=True,
                                     capture_output=True, text=True).stdout)
    headers = []
    for header in cpu_ops.HEADERS:  # the headers it includes, where that revision had them
        shown = subprocess.run(["git", "show", f"{rev}:{header.relative_to(REPO)}"], cwd=REPO, capture_output=True,
                               text=True)
        if shown.returncode == 0:
            (workdir / header.name).write_text(shown.stdout)
            headers.append(workdir / header.name)
    signatures = {name: (argtypes, cpu_ops._RESTYPES.get(name)) for name, argtypes in cpu_ops._SIGNATURES.items()}
    path = cpu_ops.build_library(workdir, (source, *headers))
    return cpu_ops.open_library(path, "arborlm_abi_version", cpu_ops.ABI_VERSION, signatures)


def make_step(batch: int, context: int, layers: int, q_heads: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype, draft_len: int = 0):
    """q per layer, the pools of `layers` layers and the step's indices (slots contiguous per
    request); with `draft_len`, 1 + draft_len rows per request at lengths context - draft_len
    .. context (a verify chain)."""
    slots = batch * context
    rows = 1 + draft_len
    k_pools = [torch.randn(slots, kv_heads, head_dim).to(dtype) for _ in range(layers)]
    v_pools = [torch.randn(slots, kv_heads, head_dim).to(dtype) for _ in range(layers)]
    qs = [torch.randn(batch * rows, q_heads, head_dim).to(dtype) for _ in range(layers)]
    req_to_token = torch.arange(slots, dtype=torch.int32).view(batch, context)
    req_pool_indices = torch.arange(batch, dtype=torch.int64).repeat_interleave(rows)
    seq_lens = torch.arange(context - draft_len, context + 1, dtype=torch.int64).repeat(batch)
    return qs, k_pools, v_pools, req_to_token, req_pool_indices, seq_lens


def outputs(ops: NativeLayerOps, step) -> torch.Tensor:
    """The first layer's output (to check that two builds agree bit for bit)."""
    qs, k_pools, v_pools, req_to_token, rpi, seq_lens = step
    return ops.decode_attention(qs[0], k_pools[0], v_pools[0], req_to_token, rpi, seq_lens, qs[0].shape[-1] ** -0.5,
                                check=False)


def time_block(ops: NativeLayerOps, step, calls: int) -> float:
    """Seconds per call over `calls` calls, each on the next layer's pool."""
    qs, k_pools, v_pools, req_to_token, rpi, seq_lens = step
    scale = qs[0].shape[-1] ** -0.5
    start = time.perf_counter()
    for i in range(calls):
        layer = i % len(qs)
        ops.decode_attention(qs[layer], k_pools[layer], v_pools[layer], req_to_token, rpi, seq_lens, scale,
                             check=False)
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--context", type=int, default=260, help="tokens per request")
    parser.add_argument("--layers", type=int, default=30, help="pools cycled through (one per layer)")
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved blocks per variant")
    parser.add_argument("--calls", type=int, default=60, help="calls per block")
    parser.add_argument("--baseline-rev", default=None, help="git revision of cpu_kernels.cpp to compare with")
    parser.add_argument("--draft-len", type=int, default=0, help="verify chains of 1 + N rows per request")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    variants = {"current": NativeLayerOps(cpu_ops.native_library())}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline_rev:
            variants[f"at {args.baseline_rev}"] = NativeLayerOps(baseline_library(args.baseline_rev, Path(tmp)))
        bandwidth = copy_bandwidth_gbs()
        print(f"copy bandwidth (read + write) {bandwidth:.1f} GB/s; {args.q_heads}/{args.kv_heads} heads, "
              f"head_dim {args.head_dim}, {args.dtype}, {args.context} tokens per request, "
              f"{1 + args.draft_len} row(s) per request, {torch.get_num_threads()} threads")
        names = list(variants)
        header = "| batch | K/V per call (MB) | " + " | ".join(f"{n} (us)" for n in names)
        header += " | " + " | ".join(f"{n} K/V GB/s" for n in names)
        print(header + (" | current / baseline |" if len(names) > 1 else " |"))
        print("|" + "---|" * (2 + 2 * len(names) + (len(names) > 1)))
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            step = make_step(batch, args.context, args.layers, args.q_heads, args.kv_heads, args.head_dim, dtype,
                             args.draft_len)
            results = [outputs(ops, step) for ops in variants.values()]
            if any(not torch.equal(results[0], r) for r in results[1:]):
                raise SystemExit(f"batch {batch}: the builds' outputs differ")
            kv_mb = 2 * batch * args.context * args.kv_heads * args.head_dim * dtype.itemsize / 1e6
            times = {n: [] for n in names}
            for ops in variants.values():
                time_block(ops, step, args.layers)  # warm-up: build, page in
            for _ in range(args.rounds):
                for name, ops in variants.items():
                    times[name].append(time_block(ops, step, args.calls))
            med = {n: statistics.median(t) for n, t in times.items()}
            row = f"| {batch} | {kv_mb:.2f} | " + " | ".join(f"{med[n] * 1e6:.0f}" for n in names)
            row += " | " + " | ".join(f"{kv_mb / 1e3 / med[n]:.1f}" for n in names)
            if len(names) > 1:
                row += f" | {med[names[0]] / med[names[1]]:.2f}x"
            print(row + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
