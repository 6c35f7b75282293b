"""The fused decoder layer of decode steps (`kernels/fused_decoder_layer.py`) against its oracles.

Oracle 1, the unfused native path: the same layer run op by op through `NativeLayerOps`
as `LlamaDecoderLayer` runs it (norms, linears with their packed weights, rotary,
`decode_attention` storing the new K/V). In bf16 the fused call runs the same kernels in
the same order, so its output, residual and the whole K/V pool must be equal bit for
bit. In float32 the unfused linears are torch's (MKL) and the fused ones a row-dot
kernel: the same products summed in another order, within `F32_TOL`.
Oracle 2, plain torch (`LayerOps`, `reference.decode_attention`), float32: within `F32_TOL`.

Two layers run in a chain (the first starts the residual stream, the second reads the
first's output from the shared scratch buffer it then overwrites), for 1, 3 and 8 rows,
ragged odd context lengths, GQA groups of 2 and 3 (SmolLM2-135M's own sizes), a bias and
a sliding window. Then the model: greedy tokens with the fused path on equal those with
it off (tiny Llama, Qwen2 with q/k/v biases, Mistral with a window; SmolLM2), and the
path switches itself off where it does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from arborlm.kernels import cpu_ops, reference
from arborlm.kernels import fused_decoder_layer as fused
from arborlm.kernels.cpu_ops import LayerOps, NativeLayerOps, RotaryStep

LIB = fused.native_library()
NATIVE = cpu_ops.native_library()
pytestmark = pytest.mark.skipif(LIB is None or NATIVE is None, reason="native CPU kernels unavailable")
EPS = 1e-5
# float32: |fused - oracle| <= F32_TOL * (1 + |oracle|) (summation order of the linears).
F32_TOL = 1e-4
CONTEXTS = [5, 17, 33, 1, 9, 63, 2, 11]  # tokens already in the pool, per request
ROWS = [1, 3, 8]


@pytest.fixture(autouse=True)
def float32_kind_everywhere(monkeypatch):
    """The float32 row-dot kernel is tested on every CPU: in serving it is taken only with
    AVX-512 (`test_float32_kind_needs_avx512`), here its scalar build is checked too."""
    monkeypatch.setattr(cpu_ops, "cpu_has_avx512f", lambda: True)


@dataclass(frozen=True)
class Case:
    shape: fused.LayerShape
    bias: bool = False
    window: int | None = None


CASES = {
    "smollm2": Case(fused.LayerShape(576, 9, 3, 64, 1536)),
    "bias+window+d128": Case(fused.LayerShape(256, 4, 2, 128, 384), bias=True, window=8),
}


def randn(*shape, dtype, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@dataclass
class Layer:
    """One layer's weights as the model holds them: (weight, bias, packed) per linear."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    linears: dict[str, fused.LinearWeights]

    def params(self, case: Case, dtype, layer_id: int) -> fused.LayerParams | None:
        lin = self.linears
        return fused.layer_params(
            case.shape, dtype, layer_id, (self.input_norm, EPS), (self.post_norm, EPS), lin["qkv"], lin["o"],
            lin["gate_up"], lin["down"], case.shape.head_dim**-0.5, case.window,
        )


def make_layer(ops: LayerOps, case: Case, dtype, seed: int) -> Layer:
    s = case.shape
    sizes = {"qkv": (s.qkv_width, s.hidden), "o": (s.hidden, s.num_heads * s.head_dim),
             "gate_up": (2 * s.intermediate, s.hidden), "down": (s.hidden, s.intermediate)}
    linears = {}
    for i, (name, (n, k)) in enumerate(sizes.items()):
        w = randn(n, k, dtype=dtype, seed=seed + i, scale=k**-0.5)
        b = randn(n, dtype=dtype, seed=seed + 10 + i, scale=0.1) if case.bias else None
        linears[name] = fused.LinearWeights(w, b, ops.pack_linear(w))
    norms = [1 + randn(s.hidden, dtype=torch.float32, seed=seed + 20 + i, scale=0.1) for i in range(2)]
    return Layer(norms[0].to(dtype), norms[1].to(dtype), linears)


