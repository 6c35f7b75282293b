"""Quantized serving against dequantized bf16 and against llama.cpp's llama-server, one process.

Models (GGUF files; all but the default made by `gguf_models.py` under the cache, nothing
downloaded), each a group of variants run side by side:

- `default`: SmolLM2-135M-Instruct as shipped (Q4_1, its embedding Q8_0): `none` (dequantized
  to bf16), `gguf` (served as stored), `int8`, `int4` (weight-only, quantized at load), and the
  bf16 model with its KV pool in `int8`, `fp8_e4m3`, `fp8_e5m2`;
- `q8_0`, `q4_k_m`: the default model's weights written again as Q8_0 (`gguf.quants`) and as
  llama.cpp's Q4_K_M (`llama-quantize`, when built): `gguf`. K-quants need rows of 256 values
  and SmolLM2's hidden size is 576, so in that file only `ffn_down` is a K-quant, the rest
  llama-quantize's fallbacks (Q5_0, which we serve dequantized, and Q8_0): not in the default
  `--groups`;
- `random-0.5b-q8_0`, `random-0.5b-q4_k_m`: a random Llama of ~0.5 B parameters
  (`gguf_models.RANDOM_DIMS`) in those formats: `none`, `gguf`, `int8`, `int4` on the Q8_0 file,
  `gguf` on the Q4_K_M one (perplexity not measured: random weights).

For each group and batch size, one scheduler per variant holds the same greedy requests; after
their prefill, blocks of decode steps alternate between the variants and, when
`llama-server` is built (`benchmarks/peers/llama_cpp.sh install`), a block of the same batch
of requests on llama-server serving the same file (its own decode timings), so the machine's
drift hits all alike. Prefill: a `--prefill-len`-token prompt, one forward, also interleaved.
Perplexity: `bench_perplexity.perplexity` over the first `--ppl-tokens` tokens of its text.
Memory: the bytes of the weights the model holds, and of its KV pool (`--max-total-tokens`
slots; an int8 pool's scales included): what the variant keeps resident after load.

    flock /tmp/arborlm-timing.lock .venv/bin/python benchmarks/bench_quant.py --threads 1

`--variants none gguf gguf-unfused` runs only those variants of each group; a name ending in
`-unfused` is that variant with the fused decoder layer off (`kernels/fused_decoder_layer.py`),
so the fused layer's effect is a ratio in the same run.

`--threads` pins torch's and OpenMP's thread counts (and llama-server's `-t`): on a shared
machine one thread per step times steadier. Prints one markdown table and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--threads" in sys.argv:  # OpenMP reads it once, when the kernels' library loads
    os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import torch  # noqa: E402

from arborlm.runtime.config import ServerArgs  # noqa: E402
from arborlm.runtime.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from arborlm.runtime.io_struct import TokenizedGenerateReqInput  # noqa: E402
from arborlm.runtime.layers.quantization.gguf_loader import weight_bytes  # noqa: E402
from arborlm.runtime.scheduler import Scheduler  # noqa: E402
from arborlm.sampling_params import SamplingParams  # noqa: E402
from benchmarks import bench_perplexity, gguf_models  # noqa: E402

LLAMA_SERVER = gguf_models.PEERS_CACHE / "llama.cpp" / "build" / "bin" / "llama-server"
LLAMA = "llama-server"
DEFAULT_VARIANTS = ("none", "gguf", "int8", "int4", "kv-int8", "kv-fp8_e4m3", "kv-fp8_e5m2")
# A variant name with this suffix runs with the fused decoder layer off (`FusedDecode.enabled`).
UNFUSED = "-unfused"
RANDOM_VARIANTS = ("none", "gguf", "int8", "int4")


@dataclass
class Group:
    """One GGUF file and the variants run on it side by side."""

    name: str
    path: Path
    variants: tuple[str, ...]
    perplexity: bool = True


@dataclass
class Row:
    """What one variant measured in one group at one batch size."""

    decode_ms: list[float] = field(default_factory=list)
    prefill_tok_s: list[float] = field(default_factory=list)
    weights_mb: float | None = None
    kv_mb: float | None = None
    perplexity: float | None = None


def groups(names: list[str]) -> list[Group]:
    """The groups asked for; those whose file cannot be made here are left out (logged)."""
    made = {
        "default": lambda: Group("default", gguf_models.default_model_path(), DEFAULT_VARIANTS),
        "q8_0": lambda: Group("q8_0", gguf_models.requantized_default("Q8_0"), ("gguf",)),
        "q4_k_m": lambda: _k_quant("q4_k_m", gguf_models.requantized_default("F16"), ("gguf",), True),
        "random-0.5b-q8_0": lambda: Group("random-0.5b-q8_0", gguf_models.random_llama("Q8_0"), RANDOM_VARIANTS,
                                          perplexity=False),
        "random-0.5b-q4_k_m": lambda: _k_quant("random-0.5b-q4_k_m", gguf_models.random_llama("F16"), ("gguf",),
                                               False),
    }
    out = []
    for name in names:
        group = made[name]()
        if group is None:
            print(f"{name}: skipped, llama-quantize is not built (benchmarks/peers/llama_cpp.sh install)",
                  file=sys.stderr)
        else:
            out.append(group)
    return out


def _k_quant(name: str, f16: Path, variants: tuple[str, ...], perplexity: bool) -> Group | None:
    path = gguf_models.llama_quantize(f16, "Q4_K_M")
    return None if path is None else Group(name, path, variants, perplexity)


def server_args(group: Group, variant: str, args: argparse.Namespace) -> ServerArgs:
    variant = variant.removesuffix(UNFUSED)
    kwargs = dict(model_path=str(group.path), log_level="warning", max_total_tokens=args.max_total_tokens)
    if variant.startswith("kv-"):
        kwargs.update(quantization="none", kv_cache_dtype=variant.removeprefix("kv-"))
    else:
        kwargs.update(quantization=variant)
    return ServerArgs.from_kwargs(**kwargs)


def kv_pool_mb(sched: Scheduler) -> float:
    """Bytes (MB) of the scheduler's KV pool: K, V and an int8 pool's scales."""
    pool = sched.model_runner.token_to_kv_pool
    tensors = (pool.k_buffer, pool.v_buffer, pool.k_scale, pool.v_scale)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None) / 1e6


def make_scheduler(group: Group, variant: str, batch_size: int, args: argparse.Namespace, row: Row) -> Scheduler:
    """A scheduler holding `batch_size` greedy requests of `prompt_len` tokens each."""
    sched = Scheduler(server_args(group, variant, args))
    fused_decode = getattr(sched.model_runner.model.model, "fused_decode", None)
    if variant.endswith(UNFUSED) and fused_decode is not None:
        fused_decode.enabled = False
    row.weights_mb, row.kv_mb = weight_bytes(sched.model_runner.model) / 1e6, kv_pool_mb(sched)
    params = SamplingParams(max_new_tokens=args.warmup + args.rounds * args.block + 8, ignore_eos=True, temperature=0)
    for i, ids in enumerate(prompts(batch_size, args.prompt_len)):
        sched.handle(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=ids, sampling_params=params, seed=i))
    return sched


def prompts(batch_size: int, prompt_len: int) -> list[list[int]]:
    return [list(range(100 + i, 100 + i + prompt_len)) for i in range(batch_size)]


def prefill_tok_s(sched: Scheduler, prefill_len: int) -> float:
    """Tokens per second of one `prefill_len`-token prefill through the scheduler's model runner."""
    runner = sched.model_runner
    ids = list(range(1000, 1000 + prefill_len))
    (row,) = runner.req_to_token_pool.alloc(1)
    loc = runner.token_to_kv_pool_allocator.alloc(prefill_len)
    try:
        runner.req_to_token_pool.req_to_token[row, :prefill_len] = loc.to(torch.int32)
        batch = ForwardBatch.build(ForwardMode.EXTEND, ids, [row], [0], [prefill_len], loc,
                                   runner.req_to_token_pool, runner.token_to_kv_pool)
        start = time.perf_counter()
        runner.forward(batch)
        return prefill_len / (time.perf_counter() - start)
    finally:
        runner.req_to_token_pool.free(row)
        runner.token_to_kv_pool_allocator.free(loc)


