"""A Qwen3-Embedding-style checkpoint on the in-process Engine (`is_embedding=True`): a bare random
`Qwen3Model` (no LM head, no sentence-transformers files: last-token pooling, normalized), prompts
batched as prefill-only requests; each vector against transformers' last hidden state, cosine >= 0.9999,
generation refused by name, and the bare checkpoint refused for a generation server."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import arborlm
from arborlm.errors import InvalidRequestError, ModelLoadError
from arborlm.runtime.model_loader import load_model
from tests.conftest import TOKENIZER_FILES

PROMPTS = [[5, 17, 300, 2], [9, 8, 7, 6, 5, 4, 3, 2], [1200]]


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory, smollm_dir):
    from transformers import Qwen3Config, Qwen3Model

    folder = tmp_path_factory.mktemp("tiny_qwen3_embedding")
    config = Qwen3Config(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(2)
    model = Qwen3Model(config).to(torch.float32).eval()
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (smollm_dir / name).is_file():
            (folder / name).write_bytes((smollm_dir / name).read_bytes())
    engine = arborlm.Engine(model=str(folder), dtype="float32", max_total_tokens=2048, is_embedding=True,
                            log_level="warning")
    yield engine, model
    engine.shutdown()


def test_last_token_pooling_matches_transformers(qwen3_embedding):
    engine, model = qwen3_embedding
    results = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 0})
    for prompt, result in zip(PROMPTS, results):
        with torch.no_grad():
            expected = model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
        vector = torch.tensor(result["embedding"])  # the raw pooled state; the HTTP route normalizes
        assert vector.shape == (64,)
        assert float(torch.nn.functional.cosine_similarity(vector, expected, dim=0)) >= 0.9999
        assert result["meta_info"]["completion_tokens"] == 0


def test_generation_is_refused(qwen3_embedding):
    engine, _ = qwen3_embedding
    with pytest.raises(InvalidRequestError, match="embedding"):
        engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 2})


def test_a_bare_decoder_is_not_served_for_generation(qwen3_embedding):
    folder = Path(qwen3_embedding[0].server_args.model.model_path)
    with pytest.raises(ModelLoadError, match="--is-embedding"):
        load_model(folder, torch.float32, torch.device("cpu"))