@dataclass
class Step:
    """A decode step's inputs over a pool of 2 layers whose contexts hold random K/V."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    rotary: RotaryStep

    def clone_pools(self) -> Step:
        return Step(self.k_pool.clone(), self.v_pool.clone(), self.req_to_token, self.req_pool_indices,
                    self.seq_lens, self.out_cache_loc, self.rotary)

    def params(self, dtype, head_dim: int) -> fused.StepParams | None:
        r = self.rotary
        return fused.step_params(self.req_to_token, self.req_pool_indices, self.seq_lens, self.out_cache_loc,
                                 r.positions, r.cos_table, r.sin_table, self.k_pool, self.v_pool, dtype, head_dim)


def rotary_tables(max_positions: int, head_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's cos/sin tables, sin carrying `rotate_half`'s sign (as `RotaryStep` holds them)."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cos(angles), torch.sin(angles)
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)


def make_step(case: Case, dtype, rows: int, seed: int = 7) -> Step:
    s = case.shape
    contexts = CONTEXTS[:rows]
    num_slots = sum(contexts) + rows + 1
    k_pool = randn(2, num_slots, s.num_kv_heads, s.head_dim, dtype=dtype, seed=seed)
    v_pool = randn(2, num_slots, s.num_kv_heads, s.head_dim, dtype=dtype, seed=seed + 1)
    # Slots scattered over the pool (slot 0 is padding), each request on its own row.
    slots = torch.randperm(num_slots - 1, generator=torch.Generator().manual_seed(seed)) + 1
    req_to_token = torch.zeros(rows + 2, 128, dtype=torch.int32)
    req_pool_indices = torch.arange(rows, dtype=torch.int64) + 1
    used, locs = 0, []
    for b, ctx in enumerate(contexts):
        row = slots[used : used + ctx + 1]
        used += ctx + 1
        req_to_token[req_pool_indices[b], : ctx + 1] = row.to(torch.int32)
        locs.append(int(row[-1]))
    seq_lens = torch.tensor([c + 1 for c in contexts], dtype=torch.int64)
    cos, sin = rotary_tables(128, s.head_dim, dtype)
    rotary = RotaryStep(seq_lens - 1, cos, sin)
    return Step(k_pool, v_pool, req_to_token, req_pool_indices, seq_lens, torch.tensor(locs), rotary)


def unfused_layer(ops: LayerOps, layer: Layer, case: Case, layer_id: int, step: Step, x, residual):
    """The layer op by op, as `LlamaDecoderLayer` / `LlamaAttention` / the torch backend run it."""
    s = case.shape
    rows, q_size, kv_size = x.shape[0], s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    lin = {name: (w.weight, w.bias, w.packed) for name, w in layer.linears.items()}
    if residual is None:
        residual, h = x, ops.rms_norm(x, layer.input_norm, EPS)
    else:
        h, residual = ops.rms_norm(x, layer.input_norm, EPS, residual)
    qkv = ops.linear(h, *lin["qkv"])
    qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
    qk = ops.rotary_(qk.view(rows, -1, s.head_dim), step.rotary)
    q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
    v = v.view(rows, s.num_kv_heads, s.head_dim)
    scale = s.head_dim**-0.5
    if isinstance(ops, NativeLayerOps):
        o = ops.decode_attention(q, step.k_pool[layer_id], step.v_pool[layer_id], step.req_to_token,
                                 step.req_pool_indices, step.seq_lens, scale, case.window, new_kv=(k, v, step.out_cache_loc))
    else:
        step.k_pool[layer_id][step.out_cache_loc] = k
        step.v_pool[layer_id][step.out_cache_loc] = v
        o = reference.decode_attention(q, step.k_pool[layer_id], step.v_pool[layer_id], step.req_to_token,
                                       step.req_pool_indices, step.seq_lens, scale, case.window)
    a = ops.linear(o.reshape(rows, q_size), *lin["o"])
    h, residual = ops.rms_norm(a, layer.post_norm, EPS, residual)
    return ops.linear(ops.silu_and_mul(ops.linear(h, *lin["gate_up"])), *lin["down"]), residual


def fused_layers(layers, case, dtype, step: Step, x):
    """The two layers through `run_layer`, over one scratch, as `FusedDecode` runs them."""
    params = [layer.params(case, dtype, i) for i, layer in enumerate(layers)]
    assert all(p is not None for p in params)
    step_params = step.params(dtype, case.shape.head_dim)
    assert step_params is not None
    scratch = fused.DecodeScratch(case.shape, dtype, params[0].max_rows)
    hidden, residual = x, None
    for p in params:
        hidden, residual = fused.run_layer(LIB, p, step_params, scratch, hidden, residual)
    return hidden.clone(), residual


def run_both(oracle_ops: LayerOps, case: Case, dtype, rows: int):
    ops = NativeLayerOps(NATIVE)
    layers = [make_layer(ops, case, dtype, seed=100 * i) for i in range(2)]
    x = randn(rows, case.shape.hidden, dtype=dtype, seed=3)
    step = make_step(case, dtype, rows)
    mine = step.clone_pools()
    out, residual = fused_layers(layers, case, dtype, mine, x.clone())
    ref = step.clone_pools()
    ref_hidden, ref_residual = x.clone(), None
    for i, layer in enumerate(layers):
        ref_hidden, ref_residual = unfused_layer(oracle_ops, layer, case, i, ref, ref_hidden, ref_residual)
    return (out, residual, mine.k_pool, mine.v_pool), (ref_hidden, ref_residual, ref.k_pool, ref.v_pool)


def _close(got, want, tol):
    assert ((got.double() - want.double()).abs() <= tol * (1 + want.double().abs())).all(), (
        (got.double() - want.double()).abs().max().item()
    )


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("case", list(CASES))
def test_bf16_equals_the_unfused_native_path_bit_for_bit(case, rows):
    case = CASES[case]
    ops = NativeLayerOps(NATIVE)
    if not isinstance(ops.pack_linear(torch.zeros(32, 32, dtype=torch.bfloat16)), (cpu_ops.AmxWeight,
                                                                                      fused.linear_avx512.Avx512Weight)):
        pytest.skip("bf16 linears here take oneDNN (no AVX-512 BF16 / AMX kernel): the fused layer does not apply")
    got, want = run_both(ops, case, torch.bfloat16, rows)
    for name, g, w in zip(("output", "residual", "k_pool", "v_pool"), got, want):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("case", list(CASES))
def test_float32_within_rounding_of_the_unfused_and_torch_paths(case, rows):
    case = CASES[case]
    for oracle in (NativeLayerOps(NATIVE), LayerOps()):
        got, want = run_both(oracle, case, torch.float32, rows)
        for g, w in zip(got, want):
            _close(g, w, F32_TOL)
        # The new tokens' K/V went to their slots, and nothing else moved.
        untouched = torch.ones(got[2].shape[1], dtype=torch.bool)
        untouched[make_step(case, torch.float32, rows).out_cache_loc] = False
        assert torch.equal(got[2][:, untouched], make_step(case, torch.float32, rows).k_pool[:, untouched])


def test_float32_kind_needs_avx512(monkeypatch):
    """Without AVX-512 the row-dot kernel is scalar, slower than MKL unfused: not taken."""
    case = CASES["bias+window+d128"]
    layer = make_layer(NativeLayerOps(NATIVE), case, torch.float32, seed=0)
    monkeypatch.setattr(cpu_ops, "cpu_has_avx512f", lambda: False)
    assert layer.params(case, torch.float32, 0) is None


def test_refuses_what_no_fused_kernel_reads():
    case = CASES["bias+window+d128"]
    ops = NativeLayerOps(NATIVE)
    layer = make_layer(ops, case, torch.float32, seed=0)
    assert layer.params(case, torch.float32, 0) is not None
    assert layer.params(case, torch.float16, 0) is None  # dtype
    assert layer.params(case, torch.bfloat16, 0) is None  # float32 weights in a bf16 layer
    onednn = dict(layer.linears, o=fused.LinearWeights(layer.linears["o"].weight, None, torch.zeros(1)))
    assert Layer(layer.input_norm, layer.post_norm, onednn).params(case, torch.float32, 0) is None  # other packing
    wrong = fused.LayerShape(case.shape.hidden, case.shape.num_heads, case.shape.num_kv_heads, 64, 384)
    assert layer.params(Case(wrong), torch.float32, 0) is None  # shapes
    step = make_step(case, torch.float32, 3)
    assert step.params(torch.float32, case.shape.head_dim) is not None
    bad_index = Step(step.k_pool, step.v_pool, step.req_to_token, step.req_pool_indices.int(), step.seq_lens,
                     step.out_cache_loc, step.rotary)
    assert bad_index.params(torch.float32, case.shape.head_dim) is None
    half = RotaryStep(step.rotary.positions, step.rotary.cos_table[:, :64], step.rotary.sin_table[:, :64])
    partial = Step(step.k_pool, step.v_pool, step.req_to_token, step.req_pool_indices, step.seq_lens,
                   step.out_cache_loc, half)
    assert partial.params(torch.float32, case.shape.head_dim) is None  # partial rotary
    assert step.params(torch.bfloat16, case.shape.head_dim) is None  # pool of another dtype


def test_kind_dtype_mismatch_raises_and_writes_nothing():
    case = CASES["bias+window+d128"]
    layer = make_layer(NativeLayerOps(NATIVE), case, torch.float32, seed=0)
    params = layer.params(case, torch.float32, 0)
    params.struct.dtype = 1  # float32 weights, told bf16
    step = make_step(case, torch.float32, 3)
    before = step.k_pool.clone()
    scratch = fused.DecodeScratch(case.shape, torch.float32, params.max_rows)
    x = randn(3, case.shape.hidden, dtype=torch.float32, seed=3)
    with pytest.raises(ValueError, match="kind"):
        fused.run_layer(LIB, params, step.params(torch.float32, case.shape.head_dim), scratch, x, None)
    assert torch.equal(step.k_pool, before)


def _stacked_and_one_by_one(case, dtype, rows):
    """Two layers through `run_layers` and through `run_layer` one by one, each on its own
    copy of the pools: (output, residual, k_pool, v_pool) of both."""
    ops = NativeLayerOps(NATIVE)
    layers = [make_layer(ops, case, dtype, seed=100 * i) for i in range(2)]
    params = tuple(layer.params(case, dtype, i) for i, layer in enumerate(layers))
    stack = fused.layer_stack(params)
    assert stack is not None and stack.max_rows == params[0].max_rows
    x = randn(rows, case.shape.hidden, dtype=dtype, seed=3)
    step = make_step(case, dtype, rows)
    stacked = step.clone_pools()
    scratch = fused.DecodeScratch(case.shape, dtype, stack.max_rows)
    out, residual = fused.run_layers(LIB, stack, stacked.params(dtype, case.shape.head_dim), scratch, x.clone(), None)
    got = (out.clone(), residual, stacked.k_pool, stacked.v_pool)
    one = step.clone_pools()
    hidden, residual = fused_layers(layers, case, dtype, one, x.clone())
    return got, (hidden, residual, one.k_pool, one.v_pool)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("case", list(CASES))
def test_stacked_layers_equal_the_layers_one_by_one_bit_for_bit(case, rows):
    """`run_layers` (the model's decode steps) runs the same kernels as `run_layer` per layer."""
    case = CASES[case]
    dtypes = [torch.float32]
    if isinstance(NativeLayerOps(NATIVE).pack_linear(torch.zeros(32, 32, dtype=torch.bfloat16)),
                  (cpu_ops.AmxWeight, fused.linear_avx512.Avx512Weight)):
        dtypes.append(torch.bfloat16)
    for dtype in dtypes:
        got, want = _stacked_and_one_by_one(case, dtype, rows)
        for name, g, w in zip(("output", "residual", "k_pool", "v_pool"), got, want):
            assert torch.equal(g, w), (dtype, name)


def test_stack_with_a_refused_layer_raises_and_writes_nothing():
    """A refused kind in the second layer is found before the first one runs."""
    case = CASES["bias+window+d128"]
    ops = NativeLayerOps(NATIVE)
    params = tuple(make_layer(ops, case, torch.float32, seed=i).params(case, torch.float32, i) for i in range(2))
    params[1].struct.dtype = 1  # float32 weights, told bf16
    step = make_step(case, torch.float32, 3)
    before = (step.k_pool.clone(), step.v_pool.clone())
    scratch = fused.DecodeScratch(case.shape, torch.float32, params[0].max_rows)
    x = randn(3, case.shape.hidden, dtype=torch.float32, seed=3)
    x_before = x.clone()
    with pytest.raises(ValueError, match="kind"):
        fused.run_layers(LIB, fused.layer_stack(params), step.params(torch.float32, case.shape.head_dim), scratch, x,
                         None)
    assert torch.equal(step.k_pool, before[0]) and torch.equal(step.v_pool, before[1]) and torch.equal(x, x_before)


def test_layer_stack_needs_one_dtype_and_shape():
    case = CASES["bias+window+d128"]
    ops = NativeLayerOps(NATIVE)
    layer = make_layer(ops, case, torch.float32, seed=0).params(case, torch.float32, 0)
    other_shape = fused.LayerShape(case.shape.hidden, case.shape.num_heads, case.shape.num_kv_heads,
                                   case.shape.head_dim, case.shape.intermediate + 32)
    assert fused.layer_stack(()) is None
    assert fused.layer_stack((layer, fused.LayerParams(layer.struct, layer.address, layer.dtype, other_shape,
                                                       layer.max_rows, ()))) is None
    assert fused.layer_stack((layer, layer)) is not None


# ---- the model: greedy tokens with the fused path on and off --------------------------

PROMPTS = [[5, 17, 99, 3, 250, 8, 41, 77, 12, 6, 140, 33, 9], [200, 1, 2], [7, 7, 7, 64, 128, 31, 90, 15]]


def _greedy_on_off(loaded, dtype, prompts, max_new_tokens, monkeypatch):
    """Greedy tokens with the fused path on, then off; and how many layers it ran."""
    from tests.runtime.model_helpers import ModelHarness, count_fused_layer_calls

    model = loaded.model
    fd = model.model.fused_decode
    assert fd is not None
    calls = count_fused_layer_calls(monkeypatch)
    outs = []
    for enabled in (True, False):
        fd.enabled = enabled
        harness = ModelHarness(model, loaded.hf_config, dtype=dtype)
        outs.append(harness.greedy(prompts, max_new_tokens))
    fd.enabled = True
    return outs[0], outs[1], sum(calls)


FAMILIES = {
    "llama": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "mistral-window": ("mistral", {"sliding_window": 4}),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from tests.runtime.family_helpers import tiny_checkpoint

    dirs = {}
    for name, (model_type, extra) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(name)
        # head_dim 32 (64 / 2 heads would be 32 too): the kernel's generic attention loop;
        # SmolLM2 below takes the register-tiled one (head_dim 64).
        tiny_checkpoint(folder, model_type, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=256, **extra)
        dirs[name] = folder
    return dirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_models_greedy_tokens_equal_with_the_fused_path_off(family, dtype, family_dirs, monkeypatch):
    from arborlm.runtime.model_loader import load_model

    loaded = load_model(family_dirs[family], dtype, torch.device("cpu"))
    on, off, calls = _greedy_on_off(loaded, dtype, PROMPTS, 10, monkeypatch)
    num_layers = loaded.hf_config.num_hidden_layers
    if dtype == torch.bfloat16 and not _bf16_fused(loaded.model):
        assert calls == 0
        pytest.skip("bf16 linears here take oneDNN: the fused layer does not apply (checked: not taken)")
    assert calls == 9 * num_layers  # every decode step, every layer (the prefill is not fused)
    assert on == off


def _bf16_fused(model) -> bool:
    packed = model.model.layers[0].self_attn.qkv_proj.packed_weight
    return isinstance(packed, (cpu_ops.AmxWeight, fused.linear_avx512.Avx512Weight))


def test_takes_int8_weights_too(family_dirs, monkeypatch):
    """Quantized linears run inside the fused layer (more in test_fused_quant_layer.py)."""
    from arborlm.runtime.model_loader import load_model

    loaded = load_model(family_dirs["llama"], torch.float32, torch.device("cpu"), quantization="int8")
    on, off, calls = _greedy_on_off(loaded, torch.float32, PROMPTS[:1], 4, monkeypatch)
    assert calls == 3 * loaded.hf_config.num_hidden_layers and on == off


def test_switches_itself_off_on_the_torch_ops(family_dirs, monkeypatch):
    from arborlm.runtime.model_loader import load_model

    loaded = load_model(family_dirs["llama"], torch.float32, torch.device("cpu"), cpu_kernels=False)
    assert loaded.model.model.fused_decode is None


@pytest.mark.smollm
def test_smollm2_greedy_tokens_equal_with_the_fused_path_off(smollm_dir: Path, monkeypatch):
    """bf16, the default dtype (float32 with the fused path on is held to the greedy pins,
    `tests/e2e/test_greedy_pins.py`)."""
    from arborlm.runtime.model_loader import load_model

    dtype = torch.bfloat16

    loaded = load_model(smollm_dir, dtype, torch.device("cpu"), quantization="none")
    prompts = [[1, 4093, 314, 253, 1345, 30, 198] * 3, [1, 504, 3937, 282], list(range(300, 337))]
    on, off, calls = _greedy_on_off(loaded, dtype, prompts, 12, monkeypatch)
    if dtype == torch.bfloat16 and not _bf16_fused(loaded.model):
        pytest.skip("bf16 linears here take oneDNN: the fused layer does not apply")
    assert calls == 11 * loaded.hf_config.num_hidden_layers
    assert on == off


def test_a_replaced_weight_rebuilds_the_layer_params(family_dirs, monkeypatch):
    """The per-step check that the params still point into the layers' packed weights: a
    weight replaced after load (`QuantizedLinear.set_weights`) is what the next fused step
    reads. int8 weights: the fused layer takes them on every CPU the native kernels build on."""
    import dataclasses

    from arborlm.runtime.model_loader import load_model

    loaded = load_model(family_dirs["llama"], torch.float32, torch.device("cpu"), quantization="int8")
    model = loaded.model
    fd, layers = model.model.fused_decode, model.model.layers
    stack = fd._layer_stack(layers)
    assert stack is not None and fd._layer_stack(layers) is stack  # unchanged: the same params
    down = layers[1].mlp.down_proj
    # Other values: the quant rows of each 16-row tile in reverse order.
    down.set_weights(tuple(dataclasses.replace(w, qs=w.qs.flip(0).contiguous()) for w in down.weights))
    rebuilt = fd._layer_stack(layers)
    assert rebuilt is not stack
    assert rebuilt.layers[0] is stack.layers[0] and rebuilt.layers[1] is not stack.layers[1]
    assert fd._layer_stack(layers) is rebuilt  # and stands again
    on, off, calls = _greedy_on_off(loaded, torch.float32, PROMPTS[:1], 4, monkeypatch)
    assert calls > 0 and on == off  # the fused path follows the replaced weight


def test_a_replaced_layer_or_projection_rebuilds_the_stack(family_dirs, monkeypatch):
    """The stack's per-step check also sees modules replaced, not only weights re-packed:
    two decoder layers swapped in the model's `ModuleList`, then two layers' o_proj modules
    swapped, each time the stack follows, and greedy tokens stay the unfused path's."""
    from arborlm.runtime.model_loader import load_model

    loaded = load_model(family_dirs["llama"], torch.float32, torch.device("cpu"), quantization="int8")
    fd, layers = loaded.model.model.fused_decode, loaded.model.model.layers
    assert len(layers) >= 2
    stack = fd._layer_stack(layers)
    assert stack is not None
    layers[0], layers[1] = layers[1], layers[0]
    swapped = fd._layer_stack(layers)
    assert swapped is not stack
    assert swapped.layers[0] is stack.layers[1] and swapped.layers[1] is stack.layers[0]
    first, second = layers[0].self_attn, layers[1].self_attn
    first.o_proj, second.o_proj = second.o_proj, first.o_proj
    again = fd._layer_stack(layers)
    assert again is not swapped and again.layers[0] is not swapped.layers[0]
    assert fd._layer_stack(layers) is again
    on, off, calls = _greedy_on_off(loaded, torch.float32, PROMPTS[:1], 4, monkeypatch)
    assert calls > 0 and on == off
