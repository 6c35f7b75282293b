// Fused CPU kernels for the decoder layer: RMSNorm (with the residual add),
// SiLU-and-mul, rotary embedding, paged decode attention, and (on CPUs with
// AMX) the bf16 linear layer for decode-sized batches.
//
// Why: on the CPU a decode step of a small model spends as long in ~40 small
// torch ops per layer (each a dispatch, an allocation and a pass over memory) as
// in its matrix products. These kernels do each group in one pass, in float32,
// rounding once to the tensor's dtype. The same fusions as vLLM's and SGLang's
// CPU kernels (`fused_add_rms_norm`, `silu_and_mul`, `rotary_embedding`,
// `decode_attention`); written here from the math, not copied.
//
// Plain C ABI over raw pointers, called through ctypes (`cpu_ops.py`), so the
// library builds in about a second with no torch headers. Dtype codes: 0 =
// float32, 1 = bfloat16. Row strides are in elements. OpenMP parallelises over
// rows/heads when the work is large enough to pay for waking the threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "fast_exp.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define ARBORLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch's `c10::BFloat16` does; NaN stays a quiet NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

// One-byte KV pool elements (`kv_cache_dtype`, `radix_cache/memory_pool.py`): fp8 as
// torch stores float8_e4m3fn / float8_e5m2, and int8 with an fp16 scale per (slot, KV
// head). The attention kernels read them in place and widen in registers.
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

// IEEE half to float32, exact (subnormals, inf and NaN included).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  float f;
  if (e == 0) {
    f = std::ldexp(static_cast<float>(m), -24);
  } else if (e == 31) {
    f = m ? NAN : INFINITY;
  } else {
    const uint32_t u = ((e + 112u) << 23) | (m << 13);
    std::memcpy(&f, &u, 4);
  }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u |= sign;
  std::memcpy(&f, &u, 4);
  return f;
}

// float32 to IEEE half, rounded to nearest even as torch's `.to(float16)` (overflow to
// inf, subnormals, NaN kept quiet).
inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00u;
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (u < 0x38800000u) {  // below 2^-14: a subnormal half, in steps of 2^-24 (exact scaling)
    float a;
    std::memcpy(&a, &u, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));
  }
  uint32_t r = u - (112u << 23);  // exponent bias 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

// float8_e4m3fn (bias 7, no infinities, 0x7f / 0xff NaN) to float32, exact: a normal
// value's exponent and mantissa move into float32's fields with the bias raised by 120;
// a subnormal is its 3-bit mantissa times 2^-9.
inline float fp8_e4m3_to_f32(uint8_t b) {
  const uint32_t m = b & 0x7fu;
  float f;
  if (m == 0x7fu) {
    f = NAN;
  } else if (m < 8u) {
    f = static_cast<float>(m) * 0.001953125f;
  } else {
    const uint32_t u = (m << 20) + (120u << 23);
    std::memcpy(&f, &u, 4);
  }
  return (b & 0x80u) ? -f : f;
}

// float8_e5m2 is the top byte of an IEEE half.
inline float fp8_e5m2_to_f32(uint8_t b) { return f16_to_f32(static_cast<uint16_t>(b << 8)); }

// All 256 values of a one-byte float format, for the scalar loads: a table read instead
// of the branches of a conversion per element (about 2x faster decode attention over an
// fp8 pool without AVX-512, bench_quant.py on an AVX2-only EPYC).
struct Fp8Table {
  float values[256];
  explicit Fp8Table(float (*widen)(uint8_t)) {
    for (int b = 0; b < 256; ++b) values[b] = widen(static_cast<uint8_t>(b));
  }
};

inline float load(const Fp8E4M3* p, int64_t i) {
  static const Fp8Table table(fp8_e4m3_to_f32);  // built once, thread-safe (C++11 statics)
  return table.values[p[i].bits];
}
inline float load(const Fp8E5M2* p, int64_t i) {
  static const Fp8Table table(fp8_e5m2_to_f32);
  return table.values[p[i].bits];
}
inline float load(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }

// Scale of row (slot, head) of a KV pool layer: an int8 pool's fp16 scale; 1 for the
// pools that store values as they are (float, bf16, fp8).
template <typename E>
inline float row_scale(const uint16_t* scales, int64_t slot, int64_t kv_heads, int64_t head) {
  if constexpr (std::is_same_v<E, int8_t>) return f16_to_f32(scales[slot * kv_heads + head]);
  (void)scales, (void)slot, (void)kv_heads, (void)head;
  return 1.f;
}

// Minimum elements per call before OpenMP threads are used.
constexpr int64_t kParallelWork = 1 << 15;

// Max and sum of s[lo, hi) in eight independent lanes (a single running max or sum is
// a chain of dependent operations: it took as long as the tile's products).
inline float range_max(const float* s, int64_t lo, int64_t hi) {
  float m = -INFINITY;
  int64_t j = lo;
#if defined(__AVX2__)
  if (hi - lo >= 8) {
    __m256 lanes = _mm256_loadu_ps(s + j);
    for (j += 8; j + 8 <= hi; j += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(s + j));
    alignas(32) float part[8];
    _mm256_store_ps(part, lanes);
    for (float v : part) m = v > m ? v : m;
  }
#endif
  for (; j < hi; ++j) m = s[j] > m ? s[j] : m;
  return m;
}

inline float range_sum(const float* s, int64_t lo, int64_t hi) {
  float total = 0.f;
  int64_t j = lo;
#if defined(__AVX2__)
  __m256 lanes = _mm256_setzero_ps();
  for (; j + 8 <= hi; j += 8) lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(s + j));
  alignas(32) float part[8];
  _mm256_store_ps(part, lanes);
  for (float v : part) total += v;
#endif
  for (; j < hi; ++j) total += s[j];
  return total;
}

#if defined(__AVX512F__)
// 16 lanes of float32; the loops below run them, then finish the row in scalar code.
constexpr int64_t kLanes = 16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// Round to nearest even, NaN kept quiet: `f32_to_bf16` on 16 lanes.
inline void store16(uint16_t* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

// 16 one-byte KV elements widened to float32 (the scalar `load`s above, in lanes).
inline __m128i load16_bytes(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m512 load16(const Fp8E5M2* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(load16_bytes(p)), 8));
}
inline __m512 load16(const Fp8E4M3* p) {
  const __m512i u = _mm512_cvtepu8_epi32(load16_bytes(p));
  const __m512i m = _mm512_and_si512(u, _mm512_set1_epi32(0x7f));
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(m, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0.001953125f));
  __m512 f = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(m, _mm512_set1_epi32(8)), normal, subnormal);
  f = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(m, _mm512_set1_epi32(0x7f)), f, _mm512_set1_ps(NAN));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}
inline __m512 load16(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16_bytes(p))); }

#else
constexpr int64_t kLanes = 0;  // no vector loops: scalar code only
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ---- 8 lanes of float32, for CPUs with AVX2 and no AVX-512 ----------------------
//
// The loops below take these where the AVX-512 ones do not build: without them every
// norm, SiLU, rotary and decode attention of an AVX2 CPU ran scalar code.
#define ARBORLM_AVX2_LANES 1

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m128i load8_bytes(const void* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline __m256 load8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8_bytes(p))); }
inline __m256 load8(const Fp8E5M2* p) { return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(load8_bytes(p)), 8)); }
inline __m256 load8(const Fp8E4M3* p) {  // `fp8_e4m3_to_f32` in lanes
  const __m256i u = _mm256_cvtepu8_epi32(load8_bytes(p));
  const __m256i m = _mm256_and_si256(u, _mm256_set1_epi32(0x7f));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(m, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0.001953125f));
  __m256 f = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), m)));
  f = _mm256_blendv_ps(f, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, _mm256_set1_epi32(0x7f))));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f), sign));
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// Round to nearest even, NaN kept quiet: `f32_to_bf16` on 8 lanes.
inline void store8(uint16_t* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  const __m256i hi = _mm256_srli_epi32(r, 16);  // 8 x 16 bits in the low halves of 32-bit lanes
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// `exp16` in 8 lanes (Cephes `expf`): 2^n applied as two halves in the exponent bits,
// so that n = 128 (x near the clamp's top) stays finite as `_mm512_scalef_ps` keeps it.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256 pow1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
  const __m256 pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, pow1), pow2);
}
#endif

// Vector loops cover [0, vector_end(n)); the scalar tail the rest.
inline int64_t vector_end(int64_t n) { return kLanes ? n - n % (kLanes ? kLanes : 1) : 0; }

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, T* residual, int64_t res_stride, const T* weight, T* out,
                   int64_t out_stride, int64_t rows, int64_t dim, float eps) {
  const int64_t vec = vector_end(dim);
#pragma omp parallel for if (rows * dim >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* outr = out + r * out_stride;
    T* resr = residual ? residual + r * res_stride : nullptr;
    // The residual stream keeps the model dtype: round the sum as torch's add does,
    // then normalise the rounded value.
    const T* src = xr;
    if (resr) {
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i < vec; i += kLanes) store16(resr + i, _mm512_add_ps(load16(xr + i), load16(resr + i)));
#elif defined(ARBORLM_AVX2_LANES)
      for (; i + 8 <= dim; i += 8) store8(resr + i, _mm256_add_ps(load8(xr + i), load8(resr + i)));
#endif
      for (; i < dim; ++i) store(resr, i, load(xr, i) + load(resr, i));
      src = resr;
    }
    float sum_sq = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i < vec; i += kLanes) {
      const __m512 v = load16(src + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    sum_sq = _mm512_reduce_add_ps(acc);
#elif defined(ARBORLM_AVX2_LANES)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= dim; i += 16) {
      const __m256 v0 = load8(src + i), v1 = load8(src + i + 8);
      acc0 = _mm256_fmadd_ps(v0, v0, acc0);
      acc1 = _mm256_fmadd_ps(v1, v1, acc1);
    }
    sum_sq = hsum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < dim; ++i) sum_sq += load(src, i) * load(src, i);
    const float rstd = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
    i = 0;
#if defined(__AVX512F__)
    const __m512 rstd16 = _mm512_set1_ps(rstd);
    for (; i < vec; i += kLanes)
      store16(outr + i, _mm512_mul_ps(_mm512_mul_ps(load16(src + i), rstd16), load16(weight + i)));
#elif defined(ARBORLM_AVX2_LANES)
    const __m256 rstd8 = _mm256_set1_ps(rstd);
    for (; i + 8 <= dim; i += 8)
      store8(outr + i, _mm256_mul_ps(_mm256_mul_ps(load8(src + i), rstd8), load8(weight + i)));
#endif
    for (; i < dim; ++i) store(outr, i, load(src, i) * rstd * load(weight, i));
  }
}

