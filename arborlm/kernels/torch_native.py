"""Fast torch attention over the paged KV layout: the CPU serving path.

Same masking and results as `reference.py` (the oracle it is tested against), but
the work that depends only on the step — which pool rows each request reads, the
padding and causal masks — is done once per step in `build_metadata`, not once per
layer. On the CPU decode attention is bound by memory traffic (the K/V of every
request, ~10 MB a layer at batch 64), so each layer touches each K/V row as few
times as it can:

- decode: K is gathered once as `(batch, max_len, kv_heads * head_dim)` and
  scored with one `bmm` against a block-diagonal q (no `repeat_kv`); scores are
  rounded to q's dtype by the `bmm` (as Hugging Face's eager attention does),
  softmax runs in float32. V is never gathered: `embedding_bag` sums the pool's V
  rows weighted by the probabilities straight from the pool.
- extend: K/V are gathered into a padded block and attended with
  `scaled_dot_product_attention` under a precomputed boolean mask.
- mixed extend (decode tokens riding along a prefill, or a jump-forward step):
  the one-token requests take the decode path and only the others are padded,
  so a long prompt does not pad every decoding request to its length.

Masking follows SGLang / Hugging Face: a query at position `p` sees keys at
positions `<= p`, and with `sliding_window = w` only those `> p - w`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from arborlm.kernels.reference import attend


@dataclass
class DecodeMetadata:
    """Per-step gather indices and mask of a DECODE step.

    Attributes
    ----------
    batch_size, max_len, num_kv_heads: K is gathered as `(batch_size, max_len,
        num_kv_heads * head_dim)`.
    slots: (batch_size, max_len) int64 pool slots of each request's keys; 0 (the
        padding slot) past its seq_len.
    seq_lens: (batch_size,) int64.
    """

    batch_size: int
    max_len: int
    num_kv_heads: int
    slots: torch.Tensor
    seq_lens: torch.Tensor
    _bias: dict = field(default_factory=dict)
    _value_rows: dict = field(default_factory=dict)
    _eye: dict = field(default_factory=dict)

    def head_selector(self, dtype: torch.dtype) -> torch.Tensor:
        """(num_kv_heads, 1, num_kv_heads, 1) identity in `dtype`, built once per step, not per layer."""
        if dtype not in self._eye:
            eye = torch.eye(self.num_kv_heads, dtype=dtype, device=self.slots.device)
            self._eye[dtype] = eye[:, None, :, None]
        return self._eye[dtype]

    def value_rows(self, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of a layer's `v_buffer.view(-1, head_dim)` read by each (request, q head).

        Returns `(rows, offsets)`: rows (batch * num_q_heads * max_len,) int64,
        `slot * num_kv_heads + h // group` ordered (request, q head, position);
        offsets (batch * num_q_heads,) int64, where each (request, q head) starts.
        """
        if num_q_heads not in self._value_rows:
            kv_head = torch.arange(num_q_heads, device=self.slots.device) // (num_q_heads // self.num_kv_heads)
            rows = (self.slots[:, None, :] * self.num_kv_heads + kv_head[None, :, None]).view(-1)
            offsets = torch.arange(0, rows.numel(), self.max_len, device=rows.device)
            self._value_rows[num_q_heads] = rows, offsets
        return self._value_rows[num_q_heads]

    def key_bias(self, sliding_window: int | None) -> torch.Tensor:
        """(batch, 1, max_len) float32: 0 where the key is attended, -inf elsewhere."""
        if sliding_window not in self._bias:
            k_pos = torch.arange(self.max_len, device=self.seq_lens.device)[None, :]
            allowed = k_pos < self.seq_lens[:, None]
            if sliding_window is not None:
                allowed &= k_pos > (self.seq_lens[:, None] - 1 - sliding_window)
            bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
            self._bias[sliding_window] = bias.masked_fill_(~allowed, float("-inf"))[:, None, :]
        return self._bias[sliding_window]


@dataclass
class ExtendMetadata:
    """Per-step gather indices and masks of an EXTEND step.

    Attributes
    ----------
    batch_size, max_new, max_len: the padded query block is `(batch, max_new)`,
        the key block `(batch, max_len)`.
    token_pos: (num_tokens,) int64, each new token's row in the flattened
        `(batch * max_new)` query block.
    slots: (batch * max_len,) int64 pool slots of each request's keys; 0 for padding.
    key_valid: (batch, max_len) bool.
    q_pos: (batch, max_new) int64 absolute positions of the padded queries.
    """

    batch_size: int
    max_new: int
    max_len: int
    token_pos: torch.Tensor
    slots: torch.Tensor
    key_valid: torch.Tensor
    q_pos: torch.Tensor
    _mask: dict = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """(batch, 1, max_new, max_len) bool, True = attend."""
        if sliding_window not in self._mask:
            k_pos = torch.arange(self.max_len, device=self.slots.device)[None, None, :]
            q_pos = self.q_pos[:, :, None]
            allowed = self.key_valid[:, None, :] & (k_pos <= q_pos)
            if sliding_window is not None:
                allowed &= k_pos > q_pos - sliding_window
            self._mask[sliding_window] = allowed[:, None]
        return self._mask[sliding_window]


