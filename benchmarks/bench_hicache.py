"""The host KV tier (`--enable-hierarchical-cache`) on a multi-turn agent workload larger than the pool.

`--num-agents` agents share one `--system-len` token system prompt; each has its
own `--context-len` token task context (a tool output, a document) and runs
`--num-turns` turns: a turn's prompt is the agent's whole history (system,
context, every earlier user message and answer) plus a new `--user-len` token
user message, and it generates `--output-len` greedy tokens (ignore_eos). All
agents send turn t together, turn t+1 after every turn-t answer is back (an agent
loop). The histories together are several times the KV pool (`--max-total-tokens`),
so without a host tier most of an agent's history has been evicted when its next
turn comes and is prefilled again.

Two in-process schedulers on the same model and pool size, one with the host
tier (`--hicache-ratio` times the pool) and one without, run the same workload
interleaved turn by turn in one process (the order alternates every turn), so
the machine's drift hits both alike. Per mode: prefill tokens computed (the
scheduler's `num_prefill_tokens_computed`), cache hit rates per tier, tokens
loaded back, TTFT p50/p95 over the turns after the first (counted from the
moment the turn's requests arrive) and wall time. Timing runs go under
`flock /tmp/arborlm-timing.lock` on a shared machine.

Example (the table in docs/hicache.md)::

    flock /tmp/arborlm-timing.lock .venv/bin/python benchmarks/bench_hicache.py \\
        --markdown-out benchmarks/results/hicache.md
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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from arborlm.runtime.config import ServerArgs
from arborlm.runtime.io_struct import TokenizedGenerateReqInput
from arborlm.runtime.scheduler import Scheduler
from arborlm.sampling_params import SamplingParams

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SEED = 0
# Token ids drawn for prompts: ordinary vocabulary, clear of the special tokens at the bottom.
TOKEN_RANGE = (1000, 40000)


@dataclass
class ModeResult:
    """What one scheduler did over the whole workload."""

    mode: str
    prefill_tokens_computed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    loaded_back_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)  # turns after the first
    wall_s: float = 0.0

    def row(self) -> dict[str, float | int | str]:
        ttft = sorted(self.ttft_s)
        return {
            "mode": self.mode,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "cache_hit_rate": self.cached_tokens / self.prompt_tokens,
            "host_hit_rate": self.host_cached_tokens / self.prompt_tokens,
            "loaded_back_tokens": self.loaded_back_tokens,
            "ttft_p50_s": statistics.median(ttft),
            "ttft_p95_s": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
            "wall_s": self.wall_s,
        }


class Agents:
    """The agents' histories (token ids), one list per agent, grown turn by turn."""

    def __init__(self, args: argparse.Namespace):
        self.rng = random.Random(SEED)
        system = self.tokens(args.system_len)
        self.histories = [system + self.tokens(args.context_len) for _ in range(args.num_agents)]
        self.user_msgs = [[self.tokens(args.user_len) for _ in range(args.num_turns)] for _ in range(args.num_agents)]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def make_scheduler(args: argparse.Namespace, hicache: bool) -> Scheduler:
    kwargs = dict(max_total_tokens=args.max_total_tokens, device="cpu", log_level="warning",
                  chunked_prefill_size=args.chunked_prefill_size)
    if args.model:
        kwargs["model"] = args.model
    if args.dtype:
        kwargs["dtype"] = args.dtype
    if hicache:
        kwargs.update(enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio)
    return Scheduler(ServerArgs.from_kwargs(**kwargs))


