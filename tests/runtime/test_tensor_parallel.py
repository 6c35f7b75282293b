"""Tensor parallelism (`--tp-size`, issue 23): the split layers and models (K/V heads replicated,
q/k/v biases, a padded vocabulary) against unsharded ones in a world of two gloo processes, the arguments refused by name, and greedy output with tp_size=2 equal to
tp_size=1 token for token through the Engine (tiny float32 Llama on the CPU)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.multiprocessing as tmp

import arborlm
from arborlm.errors import EngineDeadError
from arborlm.kernels.cpu_ops import layer_ops
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.distributed.launch import TpWorkers, free_loopback_port
from arborlm.runtime.distributed.parallel_state import (
    ParallelState,
    destroy_parallel_state,
    init_parallel_state,
)
from arborlm.runtime.layers.linear import (
    QKVParallelLinear,
    make_merged_column_linear,
    make_row_linear,
)
from arborlm.runtime.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from arborlm.runtime.model_loader import _tensor_parallel_kwargs

TP = 2


def _fill(layer, full: dict[str, torch.Tensor], shard=None) -> None:
    """Load `full` (param name -> checkpoint tensor) into `layer` through its `checkpoint_slice`."""
    for name, tensor in full.items():
        part = layer.checkpoint_slice(name, shard, tensor)
        getattr(layer, name).data.copy_(part)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (float32 sums reorder)."""
    return ((got - want).abs().max() / want.abs().max()).item()


def _layers_rank(rank: int, port: int, checkpoints: dict[str, tuple], results) -> None:
    """One rank of the layer check: every split layer's output next to the unsharded layer's."""
    torch.manual_seed(0)  # the same "checkpoint" on both ranks
    state = init_parallel_state(rank, TP, port, torch.device("cpu"), timeout_s=60)
    ops = layer_ops(torch.device("cpu"), native=False)
    f32, cpu = torch.float32, torch.device("cpu")
    x = torch.randn(5, 16)
    errors = {}
    # q/k/v with 4 query heads and 1 K/V head (replicated on both ranks), head_dim 4, with bias.
    w = {"q": torch.randn(16, 16), "k": torch.randn(4, 16), "v": torch.randn(4, 16)}
    b = {"q": torch.randn(16), "k": torch.randn(4), "v": torch.randn(4)}
    full_qkv = torch.cat([x @ w[s].T + b[s] for s in ("q", "k", "v")], dim=-1)
    qkv = QKVParallelLinear(16, 4, 1, 4, True, f32, cpu, ops, state)
    for s in ("q", "k", "v"):
        qkv.weight.data[qkv.shard_rows(s)] = qkv.checkpoint_slice("weight", s, w[s])
        qkv.bias.data[qkv.shard_rows(s)] = qkv.checkpoint_slice("bias", s, b[s])
    q, k, v = qkv(x).split([8, 4, 4], dim=-1)
    errors["qkv_q"] = _rel_err(q, full_qkv[:, rank * 8 : rank * 8 + 8])
    errors["qkv_kv"] = _rel_err(torch.cat([k, v], -1), full_qkv[:, 16:])
    # gate/up column-parallel, then down row-parallel (with bias): the MLP's shape of split.
    gate, up, down, down_b = torch.randn(12, 16), torch.randn(12, 16), torch.randn(16, 12), torch.randn(16)
    gate_up = make_merged_column_linear(16, {0: 12, 1: 12}, False, f32, cpu, ops, state, "intermediate_size")
    for shard, t in ((0, gate), (1, up)):
        gate_up.weight.data[gate_up.shard_rows(shard)] = gate_up.checkpoint_slice("weight", shard, t)
    g, u = gate_up(x).chunk(2, dim=-1)
    row = make_row_linear(12, 16, True, f32, cpu, ops, state, "intermediate_size")
    _fill(row, {"weight": down, "bias": down_b})
    full_mlp = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T + down_b
    errors["mlp"] = _rel_err(row(torch.nn.functional.silu(g) * u), full_mlp)
    # Vocabulary of 11 rows over 2 ranks (6 + 5, the last padded): embedding and head.
    table = torch.randn(11, 16)
    emb = VocabParallelEmbedding(11, 16, f32, cpu, state)
    _fill(emb, {"weight": table})
    ids = torch.tensor([0, 5, 6, 10, 3])
    errors["embedding"] = _rel_err(emb(ids), table[ids])
    head = ParallelLMHead(16, 11, f32, cpu, ops, state)
    _fill(head, {"weight": table})
    logits = head(x)
    errors["lm_head_shape"] = float(logits.shape != (5, 11))
    errors["lm_head"] = _rel_err(logits, x @ table.T)
    errors.update(_model_errors(state, checkpoints))
    results.put((rank, errors))
    destroy_parallel_state(state)


