"""Structured-output benchmark: schema coverage, validity, compile and mask time, throughput.

On the default model, in one run:

1. coverage per JSONSchemaBench sub-dataset and backend: schemas accepted by the
   front (normalised, not refused) and compiled within the timeout / total;
2. validity: one generation per covered schema (temperature 1.0); every
   output that finished with "stop" must parse and validate with `jsonschema`
   (outputs cut by `max_new_tokens` are counted apart);
3. compile time p50 / p95 (seconds) and per-token mask fill time p50 / p99 (µs: each
   constrained request at each step, timed alone);
4. output tok/s of 16 JSON-schema requests against the same requests
   unconstrained (each with the constrained output's length, `ignore_eos`);
5. decode steps saved by jump-forward (the same constrained batch with it off).

``--compile-only`` leaves the model out (minutes, not hours, for all 420 schemas on every
backend): coverage and compile times as above, and for each compiled schema `WALKS`
random walks of its grammar (each step samples uniformly among the allowed tokens, EOS
with probability `EOS_BIAS` once allowed), timing every mask fill and validating every
walk the grammar ended against the user's schema (`GrammarSpec.validate_output`, the
check the server applies); refusals and failed validations are counted by cause.

The scheduler runs in this process (the same loop the Engine runs in its own
process), so its counters can be read directly. Results go to
`benchmarks/results/structured.json` and a markdown table on stdout.

    python benchmarks/bench_structured.py            # full run
    python benchmarks/bench_structured.py --quick    # 8 schemas per sub-dataset
    flock /tmp/arborlm-timing.lock python benchmarks/bench_structured.py --compile-only \
        --backends llguidance,xgrammar,outlines
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

import jsonschema
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arborlm.constrained.base import GrammarError, allocate_vocab_mask  # noqa: E402
from arborlm.constrained.grammar_manager import GrammarManager, create_grammar_backend  # noqa: E402
from arborlm.constrained.grammar_spec import grammar_spec_from_params  # noqa: E402
from arborlm.runtime.config import ServerArgs  # noqa: E402
from arborlm.runtime.io_struct import TokenizedGenerateReqInput  # noqa: E402
from arborlm.runtime.model_loader import resolve_checkpoint  # noqa: E402
from arborlm.runtime.scheduler import Scheduler  # noqa: E402
from arborlm.sampling_params import SamplingParams  # noqa: E402

DATA = next((p / "shared" / "data" / "jsonschemabench" for p in ROOT.parents
             if (p / "shared" / "data" / "jsonschemabench").is_dir()), Path("/work/shared/data/jsonschemabench"))
RESULTS = ROOT / "benchmarks" / "results"
BACKENDS = ("llguidance", "xgrammar", "outlines")
VOCAB_SIZE = 49152
# --compile-only: random walks per compiled schema, the most steps of one, and the chance
# of taking EOS at a step where the grammar allows it.
WALKS = 2
WALK_STEPS = 400
EOS_BIAS = 0.3


def load_schemas(per_subset: int | None) -> dict[str, list[tuple[str, dict]]]:
    subsets = {}
    for path in sorted(DATA.glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        subsets[path.stem] = [(r["id"], r["schema"]) for r in records[:per_subset]]
    return subsets


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def refusal_cause(message: str) -> str:
    """The keyword (or kind of failure) a refusal names first, for counting refusals by cause."""
    named = re.search(r"Unimplemented keys: \[\"([^\"]+)\"|keywords the grammar cannot enforce: (\S+) at "
                      r"|^(?:invalid JSON schema \(llguidance\): )?(Unknown format|Resource|Unable to resolve)"
                      r"|outlines-core cannot (enforce|use)|does not support (\S+)", message)
    if named:
        return next(g for g in named.groups() if g)
    return message[:40]


def walk(matcher, spec, rng: random.Random, eos: int, fill_us: list[float]) -> str:
    """One random walk of ``matcher``: "valid", "unfinished", or the failed validation's cause."""
    mask = allocate_vocab_mask(1, VOCAB_SIZE)
    tokens = []
    for _ in range(WALK_STEPS):
        start = time.perf_counter()
        matcher.fill_vocab_mask(mask, 0)
        fill_us.append((time.perf_counter() - start) * 1e6)
        allowed = mask_ids(mask[0])
        if len(allowed) == 0:
            return "dead end"
        eos_allowed = bool((allowed == eos).any())
        if eos_allowed and (len(allowed) == 1 or rng.random() < EOS_BIAS):
            assert matcher.accept_token(eos)
            message = spec.validate_output(_TOKENIZER.decode(tokens, skip_special_tokens=True))
            return "valid" if message is None else "invalid: " + message[:60]
        token = int(rng.choice(allowed[allowed != eos]))
        assert matcher.accept_token(token), token
        tokens.append(token)
    return "unfinished"


