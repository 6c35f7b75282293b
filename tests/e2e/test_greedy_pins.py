"""The default model's greedy tokens are pinned: restructuring the runtime must not change them.

`data/smollm_greedy_pins.json` holds the greedy output ids of SmolLM2-135M-Instruct for a
few chat prompts, in float32 and in bfloat16 (the default), sent as one batch with
`max_new_tokens=32`. They were recorded on the tree before the model worker / KV manager
restructuring (commit 2659038) on this project's CPU machine; the float32 ones also agree
with transformers where `test_smollm.py` checks it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import arborlm as sgl

pytestmark = pytest.mark.smollm

PINS = json.loads((Path(__file__).parent / "data" / "smollm_greedy_pins.json").read_text())


@pytest.mark.parametrize("dtype", sorted(PINS))
def test_greedy_outputs_match_pins(dtype):
    engine = sgl.Engine(dtype=dtype, log_level="warning")
    try:
        pins = PINS[dtype]
        prompts = [engine.apply_chat_template(p["messages"]) for p in pins]
        outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 32})
        assert [o["output_ids"] for o in outs] == [p["output_ids"] for p in pins]
        # The first prompt alone gives the same tokens as inside the batch.
        alone = engine.generate(prompts[0], {"temperature": 0, "max_new_tokens": 32})
        assert alone["output_ids"] == pins[0]["output_ids"]
    finally:
        engine.shutdown()
