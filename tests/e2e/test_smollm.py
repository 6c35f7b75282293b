"""End to end on the default model, SmolLM2-135M-Instruct (one float32 Engine for the module)."""

from __future__ import annotations

import pytest
import torch

import arborlm as sgl

pytestmark = pytest.mark.smollm


@pytest.fixture(scope="module")
def smollm_engine():
    # transformers' reference runs the dequantized weights; so does this engine.
    engine = sgl.Engine(dtype="float32", log_level="warning", quantization="none")
    yield engine
    engine.shutdown()


def test_default_model_greedy_matches_transformers(smollm_engine, smollm_dir):
    from transformers import AutoModelForCausalLM

    prompt = smollm_engine.apply_chat_template([{"role": "user", "content": "Name three colors."}])
    out = smollm_engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24})
    ids = smollm_engine.tokenizer.encode(prompt, add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        # An explicit mask: the prompt holds <|im_end|>, which is also SmolLM2's pad id.
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=24, do_sample=False, pad_token_id=2)
    # Both stop at the same EOS (or run the full 24 tokens).
    assert out["output_ids"] == ref[0, len(ids):].tolist()


@sgl.function
def agent(s, question):
    s += sgl.system("You are a concise assistant. Answer in one sentence.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("a1", max_tokens=24))
    s += sgl.user("Give one example.")
    s += sgl.assistant(sgl.gen("a2", max_tokens=24))
    s += sgl.user("Summarise in three words.")
    s += sgl.assistant(sgl.gen("a3", max_tokens=12))


def test_agent_program_later_calls_hit_the_cache(smollm_engine):
    state = agent.run(question="What is a KV cache?", backend=smollm_engine, temperature=0)
    metas = [state.get_meta_info(n) for n in ("a1", "a2", "a3")]
    assert all(state[n].strip() for n in ("a1", "a2", "a3"))
    for earlier, later in zip(metas, metas[1:]):
        assert later["cached_tokens"] > 0
        # The earlier call's prompt (at least) is reused.
        assert later["cached_tokens"] >= earlier["prompt_tokens"] - 1
    info = smollm_engine.get_server_info(check_invariants=True)
    assert info["cache_hit_rate"] > 0


def test_streaming_non_ascii_has_no_replacement_characters(smollm_engine):
    prompt = smollm_engine.apply_chat_template(
        [{"role": "user", "content": "Écris une phrase en français avec des accents, puis 日本語, puis 🙂."}]
    )
    params = {"temperature": 0, "max_new_tokens": 40}
    chunks = [c["text"] for c in smollm_engine.generate(prompt, params, stream=True)]
    final = smollm_engine.generate(prompt, params)["text"]
    assert "".join(chunks) == final
    assert all("\ufffd" not in c for c in chunks)
