// One Llama-family decoder layer of a decode step as one native call (issue 25).
//
// Why: at a few rows a decode step of a small model spends several milliseconds in
// the ~10 kernel calls per layer around the matrix products (each a ctypes call,
// a fresh tensor and Python glue: norms, rotary, views, SiLU-and-mul). This entry
// runs the whole layer from C++ over scratch buffers the caller allocated once:
//
//   residual += x; h = rms_norm(residual)           (first layer: residual = x)
//   qkv = h Wqkv^T (+ b); rotary on q and k heads in place
//   store k, v at out_cache_loc; o = decode attention over the paged pool
//   a = o Wo^T (+ b); residual += a; h = rms_norm(residual)
//   g = h Wgate_up^T (+ b); s = silu(gate) * up; out = s Wdown^T (+ b)
//
// Each step calls the same exported kernels the unfused path calls through
// ctypes (`cpu_kernels.cpp`: `arborlm_rms_norm`, `arborlm_rotary`,
// `arborlm_decode_attention`, `arborlm_silu_and_mul`, `arborlm_linear_bf16` on
// AMX; `linear_bf16_avx512.cpp`: `arborlm_linear_bf16_avx512`), in the same
// order on the same inputs, so bf16 outputs are the unfused native path's bit
// for bit. The library is built from those two sources plus this one. float32
// linear layers, which the unfused path hands to torch (MKL), take the row-dot
// kernel below: the same products in another summation order (within float32
// rounding of them, not bit-identical). Quantized linears (GGUF blocks, int8 /
// int4 weight-only, all packed by `kernels/quant_layout.py`) call
// `quant_linear.cpp`'s `arborlm_quant_linear`, as the unfused path does through
// `quant_ops.NativeQuantOps.linear`: it quantizes the activation rows per block of
// 32 into its thread's scratch (kept between calls), then streams the weight once,
// so those layers' outputs are bit for bit the unfused path's too.
//
// Plain C ABI over raw pointers (`kernels/fused_decoder_layer.py` fills the
// structs with ctypes). Row strides are in elements; every buffer has
// contiguous rows.

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

extern "C" {
void arborlm_rms_norm(int dtype, const void* x, int64_t x_stride, void* residual, int64_t res_stride,
                      const void* weight, void* out, int64_t out_stride, int64_t rows, int64_t dim, float eps);
void arborlm_silu_and_mul(int dtype, const void* gate_up, int64_t in_stride, void* out, int64_t out_stride,
                          int64_t rows, int64_t dim);
void arborlm_rotary(int dtype, void* x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t head_dim,
                    const int64_t* positions, const void* cos_table, const void* sin_table);
void arborlm_decode_attention(int dtype, int kv_dtype, const void* q, int64_t q_stride, const void* k_buffer,
                              const void* v_buffer, const void* k_scale, const void* v_scale,
                              const int32_t* req_to_token, int64_t req_to_token_stride,
                              const int64_t* req_pool_indices, const int64_t* seq_lens, int64_t batch,
                              int64_t q_heads, int64_t kv_heads, int64_t head_dim, float scale, int64_t window,
                              float logit_cap, void* out, int64_t out_stride, const void* k_new, int64_t k_stride,
                              const void* v_new, int64_t v_stride, const int64_t* out_cache_loc);
void arborlm_store_kv_int8(int dtype, const void* k_new, int64_t k_stride, const void* v_new, int64_t v_stride,
                           const int64_t* loc, int64_t tokens, int64_t kv_heads, int64_t head_dim, void* k_buffer,
                           void* v_buffer, void* k_scale, void* v_scale);
void arborlm_linear_bf16(const void* x, int64_t x_stride, int64_t rows, int64_t in_features, const void* packed,
                         int64_t out_features, const void* bias, void* out, int64_t out_stride);
void arborlm_linear_bf16_avx512(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t K, int64_t k_block,
                                const uint16_t* packed, int64_t N, const uint16_t* bias, uint16_t* out,
                                int64_t out_stride);
int arborlm_quant_linear(const void* x, int64_t ldx, int dtype, int64_t M, int64_t K, int64_t num_parts,
                         const int32_t* fmts, const uint64_t* ptrs, const int64_t* Ns, const void* bias, void* out,
                         int64_t ldo);
}