# Families split on this rank pair: K/V heads replicated (1 K/V head, 2 ranks) with an untied head
# over a vocabulary the ranks do not divide; Qwen2's q/k/v biases with a tied head.
MODEL_CONFIGS = {
    "llama_kv1": ("LlamaConfig", {"num_key_value_heads": 1, "tie_word_embeddings": False, "vocab_size": 101}),
    "qwen2_bias": ("Qwen2Config", {"num_key_value_heads": 2, "tie_word_embeddings": True, "vocab_size": 96}),
}


def _random_checkpoints() -> dict[str, tuple]:
    """Per family of MODEL_CONFIGS: its transformers config and a random float32 state dict
    (built once in the test process and sent to both ranks)."""
    import transformers

    out = {}
    for name, (config_cls, changes) in MODEL_CONFIGS.items():
        config = getattr(transformers, config_cls)(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=128, **changes)
        torch.manual_seed(1)
        hf = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
        out[name] = (config, {k: v.clone() for k, v in hf.state_dict().items()})
    return out


def _model_errors(state: ParallelState, checkpoints: dict[str, tuple]) -> dict[str, float]:
    """Per family: logits of the split model against the whole one (extend of two requests, then
    two decode steps), both built on this rank from the same checkpoint."""
    from arborlm.radix_cache.memory_pool import TokenToKVPool
    from arborlm.runtime.layers.attention.factory import create_attention_backend
    from arborlm.runtime.models.llama import LlamaForCausalLM
    from tests.runtime.model_helpers import ModelHarness

    cpu, errors = torch.device("cpu"), {}
    for name, (config, weights) in checkpoints.items():
        logits = {}
        for parallel in (None, state):
            model = LlamaForCausalLM(config, torch.float32, cpu, create_attention_backend("torch", cpu, None),
                                     layer_ops(cpu, native=False), parallel=parallel)
            model.load_weights(weights.items())
            harness = ModelHarness(model, config, num_reqs=2, max_context_len=32, num_slots=64)
            kv_heads = model.model.layers[0].self_attn.num_kv_heads  # this rank's
            harness.token_to_kv_pool = TokenToKVPool(64, 2, kv_heads, 8, torch.float32, cpu)
            rows = [harness.new_req(), harness.new_req()]
            steps = [harness.extend(rows, [[5, 9, 2, 7, 1], [3, 8, 4]]).next_token_logits]
            steps += [harness.decode(rows, [11, 12]).next_token_logits, harness.decode(rows, [13, 14]).next_token_logits]
            logits[parallel is None] = torch.cat(steps)
        errors[name] = _rel_err(logits[False], logits[True])
    return errors


def test_parallel_layers_match_unsharded_ones():
    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    port = free_loopback_port()
    checkpoints = _random_checkpoints()
    procs = [ctx.Process(target=_layers_rank, args=(r, port, checkpoints, results)) for r in range(TP)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in range(TP))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for rank in range(TP):
        for name, err in got[rank].items():
            assert err < 1e-5, (rank, name, err)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"tp_size": 0}, ValueError, "tp_size=0"),
    ({"tp_size": 65}, ValueError, "tp_size=65"),
    ({"tp_size": "2"}, TypeError, "tp_size"),
    ({"tp_size": 2, "dp_size": 2}, ValueError, "tp_size=2.*dp_size"),
    ({"tp_size": 2, "quantization": "gguf"}, ValueError, "quantization"),
    ({"tp_size": 2, "enable_hierarchical_cache": True}, ValueError, "enable_hierarchical_cache"),
    ({"tp_size": 2, "is_embedding": True}, ValueError, "is_embedding"),
])
def test_bad_tp_arguments_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        ServerArgs.from_kwargs(**kwargs)


def test_sizes_the_ranks_cannot_split_are_refused_by_name():
    three = ParallelState(tp_rank=0, tp_size=3)
    with pytest.raises(ValueError, match="tp_size=3 does not divide num_attention_heads=4"):
        three.split(4, "num_attention_heads")
    with pytest.raises(ValueError, match="tp_size=4 is not a multiple of num_key_value_heads=3"):
        ParallelState(tp_rank=0, tp_size=4).kv_head_range(3)
    assert ParallelState(tp_rank=3, tp_size=4).kv_head_range(2).start == 1  # ranks 2, 3 share K/V head 1
    with pytest.raises(ValueError, match="tp_size=2: the Gemma3ForCausalLM architecture"):
        _tensor_parallel_kwargs("Gemma3ForCausalLM", ParallelState(tp_rank=0, tp_size=2))
    assert _tensor_parallel_kwargs("LlamaForCausalLM", ParallelState()) == {}