template <typename T>
void silu_and_mul_rows(const T* gate_up, int64_t in_stride, T* out, int64_t out_stride, int64_t rows,
                       int64_t dim) {
  const int64_t vec = vector_end(dim);
#pragma omp parallel for if (rows * dim >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * in_stride;
    const T* u = g + dim;
    T* o = out + r * out_stride;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i < vec; i += kLanes) {
      const __m512 gv = load16(g + i);
      const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      store16(o + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), load16(u + i)));
    }
#elif defined(ARBORLM_AVX2_LANES)
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= dim; i += 8) {
      const __m256 gv = load8(g + i);
      const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
      store8(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), load8(u + i)));
    }
#endif
    for (; i < dim; ++i) {
      const float gv = load(g, i);
      store(o, i, gv * (1.f / (1.f + fast_exp(-gv))) * load(u, i));
    }
  }
}

// x[t, h, :] = x * cos[pos] + roll(x, half) * signed_sin[pos] in place, for the
// (tokens, heads, head_dim) view at `x` with row stride `token_stride`.
template <typename T>
void rotary_rows(T* x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t head_dim,
                 const int64_t* positions, const T* cos_table, const T* sin_table) {
  const int64_t half = head_dim / 2;
  const int64_t vec = vector_end(half);
#pragma omp parallel for if (tokens * heads * head_dim >= kParallelWork)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos_table + positions[t] * head_dim;
    const T* s = sin_table + positions[t] * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + t * token_stride + h * head_dim;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i < vec; i += kLanes) {
        const __m512 a = load16(v + i), b = load16(v + i + half);
        const __m512 lo = _mm512_add_ps(_mm512_mul_ps(a, load16(c + i)), _mm512_mul_ps(b, load16(s + i)));
        const __m512 hi =
            _mm512_add_ps(_mm512_mul_ps(b, load16(c + i + half)), _mm512_mul_ps(a, load16(s + i + half)));
        store16(v + i, lo);
        store16(v + i + half, hi);
      }
#elif defined(ARBORLM_AVX2_LANES)
      for (; i + 8 <= half; i += 8) {
        const __m256 a = load8(v + i), b = load8(v + i + half);
        const __m256 lo = _mm256_add_ps(_mm256_mul_ps(a, load8(c + i)), _mm256_mul_ps(b, load8(s + i)));
        const __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, load8(c + i + half)), _mm256_mul_ps(a, load8(s + i + half)));
        store8(v + i, lo);
        store8(v + i + half, hi);
      }
#endif
      for (; i < half; ++i) {
        const float a = load(v, i), b = load(v, i + half);
        const float lo = a * load(c, i) + b * load(s, i);
        const float hi = b * load(c, i + half) + a * load(s, i + half);
        store(v, i, lo);
        store(v, i + half, hi);
      }
    }
  }
}

// Softmax over `len` float32 scores in place (max-subtracted); returns their
// log-sum-exp, max + log(sum of exp(s - max)), what merging split-K parts needs.
inline float softmax_inplace(float* sg, int64_t len) {
  float mx = -INFINITY;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 max16 = _mm512_set1_ps(-INFINITY);
  for (; t < vector_end(len); t += kLanes) max16 = _mm512_max_ps(max16, _mm512_loadu_ps(sg + t));
  mx = _mm512_reduce_max_ps(max16);
#endif
  for (; t < len; ++t) mx = sg[t] > mx ? sg[t] : mx;
  float denom = 0.f;
  t = 0;
#if defined(__AVX512F__)
  const __m512 mx16 = _mm512_set1_ps(mx);
  __m512 sum16 = _mm512_setzero_ps();
  for (; t < vector_end(len); t += kLanes) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mx16));
    _mm512_storeu_ps(sg + t, e);
    sum16 = _mm512_add_ps(sum16, e);
  }
  denom = _mm512_reduce_add_ps(sum16);
  if (t < len) {  // the tail's exps in lanes; its sum stays in order, as below
    const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1);
    _mm512_mask_storeu_ps(sg + t, tail, fast_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sg + t), mx16)));
    for (; t < len; ++t) denom += sg[t];
  }
#endif
  for (; t < len; ++t) {
    sg[t] = fast_exp(sg[t] - mx);
    denom += sg[t];
  }
  const float inv = 1.f / denom;
  for (t = 0; t < len; ++t) sg[t] *= inv;
  return mx + std::log(denom);
}

inline float capped(float dot, float scale, float logit_cap) {
  return logit_cap > 0.f ? logit_cap * std::tanh(dot * scale / logit_cap) : dot * scale;
}

#if defined(__AVX512F__)
// How many K/V rows ahead `decode_tile` prefetches.
constexpr int64_t kPrefetchRows = 8;

// Row `t` of one KV head in a pool layer: `buffer[slots[t], head, :]`, D elements.
// Also prefetches row t + kPrefetchRows: rows are found through `slots`, which the
// hardware prefetcher cannot follow.
template <typename E, int64_t D>
inline const E* pool_row(const E* buffer, const int32_t* slots, int64_t t, int64_t len, int64_t kv_heads,
                         int64_t head) {
  if (t + kPrefetchRows < len) {
    const char* ahead =
        reinterpret_cast<const char*>(buffer + (static_cast<int64_t>(slots[t + kPrefetchRows]) * kv_heads + head) * D);
    for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(E)); off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
  }
  return buffer + (static_cast<int64_t>(slots[t]) * kv_heads + head) * D;
}

// Decode attention of G query heads that share one KV head, head_dim = 16 * C:
// each K/V row is loaded once into C registers and used by all G heads, and the
// G * C output accumulators stay in registers (G * C <= 16 of the 32 zmm). K/V rows
// are of element type E, widened on load; an int8 row's scale multiplies its score
// (K) or its probability (V), once per row instead of once per element.
template <typename T, typename E, typename O, int C, int G>
void decode_tile(const T* q, const E* k_buffer, const E* v_buffer, const uint16_t* k_scale, const uint16_t* v_scale,
                 const int32_t* slots, int64_t len, int64_t kv_heads, int64_t head, float scale, float logit_cap,
                 O* out, float* lse, float* scores) {
  constexpr int64_t D = 16 * C;
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load16(q + g * D + c * 16);
  // The soft cap is decided once, outside the key loop: its `std::tanh` call inside the
  // loop made the compiler keep `qv` in memory (a call clobbers every zmm register) and
  // branch per score. The scores are the same products, rounded the same way.
  const auto score_keys = [&](auto has_cap) {
    for (int64_t t = 0; t < len; ++t) {
      const E* k = pool_row<E, D>(k_buffer, slots, t, len, kv_heads, head);
      const float ks = row_scale<E>(k_scale, slots[t], kv_heads, head);
      __m512 kr[C];
      for (int c = 0; c < C; ++c) kr[c] = load16(k + c * 16);
      for (int g = 0; g < G; ++g) {
        __m512 sum = _mm512_mul_ps(qv[g][0], kr[0]);
        for (int c = 1; c < C; ++c) sum = _mm512_fmadd_ps(qv[g][c], kr[c], sum);
        const float dot = _mm512_reduce_add_ps(sum) * ks;
        if constexpr (decltype(has_cap)::value) {
          scores[g * len + t] = capped(dot, scale, logit_cap);
        } else {
          scores[g * len + t] = dot * scale;
        }
      }
    }
  };
  if (logit_cap > 0.f) {
    score_keys(std::true_type{});
  } else {
    score_keys(std::false_type{});
  }
  for (int g = 0; g < G; ++g) {
    const float l = softmax_inplace(scores + g * len, len);
    if (lse != nullptr) lse[g] = l;
  }
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const E* v = pool_row<E, D>(v_buffer, slots, t, len, kv_heads, head);
    const float vs = row_scale<E>(v_scale, slots[t], kv_heads, head);
    __m512 vr[C];
    for (int c = 0; c < C; ++c) vr[c] = load16(v + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * len + t] * vs);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vr[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store16(out + g * D + c * 16, acc[g][c]);
}

// Run `decode_tile<T, E, O, C, G>` over the `group` query heads of one KV head, G at a time.
template <typename T, typename E, typename O, int C, int G>
void decode_tiles(const T* q, const E* k_buffer, const E* v_buffer, const uint16_t* k_scale, const uint16_t* v_scale,
                  const int32_t* slots, int64_t len, int64_t kv_heads, int64_t head, int64_t group, float scale,
                  float logit_cap, O* out, float* lse, float* scores) {
  constexpr int64_t D = 16 * C;
  for (int64_t g0 = 0; g0 < group; g0 += G)
    decode_tile<T, E, O, C, G>(q + (head * group + g0) * D, k_buffer, v_buffer, k_scale, v_scale, slots, len,
                               kv_heads, head, scale, logit_cap, out + (head * group + g0) * D,
                               lse == nullptr ? nullptr : lse + head * group + g0, scores);
}

// The register-tiled path for head_dim 64 or 128 and a group size it divides
// evenly; false when it does not apply (the caller takes the generic path).
template <typename T, typename E, typename O>
bool decode_tiled(const T* q, const E* k_buffer, const E* v_buffer, const uint16_t* k_scale, const uint16_t* v_scale,
                  const int32_t* slots, int64_t len, int64_t kv_heads, int64_t head, int64_t group, int64_t head_dim,
                  float scale, float logit_cap, O* out, float* lse, float* scores) {
  const auto run = [&](auto tiles) {
    tiles(q, k_buffer, v_buffer, k_scale, v_scale, slots, len, kv_heads, head, group, scale, logit_cap, out, lse,
          scores);
    return true;
  };
  if (head_dim == 64) {
    if (group % 4 == 0) return run(decode_tiles<T, E, O, 4, 4>);
    if (group % 3 == 0) return run(decode_tiles<T, E, O, 4, 3>);
    if (group % 2 == 0) return run(decode_tiles<T, E, O, 4, 2>);
    return run(decode_tiles<T, E, O, 4, 1>);
  }
  if (head_dim == 128) {
    if (group % 2 == 0) return run(decode_tiles<T, E, O, 8, 2>);
    return run(decode_tiles<T, E, O, 8, 1>);
  }
  return false;
}
#endif

#if defined(ARBORLM_AVX2_LANES)
// ---- decode attention on AVX2 (CPUs without AVX-512) --------------------------
//
// The AVX-512 loops above in 8 lanes: K rows widened to float32 once per group, dot
// products in 8-lane FMA chains, the softmax's max / exp / sum in lanes, probs @ V as
// one chain pair per (head, 8 dims). Without these every AVX2 decode step attended in
// scalar code (at 256 keys most of a quantized decode step's time).
// softmax over s[0, len) in place: max and sum in lanes, exp of the shifted scores.
// Returns the scores' log-sum-exp (as `softmax_inplace`).
inline float softmax_lanes(float* s, int64_t len) {
  const float mx = range_max(s, 0, len);
  for (int64_t t = 0; t < len; ++t) s[t] = exp_nonpositive(s[t] - mx);
  const float denom = range_sum(s, 0, len);
  const float inv = 1.f / denom;
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  return mx + std::log(denom);
}

