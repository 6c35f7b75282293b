"""`benchmarks/bench_quant_stream.py` runs, A/B against a second build, and prints its table."""

from __future__ import annotations

from pathlib import Path

import pytest

from arborlm.kernels import quant_ops


def test_stream_table_runs_against_a_second_build(capsys):
    if quant_ops.native_library() is None:
        pytest.skip("no C++ compiler here, so no native quantized kernels: the benchmark times them and has "
                    "nothing to run (serving falls back to dequantized weights, tested elsewhere)")
    from benchmarks import bench_quant_stream

    here = Path(bench_quant_stream.__file__).resolve().parents[1]
    assert bench_quant_stream.main(["--rows", "1,7", "--repeats", "1", "--layers", "1", "--against", str(here)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 |", "| 7 |"))]
    # rows | this ms, GB/s, / 1 row | against ms, GB/s, / 1 row | plain read GB/s | this / read | this / against
    assert len(rows) == 2 and all(len(row.split("|")) == 12 for row in rows)
    assert all(float(row.split("|")[8]) > 0 and row.split("|")[9].strip().endswith("x") for row in rows)
