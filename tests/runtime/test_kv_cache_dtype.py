"""A quantized KV pool (`kv_cache_dtype`: SGLang's fp8_e5m2 / fp8_e4m3, and int8 with a scale per
token and KV head): storage, attention, pool size.

The pool stores one byte per value (fp8: saturated cast); attention reads it in place
with the C++ kernels, else upcast (`layers/attention/quantized_kv_backend.py`); native
steps never read an upcast copy. Attention over the fp8 pool equals the
reference attention over a float pool holding the same fp8-rounded K/V (1e-5), for
decode and extend steps with a cached prefix; a tiny Llama served with an fp8 pool keeps
its float-pool logits (prompt and teacher-forced decode steps) within the format's
rounding and their argmax wherever the float model is not near a tie; the same
memory holds twice the tokens of bf16 (int8: 2 head_dim / (head_dim + 2) times); unknown
names and int8 with the host tier are a ValueError naming kv_cache_dtype.
"""

from __future__ import annotations

import pytest
import torch

from arborlm.radix_cache.memory_pool import (
    KV_CACHE_DTYPES,
    ReqToTokenPool,
    TokenToKVPool,
    TokenToKVPoolAllocator,
    kv_cache_torch_dtype,
)
from arborlm.runtime import model_runner
from arborlm.runtime.config import CacheConfig, ServerArgs
from arborlm.runtime.forward_batch_info import ForwardBatch, ForwardMode
from arborlm.runtime.layers.attention.quantized_kv_backend import QuantizedKVAttentionBackend
from arborlm.runtime.layers.attention.reference_backend import ReferenceAttentionBackend
from arborlm.runtime.model_loader import load_model
from tests.runtime.family_helpers import PROMPTS, tiny_checkpoint
from tests.runtime.model_helpers import ModelHarness

FP8 = ["fp8_e4m3", "fp8_e5m2"]
QUANTIZED = sorted(KV_CACHE_DTYPES)  # fp8 and int8
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def test_pool_stores_one_byte_saturated():
    for name in FP8:
        dtype = KV_CACHE_DTYPES[name]
        pool = TokenToKVPool(16, 2, KV_HEADS, HEAD_DIM, dtype)
        bf16 = TokenToKVPool(16, 2, KV_HEADS, HEAD_DIM, torch.bfloat16)
        assert pool.quantized and not bf16.quantized
        assert 2 * pool.k_buffer.nbytes == bf16.k_buffer.nbytes
        k = torch.randn(3, KV_HEADS, HEAD_DIM)
        k[0, 0, 0] = 1e6  # beyond both formats' range: saturated, not inf
        v = torch.randn(3, KV_HEADS, HEAD_DIM)
        loc = torch.tensor([2, 5, 7])
        pool.set_kv_buffer(1, loc, k, v)
        got_k, got_v = pool.read_kv(1, loc, torch.float32)
        bound = torch.finfo(dtype).max
        torch.testing.assert_close(got_k, k.clamp(-bound, bound).to(dtype).float(), atol=0, rtol=0, msg=name)
        torch.testing.assert_close(got_v, v.to(dtype).float(), atol=0, rtol=0, msg=name)
        assert float(got_k[0, 0, 0]) == bound
        assert not pool.k_buffer[0].float().any()  # other layers untouched