// Row t of a pool layer (slot slots[t], KV head `head`, head_dim D), after prefetching
// row t + kPrefetchRowsAvx2: rows are found through `slots`, which the hardware
// prefetcher cannot follow; without it each row's first touch waited on memory (the
// score loop read K at ~3 GB/s on one thread of an AVX2 EPYC).
constexpr int64_t kPrefetchRowsAvx2 = 8;
template <typename E>
inline const E* pool_row_ahead(const E* buffer, const int32_t* slots, int64_t t, int64_t len, int64_t kv_heads,
                               int64_t head, int64_t D) {
  if (t + kPrefetchRowsAvx2 < len) {
    const char* ahead = reinterpret_cast<const char*>(
        buffer + (static_cast<int64_t>(slots[t + kPrefetchRowsAvx2]) * kv_heads + head) * D);
    for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(E)); off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
  }
  return buffer + (static_cast<int64_t>(slots[t]) * kv_heads + head) * D;
}

// probs @ V for G query heads and C * 8 columns from `col`: one pass over the rows
// (t outer), each V row's 8-column pieces loaded once and used by all G heads, G * C
// accumulators in registers (G * C + G + 1 <= 16 ymm). p: G rows of `len`
// probabilities (stride len); acc: G rows of D floats.
template <typename E, int G, int C>
inline void pv_block(const float* p, int64_t len, const E* v_buffer, const int32_t* slots, int64_t kv_heads,
                     int64_t head, int64_t D, int64_t col, float* acc) {
  __m256 a[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const E* v = pool_row_ahead(v_buffer, slots, t, len, kv_heads, head, D) + col;
    __m256 pb[G];
    for (int g = 0; g < G; ++g) pb[g] = _mm256_set1_ps(p[g * len + t]);
    for (int c = 0; c < C; ++c) {
      const __m256 vr = load8(v + c * 8);
      for (int g = 0; g < G; ++g) a[g][c] = _mm256_fmadd_ps(pb[g], vr, a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + g * D + col + c * 8, a[g][c]);
}

// Every column of G heads' probs @ V: passes of C * 8 columns, a last one of 8 at a time.
template <typename E, int G, int C>
void pv_heads(const float* p, int64_t len, const E* v_buffer, const int32_t* slots, int64_t kv_heads, int64_t head,
              int64_t D, float* acc) {
  int64_t col = 0;
  for (; col + C * 8 <= D; col += C * 8) pv_block<E, G, C>(p, len, v_buffer, slots, kv_heads, head, D, col, acc);
  for (; col < D; col += 8) pv_block<E, G, 1>(p, len, v_buffer, slots, kv_heads, head, D, col, acc);
}

// `decode_range` for head_dim a multiple of 8 (`krow`: a float32 row of scratch, `acc`:
// group * head_dim floats). Scores: each K row (prefetched ahead, widened once) dotted
// with every head of the group in 8-lane FMA chains; softmax in lanes; probs @ V by
// `pv_heads`, up to 4 heads of the group per pass over V.
template <typename O, typename E>
void decode_avx2(const float* qf, const E* k_buffer, const E* v_buffer, const uint16_t* k_scale,
                 const uint16_t* v_scale, const int32_t* slots, int64_t len, int64_t kv_heads, int64_t head,
                 int64_t group, int64_t head_dim, float scale, float logit_cap, O* out, float* lse, float* scores,
                 float* krow, float* acc) {
  const int64_t D = head_dim;
  for (int64_t t = 0; t < len; ++t) {
    const E* k = pool_row_ahead(k_buffer, slots, t, len, kv_heads, head, D);
    const float* kf = krow;
    if constexpr (std::is_same_v<E, float>) {
      kf = k;
    } else {
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(krow + d, load8(k + d));
    }
    const float ks = row_scale<E>(k_scale, slots[t], kv_heads, head);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(kf + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d + 8), _mm256_loadu_ps(kf + d + 8), a1);
      }
      if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(kf + d), a0);
      scores[g * len + t] = capped(hsum8(_mm256_add_ps(a0, a1)) * ks, scale, logit_cap);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float l = softmax_lanes(scores + g * len, len);
    if (lse != nullptr) lse[head * group + g] = l;
  }
  if constexpr (std::is_same_v<E, int8_t>) {  // an int8 row's V scale folds into its probabilities
    for (int64_t t = 0; t < len; ++t) {
      const float vs = row_scale<E>(v_scale, slots[t], kv_heads, head);
      for (int64_t g = 0; g < group; ++g) scores[g * len + t] *= vs;
    }
  }
  int64_t g0 = 0;
  for (; g0 + 4 <= group; g0 += 4)
    pv_heads<E, 4, 2>(scores + g0 * len, len, v_buffer, slots, kv_heads, head, D, acc + g0 * D);
  if (group - g0 == 3) pv_heads<E, 3, 4>(scores + g0 * len, len, v_buffer, slots, kv_heads, head, D, acc + g0 * D);
  if (group - g0 == 2) pv_heads<E, 2, 4>(scores + g0 * len, len, v_buffer, slots, kv_heads, head, D, acc + g0 * D);
  if (group - g0 == 1) pv_heads<E, 1, 8>(scores + g0 * len, len, v_buffer, slots, kv_heads, head, D, acc + g0 * D);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < D; ++d) store(out + (head * group + g) * D, d, acc[g * D + d]);
}
#endif

// Scratch of one thread for `decode_range`, reused across its items.
struct DecodeScratch {
  std::vector<float> scores, acc, q, krow;
};

// One request, one KV head, the keys at slots[0, len) (all of the request's keys the
// window leaves, or one split-K chunk of them): every query head of its group attends
// over them, read in place from the pool through the request's `req_to_token` row.
// Scores and the softmax are float32; each K and V row is loaded once per group.
// K/V are of element type E (T itself, or a one-byte type with `k_scale` /
// `v_scale` for int8; see `row_scale`). out: the q row's heads (q_heads * head_dim
// of type O: T, or float32 for a chunk's part); lse, when not null: each query head's
// log-sum-exp of its scores (q_heads floats, this group's written), to merge chunks.
template <typename T, typename E, typename O>
void decode_range(const T* q, const E* k_buffer, const E* v_buffer, const int32_t* slots, int64_t len,
                  int64_t kv_heads, int64_t head, int64_t group, int64_t head_dim, float scale, float logit_cap,
                  O* out, float* lse, DecodeScratch& scratch, const uint16_t* k_scale, const uint16_t* v_scale) {
  const int64_t vec = vector_end(head_dim);
  scratch.scores.resize(group * len);
#if defined(__AVX512F__)
  if (decode_tiled(q, k_buffer, v_buffer, k_scale, v_scale, slots, len, kv_heads, head, group, head_dim, scale,
                   logit_cap, out, lse, scratch.scores.data()))
    return;
#endif
  scratch.acc.assign(group * head_dim, 0.f);
  scratch.q.resize(group * head_dim);
  float* scores = scratch.scores.data();
  float* acc = scratch.acc.data();
  float* qf = scratch.q.data();
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = load(q + (head * group + g) * head_dim, d);
#if defined(ARBORLM_AVX2_LANES)
  if (head_dim % 8 == 0) {
    scratch.krow.resize(head_dim);
    decode_avx2(qf, k_buffer, v_buffer, k_scale, v_scale, slots, len, kv_heads, head, group, head_dim, scale,
                logit_cap, out, lse, scores, scratch.krow.data(), acc);
    return;
  }
#endif
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = slots[t];
    const E* k = k_buffer + (slot * kv_heads + head) * head_dim;
    const float ks = row_scale<E>(k_scale, slot, kv_heads, head);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * head_dim;
      float dot = 0.f;
      int64_t d = 0;
#if defined(__AVX512F__)
      __m512 sum = _mm512_setzero_ps();
      for (; d < vec; d += kLanes) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), load16(k + d), sum);
      dot = _mm512_reduce_add_ps(sum);
#endif
      for (; d < head_dim; ++d) dot += qg[d] * load(k, d);
      scores[g * len + t] = capped(dot * ks, scale, logit_cap);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float l = softmax_inplace(scores + g * len, len);
    if (lse != nullptr) lse[head * group + g] = l;
  }
  // An int8 row's V scale folds into its probabilities (rows of every group head).
  if constexpr (std::is_same_v<E, int8_t>) {
    for (int64_t t = 0; t < len; ++t) {
      const float vs = row_scale<E>(v_scale, slots[t], kv_heads, head);
      for (int64_t g = 0; g < group; ++g) scores[g * len + t] *= vs;
    }
  }
  // probs @ V: one accumulator chain per (head, 16 dims), two keys per iteration
  // so that the chain's FMA latency is hidden.
  for (int64_t g = 0; g < group; ++g) {
    const float* pg = scores + g * len;
    float* ag = acc + g * head_dim;
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d < vec; d += kLanes) {
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      int64_t t = 0;
      for (; t + 1 < len; t += 2) {
        const E* v0 = v_buffer + (static_cast<int64_t>(slots[t]) * kv_heads + head) * head_dim;
        const E* v1 = v_buffer + (static_cast<int64_t>(slots[t + 1]) * kv_heads + head) * head_dim;
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(pg[t]), load16(v0 + d), a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(pg[t + 1]), load16(v1 + d), a1);
      }
      if (t < len) {
        const E* v0 = v_buffer + (static_cast<int64_t>(slots[t]) * kv_heads + head) * head_dim;
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(pg[t]), load16(v0 + d), a0);
      }
      _mm512_storeu_ps(ag + d, _mm512_add_ps(a0, a1));
    }
#endif
    for (int64_t t = 0; d < head_dim && t < len; ++t) {
      const E* v = v_buffer + (static_cast<int64_t>(slots[t]) * kv_heads + head) * head_dim;
      for (int64_t e = d; e < head_dim; ++e) ag[e] += pg[t] * load(v, e);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) store(out + (head * group + g) * head_dim, d, acc[g * head_dim + d]);
}

// Copy each new token's K and V (rows of `kv_heads * head_dim`, token stride
// `*_stride`) into the pool at `loc[token]`.
template <typename T>
void store_kv(const T* k_new, int64_t k_stride, const T* v_new, int64_t v_stride, const int64_t* loc, int64_t tokens,
              int64_t row, T* k_buffer, T* v_buffer) {
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(k_buffer + loc[t] * row, k_new + t * k_stride, row * sizeof(T));
    std::memcpy(v_buffer + loc[t] * row, v_new + t * v_stride, row * sizeof(T));
  }
}

