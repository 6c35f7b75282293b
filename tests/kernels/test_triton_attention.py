"""The Triton kernels against the torch reference, under Triton's interpreter on the CPU.

`TRITON_INTERPRET=1` is set before the kernels are imported (it is read when
`@triton.jit` runs); on a CUDA machine run with `TRITON_INTERPRET=0` to test the
compiled kernels instead. The default cases cover every head dim, GQA ratio,
page size and dtype the kernels promise at least once; `ARBORLM_KERNEL_SWEEP=1`
runs their full cross product (slow under the interpreter).
"""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from arborlm.kernels import reference  # noqa: E402
from arborlm.kernels.triton_decode import decode_attention  # noqa: E402
from arborlm.kernels.triton_extend import extend_attention  # noqa: E402

pytestmark = pytest.mark.interpreter

DEVICE = torch.device("cuda" if os.environ["TRITON_INTERPRET"] != "1" else "cpu")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def make_paged_pool(prefix_lens, extend_lens, num_kv_heads, head_dim, page_size, dtype, seed=0):
    """Random K/V buffers and a `req_to_token` that maps each request's positions to
    whole pages taken in random order (page_size 1: scattered single slots).

    Returns (k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens) on DEVICE.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_req) + 1  # page 0 stays unused: the padding slot
    num_slots = num_pages * page_size
    k_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    batch = len(seq_lens)
    req_to_token = torch.zeros(batch + 2, max(seq_lens) + page_size, dtype=torch.int32)
    req_pool_indices = torch.randperm(batch + 2, generator=gen)[:batch]
    pages = torch.randperm(num_pages - 1, generator=gen) + 1
    start = 0
    for row, n, num in zip(req_pool_indices.tolist(), seq_lens, pages_per_req):
        slots = (pages[start:start + num, None] * page_size + torch.arange(page_size)).flatten()
        req_to_token[row, :n] = slots[:n].to(torch.int32)
        start += num
    tensors = (k_buffer, v_buffer, req_to_token, req_pool_indices, torch.tensor(seq_lens))
    return tuple(t.to(DEVICE) for t in tensors)


def check_extend(prefix_lens, extend_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype,
                 sliding_window=None, logit_cap=0.0, block_sizes=None):
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = make_paged_pool(
        prefix_lens, extend_lens, num_kv_heads, head_dim, page_size, dtype
    )
    q = torch.randn(sum(extend_lens), num_q_heads, head_dim, generator=torch.Generator().manual_seed(1))
    q = q.to(dtype).to(DEVICE)
    prefix, extend = torch.tensor(prefix_lens, device=DEVICE), torch.tensor(extend_lens, device=DEVICE)
    scale = head_dim**-0.5
    out = extend_attention(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, prefix, extend, scale,
        sliding_window, logit_cap, block_sizes=block_sizes,
    )
    expected = reference.extend_attention(
        q.float(), k_buffer.float(), v_buffer.float(), req_to_token, req_pool_indices, seq_lens, prefix, extend,
        scale, sliding_window, logit_cap,
    )
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def check_decode(seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype,
                 sliding_window=None, logit_cap=0.0, num_kv_splits=None):
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens_t = make_paged_pool(
        [n - 1 for n in seq_lens], [1] * len(seq_lens), num_kv_heads, head_dim, page_size, dtype
    )
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=torch.Generator().manual_seed(1))
    q = q.to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    out = decode_attention(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens_t, scale, sliding_window, logit_cap,
        num_kv_splits=num_kv_splits,
    )
    expected = reference.decode_attention(
        q.float(), k_buffer.float(), v_buffer.float(), req_to_token, req_pool_indices, seq_lens_t, scale,
        sliding_window, logit_cap,
    )
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


EXTEND_CASES = [  # prefix_lens, extend_lens, q heads, kv heads, head_dim, page, dtype, window, cap, blocks
    ([0], [1], 2, 2, 64, 1, torch.float32, None, 0.0, None),
    ([0, 5, 300], [17, 40, 3], 4, 4, 64, 1, torch.float32, None, 0.0, (16, 16)),
    ([0, 130], [33, 20], 6, 2, 80, 16, torch.float32, None, 0.0, (16, 32)),
    ([64, 7, 0], [9, 1, 50], 8, 1, 96, 1, torch.float32, 20, 0.0, (16, 16)),
    ([45, 0], [30, 12], 6, 2, 128, 16, torch.float32, None, 30.0, None),
    ([200, 3], [20, 70], 8, 1, 128, 16, torch.float16, None, 0.0, (16, 16)),
    ([0, 33], [40, 16], 6, 2, 64, 1, torch.bfloat16, None, 0.0, None),
    ([17, 90], [5, 24], 3, 3, 80, 16, torch.float16, 16, 0.0, (16, 16)),
    ([120], [35], 6, 2, 96, 1, torch.bfloat16, None, 20.0, (32, 16)),
]


@pytest.mark.parametrize(
    "prefix_lens, extend_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, window, cap, blocks",
    EXTEND_CASES,
)
def test_extend_matches_reference(prefix_lens, extend_lens, num_q_heads, num_kv_heads, head_dim, page_size,
                                  dtype, window, cap, blocks):
    check_extend(prefix_lens, extend_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, window, cap, blocks)


DECODE_CASES = [  # seq_lens, q heads, kv heads, head_dim, page, dtype, window, cap, splits
    ([1], 2, 2, 64, 1, torch.float32, None, 0.0, 1),
    ([1, 37, 300], 4, 4, 64, 1, torch.float32, None, 0.0, 3),
    ([130, 2, 64], 6, 2, 80, 16, torch.float32, None, 0.0, 8),
    ([250, 17], 8, 1, 96, 1, torch.float32, 40, 0.0, 4),
    ([90, 400], 6, 2, 128, 16, torch.float32, None, 30.0, 2),
    ([333, 5, 48], 8, 1, 128, 16, torch.float16, None, 0.0, 5),
    ([70, 129], 6, 2, 64, 1, torch.bfloat16, None, 0.0, 2),
    ([200, 31], 3, 3, 80, 16, torch.float16, 25, 0.0, 3),
    ([160], 6, 2, 96, 1, torch.bfloat16, None, 20.0, 16),
]


@pytest.mark.parametrize(
    "seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, window, cap, splits", DECODE_CASES
)
def test_decode_matches_reference(seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, window, cap,
                                  splits):
    check_decode(seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, window, cap, splits)


SWEEP = list(itertools.product(
    [(1, 1), (3, 1), (8, 1)],  # (group, kv heads)
    [64, 80, 96, 128],
    [1, 16],
    [torch.float32, torch.float16, torch.bfloat16],
))
sweep = pytest.mark.skipif(
    os.environ.get("ARBORLM_KERNEL_SWEEP") != "1", reason="full kernel sweep: set ARBORLM_KERNEL_SWEEP=1"
)


@sweep
@pytest.mark.parametrize("heads, head_dim, page_size, dtype", SWEEP)
def test_sweep(heads, head_dim, page_size, dtype):
    group, num_kv_heads = heads
    check_extend([0, 150, 17], [23, 9, 64], group * num_kv_heads, num_kv_heads, head_dim, page_size, dtype)
    check_decode([1, 150, 333], group * num_kv_heads, num_kv_heads, head_dim, page_size, dtype, num_kv_splits=4)


ONE_BYTE = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


def one_byte(buffer: torch.Tensor, kv_dtype: torch.dtype):
    """`buffer` as a one-byte pool stores it (`TokenToKVPool.set_kv_buffer`'s rounding):
    (stored, scale or None, the float32 values the stored bytes stand for)."""
    if kv_dtype != torch.int8:
        stored = buffer.float().to(kv_dtype)
        return stored, None, stored.float()
    scale = (buffer.float().abs().amax(dim=-1) / 127).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    stored = torch.round(buffer.float() / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return stored, scale, stored.float() * scale.float()[..., None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_dtype", ONE_BYTE, ids=str)
def test_one_byte_pools_read_in_place(kv_dtype, dtype):
    """Decode and extend over an fp8 / int8 pool, widened in the kernel: equal the reference
    over the widened values (the same tolerance as a pool of q's dtype)."""
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = make_paged_pool(
        [40, 0, 129], [5, 17, 1], 2, 64, 16, dtype)
    (k8, k_scale, k_wide), (v8, v_scale, v_wide) = (one_byte(b.cpu(), kv_dtype) for b in (k_buffer, v_buffer))
    k8, v8, k_wide, v_wide = (t.to(DEVICE) for t in (k8, v8, k_wide, v_wide))
    scales = None if k_scale is None else (k_scale.to(DEVICE), v_scale.to(DEVICE))
    gen = torch.Generator().manual_seed(3)
    prefix, extend = torch.tensor([40, 0, 129], device=DEVICE), torch.tensor([5, 17, 1], device=DEVICE)
    q = torch.randn(23, 6, 64, generator=gen).to(dtype).to(DEVICE)
    out = extend_attention(q, k8, v8, req_to_token, req_pool_indices, seq_lens, prefix, extend, 0.125,
                           kv_scales=scales)
    want = reference.extend_attention(q.float(), k_wide, v_wide, req_to_token, req_pool_indices, seq_lens, prefix,
                                      extend, 0.125)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    q = torch.randn(3, 6, 64, generator=gen).to(dtype).to(DEVICE)
    out = decode_attention(q, k8, v8, req_to_token, req_pool_indices, seq_lens, 0.125, 30, kv_scales=scales,
                           num_kv_splits=2)
    want = reference.decode_attention(q.float(), k_wide, v_wide, req_to_token, req_pool_indices, seq_lens, 0.125, 30)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_every_fp8_byte_widens_as_torch_does(kv_dtype):
    """All 256 bit patterns (subnormals, the largest values, inf, NaN) as V rows of one-key
    requests in float32: each output row is its V row as torch's `.float()` widens it."""
    rows, head_dim = 4, 64
    v8 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(rows, 1, head_dim).view(kv_dtype)
    k8 = torch.zeros_like(v8)  # keys 0: a finite score, so the one probability is exactly 1
    req_to_token = torch.arange(rows, dtype=torch.int32).view(rows, 1)
    q = torch.ones(rows, 1, head_dim)
    lens = torch.ones(rows, dtype=torch.int64)
    tensors = [t.to(DEVICE) for t in (q, k8, v8, req_to_token, torch.arange(rows), lens)]
    out = decode_attention(*tensors, 1.0)
    torch.testing.assert_close(out.cpu(), v8.float(), atol=0, rtol=0, equal_nan=True)


def test_int8_pool_needs_its_scales():
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = make_paged_pool([3], [1], 2, 64, 1, torch.float32)
    k8, k_scale, _ = one_byte(k_buffer.cpu(), torch.int8)
    q = torch.randn(1, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="kv_scales"):
        decode_attention(q, k8.to(DEVICE), k8.to(DEVICE), req_to_token, req_pool_indices, seq_lens, 0.125)
    with pytest.raises(ValueError, match="kv_scales"):
        decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, 0.125,
                         kv_scales=(k_scale, k_scale))


def test_bad_layout_is_a_clear_error():
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = make_paged_pool([3], [1], 2, 64, 1, torch.float32)
    q = torch.randn(1, 64, 2, device=DEVICE).transpose(1, 2)  # last dim strided
    with pytest.raises(ValueError, match="contiguous last dimension"):
        decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, 0.125)


