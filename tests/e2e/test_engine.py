"""The Engine end to end on the tiny random Llama: API shapes, streaming, errors, isolation."""

from __future__ import annotations

import asyncio
import threading

import pytest

from arborlm.errors import InvalidRequestError, ModelLoadError
from tests.runtime.scheduler_helpers import reference_greedy

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def test_generate_shape_and_greedy_tokens(engine, tiny_hf_model):
    ids = engine.tokenizer.encode("Hello there, how are", add_special_tokens=False)
    out = engine.generate("Hello there, how are", GREEDY)
    assert set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert set(meta) >= {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
                         "matched_stop", "e2e_latency"}
    assert meta["prompt_tokens"] == len(ids)
    assert meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert out["output_ids"] == reference_greedy(tiny_hf_model, ids, 8)
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_batch_and_input_ids(engine):
    outs = engine.generate(["a b c", "d e f g"], GREEDY)
    assert isinstance(outs, list) and len(outs) == 2
    ids = engine.tokenizer.encode("a b c", add_special_tokens=False)
    again = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert again["output_ids"] == outs[0]["output_ids"]
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1


def test_n_samples(engine):
    outs = engine.generate("x y z", {"temperature": 1.0, "max_new_tokens": 6, "n": 3, "seed": 7, "ignore_eos": True})
    assert len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1


def test_seed_reproducible(engine):
    params = {"temperature": 0.8, "top_k": 50, "max_new_tokens": 10, "seed": 42, "ignore_eos": True}
    assert engine.generate("seeded", params)["output_ids"] == engine.generate("seeded", params)["output_ids"]


