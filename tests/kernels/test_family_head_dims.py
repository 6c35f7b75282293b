"""Attention features the model families need, on every kernel, against `kernels/reference.py`.

Head dims of the families (Phi-3-mini 96, Gemma 3 256, Phi-2-style 80, beside the common 64 /
128 the other kernel tests sweep), each with the per-layer sliding window (Gemma 3, Mistral,
Phi-3) and the attention soft-cap (Gemma 2-style `logit_cap`), one case per combination:

- the native CPU decode kernel (`cpu_ops.decode_attention`, C++), float32 and bfloat16;
- the native rotary kernel at those head dims (Gemma 3's 256 rotates whole heads);
- the torch serving path (`torch_native`), extend and decode;
- the Triton kernels in the interpreter (`TRITON_INTERPRET=1`, as `test_triton_attention`
  runs them on a CPU machine), extend and decode at head dim 256, which that file does not sweep.
"""

from __future__ import annotations

import os

# Read when `@triton.jit` runs: before any kernel module is imported (as test_triton_attention).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from arborlm.kernels import reference, torch_native  # noqa: E402
from arborlm.kernels.cpu_ops import LayerOps, NativeLayerOps  # noqa: E402
from tests.kernels.test_cpu_ops import assert_decode_matches_reference, decode_case, rotary_case  # noqa: E402
from tests.kernels.test_reference import make_pool  # noqa: E402

FAMILY_HEAD_DIMS = [80, 96, 256]
FEATURES = [(None, 0.0), (7, 0.0), (None, 30.0), (7, 30.0)]  # (sliding_window, logit_cap)
FEATURE_IDS = ["plain", "window", "softcap", "window+softcap"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops(native_lib) -> NativeLayerOps:
    return NativeLayerOps(native_lib)


@pytest.mark.parametrize(("sliding_window", "logit_cap"), FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize("head_dim", FAMILY_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_decode_matches_reference(ops, dtype, head_dim, sliding_window, logit_cap):
    case = decode_case([1, 17, 60, 9], 2, 3, head_dim, dtype)
    assert_decode_matches_reference(ops, case, sliding_window, logit_cap)


@pytest.mark.parametrize("head_dim", FAMILY_HEAD_DIMS)
def test_native_rotary_matches_torch(ops, head_dim):
    qkv, step = rotary_case(33, head_dim, torch.float32)
    qk = qkv[:, :8 * head_dim].view(33, 8, head_dim)
    expected = LayerOps().rotary_(qk.clone(), step)
    torch.testing.assert_close(ops.rotary_(qk, step), expected, atol=0, rtol=0)


def _extend_inputs(head_dim, dtype, prefix_lens=(20, 0, 5), extend_lens=(10, 13, 6), num_q_heads=6, num_kv_heads=2):
    k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens = make_pool(
        list(prefix_lens), list(extend_lens), num_kv_heads, head_dim
    )
    q = torch.randn(sum(extend_lens), num_q_heads, head_dim, generator=torch.Generator().manual_seed(3))
    return (q.to(dtype), k_buffer.to(dtype), v_buffer.to(dtype), req_to_token, req_pool_indices, seq_lens,
            torch.tensor(prefix_lens), torch.tensor(extend_lens))


@pytest.mark.parametrize(("sliding_window", "logit_cap"), FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize("head_dim", FAMILY_HEAD_DIMS)
def test_torch_native_extend_matches_reference(head_dim, sliding_window, logit_cap):
    q, k, v, req_to_token, req_pool_indices, seq_lens, prefix, new = _extend_inputs(head_dim, torch.float32)
    scale = head_dim**-0.5
    expected = reference.extend_attention(
        q, k, v, req_to_token, req_pool_indices, seq_lens, prefix, new, scale, sliding_window, logit_cap
    )
    metadata = torch_native.build_extend_metadata(
        req_to_token, req_pool_indices, seq_lens, prefix, new, int(new.max()), int(seq_lens.max())
    )
    out = torch_native.extend_attention(q, k, v, metadata, scale, sliding_window, logit_cap)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize(("sliding_window", "logit_cap"), FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize("head_dim", FAMILY_HEAD_DIMS)
def test_torch_native_decode_matches_reference(head_dim, sliding_window, logit_cap):
    k, v, req_to_token, req_pool_indices, seq_lens = make_pool([40, 3, 17], [1, 1, 1], 2, head_dim)
    q = torch.randn(3, 6, head_dim, generator=torch.Generator().manual_seed(4))
    scale = head_dim**-0.5
    expected = reference.decode_attention(q, k, v, req_to_token, req_pool_indices, seq_lens, scale,
                                          sliding_window, logit_cap)
    metadata = torch_native.build_decode_metadata(req_to_token, req_pool_indices, seq_lens, int(seq_lens.max()), 2)
    out = torch_native.decode_attention(q, k, v, metadata, scale, sliding_window, logit_cap)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.fixture(scope="module")
def triton_attention():
    """test_triton_attention's checks, run as it runs them (the interpreter on a CPU machine)."""
    pytest.importorskip("triton")
    from tests.kernels import test_triton_attention

    return test_triton_attention


@pytest.mark.parametrize(("sliding_window", "logit_cap"), [(None, 0.0), (9, 30.0)], ids=["plain", "window+softcap"])
def test_triton_extend_at_head_dim_256(triton_attention, sliding_window, logit_cap):
    triton_attention.check_extend([0, 20], [9, 6], 4, 2, 256, 1, torch.float32, sliding_window, logit_cap, (16, 16))


@pytest.mark.parametrize(("sliding_window", "logit_cap"), [(None, 0.0), (9, 30.0)], ids=["plain", "window+softcap"])
def test_triton_decode_at_head_dim_256(triton_attention, sliding_window, logit_cap):
    triton_attention.check_decode([30, 5], 4, 2, 256, 1, torch.float32, sliding_window, logit_cap, 2)