// Store new K or V rows into an int8 pool as `TokenToKVPool.set_kv_buffer` does, bit for
// bit: per (token, KV head) scale = fp16(max |x| / 127) (1 where that is 0), values
// round(x / scale) (half to even) clamped to [-127, 127]. rows: (tokens, kv_heads,
// head_dim) with token stride `stride`; buffer (slots, kv_heads, head_dim) int8, scales
// (slots, kv_heads) fp16 bits; loc: each token's slot.
template <typename T>
void store_kv_int8(const T* rows, int64_t stride, const int64_t* loc, int64_t tokens, int64_t kv_heads,
                   int64_t head_dim, int8_t* buffer, uint16_t* scales) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* x = rows + t * stride + h * head_dim;
      float amax = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) amax = std::fmax(amax, std::fabs(load(x, d)));
      uint16_t bits = f32_to_f16(amax / 127.f);
      float scale = f16_to_f32(bits);
      if (!(scale > 0.f)) bits = 0x3c00u, scale = 1.f;  // 1.0: an all-zero row
      int8_t* out = buffer + (loc[t] * kv_heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d)
        out[d] = static_cast<int8_t>(std::fmin(std::fmax(std::nearbyint(load(x, d) / scale), -127.f), 127.f));
      scales[loc[t] * kv_heads + h] = bits;
    }
}

// Split-K (flash-decoding, Dao et al. 2023; FlashInfer's merge_state): a request's keys
// are cut into chunks of at least kSplitMinKeys, each (request, KV head, chunk) is one
// work item, and the chunks' normalised parts are merged by their log-sum-exps. At a
// few requests the (request, KV head) items alone are fewer than the threads or split
// unevenly over them (SmolLM2's 3 KV heads on 2 threads: one thread idle a third of
// the time). The chunking depends on the sequence length only, never on the batch or
// the thread count, so a request's output is the same in any batch.
constexpr int64_t kSplitMinKeys = 128;

inline int64_t split_chunks(int64_t len) { return std::max<int64_t>(1, len / kSplitMinKeys); }

// Keys [lo, hi) of chunk c of n over `len` keys: equal parts, the first len % n one longer.
inline std::pair<int64_t, int64_t> chunk_range(int64_t len, int64_t n, int64_t c) {
  const int64_t base = len / n, extra = len % n;
  const int64_t lo = c * base + std::min(c, extra);
  return {lo, lo + base + (c < extra ? 1 : 0)};
}

// out[head g, :] = sum_c w_c part_c[g, :] / sum_c w_c, w_c = exp(lse_c[g] - max_c lse_c[g]),
// for the group of query heads of KV head `head`. parts: n rows of q_heads * D floats;
// lses: n rows of q_heads.
template <typename T>
void merge_chunks(const float* parts, const float* lses, int64_t n, int64_t q_heads, int64_t head, int64_t group,
                  int64_t D, T* out) {
  std::vector<float> acc(D);
  for (int64_t g = head * group; g < (head + 1) * group; ++g) {
    float mx = -INFINITY;
    for (int64_t c = 0; c < n; ++c) mx = std::max(mx, lses[c * q_heads + g]);
    std::fill(acc.begin(), acc.end(), 0.f);
    float total = 0.f;
    for (int64_t c = 0; c < n; ++c) {
      const float w = std::exp(lses[c * q_heads + g] - mx);
      const float* part = parts + c * q_heads * D + g * D;
      total += w;
      for (int64_t d = 0; d < D; ++d) acc[d] += w * part[d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) store(out + g * D, d, acc[d] * inv);
  }
}

// One item of `decode_attention`: chunk `chunk` of KV head `head` for rows
// [b, b + rows) (one request's row, or a speculative chain's rows: see
// `chain_rows`); chunk -1: all of one row's chunks in turn, merged by the same item.
struct DecodeItem {
  int64_t b, rows, head, chunk;
};

// Rows from b on that form one speculative verify chain: the same request row, each
// row one key longer than the last (its own draft token stored just before). One
// item then runs the chain's rows one after another over the same chunk of keys,
// which stay in this core's cache, instead of each row fetching the request's K/V
// again from a shared cache or memory. Every row still runs its own `decode_range`
// over its own chunks, so its output is the bits of a lone decode row. Chains are cut
// at kMaxChainRows: a prefill run as decode rows (one request at lengths 1..n) would
// otherwise be one chain of a few items, too few to keep every thread busy.
constexpr int64_t kMaxChainRows = 16;

inline int64_t chain_rows(const int64_t* req_pool_indices, const int64_t* seq_lens, int64_t b, int64_t batch) {
  int64_t e = b + 1;
  while (e < batch && e - b < kMaxChainRows && req_pool_indices[e] == req_pool_indices[b] &&
         seq_lens[e] == seq_lens[e - 1] + 1)
    ++e;
  return e - b;
}

// Split items keep every chunk's part in one buffer; past this many floats of parts
// (an EXTEND step's thousands of rows, each a request of its own length) each (row, KV
// head) item runs its chunks in turn in its thread's scratch instead. Both run the
// same `decode_range` per chunk and the same `merge_chunks`, so a row's bits are the
// same either way.
constexpr int64_t kMaxSplitParts = int64_t{1} << 20;

// Scratch of one thread for the chunks of a (row, KV head) item run in turn.
struct ChunkScratch {
  std::vector<float> parts, lses;
};

template <typename T, typename E>
void decode_attention(const T* q, int64_t q_stride, const E* k_buffer, const E* v_buffer, const uint16_t* k_scale,
                      const uint16_t* v_scale, const int32_t* req_to_token, int64_t req_to_token_stride,
                      const int64_t* req_pool_indices, const int64_t* seq_lens, int64_t batch, int64_t q_heads,
                      int64_t kv_heads, int64_t head_dim, float scale, int64_t window, float logit_cap, T* out,
                      int64_t out_stride) {
  const int64_t group = q_heads / kv_heads;
  int64_t work = 0;
  // Per request: the first key the window leaves, its key count, its chunks, and the
  // first row of its chunks' parts (requests of one chunk write `out` directly).
  std::vector<int64_t> start(batch), len(batch), chunks(batch), part_row(batch);
  int64_t part_rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    start[b] = (window > 0 && seq_lens[b] > window) ? seq_lens[b] - window : 0;
    len[b] = seq_lens[b] - start[b];
    chunks[b] = split_chunks(len[b]);
    part_row[b] = part_rows;
    if (chunks[b] > 1) part_rows += chunks[b];
    work += seq_lens[b];
  }
  work *= q_heads * head_dim;
  const bool split = part_rows * q_heads * head_dim <= kMaxSplitParts;
  std::vector<DecodeItem> items;
  items.reserve(batch * kv_heads);
  for (int64_t b = 0; b < batch;) {
    if (!split) {  // an EXTEND step's many rows: one row per item, its chunks in turn
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({b, 1, h, chunks[b] > 1 ? -1 : 0});
      ++b;
      continue;
    }
    const int64_t n = chain_rows(req_pool_indices, seq_lens, b, batch);
    const int64_t most = *std::max_element(chunks.begin() + b, chunks.begin() + b + n);
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t c = 0; c < most; ++c) items.push_back({b, n, h, c});
    b += n;
  }
  std::vector<float> parts(split ? part_rows * q_heads * head_dim : 0), lses(split ? part_rows * q_heads : 0);
  const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel if (work >= kParallelWork)
  {
    DecodeScratch scratch;
    ChunkScratch own;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const DecodeItem it = items[i];
      for (int64_t b = it.b; b < it.b + it.rows; ++b) {
        const int32_t* slots = req_to_token + req_pool_indices[b] * req_to_token_stride + start[b];
        const T* qb = q + b * q_stride;
        if (chunks[b] == 1) {
          if (it.chunk <= 0)
            decode_range(qb, k_buffer, v_buffer, slots, len[b], kv_heads, it.head, group, head_dim, scale, logit_cap,
                         out + b * out_stride, static_cast<float*>(nullptr), scratch, k_scale, v_scale);
          continue;
        }
        if (it.chunk < 0) {
          const int64_t n = chunks[b];
          own.parts.resize(n * q_heads * head_dim);
          own.lses.resize(n * q_heads);
          for (int64_t c = 0; c < n; ++c) {
            const auto [lo, hi] = chunk_range(len[b], n, c);
            decode_range(qb, k_buffer, v_buffer, slots + lo, hi - lo, kv_heads, it.head, group, head_dim, scale,
                         logit_cap, own.parts.data() + c * q_heads * head_dim, own.lses.data() + c * q_heads,
                         scratch, k_scale, v_scale);
          }
          merge_chunks(own.parts.data(), own.lses.data(), n, q_heads, it.head, group, head_dim, out + b * out_stride);
          continue;
        }
        if (it.chunk >= chunks[b]) continue;  // a shorter row of the chain has fewer chunks
        const auto [lo, hi] = chunk_range(len[b], chunks[b], it.chunk);
        const int64_t row = part_row[b] + it.chunk;
        decode_range(qb, k_buffer, v_buffer, slots + lo, hi - lo, kv_heads, it.head, group, head_dim, scale,
                     logit_cap, parts.data() + row * q_heads * head_dim, lses.data() + row * q_heads, scratch,
                     k_scale, v_scale);
      }
    }
    if (split) {
#pragma omp for collapse(2) schedule(static)
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t h = 0; h < kv_heads; ++h)
          if (chunks[b] > 1)
            merge_chunks(parts.data() + part_row[b] * q_heads * head_dim, lses.data() + part_row[b] * q_heads,
                         chunks[b], q_heads, h, group, head_dim, out + b * out_stride);
    }
  }
}

// `decode_attention` with q / out of type T over a pool of KV code `kv_dtype`
// (0 float32, 1 bfloat16: T itself; 2 float8_e4m3fn, 3 float8_e5m2, 4 int8 + scales).
template <typename T>
void decode_attention_kv(int kv_dtype, const T* q, int64_t q_stride, const void* k_buffer, const void* v_buffer,
                         const uint16_t* k_scale, const uint16_t* v_scale, const int32_t* req_to_token,
                         int64_t req_to_token_stride, const int64_t* req_pool_indices, const int64_t* seq_lens,
                         int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim, float scale,
                         int64_t window, float logit_cap, T* out, int64_t out_stride) {
  const auto run = [&](auto* element) {
    using E = std::remove_pointer_t<decltype(element)>;
    decode_attention(q, q_stride, static_cast<const E*>(k_buffer), static_cast<const E*>(v_buffer), k_scale, v_scale,
                     req_to_token, req_to_token_stride, req_pool_indices, seq_lens, batch, q_heads, kv_heads,
                     head_dim, scale, window, logit_cap, out, out_stride);
  };
  switch (kv_dtype) {
    case 2: return run(static_cast<Fp8E4M3*>(nullptr));
    case 3: return run(static_cast<Fp8E5M2*>(nullptr));
    case 4: return run(static_cast<int8_t*>(nullptr));
    default: return run(static_cast<T*>(nullptr));
  }
}