def build_decode_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    num_kv_heads: int,
) -> DecodeMetadata:
    """Gather rows and mask inputs of a DECODE step (shapes as in `reference.decode_attention`)."""
    device = seq_lens.device
    valid = torch.arange(max_len, device=device)[None, :] < seq_lens[:, None]
    slots = req_to_token[req_pool_indices, :max_len].to(torch.int64).masked_fill_(~valid, 0)  # (B, L)
    return DecodeMetadata(int(seq_lens.shape[0]), max_len, num_kv_heads, slots, seq_lens)


def build_extend_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    max_new: int,
    max_len: int,
) -> ExtendMetadata:
    """Padding positions and key slots of an EXTEND step (shapes as in `reference.extend_attention`)."""
    device = seq_lens.device
    batch = int(req_pool_indices.shape[0])
    num_tokens = int(extend_seq_lens.sum())
    token_req = torch.repeat_interleave(torch.arange(batch, device=device), extend_seq_lens)
    starts = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens
    token_pos = torch.arange(num_tokens, device=device) - starts[token_req] + token_req * max_new
    key_valid = torch.arange(max_len, device=device)[None, :] < seq_lens[:, None]
    slots = req_to_token[req_pool_indices, :max_len].to(torch.int64).masked_fill_(~key_valid, 0)
    q_pos = extend_prefix_lens[:, None] + torch.arange(max_new, device=device)
    return ExtendMetadata(batch, max_new, max_len, token_pos, slots.view(-1), key_valid, q_pos)


@dataclass
class MixedMetadata:
    """An EXTEND step that holds both one-token requests and longer ones.

    The one-token requests (decode tokens riding along a prefill) attend through
    `decode_attention`, the others through `extend_attention`; padding the one-token
    requests to the longest chunk would cost `max_new` times their attention.

    Attributes
    ----------
    single_rows: (n1,) int64 rows of the step's q (num_tokens, ...) of the one-token requests.
    multi_rows: (n2,) int64 rows of the other requests' tokens, in order.
    decode: `DecodeMetadata` over the one-token requests.
    extend: `ExtendMetadata` over the others.
    """

    single_rows: torch.Tensor
    multi_rows: torch.Tensor
    decode: DecodeMetadata
    extend: ExtendMetadata


def build_extend_step_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_seq_lens_cpu: list[int],
    seq_lens_cpu: list[int],
    num_kv_heads: int,
) -> ExtendMetadata | MixedMetadata:
    """Metadata of an EXTEND step: `MixedMetadata` when it mixes one-token and longer requests.

    Shapes as in `build_extend_metadata`; `*_cpu` are the same lengths as Python lists.
    """
    single = [i for i, n in enumerate(extend_seq_lens_cpu) if n == 1]
    multi = [i for i, n in enumerate(extend_seq_lens_cpu) if n != 1]
    if not single or not multi:
        return build_extend_metadata(
            req_to_token, req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
            max(extend_seq_lens_cpu), max(seq_lens_cpu),
        )
    device = seq_lens.device
    starts, rows_of = 0, []
    for n in extend_seq_lens_cpu:
        rows_of.append(range(starts, starts + n))
        starts += n
    single_rows = torch.tensor([rows_of[i].start for i in single], dtype=torch.int64, device=device)
    multi_rows = torch.tensor([r for i in multi for r in rows_of[i]], dtype=torch.int64, device=device)
    s_idx = torch.tensor(single, dtype=torch.int64, device=device)
    m_idx = torch.tensor(multi, dtype=torch.int64, device=device)
    decode = build_decode_metadata(
        req_to_token, req_pool_indices[s_idx], seq_lens[s_idx], max(seq_lens_cpu[i] for i in single), num_kv_heads
    )
    extend = build_extend_metadata(
        req_to_token, req_pool_indices[m_idx], seq_lens[m_idx], extend_prefix_lens[m_idx], extend_seq_lens[m_idx],
        max(extend_seq_lens_cpu[i] for i in multi), max(seq_lens_cpu[i] for i in multi),
    )
    return MixedMetadata(single_rows, multi_rows, decode, extend)


