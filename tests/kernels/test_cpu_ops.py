"""The native CPU kernels (`cpu_ops.NativeLayerOps`) against their torch oracles.

The library is compiled once per module into pytest's temporary folder, three times:
as `layer_ops` builds it (`-march=native`, the AVX-512 loops where the CPU has them),
with AVX-512 turned off (the AVX2 loops that CPUs without AVX-512 run, where this one
has AVX2), and with AVX2 and FMA off too (the scalar code). Row lengths that are not multiples of 16 run each loop's scalar tail;
the large cases cross the kernels' OpenMP threshold (2**15 elements).

Oracles: `LayerOps` (plain torch) for the elementwise groups and
`reference.decode_attention` for attention. bfloat16 outputs are also compared
with the oracle computed in float32 and rounded once, which is what the kernels
compute, within one bfloat16 ulp.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from arborlm.kernels import cpu_ops, reference
from arborlm.kernels.cpu_ops import LayerOps, NativeLayerOps, RotaryStep

EPS = 1e-6
BF16_RTOL = 1 / 128  # one bfloat16 ulp relative to the value
# native: what this CPU takes; no-avx512: the AVX2 loops (on a CPU with AVX2); scalar: neither.
BUILDS = {"native": (), "no-avx512": ("-mno-avx512f",), "scalar": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}
DTYPES = [torch.float32, torch.bfloat16]
DIMS = [7, 33, 100, 576]  # 576 = 36 vectors of 16; the others end in a scalar tail
ROWS = [1, 2048]  # 2048 rows cross the OpenMP threshold at every dim but 7


@pytest.fixture(scope="module", params=list(BUILDS))
def lib(request, compiler, tmp_path_factory):
    """The kernel library, built once per module for each entry of `BUILDS`.

    Skipped without a compiler; with one, a `KernelBuildError` (the source does not
    compile, an ABI mismatch) fails the tests rather than hiding them."""
    if BUILDS[request.param] and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(
            f"the {request.param} build passes x86-only flags ({' '.join(BUILDS[request.param])}); "
            f"this machine is {platform.machine()}, where only the native build runs"
        )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_ops, "CXX_FLAGS", cpu_ops.CXX_FLAGS + BUILDS[request.param])
        return cpu_ops.load_library(tmp_path_factory.mktemp(f"kernels-{request.param}"))


@pytest.fixture
def ops(lib) -> NativeLayerOps:
    """`NativeLayerOps` over this module's library."""
    return NativeLayerOps(lib)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    """Seeded standard-normal values times `scale`, rounded to `dtype`."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def column_slice(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as a column slice of a wider tensor: rows strided, last dimension contiguous."""
    wide = torch.full((t.shape[0], t.shape[1] + 9), float("nan"), dtype=t.dtype)
    wide[:, 5:5 + t.shape[1]] = t
    return wide[:, 5:5 + t.shape[1]]


def rows_of(rows: int, dim: int, dtype, seed: int, strided: bool) -> torch.Tensor:
    """(rows, dim) random values; when `strided`, a column slice of a wider tensor."""
    x = randn(rows, dim, dtype=dtype, seed=seed)
    return column_slice(x) if strided else x


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 to within float32 rounding at O(1) values; bfloat16 to within one ulp."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.bfloat16:
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-6, rtol=BF16_RTOL)
    else:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def rotary_tables(max_positions: int, head_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's cos table and signed sin table (first half negated), as `RotaryEmbedding` builds them."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    half = head_dim // 2
    signed_sin = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)
    return emb.cos().to(dtype), signed_sin.to(dtype)


# ---------------------------------------------------------------- rms_norm


def row_cases(test):
    """Parametrize `test` over every dtype x dim x rows x (contiguous | strided rows)."""
    for mark in (
        pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"]),
        pytest.mark.parametrize("rows", ROWS),
        pytest.mark.parametrize("dim", DIMS),
        pytest.mark.parametrize("dtype", DTYPES, ids=str),
    ):
        test = mark(test)
    return test



@row_cases
def test_rms_norm_matches_torch(ops, dtype, dim, rows, strided):
    x, weight = rows_of(rows, dim, dtype, 1, strided), randn(dim, dtype=dtype, seed=2)
    out = ops.rms_norm(x, weight, EPS)
    assert_matches(out, LayerOps().rms_norm(x, weight, EPS))


@row_cases
def test_fused_add_rms_norm_updates_residual_in_place(ops, dtype, dim, rows, strided):
    x, weight = rows_of(rows, dim, dtype, 1, strided), randn(dim, dtype=dtype, seed=2)
    wide_residual = randn(rows, dim + 9, dtype=dtype, seed=3)
    residual = wide_residual[:, 5:5 + dim] if strided else wide_residual[:, 5:5 + dim].contiguous()
    before, wide_before = residual.clone(), wide_residual.clone()
    expected_out, expected_sum = LayerOps().rms_norm(x, weight, EPS, before.clone())

    out, new_residual = ops.rms_norm(x, weight, EPS, residual)

    assert new_residual.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(residual, x + before, atol=0, rtol=0)
    torch.testing.assert_close(residual, expected_sum, atol=0, rtol=0)
    if strided:  # the columns around the view are not written
        torch.testing.assert_close(wide_residual[:, :5], wide_before[:, :5], atol=0, rtol=0)
        torch.testing.assert_close(wide_residual[:, 5 + dim:], wide_before[:, 5 + dim:], atol=0, rtol=0)
    assert_matches(out, expected_out)


# ---------------------------------------------------------------- silu_and_mul

EXTREME_GATES = [-1e4, -100.0, -89.0, -88.0, 88.0, 89.0, 100.0, 1e4]  # exp over/underflows float32


