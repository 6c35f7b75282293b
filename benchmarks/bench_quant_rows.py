"""The quantized linear's two paths by row count: the int8 kernel against the dequantized GEMM.

`NativeQuantOps.linear` runs up to `quant_ops.int8_max_rows(dtype)` rows through the int8
kernel (`csrc/quant_linear.cpp`: activations rounded to int8 per block of 32, integer dot
products) and more rows by dequantizing the weight to the activations' dtype and one torch
GEMM. This times both paths on the same inputs, interleaved call by call (the median of
`--repeats` each), for SmolLM2-135M's projections in the formats of its GGUF file (Q4_1
qkv / gate_up / down, the Q8_0 lm_head), random weights quantized by the gguf package, and
prints the ratio per row count: where it is below 1 the int8 kernel is the faster path.
Results: docs/kernels.md ("Prefills through the int8 kernel").

    .venv/bin/python benchmarks/bench_quant_rows.py --rows 65,128,256,512,1024,2048,4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import gguf
import numpy as np
import torch

from arborlm.kernels import quant_layout, quant_ops

# name -> (format, out_features, in_features): SmolLM2-135M's layers in its GGUF file.
SHAPES = {"qkv_proj": ("q4_1", 960, 576), "gate_up_proj": ("q4_1", 3072, 576), "down_proj": ("q4_1", 576, 1536),
          "lm_head": ("q8_0", 49152, 576)}


def packed_weight(ops: quant_ops.NativeQuantOps, fmt: str, out_features: int, in_features: int):
    """A random (out, in) weight quantized to `fmt` by the gguf package, packed for `ops`."""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)).numpy()
    raw = gguf.quants.quantize(w.astype(np.float32), getattr(gguf.GGMLQuantizationType, fmt.upper()))
    blocks = torch.from_numpy(raw.view(np.uint8).reshape(out_features, -1))
    return ops.prepare([quant_layout.pack_ggml_blocks(fmt, blocks, in_features)])


def time_paths(ops, weights, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median seconds of `ops.linear(x, weights)` through the int8 kernel and dequantized."""
    int8, dequantized = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        ops.linear_int8(x, weights)
        int8.append(time.perf_counter() - start)
        start = time.perf_counter()
        ops.linear_dequantized(x, weights)
        dequantized.append(time.perf_counter() - start)
    return statistics.median(int8), statistics.median(dequantized)


class BothPaths(quant_ops.NativeQuantOps):
    """`NativeQuantOps` with either path callable whatever the row count."""

    def linear_int8(self, x, weights):
        saved = quant_ops.INT8_MAX_ROWS, quant_ops.INT8_MAX_ROWS_PREFILL
        quant_ops.INT8_MAX_ROWS = quant_ops.INT8_MAX_ROWS_PREFILL = 1 << 30
        try:
            return self.linear(x, weights)
        finally:
            quant_ops.INT8_MAX_ROWS, quant_ops.INT8_MAX_ROWS_PREFILL = saved

    def linear_dequantized(self, x, weights):
        return self._dequantized_linear(x, weights, None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="65,128,256,512,1024,2048", help="row counts (activation rows per call)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="default: every core")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = quant_ops.native_library()
    if lib is None:
        print("the quantized C++ kernels do not build here", file=sys.stderr)
        return 1
    ops = BothPaths(lib)
    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{ops.simd} loops, {args.dtype}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print("| layer | format | rows | int8 kernel (ms) | dequantized GEMM (ms) | int8 / dequantized |")
    print("|---|---|---:|---:|---:|---:|")
    for name, (fmt, n, k) in SHAPES.items():
        weights = packed_weight(ops, fmt, n, k)
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            t_int8, t_deq = time_paths(ops, weights, x, args.repeats)
            print(f"| {name} | {fmt} | {m} | {t_int8 * 1e3:.2f} | {t_deq * 1e3:.2f} | {t_int8 / t_deq:.2f}x |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