def mixed_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    metadata: MixedMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """`extend_attention` of a step with both one-token and longer requests (see `MixedMetadata`).

    q: (num_tokens, num_q_heads, head_dim); returns the same shape in q's dtype.
    """
    out = torch.empty_like(q)
    q_single = q.index_select(0, metadata.single_rows)
    single = decode_attention(q_single, k_buffer, v_buffer, metadata.decode, scale, sliding_window, logit_cap)
    multi = extend_attention(
        q.index_select(0, metadata.multi_rows), k_buffer, v_buffer, metadata.extend, scale, sliding_window, logit_cap
    )
    out.index_copy_(0, metadata.single_rows, single)
    out.index_copy_(0, metadata.multi_rows, multi)
    return out


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    metadata: DecodeMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """`reference.decode_attention` with the step's indices precomputed.

    Parameters
    ----------
    q: (batch, num_q_heads, head_dim).
    k_buffer, v_buffer: (slots, num_kv_heads, head_dim), one contiguous layer of the pool.
    metadata: from `build_decode_metadata` for this step.
    scale, sliding_window, logit_cap: as in `reference.decode_attention`.

    Returns
    -------
    (batch, num_q_heads, head_dim) tensor in q's dtype.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, max_len = metadata.num_kv_heads, metadata.max_len
    group = num_q_heads // num_kv_heads
    row = num_kv_heads * head_dim
    k = k_buffer.view(-1, row).index_select(0, metadata.slots.view(-1)).view(batch, max_len, row)
    # Block-diagonal q: head h keeps only the columns of its KV head h // group, so one
    # bmm against all KV heads of a request gives every head's scores (num_kv_heads times
    # the flops of per-head bmms, but one well-shaped GEMM per request and no K copy per head).
    eye = metadata.head_selector(k.dtype)  # (Hkv, 1, Hkv, 1)
    qe = (q.reshape(batch, num_kv_heads, group, 1, head_dim).to(k.dtype) * eye).view(batch, num_q_heads, row)
    scores = torch.bmm(qe, k.transpose(1, 2))  # (B, Hq, L) in k's dtype
    bias = metadata.key_bias(sliding_window)  # (B, 1, L)
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores.float() * (scale / logit_cap)) + bias
    else:
        scores = torch.add(bias, scores, alpha=scale)  # float32
    probs = torch.softmax(scores, dim=-1).to(v_buffer.dtype)
    # probs @ V without gathering V: embedding_bag sums the pool rows of each
    # (request, q head) weighted by its probabilities; padding rows weigh 0.
    v_rows, v_offsets = metadata.value_rows(num_q_heads)
    o = F.embedding_bag(
        v_rows, v_buffer.view(-1, head_dim), v_offsets, mode="sum", per_sample_weights=probs.view(-1)
    )  # (B * Hq, D)
    return o.view(batch, num_q_heads, head_dim).to(q.dtype)


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    metadata: ExtendMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """`reference.extend_attention` with the step's indices and masks precomputed.

    Parameters
    ----------
    q: (num_tokens, num_q_heads, head_dim), new tokens request after request.
    k_buffer, v_buffer: (slots, num_kv_heads, head_dim), one layer of the pool,
        already holding the new tokens' K/V.
    metadata: from `build_extend_metadata` for this step.
    scale, sliding_window, logit_cap: as in `reference.extend_attention`.

    Returns
    -------
    (num_tokens, num_q_heads, head_dim) tensor in q's dtype.
    """
    batch, max_new, max_len = metadata.batch_size, metadata.max_new, metadata.max_len
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    q_pad = q.new_zeros((batch * max_new, num_q_heads, head_dim))
    q_pad.index_copy_(0, metadata.token_pos, q)
    q_pad = q_pad.view(batch, max_new, num_q_heads, head_dim).transpose(1, 2)  # (B, Hq, Lq, D)
    shape = (batch, max_len) + tuple(k_buffer.shape[1:])
    k = k_buffer.index_select(0, metadata.slots).view(shape).transpose(1, 2)  # (B, Hkv, Lk, D)
    v = v_buffer.index_select(0, metadata.slots).view(shape).transpose(1, 2)
    o = attend(q_pad, k, v, metadata.mask(sliding_window), scale, logit_cap)  # (B, Hq, Lq, D)
    o = o.transpose(1, 2).reshape(batch * max_new, num_q_heads, head_dim)
    return o.index_select(0, metadata.token_pos)