def run_turn(sched: Scheduler, histories: list[list[int]], turn: int, args: argparse.Namespace) -> tuple[
        list[list[int]], list[float]]:
    """Send every agent's turn at once, step until all finish; return the answers and TTFTs (s)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=args.output_len, ignore_eos=True).normalized()
    for a, prompt in enumerate(histories):
        sched.add_request(TokenizedGenerateReqInput(rid=f"a{a}t{turn}", input_ids=prompt, sampling_params=params,
                                                    seed=0))
    start = time.perf_counter()
    answers: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    while sched.has_work():
        for out in sched.step():
            if out.new_token_ids and out.rid not in first:
                first[out.rid] = time.perf_counter() - start
            answers.setdefault(out.rid, []).extend(out.new_token_ids)
    rids = [f"a{a}t{turn}" for a in range(len(histories))]
    return [answers[r] for r in rids], [first[r] for r in rids]


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(SEED)
    schedulers = {"hicache off": make_scheduler(args, False), "hicache on": make_scheduler(args, True)}
    # Both modes get the same prompts each turn (the histories grow with the first mode's
    # answers), so their answers can be compared turn by turn: a float32 near-tie flipped by
    # a different prefill split then costs one agent-turn, not the rest of that history.
    agents = Agents(args)
    results = {mode: ModeResult(mode) for mode in schedulers}
    same_answers = 0
    warm = Agents(args).tokens(64)
    for sched in schedulers.values():  # one warm-up request each (kernels compiled, caches touched)
        run_turn(sched, [warm], -1, args)
        sched.flush_cache()
        sched.stats = {key: 0 for key in sched.stats}
    for turn in range(args.num_turns):
        order = list(schedulers) if turn % 2 == 0 else list(reversed(schedulers))
        prompts = [h + agents.user_msgs[a][turn] for a, h in enumerate(agents.histories)]
        answers = {}
        for mode in order:
            sched, result = schedulers[mode], results[mode]
            t0 = time.perf_counter()
            answers[mode], ttfts = run_turn(sched, prompts, turn, args)
            result.wall_s += time.perf_counter() - t0
            if turn > 0:
                result.ttft_s += ttfts
        same_answers += sum(a == b for a, b in zip(answers["hicache off"], answers["hicache on"]))
        agents.histories = [p + ans for p, ans in zip(prompts, answers["hicache off"])]
    for mode, sched in schedulers.items():
        info, result = sched.get_info(), results[mode]
        result.prefill_tokens_computed = info["num_prefill_tokens_computed"]
        result.prompt_tokens = info["num_prompt_tokens"]
        result.cached_tokens = info["num_cached_tokens"]
        result.host_cached_tokens = info["num_host_cached_tokens"]
        result.loaded_back_tokens = info.get("hicache_loaded_back_tokens", 0)
    rows = [results[m].row() for m in schedulers]
    off, on = rows
    history_len = statistics.mean(len(h) for h in agents.histories)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
        "model": schedulers["hicache on"].model_info.checkpoint, "dtype": schedulers["hicache on"].model_info.dtype,
        "args": vars(args), "final_history_tokens_mean": history_len,
        "histories_total_tokens": history_len * args.num_agents,
        "host_tier_tokens": schedulers["hicache on"].get_info()["hicache_host_total_tokens"],
        "same_answers": same_answers, "answers": args.num_agents * args.num_turns,
        "rows": rows,
        "ratios": {
            "prefill_tokens_off_over_on": off["prefill_tokens_computed"] / on["prefill_tokens_computed"],
            "ttft_p50_off_over_on": off["ttft_p50_s"] / on["ttft_p50_s"],
            "ttft_p95_off_over_on": off["ttft_p95_s"] / on["ttft_p95_s"],
            "wall_off_over_on": off["wall_s"] / on["wall_s"],
        },
    }


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [
        f"{a['num_agents']} agents x {a['num_turns']} turns; system {a['system_len']}, context {a['context_len']}, "
        f"user {a['user_len']}, output {a['output_len']} tokens; KV pool {a['max_total_tokens']} tokens, host tier "
        f"{report['host_tier_tokens']} tokens; histories at the end {report['histories_total_tokens']:.0f} tokens "
        f"in all; {report['model']} ({report['dtype']}), {report['cpu_count']} CPUs, {report['date']}",
        "",
        "| mode | prefill tokens computed | cache hit rate | of it from host | tokens loaded back "
        "| TTFT p50 (s) | TTFT p95 (s) | wall (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['mode']} | {r['prefill_tokens_computed']} | {r['cache_hit_rate']:.1%} | {r['host_hit_rate']:.1%} "
            f"| {r['loaded_back_tokens']} | {r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} | {r['wall_s']:.1f} |"
        )
    x = report["ratios"]
    lines += [
        "",
        f"off / on: prefill tokens {x['prefill_tokens_off_over_on']:.2f}x, TTFT p50 {x['ttft_p50_off_over_on']:.2f}x, "
        f"TTFT p95 {x['ttft_p95_off_over_on']:.2f}x, wall {x['wall_off_over_on']:.2f}x; "
        f"answers identical with and without the host tier: {report['same_answers']}/{report['answers']}",
    ]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-agents", type=int, default=8)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--context-len", type=int, default=384)
    p.add_argument("--user-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--chunked-prefill-size", type=int, default=1024)
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--json-out", type=Path, default=RESULTS_DIR / "hicache.json")
    p.add_argument("--markdown-out", type=Path, default=None)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    report = run(args)
    text = markdown(report)
    print(text)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(report | {"args": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    if args.markdown_out is not None:
        args.markdown_out.write_text(text)


if __name__ == "__main__":
    main()
