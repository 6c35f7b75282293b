"""The Triton attention kernels on a CUDA GPU: correctness, then speed against peaks.

1. Correctness: extend and decode against `kernels/reference.py` (bfloat16 and
   float16, GQA, paged `req_to_token`, prefix lengths 0..several hundred), and
   GPU sampling (top-k / top-p / min-p filtering, grammar bitmask) against the
   CPU results.
2. Decode: batch 64, context 4096 (Llama-3-8B heads: 32 query, 8 KV, dim 128,
   bfloat16), timed with `triton.testing.do_bench`; achieved bandwidth = K/V
   bytes read / time, as a fraction of the H200's 4.8 TB/s. Baseline in the same
   run: torch `scaled_dot_product_attention` on dense (already gathered) K/V.
3. Extend: 8 requests x 2048 new tokens, causal, same heads; TFLOP/s =
   causal attention FLOPs / time, as a fraction of ~990 dense bf16 TFLOP/s.
   Same SDPA baseline.

Targets (issue): decode >= 70 % of peak bandwidth, extend >= 50 % of peak FLOP/s.
One run takes well under 5 minutes on an H200. `--smoke` runs every code path
with tiny shapes on the CPU under Triton's interpreter (no GPU, no timing
targets), to check the script itself::

    python benchmarks/bench_kernels.py                       # on the GPU machine
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from arborlm.constrained.base import allocate_vocab_mask, apply_vocab_mask  # noqa: E402
from arborlm.kernels import reference  # noqa: E402
from arborlm.kernels.triton_decode import decode_attention  # noqa: E402
from arborlm.kernels.triton_extend import extend_attention  # noqa: E402
from arborlm.runtime.sampling import SamplingBatchInfo  # noqa: E402
from arborlm.runtime.sampling_filters import filter_probs  # noqa: E402
from arborlm.sampling_params import SamplingParams  # noqa: E402

H200_BANDWIDTH = 4.8e12  # bytes/s (HBM3e)
H200_BF16_FLOPS = 989e12  # dense, no sparsity
TARGET_DECODE_BANDWIDTH = 0.70
TARGET_EXTEND_FLOPS = 0.50
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Shape:
    """One benchmark shape: requests, tokens, heads (query / KV), head dim."""

    batch: int
    prefix_len: int
    extend_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def paged_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, page_size: int = 16, seed: int = 0):
    """A pool holding `shape.batch` requests of prefix + extend tokens in shuffled pages,
    and the new tokens' queries. Returns (q, k_buffer, v_buffer, req_to_token,
    req_pool_indices, seq_lens, prefix_lens, extend_lens)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seq_len = shape.prefix_len + shape.extend_len
    pages_per_req = -(-seq_len // page_size)
    num_pages = shape.batch * pages_per_req + 1
    k_buffer = torch.randn(num_pages * page_size, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_pages * page_size, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype)
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).view(shape.batch, pages_per_req)
    slots = (pages[:, :, None] * page_size + torch.arange(page_size)).view(shape.batch, -1)[:, :seq_len]
    req_to_token = slots.to(torch.int32)
    q = torch.randn(shape.batch * shape.extend_len, shape.num_q_heads, shape.head_dim, generator=gen).to(dtype)
    lens = [torch.full((shape.batch,), n, dtype=torch.int64) for n in (seq_len, shape.prefix_len, shape.extend_len)]
    tensors = (q, k_buffer, v_buffer, req_to_token, torch.arange(shape.batch), *lens)
    return tuple(t.to(device) for t in tensors)


