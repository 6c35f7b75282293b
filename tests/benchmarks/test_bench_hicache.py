"""benchmarks/bench_hicache.py on the tiny random Llama (its logic, not its timings): the
agents' histories outgrow the pool, the host tier serves part of every later turn, fewer
prefill tokens are computed with it, and both modes produce the same tokens."""

from __future__ import annotations

import argparse

from benchmarks import bench_hicache


def test_bench_hicache_runs_the_agents_on_both_modes(tiny_llama_dir, tmp_path):
    args = argparse.Namespace(
        model=str(tiny_llama_dir), dtype="float32", num_agents=4, num_turns=3, system_len=32, context_len=64,
        user_len=16, output_len=4, max_total_tokens=256, chunked_prefill_size=128, hicache_ratio=4.0,
    )
    report = bench_hicache.run(args)
    off, on = report["rows"]
    assert (off["mode"], on["mode"]) == ("hicache off", "hicache on")
    assert report["histories_total_tokens"] > args.max_total_tokens
    assert report["same_answers"] == report["answers"] == 12
    assert on["host_hit_rate"] > 0 and off["host_hit_rate"] == 0
    assert on["loaded_back_tokens"] > 0
    assert report["ratios"]["prefill_tokens_off_over_on"] > 1.0
    assert "| hicache on |" in bench_hicache.markdown(report)