def mask_ids(row):
    """The allowed token ids of one int32 bitmask row (bit j % 32 of word j // 32), as a numpy array."""
    import numpy as np

    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:VOCAB_SIZE])


_TOKENIZER = None


def compile_all(backend_name, tokenizer, eos_ids, subsets, timeout_s, walks: int = 0):
    """Front check + compile every schema; returns {id: spec} of the covered ones and per-id status.

    ``walks`` > 0: also that many random walks per compiled grammar (see the module docstring);
    their outcomes and mask-fill times are returned in the third and fourth place.
    """
    backend = create_grammar_backend(backend_name, tokenizer, VOCAB_SIZE, eos_ids)
    manager = GrammarManager(backend, compile_timeout=timeout_s)
    specs, status, pending, outcomes, fill_us = {}, {}, {}, Counter(), []
    rng = random.Random(0)
    items = [item for items in subsets.values() for item in items]
    with tqdm(total=len(items), desc=f"{backend_name}: check, compile" + (", walk" if walks else ""),
              file=sys.stderr) as bar:
        for sid, schema in items:
            try:
                spec = grammar_spec_from_params(SamplingParams(json_schema=schema), backend_name)
            except GrammarError as e:
                status[sid] = f"refused: {e.message[:120]}"
                bar.update(1)
                continue
            specs[sid] = spec
            pending[sid] = manager.request(spec.key)
            if walks:  # one compile at a time: each gets its whole timeout and the cores to itself
                _finish(manager, {sid: pending.pop(sid)}, specs, status, walks, rng, eos_ids[0], outcomes, fill_us,
                        bar)
        _finish(manager, pending, specs, status, walks, rng, eos_ids[0], outcomes, fill_us, bar)
    compile_times = list(manager.stats()["compile_times_s"])
    if walks:
        return specs, status, compile_times, manager, outcomes, fill_us
    return specs, status, compile_times, manager


def _finish(manager, pending, specs, status, walks, rng, eos, outcomes, fill_us, bar) -> None:
    """Wait for every compile in ``pending``, recording its status (and walking it ``walks`` times)."""
    while pending:
        manager.wait_any(list(pending.values()), 0.5)
        now = time.monotonic()
        for sid, p in list(pending.items()):
            try:
                compiled = p.result(now)
                if compiled is None:
                    continue
                status[sid] = "compiled"
                for _ in range(walks):
                    outcomes[walk(compiled.new_matcher(), specs[sid], rng, eos, fill_us)] += 1
            except GrammarError as e:
                status[sid] = f"failed: {e.message[:120]}"
                specs.pop(sid)
            del pending[sid]
            if bar is not None:
                bar.update(1)


def make_scheduler(model_dir, tokenizer, **kw) -> Scheduler:
    return Scheduler(ServerArgs.from_kwargs(model=str(model_dir), max_total_tokens=65536, **kw), tokenizer=tokenizer)