def check_attention(device: torch.device, dtype: torch.dtype, shapes: list[Shape]) -> float:
    """Largest |kernel - reference| over `shapes` for extend and decode; raises past 2e-2."""
    worst = 0.0
    for shape in shapes:
        q, k, v, r2t, rows, seq_lens, prefix, extend = paged_inputs(shape, dtype, device)
        scale = shape.head_dim**-0.5
        out = extend_attention(q, k, v, r2t, rows, seq_lens, prefix, extend, scale)
        ref = reference.extend_attention(q.float(), k.float(), v.float(), r2t, rows, seq_lens, prefix, extend, scale)
        worst = max(worst, (out.float() - ref).abs().max().item())
        q1 = q.view(shape.batch, shape.extend_len, *q.shape[1:])[:, -1].contiguous()
        out = decode_attention(q1, k, v, r2t, rows, seq_lens, scale)
        ref = reference.decode_attention(q1.float(), k.float(), v.float(), r2t, rows, seq_lens, scale)
        worst = max(worst, (out.float() - ref).abs().max().item())
        print(f"  {dtype} {shape}: max error so far {worst:.2e}", flush=True)
    if worst > 2e-2:
        raise SystemExit(f"kernel disagrees with the reference: max abs error {worst:.3e} > 2e-2")
    return worst


def check_sampling(device: torch.device) -> float:
    """Largest difference between GPU and CPU filtered probabilities and masked logits."""
    vocab = 49152
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, vocab, generator=gen) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=50), SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.3, min_p=0.05), SamplingParams(temperature=0.9, top_k=200, top_p=0.8, min_p=0.01),
    ] * 2
    worst = 0.0
    results = []
    for dev in (torch.device("cpu"), device):
        info = SamplingBatchInfo.from_params(params, list(range(8)), vocab, dev)
        probs = torch.softmax(logits.to(dev) / info.temperatures, dim=-1)
        filtered = filter_probs(probs, info).cpu()
        mask = allocate_vocab_mask(8, vocab)
        mask[:, ::3] = 0x0F0F0F0F
        masked = logits.to(dev).clone()
        apply_vocab_mask(masked, mask, [0, 2, 5])
        results.append((filtered, masked.cpu()))
    (f_cpu, m_cpu), (f_dev, m_dev) = results
    worst = max((f_cpu - f_dev).abs().max().item(), 0.0)
    if not torch.equal(torch.isinf(m_cpu), torch.isinf(m_dev)):
        raise SystemExit("grammar bitmask masks different tokens on the GPU")
    if worst > 1e-5:
        raise SystemExit(f"GPU top-k/top-p/min-p filtering differs from the CPU: {worst:.3e}")
    return worst


