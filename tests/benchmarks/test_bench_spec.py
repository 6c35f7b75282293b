"""bench_spec.py's agent cell without a model: a fake engine answers each call, and the cell
must feed every answer into that session's next call and sum the waves' figures."""

from __future__ import annotations

import argparse

from benchmarks import bench_spec


class FakeEngine:
    """Answers call k of a batch with ``k + 1`` tokens; counts steps like a scheduler would."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.params: list[dict] = []
        self.info = {"num_decode_steps": 0, "num_extend_steps": 0, "spec_num_verify_steps": 0,
                     "spec_num_accepted_tokens": 0}
        self.tokenizer = self

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * len(text.split())

    def apply_chat_template(self, messages) -> str:
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages)

    def get_server_info(self) -> dict:
        return dict(self.info)

    def generate(self, prompts: list[str], params: dict | list[dict]) -> list[dict]:
        params = [params] * len(prompts) if isinstance(params, dict) else params
        assert all(p["stop"] == ["Observation:"] for p in params)
        self.batches.append(prompts)
        self.params.extend(params)
        self.info["num_extend_steps"] += 1
        self.info["num_decode_steps"] += 3
        self.info["spec_num_accepted_tokens"] += 2
        outs = []
        for k in range(len(prompts)):
            n = k + 1
            outs.append({"text": f"Thought: answer {len(self.batches)}.{k}", "output_ids": list(range(n)),
                         "meta_info": {"completion_tokens": n, "e2e_latency": 0.5, "ttft": 0.1,
                                       "spec_verify_ct": 1}})
        return outs


def test_agent_cell_feeds_answers_forward_and_sums_waves():
    args = argparse.Namespace(max_new_tokens=16, agent_system_len=40, agent_question_len=8, agent_steps=3)
    engine = FakeEngine()
    sessions = bench_spec.agent_sessions(engine, 2, seed=0, args=args)
    cell = bench_spec.run_agent_cell(engine, sessions, {"temperature": 0})
    assert [len(b) for b in engine.batches] == [2, 2, 2]  # three waves of both sessions
    # The second wave's prompt of session k holds the first wave's answer to it.
    for k in range(2):
        assert f"Thought: answer 1.{k}" in engine.batches[1][k]
        assert f"Thought: answer 2.{k}" in engine.batches[2][k]
    assert cell["tokens"] == 3 * (1 + 2)
    assert cell["steps"] == 3 * 4
    assert cell["output_ids"] == [[0] * 3, [0, 1] * 3]
    assert cell["accept_len"] == (6 + 6) / 6
    assert cell["tok_s"] == cell["tokens"] / cell["wall_s"]


def test_a_small_batch_cell_runs_its_prompts_in_consecutive_batches():
    engine = FakeEngine()
    params = {"temperature": 0, "stop": ["Observation:"]}
    cell = bench_spec.run_in_waves(engine, ["a", "b", "c", "d", "e"], 2, params)
    assert engine.batches == [["a", "b"], ["c", "d"], ["e"]]
    assert cell["output_ids"] == [[0], [0, 1], [0], [0, 1], [0]]
    assert cell["tokens"] == 7 and cell["steps"] == 12


def test_sampled_cells_give_each_request_its_own_seed():
    engine = FakeEngine()
    bench_spec.run_in_waves(engine, ["a", "b", "c", "d", "e"], 2,
                            {"temperature": 0.7, "seed": 100, "stop": ["Observation:"]})
    assert [p["seed"] for p in engine.params] == [100, 101, 102, 103, 104]
    args = argparse.Namespace(max_new_tokens=16, agent_system_len=40, agent_question_len=8, agent_steps=2)
    engine = FakeEngine()
    sessions = bench_spec.agent_sessions(engine, 2, seed=0, args=args)
    bench_spec.run_agent_cell(engine, sessions, {"temperature": 0.7, "seed": 5})
    assert [p["seed"] for p in engine.params] == [5, 6, 5, 6]  # session k's calls: seed 5 + k


def test_several_draft_token_counts_get_one_ngram_engine_each(monkeypatch, tmp_path):
    """``--num-draft-tokens 6 12``: engines off, ngram-6 and ngram-12, each NGRAM one with its count
    (so the settings compare inside one interleaved run); one value keeps the name ``ngram``."""
    made = []

    def engine(**kwargs):
        made.append(kwargs)
        return kwargs

    monkeypatch.setattr(bench_spec.arborlm, "Engine", engine)
    args = argparse.Namespace(model=None, dtype="auto", quantization=None, methods=["ngram"], num_draft_tokens=[6, 12],
                              draft_self=False)
    engines = bench_spec.make_engines(args, tmp_path)
    assert list(engines) == ["off", "ngram-6", "ngram-12"]
    assert [e.get("speculative_num_draft_tokens") for e in engines.values()] == [None, 6, 12]
    args.num_draft_tokens = [8]
    assert list(bench_spec.make_engines(args, tmp_path)) == ["off", "ngram"]
