"""The Triton quantized GEMM (`kernels/triton_quant_linear.py`) against the torch oracle
(`quant_reference.quant_linear`: dequantize, then a float matmul), under Triton's interpreter on
the CPU (`TRITON_INTERPRET=1`, set before the kernel is imported); on a CUDA machine run with
`TRITON_INTERPRET=0` to test the compiled kernel. GGUF blocks of Q8_0 / Q4_0 / Q4_1 from
`gguf.quants`, int8 per-channel weights, odd row counts and a last tile of padding rows.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

gguf = pytest.importorskip("gguf")
pytest.importorskip("triton")

from arborlm.kernels import quant_reference  # noqa: E402
from arborlm.kernels.quant_layout import pack_ggml_blocks, pack_int8_per_channel  # noqa: E402
from arborlm.kernels.triton_quant_linear import quant_linear  # noqa: E402

pytestmark = pytest.mark.interpreter
DEVICE = torch.device("cuda" if os.environ["TRITON_INTERPRET"] != "1" else "cpu")
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)


def packed(fmt: str, out_features: int, in_features: int, seed: int = 0):
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.1
    if fmt == "int8":
        return pack_int8_per_channel(w)
    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    return pack_ggml_blocks(fmt, torch.from_numpy(gguf.quants.quantize(w.numpy(), qtype)), in_features)


def to_device(weight):
    from dataclasses import replace

    return replace(weight, **{k: None if t is None else t.to(DEVICE) for k, t in weight.arrays().items()})


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "int8"])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 40, 64), (7, 16, 96), (33, 70, 32)])
def test_triton_gemm_equals_the_oracle(fmt, rows, out_features, in_features):
    weight = packed(fmt, out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(out_features)
    expected = quant_reference.quant_linear(x, weight, bias)
    got = quant_linear(x.to(DEVICE), to_device(weight), bias.to(DEVICE)).cpu()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_bf16_inputs_and_refusals():
    weight = packed("q4_1", 48, 64)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = quant_linear(x.to(DEVICE), to_device(weight)).cpu()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), quant_reference.quant_linear(x.float(), weight), atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="in_features|64"):
        quant_linear(torch.randn(2, 32).to(DEVICE), to_device(weight))
    k_weight = pack_ggml_blocks("q6_k", torch.zeros(16, 210, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="q6_k"):
        quant_linear(torch.randn(2, 256).to(DEVICE), to_device(k_weight))


def test_triton_ops_serve_stacked_shards_and_fall_back_for_k_quants():
    from arborlm.kernels.quant_ops import QuantOps, TritonQuantOps

    shards = [to_device(packed("q4_0", 32, 64, seed=3)), to_device(packed("q8_0", 24, 64, seed=4))]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    bias = torch.randn(56).to(DEVICE)
    ops = TritonQuantOps()
    torch.testing.assert_close(ops.linear(x, ops.prepare(shards), bias), QuantOps().linear(x, shards, bias),
                               atol=1e-4, rtol=1e-4)
    k_weight = to_device(pack_ggml_blocks("q6_k", torch.zeros(16, 210, dtype=torch.uint8), 256))
    y = torch.randn(2, 256).to(DEVICE)
    torch.testing.assert_close(ops.linear(y, [k_weight]), QuantOps().linear(y, [k_weight]))
