"""Offline throughput of the in-process Engine against transformers `generate`.

One run, one model, one dtype:

1. Throughput: `--num-prompts` prompts of exactly `--input-len` tokens, each
   generating `--output-len` tokens (ignore_eos), sent to the Engine in one
   `generate` call; the same prompts through transformers `generate` one request
   at a time (on the first `--sequential-prompts` prompts, since it is slow) and
   in left-padded static batches of `--static-batch`.
2. Shared prefix: `--shared-requests` requests made of one `--shared-prefix-len`
   token system prompt and a different question each, sent at once to an Engine
   with the radix cache on and to one with `disable_radix_cache=True`.

The Engines run first and are shut down before transformers loads, so the two
never compete for the CPU cores. Output tok/s = generated tokens / wall time.
Prints a markdown table with ratios and the targets, and writes JSON.

Example (the full run)::

    .venv/bin/python benchmarks/bench_offline.py --markdown-out benchmarks/results/offline.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

import arborlm

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SEED = 0
WARMUP_SEED = 12345

# Target ratios of the issue: Engine vs one-at-a-time, Engine vs static batches,
# radix cache on vs off with a shared prefix (all in output tok/s).
TARGET_VS_SEQUENTIAL = 8.0
TARGET_VS_STATIC = 2.0
TARGET_CACHE_ON_VS_OFF = 3.0

# Prompts are shuffled words of this paragraph, so they read like text and
# tokenize like text (not like random ids).
CORPUS = """
The river town woke slowly under a pale autumn sky. Fishermen pulled their boats
onto the gravel bank while the baker opened the shutters and set out trays of warm
bread. Children ran along the old stone wall, counting the barges that drifted past
with loads of timber, coal and grain. At the station a clerk checked the timetable,
wrote the arrivals on a small blackboard and answered questions about the mountain
line, which had been closed for repairs since the spring floods washed away part of
the embankment. In the library a student read about the history of the canal, how
engineers measured the fall of the land, dug locks by hand and argued for years over
the cost. Later the market filled with farmers selling apples, cheese, honey and
wool, and the square echoed with bargaining, laughter and the bells of the church.
Scientists at the nearby observatory prepared their instruments for the night,
hoping the clouds would clear so they could record the passage of a bright comet.
"""

QUESTION_STARTS = [
    "Summarize", "Explain", "Describe", "List", "Compare", "Why did", "How would you",
    "What happened to", "Translate", "Rewrite", "Criticize", "Continue",
]


@dataclass
class Result:
    """One measured system: throughput, latency and prefill work."""

    system: str
    num_requests: int
    output_tokens: int
    wall_s: float
    prefill_tokens_computed: int
    prompt_tokens: int
    mean_ttft_s: float | None = None
    p50_ttft_s: float | None = None
    cache_hit_rate: float | None = None
    note: str = ""

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.wall_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}


# ---- prompts ----------------------------------------------------------------


def text_ids(tokenizer, rng: random.Random, num_tokens: int, start: str = "") -> list[int]:
    """Exactly `num_tokens` ids of shuffled corpus words (after `start`), no special tokens."""
    words = CORPUS.split()
    ids: list[int] = []
    text = start
    while len(ids) < num_tokens:
        rng.shuffle(words)
        text = (text + " " + " ".join(words)).strip()
        ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[:num_tokens]


def make_prompts(tokenizer, num: int, length: int, seed: int) -> list[list[int]]:
    """`num` distinct seeded prompts of exactly `length` token ids."""
    rng = random.Random(seed)
    return [text_ids(tokenizer, rng, length) for _ in range(num)]


def make_shared_prompts(tokenizer, prefix_len: int, num: int, question_len: int) -> list[list[int]]:
    """One `prefix_len`-token system prompt followed by `num` different questions."""
    rng = random.Random(SEED + 1)
    system = text_ids(tokenizer, rng, prefix_len, start="You are a helpful assistant for a river town.")
    prompts = []
    for i in range(num):
        start = f"Question {i + 1}: {QUESTION_STARTS[i % len(QUESTION_STARTS)]}"
        prompts.append(system + text_ids(tokenizer, rng, question_len, start=start))
    return prompts


# ---- arborlm Engine ---------------------------------------------------------


def greedy_params(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}


def warm_up(engine: arborlm.Engine) -> None:
    """A few short requests (compiles, allocates), then an empty cache."""
    prompts = make_prompts(engine.tokenizer, 4, 32, WARMUP_SEED)
    engine.generate(input_ids=prompts, sampling_params=greedy_params(8))
    engine.flush_cache()


def run_engine(engine: arborlm.Engine, system: str, prompts: list[list[int]], output_len: int) -> Result:
    """Send every prompt in one `generate` call and time it."""
    before = engine.get_server_info()
    start = time.perf_counter()
    outputs = engine.generate(input_ids=prompts, sampling_params=greedy_params(output_len))
    wall_s = time.perf_counter() - start
    after = engine.get_server_info()

    def delta(key: str) -> int:
        return after[key] - before[key]

    metas = [o["meta_info"] for o in outputs]
    ttfts = [m["ttft"] for m in metas if m.get("ttft") is not None]
    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    return Result(
        system=system,
        num_requests=len(prompts),
        output_tokens=sum(m["completion_tokens"] for m in metas),
        wall_s=wall_s,
        prefill_tokens_computed=delta("num_prefill_tokens_computed"),
        prompt_tokens=prompt_tokens,
        mean_ttft_s=statistics.mean(ttfts) if ttfts else None,
        p50_ttft_s=statistics.median(ttfts) if ttfts else None,
        cache_hit_rate=delta("num_cached_tokens") / max(delta("num_prompt_tokens"), 1),
    )


def bench_engines(args, shared_prompts_fn) -> tuple[list[Result], dict[str, Any], list[list[int]]]:
    """Engine throughput, then the shared-prefix runs with the cache on and off.

    Returns the results, the model facts, and the throughput prompts (for the baselines).
    """
    print(f"[engine] starting (model={args.model or 'default'}, dtype={args.dtype}, radix cache on)", flush=True)
    engine = arborlm.Engine(model=args.model, dtype=args.dtype)
    try:
        info = {
            "checkpoint": engine.model_info.checkpoint,
            "dtype": engine.model_info.dtype,
            "device": engine.model_info.device,
            "architecture": engine.model_info.architecture,
        }
        prompts = make_prompts(engine.tokenizer, args.num_prompts, args.input_len, SEED)
        shared = shared_prompts_fn(engine.tokenizer)
        print(f"[engine] dtype={info['dtype']} device={info['device']}; warming up", flush=True)
        warm_up(engine)
        print(f"[engine] {args.num_prompts} prompts x {args.input_len} in -> {args.output_len} out", flush=True)
        throughput = run_engine(engine, "arborlm Engine", prompts, args.output_len)
        print(f"[engine] {throughput.output_tok_s:.1f} output tok/s", flush=True)
        engine.flush_cache()
        print(f"[shared prefix] cache on: {len(shared)} requests", flush=True)
        cache_on = run_engine(engine, "arborlm Engine, radix cache on", shared, args.shared_output_len)
        print(f"[shared prefix] cache on: {cache_on.output_tok_s:.1f} output tok/s", flush=True)
    finally:
        engine.shutdown()

    print("[shared prefix] starting an engine with disable_radix_cache=True", flush=True)
    engine = arborlm.Engine(model=args.model, dtype=args.dtype, disable_radix_cache=True)
    try:
        warm_up(engine)
        print(f"[shared prefix] cache off: {len(shared)} requests", flush=True)
        cache_off = run_engine(engine, "arborlm Engine, radix cache off", shared, args.shared_output_len)
        print(f"[shared prefix] cache off: {cache_off.output_tok_s:.1f} output tok/s", flush=True)
    finally:
        engine.shutdown()
    return [throughput, cache_on, cache_off], info, prompts


# ---- transformers baselines -------------------------------------------------


class FirstTokenTimer(transformers.generation.streamers.BaseStreamer):
    """Records when `generate` emits its first new token (its first `put` is the prompt)."""

    def __init__(self):
        self.num_puts = 0
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        """Part of transformers' streamer interface; nothing to record at the end."""