@pytest.mark.parametrize("changes, match", [
    ({}, "tp_size=3 does not divide num_attention_heads=4"),
    ({"num_attention_heads": 3, "num_key_value_heads": 3, "intermediate_size": 100},
     "tp_size=3 does not divide intermediate_size=100"),
])
def test_model_refuses_sizes_tp_size_does_not_divide(changes, match):
    from transformers import LlamaConfig

    from arborlm.runtime.layers.attention.factory import create_attention_backend
    from arborlm.runtime.models.llama import LlamaForCausalLM

    config = LlamaConfig(**{"vocab_size": 64, "hidden_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "intermediate_size": 48, **changes})
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=match):
        LlamaForCausalLM(config, torch.float32, cpu, create_attention_backend("torch", cpu, None),
                         layer_ops(cpu, native=False), parallel=ParallelState(tp_rank=0, tp_size=3))


class _FakeRank:
    """A stand-in for a rank's process: alive or exited with `exitcode`."""

    def __init__(self, alive: bool, exitcode: int | None = None):
        self.alive, self.exitcode = alive, exitcode

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout=None) -> None:
        pass


def test_a_rank_failing_to_start_raises_its_error():
    ctx = tmp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    workers = TpWorkers(nccl_port=1, processes=[_FakeRank(True)], readers=[reader])
    workers.check_started()  # still loading: nothing to say
    writer.send({"status": "error", "error": ValueError("tp_size=2 does not divide intermediate_size=5"),
                 "traceback": ""})
    with pytest.raises(ValueError, match="intermediate_size=5"):
        workers.check_started()
    silent = TpWorkers(nccl_port=1, processes=[_FakeRank(False, -9)], readers=[ctx.Pipe(duplex=False)[0]])
    with pytest.raises(EngineDeadError, match="tensor-parallel rank 1 exited while starting"):
        silent.check_started()
    assert "rank 1 exited (code -9)" in silent.first_dead()


def test_the_rank_killed_by_a_signal_is_named_before_its_peers():
    # Rank 2 killed: rank 1 exits in its wake (code 1) and may be seen first.
    workers = TpWorkers(nccl_port=1, processes=[_FakeRank(False, 1), _FakeRank(False, -9), _FakeRank(True)])
    assert workers.first_dead().startswith("tensor-parallel rank 2 exited (code -9)")
    exited = TpWorkers(nccl_port=1, processes=[_FakeRank(True), _FakeRank(False, 1), _FakeRank(False, 1)])
    assert exited.first_dead().startswith("tensor-parallel rank 2 exited (code 1)")
    assert TpWorkers(nccl_port=1, processes=[_FakeRank(True)]).first_dead() is None


def test_a_failed_step_stops_rank_0_at_its_next_keep_alive():
    from arborlm.runtime.distributed.step_sync import StepBroadcaster

    broadcaster = StepBroadcaster(ParallelState())
    broadcaster.keep_alive()  # nothing wrong: no error
    broadcaster.mark_failed("rank 0's forward raised ValueError midway")
    with pytest.raises(RuntimeError, match="cannot go on: rank 0's forward raised ValueError"):
        broadcaster.keep_alive()
    with pytest.raises(ValueError, match="tp_rank=1"):
        StepBroadcaster(ParallelState(tp_rank=1, tp_size=2))


PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def _greedy_ids(engine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, GREEDY)
    # A second round shares the prompts' prefixes through the radix cache (a cached-prefix extend).
    again = engine.generate([p + " and" for p in PROMPTS], GREEDY)
    return [o["output_ids"] for o in outs + again]


def test_tp2_greedy_equals_tp1_token_for_token(tiny_llama_dir):
    common = {"model": str(tiny_llama_dir), "dtype": "float32", "max_total_tokens": 4096, "log_level": "warning"}
    tp1 = arborlm.Engine(**common)
    try:
        want = _greedy_ids(tp1)
    finally:
        tp1.shutdown()
    tp2 = arborlm.Engine(tp_size=2, **common)
    try:
        got = _greedy_ids(tp2)
        info = tp2.get_server_info(check_invariants=True)
        assert info["tp_size"] == 2
        assert info["free_req_rows"] == info["total_req_rows"]
        assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"] == 4096
        assert got == want
        (rank1,) = tp2._scheduler.tp_workers.processes
        if len(os.sched_getaffinity(0)) >= 2:  # each rank on its own cores
            assert not os.sched_getaffinity(tp2._scheduler.process.pid) & os.sched_getaffinity(rank1.pid)
        # A dead rank stops the server with a clear error instead of a hang.
        (rank1,) = tp2._scheduler.tp_workers.processes
        os.kill(rank1.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 exited \(code -9\)"):
            while time.monotonic() < deadline:
                out = tp2.generate(PROMPTS[0], GREEDY)  # a request already at the scheduler fails alone
                assert out["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        tp2.shutdown()