def gate_up_with_extremes(rows: int, dim: int, dtype, strided: bool) -> torch.Tensor:
    """(rows, 2 * dim) gate/up values; the gates of the first and last rows are
    `EXTREME_GATES` repeated (reversed in the last row), so both the vector loop and the
    scalar tail meet each sign."""
    gate_up = randn(rows, 2 * dim, seed=4, scale=3.0)
    extremes = torch.tensor(EXTREME_GATES).repeat(dim // len(EXTREME_GATES) + 1)[:dim]
    gate_up[0, :dim] = extremes
    gate_up[-1, :dim] = extremes.flip(0)
    gate_up = gate_up.to(dtype)
    return column_slice(gate_up) if strided else gate_up


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_torch(ops, dtype, dim, rows, strided):
    gate_up = gate_up_with_extremes(rows, dim, dtype, strided)
    expected = LayerOps().silu_and_mul(gate_up)
    assert torch.isfinite(expected).all()

    out = ops.silu_and_mul(gate_up)

    assert torch.isfinite(out).all()
    assert_matches(out, expected)


# ---------------------------------------------------------------- rotary_

MAX_POSITIONS = 4096


def rotary_case(tokens: int, head_dim: int, dtype, seed: int = 5):
    """A fused qkv output (6 q, 2 k, 2 v heads) and a step at random, unsorted positions
    (the last table row included, and the first when there are two tokens or more)."""
    qkv = randn(tokens, 10 * head_dim, dtype=dtype, seed=seed)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=torch.Generator().manual_seed(seed))
    positions[-1], positions[0] = 0, MAX_POSITIONS - 1
    return qkv, RotaryStep(positions, *rotary_tables(MAX_POSITIONS, head_dim, dtype))


@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("head_dim", [8, 64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_in_place_on_qk_view(ops, dtype, head_dim, tokens):
    qkv, step = rotary_case(tokens, head_dim, dtype)
    qk = qkv[:, :8 * head_dim].view(tokens, 8, head_dim)
    v_before = qkv[:, 8 * head_dim:].clone()
    expected = LayerOps().rotary_(qk.clone(), step)
    step32 = RotaryStep(step.positions, step.cos_table.float(), step.sin_table.float())
    # The kernel's own arithmetic: float32 ops as torch does them, one rounding at the end.
    expected_once_rounded = LayerOps().rotary_(qk.float(), step32).to(dtype)

    out = ops.rotary_(qk, step)

    assert out.data_ptr() == qk.data_ptr()
    torch.testing.assert_close(qkv[:, 8 * head_dim:], v_before, atol=0, rtol=0)
    torch.testing.assert_close(out, expected_once_rounded, atol=0, rtol=0)
    if dtype == torch.bfloat16:
        # torch rounds both products before the sum: each off by up to half an ulp of max |x|.
        atol = float(qkv.abs().max()) / 256
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=BF16_RTOL)
    else:
        torch.testing.assert_close(out, expected, atol=0, rtol=0)


# ---------------------------------------------------------------- torch fallbacks


def test_float16_takes_the_torch_path(ops):
    x, weight, residual = (randn(5, 33, dtype=torch.float16, seed=s) for s in (1, 2, 3))
    weight = weight[0]
    torch_ops = LayerOps()
    torch.testing.assert_close(ops.rms_norm(x, weight, EPS), torch_ops.rms_norm(x, weight, EPS), atol=0, rtol=0)
    out, new_residual = ops.rms_norm(x, weight, EPS, residual.clone())
    expected_out, expected_sum = torch_ops.rms_norm(x, weight, EPS, residual.clone())
    torch.testing.assert_close(out, expected_out, atol=0, rtol=0)
    torch.testing.assert_close(new_residual, expected_sum, atol=0, rtol=0)
    gate_up = randn(5, 66, dtype=torch.float16, seed=4)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up), atol=0, rtol=0)

    qkv, step = rotary_case(7, 64, torch.float16)
    qk = qkv[:, :8 * 64].view(7, 8, 64)
    expected = torch_ops.rotary_(qk.clone(), step)
    torch.testing.assert_close(ops.rotary_(qk, step), expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "make_x",
    [
        lambda: randn(2, 3, 33, seed=1),  # 3-D
        lambda: randn(33, 4, seed=1).t(),  # last dimension strided
    ],
    ids=["3d", "column-strided"],
)
def test_layouts_the_kernels_skip_take_the_torch_path(ops, make_x):
    x, weight = make_x(), randn(33, seed=2)
    expected = LayerOps().rms_norm(x, weight, EPS)
    torch.testing.assert_close(ops.rms_norm(x, weight, EPS), expected, atol=0, rtol=0)


def test_rms_norm_with_a_broadcast_residual_takes_the_torch_path(ops):
    """A (1, dim) residual broadcasts in torch; the kernel would write past it."""
    x, weight, residual = randn(4, 33, seed=1), randn(33, seed=2), randn(1, 33, seed=3)
    expected = LayerOps().rms_norm(x, weight, EPS, residual.clone())
    out = ops.rms_norm(x, weight, EPS, residual.clone())
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_rms_norm_with_weight_of_another_dtype_takes_the_torch_path(ops):
    x, weight = randn(4, 33, dtype=torch.bfloat16, seed=1), randn(33, seed=2)
    expected = LayerOps().rms_norm(x, weight, EPS)
    torch.testing.assert_close(ops.rms_norm(x, weight, EPS), expected, atol=0, rtol=0)


def test_layer_ops_without_native_is_torch():
    assert type(cpu_ops.layer_ops("cpu", native=False)) is LayerOps


@pytest.mark.parametrize("device", ["meta", torch.device("meta"), "cuda"])
def test_layer_ops_off_cpu_is_torch(device, monkeypatch):
    monkeypatch.setattr(cpu_ops, "native_library", lambda: pytest.fail("built the library for a non-CPU device"))
    assert type(cpu_ops.layer_ops(device)) is LayerOps


def test_layer_ops_on_cpu_uses_the_library(lib, monkeypatch):
    monkeypatch.setattr(cpu_ops, "native_library", lambda: lib)
    ops = cpu_ops.layer_ops("cpu")
    assert isinstance(ops, NativeLayerOps) and ops.native and ops.lib is lib