def load_hf(checkpoint: str, dtype: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return model, pad_id


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) input ids and attention mask, padded on the left to the longest prompt."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p):] = torch.tensor(p)
        mask[row, longest - len(p):] = 1
    return ids, mask


@torch.inference_mode()
def hf_generate(model, pad_id: int, prompts: list[list[int]], output_len: int) -> tuple[int, float, int]:
    """Greedy `generate` on one padded batch: (new tokens, seconds to first token, padded input tokens)."""
    ids, mask = left_pad(prompts, pad_id)
    timer = FirstTokenTimer()
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
        do_sample=False, pad_token_id=pad_id, streamer=timer,
    )
    ttft = (timer.first_token_time or time.perf_counter()) - start
    return (out.shape[1] - ids.shape[1]) * len(prompts), ttft, ids.numel()


def bench_hf(args, info: dict[str, Any], prompts: list[list[int]]) -> list[Result]:
    from tqdm import tqdm

    print(f"[transformers] loading {info['checkpoint']} in {info['dtype']}", flush=True)
    model, pad_id = load_hf(info["checkpoint"], info["dtype"])
    hf_generate(model, pad_id, prompts[:2], 4)  # warm-up

    subset = prompts[: args.sequential_prompts]
    tokens, prefill, ttfts = 0, 0, []
    start = time.perf_counter()
    for p in tqdm(subset, desc="transformers one at a time", unit="req"):
        new, ttft, padded = hf_generate(model, pad_id, [p], args.output_len)
        tokens, prefill = tokens + new, prefill + padded
        ttfts.append(ttft)
    sequential = Result(
        system="transformers generate, one at a time",
        num_requests=len(subset), output_tokens=tokens, wall_s=time.perf_counter() - start,
        prefill_tokens_computed=prefill, prompt_tokens=sum(map(len, subset)),
        mean_ttft_s=statistics.mean(ttfts), p50_ttft_s=statistics.median(ttfts),
        note="TTFT from the start of each request's own generate call",
    )

    batches = [prompts[i: i + args.static_batch] for i in range(0, len(prompts), args.static_batch)]
    tokens, prefill, ttfts = 0, 0, []
    start = time.perf_counter()
    for batch in tqdm(batches, desc=f"transformers static batches of {args.static_batch}", unit="batch"):
        batch_start = time.perf_counter() - start
        new, ttft, padded = hf_generate(model, pad_id, batch, args.output_len)
        tokens, prefill = tokens + new, prefill + padded
        # Every request arrived at the start, as with the Engine: waiting counts.
        ttfts += [batch_start + ttft] * len(batch)
    static = Result(
        system=f"transformers generate, static batches of {args.static_batch}",
        num_requests=len(prompts), output_tokens=tokens, wall_s=time.perf_counter() - start,
        prefill_tokens_computed=prefill, prompt_tokens=sum(map(len, prompts)),
        mean_ttft_s=statistics.mean(ttfts), p50_ttft_s=statistics.median(ttfts),
        note="TTFT from the start of the run (all requests arrive at once)",
    )
    print(f"[transformers] one at a time {sequential.output_tok_s:.1f} tok/s, "
          f"static {static.output_tok_s:.1f} tok/s", flush=True)
    return [sequential, static]