namespace {

// How a linear layer's weight is stored (`FusedLinear.kind`).
constexpr int64_t kBf16Avx512 = 0;  // `linear_avx512.Avx512Weight.data`
constexpr int64_t kBf16Amx = 1;     // `cpu_ops.AmxWeight.data`
constexpr int64_t kFloat32 = 2;     // the (out, in) float32 weight itself, rows contiguous
constexpr int64_t kQuant = 3;       // a `FusedQuantParts` (either dtype)
constexpr int kKvInt8 = 4;  // `cpu_kernels.cpp`'s KV code of an int8 pool with fp16 scales
constexpr int32_t kNumQuantFormats = 6;  // quant_layout.h's `Format` codes are 0..5

// Minimum weight elements before the float32 kernel wakes the OpenMP threads.
constexpr int64_t kParallelWeights = 1 << 15;

}  // namespace

extern "C" {

// One linear layer of the layer: y = x W^T (+ bias).
struct FusedLinear {
  const void* weight;
  const void* bias;  // out_features in the layer's dtype, or null
  int64_t kind;
  int64_t out_features;
  int64_t in_features;
  int64_t k_block;  // kBf16Avx512 only: `Avx512Weight.k_block`
};

// A quantized weight (`kQuant`): `arborlm_quant_linear`'s arguments, parts stacked by rows.
struct FusedQuantParts {
  int64_t num_parts;
  const int32_t* fmts;   // (num_parts,) quant_layout.h format codes
  const uint64_t* ptrs;  // (6 num_parts,) each part's six array addresses
  const int64_t* Ns;     // (num_parts,) rows of each part
};

// What is fixed for one layer (filled once, `fused_decoder_layer.LayerParams`).
struct FusedLayerParams {
  int64_t dtype;  // 0 = float32, 1 = bfloat16
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  int64_t layer_id;
  int64_t window;  // sliding window; <= 0: none
  float input_eps, post_eps, scale, logit_cap;
  const void* input_norm;
  const void* post_norm;
  FusedLinear qkv, o_proj, gate_up, down;
};

// What one decode step shares across layers (`fused_decoder_layer.StepParams`).
struct FusedStep {
  int64_t rows;  // one new token per request
  const int32_t* req_to_token;
  int64_t req_to_token_stride;
  const int64_t* req_pool_indices;
  const int64_t* seq_lens;  // after this step's token
  const int64_t* out_cache_loc;
  const int64_t* positions;
  const void* cos_table;  // (max_positions, head_dim), `rotate_half`'s sign in sin
  const void* sin_table;
  void* k_pool;  // (layers, slots, kv_heads, head_dim) contiguous
  void* v_pool;
  int64_t pool_layer_stride;  // elements between two layers of the pool
  int64_t kv_dtype;  // what the pool stores: the layer's dtype code, or kKvInt8 (with scales)
  void* k_scale;     // kKvInt8: (layers, slots, kv_heads) fp16 contiguous; else null
  void* v_scale;
  int64_t scale_layer_stride;  // elements between two layers of the scales
};

// Scratch rows (`fused_decoder_layer.DecodeScratch`), each (capacity, width) contiguous.
struct FusedScratch {
  void* normed;   // hidden
  void* qkv;      // (num_heads + 2 * num_kv_heads) * head_dim
  void* attn;     // num_heads * head_dim
  void* o;        // hidden
  void* gate_up;  // 2 * intermediate
  void* act;      // intermediate
};

}  // extern "C"

namespace {

// out[r, n] = sum_k x[r, k] w[n, k] (+ bias[n]) in float32, rows <= 8: each weight row
// is read once for all rows, 16 lanes per FMA, then one horizontal sum.
void linear_f32(const float* x, int64_t x_stride, int64_t rows, int64_t K, const float* w, int64_t N,
                const float* bias, float* out, int64_t out_stride) {
#pragma omp parallel for schedule(static) if (N * K >= kParallelWeights)
  for (int64_t n = 0; n < N; ++n) {
    const float* wn = w + n * K;
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      const int64_t nr = rows - r0 < 8 ? rows - r0 : 8;
      float sums[8];
      int64_t k = 0;
#if defined(__AVX512F__)
      __m512 acc[8];
      for (int64_t r = 0; r < nr; ++r) acc[r] = _mm512_setzero_ps();
      for (; k + 16 <= K; k += 16) {
        const __m512 wv = _mm512_loadu_ps(wn + k);
        for (int64_t r = 0; r < nr; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (r0 + r) * x_stride + k), wv, acc[r]);
      }
      for (int64_t r = 0; r < nr; ++r) sums[r] = _mm512_reduce_add_ps(acc[r]);
#else
      for (int64_t r = 0; r < nr; ++r) sums[r] = 0.f;
#endif
      for (; k < K; ++k)
        for (int64_t r = 0; r < nr; ++r) sums[r] += x[(r0 + r) * x_stride + k] * wn[k];
      for (int64_t r = 0; r < nr; ++r)
        out[(r0 + r) * out_stride + n] = bias ? sums[r] + static_cast<const float*>(bias)[n] : sums[r];
    }
  }
}

