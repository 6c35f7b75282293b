"""Quantized linears inside the fused decoder layer (`kernels/fused_decoder_layer.py`,
`KIND_QUANT`) against the unfused quantized path.

Oracle: the same two layers run op by op as `LlamaDecoderLayer` runs a model whose
projections are `QuantizedLinear`s: `NativeLayerOps` for the norms, rotary, SiLU-and-mul
and decode attention, `NativeQuantOps.linear` for every projection (its per-block int8
activation quantization, then the VNNI kernel). The fused call runs the same kernels in
the same order, so output, residual and the whole K/V pool must be equal bit for bit, in
bf16 and in float32 alike (the quantized kernel is the same call in both paths, unlike
float32's plain linears).

Weights of each kind the serving path builds: GGUF Q8_0 / Q4_0 / Q4_1 blocks
(`gguf.quants.quantize`), `quantization="int8"` (per channel, Q8_0 tiles) and `"int4"`
(group 32 and 128, Q4_1 tiles), random Q4_K / Q5_K / Q6_K blocks, and a Q4_K_M-like mix
(q/k/v shards of three formats stacked in one projection, `num_parts` 3). 1, 3 and 8
rows; SmolLM2-135M's sizes, and a layer with biases, a sliding window and head_dim 128
(K-quants: rows of 256 values, so a 256-wide layer).
"""

from __future__ import annotations

import functools

import pytest
import torch

gguf = pytest.importorskip("gguf")

from arborlm.kernels import cpu_ops, quant_ops  # noqa: E402
from arborlm.kernels import fused_decoder_layer as fused  # noqa: E402
from arborlm.kernels.cpu_ops import NativeLayerOps  # noqa: E402
from arborlm.kernels.quant_layout import (  # noqa: E402
    pack_ggml_blocks,
    pack_int4_groupwise,
    pack_int8_per_channel,
)
from tests.kernels.test_fused_decoder_layer import CASES, EPS, F32_TOL, Case, make_step, randn  # noqa: E402
from tests.kernels.test_quant_linear import ggml_weight  # noqa: E402

LIB = fused.native_library()
NATIVE = cpu_ops.native_library()
QUANT = quant_ops.native_library()
pytestmark = pytest.mark.skipif(LIB is None or NATIVE is None or QUANT is None,
                                reason="native CPU kernels unavailable")
ROWS = [1, 3, 8]
K_CASE = Case(fused.LayerShape(256, 4, 2, 64, 512), bias=True, window=8)
NAMES = ("qkv", "o", "gate_up", "down")


def _ggml(fmt: str, n: int, k: int, seed: int):
    raw, _ = ggml_weight(fmt, n, k, seed)
    return pack_ggml_blocks(fmt, torch.from_numpy(raw), k)


def _float(n: int, k: int, seed: int) -> torch.Tensor:
    return randn(n, k, dtype=torch.float32, seed=seed, scale=k**-0.5)


# kind -> (its layer case, a function (linear name, out, in, seed) -> the parts stacked by rows)
KINDS = {
    "q8_0": (None, lambda name, n, k, seed: [_ggml("q8_0", n, k, seed)]),
    "q4_0": (None, lambda name, n, k, seed: [_ggml("q4_0", n, k, seed)]),
    "q4_1": (None, lambda name, n, k, seed: [_ggml("q4_1", n, k, seed)]),
    "int8": (None, lambda name, n, k, seed: [pack_int8_per_channel(_float(n, k, seed))]),
    "int4-g32": (None, lambda name, n, k, seed: [pack_int4_groupwise(_float(n, k, seed), 32)]),
    "int4-g128": (CASES["bias+window+d128"], lambda name, n, k, seed: [pack_int4_groupwise(_float(n, k, seed), 128)]),
    "q4_k": (K_CASE, lambda name, n, k, seed: [_ggml("q4_k", n, k, seed)]),
    "q5_k": (K_CASE, lambda name, n, k, seed: [_ggml("q5_k", n, k, seed)]),
    "q6_k": (K_CASE, lambda name, n, k, seed: [_ggml("q6_k", n, k, seed)]),
}


def _q4_k_m(name: str, n: int, k: int, seed: int):
    """Q4_K_M's mix: q, k, v of three formats in one projection; the down projection in Q6_K."""
    if name == "qkv":
        s = K_CASE.shape
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        return [_ggml(fmt, rows, k, seed + i) for i, (fmt, rows) in enumerate((("q4_k", q), ("q5_k", kv),
                                                                                ("q6_k", kv)))]
    return [_ggml("q6_k" if name == "down" else "q4_k", n, k, seed)]


KINDS["q4_k_m-mix"] = (K_CASE, _q4_k_m)
TABLE = [(kind, case) for kind, (only, _) in KINDS.items()
         for case in ([only] if only else list(CASES.values()))]


def _case_id(case: Case) -> str:
    return next((name for name, c in CASES.items() if c == case), "k-quant-256")


