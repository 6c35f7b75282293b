"""benchmarks/gguf_models.py: a GGUF file written again in another format keeps its metadata (all
but general.file_type) and its tensors (Q8_0 / Q4_0 round trips of the values, F16 to fp16
rounding), and arborlm serves the written file: prompt logits of the Q8_0 file as stored within
5 % of the float32 file dequantized."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from arborlm.runtime.model_loader import load_model, resolve_checkpoint, resolve_quantization  # noqa: E402
from benchmarks import gguf_models  # noqa: E402
from tests.runtime.family_helpers import PROMPTS, tiny_checkpoint  # noqa: E402
from tests.runtime.gguf_writer import write_gguf  # noqa: E402
from tests.runtime.model_helpers import ModelHarness  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf_models")
    reference = tiny_checkpoint(folder, "llama")
    return write_gguf(reference, folder / "tiny-f32.gguf")


def fields(reader) -> dict:
    return {name: f.contents() for name, f in reader.fields.items()
            if not name.startswith("GGUF.") and name != "general.file_type"}


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "F16"])
def test_requantized_file_keeps_metadata_and_values(tiny_gguf, tmp_path, fmt):
    dst = tmp_path / f"tiny-{fmt}.gguf"
    gguf_models.requantize_file(tiny_gguf, dst, fmt)
    src, out = gguf.GGUFReader(str(tiny_gguf)), gguf.GGUFReader(str(dst))
    assert fields(out) == fields(src)
    assert out.fields["general.file_type"].contents() == gguf_models.FILE_TYPES[fmt]
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    written = {t.name: t for t in out.tensors}
    assert set(written) == {t.name for t in src.tensors}
    for t in src.tensors:
        w = written[t.name]
        values = np.asarray(t.data, np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if values.ndim == 1:
            assert w.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(np.asarray(w.data), values)
            continue
        assert w.tensor_type == qtype
        got = gguf.quants.dequantize(w.data, w.tensor_type).reshape(values.shape)
        expected = values.astype(np.float16).astype(np.float32) if fmt == "F16" else \
            gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype).reshape(values.shape)
        np.testing.assert_array_equal(got, expected)


def test_written_q8_0_file_is_served_as_stored(tiny_gguf, tmp_path):
    dst = tmp_path / "tiny-Q8_0.gguf"
    gguf_models.requantize_file(tiny_gguf, dst, "Q8_0")
    assert resolve_quantization(str(dst), None) == dst  # served quantized by default
    served = load_model(resolve_checkpoint(str(dst), weights=False), torch.float32, CPU, gguf_file=dst)
    plain = load_model(resolve_checkpoint(str(tiny_gguf)), torch.float32, CPU)

    def logits(loaded):
        harness = ModelHarness(loaded.model, loaded.hf_config, dtype=torch.float32)
        return harness.extend([harness.new_req() for _ in PROMPTS], PROMPTS, return_full_logits=True).full_logits

    q, p = logits(served), logits(plain)
    assert 0 < float((q - p).norm() / p.norm()) < 0.05
