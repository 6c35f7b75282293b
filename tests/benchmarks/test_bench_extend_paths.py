"""`benchmarks/bench_extend_paths.py` runs and prints its attention table (numbers not checked)."""

from __future__ import annotations

import pytest

from arborlm.kernels import cpu_ops


def test_attention_table_runs(capsys):
    if cpu_ops.native_library() is None:
        pytest.skip("no C++ compiler here, so no native CPU kernels: the benchmark compares two of them with SDPA "
                    "and has nothing to time (serving falls back to torch and is tested elsewhere)")
    from benchmarks import bench_extend_paths

    assert bench_extend_paths.main(["--lengths", "64,130", "--rounds", "1", "--skip-model"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 |") or line.startswith("| 130 |")]
    assert len(rows) == 2 and all(len(row.split("|")) == 8 for row in rows)