@functools.cache
def quant_layer(kind: str, case: Case, dtype: torch.dtype, seed: int):
    """(input norm, post norm, {name: QuantLinearWeights}) of one layer, packed by `NativeQuantOps`."""
    qops = quant_ops.NativeQuantOps(QUANT)
    s = case.shape
    sizes = {"qkv": (s.qkv_width, s.hidden), "o": (s.hidden, s.num_heads * s.head_dim),
             "gate_up": (2 * s.intermediate, s.hidden), "down": (s.hidden, s.intermediate)}
    linears = {}
    for i, (name, (n, k)) in enumerate(sizes.items()):
        parts = KINDS[kind][1](name, n, k, seed + i)
        bias = randn(n, dtype=dtype, seed=seed + 10 + i, scale=0.1) if case.bias else None
        linears[name] = fused.QuantLinearWeights(qops.prepare(tuple(parts)), bias)
    norms = [(1 + randn(s.hidden, dtype=torch.float32, seed=seed + 20 + i, scale=0.1)).to(dtype) for i in range(2)]
    return norms[0], norms[1], linears


def layer_params(layer, case: Case, dtype, layer_id: int) -> fused.LayerParams | None:
    input_norm, post_norm, lin = layer
    return fused.layer_params(case.shape, dtype, layer_id, (input_norm, EPS), (post_norm, EPS),
                              *(lin[name] for name in NAMES), case.shape.head_dim**-0.5, case.window)


def unfused_quant_layer(layer, case: Case, layer_id: int, step, x, residual):
    """The layer op by op, as `LlamaDecoderLayer` runs it with `QuantizedLinear` projections."""
    ops, qops = NativeLayerOps(NATIVE), quant_ops.NativeQuantOps(QUANT)
    input_norm, post_norm, lin = layer
    s = case.shape
    rows, q_size, kv_size = x.shape[0], s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim

    def linear(name, h):
        if isinstance(lin[name], fused.LinearWeights):  # a plain float32 linear: torch's, as `Linear`
            return torch.nn.functional.linear(h, lin[name].weight, lin[name].bias)
        return qops.linear(h, lin[name].weights, lin[name].bias)

    if residual is None:
        residual, h = x, ops.rms_norm(x, input_norm, EPS)
    else:
        h, residual = ops.rms_norm(x, input_norm, EPS, residual)
    qkv = linear("qkv", h)
    qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
    qk = ops.rotary_(qk.view(rows, -1, s.head_dim), step.rotary)
    q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
    v = v.view(rows, s.num_kv_heads, s.head_dim)
    o = ops.decode_attention(q, step.k_pool[layer_id], step.v_pool[layer_id], step.req_to_token,
                             step.req_pool_indices, step.seq_lens, s.head_dim**-0.5, case.window,
                             new_kv=(k, v, step.out_cache_loc))
    a = linear("o", o.reshape(rows, q_size))
    h, residual = ops.rms_norm(a, post_norm, EPS, residual)
    return linear("down", ops.silu_and_mul(linear("gate_up", h))), residual


def run_both(kind: str, case: Case, dtype, rows: int, replace: dict | None = None, num_layers: int = 2):
    """(fused, unfused) (output, residual, k_pool, v_pool) of `num_layers` layers of `kind`
    (`replace`: linears put in place of the quantized ones)."""
    layers = [quant_layer(kind, case, dtype, seed=100 * i) for i in range(num_layers)]
    layers = [(a, b, dict(lin, **(replace or {}))) for a, b, lin in layers]
    x = randn(rows, case.shape.hidden, dtype=dtype, seed=3)
    step = make_step(case, dtype, rows)
    mine, ref = step.clone_pools(), step.clone_pools()
    params = [layer_params(layer, case, dtype, i) for i, layer in enumerate(layers)]
    assert all(p is not None for p in params)
    step_params = mine.params(dtype, case.shape.head_dim)
    scratch = fused.DecodeScratch(case.shape, dtype, params[0].max_rows)
    hidden, residual = x.clone(), None
    for p in params:
        hidden, residual = fused.run_layer(LIB, p, step_params, scratch, hidden, residual)
    ref_hidden, ref_residual = x.clone(), None
    for i, layer in enumerate(layers):
        ref_hidden, ref_residual = unfused_quant_layer(layer, case, i, ref, ref_hidden, ref_residual)
    return (hidden.clone(), residual, mine.k_pool, mine.v_pool), (ref_hidden, ref_residual, ref.k_pool, ref.v_pool)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind,case", TABLE, ids=[f"{k}-{_case_id(c)}" for k, c in TABLE])
def test_equals_the_unfused_quantized_path_bit_for_bit(kind, case, dtype, rows):
    params = layer_params(quant_layer(kind, case, dtype, seed=0), case, dtype, 0)
    assert params.max_rows == quant_ops.INT8_MAX_ROWS  # the unfused path's int8 kernel bound
    assert all(getattr(params.struct, f).kind == fused.KIND_QUANT for f in ("qkv", "o_proj", "gate_up", "down"))
    got, want = run_both(kind, case, dtype, rows)
    assert got[0].abs().sum() > 0 and got[0].isfinite().all()
    for name, g, w in zip(("output", "residual", "k_pool", "v_pool"), got, want):
        assert torch.equal(g, w), name