# ---- report -----------------------------------------------------------------


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "—" if value is None else format(value, spec)


def ratio(a: Result | None, b: Result | None) -> float | None:
    return a.output_tok_s / b.output_tok_s if a and b else None


def compute_ratios(by_key: dict[str, Result]) -> dict[str, float | None]:
    return {
        "engine_vs_sequential": ratio(by_key.get("engine"), by_key.get("sequential")),
        "engine_vs_static": ratio(by_key.get("engine"), by_key.get("static")),
        "static_vs_sequential": ratio(by_key.get("static"), by_key.get("sequential")),
        "cache_on_vs_off": ratio(by_key.get("cache_on"), by_key.get("cache_off")),
    }


def ratio_cell(key: str, ratios: dict[str, float | None]) -> str:
    def x(name: str, label: str) -> str:
        return f"{ratios[name]:.2f}× {label}" if ratios[name] is not None else f"— {label}"

    return {
        "sequential": "1.00× (baseline)",
        "static": x("static_vs_sequential", "vs one-at-a-time"),
        "engine": x("engine_vs_sequential", "vs one-at-a-time") + ", " + x("engine_vs_static", "vs static"),
        "cache_off": "1.00× (baseline)",
        "cache_on": x("cache_on_vs_off", "vs cache off"),
    }[key]