// ---- Extend attention over a pool of any KV code, in tiles ------------------
//
// Why: an EXTEND step over a one-byte pool (`kv_cache_dtype`) would otherwise read an
// upcast copy of every request's whole context per layer, then attend over the copy;
// a multi-turn request with a long cached prefix and a few new tokens pays more for
// the copy than for its attention. Here each tile of keys is widened once (in L1) and
// used by every new token of a block and every query head of the KV head's group,
// with the online softmax of FlashAttention (Dao et al., arXiv 2205.14135): running
// max and sum per query row, the accumulator rescaled when the max grows. The inner
// loops run over independent lanes (keys of a tile, dims of a row), so the compiler
// vectorizes them for whatever the CPU has (AVX2 or AVX-512) without reordering a sum.

// Keys per tile and new tokens per work item.
constexpr int64_t kTileKeys = 64;
constexpr int64_t kTileRows = 16;

// Query rows and keys / dims of one register block of the tile products: 4 x 16 float32
// accumulators (8 AVX2 or 4 AVX-512 registers), fused multiply-adds.
constexpr int64_t kBlockRows = 4;
constexpr int64_t kBlockLanes = 16;

// s[r][j] = q[r] . kt[:, j] for kBlockRows rows of q (row stride D) and the tile's keys
// [j0, j0 + kBlockLanes) (kt: D x kTileKeys, transposed); s row stride kTileKeys.
inline void tile_scores(const float* __restrict q, const float* __restrict kt, int64_t D, int64_t j0,
                        float* __restrict s) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * kTileKeys + j0), k1 = _mm256_loadu_ps(kt + d * kTileKeys + j0 + 8);
    __m256 qv = _mm256_broadcast_ss(q + d);
    a00 = _mm256_fmadd_ps(qv, k0, a00), a01 = _mm256_fmadd_ps(qv, k1, a01);
    qv = _mm256_broadcast_ss(q + D + d);
    a10 = _mm256_fmadd_ps(qv, k0, a10), a11 = _mm256_fmadd_ps(qv, k1, a11);
    qv = _mm256_broadcast_ss(q + 2 * D + d);
    a20 = _mm256_fmadd_ps(qv, k0, a20), a21 = _mm256_fmadd_ps(qv, k1, a21);
    qv = _mm256_broadcast_ss(q + 3 * D + d);
    a30 = _mm256_fmadd_ps(qv, k0, a30), a31 = _mm256_fmadd_ps(qv, k1, a31);
  }
  float* o = s + j0;
  _mm256_storeu_ps(o, a00), _mm256_storeu_ps(o + 8, a01);
  _mm256_storeu_ps(o + kTileKeys, a10), _mm256_storeu_ps(o + kTileKeys + 8, a11);
  _mm256_storeu_ps(o + 2 * kTileKeys, a20), _mm256_storeu_ps(o + 2 * kTileKeys + 8, a21);
  _mm256_storeu_ps(o + 3 * kTileKeys, a30), _mm256_storeu_ps(o + 3 * kTileKeys + 8, a31);
#else
  for (int64_t r = 0; r < kBlockRows; ++r)
    for (int64_t j = 0; j < kBlockLanes; ++j) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot = std::fma(q[r * D + d], kt[d * kTileKeys + j0 + j], dot);
      s[r * kTileKeys + j0 + j] = dot;
    }
#endif
}

// acc[r][d0, d0 + kBlockLanes) += sum_j p[r][j] * vt[j][d0 + ...] over the tile's n keys, for
// kBlockRows rows (p row stride kTileKeys, acc row stride D).
inline void tile_values(const float* __restrict p, const float* __restrict vt, int64_t n, int64_t D, int64_t d0,
                        float* __restrict acc) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
  for (int64_t j = 0; j < n; ++j) {
    const __m256 v0 = _mm256_loadu_ps(vt + j * D + d0), v1 = _mm256_loadu_ps(vt + j * D + d0 + 8);
    __m256 pv = _mm256_broadcast_ss(p + j);
    a00 = _mm256_fmadd_ps(pv, v0, a00), a01 = _mm256_fmadd_ps(pv, v1, a01);
    pv = _mm256_broadcast_ss(p + kTileKeys + j);
    a10 = _mm256_fmadd_ps(pv, v0, a10), a11 = _mm256_fmadd_ps(pv, v1, a11);
    pv = _mm256_broadcast_ss(p + 2 * kTileKeys + j);
    a20 = _mm256_fmadd_ps(pv, v0, a20), a21 = _mm256_fmadd_ps(pv, v1, a21);
    pv = _mm256_broadcast_ss(p + 3 * kTileKeys + j);
    a30 = _mm256_fmadd_ps(pv, v0, a30), a31 = _mm256_fmadd_ps(pv, v1, a31);
  }
  const __m256 acc_rows[kBlockRows][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
  for (int64_t r = 0; r < kBlockRows; ++r)
    for (int64_t h = 0; h < 2; ++h) {
      float* o = acc + r * D + d0 + 8 * h;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc_rows[r][h]));
    }
#else
  for (int64_t r = 0; r < kBlockRows; ++r)
    for (int64_t e = 0; e < kBlockLanes; ++e) {
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) sum = std::fma(p[r * kTileKeys + j], vt[j * D + d0 + e], sum);
      acc[r * D + d0 + e] += sum;
    }
#endif
}

// Scratch of one thread for `extend_tile_block`: the widened K tile (head_dim x keys,
// transposed), the V tile (keys x head_dim), query rows, the tile's scores / probabilities,
// and per query row its accumulator, running max and running sum.
struct TiledExtendScratch {
  std::vector<float> kt, vt, q, s, acc, mx, sum;
};

// One request, one KV head, new tokens [row0, row0 + rows) of the request (positions
// prefix + row0 + i): every query head of the group attends causally (and within
// `window`) over the request's keys, read in place through its `req_to_token` row.
// q / out point at the request's first new token (row stride q_stride / out_stride).
// Query rows are (token, group head) pairs, padded to a multiple of kBlockRows with
// zero rows whose probabilities stay 0.
template <typename T, typename E>
void extend_tile_block(const T* q, int64_t q_stride, const E* k_buffer, const E* v_buffer, const uint16_t* k_scale,
                       const uint16_t* v_scale, const int32_t* slots, int64_t prefix, int64_t row0, int64_t rows,
                       int64_t kv_heads, int64_t head, int64_t group, int64_t head_dim, float scale, int64_t window,
                       float logit_cap, T* out, int64_t out_stride, TiledExtendScratch& sc) {
  const int64_t D = head_dim, R = rows * group, R4 = (R + kBlockRows - 1) / kBlockRows * kBlockRows;
  const int64_t D16 = D / kBlockLanes * kBlockLanes;
  sc.kt.assign(D * kTileKeys, 0.f);
  sc.vt.assign(kTileKeys * D, 0.f);
  sc.q.assign(R4 * D, 0.f);
  sc.s.resize(R4 * kTileKeys);
  sc.acc.assign(R4 * D, 0.f);
  sc.mx.assign(R4, -INFINITY);
  sc.sum.assign(R4, 0.f);
  float* __restrict kt = sc.kt.data();
  float* __restrict vt = sc.vt.data();
  float* __restrict qf = sc.q.data();
  float* __restrict acc = sc.acc.data();
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < D; ++d) qf[(i * group + g) * D + d] = load(q + (row0 + i) * q_stride + (head * group + g) * D, d);
  const int64_t first = prefix + row0, last = prefix + row0 + rows - 1;
  // Tiles start at multiples of kTileKeys, never where this block's window does: a row's
  // tiles (and so its bits) then do not depend on which rows share its block.
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first - window + 1) / kTileKeys * kTileKeys : 0;
  for (int64_t j0 = lo; j0 <= last; j0 += kTileKeys) {
    const int64_t n = std::min(kTileKeys, last + 1 - j0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = slots[j0 + j];
      const E* k = k_buffer + (slot * kv_heads + head) * D;
      const E* v = v_buffer + (slot * kv_heads + head) * D;
      const float ks = row_scale<E>(k_scale, slot, kv_heads, head), vs = row_scale<E>(v_scale, slot, kv_heads, head);
      for (int64_t d = 0; d < D; ++d) kt[d * kTileKeys + j] = load(k, d) * ks;
      for (int64_t d = 0; d < D; ++d) vt[j * D + d] = load(v, d) * vs;
    }
    for (int64_t r0 = 0; r0 < R4; r0 += kBlockRows)
      for (int64_t jb = 0; jb < n; jb += kBlockLanes) tile_scores(qf + r0 * D, kt, D, jb, sc.s.data() + r0 * kTileKeys);
    for (int64_t r = 0; r < R4; ++r) {
      float* __restrict s = sc.s.data() + r * kTileKeys;
      const int64_t pos = first + r / group;
      // Keys [key_lo, key_hi) of this tile are visible to the row (none to a padding row).
      const int64_t key_lo = window > 0 ? std::max<int64_t>(0, pos - window + 1 - j0) : 0;
      const int64_t key_hi = r < R ? std::min(n, pos + 1 - j0) : 0;
      if (key_hi <= key_lo) {
        for (int64_t j = 0; j < kTileKeys; ++j) s[j] = 0.f;
        continue;
      }
      // Separate passes over the visible keys, each one vectorized.
      if (logit_cap > 0.f)
        for (int64_t j = key_lo; j < key_hi; ++j) s[j] = capped(s[j], scale, logit_cap);
      else
        for (int64_t j = key_lo; j < key_hi; ++j) s[j] *= scale;
      const float new_max = std::fmax(sc.mx[r], range_max(s, key_lo, key_hi));
      if (new_max > sc.mx[r] && sc.mx[r] != -INFINITY) {
        const float shrink = exp_nonpositive(sc.mx[r] - new_max);
        sc.sum[r] *= shrink;
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= shrink;
      }
      sc.mx[r] = new_max;
      for (int64_t j = key_lo; j < key_hi; ++j) s[j] = exp_nonpositive(s[j] - new_max);
      for (int64_t j = 0; j < key_lo; ++j) s[j] = 0.f;
      for (int64_t j = key_hi; j < kTileKeys; ++j) s[j] = 0.f;
      sc.sum[r] += range_sum(s, key_lo, key_hi);
    }
    for (int64_t r0 = 0; r0 < R4; r0 += kBlockRows) {
      const float* p = sc.s.data() + r0 * kTileKeys;
      for (int64_t d0 = 0; d0 < D16; d0 += kBlockLanes) tile_values(p, vt, n, D, d0, acc + r0 * D);
      for (int64_t r = r0; r < r0 + kBlockRows; ++r)  // head_dim past a multiple of 16
        for (int64_t j = 0; j < n; ++j)
          for (int64_t d = D16; d < D; ++d) acc[r * D + d] = std::fma(sc.s[r * kTileKeys + j], vt[j * D + d], acc[r * D + d]);
    }
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      const float inv = 1.f / sc.sum[r];
      T* o = out + (row0 + i) * out_stride + (head * group + g) * D;
      for (int64_t d = 0; d < D; ++d) store(o, d, acc[r * D + d] * inv);
    }
}

