"""The default model's greedy tokens are pinned: restructuring the runtime must not change them.

`data/smollm_greedy_pins.json` holds the greedy output ids of SmolLM2-135M-Instruct for a
few chat prompts, sent as one batch with `max_new_tokens=32`, recorded on the tree before
the model worker / KV manager restructuring (commit 2659038). float32 pins hold on any x86
CPU (they also agree with transformers where `test_smollm.py` checks it). bfloat16 (the
default dtype) runs other kernels on a CPU with AMX than on one with only AVX-512, whose
roundings differ, so its pins are keyed by that kernel path and checked where they were
recorded. The `bfloat16/avx512-no-amx` pins were re-recorded at `c3b459b`, which computes a
prefill's attention as decode rows (batch-invariant answers, docs/serving.md): of the four
prompts three keep their tokens and the third now follows the float32 pin for all 32 tokens
(17 before). The `bfloat16/avx512-no-bf16` pins (an AVX-512 CPU without AVX512-BF16, e.g.
Intel Ice Lake, where oneDNN emulates bf16) were recorded at the commit that makes its
single-row linears batch-invariant (`cpu_linear.packed_linear`); they agree with the other
pins from the first token on for three prompts and part from them at a near-tie on the
first (logprobs -2.12 / -2.24 in bf16, -2.16 / -2.20 the other way round in float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import arborlm as sgl

pytestmark = pytest.mark.smollm

PINS = json.loads((Path(__file__).parent / "data" / "smollm_greedy_pins.json").read_text())


def _cpu_path() -> str:
    """The bf16 kernel path this CPU takes: 'amx', 'avx512-no-amx' (AVX512-BF16 without AMX),
    'avx512-no-bf16' (AVX-512 without native bf16: oneDNN emulates it) or 'other'."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "other"
    if "amx_bf16" in flags:
        return "amx"
    if "avx512f" not in flags:
        return "other"
    return "avx512-no-amx" if "avx512_bf16" in flags else "avx512-no-bf16"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_outputs_match_pins(dtype):
    key = dtype if dtype == "float32" else f"bfloat16/{_cpu_path()}"
    if key not in PINS:
        pytest.skip(f"no bfloat16 pins for this CPU's kernel path ({key}); the float32 pins still run")
    pins = PINS[key]
    # The pins are the dequantized weights' tokens (int8 activations round otherwise).
    engine = sgl.Engine(dtype=dtype, log_level="warning", quantization="none")
    try:
        prompts = [engine.apply_chat_template(p["messages"]) for p in pins]
        outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 32})
        assert [o["output_ids"] for o in outs] == [p["output_ids"] for p in pins]
        # The first prompt alone gives the same tokens as inside the batch.
        alone = engine.generate(prompts[0], {"temperature": 0, "max_new_tokens": 32})
        assert alone["output_ids"] == pins[0]["output_ids"]
    finally:
        engine.shutdown()