def test_a_layer_of_quantized_and_plain_linears(monkeypatch):
    """A layer whose down shard was dequantized (a GGUF type the kernels do not serve) mixes
    kinds: its plain float32 linear takes the row-dot kernel (torch's in the unfused path:
    within `F32_TOL`), the quantized ones the quantized kernel (bit for bit); rows bounded by
    the float32 one. One layer with the float32 linear last: a later quantized linear would
    quantize its input per block to int8, where a float32 summation-order difference can move
    a value across a rounding boundary (one int8 step, far above `F32_TOL`; MKL's order
    differs between CPUs). The output is held to `F32_TOL` of each row's largest value."""
    case, dtype = CASES["smollm2"], torch.float32
    # The row-dot kernel serves only with AVX-512 (`fused_decoder_layer._fused_linear`);
    # its scalar build is tested here on every CPU.
    monkeypatch.setattr(cpu_ops, "cpu_has_avx512f", lambda: True)
    s = case.shape
    plain = {"down": fused.LinearWeights(_float(s.hidden, s.intermediate, seed=5), None, None)}
    input_norm, post_norm, lin = quant_layer("q4_1", case, dtype, seed=0)
    params = layer_params((input_norm, post_norm, dict(lin, **plain)), case, dtype, 0)
    assert params.max_rows == fused.FLOAT32_MAX_ROWS
    assert params.struct.down.kind == fused.KIND_FLOAT32 and params.struct.qkv.kind == fused.KIND_QUANT
    got, want = run_both("q4_1", case, dtype, 3, replace=plain, num_layers=1)
    assert got[0].abs().sum() > 0
    for name, g, w in zip(("residual", "k_pool", "v_pool"), got[1:], want[1:]):
        assert torch.equal(g, w), name  # everything before the float32 linear is quantized
    # Against each row's largest value: where a row's terms cancel (0.6 among values of 1700),
    # two float32 summation orders differ by more than F32_TOL of that small result (6.7e-4 here,
    # on an AMD EPYC: 4.8e-7 of the row's largest value).
    error = (got[0].double() - want[0].double()).abs()
    assert (error <= F32_TOL * (1 + want[0].double().abs().amax(dim=1, keepdim=True))).all()


def test_refuses_quantized_weights_the_native_path_would_not_take():
    case, dtype = CASES["bias+window+d128"], torch.bfloat16
    input_norm, post_norm, lin = quant_layer("q4_1", case, dtype, seed=0)
    assert layer_params((input_norm, post_norm, lin), case, dtype, 0) is not None

    def with_o(o):
        return layer_params((input_norm, post_norm, dict(lin, o=o)), case, dtype, 0)

    o = lin["o"]
    torch_prepared = quant_ops.QuantOps().prepare(tuple(o.weights))  # no native_args: the torch path
    assert with_o(fused.QuantLinearWeights(torch_prepared, o.bias)) is None
    assert with_o(fused.QuantLinearWeights(o.weights, o.bias.float())) is None  # bias of another dtype
    assert with_o(fused.QuantLinearWeights(o.weights, o.bias[:-1])) is None  # bias of another shape
    assert with_o(lin["down"]) is None  # in_features of another linear
    wrong = Case(fused.LayerShape(case.shape.hidden, case.shape.num_heads, case.shape.num_kv_heads, 128, 512))
    assert layer_params((input_norm, post_norm, lin), wrong, dtype, 0) is None  # shapes


def test_unknown_format_raises_and_writes_nothing():
    case, dtype = CASES["smollm2"], torch.bfloat16
    layer = quant_layer("q8_0", case, dtype, seed=0)
    params = layer_params(layer, case, dtype, 0)
    # A fresh StackedWeights: the cached layer's arrays stay as they are for other tests.
    parts = quant_ops.NativeQuantOps(QUANT).prepare(tuple(layer[2]["down"].weights))
    parts.native_args[5][0][0] = 9  # its format code: none of quant_layout.h's
    bad = layer_params((layer[0], layer[1], dict(layer[2], down=fused.QuantLinearWeights(parts, None))),
                       case, dtype, 0)
    assert params is not None and bad is not None
    step = make_step(case, dtype, 3)
    before = (step.k_pool.clone(), step.v_pool.clone())
    scratch = fused.DecodeScratch(case.shape, dtype, bad.max_rows)
    x = randn(3, case.shape.hidden, dtype=dtype, seed=3)
    with pytest.raises(ValueError, match="format"):
        fused.run_layer(LIB, bad, step.params(dtype, case.shape.head_dim), scratch, x, None)
    assert torch.equal(step.k_pool, before[0]) and torch.equal(step.v_pool, before[1])