def test_layer_ops_falls_back_when_the_build_fails(monkeypatch, caplog):
    def fail(cache_dir):
        raise cpu_ops.KernelBuildError("no compiler here")

    monkeypatch.setattr(cpu_ops, "load_library", fail)
    with caplog.at_level(logging.WARNING, logger=cpu_ops.__name__):
        assert cpu_ops.native_library.__wrapped__() is None  # bypass the per-process cache
    assert "no compiler here" in caplog.text
    monkeypatch.setattr(cpu_ops, "native_library", lambda: None)
    assert type(cpu_ops.layer_ops("cpu")) is LayerOps


# ---------------------------------------------------------------- decode_attention

SEQ_LENS = [1, 17, 60, 9]


def decode_case(seq_lens, num_kv_heads, group, head_dim, dtype, seed=6):
    """q and a paged pool: slots shuffled, req_pool_indices out of order, and
    req_to_token rows filled past each seq_len with other requests' slots (must be ignored).

    Returns (q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens)."""
    gen = torch.Generator().manual_seed(seed)
    batch, num_slots = len(seq_lens), sum(seq_lens) + 11
    k_buffer = randn(num_slots, num_kv_heads, head_dim, dtype=dtype, seed=seed + 1)
    v_buffer = randn(num_slots, num_kv_heads, head_dim, dtype=dtype, seed=seed + 2)
    q = randn(batch, num_kv_heads * group, head_dim, dtype=dtype, seed=seed + 3, scale=4.0)
    num_rows = batch + 3
    req_to_token = torch.randint(0, num_slots, (num_rows, max(seq_lens) + 5), generator=gen, dtype=torch.int32)
    req_pool_indices = torch.randperm(num_rows, generator=gen)[:batch]
    slots = torch.randperm(num_slots, generator=gen).to(torch.int32)
    start = 0
    for row, n in zip(req_pool_indices.tolist(), seq_lens):
        req_to_token[row, :n] = slots[start:start + n]
        start += n
    return q, k_buffer, v_buffer, req_to_token, req_pool_indices, torch.tensor(seq_lens)


def assert_decode_matches_reference(ops, case, sliding_window, logit_cap) -> None:
    """Native decode attention equals `reference.decode_attention`: float32 to within
    float32 rounding; bfloat16 within one ulp of the float32 oracle and within the
    bfloat16 reference's own error."""
    q, k_buffer, v_buffer, *pool = case
    scale = q.shape[-1] ** -0.5
    assert ops.can_decode(q, k_buffer, v_buffer, pool[0])
    out = ops.decode_attention(q, k_buffer, v_buffer, *pool, scale, sliding_window, logit_cap)
    expected = reference.decode_attention(q, k_buffer, v_buffer, *pool, scale, sliding_window, logit_cap)
    assert out.dtype == q.dtype and out.shape == q.shape
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        return
    expected32 = reference.decode_attention(
        q.float(), k_buffer.float(), v_buffer.float(), *pool, scale, sliding_window, logit_cap
    )
    torch.testing.assert_close(out.float(), expected32, atol=1e-5, rtol=BF16_RTOL)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("logit_cap", [0.0, 30.0])