// Every request's new tokens in blocks of `kTileRows`, each block and KV head one work item.
template <typename T, typename E>
void extend_attention_tiled(const T* q, int64_t q_stride, const E* k_buffer, const E* v_buffer,
                            const uint16_t* k_scale, const uint16_t* v_scale, const int32_t* req_to_token,
                            int64_t req_to_token_stride, const int64_t* req_pool_indices, const int64_t* seq_lens,
                            const int64_t* extend_lens, const int64_t* extend_starts, int64_t batch, int64_t q_heads,
                            int64_t kv_heads, int64_t head_dim, float scale, int64_t window, float logit_cap, T* out,
                            int64_t out_stride) {
  const int64_t group = q_heads / kv_heads;
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (request, first new token)
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r = 0; r < extend_lens[b]; r += kTileRows) blocks.emplace_back(b, r);
    work += extend_lens[b] * seq_lens[b];
  }
  const int64_t items = static_cast<int64_t>(blocks.size()) * kv_heads;
#pragma omp parallel if (work * q_heads * head_dim >= kParallelWork && items > 1)
  {
    TiledExtendScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const auto [b, row0] = blocks[item / kv_heads];
      const int64_t head = item % kv_heads;
      const int64_t rows = std::min(kTileRows, extend_lens[b] - row0);
      extend_tile_block(q + extend_starts[b] * q_stride, q_stride, k_buffer, v_buffer, k_scale, v_scale,
                        req_to_token + req_pool_indices[b] * req_to_token_stride, seq_lens[b] - extend_lens[b],
                        row0, rows, kv_heads, head, group, head_dim, scale, window, logit_cap,
                        out + extend_starts[b] * out_stride, out_stride, scratch);
    }
  }
}

// `extend_attention_tiled` with q / out of type T over a pool of KV code `kv_dtype`
// (as `decode_attention_kv`).
template <typename T>
void extend_attention_kv(int kv_dtype, const T* q, int64_t q_stride, const void* k_buffer, const void* v_buffer,
                         const uint16_t* k_scale, const uint16_t* v_scale, const int32_t* req_to_token,
                         int64_t req_to_token_stride, const int64_t* req_pool_indices, const int64_t* seq_lens,
                         const int64_t* extend_lens, const int64_t* extend_starts, int64_t batch, int64_t q_heads,
                         int64_t kv_heads, int64_t head_dim, float scale, int64_t window, float logit_cap, T* out,
                         int64_t out_stride) {
  const auto run = [&](auto* element) {
    using E = std::remove_pointer_t<decltype(element)>;
    extend_attention_tiled(q, q_stride, static_cast<const E*>(k_buffer), static_cast<const E*>(v_buffer), k_scale,
                           v_scale, req_to_token, req_to_token_stride, req_pool_indices, seq_lens, extend_lens,
                           extend_starts, batch, q_heads, kv_heads, head_dim, scale, window, logit_cap, out,
                           out_stride);
  };
  switch (kv_dtype) {
    case 2: return run(static_cast<Fp8E4M3*>(nullptr));
    case 3: return run(static_cast<Fp8E5M2*>(nullptr));
    case 4: return run(static_cast<int8_t*>(nullptr));
    default: return run(static_cast<T*>(nullptr));
  }
}

#if defined(ARBORLM_AMX)
// ---- bf16 linear layer on AMX tiles ----------------------------------------
//
// Why: a decode step multiplies a few rows by every weight matrix once, so it is
// bound by reading the weights. oneDNN's prepacked path reads them at ~14 GB/s
// here; streaming each 32-column block once through two AMX B tiles reaches the
// memory's ~20 GB/s (a decode step's matrix products take ~0.7x the time).
// Results equal oneDNN's bit for bit on decode sizes: the same TDPBF16PS
// products, accumulated over K in the same order, rounded once.
//
// Packed weight (`cpu_ops.pack_amx_weight`): out_features padded to a multiple
// of 32 with zero rows, in_features a multiple of 32, laid out
// [out/32][in/32][2][16][16][2]: per 32-column block and 32-wide K step, two
// 1 KiB B tiles (16 column each) of 16 K-pairs x 16 columns x 2 (VNNI order).

constexpr int64_t kAmxRows = 16;     // rows of an A or C tile
constexpr int64_t kAmxBlockN = 32;   // output columns per block: two C tiles
constexpr int64_t kAmxStepK = 32;    // bf16 elements of K per tile product
constexpr int64_t kAmxBlockElems = kAmxBlockN * kAmxStepK;  // packed elements per block and K step
constexpr int64_t kAmxRowBlock = 128;  // rows of x kept in L2 while a thread walks the column blocks

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: 0-1 C of rows [0, r0), 2-3 C of rows [16, 16 + r1), 4-5 the two A
// chunks, 6-7 the two B tiles of a block. r1 == 0: one row chunk.
void configure_tiles(int r0, int r1) {
  TileConfig config{};
  config.palette_id = 1;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, kAmxRows, kAmxRows};
  for (int t = 0; t < 8; ++t) {
    if (rows[t] == 0) continue;
    config.rows[t] = static_cast<uint8_t>(rows[t]);
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Round `rows` rows of 32 float32 sums (plus bias) to bf16; write the first n columns.
void store_block(const float (*acc)[kAmxBlockN], int rows, const uint16_t* bias, uint16_t* out, int64_t out_stride,
                 int64_t n) {
  alignas(64) float bias_f[kAmxBlockN] = {};
  if (bias)
    for (int64_t j = 0; j < n; ++j) bias_f[j] = bf16_to_f32(bias[j]);
  for (int r = 0; r < rows; ++r) {
    alignas(64) uint16_t row[kAmxBlockN];
    for (int half = 0; half < 2; ++half) {
      const __m512 sum = _mm512_add_ps(_mm512_load_ps(&acc[r][16 * half]), _mm512_load_ps(bias_f + 16 * half));
      _mm256_store_si256(reinterpret_cast<__m256i*>(row + 16 * half), (__m256i)_mm512_cvtneps_pbh(sum));
    }
    std::memcpy(out + r * out_stride, row, n * sizeof(uint16_t));
  }
}

// Up to 32 rows of x against one 32-column block: two row chunks share each
// pair of B tile loads.
void linear_block(const uint16_t* x, int64_t x_stride, int r0, int r1, int64_t k_steps, const uint16_t* block,
                  float (*acc)[kAmxBlockN]) {
  const int64_t a_bytes = x_stride * static_cast<int64_t>(sizeof(uint16_t));
  _tile_zero(0);
  _tile_zero(1);
  if (r1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < k_steps; ++k) {
    const uint16_t* b = block + k * kAmxBlockElems;
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + kAmxBlockElems / 2, 64);
    _tile_loadd(4, x + k * kAmxStepK, a_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (r1) {
      _tile_loadd(5, x + kAmxRows * x_stride + k * kAmxStepK, a_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, &acc[0][0], kAmxBlockN * sizeof(float));
  _tile_stored(1, &acc[0][16], kAmxBlockN * sizeof(float));
  if (r1) {
    _tile_stored(2, &acc[kAmxRows][0], kAmxBlockN * sizeof(float));
    _tile_stored(3, &acc[kAmxRows][16], kAmxBlockN * sizeof(float));
  }
}

void linear_bf16(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t in_features, const uint16_t* packed,
                 int64_t out_features, const uint16_t* bias, uint16_t* out, int64_t out_stride) {
  const int64_t blocks = (out_features + kAmxBlockN - 1) / kAmxBlockN;
  const int64_t k_steps = in_features / kAmxStepK;
  const int64_t row_blocks = (rows + kAmxRowBlock - 1) / kAmxRowBlock;
#pragma omp parallel if (blocks * row_blocks >= 4)
  {
    alignas(64) float acc[2 * kAmxRows][kAmxBlockN];
    int configured = -1;  // (r0, r1) of the current tile configuration; tiles are per thread
    // Row blocks outermost: a long prefill's rows stay in L2 while the weights stream by.
#pragma omp for collapse(2) schedule(static)
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t n0 = blk * kAmxBlockN;
        const int64_t n = std::min(kAmxBlockN, out_features - n0);
        const int64_t m_end = std::min(rows, (rb + 1) * kAmxRowBlock);
        for (int64_t m0 = rb * kAmxRowBlock; m0 < m_end; m0 += 2 * kAmxRows) {
          const int r0 = static_cast<int>(std::min(kAmxRows, m_end - m0));
          const int r1 = static_cast<int>(std::min(kAmxRows, m_end - m0 - r0));
          if (r0 * 64 + r1 != configured) {
            configure_tiles(r0, r1);
            configured = r0 * 64 + r1;
          }
          linear_block(x + m0 * x_stride, x_stride, r0, r1, k_steps, packed + blk * k_steps * kAmxBlockElems, acc);
          store_block(acc, r0 + r1, bias ? bias + n0 : nullptr, out + m0 * out_stride + n0, out_stride, n);
        }
      }
    }
    if (configured >= 0) _tile_release();
  }
}

// ---- paged extend (prefill) attention on AMX tiles ---------------------------
//
// Why: torch's SDPA over a padded gather spent about as long as the linear layers
// in a prefill of a few requests. Here each (request, KV head) packs its keys and
// values once from the pool (through `req_to_token`: no gather, no padding) into
// the B-tile layout of `linear_block`, then each block of up to 32 query rows (the
// group's heads of up to 32 / group tokens) computes S = Q K^T on tiles, a float32
// softmax over the keys its tokens see (causal, sliding window, logit cap), and
// O = P V on tiles (P rounded to bf16, as flash attention's CPU kernels do).
// The scheme of FlashAttention (Dao et al., 2022) with whole rows of scores: a
// block's scores fit in L2 for the context lengths served here.

constexpr int64_t kAmxTileElems = 16 * 32;  // bf16 elements of one B tile

// Pack rows [0, len) of one KV head of a pool layer as the (keys x D) weight of
// `linear_block` (keys padded to 32 with zeros): S = Q K^T is a linear layer.
// A B tile holds 16 keys x 16 dim pairs: a 16 x 16 transpose of 32-bit pairs.
void pack_keys(const uint16_t* buffer, const int32_t* slots, int64_t len, int64_t kv_heads, int64_t head,
               int64_t head_dim, int64_t keys_pad, uint16_t* out) {
  const int64_t d_steps = head_dim / kAmxStepK;
  alignas(64) uint32_t rows[16][16];
  for (int64_t j0 = 0; j0 < keys_pad; j0 += 16) {
    const int64_t block = j0 / kAmxBlockN, sub = (j0 % kAmxBlockN) / 16;
    for (int64_t ds = 0; ds < d_steps; ++ds) {
      for (int64_t c = 0; c < 16; ++c) {
        if (j0 + c < len) {
          const uint16_t* row = buffer + (static_cast<int64_t>(slots[j0 + c]) * kv_heads + head) * head_dim;
          std::memcpy(rows[c], row + ds * kAmxStepK, 64);
        } else {
          std::memset(rows[c], 0, 64);
        }
      }
      uint32_t* tile = reinterpret_cast<uint32_t*>(out + ((block * d_steps + ds) * 2 + sub) * kAmxTileElems);
      for (int64_t pair = 0; pair < 16; ++pair) {
        const __m512i column = _mm512_i32gather_epi32(
            _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240),
            &rows[0][pair], 4);
        _mm512_storeu_si512(tile + pair * 16, column);
      }
    }
  }
}

