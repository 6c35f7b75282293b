"""benchmarks/bench_quant.py on a tiny random Llama: one group's variants side by side give a decode
time per round, prefill rates, the weights' and KV pool's bytes and a perplexity per variant; the
timed prefill hands its request row and KV slots back; the table prints every row."""

from __future__ import annotations

import argparse
import math

import pytest

pytest.importorskip("gguf")

from arborlm.runtime.scheduler import Scheduler  # noqa: E402
from benchmarks import bench_quant  # noqa: E402


def bench_args(**overrides) -> argparse.Namespace:
    values = dict(prompt_len=8, prefill_len=16, warmup=1, rounds=2, block=2, prefill_rounds=1,
                  max_total_tokens=256, threads=None)
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.fixture(scope="module")
def tiny_group(tiny_llama_dir):
    return bench_quant.Group("tiny", tiny_llama_dir, ("none", "int4", "kv-int8"))


def test_prefill_hands_its_row_and_slots_back(tiny_group):
    sched = Scheduler(bench_quant.server_args(tiny_group, "none", bench_args()))
    runner = sched.model_runner
    rows, slots = runner.req_to_token_pool.available_size(), runner.token_to_kv_pool_allocator.available_size()
    assert bench_quant.prefill_tok_s(sched, 16) > 0
    assert runner.req_to_token_pool.available_size() == rows
    assert runner.token_to_kv_pool_allocator.available_size() == slots
    pool = runner.token_to_kv_pool
    assert bench_quant.kv_pool_mb(sched) == pytest.approx(2 * pool.k_buffer.numel() * pool.k_buffer.element_size() / 1e6)


def test_a_group_measures_every_variant(tiny_group, capsys):
    args = bench_args()
    windows = [[5, 17, 99, 3, 250, 8, 41, 77], [200, 1, 2, 64]]
    rows = bench_quant.run_group(tiny_group, 2, args, None, windows)
    assert set(rows) == set(tiny_group.variants)
    for row in rows.values():
        assert len(row.decode_ms) == args.rounds and all(ms > 0 for ms in row.decode_ms)
        assert len(row.prefill_tok_s) == args.prefill_rounds
        assert row.weights_mb > 0 and row.kv_mb > 0 and math.isfinite(row.perplexity)
    # the tied head's int4 copy beside the float table: more bytes than `none` on a model this small
    assert rows["int4"].weights_mb != rows["none"].weights_mb
    assert rows["kv-int8"].kv_mb < rows["none"].kv_mb  # one byte a value plus scales, against fp32/bf16
    bench_quant.print_table([(tiny_group, 2, rows)], args)
    table = capsys.readouterr().out
    assert all(f"| tiny | 2 | {variant} |" in table for variant in tiny_group.variants)


def test_an_unfused_variant_turns_the_fused_layer_off(tiny_group):
    args = bench_args()
    fused = bench_quant.make_scheduler(tiny_group, "int4", 1, args, bench_quant.Row())
    unfused = bench_quant.make_scheduler(tiny_group, "int4" + bench_quant.UNFUSED, 1, args, bench_quant.Row())
    assert bench_quant.server_args(tiny_group, "int4-unfused", args).model.quantization == "int4"
    fused_decode = [s.model_runner.model.model.fused_decode for s in (fused, unfused)]
    if fused_decode[0] is None:
        pytest.skip("the fused decoder layer is not built here")
    assert fused_decode[0].enabled and not fused_decode[1].enabled