def test_int8_pool_rounds_per_token_and_head():
    pool = TokenToKVPool(16, 2, KV_HEADS, HEAD_DIM, torch.int8)
    assert pool.quantized and pool.k_scale.shape == (2, 17, KV_HEADS)
    assert TokenToKVPool.bytes_per_token(2, KV_HEADS, HEAD_DIM, torch.int8) == 2 * 2 * KV_HEADS * (HEAD_DIM + 2)
    k = torch.randn(3, KV_HEADS, HEAD_DIM) * torch.tensor([1.0, 50.0, 0.01]).view(3, 1, 1)
    k[1, 1] = 0  # an all-zero head
    loc = torch.tensor([2, 5, 7])
    pool.set_kv_buffer(1, loc, k, -k)
    got_k, got_v = pool.read_kv(1, loc, torch.float32)
    step = (k.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    assert bool(((got_k - k).abs() <= step / 2 * (1 + 1e-3) + 1e-8).all())
    torch.testing.assert_close(got_v, -got_k, atol=0, rtol=0)
    assert not got_k[1, 1].any()


def _rounded(kind: str, x: torch.Tensor) -> torch.Tensor:
    """x as an fp8 / int8 pool of `kind` gives it back."""
    pool = TokenToKVPool(x.shape[0], 1, x.shape[1], x.shape[2], KV_CACHE_DTYPES[kind])
    slots = torch.arange(1, x.shape[0] + 1)
    pool.set_kv_buffer(0, slots, x, x)
    return pool.read_kv(0, slots, x.dtype)[0]


def _batch(mode, pool, req_to_token_pool, allocator, rows, prefix_lens, new_lens):
    out_cache_loc = allocator.alloc(sum(new_lens))
    start = 0
    for row, prefix, n in zip(rows, prefix_lens, new_lens):
        req_to_token_pool.req_to_token[row, prefix:prefix + n] = out_cache_loc[start:start + n].to(torch.int32)
        start += n
    ids = [0] * sum(new_lens)
    return ForwardBatch.build(mode, ids, rows, prefix_lens, new_lens, out_cache_loc, req_to_token_pool, pool)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_equals_reference_over_rounded_kv(name, dtype):
    """Both pools see the same steps: a prefill of two requests, an extend after the
    cached prefix, then a decode step; the float pool is given the rounded K/V."""
    fp8 = KV_CACHE_DTYPES[name]
    g = torch.Generator().manual_seed(0)
    pools = {kind: TokenToKVPool(64, 1, KV_HEADS, HEAD_DIM, fp8 if kind == "fp8" else dtype) for kind in ("fp8", "ref")}
    req_pools = {kind: ReqToTokenPool(4, 32) for kind in pools}
    allocators = {kind: TokenToKVPoolAllocator(64) for kind in pools}
    backends = {"fp8": QuantizedKVAttentionBackend.create(torch.device("cpu"), _native()), "ref": ReferenceAttentionBackend()}
    steps = [(ForwardMode.EXTEND, [0, 5], [5, 9]), (ForwardMode.EXTEND, [5, 9], [3, 1]), (ForwardMode.DECODE, [8, 10], [1, 1])]
    for mode, prefix_lens, new_lens in steps:
        n = sum(new_lens)
        q = torch.randn(n, HEADS, HEAD_DIM, generator=g).to(dtype)
        k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
        out = {}
        for kind in pools:
            batch = _batch(mode, pools[kind], req_pools[kind], allocators[kind], [1, 3], prefix_lens, new_lens)
            backends[kind].init_forward_metadata(batch)
            kk, vv = (k, v) if kind == "fp8" else (_rounded(name, k), _rounded(name, v))
            out[kind] = backends[kind].forward(q, kk, vv, 0, batch, HEAD_DIM**-0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out["fp8"].float(), out["ref"].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", QUANTIZED)
def test_native_steps_read_the_pool_in_place(name, monkeypatch):
    """With the C++ kernels, prefill, extend-after-prefix and decode steps over a one-byte
    pool never read an upcast copy of the context (`read_kv`), and equal the reference."""
    native = _native()
    if native is None:
        pytest.skip("no C++ compiler here, so no native CPU kernels: every step reads the upcast copy, "
                    "which test_attention_equals_reference_over_rounded_kv checks")
    monkeypatch.setattr(TokenToKVPool, "read_kv", lambda *a, **k: pytest.fail("read an upcast copy"))
    g = torch.Generator().manual_seed(1)
    pool = TokenToKVPool(256, 1, KV_HEADS, HEAD_DIM, KV_CACHE_DTYPES[name])
    ref_pool = TokenToKVPool(256, 1, KV_HEADS, HEAD_DIM, torch.float32)
    req_pools, allocators = [ReqToTokenPool(4, 200) for _ in range(2)], [TokenToKVPoolAllocator(256) for _ in range(2)]
    backends = [QuantizedKVAttentionBackend.create(torch.device("cpu"), native), ReferenceAttentionBackend()]
    steps = [(ForwardMode.EXTEND, [0, 0], [70, 9]), (ForwardMode.EXTEND, [70, 9], [20, 80]),
             (ForwardMode.DECODE, [90, 89], [1, 1])]
    for mode, prefix_lens, new_lens in steps:
        n = sum(new_lens)
        q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
        k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
        outs = []
        for i, kv_pool in enumerate((pool, ref_pool)):
            batch = _batch(mode, kv_pool, req_pools[i], allocators[i], [1, 3], prefix_lens, new_lens)
            backends[i].init_forward_metadata(batch)
            kk, vv = (k, v) if i == 0 else (_rounded_in_place(name, k), _rounded_in_place(name, v))
            outs.append(backends[i].forward(q, kk, vv, 0, batch, HEAD_DIM**-0.5))
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def _rounded_in_place(kind: str, x: torch.Tensor) -> torch.Tensor:
    """`_rounded` without `read_kv`: the pool's stored values widened by hand."""
    pool = TokenToKVPool(x.shape[0], 1, x.shape[1], x.shape[2], KV_CACHE_DTYPES[kind])
    slots = torch.arange(1, x.shape[0] + 1)
    pool.set_kv_buffer(0, slots, x, x)
    stored = pool.get_kv_buffer(0)[0][slots].float()
    scales = pool.get_kv_scales(0)
    return stored if scales is None else stored * scales[0][slots].float()[..., None]


def _native():
    from arborlm.kernels.cpu_ops import layer_ops

    ops = layer_ops("cpu")
    return ops if ops.native else None


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv_llama")
    tiny_checkpoint(folder, "llama", head_dim=32, num_attention_heads=2, num_key_value_heads=1)
    return folder


def _decode_logits(loaded, pool_dtype, tokens: list[list[int]]) -> torch.Tensor:
    """Prompt logits, then the logits of each decode step fed `tokens` (teacher forcing:
    a random tiny model's near-tied logits would let greedy paths part on noise)."""
    harness = ModelHarness(loaded.model, loaded.hf_config, dtype=pool_dtype)
    rows = [harness.new_req() for _ in PROMPTS]
    out = [harness.extend(rows, PROMPTS, return_full_logits=True).full_logits]
    for step in range(len(tokens[0])):
        out.append(harness.decode(rows, [t[step] for t in tokens]).next_token_logits)
    return torch.cat(out)


@pytest.mark.parametrize("name", QUANTIZED)
def test_tiny_llama_with_an_fp8_pool_keeps_its_logits(llama_dir, name):
    fp8 = load_model(llama_dir, torch.float32, torch.device("cpu"), kv_cache_dtype=name)
    plain = load_model(llama_dir, torch.float32, torch.device("cpu"))
    tokens = ModelHarness(plain.model, plain.hf_config).greedy(PROMPTS, 16)
    q = _decode_logits(fp8, KV_CACHE_DTYPES[name], tokens)
    p = _decode_logits(plain, torch.float32, tokens)
    # fp8_e4m3 keeps 3 mantissa bits, fp8_e5m2 2: relative rounding 2^-4 and 2^-3 per value.
    assert float((q - p).norm() / p.norm()) < {"int8": 0.01, "fp8_e4m3": 0.03, "fp8_e5m2": 0.06}[name]
    margin = p.topk(2).values  # where the float model is not near a tie, the same argmax
    clear = (margin[:, 0] - margin[:, 1]) > 0.05
    assert bool(clear.any()) and bool((q.argmax(-1) == p.argmax(-1))[clear].all())


def test_same_memory_holds_twice_the_tokens(llama_dir, monkeypatch):
    monkeypatch.setattr(model_runner, "_available_memory_bytes", lambda device: 64 << 20)
    tokens = {}
    for name in ("auto", *QUANTIZED):
        args = ServerArgs.from_kwargs(model_path=str(llama_dir), dtype="bfloat16", kv_cache_dtype=name)
        runner = model_runner.ModelRunner(args)
        tokens[name] = runner.max_total_tokens
        assert runner.token_to_kv_pool.dtype == kv_cache_torch_dtype(name, torch.bfloat16)
    assert tokens["fp8_e4m3"] == tokens["fp8_e5m2"] == 2 * tokens["auto"]
    head_dim = 32  # llama_dir's: int8 stores head_dim bytes and a 2-byte scale per token and head
    assert tokens["int8"] == pytest.approx(tokens["auto"] * 2 * head_dim / (head_dim + 2), rel=1e-3)


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_torch_dtype("int3", torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int8", enable_hierarchical_cache=True)
