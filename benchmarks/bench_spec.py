"""Speculative decoding: speculation off vs NGRAM vs STANDALONE, interleaved A/B in one run.

In-process Engines on the same model (``speculative_algorithm=None``,
``"NGRAM"`` and ``"STANDALONE"``) stay loaded side by side; every (workload,
batch size) cell runs ``--rounds`` times per engine, rotating which goes
first, so the machine's drift falls on all. Greedy decoding by default; with
``--temperature`` the requests sample, each with its own seed. Either way the
engines must produce the same tokens: the table says how many requests did.

The STANDALONE draft is made in the run from the local weights (nothing is
downloaded): the target truncated to its first ``--draft-layers`` decoder
layers (embeddings, those layers, the final norm and the tied head), saved as
a checkpoint folder with the target's tokenizer. ``--draft-self`` adds a
STANDALONE engine whose draft is the target itself: the upper bound of
acceptance (every draft token accepted in float32), at twice the compute.

Workloads (chat-templated prompts for the default SmolLM2-135M-Instruct):

* ``copy``: repeat a given passage word for word (RAG answers that quote);
* ``json``: extract fields of a given record as JSON under a JSON schema;
* ``code``: rewrite a given function with one variable renamed;
* ``chat``: free-form answers to open questions (little to copy);
* ``agent``: the ReAct loop of ``bench_serving.py`` (``benchmarks/serving/workloads.py``):
  per client a session of ``--agent-steps`` dependent calls (a shared system prompt
  listing the tools, the question, then each answer and a tool observation appended),
  each call stopping at "Observation:". A cell of batch B runs B sessions as B
  clients in lock step: each wave sends every session's next call in one batch.

A cell of a batch smaller than ``--min-prompts`` (4) runs that many prompts (agent:
sessions) in consecutive batches (batch 1: four one after another), so a batch-1
figure does not hang on one prompt (on SmolLM2 some "repeat this passage"
prompts are paraphrased, not copied).

Per cell and method: output tok/s (completion tokens / wall time of the batch),
TPOT p50/p95 ((e2e - ttft) / (tokens - 1) per request), the mean accept length
(tokens emitted per request and verify step), target forward steps, draft
model forward steps, and the ratio method/off of the medians over rounds.
Timing runs take /tmp/arborlm-timing.lock::

    flock /tmp/arborlm-timing.lock .venv/bin/python benchmarks/bench_spec.py \\
        --batch-sizes 1 8 32 --rounds 3 --markdown-out benchmarks/results/spec.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import arborlm  # noqa: E402
from benchmarks.serving.workloads import Session, WorkloadSpec, iter_sessions  # noqa: E402

SENTENCES = [
    "The radix cache keeps every prompt prefix it has seen, so a second call with the same system prompt starts at once.",
    "Grammar masks remove every token the schema forbids before sampling, which makes the output valid by construction.",
    "Continuous batching lets new requests join the running batch between two decode steps.",
    "A request that runs out of memory is retracted and later resumes from its cached tokens.",
    "The scheduler prefers requests whose prompts share the longest cached prefix.",
    "Chunked prefill splits a long prompt into pieces so decoding requests keep their pace.",
    "Speculative decoding drafts several tokens and checks them all in one forward pass.",
    "The tokenizer manager streams text to clients as soon as the detokenizer emits it.",
]
NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth"]
CITIES = ["London", "Manchester", "New York", "Amsterdam", "Boston", "Stanford"]
QUESTIONS = [
    "What makes a good breakfast?", "Why do cats purr?", "Describe a walk in the forest.",
    "What is your favourite season and why?", "Give advice to a new gardener.", "How do birds find their way?",
]
RECORD_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "year": {"type": "integer"},
                   "summary": {"type": "string"}},
    "required": ["name", "city", "year", "summary"],
}


def workload_prompts(engine, workload: str, n: int, seed: int) -> tuple[list[str], dict[str, Any]]:
    """``n`` chat prompts of ``workload`` and its extra sampling fields."""
    rng = random.Random(seed)
    prompts, extra = [], {}
    for i in range(n):
        if workload == "copy":
            passage = " ".join(rng.sample(SENTENCES, 3))
            content = f"Repeat the following passage word for word.\n\n{passage}"
        elif workload == "json":
            name, city, year = NAMES[i % len(NAMES)], rng.choice(CITIES), rng.randrange(1900, 2000)
            summary = rng.choice(SENTENCES)
            content = (f"Record: name: {name}; city: {city}; year: {year}; summary: {summary}\n"
                       "Give this record as JSON with the keys name, city, year and summary, copying the values.")
            extra = {"json_schema": RECORD_SCHEMA}
        elif workload == "code":
            var = rng.choice(["total", "acc", "result", "value"])
            func = ("def add_all(items):\n    s = 0\n    for item in items:\n        s = s + item\n"
                    "    print('sum so far', s)\n    return s\n")
            content = f"Rewrite this Python function with the variable s renamed to {var}.\n\n```python\n{func}```"
        elif workload == "chat":
            content = QUESTIONS[(i + seed) % len(QUESTIONS)]
        else:
            raise ValueError(f"workload={workload!r} is unknown")
        prompts.append(engine.apply_chat_template([{"role": "user", "content": content}]))
    return prompts, extra


def run_cell(engine, prompts: list[str], params: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
    """One batch through one engine: throughput, TPOT per request, accept length, output ids."""
    before = engine.get_server_info()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    after = engine.get_server_info()
    tpot = [(o["meta_info"]["e2e_latency"] - o["meta_info"]["ttft"]) / (o["meta_info"]["completion_tokens"] - 1)
            for o in outs if o["meta_info"]["completion_tokens"] > 1 and o["meta_info"]["ttft"] is not None]

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    return summarise_cell({
        "wall_s": wall, "tokens": sum(o["meta_info"]["completion_tokens"] for o in outs), "tpot_s": tpot,
        "spec_reqs": sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs),
        "accepted": delta("spec_num_accepted_tokens"), "verify_steps": delta("spec_num_verify_steps"),
        "steps": delta("num_decode_steps") + delta("num_extend_steps"),
        "draft_steps": delta("spec_num_draft_forward_steps"),
        "output_ids": [o["output_ids"] for o in outs], "texts": [o["text"] for o in outs],
    })


def summarise_cell(raw: dict[str, Any]) -> dict[str, Any]:
    """The figures of one cell from its raw counts (`run_cell`'s, or several waves' summed)."""
    tpot = sorted(raw["tpot_s"])
    return {
        **raw, "tok_s": raw["tokens"] / raw["wall_s"],
        "tpot_p50_ms": 1e3 * statistics.median(tpot) if tpot else 0.0,
        "tpot_p95_ms": 1e3 * tpot[max(0, round(0.95 * len(tpot)) - 1)] if tpot else 0.0,
        "accept_len": (raw["spec_reqs"] + raw["accepted"]) / raw["spec_reqs"] if raw["spec_reqs"] else 1.0,
    }


def agent_sessions(engine, n: int, seed: int, args) -> list[Session]:
    """``n`` sessions of bench_serving's agent workload, sized by ``args`` (tokens)."""
    spec = WorkloadSpec("agent", output_len=args.max_new_tokens, system_len=args.agent_system_len,
                        question_len=args.agent_question_len, observation_len=args.agent_question_len,
                        agent_steps=args.agent_steps)

    def count(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    return list(itertools.islice(iter_sessions(spec, count, seed), n))


def run_agent_cell(engine, sessions: list[Session], params: dict[str, Any]) -> dict[str, Any]:
    """The sessions as concurrent clients in lock step: each wave is one batch of every live
    session's next call (its chat messages, ``max_tokens`` and stop strings); the answers' texts
    feed the next calls. Figures are those of all waves together (wall time summed)."""
    scripts = [s.start() for s in sessions]
    calls = {i: next(script) for i, script in enumerate(scripts)}
    waves, ids = [], [[] for _ in sessions]
    while calls:
        order = sorted(calls)
        prompts = [engine.apply_chat_template(list(calls[i].messages)) for i in order]
        waves.append(run_cell(engine, prompts, [{**seeded(params, i), "max_new_tokens": calls[i].max_tokens,
                                                 "stop": list(calls[i].stop)} for i in order]))
        for i, out_ids, text in zip(order, waves[-1]["output_ids"], waves[-1]["texts"]):
            ids[i] += out_ids
            try:
                calls[i] = scripts[i].send(text)
            except StopIteration:
                del calls[i]
    return {**sum_waves(waves), "output_ids": ids}


def run_in_waves(engine, prompts: list[str], batch: int, params: dict[str, Any]) -> dict[str, Any]:
    """``prompts`` as consecutive batches of ``batch`` (a batch-1 cell of several prompts)."""
    return join_cells([run_cell(engine, prompts[i : i + batch], [seeded(params, j) for j in range(i, i + len(prompts[i : i + batch]))])
                       for i in range(0, len(prompts), batch)])


def join_cells(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Consecutive cells as one (counts and wall time summed, outputs in order)."""
    return {**sum_waves(cells), "output_ids": [ids for c in cells for ids in c["output_ids"]]}


def sum_waves(waves: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell's figures from consecutive waves (counts and wall time summed)."""
    keys = ("wall_s", "tokens", "tpot_s", "spec_reqs", "accepted", "verify_steps", "steps", "draft_steps")
    total: dict[str, Any] = {key: sum((w[key] for w in waves), [] if key == "tpot_s" else 0) for key in keys}
    return summarise_cell(total)


def make_truncated_draft(model: str | None, num_layers: int, folder: Path) -> Path:
    """The target's first ``num_layers`` decoder layers as a checkpoint folder (float32 safetensors
    and the target's tokenizer files), built from the local weights."""
    from transformers import AutoModelForCausalLM

    from arborlm.runtime.model_loader import resolve_checkpoint

    source = resolve_checkpoint(model, progress=False)
    draft = AutoModelForCausalLM.from_pretrained(str(source), num_hidden_layers=num_layers)
    draft.save_pretrained(folder)
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            (folder / path.name).write_bytes(path.read_bytes())
    return folder


def make_engines(args, tmp: Path) -> dict[str, Any]:
    """One Engine per method of ``args.methods`` (plus the draft = target one with ``--draft-self``)."""
    common = dict(model=args.model, dtype=args.dtype, quantization=args.quantization, log_level="warning",
                  random_seed=0, max_running_requests=64)
    engines = {"off": arborlm.Engine(**common)}
    if "ngram" in args.methods:
        for k in args.num_draft_tokens:
            name = "ngram" if len(args.num_draft_tokens) == 1 else f"ngram-{k}"
            engines[name] = arborlm.Engine(**common, speculative_algorithm="NGRAM", speculative_num_draft_tokens=k)
    drafts = {}
    if "standalone" in args.methods:
        drafts["standalone"] = str(make_truncated_draft(args.model, args.draft_layers, tmp / "draft"))
    if args.draft_self:
        from arborlm.runtime.model_loader import resolve_checkpoint

        drafts["standalone-self"] = str(resolve_checkpoint(args.model, progress=False))
    for name, path in drafts.items():
        engines[name] = arborlm.Engine(**common, speculative_algorithm="STANDALONE",
                                       speculative_draft_model_path=path, speculative_num_steps=args.num_steps)
    return engines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (float32 keeps greedy identity exact)")
    ap.add_argument("--quantization", default=None, help="gguf | none (default: the model's)")
    ap.add_argument("--workloads", nargs="+", default=["copy", "json", "code", "chat", "agent"],
                    choices=["copy", "json", "code", "chat", "agent"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--methods", nargs="+", default=["ngram", "standalone"], choices=["ngram", "standalone"],
                    help="what is compared with speculation off")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above: sampled, request i of a batch seeded --seed + i (outputs still "
                         "equal to speculation off's)")
    ap.add_argument("--seed", type=int, default=1000, help="the first request seed when --temperature > 0")
    ap.add_argument("--top-p", type=float, default=1.0, help="sampled requests' top_p")
    ap.add_argument("--num-draft-tokens", type=int, nargs="+", default=[6],
                    help="NGRAM: speculative_num_draft_tokens; several values: one NGRAM engine each (ngram-K), "
                         "interleaved in the same run")
    ap.add_argument("--num-steps", type=int, default=3, help="STANDALONE: speculative_num_steps")
    ap.add_argument("--draft-layers", type=int, default=4, help="STANDALONE: decoder layers kept in the draft")
    ap.add_argument("--draft-self", action="store_true", help="also STANDALONE with the target as its own draft")
    ap.add_argument("--min-prompts", type=int, default=4,
                    help="a cell of a smaller batch runs this many prompts, in consecutive batches")
    ap.add_argument("--agent-steps", type=int, default=3, help="agent: calls per session")
    ap.add_argument("--agent-system-len", type=int, default=256, help="agent: system prompt tokens (the tools)")
    ap.add_argument("--agent-question-len", type=int, default=32, help="agent: question and observation tokens")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--markdown-out", default=None)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench_spec_") as tmp:
        engines = make_engines(args, Path(tmp))
        try:
            rows = bench(engines, args)
        finally:
            for e in engines.values():
                e.shutdown()
    table = markdown(rows, args)
    print(table)
    if args.markdown_out:
        Path(args.markdown_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown_out).write_text(table + "\n")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


def bench(engines: dict[str, Any], args) -> list[dict[str, Any]]:
    params = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens}
    if args.temperature > 0:
        params.update(seed=args.seed, top_p=args.top_p)
    warm, _ = workload_prompts(engines["off"], "copy", 2, seed=99)
    for e in engines.values():
        e.generate(warm, {**params, "max_new_tokens": 8})
    names = list(engines)
    rows = []
    for workload in args.workloads:
        for batch in args.batch_sizes:
            run = cell_runner(engines["off"], workload, batch, params, args)
            cells: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    engines[name].flush_cache()  # each run prefills its prompts (and drafts) itself
                    cells[name].append(run(engines[name]))
            for name in names[1:]:
                rows.append(summarise(workload, batch, name, cells))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def cell_runner(engine, workload: str, batch: int, params: dict[str, Any], args):
    """The function running one (workload, batch) cell on an engine (the same prompts for every engine)."""
    if workload == "agent":
        sessions = agent_sessions(engine, max(batch, args.min_prompts), batch, args)
        groups = [sessions[i : i + batch] for i in range(0, len(sessions), batch)]
        return lambda e: join_cells([run_agent_cell(e, g, params) for g in groups])
    prompts, extra = workload_prompts(engine, workload, max(batch, args.min_prompts), seed=batch)
    return lambda e: run_in_waves(e, prompts, batch, {**params, **extra})


def seeded(params: dict[str, Any], i: int) -> dict[str, Any]:
    """Request ``i``'s parameters: its own seed (``params["seed"] + i``) when sampled."""
    return {**params, "seed": params["seed"] + i} if "seed" in params else params


def summarise(workload: str, batch: int, name: str, cells: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One table row: method ``name`` against "off" on one cell."""
    def med(method: str, key: str) -> float:
        return statistics.median(c[key] for c in cells[method])

    same = sum(a == b for a, b in zip(cells["off"][0]["output_ids"], cells[name][0]["output_ids"]))
    return {
        "workload": workload, "batch": batch, "method": name,
        "off_tok_s": med("off", "tok_s"), "tok_s": med(name, "tok_s"),
        "ratio": statistics.median(b["tok_s"] / a["tok_s"] for a, b in zip(cells["off"], cells[name])),
        "off_tpot_p50_ms": med("off", "tpot_p50_ms"), "tpot_p50_ms": med(name, "tpot_p50_ms"),
        "off_tpot_p95_ms": med("off", "tpot_p95_ms"), "tpot_p95_ms": med(name, "tpot_p95_ms"),
        "accept_len": med(name, "accept_len"), "identical": f"{same}/{len(cells['off'][0]['output_ids'])}",
        "off_steps": med("off", "steps"), "steps": med(name, "steps"), "draft_steps": med(name, "draft_steps"),
    }


def markdown(rows: list[dict[str, Any]], args) -> str:
    head = ("| workload | batch | method | off tok/s | method tok/s | method/off | TPOT p50 off / method (ms) "
            "| TPOT p95 off / method (ms) | target forward steps off / method | draft model steps "
            "| accept length | identical to off |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['batch']} | {r['method']} | {r['off_tok_s']:.1f} | {r['tok_s']:.1f} "
            f"| {r['ratio']:.2f}x | {r['off_tpot_p50_ms']:.0f} / {r['tpot_p50_ms']:.0f} "
            f"| {r['off_tpot_p95_ms']:.0f} / {r['tpot_p95_ms']:.0f} | {r['off_steps']:.0f} / {r['steps']:.0f} "
            f"| {r['draft_steps']:.0f} | {r['accept_len']:.2f} | {r['identical']} |")
    sampling = (f"temperature {args.temperature}, top_p {args.top_p}, seeds from {args.seed}" if args.temperature > 0
                else "greedy")
    lines.append(f"\n{args.rounds} rounds per cell, median ratio of interleaved runs; {sampling}; dtype={args.dtype}, "
                 f"quantization={args.quantization or 'default'}, max_new_tokens={args.max_new_tokens}, "
                 f"NGRAM speculative_num_draft_tokens={'/'.join(map(str, args.num_draft_tokens))}, STANDALONE "
                 f"speculative_num_steps={args.num_steps} with the target's first {args.draft_layers} layers "
                 f"as draft{' (standalone-self: the target as its own draft)' if args.draft_self else ''}.")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