@pytest.mark.parametrize("sliding_window", [None, 1, 17, 1000])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_matches_reference(ops, dtype, group, head_dim, sliding_window, logit_cap):
    case = decode_case(SEQ_LENS, 2, group, head_dim, dtype)
    assert_decode_matches_reference(ops, case, sliding_window, logit_cap)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_large_batch(ops, dtype):
    """Ragged lengths up to 400 over 12 requests: the OpenMP path, threads sharing the work."""
    seq_lens = torch.randint(1, 400, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    case = decode_case(seq_lens, 4, 2, 80, dtype)
    assert_decode_matches_reference(ops, case, None, 0.0)
    assert_decode_matches_reference(ops, case, 100, 30.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_q_strided_rows(ops, dtype):
    """q as the model passes it: the q heads of a fused qkv row, row stride wider than q."""
    q, *rest = decode_case(SEQ_LENS, 2, 3, 64, dtype)
    qkv = torch.cat([q.flatten(1), randn(len(SEQ_LENS), 4 * 64, dtype=dtype, seed=9)], dim=1)
    q_view = qkv[:, :6 * 64].view(len(SEQ_LENS), 6, 64)
    assert q_view.stride(0) == 10 * 64
    assert_decode_matches_reference(ops, (q_view, *rest), 17, 0.0)


def new_kv_step(case, seed=8):
    """The decode step's new K/V for `case`, as the model passes them: the k and v heads
    of a fused qkv row (token stride wider than one row), to be stored at each request's
    last position. Returns (new_kv, pool_with_new_kv): the kernel's argument, and
    (k_buffer, v_buffer) copies with the rows stored by torch."""
    q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = case
    batch, (num_kv_heads, head_dim) = q.shape[0], k_buffer.shape[1:]
    qkv = randn(batch, q.shape[1] + 2 * num_kv_heads, head_dim, dtype=q.dtype, seed=seed)
    k, v = qkv[:, q.shape[1]:-num_kv_heads], qkv[:, -num_kv_heads:]
    out_cache_loc = req_to_token[req_pool_indices, seq_lens - 1].to(torch.int64)
    k_expected, v_expected = k_buffer.clone(), v_buffer.clone()
    k_expected[out_cache_loc], v_expected[out_cache_loc] = k, v
    return (k, v, out_cache_loc), (k_expected, v_expected)


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_stores_new_kv_first(ops, dtype, head_dim):
    case = decode_case(SEQ_LENS, 2, 3, head_dim, dtype)
    q, k_buffer, v_buffer, *pool = case
    new_kv, (k_expected, v_expected) = new_kv_step(case)
    assert ops.can_decode(q, k_buffer, v_buffer, pool[0], new_kv)

    out = ops.decode_attention(q, k_buffer, v_buffer, *pool, head_dim**-0.5, 17, 0.0, new_kv=new_kv)

    torch.testing.assert_close(k_buffer, k_expected, atol=0, rtol=0)
    torch.testing.assert_close(v_buffer, v_expected, atol=0, rtol=0)
    expected = ops.decode_attention(q, k_expected, v_expected, *pool, head_dim**-0.5, 17, 0.0)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert_decode_matches_reference(ops, (q, k_expected, v_expected, *pool), 17, 0.0)


def heads_strided(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values with a gap between heads (stride(1) > head_dim), last dimension contiguous."""
    wide = torch.zeros(t.shape[0], t.shape[1], 2 * t.shape[2], dtype=t.dtype)
    wide[:, :, :t.shape[2]] = t
    return wide[:, :, :t.shape[2]]


BAD_NEW_KV = {  # (k, v, out_cache_loc) -> a new_kv the kernel cannot store
    "k-other-dtype": lambda k, v, loc: (k.bfloat16(), v, loc),
    "v-fewer-heads": lambda k, v, loc: (k, v[:, :1], loc),
    "v-heads-strided": lambda k, v, loc: (k, heads_strided(v), loc),
    "loc-shorter-than-batch": lambda k, v, loc: (k, v, loc[:2]),
}


@pytest.mark.parametrize("spoil", list(BAD_NEW_KV.values()), ids=list(BAD_NEW_KV))
def test_decode_attention_refuses_new_kv_it_cannot_store(ops, spoil):
    case = decode_case(SEQ_LENS, 2, 3, 64, torch.float32)
    q, k_buffer, v_buffer, req_to_token, *_ = case
    new_kv, _ = new_kv_step(case)
    bad = spoil(*new_kv)
    assert not ops.can_decode(q, k_buffer, v_buffer, req_to_token, bad)
    with pytest.raises(ValueError, match="decode_attention"):
        ops.decode_attention(*case, 0.125, new_kv=bad)


def unsupported_layouts():
    """(id, case) pairs `decode_attention` must refuse."""
    q, k, v, req_to_token, rpi, seq_lens = decode_case([5, 3], 2, 2, 64, torch.float32)
    wide = torch.cat([k, v], dim=1)  # (slots, 4, 64): k as a head slice of it is not contiguous
    return [
        ("float16", (q.half(), k.half(), v.half(), req_to_token, rpi, seq_lens)),
        ("k-not-contiguous", (q, wide[:, :2], v, req_to_token, rpi, seq_lens)),
        ("v-not-contiguous", (q, k, wide[:, 2:], req_to_token, rpi, seq_lens)),
        ("k-other-dtype", (q, k.bfloat16(), v, req_to_token, rpi, seq_lens)),
        ("req-to-token-int64", (q, k, v, req_to_token.long(), rpi, seq_lens)),
        ("q-heads-not-multiple", (q[:, :3], k, v, req_to_token, rpi, seq_lens)),
        ("q-last-dim-strided", (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, req_to_token, rpi, seq_lens)),
        ("q-head-dim-not-the-pool's", (torch.cat([q, q], dim=-1), k, v, req_to_token, rpi, seq_lens)),
        ("v-shape-not-k's", (q, k, v[:, :1].contiguous(), req_to_token, rpi, seq_lens)),
    ]


@pytest.mark.parametrize("case", [pytest.param(case, id=name) for name, case in unsupported_layouts()])
def test_decode_attention_refuses_unsupported_layouts(ops, case):
    q, k_buffer, v_buffer, req_to_token, *_ = case
    assert not ops.can_decode(q, k_buffer, v_buffer, req_to_token)
    with pytest.raises(ValueError, match="decode_attention"):
        ops.decode_attention(*case, 0.125)


# A key block length for the long-context cases: lengths just under, at and past its
# multiples, so a kernel that splits a request's keys into blocks (split-K) and merges
# them is checked on both sides of each boundary.
CHUNK = 128


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_long_contexts(ops, dtype, group, head_dim):
    """Contexts of 1 to 5 blocks of keys (and one key past a block), with a window
    whose first key is inside a block, a logit cap, and none: each row as the oracle's."""
    seq_lens = [1, CHUNK, CHUNK + 1, 2 * CHUNK - 3, 5 * CHUNK + 7]
    case = decode_case(seq_lens, 2, group, head_dim, dtype)
    for sliding_window, logit_cap in ((None, 0.0), (CHUNK + 50, 0.0), (None, 30.0), (3 * CHUNK, 30.0)):
        assert_decode_matches_reference(ops, case, sliding_window, logit_cap)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_one_long_request(ops, dtype):
    """Batch 1, 3000 keys, SmolLM2-135M's heads (9 q, 3 kv, head_dim 64), with and
    without a window."""
    case = decode_case([3000], 3, 3, 64, dtype)
    assert_decode_matches_reference(ops, case, None, 0.0)
    assert_decode_matches_reference(ops, case, 1000, 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_batch_32_stores_then_attends(ops, dtype):
    """A batch-32 step shaped as SmolLM2-135M's (ragged 1-300 keys): stores the new K/V
    exactly, and each row's attention over the stored pool is the oracle's."""
    seq_lens = torch.randint(1, 300, (32,), generator=torch.Generator().manual_seed(11)).tolist()
    case = decode_case(seq_lens, 3, 3, 64, dtype)
    q, k_buffer, v_buffer, *pool = case
    new_kv, (k_expected, v_expected) = new_kv_step(case)
    out = ops.decode_attention(q, k_buffer, v_buffer, *pool, 0.125, None, 0.0, new_kv=new_kv)
    torch.testing.assert_close(k_buffer, k_expected, atol=0, rtol=0)
    torch.testing.assert_close(v_buffer, v_expected, atol=0, rtol=0)
    expected = reference.decode_attention(q.float(), k_buffer.float(), v_buffer.float(), *pool, 0.125)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-5, rtol=BF16_RTOL)
    torch.testing.assert_close(out.float(), expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_row_does_not_depend_on_its_batch(ops, dtype):
    """A request's output is the same bits alone and inside a batch of 32 (how the work
    is split may depend on the request's own keys, never on the batch or the threads),
    so greedy tokens do not depend on what else is running."""
    seq_lens = torch.randint(1, 700, (32,), generator=torch.Generator().manual_seed(12)).tolist()
    q, k_buffer, v_buffer, req_to_token, rpi, lens = decode_case(seq_lens, 3, 3, 64, dtype)
    batched = ops.decode_attention(q, k_buffer, v_buffer, req_to_token, rpi, lens, 0.125, 200, 0.0)
    for i in (0, 7, 31):
        alone = ops.decode_attention(q[i:i + 1], k_buffer, v_buffer, req_to_token, rpi[i:i + 1], lens[i:i + 1],
                                     0.125, 200, 0.0)
        torch.testing.assert_close(alone[0], batched[i], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_extend_rows_equal_each_row_alone(ops, dtype):
    """A prefill as decode rows (`NativeDecodeMetadata.of_extend_rows`): 1500 rows of one
    request at lengths 1..1500, whose split-K parts would pass the kernel's bound, so
    each (row, KV head) runs its chunks in turn; every row is the same bits as that row
    alone (chunks split across items) and matches the reference."""
    context, heads, group, head_dim = 1500, 3, 3, 64
    gen = torch.Generator().manual_seed(21)
    k_buffer = randn(context + 7, heads, head_dim, dtype=dtype, seed=22)
    v_buffer = randn(context + 7, heads, head_dim, dtype=dtype, seed=23)
    req_to_token = torch.zeros(3, context + 2, dtype=torch.int32)
    req_to_token[2, :context] = torch.randperm(context + 7, generator=gen)[:context].to(torch.int32)
    q = randn(context, heads * group, head_dim, dtype=dtype, seed=24, scale=4.0)
    rpi = torch.full((context,), 2, dtype=torch.int64)
    lens = torch.arange(1, context + 1)
    rows = ops.decode_attention(q, k_buffer, v_buffer, req_to_token, rpi, lens, 0.125, None, 0.0)
    for i in (0, 127, 255, 256, 999, context - 1):
        alone = ops.decode_attention(q[i:i + 1], k_buffer, v_buffer, req_to_token, rpi[i:i + 1], lens[i:i + 1],
                                     0.125, None, 0.0)
        torch.testing.assert_close(rows[i], alone[0], atol=0, rtol=0)
        expected = reference.decode_attention(q[i:i + 1].float(), k_buffer.float(), v_buffer.float(), req_to_token,
                                              rpi[i:i + 1], lens[i:i + 1], 0.125)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-5, rtol=BF16_RTOL)
        torch.testing.assert_close(rows[i:i + 1].float(), expected, **tol)


def fast_exp_float32(x: np.ndarray) -> np.ndarray:
    """`cpu_kernels.cpp`'s `fast_exp` (Cephes `expf`) in numpy float32, each operation
    rounded on its own as the kernel's scalar code is compiled (-ffp-contract=off)."""
    f = np.float32
    x = np.minimum(np.maximum(x.astype(f), f(-87.3)), f(88.7))
    n = np.rint(x * f(1.44269504088896341))
    r = (x - n * f(0.693359375)) + n * f(2.12194440e-4)
    p = np.full_like(x, f(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    p = ((p * r) * r + r) + f(1.0)
    return np.ldexp(p, n.astype(np.int32)).astype(f)


@pytest.mark.parametrize("length", [1, 5, 15, 16 + 1, 16 + 9, 16 + 15])
def test_decode_softmax_tail_is_fast_exp_bit_for_bit(lib, ops, request, length):
    """The softmax's last len % 16 probabilities (exps in masked lanes on AVX-512) are the
    bits of the scalar `fast_exp`, summed in order. Scores are made exact (q = e_0 and K
    rows x_t e_0, scale 1) and V rows one-hot, so the output's first `length` dims are the
    probabilities themselves; the first 16 keys of a longer row equal the maximum, whose
    exp is exactly 1 on every path. The AVX2 build's softmax is another exp and sum order."""
    if request.node.callspec.params["lib"] == "no-avx512":
        pytest.skip("the AVX2 loops exponentiate with exp_nonpositive in 8-lane sums")
    batch = 256  # requests, each its own scores: many exps to compare
    gen = np.random.default_rng(length)
    x = (gen.standard_normal((batch, length)) * 30).astype(np.float32)
    x[:, ::4] -= 200  # below the clamp at -87.3 after the max is taken off
    if length > 16:
        x[:, :16] = x.max(axis=1, keepdims=True) + 1
    k_buffer = torch.zeros(batch * length, 1, 64)
    k_buffer[:, 0, 0] = torch.from_numpy(x.reshape(-1))
    v_buffer = torch.zeros(batch * length, 1, 64)
    v_buffer[torch.arange(batch * length), 0, torch.arange(batch * length) % length] = 1.0
    q = torch.zeros(batch, 1, 64)
    q[:, 0, 0] = 1.0
    req_to_token = torch.arange(batch * length, dtype=torch.int32).reshape(batch, length)
    out = ops.decode_attention(q, k_buffer, v_buffer, req_to_token, torch.arange(batch),
                               torch.full((batch,), length), 1.0)

    e = fast_exp_float32(x - x.max(axis=1, keepdims=True))
    denom = np.zeros(batch, dtype=np.float32)
    for t in range(length):
        denom = denom + e[:, t]
    expected = e * (np.float32(1) / denom)[:, None]
    assert out[:, 0, :length].numpy().tobytes() == expected.tobytes()


@pytest.mark.parametrize("sliding_window", [None, 300])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_chains_equal_each_row_alone(ops, dtype, sliding_window):
    """Verify chains (rows of one request at lengths L, L+1, ...) run as one work item per
    chunk of keys; each row is still the bits of that row alone. The batch mixes a chain
    whose rows cross a chunk-count boundary (2 * CHUNK - 3 .. 2 * CHUNK + 3: one chunk,
    then two), a lone row, a 20-row chain of another request (cut into work items of at
    most 16 rows), a row of the first request whose length breaks the chain, and a chain
    across the sliding window's edge."""
    context = 3 * CHUNK
    gen = torch.Generator().manual_seed(31)
    k_buffer = randn(4 * context, 3, 64, dtype=dtype, seed=32)
    v_buffer = randn(4 * context, 3, 64, dtype=dtype, seed=33)
    req_to_token = torch.zeros(4, context + 8, dtype=torch.int32)
    for r in range(4):
        req_to_token[r] = torch.randperm(4 * context, generator=gen)[:context + 8].to(torch.int32)
    rows = ([(2, n) for n in range(2 * CHUNK - 3, 2 * CHUNK + 4)] + [(0, 40)] + [(1, n) for n in range(100, 120)]
            + [(2, 17)] + [(3, n) for n in range(298, 304)])
    rpi = torch.tensor([r for r, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    q = randn(len(rows), 9, 64, dtype=dtype, seed=34, scale=4.0)
    batched = ops.decode_attention(q, k_buffer, v_buffer, req_to_token, rpi, lens, 0.125, sliding_window, 0.0)
    for i in range(len(rows)):
        alone = ops.decode_attention(q[i:i + 1], k_buffer, v_buffer, req_to_token, rpi[i:i + 1], lens[i:i + 1],
                                     0.125, sliding_window, 0.0)
        torch.testing.assert_close(batched[i], alone[0], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_rows_of_one_request(ops, dtype):
    """Speculative verify's layout: several rows of one request at increasing lengths
    (L, L+1, ..., around a block boundary), every row's new K/V stored first; row i
    attends over its own seq_len only, and sees the rows before it."""
    context, rows, heads, head_dim = CHUNK - 2, 5, 3, 64
    gen = torch.Generator().manual_seed(13)
    num_slots = context + rows + 8
    k_buffer = randn(num_slots, heads, head_dim, dtype=dtype, seed=14)
    v_buffer = randn(num_slots, heads, head_dim, dtype=dtype, seed=15)
    req_to_token = torch.zeros(2, context + rows + 4, dtype=torch.int32)
    req_to_token[1, :context + rows] = torch.randperm(num_slots, generator=gen)[:context + rows].to(torch.int32)
    q = randn(rows, 3 * heads, head_dim, dtype=dtype, seed=16, scale=4.0)
    rpi = torch.ones(rows, dtype=torch.int64)
    lens = torch.arange(context + 1, context + rows + 1)
    k_new = randn(rows, heads, head_dim, dtype=dtype, seed=17)
    v_new = randn(rows, heads, head_dim, dtype=dtype, seed=18)
    loc = req_to_token[1, lens - 1].to(torch.int64)
    k_expected, v_expected = k_buffer.clone(), v_buffer.clone()
    k_expected[loc], v_expected[loc] = k_new, v_new

    out = ops.decode_attention(q, k_buffer, v_buffer, req_to_token, rpi, lens, 0.125, new_kv=(k_new, v_new, loc))

    torch.testing.assert_close(k_buffer, k_expected, atol=0, rtol=0)
    expected = reference.decode_attention(q.float(), k_expected.float(), v_expected.float(), req_to_token, rpi,
                                          lens, 0.125)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-5, rtol=BF16_RTOL)
    torch.testing.assert_close(out.float(), expected, **tol)


# ------------------------------------------------ one-byte KV pools (kv_cache_dtype)

ONE_BYTE = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


def one_byte_pool(buffer: torch.Tensor, kv_dtype: torch.dtype):
    """`buffer` (slots, heads, head_dim) stored as a one-byte pool stores it
    (`memory_pool.TokenToKVPool.set_kv_buffer`'s rounding): (stored, scales or None,
    widened) where `widened` is the float32 value each stored element stands for."""
    if kv_dtype != torch.int8:
        bound = torch.finfo(kv_dtype).max
        stored = buffer.float().clamp(-bound, bound).to(kv_dtype)
        return stored, None, stored.float()
    scale = (buffer.float().abs().amax(dim=-1) / 127).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    stored = torch.round(buffer.float() / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return stored, scale, stored.float() * scale.float()[..., None]


@pytest.mark.parametrize("sliding_window,logit_cap", [(None, 0.0), (17, 30.0)])
@pytest.mark.parametrize("head_dim", [40, 64, 128])  # 40: a scalar tail; 64, 128: the register tiles
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("kv_dtype", ONE_BYTE, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_over_one_byte_pool(ops, dtype, kv_dtype, group, head_dim, sliding_window, logit_cap):
    """Read in place and widened in registers: equals the kernel over a pool of q's
    dtype holding the widened values (float32 within rounding, bf16 within one ulp of
    the float32 oracle over them)."""
    q, k_buffer, v_buffer, *pool = decode_case([1, 9, 40, 133, 300], 2, group, head_dim, dtype)  # 300: split
    (k8, k_scale, k_wide), (v8, v_scale, v_wide) = (one_byte_pool(b, kv_dtype) for b in (k_buffer, v_buffer))
    scales = None if k_scale is None else (k_scale, v_scale)
    assert ops.can_decode(q, k8, v8, pool[0], kv_scales=scales)
    out = ops.decode_attention(q, k8, v8, *pool, head_dim**-0.5, sliding_window, logit_cap, kv_scales=scales)
    expected = reference.decode_attention(q.float(), k_wide, v_wide, *pool, head_dim**-0.5, sliding_window, logit_cap)
    rtol = 1e-5 if dtype == torch.float32 else BF16_RTOL
    torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=rtol)


@pytest.mark.parametrize("head_dim", [40, 64])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_every_fp8_byte_widens_as_torch_does(ops, kv_dtype, head_dim):
    """All 256 bit patterns (subnormals, the largest finite values, inf and NaN) as V
    rows of one-key requests: each output row is its V row widened, bit for bit, as
    torch's `.float()` widens it."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    rows = -(-256 // head_dim)
    v8 = torch.zeros(rows * head_dim, dtype=torch.uint8)
    v8[:256] = values
    v8 = v8.view(rows, 1, head_dim).view(kv_dtype)
    k8 = torch.zeros_like(v8)  # keys 0: a finite score, so the one probability is exactly 1
    req_to_token = torch.arange(rows, dtype=torch.int32).view(rows, 1)
    q = torch.ones(rows, 1, head_dim)
    out = ops.decode_attention(q, k8, v8, req_to_token, torch.arange(rows), torch.ones(rows, dtype=torch.int64), 1.0)
    torch.testing.assert_close(out, v8.float(), atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_store_rounds_as_the_pool_does(ops, dtype):
    """The native int8 store gives the bytes and scales `TokenToKVPool.set_kv_buffer` gives,
    bit for bit: ordinary rows, all-zero rows, rows whose scale is an fp16 subnormal or
    overflows fp16, and K/V read from a fused qkv row (token stride wider than a row)."""
    from arborlm.radix_cache.memory_pool import TokenToKVPool

    tokens, heads, head_dim = 9, 3, 64
    qkv = randn(tokens, 5 * heads, head_dim, dtype=dtype, seed=21, scale=3.0)
    qkv[1, 3 * heads] = 0  # an all-zero K row
    qkv[2, 3 * heads + 1] *= 1e-5  # its scale an fp16 subnormal
    qkv[3, 4 * heads] *= 1e7 if dtype == torch.float32 else 1e6  # its scale past fp16's range
    k, v = qkv[:, 3 * heads:4 * heads], qkv[:, 4 * heads:]
    loc = torch.tensor([7, 2, 30, 11, 5, 19, 1, 25, 13])
    want = TokenToKVPool(32, 2, heads, head_dim, torch.int8)
    got = TokenToKVPool(32, 2, heads, head_dim, torch.int8)
    want.set_kv_buffer(1, loc, k, v)
    ops.store_kv_int8(k, v, loc, (*got.get_kv_buffer(1), *got.get_kv_scales(1)))
    for a, b in ((got.k_buffer, want.k_buffer), (got.v_buffer, want.v_buffer)):
        assert torch.equal(a, b)
    for a, b in ((got.k_scale, want.k_scale), (got.v_scale, want.v_scale)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    with pytest.raises(ValueError, match="store_kv_int8"):
        ops.store_kv_int8(k.half(), v.half(), loc, (*got.get_kv_buffer(1), *got.get_kv_scales(1)))


def test_int8_pool_needs_its_scales(ops):
    case = decode_case([5, 3], 2, 2, 64, torch.float32)
    q, k_buffer, v_buffer, req_to_token, *_ = case
    (k8, k_scale, _), (v8, v_scale, _) = (one_byte_pool(b, torch.int8) for b in (k_buffer, v_buffer))
    assert not ops.can_decode(q, k8, v8, req_to_token)  # no scales
    assert not ops.can_decode(q, k8, v8, req_to_token, kv_scales=(k_scale.float(), v_scale))  # fp16 only
    assert not ops.can_decode(q, k8, v8, req_to_token, kv_scales=(k_scale[:-1], v_scale))  # one per slot and head
    fp8 = one_byte_pool(k_buffer, torch.float8_e4m3fn)[0]
    assert not ops.can_decode(q, fp8, fp8, req_to_token, kv_scales=(k_scale, v_scale))  # fp8 takes none
    new_kv, _ = new_kv_step(case)
    assert not ops.can_decode(q, fp8, fp8, req_to_token, new_kv)  # stores only into a pool of q's dtype


# ---------------------------------------------------------------- build


def kernel_files(cache_dir: Path) -> list[str]:
    """Names of the files in the build folder (the library and any leftover temporaries)."""
    folder = cache_dir / "kernels"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_missing_compiler_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(cpu_ops.KernelBuildError, match="no-such-c\\+\\+"):
        cpu_ops.build_library(tmp_path)
    assert kernel_files(tmp_path) == []


def test_no_compiler_on_path_raises(tmp_path, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(cpu_ops.shutil, "which", lambda name: None)
    with pytest.raises(cpu_ops.KernelBuildError, match="no C\\+\\+ compiler"):
        cpu_ops.build_library(tmp_path)


def test_compile_error_carries_the_compiler_message(compiler, tmp_path, monkeypatch):
    source = tmp_path / "broken_kernels.cpp"
    source.write_text("int arborlm_abi_version() { return 1 }\n")  # missing ';'
    monkeypatch.setattr(cpu_ops, "SOURCE", source)
    with pytest.raises(cpu_ops.KernelBuildError) as info:
        cpu_ops.build_library(tmp_path / "cache")
    message = str(info.value)
    assert "broken_kernels.cpp" in message and "error" in message and "expected" in message
    assert kernel_files(tmp_path / "cache") == []  # no half-written library left behind


def test_second_build_reuses_the_library(compiler, tmp_path):
    first = cpu_ops.build_library(tmp_path)
    mtime = first.stat().st_mtime_ns
    second = cpu_ops.build_library(tmp_path)
    assert second == first and second.stat().st_mtime_ns == mtime
    assert kernel_files(tmp_path) == [first.name]
    assert cpu_ops.load_library(tmp_path).arborlm_abi_version() == cpu_ops.ABI_VERSION


# ------------------------------------------------ extend attention in tiles (any pool)


def extend_case(prefix_lens, extend_lens, num_kv_heads, group, head_dim, dtype, seed=31):
    """An EXTEND step's q and a paged pool as `decode_case` lays it out (slots shuffled,
    rows out of order, req_to_token past each seq_len filled with other slots).

    Returns (q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
    extend_prefix_lens, extend_seq_lens, extend_start_loc)."""
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    _, k_buffer, v_buffer, req_to_token, rpi, lens = decode_case(seq_lens, num_kv_heads, group, head_dim, dtype, seed)
    q = randn(sum(extend_lens), num_kv_heads * group, head_dim, dtype=dtype, seed=seed + 7, scale=4.0)
    extend = torch.tensor(extend_lens)
    return (q, k_buffer, v_buffer, req_to_token, rpi, lens, torch.tensor(prefix_lens), extend,
            torch.cumsum(extend, 0) - extend)


# New tokens from 1 to past two row blocks (16) and key tiles (64), after cached prefixes of
# 0 to past a tile.
EXTEND_PREFIXES, EXTEND_LENS = [0, 37, 100, 63, 5], [70, 5, 1, 130, 16]


@pytest.mark.parametrize("sliding_window,logit_cap", [(None, 0.0), (17, 30.0)])
@pytest.mark.parametrize("head_dim", [40, 64, 128])  # 40: past the register blocks of 16 dims
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("kv_dtype", [None, *ONE_BYTE], ids=str)  # None: a pool of q's dtype
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extend_attention_tiled_equals_the_oracle(ops, dtype, kv_dtype, group, head_dim, sliding_window, logit_cap):
    """K/V read in place (one-byte pools widened per tile): equals `reference.extend_attention`
    over the widened float32 values, float32 within rounding, bf16 within one ulp."""
    q, k_buffer, v_buffer, req_to_token, rpi, lens, prefix, extend, start = extend_case(
        EXTEND_PREFIXES, EXTEND_LENS, 2, group, head_dim, dtype)
    if kv_dtype is None:
        k_pool, v_pool, scales, k_wide, v_wide = k_buffer, v_buffer, None, k_buffer.float(), v_buffer.float()
    else:
        (k_pool, k_scale, k_wide), (v_pool, v_scale, v_wide) = (one_byte_pool(b, kv_dtype) for b in (k_buffer, v_buffer))
        scales = None if k_scale is None else (k_scale, v_scale)
    out = ops.extend_attention_tiled(q, k_pool, v_pool, req_to_token, rpi, lens, extend, start, head_dim**-0.5,
                                     sliding_window, logit_cap, kv_scales=scales)
    expected = reference.extend_attention(q.float(), k_wide, v_wide, req_to_token, rpi, lens, prefix, extend,
                                          head_dim**-0.5, sliding_window, logit_cap)
    rtol = 1e-5 if dtype == torch.float32 else BF16_RTOL
    torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=rtol)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=str)
def test_extend_attention_tiled_request_does_not_depend_on_its_batch(ops, kv_dtype):
    """A request's rows are the same bits alone and in the batch (work items are one
    request's blocks), so prefill outputs do not depend on what else is scheduled."""
    q, k_buffer, v_buffer, req_to_token, rpi, lens, _, extend, start = extend_case(
        EXTEND_PREFIXES, EXTEND_LENS, 3, 3, 64, torch.float32)
    scales = None
    if kv_dtype is not None:
        (k_buffer, k_scale, _), (v_buffer, v_scale, _) = (one_byte_pool(b, kv_dtype) for b in (k_buffer, v_buffer))
        scales = (k_scale, v_scale)
    batched = ops.extend_attention_tiled(q, k_buffer, v_buffer, req_to_token, rpi, lens, extend, start, 0.125,
                                         kv_scales=scales)
    for i in (0, 3):
        rows = slice(int(start[i]), int(start[i] + extend[i]))
        alone = ops.extend_attention_tiled(q[rows], k_buffer, v_buffer, req_to_token, rpi[i:i + 1], lens[i:i + 1],
                                           extend[i:i + 1], torch.zeros(1, dtype=torch.int64), 0.125, kv_scales=scales)
        assert torch.equal(alone, batched[rows])


@pytest.mark.parametrize("sliding_window", [None, 17, 100])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=str)
def test_extend_attention_tiled_row_does_not_depend_on_where_the_extend_starts(ops, kv_dtype, sliding_window):
    """A token's output is the same bits whether its prompt is extended in one step or
    after a cached prefix of any length (key tiles sit at fixed positions, whatever the
    window), so a prefill chunk or a radix-cache hit does not change the tokens."""
    total = 200
    q, k_buffer, v_buffer, req_to_token, rpi, lens, _, extend, start = extend_case([0], [total], 3, 3, 64,
                                                                                  torch.float32)
    scales = None
    if kv_dtype is not None:
        (k_buffer, k_scale, _), (v_buffer, v_scale, _) = (one_byte_pool(b, kv_dtype) for b in (k_buffer, v_buffer))
        scales = (k_scale, v_scale)
    whole = ops.extend_attention_tiled(q, k_buffer, v_buffer, req_to_token, rpi, lens, extend, start, 0.125,
                                       sliding_window, kv_scales=scales)
    for prefix in (1, 63, 64, 100, 199):
        part = ops.extend_attention_tiled(q[prefix:], k_buffer, v_buffer, req_to_token, rpi, lens,
                                          torch.tensor([total - prefix]), torch.zeros(1, dtype=torch.int64), 0.125,
                                          sliding_window, kv_scales=scales)
        assert torch.equal(part, whole[prefix:]), prefix


def test_extend_attention_tiled_refuses_what_it_does_not_take(ops):
    q, k_buffer, v_buffer, req_to_token, rpi, lens, _, extend, start = extend_case([3], [4], 2, 2, 64, torch.float32)
    k8, k_scale, _ = one_byte_pool(k_buffer, torch.int8)
    with pytest.raises(ValueError, match="extend_attention_tiled"):  # an int8 pool without its scales
        ops.extend_attention_tiled(q, k8, k8, req_to_token, rpi, lens, extend, start, 0.125)
    with pytest.raises(ValueError, match="extend_attention_tiled"):  # a float16 pool
        ops.extend_attention_tiled(q, k_buffer.half(), v_buffer.half(), req_to_token, rpi, lens, extend, start, 0.125)