def markdown(args, by_key: dict[str, Result], ratios: dict[str, float | None], meta: dict[str, Any]) -> str:
    lines = [
        f"Model `{meta['checkpoint']}` ({meta['architecture']}), dtype {meta['dtype']} for every system, "
        f"device {meta['device']}, {meta['cpu_count']} CPU cores, torch {meta['torch']}, "
        f"transformers {meta['transformers']}, {meta['date']}.",
        "",
        f"Throughput: {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} output "
        f"tokens each (greedy, ignore_eos). Shared prefix: {args.shared_requests} requests of a "
        f"{args.shared_prefix_len}-token system prompt + a {args.shared_question_len}-token question, "
        f"{args.shared_output_len} output tokens each, sent at once.",
        "",
        "| system | requests | output tok/s | ratio | mean TTFT (s) | prefill tokens computed |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for key in ("sequential", "static", "engine", "cache_off", "cache_on"):
        r = by_key.get(key)
        if r is None:
            continue
        requests = str(r.num_requests)
        if key == "sequential":
            requests += f" (of {args.num_prompts})¹"
        lines.append(
            f"| {r.system} | {requests} | {r.output_tok_s:.1f} | {ratio_cell(key, ratios)} | "
            f"{fmt(r.mean_ttft_s)} | {r.prefill_tokens_computed} |"
        )
    hit = by_key["cache_on"].cache_hit_rate
    lines += [
        "",
        "¹ One-at-a-time transformers is slow, so it runs on the first "
        f"{args.sequential_prompts} prompts; its tok/s is still generated tokens / wall time. "
        "Its TTFT counts from the start of each request's own call (no queueing); the Engine's and "
        "the static batches' count from the moment all requests arrive together.",
        f"Cache hit rate with the radix cache on: {fmt(hit, '.1%')}. "
        f"Engine total (input + output) tok/s: {by_key['engine'].total_tok_s:.1f}; "
        f"p50 TTFT {fmt(by_key['engine'].p50_ttft_s)} s.",
        "",
        "Targets:",
        "",
    ]
    for name, target, label in (
        ("engine_vs_sequential", TARGET_VS_SEQUENTIAL, "Engine vs transformers one at a time"),
        ("engine_vs_static", TARGET_VS_STATIC, f"Engine vs transformers static batches of {args.static_batch}"),
        ("cache_on_vs_off", TARGET_CACHE_ON_VS_OFF, "shared prefix, radix cache on vs off"),
    ):
        value = ratios[name]
        mark = "—" if value is None else ("✅" if value >= target else "❌")
        lines.append(f"- {mark} {label}: {fmt(value, '.2f')}× (target ≥ {target:g}×)")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or GGUF file; default SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto",
                   help="Engine dtype; the transformers baselines use the dtype the Engine reports")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="tokens per prompt (exact)")
    p.add_argument("--output-len", type=int, default=128, help="new tokens per request (ignore_eos)")
    p.add_argument("--static-batch", type=int, default=16, help="transformers static batch size")
    p.add_argument("--sequential-prompts", type=int, default=8,
                   help="prompts for the one-at-a-time transformers baseline (a subset: it is slow)")
    p.add_argument("--shared-prefix-len", type=int, default=1000, help="tokens of the shared system prompt")
    p.add_argument("--shared-requests", type=int, default=32)
    p.add_argument("--shared-question-len", type=int, default=32, help="tokens of each question")
    p.add_argument("--shared-output-len", type=int, default=32)
    p.add_argument("--skip-baselines", action="store_true", help="do not run transformers")
    p.add_argument("--json-out", type=Path, default=RESULTS_DIR / "offline.json")
    p.add_argument("--markdown-out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "static_batch", "sequential_prompts",
                 "shared_prefix_len", "shared_requests", "shared_question_len", "shared_output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.sequential_prompts = min(args.sequential_prompts, args.num_prompts)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = datetime.datetime.now().astimezone()

    def shared_prompts_fn(tokenizer):
        return make_shared_prompts(tokenizer, args.shared_prefix_len, args.shared_requests,
                                   args.shared_question_len)

    (engine_r, cache_on, cache_off), info, prompts = bench_engines(args, shared_prompts_fn)
    by_key = {"engine": engine_r, "cache_on": cache_on, "cache_off": cache_off}
    if not args.skip_baselines:
        by_key["sequential"], by_key["static"] = bench_hf(args, info, prompts)

    meta = {
        **info,
        "date": started.isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "arborlm": getattr(arborlm, "__version__", None),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    ratios = compute_ratios(by_key)
    table = markdown(args, by_key, ratios, meta)
    print()
    print(table)

    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "meta": meta,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": {k: r.to_dict() for k, r in by_key.items()},
        "ratios": ratios,
        "targets": {
            "engine_vs_sequential": TARGET_VS_SEQUENTIAL,
            "engine_vs_static": TARGET_VS_STATIC,
            "cache_on_vs_off": TARGET_CACHE_ON_VS_OFF,
        },
    }
    args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json_out}")
    if args.markdown_out is not None:
        args.markdown_out.parent.mkdir(parents=True, exist_ok=True)
        args.markdown_out.write_text(table)
        print(f"wrote {args.markdown_out}")


if __name__ == "__main__":
    main()
