"""Loading streams the checkpoint tensor by tensor, with a progress bar on stderr.

A tiny Llama saved in several safetensors shards: while the loader asks for tensor k+1,
no tensor before k is alive any more (each is copied into the model and dropped, so
loading holds the weights plus one tensor), every tensor of the checkpoint is read once,
and the logits are transformers'. The bar (tqdm, on stderr) counts the tensors; it is
shown on a terminal or when asked, and stays quiet otherwise.
"""

from __future__ import annotations

import io
import weakref

import pytest
import torch

from arborlm.runtime import model_loader
from arborlm.runtime.models import weight_utils
from tests.runtime.family_helpers import PROMPTS, check_prompt_logits, hf_logits, tiny_checkpoint
from tests.runtime.model_helpers import ModelHarness


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """(a tiny Llama checkpoint in several shards, the transformers original)."""
    folder = tmp_path_factory.mktemp("sharded")
    reference = tiny_checkpoint(folder / "one", "llama")
    reference.save_pretrained(folder / "shards", max_shard_size="60KB")
    for name in ("config.json", "generation_config.json"):
        (folder / "shards" / name).write_bytes((folder / "one" / name).read_bytes())
    return folder / "shards", reference


def test_checkpoint_has_several_shards(sharded):
    assert len(list(sharded[0].glob("*.safetensors"))) >= 3


def test_loading_holds_one_tensor_at_a_time(sharded, monkeypatch):
    folder, reference = sharded
    read = model_loader._safetensors_tensors
    yielded: list[weakref.ref] = []
    alive_before: list[int] = []

    def spying(files):
        for name, tensor in read(files):
            # The loader's loop variable may still hold the previous tensor; older ones must be gone.
            alive_before.append(sum(ref() is not None for ref in yielded[:-1]))
            yielded.append(weakref.ref(tensor))
            yield name, tensor

    monkeypatch.setattr(model_loader, "_safetensors_tensors", spying)
    loaded = model_loader.load_model(folder, torch.float32, torch.device("cpu"), progress=False)
    assert len(yielded) == len(reference.state_dict())
    assert max(alive_before) == 0
    harness = ModelHarness(loaded.model, loaded.hf_config)
    out = harness.extend([harness.new_req() for _ in PROMPTS], PROMPTS, return_full_logits=True)
    torch.testing.assert_close(out.full_logits, torch.cat([hf_logits(reference, ids) for ids in PROMPTS]),
                               atol=1e-4, rtol=0)


def test_sharded_checkpoint_matches_the_original(sharded):
    check_prompt_logits(*sharded)


def test_progress_bar_counts_the_tensors(sharded, capsys):
    folder, reference = sharded
    model_loader.load_model(folder, torch.float32, torch.device("cpu"), progress=True)
    err = capsys.readouterr().err
    total = len(reference.state_dict())
    assert f"loading {folder.name}" in err and f"{total}/{total}" in err


def test_no_bar_when_stderr_is_not_a_terminal(sharded, capsys):
    model_loader.load_model(sharded[0], torch.float32, torch.device("cpu"))  # progress=None: pytest's stderr
    assert capsys.readouterr().err == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("progress", "shown"), [(None, True), (False, False), (True, True)])
def test_weight_progress_on_a_terminal(monkeypatch, progress, shown):
    terminal = _Terminal()
    monkeypatch.setattr(weight_utils.sys, "stderr", terminal)
    assert list(weight_utils.weight_progress(range(5), 5, "loading x", progress)) == list(range(5))
    assert ("5/5" in terminal.getvalue()) is shown
