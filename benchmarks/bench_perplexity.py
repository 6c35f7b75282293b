"""Perplexity of the default model under each weight and KV format, one process, one text.

The text is `benchmarks/data/perplexity_text.txt` (an essay written for this
benchmark, ~2.4k tokens). It is cut into windows of `--window` tokens; each window
is one prefill through the model runner (the serving path: its pools, its
attention backend, its kernels) and scores every token after the first; with `--chunk N`
a window is fed in extend steps of N tokens over its cached prefix instead, so that at
N <= 64 the quantized linears run their decode kernels (int8 activations) as decode does. Perplexity
is exp(mean negative log-likelihood) over all scored tokens.

Variants (bf16 activations throughout):

- `none`: the default GGUF file dequantized to bf16, the reference;
- `gguf`: the file served as stored (its Q4_1 and Q8_0 tensors);
- `gguf-q8_0`, `gguf-q4_0`, `gguf-q4_1`: every linear layer of the dequantized
  model quantized again to that ggml type (`gguf.quants.quantize`) and served by
  the same kernels, the embedding table kept bf16;
- `file-q4_k_m`, `file-q5_k_m`, `file-q6_k`: K-quant GGUF files of the default model, its
  tensors written as F16 (`gguf_models.requantized_default`) and quantized by llama.cpp's
  `llama-quantize` (gguf's Python package has no K-quant quantizer; the tool is built by
  `benchmarks/peers/llama_cpp.sh install`), served as stored (`--quantization gguf`;
  `_M`: llama.cpp's mix, some tensors in Q6_K);
- `int8`: `--quantization int8` (per-channel weight-only int8);
- `int4`, `int4wo-128`: `--quantization int4` / `int4wo-128` (weight-only 4-bit, a scale and
  zero point per group of 32 / 128 inputs; `int4wo-128` is refused on the default model, whose
  hidden size 576 is not a multiple of 128, so it is not in the default `--variants`);
- `kv-int8`, `kv-fp8_e4m3`, `kv-fp8_e5m2`: bf16 weights, the KV pool in int8 / fp8.

    .venv/bin/python benchmarks/bench_perplexity.py [--window 512] [--variants none gguf int8]

Greedy agreement: `--greedy-prompts` prompts (32-token slices spread over the text)
continued greedily for `--greedy-tokens` tokens each, batched; the rate is the
fraction of generated positions whose token equals `none`'s at that position.

Prints a markdown table: perplexity, its ratio to `none`, tokens scored, greedy agreement.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from arborlm.runtime.config import ServerArgs  # noqa: E402
from arborlm.runtime.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from arborlm.runtime.model_runner import ModelRunner  # noqa: E402

TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"
REQUANTIZED = ("q8_0", "q4_0", "q4_1")
K_QUANT_FILES = ("q4_k_m", "q5_k_m", "q6_k")  # llama-quantize's type names, lower case
WEIGHT_ONLY = ("int8", "int4", "int4wo-128")
VARIANTS = ("none", "gguf", *(f"gguf-{f}" for f in REQUANTIZED), *(f"file-{f}" for f in K_QUANT_FILES),
            *WEIGHT_ONLY, "kv-int8", "kv-fp8_e4m3", "kv-fp8_e5m2")


def runner_for(variant: str, model: str | None, dtype: str = "bfloat16") -> ModelRunner:
    """A model runner for `variant` (module docstring), a small KV pool."""
    kwargs = dict(model_path=model, dtype=dtype, max_total_tokens=4096, log_level="warning")
    if variant.startswith("kv-"):
        kwargs.update(quantization="none", kv_cache_dtype=variant.removeprefix("kv-"))
    elif variant in ("none", "gguf", *WEIGHT_ONLY):
        kwargs.update(quantization=variant)
    elif variant.startswith("file-"):
        kwargs.update(model_path=str(k_quant_file(variant.removeprefix("file-"))), quantization="gguf")
    else:
        kwargs.update(quantization="none")
    runner = ModelRunner(ServerArgs.from_kwargs(**kwargs))
    if variant.startswith("gguf-"):
        requantize_linears(runner.model, variant.removeprefix("gguf-"))
    return runner


def k_quant_file(fmt: str) -> Path:
    """The default model as a `fmt` GGUF file written by llama-quantize (ValueError without the tool)."""
    from benchmarks import gguf_models

    path = gguf_models.llama_quantize(gguf_models.requantized_default("F16"), fmt.upper())
    if path is None:
        raise ValueError(f"{gguf_models.LLAMA_QUANTIZE} is not built: run benchmarks/peers/llama_cpp.sh install")
    return path


def requantize_linears(model: torch.nn.Module, fmt: str) -> None:
    """Every `Linear` of `model` quantized to ggml type `fmt` and served by the quantized kernels."""
    import gguf

    from arborlm.kernels.quant_layout import pack_ggml_blocks
    from arborlm.kernels.quant_ops import quant_ops
    from arborlm.runtime.layers.linear import Linear
    from arborlm.runtime.layers.quantization.quant_linear import WHOLE, QuantizedLinear

    ops = quant_ops("cpu")
    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    for path, module in list(model.named_modules()):
        if isinstance(module, Linear):
            raw = gguf.quants.quantize(module.weight.detach().float().numpy(), qtype)
            layer = QuantizedLinear.replacing(module, ops, whole=True)
            layer.load_shard(WHOLE, pack_ggml_blocks(fmt, torch.from_numpy(raw), module.weight.shape[1]), path)
            if module.bias is not None:
                layer.load_bias(WHOLE, module.bias.detach(), f"{path}.bias")
            layer.finish(path)
            model.set_submodule(path, layer)


def window_nll(runner: ModelRunner, ids: list[int], chunk: int = 0) -> float:
    """Summed negative log-likelihood (nats) of ids[1:] given the tokens before: one prefill,
    or with `chunk` > 0 extend steps of at most `chunk` new tokens over the cached prefix (at
    <= 64 rows, `quant_ops.INT8_MAX_ROWS`, the quantized linears take their decode kernels,
    int8 activations included, instead of the dequantized GEMM of long prefills)."""
    (row,) = runner.req_to_token_pool.alloc(1)
    loc = runner.token_to_kv_pool_allocator.alloc(len(ids))
    try:
        runner.req_to_token_pool.req_to_token[row, :len(ids)] = loc.to(torch.int32)
        step = chunk if chunk > 0 else len(ids)
        logits = []
        for start in range(0, len(ids), step):
            end = min(start + step, len(ids))
            batch = ForwardBatch.build(
                ForwardMode.EXTEND, ids[start:end], [row], [start], [end - start], loc[start:end],
                runner.req_to_token_pool, runner.token_to_kv_pool, return_full_logits=True,
            )
            logits.append(runner.forward(batch).full_logits.float())
        return float(F.cross_entropy(torch.cat(logits)[:-1], torch.tensor(ids[1:]), reduction="sum"))
    finally:
        runner.req_to_token_pool.free(row)
        runner.token_to_kv_pool_allocator.free(loc)


def greedy_tokens(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of `prompts`, batched: one prefill, then decode steps."""
    rows = runner.req_to_token_pool.alloc(len(prompts))
    if rows is None:
        raise ValueError(f"{len(prompts)} prompts exceed the runner's request rows")
    taken, seq_lens = [], [0] * len(prompts)
    try:
        new_ids = prompts
        outputs: list[list[int]] = [[] for _ in prompts]
        for step in range(max_new_tokens):
            lens = [len(ids) for ids in new_ids]
            loc = runner.token_to_kv_pool_allocator.alloc(sum(lens))
            if loc is None:
                raise ValueError("the KV pool is too small for the greedy prompts")
            taken.append(loc)
            start = 0
            for row, prefix, n in zip(rows, seq_lens, lens):
                runner.req_to_token_pool.req_to_token[row, prefix:prefix + n] = loc[start:start + n].to(torch.int32)
                start += n
            mode = ForwardMode.EXTEND if step == 0 else ForwardMode.DECODE
            batch = ForwardBatch.build(
                mode, [t for ids in new_ids for t in ids], rows, seq_lens, lens, loc, runner.req_to_token_pool,
                runner.token_to_kv_pool,
            )
            next_ids = runner.forward(batch).next_token_logits.argmax(-1).tolist()
            seq_lens = [p + n for p, n in zip(seq_lens, lens)]
            for out, t in zip(outputs, next_ids):
                out.append(t)
            new_ids = [[t] for t in next_ids]
        return outputs
    finally:
        runner.req_to_token_pool.free(rows)
        for loc in taken:
            runner.token_to_kv_pool_allocator.free(loc)


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of positions where `tokens` equals `reference`."""
    same = sum(a == b for t, r in zip(tokens, reference) for a, b in zip(t, r))
    return same / sum(len(r) for r in reference)


def perplexity(runner: ModelRunner, windows: list[list[int]], chunk: int = 0) -> tuple[float, int]:
    """(perplexity, tokens scored) over the windows (`chunk`: see `window_nll`)."""
    nll = sum(window_nll(runner, w, chunk) for w in windows)
    scored = sum(len(w) - 1 for w in windows)
    return math.exp(nll / scored), scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file; default SmolLM2-135M-Instruct (Q4_1)")
    parser.add_argument("--window", type=int, default=512, help="tokens per prefill window")
    parser.add_argument("--chunk", type=int, default=0,
                        help="score each window in extend steps of at most this many tokens (0: one prefill); "
                             "<= 64 puts the quantized decode kernels in the perplexity")
    parser.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v != "int4wo-128"], choices=VARIANTS)
    parser.add_argument("--greedy-prompts", type=int, default=32, help="prompts for greedy agreement (0: none)")
    parser.add_argument("--greedy-tokens", type=int, default=64, help="greedy tokens per prompt")
    args = parser.parse_args()
    if "none" not in args.variants:
        args.variants.insert(0, "none")

    from transformers import AutoTokenizer

    results, greedy = {}, {}
    windows = prompts = None
    for variant in args.variants:
        start = time.perf_counter()
        runner = runner_for(variant, args.model)
        if windows is None:
            tokenizer = AutoTokenizer.from_pretrained(str(runner.checkpoint))
            ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
            windows = [ids[i:i + args.window] for i in range(0, len(ids), args.window) if len(ids[i:i + args.window]) > 1]
            stride = max(1, (len(ids) - 32) // max(args.greedy_prompts, 1))
            prompts = [ids[i * stride:i * stride + 32] for i in range(args.greedy_prompts)]
        results[variant] = perplexity(runner, windows, args.chunk)
        if prompts:
            greedy[variant] = greedy_tokens(runner, prompts, args.greedy_tokens)
        print(f"{variant}: perplexity {results[variant][0]:.4f} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
        del runner
    base = results["none"][0]
    print(f"| variant | perplexity | / none | tokens scored | greedy agreement with none "
          f"({args.greedy_prompts} x {args.greedy_tokens}) |")
    print("|---|---:|---:|---:|---:|")
    for variant, (ppl, scored) in results.items():
        rate = f"{agreement(greedy[variant], greedy['none']):.3f}" if greedy else "-"
        print(f"| {variant} | {ppl:.3f} | {ppl / base:.4f} | {scored} | {rate} |")
    steps = f"extend steps of {args.chunk} tokens" if args.chunk > 0 else "one prefill each"
    print(f"\nwindow {args.window} tokens over {TEXT.name} ({steps}); bf16 activations")


if __name__ == "__main__":
    main()