// Pack rows [0, len) of one KV head as the (D x keys) weight of `linear_block`
// (V^T; keys padded to 32 with zeros): O = P V is a linear layer. A B tile row
// interleaves two keys' values for 16 dims.
void pack_values(const uint16_t* buffer, const int32_t* slots, int64_t len, int64_t kv_heads, int64_t head,
                 int64_t head_dim, int64_t keys_pad, uint16_t* out) {
  const int64_t k_steps = keys_pad / kAmxStepK;
  alignas(64) static const uint16_t kInterleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t j = 0; j < keys_pad; j += 2) {
    const uint16_t* even = j < len ? buffer + (static_cast<int64_t>(slots[j]) * kv_heads + head) * head_dim : nullptr;
    const uint16_t* odd =
        j + 1 < len ? buffer + (static_cast<int64_t>(slots[j + 1]) * kv_heads + head) * head_dim : nullptr;
    const int64_t step = j / kAmxStepK, pair = (j % kAmxStepK) / 2;
    for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
      const __m512i a = even ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + d0)))
                             : _mm512_setzero_si512();
      const __m512i b = odd ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + d0)))
                            : _mm512_setzero_si512();
      const int64_t block = d0 / kAmxBlockN, sub = (d0 % kAmxBlockN) / 16;
      _mm512_storeu_si512(out + ((block * k_steps + step) * 2 + sub) * kAmxTileElems + pair * 32,
                          _mm512_permutex2var_epi16(a, interleave, b));
    }
  }
}

// Scores s[0, len) of one query row -> bf16 probabilities p[0, len): `softmax_inplace` of
// the scaled (and capped) scores, rounded once.
inline void softmax_row_bf16(float* s, int64_t len, float scale, float logit_cap, uint16_t* p) {
  const int64_t vec_end = len - len % 16;
  if (logit_cap > 0.f) {
    for (int64_t j = 0; j < len; ++j) s[j] = capped(s[j], scale, logit_cap);
  } else {
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < vec_end; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), scale16));
    for (int64_t j = vec_end; j < len; ++j) s[j] *= scale;
  }
  softmax_inplace(s, len);
  for (int64_t j = 0; j < vec_end; j += 16) store16(p + j, _mm512_loadu_ps(s + j));
  for (int64_t j = vec_end; j < len; ++j) p[j] = f32_to_bf16(s[j]);
}

struct ExtendShape {
  int64_t q_heads, kv_heads, head_dim, group, tokens_per_block;
  float scale, logit_cap;
  int64_t window;
};

struct ExtendScratch {
  std::vector<uint16_t> q;    // (32, head_dim): the block's query rows
  std::vector<float> scores;  // (32, keys): float32 scores, then probabilities
  std::vector<uint16_t> probs;  // (32, keys): bf16 probabilities, zero where masked
  alignas(64) float acc[2 * kAmxRows][kAmxBlockN];
};

// One block of query rows of one request and KV head: `nt` tokens from token
// `t0` of the request, whose first new token is at position `prefix`.
void extend_block(const uint16_t* q, int64_t q_stride, const uint16_t* keys, const uint16_t* values, int64_t keys_pad,
                  int64_t prefix, int64_t t0, int64_t nt, int64_t head, const ExtendShape& sh, uint16_t* out,
                  int64_t out_stride, ExtendScratch& scratch, int& configured) {
  const int64_t rows = nt * sh.group, d_steps = sh.head_dim / kAmxStepK;
  for (int64_t t = 0; t < nt; ++t)
    std::memcpy(scratch.q.data() + t * sh.group * sh.head_dim, q + (t0 + t) * q_stride + head * sh.group * sh.head_dim,
                sh.group * sh.head_dim * sizeof(uint16_t));
  const int64_t first_pos = prefix + t0, last_pos = prefix + t0 + nt - 1;
  const int64_t lo_block = sh.window > 0 ? std::max<int64_t>(0, first_pos - sh.window + 1) / kAmxBlockN : 0;
  const int64_t hi_block = last_pos / kAmxBlockN + 1;  // key blocks [lo_block, hi_block) are seen
  const int r0 = static_cast<int>(std::min(kAmxRows, rows)), r1 = static_cast<int>(rows - r0);
  if (r0 * 64 + r1 != configured) {
    configure_tiles(r0, r1);
    configured = r0 * 64 + r1;
  }
  float* scores = scratch.scores.data();
  uint16_t* probs = scratch.probs.data();
  for (int64_t kb = lo_block; kb < hi_block; ++kb) {
    linear_block(scratch.q.data(), sh.head_dim, r0, r1, d_steps, keys + kb * d_steps * kAmxBlockElems, scratch.acc);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(scores + r * keys_pad + kb * kAmxBlockN, scratch.acc[r], kAmxBlockN * sizeof(float));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = prefix + t0 + r / sh.group;
    const int64_t lo = sh.window > 0 ? std::max<int64_t>(0, pos - sh.window + 1) : 0, hi = pos + 1;
    uint16_t* p = probs + r * keys_pad;
    std::memset(p + lo_block * kAmxBlockN, 0, (lo - lo_block * kAmxBlockN) * sizeof(uint16_t));
    std::memset(p + hi, 0, (hi_block * kAmxBlockN - hi) * sizeof(uint16_t));
    softmax_row_bf16(scores + r * keys_pad + lo, hi - lo, sh.scale, sh.logit_cap, p + lo);
  }
  const int64_t k_steps = keys_pad / kAmxStepK;
  for (int64_t db = 0; db < sh.head_dim / kAmxBlockN; ++db) {
    linear_block(probs + lo_block * kAmxBlockN, keys_pad, r0, r1, hi_block - lo_block,
                 values + (db * k_steps + lo_block) * kAmxBlockElems, scratch.acc);
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* o = out + (t0 + r / sh.group) * out_stride + (head * sh.group + r % sh.group) * sh.head_dim + db * kAmxBlockN;
      for (int half = 0; half < 2; ++half)
        store16(o + 16 * half, _mm512_load_ps(&scratch.acc[r][16 * half]));
    }
  }
}

void extend_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k_buffer, const uint16_t* v_buffer,
                           const int32_t* req_to_token, int64_t req_to_token_stride, const int64_t* req_pool_indices,
                           const int64_t* seq_lens, const int64_t* extend_lens, const int64_t* extend_starts,
                           int64_t batch, const ExtendShape& sh, uint16_t* out, int64_t out_stride) {
  // Keys packed per (request, KV head) for requests of several new tokens; a
  // one-token request (a decode token riding along) reads the pool in place
  // through `decode_range`, which costs less than packing its keys.
  auto packed_keys = [&](int64_t b) {
    return extend_lens[b] > 1 ? (seq_lens[b] + kAmxBlockN - 1) / kAmxBlockN * kAmxBlockN : int64_t{0};
  };
  std::vector<int64_t> offsets(batch + 1, 0), block_starts(batch + 1, 0);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < batch; ++b) {
    offsets[b + 1] = offsets[b] + packed_keys(b) * sh.head_dim * sh.kv_heads;
    block_starts[b + 1] = block_starts[b] + (extend_lens[b] + sh.tokens_per_block - 1) / sh.tokens_per_block;
    max_keys = std::max(max_keys, packed_keys(b));
  }
  std::vector<uint16_t> keys(offsets[batch]), values(offsets[batch]);
  const int64_t units = block_starts[batch] * sh.kv_heads;
#pragma omp parallel
  {
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < sh.kv_heads; ++h) {
        const int64_t keys_pad = packed_keys(b);
        if (keys_pad == 0) continue;
        const int64_t at = offsets[b] + h * keys_pad * sh.head_dim;
        const int32_t* slots = req_to_token + req_pool_indices[b] * req_to_token_stride;
        pack_keys(k_buffer, slots, seq_lens[b], sh.kv_heads, h, sh.head_dim, keys_pad, keys.data() + at);
        pack_values(v_buffer, slots, seq_lens[b], sh.kv_heads, h, sh.head_dim, keys_pad, values.data() + at);
      }
    ExtendScratch scratch;
    scratch.q.resize(2 * kAmxRows * sh.head_dim);
    scratch.scores.resize(2 * kAmxRows * max_keys);
    scratch.probs.resize(2 * kAmxRows * max_keys);
    DecodeScratch decode_scratch;
    int configured = -1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < units; ++unit) {
      const int64_t h = unit % sh.kv_heads, block = unit / sh.kv_heads;
      const int64_t b = std::upper_bound(block_starts.begin(), block_starts.end(), block) - block_starts.begin() - 1;
      const uint16_t* q_b = q + extend_starts[b] * q_stride;
      uint16_t* out_b = out + extend_starts[b] * out_stride;
      if (extend_lens[b] == 1) {
        const int64_t first = (sh.window > 0 && seq_lens[b] > sh.window) ? seq_lens[b] - sh.window : 0;
        decode_range(q_b, k_buffer, v_buffer, req_to_token + req_pool_indices[b] * req_to_token_stride + first,
                     seq_lens[b] - first, sh.kv_heads, h, sh.group, sh.head_dim, sh.scale, sh.logit_cap, out_b,
                     static_cast<float*>(nullptr), decode_scratch, static_cast<const uint16_t*>(nullptr),
                     static_cast<const uint16_t*>(nullptr));
        continue;
      }
      const int64_t t0 = (block - block_starts[b]) * sh.tokens_per_block;
      const int64_t nt = std::min(sh.tokens_per_block, extend_lens[b] - t0);
      const int64_t keys_pad = packed_keys(b);
      const int64_t at = offsets[b] + h * keys_pad * sh.head_dim;
      extend_block(q_b, q_stride, keys.data() + at, values.data() + at, keys_pad, seq_lens[b] - extend_lens[b], t0,
                   nt, h, sh, out_b, out_stride, scratch, configured);
    }
    if (configured >= 0) _tile_release();
  }
}
#endif  // ARBORLM_AMX

}  // namespace

