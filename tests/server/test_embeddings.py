"""`/v1/embeddings` and `/encode` on an `--is-embedding` server of a tiny random bare Llama (a
sentence-transformers folder: mean pooling, normalized, Matryoshka sizes 16 and 32), prefilled in
chunks of 16 tokens: vectors against transformers (and sentence-transformers when installed), cosine
>= 0.9999 in float32; bad input and generation requests are 400s; a generation server refuses embeddings."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import pytest
import torch
from openai import BadRequestError, OpenAI
from openai.types import CreateEmbeddingResponse

from tests.conftest import TOKENIZER_FILES
from tests.server.conftest import API_KEY, start_server, stop_server, wait_idle

TEXTS = ["The radix tree shares every prefix.", "Embeddings for retrieval, " * 6 + "long enough to chunk."]
MATRYOSHKA = [16, 32]


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory, smollm_dir) -> Path:
    """A 2-layer random LlamaModel (no head) saved as sentence-transformers saves one."""
    from transformers import LlamaConfig, LlamaModel

    folder = tmp_path_factory.mktemp("tiny_embedding")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(1)
    LlamaModel(config).to(torch.float32).save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, "matryoshka_dimensions": MATRYOSHKA}))
    for name in TOKENIZER_FILES:
        if (smollm_dir / name).is_file():
            (folder / name).write_bytes((smollm_dir / name).read_bytes())
    # an embedding checkpoint has no chat template (generation routes must still say it is an embedding server)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}))
    (folder / "2_Normalize").mkdir()
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return folder


@pytest.fixture(scope="module")
def embedding_server(embedding_dir, tmp_path_factory):
    """Not one of the shared servers (`_servers`): the other modules must not get this one."""
    srv = start_server(embedding_dir, tmp_path_factory.mktemp("embedding") / "server.log", "--is-embedding",
                       "--chunked-prefill-size", "16", "--max-prefill-tokens", "16")
    yield srv
    stop_server(srv)


@pytest.fixture
def emb_http(embedding_server):
    with embedding_server.client() as client:
        yield client
        info = wait_idle(client)
        assert info["free_req_rows"] == info["total_req_rows"]
        assert info["free_kv_tokens"] == info["max_total_tokens"]  # no prefix cache: every slot is free


@pytest.fixture
def client(embedding_server, emb_http) -> OpenAI:
    return OpenAI(base_url=f"{embedding_server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(embedding_dir):
    """transformers' LlamaModel: mean of the last hidden states over the tokens, then L2-normalized."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(embedding_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(embedding_dir))

    def embed(text: str, size: int | None = None) -> torch.Tensor:
        ids = torch.tensor([tokenizer.encode(text)])
        with torch.no_grad():
            vector = model(input_ids=ids).last_hidden_state[0].mean(0)
        return torch.nn.functional.normalize(vector[:size], dim=-1)

    return embed


def cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.as_tensor(b), dim=0))


def test_openai_client_matches_transformers(client, reference, tiny_tokenizer):
    resp = client.embeddings.create(model="default", input=TEXTS)  # the client asks for base64
    assert isinstance(resp, CreateEmbeddingResponse) and [d.index for d in resp.data] == [0, 1]
    assert len(tiny_tokenizer.encode(TEXTS[1])) > 16  # the second one was prefilled in chunks
    for text, item in zip(TEXTS, resp.data):
        assert len(item.embedding) == 64
        assert cosine(item.embedding, reference(text)) >= 0.9999
        assert abs(sum(v * v for v in item.embedding) - 1) < 1e-5
    assert resp.usage.prompt_tokens == sum(len(tiny_tokenizer.encode(t)) for t in TEXTS)


def test_float_and_base64_and_token_ids_agree(emb_http, tiny_tokenizer):
    floats = emb_http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "float"}).json()
    CreateEmbeddingResponse.model_validate(floats)
    packed = emb_http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats["data"][0]["embedding"], abs=1e-7)
    ids = emb_http.post("/v1/embeddings", json={"input": [tiny_tokenizer.encode(TEXTS[0])]}).json()
    assert ids["data"][0]["embedding"] == pytest.approx(floats["data"][0]["embedding"], abs=1e-6)


def test_matryoshka_dimensions(client, reference):
    resp = client.embeddings.create(model="default", input=TEXTS[0], dimensions=16)
    assert len(resp.data[0].embedding) == 16
    assert cosine(resp.data[0].embedding, reference(TEXTS[0], 16)) >= 0.9999


def test_sglang_encode(emb_http, reference):
    one = emb_http.post("/encode", json={"text": TEXTS[0]}).json()
    assert cosine(one["embedding"], reference(TEXTS[0])) >= 0.9999
    many = emb_http.post("/encode", json={"text": TEXTS}).json()
    assert [cosine(m["embedding"], reference(t)) >= 0.9999 for m, t in zip(many, TEXTS)] == [True, True]


def test_sentence_transformers_agrees(client, embedding_dir):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(embedding_dir), device="cpu")
    expected = model.encode(TEXTS, convert_to_tensor=True).float()
    resp = client.embeddings.create(model="default", input=TEXTS)
    for item, vector in zip(resp.data, expected):
        assert cosine(item.embedding, vector) >= 0.9999


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "dimensions": 17}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 65}, "dimensions"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input[1]"),
    ({"input": [[1, 2], [10**9]]}, "input[1][0]"),  # the id's place, as /detokenize names it
    ({"input": [5, -1]}, "input[1]"),
    ({"input": [[3, 4, 49152]]}, "input[0][2]"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_input_is_a_400(emb_http, body, param):
    resp = emb_http.post("/v1/embeddings", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.json()
    assert emb_http.post("/v1/embeddings", json={"input": "still serving"}).status_code == 200


def test_embedding_server_refuses_generation(client, emb_http):
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "model" and "--is-embedding" in e.value.body["message"]
    resp = emb_http.post("/v1/responses", json={"model": "default", "input": "hi"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model", resp.json()
    assert "--is-embedding" in resp.json()["error"]["message"]
    resp = emb_http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 400 and "embedding" in resp.json()["error"]["message"]
    assert emb_http.get("/get_model_info").json()["is_generation"] is False
    assert emb_http.get("/health_generate").status_code == 200  # a prefill-only probe


def test_generation_server_refuses_embeddings(http):
    resp = http.post("/v1/embeddings", json={"input": "hi"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
    assert "--is-embedding" in resp.json()["error"]["message"]
    assert http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_encode_names_an_out_of_vocabulary_id(emb_http):
    resp = emb_http.post("/encode", json={"input_ids": [1, 10**9]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input_ids[1]", resp.json()
    assert emb_http.post("/encode", json={"input_ids": [1, 2]}).status_code == 200