void linear(const FusedLinear& lin, int64_t dtype, const void* x, int64_t rows, void* out) {
  const int64_t K = lin.in_features, N = lin.out_features;
  if (lin.kind == kBf16Avx512)
    arborlm_linear_bf16_avx512(static_cast<const uint16_t*>(x), K, rows, K, lin.k_block,
                               static_cast<const uint16_t*>(lin.weight), N, static_cast<const uint16_t*>(lin.bias),
                               static_cast<uint16_t*>(out), N);
  else if (lin.kind == kBf16Amx)
    arborlm_linear_bf16(x, K, rows, K, lin.weight, N, lin.bias, out, N);
  else if (lin.kind == kFloat32 && dtype == 0)
    linear_f32(static_cast<const float*>(x), K, rows, K, static_cast<const float*>(lin.weight), N,
               static_cast<const float*>(lin.bias), static_cast<float*>(out), N);
  else if (lin.kind == kQuant) {
    const auto* q = static_cast<const FusedQuantParts*>(lin.weight);
    arborlm_quant_linear(x, K, static_cast<int>(dtype), rows, K, q->num_parts, q->fmts, q->ptrs, q->Ns, lin.bias,
                         out, N);
  }
}

// Whether every part of a quantized weight has a format the kernel knows (checked
// before anything is written, so `arborlm_quant_linear` cannot fail mid-layer).
bool quant_formats_known(const FusedLinear& lin) {
  const auto* q = static_cast<const FusedQuantParts*>(lin.weight);
  if (q == nullptr || q->num_parts <= 0) return false;
  for (int64_t p = 0; p < q->num_parts; ++p)
    if (q->fmts[p] < 0 || q->fmts[p] >= kNumQuantFormats) return false;
  return true;
}

int64_t element_bytes(int64_t dtype) { return dtype == 0 ? 4 : 2; }

// Whether every linear's kind is one the layer's dtype takes (and every quantized
// weight's format is known).
bool layer_kinds_ok(const FusedLayerParams& p) {
  const FusedLinear* linears[] = {&p.qkv, &p.o_proj, &p.gate_up, &p.down};
  for (const FusedLinear* lin : linears) {
    if (lin->kind == kQuant) {
      if (!quant_formats_known(*lin)) return false;
      continue;
    }
    const bool bf16_kind = lin->kind == kBf16Avx512 || lin->kind == kBf16Amx;
    if ((p.dtype == 1) != bf16_kind || (lin->kind == kFloat32 && p.dtype != 0)) return false;
  }
  return true;
}

