"""The int8 quantized linear over a whole model's weights, by activation rows per call.

What a decode step (1 row per request) or a speculative verify step (1 + draft tokens
per request) asks of `csrc/quant_linear.cpp`: every projection of SmolLM2-135M's 30
decoder layers in its GGUF formats (Q4_1 qkv, o, gate_up, down) and its Q8_0 lm_head,
random weights quantized by the gguf package, about 90 MB, so the weights stream from
memory as in serving rather than from cache. Per row count: the median ms of one pass
over all of them, the weight bytes streamed per second, and the time against one row
(what verifying a chain of that many rows costs against a decode step's linears).

`--against DIR` also builds the kernel from another checkout's `arborlm/kernels/csrc`
(a `git worktree` of an earlier commit) and times the two alternately, pass by pass,
so the machine's drift falls on both. Results: docs/kernels.md ("Many rows per weight
block").

    flock /tmp/arborlm-timing.lock .venv/bin/python benchmarks/bench_quant_stream.py \\
        --against /tmp/before --rows 1,4,7,8,16,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from arborlm.kernels import quant_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_quant_rows import packed_weight  # noqa: E402

LAYERS = 30
# (format, out_features, in_features) of one decoder layer's projections, then the head.
LAYER_SHAPES = (("q4_1", 960, 576), ("q4_1", 576, 576), ("q4_1", 3072, 576), ("q4_1", 576, 1536))
HEAD_SHAPE = ("q8_0", 49152, 576)
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}  # bytes per block of 32 values


def build_ops(csrc: Path | None) -> quant_ops.NativeQuantOps:
    """The native ops compiled from `csrc` (default: this checkout's sources) into a fresh folder."""
    saved = quant_ops.SOURCES
    if csrc is not None:
        quant_ops.SOURCES = tuple(csrc / p.name for p in saved)
    try:
        return quant_ops.NativeQuantOps(quant_ops.load_library(Path(tempfile.mkdtemp(prefix="arborlm-bench-"))))
    finally:
        quant_ops.SOURCES = saved


def model_weights(ops: quant_ops.NativeQuantOps, layers: int = LAYERS) -> list[tuple[object, int]]:
    """(packed weight, in_features) of every projection, in the order a step calls them."""
    out = []
    for _ in range(layers):
        out += [(packed_weight(ops, fmt, n, k), k) for fmt, n, k in LAYER_SHAPES]
    fmt, n, k = HEAD_SHAPE
    return out + [(packed_weight(ops, fmt, n, k), k)]


def weight_bytes(layers: int = LAYERS) -> int:
    """Bytes one pass streams: every block of every projection."""
    per_layer = sum(BLOCK_BYTES[f] * n * k // 32 for f, n, k in LAYER_SHAPES)
    f, n, k = HEAD_SHAPE
    return layers * per_layer + BLOCK_BYTES[f] * n * k // 32


def one_pass(ops: quant_ops.NativeQuantOps, weights, xs: dict[int, torch.Tensor]) -> float:
    """Seconds for one call per projection."""
    start = time.perf_counter()
    for w, k in weights:
        ops.linear(xs[k], w)
    return time.perf_counter() - start


def read_pass(buffer: torch.Tensor) -> float:
    """Seconds for one plain read of ``buffer`` (a uint8 tensor of a pass's bytes): the floor."""
    start = time.perf_counter()
    buffer.amax()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,7,8,16,32", help="activation rows per call")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--layers", type=int, default=LAYERS, help="decoder layers' weights per pass (fewer fit in cache)")
    ap.add_argument("--against", type=Path, default=None,
                    help="a checkout whose arborlm/kernels/csrc to time alternately with this one's")
    args = ap.parse_args(argv)
    variants = {"this": build_ops(None)}
    if args.against is not None:
        variants["against"] = build_ops(args.against / "arborlm" / "kernels" / "csrc")
    weights = model_weights(variants["this"], args.layers)  # the packed layout is the same for both builds
    gb = weight_bytes(args.layers) / 1e9
    print(f"{variants['this'].simd} loops, bf16 activations, {torch.get_num_threads()} threads, "
          f"{gb * 1e3:.0f} MB of weights per pass, median of {args.repeats}")
    names = list(variants)
    buffer = torch.ones(weight_bytes(args.layers), dtype=torch.uint8)
    header = " | ".join(f"{n} (ms) | {n} GB/s | {n} / 1 row" for n in names)
    print(f"| rows | {header} | plain read GB/s | this / read |" + (" this / against |" if len(names) == 2 else ""))
    print("|---:|" + "---:|---:|---:|" * len(names) + "---:|---:|" + ("---:|" if len(names) == 2 else ""))
    first: dict[str, float] = {}
    for m in [int(r) for r in args.rows.split(",")]:
        gen = torch.Generator().manual_seed(m)
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in {k for _, _, k in LAYER_SHAPES}}
        times: dict[str, list[float]] = {n: [] for n in names + ["read"]}
        for n in names:
            one_pass(variants[n], weights, xs)  # warm-up
        read_pass(buffer)
        for _ in range(args.repeats):  # the read floor in the same alternation, so drift falls on it too
            for n in names:
                times[n].append(one_pass(variants[n], weights, xs))
            times["read"].append(read_pass(buffer))
        med = {n: statistics.median(t) for n, t in times.items()}
        for n in names:
            first.setdefault(n, med[n])
        cells = " | ".join(f"{med[n] * 1e3:.2f} | {gb / med[n]:.1f} | {med[n] / first[n]:.2f}x" for n in names)
        ratio = f" {med['this'] / med['against']:.2f}x |" if len(names) == 2 else ""
        floor = f" {gb / med['read']:.1f} | {med['this'] / med['read']:.2f}x |"
        print(f"| {m} | {cells} |{floor}{ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
