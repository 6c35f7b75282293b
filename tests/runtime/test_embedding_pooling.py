"""The embedding step's pooling without a model: sentence-transformers configs read into a
`PoolingConfig` (and the ones refused), `dimensions` rules, and `Embedder` pooling last, mean and CLS
over one step or across the chunks of a chunked prefill (equal to pooling the whole prompt at once)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from arborlm.errors import ModelLoadError
from arborlm.runtime.embedding import Embedder
from arborlm.runtime.pooling_config import PoolingConfig, normalized, read_pooling_config

POOLING = "sentence_transformers.models.Pooling"


def st_folder(tmp_path, modes: dict, normalize: bool = True, extra_module: str | None = None, config=None):
    (tmp_path / "config.json").write_text(json.dumps(config or {"hidden_size": 8}))
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": POOLING}]
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    if extra_module:
        modules.append({"idx": 3, "path": "3", "type": extra_module})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    return tmp_path


@pytest.mark.parametrize(("modes", "pooling"), [
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean"),
    ({"pooling_mode_cls_token": True}, "cls"),
])
def test_sentence_transformers_pooling_is_read(tmp_path, modes, pooling):
    cfg = read_pooling_config(st_folder(tmp_path, modes, normalize=pooling != "cls"))
    assert cfg == PoolingConfig(pooling, pooling != "cls", 8, ())


@pytest.mark.parametrize("modes", [{"pooling_mode_max_tokens": True}, {},
                                   {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}])
def test_unserved_pooling_is_refused(tmp_path, modes):
    with pytest.raises(ModelLoadError, match="pooling"):
        read_pooling_config(st_folder(tmp_path, modes))


def test_a_dense_module_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="Dense"):
        read_pooling_config(st_folder(tmp_path, {"pooling_mode_mean_tokens": True},
                                      extra_module="sentence_transformers.models.Dense"))


def test_without_sentence_transformers_files_last_token_normalized(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 16, "is_matryoshka": True}))
    assert read_pooling_config(tmp_path) == PoolingConfig("last", True, 16, None)


@pytest.mark.parametrize(("matryoshka", "dimensions", "ok"), [
    ((), None, True), ((), 8, True), ((), 4, False), (None, 4, True), (None, 9, False), (None, 0, False),
    ((2, 4), 4, True), ((2, 4), 3, False),
])
def test_dimensions(matryoshka, dimensions, ok):
    assert (PoolingConfig("last", True, 8, matryoshka).check_dimensions(dimensions) is None) == ok


def test_normalized():
    assert normalized([3.0, 4.0]) == [0.6, 0.8] and normalized([0.0, 0.0]) == [0.0, 0.0]


class RowsModel:
    """`hidden_states` returns given rows: the rows of the step's new tokens."""

    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden
        self.offset = 0

    def hidden_states(self, forward_batch) -> torch.Tensor:
        n = sum(forward_batch.extend_seq_lens_cpu)
        rows = self.hidden[self.offset:self.offset + n]
        self.offset += n
        return rows


def step(prefix_lens: list[int], seq_lens: list[int]):
    return SimpleNamespace(extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=seq_lens)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_chunked_pooling_equals_whole(pooling):
    torch.manual_seed(0)
    a, b = torch.randn(7, 4), torch.randn(3, 4)
    expected_a = {"last": a[-1], "mean": a.mean(0), "cls": a[0]}[pooling]
    expected_b = {"last": b[-1], "mean": b.mean(0), "cls": b[0]}[pooling]
    cfg = PoolingConfig(pooling, True, 4)
    # one step: both prompts whole
    whole = Embedder(RowsModel(torch.cat([a, b])), cfg).forward(step([0, 0], [7, 3]), ["a", "b"], [7, 3])
    assert torch.allclose(torch.tensor(whole[0]), expected_a) and torch.allclose(torch.tensor(whole[1]), expected_b)
    # `a` in chunks of 3, 3, 1; `b` whole inside the second step
    embedder = Embedder(RowsModel(torch.cat([a[:3], a[3:6], b, a[6:]])), cfg)
    assert embedder.forward(step([0], [3]), ["a"], [7]) == [None]
    second = embedder.forward(step([3, 0], [3, 3]), ["a", "b"], [7, 3])
    assert second[0] is None and torch.allclose(torch.tensor(second[1]), expected_b)
    last = embedder.forward(step([6], [1]), ["a"], [7])
    assert torch.allclose(torch.tensor(last[0]), expected_a, atol=1e-6)


def test_a_model_without_hidden_states_is_refused():
    with pytest.raises(ModelLoadError, match="hidden_states"):
        Embedder(object(), PoolingConfig())