def test_stream_pieces_concatenate_to_final_text(engine):
    params = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    chunks = list(engine.generate("Streaming test", params, stream=True))
    final = engine.generate("Streaming test", params)
    assert "".join(c["text"] for c in chunks) == final["text"]
    assert [t for c in chunks for t in c["output_ids"]] == final["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert "\ufffd" not in "".join(c["text"] for c in chunks[:-1])


def test_async_generate_and_async_stream(engine):
    async def main():
        one = await engine.async_generate("async", GREEDY)
        many = await asyncio.gather(*(engine.async_generate(f"async {i}", GREEDY) for i in range(4)))
        pieces = [c["text"] async for c in await engine.async_generate("async", GREEDY, stream=True)]
        return one, many, pieces

    one, many, pieces = asyncio.run(main())
    assert len(many) == 4
    assert "".join(pieces) == one["text"]


def test_stop_string_not_in_output(engine):
    base = engine.generate("Stop here", {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    text = base["text"]
    stop = text[5:8]
    assert stop and stop in text
    out = engine.generate("Stop here", {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "stop": stop})
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["meta_info"]["matched_stop"] == stop


def test_logprobs(engine):
    out = engine.generate("log probs", GREEDY, return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == 8
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    # Greedy: the chosen token is the most likely one.
    for (lp, tid, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert top[0][1] == tid and top[0][0] == pytest.approx(lp, abs=1e-5)
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"prompt": ""}, "text"),
        ({"prompt": "word " * 2000}, "text"),
        ({"prompt": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"prompt": "x", "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"prompt": "x", "sampling_params": {"top_p": 0.0}}, "top_p"),
        ({"prompt": "x", "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"prompt": "x", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"prompt": "x", "sampling_params": {"top_k": -2}}, "top_k"),
        ({"prompt": "x", "sampling_params": {"bogus_field": 1}}, "bogus_field"),
        ({"input_ids": [1, 2, 10**9]}, "input_ids"),
        ({"prompt": "x", "input_ids": [1]}, "prompt"),
        ({"input_ids": []}, "input_ids"),
        ({"prompt": ["fine", None]}, "prompt"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": "x", "sampling_params": "greedy"}, "sampling_params"),
        ({"prompt": "x", "sampling_params": {"temperature": float("inf")}}, "temperature"),
        ({"prompt": "x", "sampling_params": {"max_new_tokens": "10"}}, "max_new_tokens"),
        ({"prompt": "x", "sampling_params": {"n": 0}}, "n"),
        ({"prompt": "x", "sampling_params": {"stop": 5}}, "stop"),
        ({"prompt": "x", "return_logprob": True, "top_logprobs_num": 10**6}, "top_logprobs_num"),
        ({"prompt": "x", "rid": 5}, "rid"),
    ],
)
def test_bad_input_gets_typed_error_and_engine_keeps_serving(engine, kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        engine.generate(**kwargs)
    assert err.value.param == param
    assert str(err.value)
    assert engine.generate("still alive", GREEDY)["meta_info"]["completion_tokens"] == 8


def test_bad_item_in_batch_rejects_batch_before_running(engine):
    with pytest.raises(InvalidRequestError):
        engine.generate(["fine", ""], GREEDY)
    assert engine.get_server_info()["num_running_reqs"] == 0


def test_abort_in_flight_request_others_unaffected(engine):
    results = {}

    def long_one():
        results["long"] = engine.generate("long", {"max_new_tokens": 5000, "ignore_eos": True}, rid="to-abort")

    thread = threading.Thread(target=long_one)
    thread.start()
    short = engine.generate("short", GREEDY)
    engine.abort_request("to-abort")
    thread.join(30)
    assert not thread.is_alive()
    assert results["long"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert short["meta_info"]["completion_tokens"] == 8


def test_closing_a_stream_aborts_the_request(engine):
    stream = engine.generate("abandoned", {"max_new_tokens": 5000, "ignore_eos": True}, stream=True)
    next(stream)
    stream.close()
    # The leak check of the `engine` fixture asserts the request's memory came back.


def test_server_info_and_flush_cache(engine):
    engine.generate("cache me please", GREEDY)
    info = engine.get_server_info()
    assert info["cached_kv_tokens"] > 0
    assert 0.0 <= info["cache_hit_rate"] <= 1.0
    assert engine.flush_cache() is True
    assert engine.get_server_info()["cached_kv_tokens"] == 0


def test_missing_model_path_is_typed_error():
    import arborlm

    with pytest.raises(ModelLoadError, match="does/not/exist"):
        arborlm.Engine(model="/does/not/exist")


def test_unknown_server_argument_is_type_error():
    import arborlm

    with pytest.raises(TypeError, match="no_such_knob"):
        arborlm.Engine(no_such_knob=1)


def test_engine_from_stdin_script_without_main_guard(tiny_llama_dir):
    """spawn must not re-run the caller's script: `python - < script` with a module-level Engine works."""
    import subprocess
    import sys

    script = (
        "import arborlm\n"
        f"engine = arborlm.Engine(model={str(tiny_llama_dir)!r}, dtype='float32', max_total_tokens=1024)\n"
        "print('tokens', engine.generate('hi', {'max_new_tokens': 3, 'ignore_eos': True})['meta_info']['completion_tokens'])\n"
        "engine.shutdown()\n"
    )
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokens 3" in done.stdout


def test_bad_request_among_concurrent_ones_fails_alone(engine):
    async def main():
        good = [engine.async_generate(f"good {i}", GREEDY) for i in range(3)]
        bad = engine.async_generate("bad", GREEDY, return_logprob=True, top_logprobs_num=10**6)
        return await asyncio.gather(*good, bad, return_exceptions=True)

    *good, bad = asyncio.run(main())
    assert isinstance(bad, InvalidRequestError)
    assert all(g["meta_info"]["finish_reason"]["type"] == "length" for g in good)


def test_max_new_tokens_zero_prefills_only_and_caches_the_prompt(engine):
    out = engine.generate("warm this prefix for later requests", {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    again = engine.generate("warm this prefix for later requests", GREEDY)
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"max_total_tokens": "abc"}, TypeError),
        ({"page_size": 1.5}, TypeError),
        ({"model": 123}, TypeError),
        ({"device": "tpu"}, ValueError),
        ({"schedule_policy": "random"}, ValueError),
        ({"mem_fraction": 0}, ValueError),
    ],
)
def test_bad_server_arguments_fail_before_starting(kwargs, error):
    import arborlm

    with pytest.raises(error, match=next(iter(kwargs)).replace("model", "model_path")):
        arborlm.Engine(**kwargs)


@pytest.mark.parametrize("hostile", [
    {"temperature": 1e-40},
    {"temperature": 5e-324},
    {"temperature": 0.9, "repetition_penalty": 1e-30, "seed": 3},
    {"temperature": 0.9, "repetition_penalty": 1e30, "seed": 3},
])
def test_underflowing_sampling_params_do_not_hurt_the_batch(engine, hostile):
    """Issue 16: a temperature that underflows float32 or a penalty near 0 made the sampler
    produce NaN, and torch.multinomial then aborted every request of the step. Now the tiny
    temperature is greedy, the penalty is clamped, and every request of the batch finishes."""
    prompts = ["neighbour one", "the hostile one", "neighbour two"]
    params = [GREEDY, {**GREEDY, **hostile}, GREEDY]
    outs = engine.generate(prompts, params)
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 3
    assert outs[0]["output_ids"] == engine.generate(prompts[0], GREEDY)["output_ids"]
    if hostile.get("temperature", 1) < 1e-5:
        assert outs[1]["output_ids"] == engine.generate(prompts[1], GREEDY)["output_ids"]