extern "C" {

int arborlm_abi_version() { return 5; }

// out = rms_norm(x) * weight, or with `residual` non-null: residual += x, then
// out = rms_norm(residual) * weight (`residual` updated in place).
void arborlm_rms_norm(int dtype, const void* x, int64_t x_stride, void* residual, int64_t res_stride,
                      const void* weight, void* out, int64_t out_stride, int64_t rows, int64_t dim, float eps) {
  if (dtype == 0)
    rms_norm_rows(static_cast<const float*>(x), x_stride, static_cast<float*>(residual), res_stride,
                  static_cast<const float*>(weight), static_cast<float*>(out), out_stride, rows, dim, eps);
  else
    rms_norm_rows(static_cast<const uint16_t*>(x), x_stride, static_cast<uint16_t*>(residual), res_stride,
                  static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), out_stride, rows, dim, eps);
}

// out[r, :dim] = silu(gate_up[r, :dim]) * gate_up[r, dim:2*dim].
void arborlm_silu_and_mul(int dtype, const void* gate_up, int64_t in_stride, void* out, int64_t out_stride,
                          int64_t rows, int64_t dim) {
  if (dtype == 0)
    silu_and_mul_rows(static_cast<const float*>(gate_up), in_stride, static_cast<float*>(out), out_stride, rows,
                      dim);
  else
    silu_and_mul_rows(static_cast<const uint16_t*>(gate_up), in_stride, static_cast<uint16_t*>(out), out_stride,
                      rows, dim);
}

void arborlm_rotary(int dtype, void* x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t head_dim,
                    const int64_t* positions, const void* cos_table, const void* sin_table) {
  if (dtype == 0)
    rotary_rows(static_cast<float*>(x), token_stride, tokens, heads, head_dim, positions,
                static_cast<const float*>(cos_table), static_cast<const float*>(sin_table));
  else
    rotary_rows(static_cast<uint16_t*>(x), token_stride, tokens, heads, head_dim, positions,
                static_cast<const uint16_t*>(cos_table), static_cast<const uint16_t*>(sin_table));
}

// q: (batch, q_heads, head_dim) with row stride q_stride; k/v_buffer: (slots,
// kv_heads, head_dim) contiguous, of KV code `kv_dtype` (`decode_attention_kv`; for
// int8, k/v_scale: (slots, kv_heads) fp16, else null); out: (batch, q_heads,
// head_dim) with row stride out_stride. window <= 0 means no sliding window;
// logit_cap <= 0 means none. With `out_cache_loc` non-null (pools of q's dtype
// only), first stores the batch's new K/V (`k_new`, `v_new`: (batch, kv_heads,
// head_dim) with token strides) at those pool slots.
void arborlm_decode_attention(int dtype, int kv_dtype, const void* q, int64_t q_stride, const void* k_buffer,
                              const void* v_buffer, const void* k_scale, const void* v_scale,
                              const int32_t* req_to_token, int64_t req_to_token_stride,
                              const int64_t* req_pool_indices, const int64_t* seq_lens, int64_t batch,
                              int64_t q_heads, int64_t kv_heads, int64_t head_dim, float scale, int64_t window,
                              float logit_cap, void* out, int64_t out_stride, const void* k_new, int64_t k_stride,
                              const void* v_new, int64_t v_stride, const int64_t* out_cache_loc) {
  const int64_t row = kv_heads * head_dim;
  const auto* ks = static_cast<const uint16_t*>(k_scale);
  const auto* vs = static_cast<const uint16_t*>(v_scale);
  if (out_cache_loc && dtype == 0)
    store_kv(static_cast<const float*>(k_new), k_stride, static_cast<const float*>(v_new), v_stride, out_cache_loc,
             batch, row, static_cast<float*>(const_cast<void*>(k_buffer)),
             static_cast<float*>(const_cast<void*>(v_buffer)));
  else if (out_cache_loc)
    store_kv(static_cast<const uint16_t*>(k_new), k_stride, static_cast<const uint16_t*>(v_new), v_stride,
             out_cache_loc, batch, row, static_cast<uint16_t*>(const_cast<void*>(k_buffer)),
             static_cast<uint16_t*>(const_cast<void*>(v_buffer)));
  if (dtype == 0)
    decode_attention_kv(kv_dtype, static_cast<const float*>(q), q_stride, k_buffer, v_buffer, ks, vs, req_to_token,
                        req_to_token_stride, req_pool_indices, seq_lens, batch, q_heads, kv_heads, head_dim, scale,
                        window, logit_cap, static_cast<float*>(out), out_stride);
  else
    decode_attention_kv(kv_dtype, static_cast<const uint16_t*>(q), q_stride, k_buffer, v_buffer, ks, vs,
                        req_to_token, req_to_token_stride, req_pool_indices, seq_lens, batch, q_heads, kv_heads,
                        head_dim, scale, window, logit_cap, static_cast<uint16_t*>(out), out_stride);
}

// Extend attention (`reference.extend_attention`'s semantics) of q / out in `dtype`
// (0 float32, 1 bfloat16) over a pool of KV code `kv_dtype` (as `arborlm_decode_attention`,
// int8 with its fp16 `k_scale` / `v_scale`), K/V read in place in tiles. The new tokens'
// K/V are already stored; extend_starts: each request's first row of q.
void arborlm_extend_attention(int dtype, int kv_dtype, const void* q, int64_t q_stride, const void* k_buffer,
                              const void* v_buffer, const void* k_scale, const void* v_scale,
                              const int32_t* req_to_token, int64_t req_to_token_stride,
                              const int64_t* req_pool_indices, const int64_t* seq_lens, const int64_t* extend_lens,
                              const int64_t* extend_starts, int64_t batch, int64_t q_heads, int64_t kv_heads,
                              int64_t head_dim, float scale, int64_t window, float logit_cap, void* out,
                              int64_t out_stride) {
  const auto* ks = static_cast<const uint16_t*>(k_scale);
  const auto* vs = static_cast<const uint16_t*>(v_scale);
  if (dtype == 0)
    extend_attention_kv(kv_dtype, static_cast<const float*>(q), q_stride, k_buffer, v_buffer, ks, vs, req_to_token,
                        req_to_token_stride, req_pool_indices, seq_lens, extend_lens, extend_starts, batch, q_heads,
                        kv_heads, head_dim, scale, window, logit_cap, static_cast<float*>(out), out_stride);
  else
    extend_attention_kv(kv_dtype, static_cast<const uint16_t*>(q), q_stride, k_buffer, v_buffer, ks, vs,
                        req_to_token, req_to_token_stride, req_pool_indices, seq_lens, extend_lens, extend_starts,
                        batch, q_heads, kv_heads, head_dim, scale, window, logit_cap, static_cast<uint16_t*>(out),
                        out_stride);
}

// `store_kv_int8` for the new K and V of `tokens` tokens (q's dtype `dtype`: 0 float32,
// 1 bfloat16), into one layer of an int8 pool and its scales.
void arborlm_store_kv_int8(int dtype, const void* k_new, int64_t k_stride, const void* v_new, int64_t v_stride,
                           const int64_t* loc, int64_t tokens, int64_t kv_heads, int64_t head_dim, void* k_buffer,
                           void* v_buffer, void* k_scale, void* v_scale) {
  auto* kb = static_cast<int8_t*>(k_buffer);
  auto* vb = static_cast<int8_t*>(v_buffer);
  auto* ks = static_cast<uint16_t*>(k_scale);
  auto* vs = static_cast<uint16_t*>(v_scale);
  if (dtype == 0) {
    store_kv_int8(static_cast<const float*>(k_new), k_stride, loc, tokens, kv_heads, head_dim, kb, ks);
    store_kv_int8(static_cast<const float*>(v_new), v_stride, loc, tokens, kv_heads, head_dim, vb, vs);
  } else {
    store_kv_int8(static_cast<const uint16_t*>(k_new), k_stride, loc, tokens, kv_heads, head_dim, kb, ks);
    store_kv_int8(static_cast<const uint16_t*>(v_new), v_stride, loc, tokens, kv_heads, head_dim, vb, vs);
  }
}

// 1 when the library has the AMX linear layer and the kernel lets this process
// use AMX tiles (Linux asks each process to request them); 0 otherwise.
int arborlm_amx_ready() {
#if defined(ARBORLM_AMX)
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? 1 : 0;
#else
  return 0;
#endif
}

// out (rows, out_features) bf16 = x (rows, in_features) bf16 @ W^T (+ bias), W
// packed by `cpu_ops.pack_amx_weight`; in_features a multiple of 32. Only valid
// after `arborlm_amx_ready()` returned 1.
void arborlm_linear_bf16(const void* x, int64_t x_stride, int64_t rows, int64_t in_features, const void* packed,
                         int64_t out_features, const void* bias, void* out, int64_t out_stride) {
#if defined(ARBORLM_AMX)
  linear_bf16(static_cast<const uint16_t*>(x), x_stride, rows, in_features, static_cast<const uint16_t*>(packed),
              out_features, static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), out_stride);
#endif
}

// Attention of an EXTEND step's new tokens (bf16, AMX): q (tokens, q_heads,
// head_dim) with token stride q_stride, request b's new tokens at rows
// [extend_starts[b], + extend_lens[b]) at positions [seq_lens[b] - extend_lens[b],
// seq_lens[b]); its keys are pool slots req_to_token[req_pool_indices[b], :seq_lens[b]]
// (the new tokens' K/V already stored). head_dim a multiple of 32, q_heads /
// kv_heads at most 32. window <= 0: none; logit_cap <= 0: none. Only valid after
// `arborlm_amx_ready()` returned 1.
void arborlm_extend_attention_bf16(const void* q, int64_t q_stride, const void* k_buffer, const void* v_buffer,
                                   const int32_t* req_to_token, int64_t req_to_token_stride,
                                   const int64_t* req_pool_indices, const int64_t* seq_lens,
                                   const int64_t* extend_lens, const int64_t* extend_starts, int64_t batch,
                                   int64_t q_heads, int64_t kv_heads, int64_t head_dim, float scale, int64_t window,
                                   float logit_cap, void* out, int64_t out_stride) {
#if defined(ARBORLM_AMX)
  const int64_t group = q_heads / kv_heads;
  if (group < 1 || group > 2 * kAmxRows) return;  // refused by `can_extend`: a block could not hold the group
  const ExtendShape shape{q_heads, kv_heads, head_dim, group, 2 * kAmxRows / group, scale, logit_cap, window};
  extend_attention_bf16(static_cast<const uint16_t*>(q), q_stride, static_cast<const uint16_t*>(k_buffer),
                        static_cast<const uint16_t*>(v_buffer), req_to_token, req_to_token_stride, req_pool_indices,
                        seq_lens, extend_lens, extend_starts, batch, shape, static_cast<uint16_t*>(out), out_stride);
#endif
}

}  // extern "C"