def run(scheduler: Scheduler, reqs: list[TokenizedGenerateReqInput], desc: str):
    """Step until idle; returns ({rid: tokens}, {rid: finish}, seconds)."""
    for r in reqs:
        scheduler.add_request(r)
    tokens, finish = {}, {}
    start = time.perf_counter()
    with tqdm(total=len(reqs), desc=desc, file=sys.stderr) as bar:
        while scheduler.has_work():
            for out in scheduler.step():
                tokens.setdefault(out.rid, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    finish[out.rid] = out.finish_reason
                    bar.update(1)
    return tokens, finish, time.perf_counter() - start


def request(rid, prompt_ids, params: SamplingParams, seed: int, backend: str | None):
    params.verify(49152)
    params = params.normalized()
    grammar = grammar_spec_from_params(params, backend) if backend else None
    return TokenizedGenerateReqInput(rid=rid, input_ids=prompt_ids, sampling_params=params, seed=seed, grammar=grammar)


def validity(model_dir, tokenizer, prompt_ids, backend_name, specs, schemas, max_new_tokens, manager):
    """Generate once per covered schema; count valid / invalid among 'stop', and 'length' / aborts.

    `manager` holds the grammars `compile_all` compiled, so nothing compiles again.
    """
    sched = make_scheduler(model_dir, tokenizer, grammar_backend=backend_name)
    sched._grammar_manager = manager
    reqs = [request(sid, prompt_ids, SamplingParams(json_schema=schemas[sid], temperature=1.0,
                                                    max_new_tokens=max_new_tokens), i, backend_name)
            for i, sid in enumerate(specs)]
    tokens, finish, _ = run(sched, reqs, f"generate {backend_name}")
    counts = {"valid": 0, "invalid": 0, "length": 0, "abort": 0}
    invalid, aborts = [], Counter()
    for sid in specs:
        kind = finish[sid]["type"]
        if kind != "stop":
            counts["length" if kind == "length" else "abort"] += 1
            if kind == "abort":
                aborts[finish[sid].get("message", "")[:60]] += 1
            continue
        text = tokenizer.decode(tokens[sid], skip_special_tokens=True)
        try:
            jsonschema.validate(json.loads(text), schemas[sid])
            counts["valid"] += 1
        except (ValueError, jsonschema.ValidationError) as e:
            counts["invalid"] += 1
            invalid.append((sid, str(e)[:200]))
    mask_us = [t * 1e6 for t in sched.worker.mask_fill_seconds]
    return counts, invalid, mask_us, dict(aborts.most_common())


def throughput(model_dir, tokenizer, prompt_ids, schemas: list[dict], max_new_tokens: int):
    """Constrained (jump-forward on and off) against unconstrained with equal output lengths."""
    out = {}
    lengths = None
    for mode in ("constrained", "constrained_no_jump_forward", "unconstrained"):
        sched = make_scheduler(model_dir, tokenizer, disable_jump_forward=mode != "constrained")
        reqs = []
        for i, schema in enumerate(schemas):
            if mode == "unconstrained":
                params = SamplingParams(temperature=1.0, max_new_tokens=lengths[i], ignore_eos=True)
            else:
                params = SamplingParams(json_schema=schema, temperature=1.0, max_new_tokens=max_new_tokens)
            reqs.append(request(str(i), prompt_ids, params, i, None if mode == "unconstrained" else "xgrammar"))
        if mode != "unconstrained":  # compile outside the timed run
            for r in reqs:
                pending = sched.grammar_manager.request(r.grammar.key)
                while pending.result() is None:
                    sched.grammar_manager.wait_any([pending], 1.0)
        tokens, _, seconds = run(sched, reqs, mode)
        if mode == "constrained":
            lengths = [max(1, len(tokens[str(i)])) for i in range(len(schemas))]
        n = sum(len(t) for t in tokens.values())
        out[mode] = {"seconds": seconds, "output_tokens": n, "tok_per_s": n / seconds,
                     "decode_steps": sched.stats["num_decode_steps"],
                     "jump_forward_tokens": sched.stats["num_jump_forward_tokens"],
                     "jump_forward_steps": sched.stats["num_jump_forward_steps"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 schemas per sub-dataset")
    parser.add_argument("--per-subset", type=int, default=None, help="schemas per sub-dataset (default all)")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--compile-timeout", type=float, default=60.0, help="seconds per schema")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="requests in the throughput comparison")
    parser.add_argument("--keyword-table", action="store_true",
                        help="which keywords each backend enforces or refuses (the docs' table; seconds)")
    parser.add_argument("--compile-only", action="store_true",
                        help="no model: coverage, compile times, random grammar walks (validity, mask fill)")
    args = parser.parse_args()
    per_subset = 8 if args.quick else args.per_subset
    if args.keyword_table:
        keyword_table(args.backends.split(","))
        return
    if args.compile_only:
        compile_only(args, per_subset)
        return

    from transformers import AutoTokenizer

    model_dir = resolve_checkpoint(None)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    eos_ids = [tokenizer.eos_token_id]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Produce one JSON document."}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    subsets = load_schemas(per_subset)
    schemas = {sid: s for items in subsets.values() for sid, s in items}
    record: dict = {"date": time.strftime("%Y-%m-%d"), "per_subset": per_subset, "backends": {}}

    # Throughput first: a backend's compiles that outlive their timeout keep a worker thread busy.
    glaive = [s for _, s in subsets["Glaiveai2K"]][: args.batch]
    glaive += [s for _, s in subsets["Github_easy"]][: args.batch - len(glaive)]
    record["throughput"] = throughput(model_dir, tokenizer, prompt_ids, glaive, args.max_new_tokens)
    # Written at once, so that a run cut short later keeps the throughput it measured.
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "structured.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record["throughput"]), flush=True)

    for backend_name in args.backends.split(","):
        specs, status, compile_times, manager = compile_all(
            backend_name, tokenizer, eos_ids, subsets, args.compile_timeout
        )
        counts, invalid, mask_us, aborts = validity(model_dir, tokenizer, prompt_ids, backend_name, specs, schemas,
                                            args.max_new_tokens, manager)
        manager.shutdown()
        coverage = {name: sum(status[sid] == "compiled" for sid, _ in items) / len(items)
                    for name, items in subsets.items()}
        record["backends"][backend_name] = {
            "coverage": coverage,
            "status": status,
            "validity": counts,
            "invalid": invalid,
            "aborts_by_cause": aborts,
            "compile_s_p50": percentile(compile_times, 50),
            "compile_s_p95": percentile(compile_times, 95),
            "mask_us_p50": percentile(mask_us, 50),
            "mask_us_p99": percentile(mask_us, 99),
        }

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "structured.json").write_text(json.dumps(record, indent=1))
    print_tables(record, list(subsets))


# Keywords that stay refused on every backend (beside the enforced cases of the keyword tests).
REFUSED_EVERYWHERE = [
    ("uniqueItems over strings", {"type": "array", "items": {"type": "string"}, "uniqueItems": True}),
    ("if whose complement is not written (minLength)", {"if": {"minLength": 3}, "then": {"required": ["b"]}}),
    ("contains on arrays of unbounded length", {"type": "array", "contains": {"const": 1}, "minContains": 2}),
    ("not of an array const", {"not": {"const": [3]}}),
    ("$dynamicRef across resources (nested $id)",
     {"$dynamicAnchor": "n", "type": "object",
      "properties": {"c": {"$id": "https://example.com/c", "$dynamicRef": "#n"}}}),
    ("remote $ref", {"properties": {"a": {"$ref": "https://example.invalid/s.json"}}}),
]


def keyword_table(backends: list[str]) -> None:
    """Print, per keyword case, whether each backend's front enforces or refuses it."""
    from tests.constrained.test_conditionals import EXACT as CONDITIONALS
    from tests.constrained.test_llguidance_keywords import EXACT

    print("| case | " + " | ".join(backends) + " |")
    print("|---|" + "---|" * len(backends))
    for name, schema in [(c[0], c[1]) for c in EXACT + CONDITIONALS] + REFUSED_EVERYWHERE:
        row = []
        for backend in backends:
            try:
                grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema)), backend)
                row.append("enforced")
            except GrammarError:
                row.append("refused")
        print(f"| {name} | " + " | ".join(row) + " |")