def timer(device: torch.device):
    """`do_bench` on CUDA (milliseconds); a plain wall-clock median elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100)

    def wall(fn, reps: int = 3) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]

    return wall


def bench_decode(shape: Shape, device: torch.device, bench) -> dict:
    """Decode: Triton over the paged pool vs SDPA on dense K/V; bandwidth of K/V reads."""
    q, k, v, r2t, rows, seq_lens, _, _ = paged_inputs(shape, torch.bfloat16, device)
    q = q.view(shape.batch, shape.extend_len, *q.shape[1:])[:, -1].contiguous()
    scale = shape.head_dim**-0.5
    seq_len = shape.prefix_len + shape.extend_len
    triton_ms = bench(lambda: decode_attention(q, k, v, r2t, rows, seq_lens, scale, max_len=seq_len))
    dense_k = k[r2t.long()].transpose(1, 2).contiguous()  # (B, Hkv, L, D), gathered once outside the timing
    dense_v = v[r2t.long()].transpose(1, 2).contiguous()
    q4 = q[:, :, None, :]
    sdpa_ms = bench(lambda: F.scaled_dot_product_attention(q4, dense_k, dense_v, scale=scale, enable_gqa=True))
    kv_bytes = 2 * shape.batch * seq_len * shape.num_kv_heads * shape.head_dim * 2
    bandwidth = kv_bytes / (triton_ms * 1e-3)
    return {
        "kernel": "decode", "shape": asdict(shape), "triton_ms": triton_ms, "sdpa_dense_ms": sdpa_ms,
        "bandwidth_GBps": bandwidth / 1e9, "fraction_of_peak": bandwidth / H200_BANDWIDTH,
        "target": TARGET_DECODE_BANDWIDTH, "vs_sdpa_dense": sdpa_ms / triton_ms,
    }


def bench_extend(shape: Shape, device: torch.device, bench) -> dict:
    """Extend: Triton causal prefill over the pool vs causal SDPA on dense tensors; TFLOP/s."""
    q, k, v, r2t, rows, seq_lens, prefix, extend = paged_inputs(shape, torch.bfloat16, device)
    scale = shape.head_dim**-0.5
    triton_ms = bench(lambda: extend_attention(
        q, k, v, r2t, rows, seq_lens, prefix, extend, scale, max_extend_len=shape.extend_len,
    ))
    dense_q = q.view(shape.batch, shape.extend_len, shape.num_q_heads, shape.head_dim).transpose(1, 2).contiguous()
    dense_k = k[r2t.long()].transpose(1, 2).contiguous()
    dense_v = v[r2t.long()].transpose(1, 2).contiguous()
    sdpa_ms = bench(lambda: F.scaled_dot_product_attention(
        dense_q, dense_k, dense_v, is_causal=True, scale=scale, enable_gqa=True,
    ))
    # QK^T and PV, 2 FLOPs per multiply-add, half the square kept by the causal mask.
    flops = 4 * shape.batch * shape.num_q_heads * shape.extend_len**2 * shape.head_dim / 2
    achieved = flops / (triton_ms * 1e-3)
    return {
        "kernel": "extend", "shape": asdict(shape), "triton_ms": triton_ms, "sdpa_dense_ms": sdpa_ms,
        "TFLOPs": achieved / 1e12, "fraction_of_peak": achieved / H200_BF16_FLOPS,
        "target": TARGET_EXTEND_FLOPS, "vs_sdpa_dense": sdpa_ms / triton_ms,
    }


def markdown(records: list[dict], device_name: str) -> str:
    """The README table."""
    lines = [
        f"Triton kernels on {device_name}, {datetime.date.today().isoformat()}:",
        "",
        "| kernel | shape | Triton (ms) | SDPA dense (ms) | achieved | of peak | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        s = r["shape"]
        shape = f"{s['batch']} x {s['prefix_len'] + s['extend_len']} tok, {s['num_q_heads']}/{s['num_kv_heads']} heads"
        achieved = f"{r['bandwidth_GBps']:.0f} GB/s" if r["kernel"] == "decode" else f"{r['TFLOPs']:.0f} TFLOP/s"
        lines.append(
            f"| {r['kernel']} | {shape} | {r['triton_ms']:.3f} | {r['sdpa_dense_ms']:.3f} | {achieved} "
            f"| {r['fraction_of_peak']:.0%} | {r['target']:.0%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--json-out", type=Path, default=RESULTS_DIR / "kernels.json")
    args = parser.parse_args()

    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs under Triton's interpreter: set TRITON_INTERPRET=1")
        device = torch.device("cpu")
        check_shapes = [Shape(2, 40, 24, 8, 2, 64)]
        decode_shape, extend_shape = Shape(2, 127, 1, 8, 2, 64), Shape(2, 0, 64, 8, 2, 64)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_kernels needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
        device = torch.device("cuda")
        check_shapes = [Shape(4, 0, 300, 32, 8, 128), Shape(3, 517, 129, 28, 4, 128), Shape(5, 64, 70, 12, 12, 64)]
        decode_shape, extend_shape = Shape(64, 4095, 1, 32, 8, 128), Shape(8, 0, 2048, 32, 8, 128)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"device: {device_name}", flush=True)

    print("[1/3] correctness against the reference", flush=True)
    errors = {str(dtype): check_attention(device, dtype, check_shapes) for dtype in (torch.bfloat16, torch.float16)}
    errors["sampling"] = check_sampling(device)
    print(f"  max errors: {errors}", flush=True)

    bench = timer(device)
    print("[2/3] decode", flush=True)
    records = [bench_decode(decode_shape, device, bench)]
    print(f"  {records[-1]}", flush=True)
    print("[3/3] extend", flush=True)
    records.append(bench_extend(extend_shape, device, bench))
    print(f"  {records[-1]}", flush=True)

    table = markdown(records, device_name)
    print(table)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps({"device": device_name, "errors": errors, "records": records}, indent=2))
    print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