// One layer whose kinds `layer_kinds_ok` accepted (see `arborlm_fused_decoder_layer`).
void run_layer(const FusedLayerParams* p, const FusedStep* step, const FusedScratch* s, const void* x,
               void* residual, int add_residual, void* out) {
  const int dtype = static_cast<int>(p->dtype);
  const int64_t rows = step->rows, H = p->hidden, D = p->head_dim;
  const int64_t q_size = p->num_heads * D, kv_size = p->num_kv_heads * D, qkv_width = q_size + 2 * kv_size;
  const int64_t bytes = element_bytes(p->dtype);
  if (add_residual)
    arborlm_rms_norm(dtype, x, H, residual, H, p->input_norm, s->normed, H, rows, H, p->input_eps);
  else
    arborlm_rms_norm(dtype, x, H, nullptr, 0, p->input_norm, s->normed, H, rows, H, p->input_eps);
  linear(p->qkv, p->dtype, s->normed, rows, s->qkv);
  // q and k heads are adjacent in each qkv row: one rotary pass over both.
  arborlm_rotary(dtype, s->qkv, qkv_width, rows, p->num_heads + p->num_kv_heads, D, step->positions, step->cos_table,
                 step->sin_table);
  char* qkv = static_cast<char*>(s->qkv);
  char* k_new = qkv + q_size * bytes;
  char* v_new = qkv + (q_size + kv_size) * bytes;
  if (step->kv_dtype == kKvInt8) {
    // An int8 pool: quantize the new K/V into it (as `TokenToKVPool.set_kv_buffer`),
    // then attend over it in place.
    const int64_t layer_offset = p->layer_id * step->pool_layer_stride;  // one byte per value
    char* k_pool = static_cast<char*>(step->k_pool) + layer_offset;
    char* v_pool = static_cast<char*>(step->v_pool) + layer_offset;
    uint16_t* k_scale = static_cast<uint16_t*>(step->k_scale) + p->layer_id * step->scale_layer_stride;
    uint16_t* v_scale = static_cast<uint16_t*>(step->v_scale) + p->layer_id * step->scale_layer_stride;
    arborlm_store_kv_int8(dtype, k_new, qkv_width, v_new, qkv_width, step->out_cache_loc, rows, p->num_kv_heads, D,
                          k_pool, v_pool, k_scale, v_scale);
    arborlm_decode_attention(dtype, kKvInt8, qkv, qkv_width, k_pool, v_pool, k_scale, v_scale, step->req_to_token,
                             step->req_to_token_stride, step->req_pool_indices, step->seq_lens, rows, p->num_heads,
                             p->num_kv_heads, D, p->scale, p->window, p->logit_cap, s->attn, q_size, nullptr, 0,
                             nullptr, 0, nullptr);
  } else {
    const int64_t layer_offset = p->layer_id * step->pool_layer_stride * bytes;
    arborlm_decode_attention(dtype, dtype, qkv, qkv_width, static_cast<char*>(step->k_pool) + layer_offset,
                             static_cast<char*>(step->v_pool) + layer_offset, nullptr, nullptr, step->req_to_token,
                             step->req_to_token_stride, step->req_pool_indices, step->seq_lens, rows, p->num_heads,
                             p->num_kv_heads, D, p->scale, p->window, p->logit_cap, s->attn, q_size, k_new,
                             qkv_width, v_new, qkv_width, step->out_cache_loc);
  }
  linear(p->o_proj, p->dtype, s->attn, rows, s->o);
  arborlm_rms_norm(dtype, s->o, H, residual, H, p->post_norm, s->normed, H, rows, H, p->post_eps);
  linear(p->gate_up, p->dtype, s->normed, rows, s->gate_up);
  arborlm_silu_and_mul(dtype, s->gate_up, 2 * p->intermediate, s->act, p->intermediate, rows, p->intermediate);
  linear(p->down, p->dtype, s->act, rows, out);
}

}  // namespace

extern "C" {

int arborlm_fused_layer_abi_version() { return 4; }

// One decoder layer of a decode step (see the top of the file). x, residual, out:
// (rows, hidden) contiguous rows. With add_residual 0 (the first layer) the residual
// stream starts as x: residual must then be x itself (normalised, not added).
// residual is updated in place; out may be x (x is read first). Returns 0, or -1
// for a linear layer whose kind the layer's dtype does not take or a quantized weight
// of an unknown format (nothing written).
int arborlm_fused_decoder_layer(const FusedLayerParams* p, const FusedStep* step, const FusedScratch* s,
                                const void* x, void* residual, int add_residual, void* out) {
  if (!layer_kinds_ok(*p)) return -1;
  run_layer(p, step, s, x, residual, add_residual, out);
  return 0;
}

// n decoder layers of one decode step in order, as n calls of the entry above where
// layer i + 1 reads layer i's output (in `out`): one call per step instead of one per
// layer saves the per-layer Python and ctypes work (~37 us a layer, bench_quant). x, residual,
// add_residual: the first layer's, as above; out: every layer's output, so the last
// one's at return (x may be out where add_residual is 1). Returns 0, or -1 when any layer's linears are
// refused (checked for all layers first: nothing written then).
int arborlm_fused_decoder_layers(const FusedLayerParams* const* layers, int64_t num_layers, const FusedStep* step,
                                 const FusedScratch* s, const void* x, void* residual, int add_residual, void* out) {
  for (int64_t i = 0; i < num_layers; ++i)
    if (!layer_kinds_ok(*layers[i])) return -1;
  for (int64_t i = 0; i < num_layers; ++i)
    run_layer(layers[i], step, s, i == 0 ? x : out, residual, i == 0 ? add_residual : 1, out);
  return 0;
}

}  // extern "C"