def compile_only(args, per_subset: int | None) -> None:
    """--compile-only: every backend over the same schemas, one after the other in this run."""
    global _TOKENIZER
    from transformers import AutoTokenizer

    tokenizer = _TOKENIZER = AutoTokenizer.from_pretrained(str(resolve_checkpoint(None)))
    subsets = load_schemas(per_subset)
    record: dict = {"date": time.strftime("%Y-%m-%d"), "per_subset": per_subset, "walks": WALKS, "backends": {}}
    for backend_name in args.backends.split(","):
        start = time.perf_counter()
        specs, status, compile_times, manager, outcomes, fill_us = compile_all(
            backend_name, tokenizer, [tokenizer.eos_token_id], subsets, args.compile_timeout, walks=WALKS)
        manager.shutdown()
        refused = Counter(refusal_cause(v.split(": ", 1)[1]) for v in status.values() if v != "compiled")
        record["backends"][backend_name] = {
            "coverage": {name: sum(status[sid] == "compiled" for sid, _ in items) / len(items)
                         for name, items in subsets.items()},
            "status": status, "refused_by_cause": dict(refused.most_common()), "walks": dict(outcomes),
            "compile_s_p50": percentile(compile_times, 50), "compile_s_p95": percentile(compile_times, 95),
            "compile_s_max": max(compile_times, default=float("nan")),
            "mask_us_p50": percentile(fill_us, 50), "mask_us_p99": percentile(fill_us, 99),
            "seconds": time.perf_counter() - start,
        }
        # Written after each backend, so that a run cut short keeps what it measured.
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "structured_compile.json").write_text(json.dumps(record, indent=1))
        print_compile_tables(record, list(subsets))
        sys.stdout.flush()