def test_model_gives_the_same_tokens_on_triton_and_torch(tiny_llama_dir):
    """The whole model through the Triton backend: same greedy tokens and logits as
    the torch CPU path, over an extend with ragged prompts and decode steps."""
    from arborlm.runtime.model_loader import load_model
    from tests.runtime.model_helpers import ModelHarness

    prompts = [[1, 4, 9, 16, 25, 36, 49], [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41], [100]]
    outputs = {}
    for backend in ("torch", "triton"):
        loaded = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"), backend)
        harness = ModelHarness(loaded.model, loaded.hf_config)
        outputs[backend] = harness.greedy(prompts, 6)
        first = ModelHarness(loaded.model, loaded.hf_config)
        outputs[backend + "_logits"] = first.extend([first.new_req() for _ in prompts], prompts).next_token_logits
    assert outputs["triton"] == outputs["torch"]
    torch.testing.assert_close(outputs["triton_logits"], outputs["torch_logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_model_over_a_one_byte_pool_on_triton_and_torch(tiny_llama_dir, kv_cache_dtype):
    """`kv_cache_dtype` with `attention_backend="triton"` keeps the Triton backend (its
    kernels widen the pool's bytes) and gives the torch path's logits over the same pool
    (prompt and teacher-forced decode steps) within float32 rounding."""
    from arborlm.radix_cache.memory_pool import KV_CACHE_DTYPES
    from arborlm.runtime.layers.attention.triton_backend import TritonAttentionBackend
    from arborlm.runtime.model_loader import load_model
    from tests.runtime.model_helpers import ModelHarness

    prompts = [[1, 4, 9, 16, 25, 36, 49], [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41], [100]]
    logits, tokens = {}, None
    for backend in ("torch", "triton"):
        loaded = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"), backend,
                            kv_cache_dtype=kv_cache_dtype)
        backends = {type(getattr(m, "backend", None)) for m in loaded.model.modules()} - {type(None)}
        assert (backends == {TritonAttentionBackend}) == (backend == "triton")
        harness = ModelHarness(loaded.model, loaded.hf_config, dtype=KV_CACHE_DTYPES[kv_cache_dtype])
        tokens = tokens or harness.greedy(prompts, 4)
        harness = ModelHarness(loaded.model, loaded.hf_config, dtype=KV_CACHE_DTYPES[kv_cache_dtype])
        rows = [harness.new_req() for _ in prompts]
        steps = [harness.extend(rows, prompts).next_token_logits]
        for i in range(3):
            steps.append(harness.decode(rows, [t[i] for t in tokens]).next_token_logits)
        logits[backend] = torch.cat(steps)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
