"""The AMX bf16 linear layer of the native CPU kernels (`NativeLayerOps.linear`).

Oracle: oneDNN's prepacked linear (`cpu_linear.packed_linear`), which runs the same
AMX tile products in the same K order; up to 32 rows the results must be equal bit
for bit (decode steps then sample the same tokens as with oneDNN). With a bias, or
beyond 32 rows, the oracle is the float32 product rounded once, within one bf16 ulp.
Skipped where the CPU or the compiler has no AMX (the library then never calls it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from arborlm.kernels import cpu_linear, cpu_ops
from arborlm.kernels.cpu_ops import AmxWeight, LayerOps, NativeLayerOps, pack_amx_weight

BF16_RTOL = 1 / 128


@pytest.fixture(scope="module")
def ops(amx_ops) -> NativeLayerOps:
    return amx_ops


def weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)


def rows(n: int, in_features: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, in_features, generator=gen).to(torch.bfloat16)


def close_to_float32(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    expected = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=BF16_RTOL, atol=1e-2)


@pytest.mark.parametrize("num_rows", [1, 2, 7, 8, 15, 16, 17, 31, 32])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576), (100, 64)], ids=str)
def test_equals_onednn_bit_for_bit(ops, num_rows, shape):
    w, x = weight(*shape), rows(num_rows, shape[1])
    packed = ops.pack_linear(w)
    assert isinstance(packed, AmxWeight)
    out = ops.linear(x, w, None, packed)
    assert out.shape == (num_rows, shape[0]) and out.dtype == torch.bfloat16
    assert torch.equal(out, cpu_linear.packed_linear(x, cpu_linear.pack_weight(w), None))


@pytest.mark.parametrize("num_rows", [33, 48, 64])
def test_two_row_chunks_and_a_ragged_last_one(ops, num_rows):
    w, x = weight(200, 96), rows(num_rows, 96)  # 200 columns: the last block is 8 wide
    close_to_float32(ops.linear(x, w, None, ops.pack_linear(w)), x, w)


def test_bias_is_added_before_rounding(ops):
    w, x = weight(130, 64), rows(5, 64)
    bias = torch.linspace(-3, 3, 130).to(torch.bfloat16)
    close_to_float32(ops.linear(x, w, bias, ops.pack_linear(w)), x, w, bias)


def test_strided_rows_and_an_empty_input(ops):
    w = weight(64, 64)
    packed = ops.pack_linear(w)
    wide = rows(4, 96)
    x = wide[:, 16:80]  # row stride 96, rows contiguous
    close_to_float32(ops.linear(x, w, None, packed), x, w)
    assert ops.linear(rows(0, 64), w, None, packed).shape == (0, 64)


def test_longer_inputs_take_onednn(ops):
    w = weight(96, 64)
    x = rows(cpu_ops.AMX_MAX_ROWS + 1, 64)
    packed = ops.pack_linear(w)
    assert torch.equal(ops.linear(x, w, None, packed), cpu_linear.packed_linear(x, packed.onednn, None))


def test_other_dtypes_and_shapes_are_not_packed_for_amx(ops):
    assert not isinstance(ops.pack_linear(weight(64, 48)), AmxWeight)  # 48 is not a multiple of 32
    assert ops.pack_linear(torch.zeros(64, 64)) is None  # float32: F.linear
    with pytest.raises(ValueError, match="in % 32 == 0"):
        pack_amx_weight(weight(64, 48))
    with pytest.raises(ValueError, match="bf16"):
        pack_amx_weight(torch.zeros(64, 64))


def test_float32_input_falls_back_to_torch(ops):
    w = weight(64, 64)
    x = rows(3, 64).float()
    out = ops.linear(x, w.float(), None, None)
    torch.testing.assert_close(out, F.linear(x, w.float()))
    assert LayerOps().linear(x, w.float(), None, None).dtype == torch.float32


def test_a_bf16_model_generates_the_same_tokens_as_with_onednn(ops, tiny_llama_dir, tiny_tokenizer, monkeypatch):
    """Continuous batching of a bf16 model: every decode step's linear layers run on AMX
    tiles, and the greedy tokens equal those of the same model on oneDNN's linear."""
    import random

    from tests.runtime.scheduler_helpers import create_scheduler, make_req, run_to_completion

    def generate() -> dict[str, list[int]]:
        # Steps of at most 20 + 9 rows: AMX for every linear layer, bit-identical to oneDNN there.
        scheduler = create_scheduler(tiny_llama_dir, tiny_tokenizer, dtype="bfloat16", chunked_prefill_size=20)
        linears = [m for m in scheduler.model_runner.model.modules() if hasattr(m, "packed_weight")]
        amx = all(isinstance(m.packed_weight, AmxWeight) for m in linears)
        rng = random.Random(0)
        reqs = [
            make_req(f"r{i}", [rng.randrange(100, 40000) for _ in range(rng.randint(5, 90))], max_new_tokens=24)
            for i in range(9)
        ]
        return amx, run_to_completion(scheduler, reqs).tokens

    amx, with_amx = generate()
    assert amx
    monkeypatch.setattr(NativeLayerOps, "pack_linear", LayerOps.pack_linear)
    amx, with_onednn = generate()
    assert not amx
    assert with_amx == with_onednn and all(len(t) == 24 for t in with_amx.values())


def test_without_amx_the_native_ops_keep_onednn(native_lib):
    """Where AMX is missing (`amx` False), bf16 weights get oneDNN's prepacked copy, as
    with the torch ops, and the results are oneDNN's."""
    native = NativeLayerOps(native_lib)
    native.amx = False
    native.avx512_lib = None  # nor AVX-512 BF16: that kernel has its own tests (test_linear_avx512.py)
    w, x = weight(96, 64), rows(4, 64)
    packed = native.pack_linear(w)
    assert not isinstance(packed, AmxWeight)
    expected = F.linear(x, w) if packed is None else cpu_linear.packed_linear(x, packed, None)
    assert torch.equal(native.linear(x, w, None, packed), expected)