def print_compile_tables(record: dict, subset_names: list[str]) -> None:
    backends = record["backends"]
    print("\n| sub-dataset | " + " | ".join(f"{b} coverage" for b in backends) + " |")
    print("|---|" + "---|" * len(backends))
    for name in [*subset_names]:
        print(f"| {name} | " + " | ".join(f"{backends[b]['coverage'][name]:.2f}" for b in backends) + " |")
    print("\n| backend | walks valid / ended | unfinished | compile p50 / p95 / max (s) | mask p50 / p99 (µs) |")
    print("|---|---|---|---|---|")
    for b, r in backends.items():
        w = r["walks"]
        ended = sum(n for k, n in w.items() if k not in ("unfinished",))
        print(f"| {b} | {w.get('valid', 0)} / {ended} | {w.get('unfinished', 0)} | {r['compile_s_p50']:.4f} / "
              f"{r['compile_s_p95']:.4f} / {r['compile_s_max']:.2f} | {r['mask_us_p50']:.0f} / {r['mask_us_p99']:.0f} |")
    for b, r in backends.items():
        causes = ", ".join(f"{k} {n}" for k, n in list(r["refused_by_cause"].items())[:8])
        bad = {k: n for k, n in r["walks"].items() if k not in ("valid", "unfinished")}
        print(f"\n{b}: refused by cause: {causes or 'none'}; walks not valid: {bad or 'none'}")


def print_tables(record: dict, subset_names: list[str]) -> None:
    backends = record["backends"]
    print("\n| sub-dataset | " + " | ".join(f"{b} coverage" for b in backends) + " |")
    print("|---|" + "---|" * len(backends))
    for name in subset_names:
        print(f"| {name} | " + " | ".join(f"{backends[b]['coverage'][name]:.2f}" for b in backends) + " |")
    print("\n| backend | valid / finished | cut by max_new_tokens | aborted | compile p50 / p95 (s) | mask p50 / p99 (µs) |")
    print("|---|---|---|---|---|---|")
    for b, r in backends.items():
        v = r["validity"]
        print(f"| {b} | {v['valid']} / {v['valid'] + v['invalid']} | {v['length']} | {v['abort']} | "
              f"{r['compile_s_p50']:.3f} / {r['compile_s_p95']:.3f} | {r['mask_us_p50']:.1f} / {r['mask_us_p99']:.1f} |")
    for b, r in backends.items():
        causes = ", ".join(f"{k} {n}" for k, n in r["aborts_by_cause"].items())
        print(f"\n{b}: aborts by cause: {causes or 'none'}; invalid: {r['invalid'][:4] or 'none'}")
    t = record["throughput"]
    base = t["unconstrained"]["tok_per_s"]
    print("\n| batch of JSON requests | output tok/s | vs unconstrained | decode steps | jump-forward tokens |")
    print("|---|---|---|---|---|")
    for mode, r in t.items():
        print(f"| {mode} | {r['tok_per_s']:.0f} | {r['tok_per_s'] / base:.2f}× | {r['decode_steps']} | "
              f"{r['jump_forward_tokens']} |")


if __name__ == "__main__":
    main()
    # A compile that outlived its timeout cannot be interrupted; do not wait for it at exit.
    sys.stdout.flush()
    os._exit(0)