class LlamaServer:
    """llama-server on one GGUF file (`-np 8 -t threads`), timed by its own `timings`."""

    def __init__(self, path: Path, threads: int, port: int, binary: Path = LLAMA_SERVER):
        self.url = f"http://127.0.0.1:{port}"
        cmd = [str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-np", "8",
               "-c", "8192", "-t", str(threads), "-tb", str(threads)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start on {path}")
            time.sleep(1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def complete(self, ids: list[int], n_predict: int) -> dict:
        body = json.dumps({"prompt": ids, "n_predict": n_predict, "temperature": 0, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        req = urllib.request.Request(f"{self.url}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["timings"]

    def block(self, batch_size: int, prompt_len: int, n_predict: int) -> tuple[float, float]:
        """(decode step ms, prefill tok/s) of `batch_size` concurrent requests: the mean of their
        decode ms per token, their summed prompt tokens over the longest prompt phase."""
        with ThreadPoolExecutor(batch_size) as pool:
            timings = list(pool.map(lambda ids: self.complete(ids, n_predict), prompts(batch_size, prompt_len)))
        step_ms = statistics.mean(t["predicted_ms"] / t["predicted_n"] for t in timings)
        prefill = sum(t["prompt_n"] for t in timings) / max(t["prompt_ms"] for t in timings) * 1e3
        return step_ms, prefill

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def run_group(group: Group, batch_size: int, args: argparse.Namespace, server: LlamaServer | None,
              windows: list[list[int]] | None) -> dict[str, Row]:
    """Every variant of `group` (and llama-server) at `batch_size`, decode blocks interleaved."""
    rows = {variant: Row() for variant in group.variants}
    schedulers = {v: make_scheduler(group, v, batch_size, args, rows[v]) for v in group.variants}
    if args.threads is not None:  # after the model runners, which set every core
        torch.set_num_threads(args.threads)
    if windows is not None:
        for variant, sched in schedulers.items():
            rows[variant].perplexity = bench_perplexity.perplexity(sched.model_runner, windows)[0]
    for sched in schedulers.values():
        for _ in range(1 + args.warmup):  # the prefill, then warm-up decode steps
            sched.step()
    if server is not None:
        rows[LLAMA] = Row()
        server.block(batch_size, args.prompt_len, 4)  # warm-up
    for r in range(args.rounds):
        for variant, sched in schedulers.items():
            start = time.perf_counter()
            for _ in range(args.block):
                sched.step()
            rows[variant].decode_ms.append((time.perf_counter() - start) / args.block * 1e3)
            if r < args.prefill_rounds:
                rows[variant].prefill_tok_s.append(prefill_tok_s(sched, args.prefill_len))
        if server is not None:
            step_ms, prefill = server.block(batch_size, args.prompt_len, 4 * args.block)
            rows[LLAMA].decode_ms.append(step_ms)
    if server is not None:  # its prefill of the same prompt length as ours, outside the decode blocks
        for _ in range(args.prefill_rounds):
            rows[LLAMA].prefill_tok_s.append(server.block(1, args.prefill_len, 1)[1])
    del schedulers
    return rows


def print_table(results: list[tuple[Group, int, dict[str, Row]]], args: argparse.Namespace) -> None:
    print(f"| model | batch | variant | weights (MB) | KV pool, {args.max_total_tokens} tokens (MB) | decode step, median (ms) | decode tok/s "
          f"| prefill tok/s ({args.prefill_len} tokens) | perplexity / none |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    # the default model's files share one reference: the shipped file dequantized (`none`)
    base_ppl = next((rows["none"].perplexity for g, _, rows in results if g.name == "default" and "none" in rows),
                    None)  # `--variants` without none: no perplexity ratio
    for group, batch_size, rows in results:
        for variant, row in rows.items():
            ms = statistics.median(row.decode_ms)
            ppl = "-" if row.perplexity is None or base_ppl is None else f"{row.perplexity / base_ppl:.4f}"
            mb = "-" if row.weights_mb is None else f"{row.weights_mb:.1f}"
            kv = "-" if row.kv_mb is None else f"{row.kv_mb:.1f}"
            prefill = f"{statistics.median(row.prefill_tok_s):.0f}" if row.prefill_tok_s else "-"
            print(f"| {group.name} | {batch_size} | {variant} | {mb} | {kv} | {ms:.2f} | {batch_size * 1e3 / ms:.1f} "
                  f"| {prefill} | {ppl} |")
    print()
    for group, batch_size, rows in results:
        med = {v: statistics.median(r.decode_ms) for v, r in rows.items()}
        ref = "none" if "none" in med else "gguf"
        ratios = ", ".join(f"{v} {med[ref] / ms:.2f}x" for v, ms in med.items() if v != ref)
        print(f"{group.name}, batch {batch_size}: decode tok/s against {ref}: {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", default=["default", "q8_0", "random-0.5b-q8_0", "random-0.5b-q4_k_m"],
                        choices=["default", "q8_0", "q4_k_m", "random-0.5b-q8_0", "random-0.5b-q4_k_m"])
    parser.add_argument("--variants", nargs="+", default=None,
                        help=f"run only these of each group's variants; a name + '{UNFUSED}' runs it with the "
                             "fused decoder layer off")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt of the decode batch")
    parser.add_argument("--prefill-len", type=int, default=256, help="tokens of the timed prefill")
    parser.add_argument("--warmup", type=int, default=3, help="decode steps before timing")
    parser.add_argument("--rounds", type=int, default=6, help="blocks of decode steps per variant")
    parser.add_argument("--block", type=int, default=4, help="decode steps per block")
    parser.add_argument("--prefill-rounds", type=int, default=3, help="rounds that also time a prefill")
    parser.add_argument("--ppl-tokens", type=int, default=1024, help="tokens of text scored (0: no perplexity)")
    parser.add_argument("--max-total-tokens", type=int, default=4096, help="KV pool slots per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch, OpenMP and llama-server threads")
    parser.add_argument("--no-llama-server", action="store_true", help="leave llama-server out")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER,
                        help="the llama-server binary (e.g. a build with -DGGML_AVX512=ON)")
    parser.add_argument("--port", type=int, default=30981)
    args = parser.parse_args()

    windows = None
    if args.ppl_tokens:
        from transformers import AutoTokenizer

        from arborlm.runtime.model_loader import resolve_checkpoint

        tokenizer = AutoTokenizer.from_pretrained(str(resolve_checkpoint(None, progress=False)))
        ids = tokenizer.encode(bench_perplexity.TEXT.read_text(), add_special_tokens=False)[:args.ppl_tokens]
        windows = [ids[i:i + 512] for i in range(0, len(ids), 512) if len(ids[i:i + 512]) > 1]
    use_server = args.llama_server.is_file() and not args.no_llama_server
    if not use_server:
        print("llama-server: left out (not built, or --no-llama-server)", file=sys.stderr)
    results = []
    for group in groups(args.groups):
        if args.variants:
            group.variants = tuple(v for v in args.variants if v.removesuffix(UNFUSED) in group.variants)
        server = LlamaServer(group.path, args.threads or os.cpu_count() or 1, args.port, args.llama_server) if use_server else None
        try:
            for i, batch_size in enumerate(args.batch_sizes):
                scored = windows if group.perplexity and i == 0 else None
                results.append((group, batch_size, run_group(group, batch_size, args, server, scored)))
                print(f"{group.name} batch {batch_size}: done", file=sys.stderr)
        finally:
            if server is not None:
                server.close()
    print_table(results, args)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; threads {args.threads or 'all'}; "
          f"{args.rounds} rounds x {args.block} decode steps; prompts of {args.prompt_len} tokens")


if __name__ == "__main__":
    main()
