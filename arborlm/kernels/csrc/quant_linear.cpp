// The quantized linear layer: out = x W^T (+ bias) for a weight W kept in its GGUF
// quantization (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; layout in quant_layout.h),
// dequantized in registers, never in memory.
//
// Why: a decode step reads every weight once for a few rows of activations, so
// its time is the bytes it streams; a 4-bit weight streams a quarter of bf16's.
// As in llama.cpp's `ggml_vec_dot_q4_1_q8_1` family, the activations are first
// quantized per block of 32 to int8 with a float scale (and the sum of their
// quants, which carries the weight's offset and min), then each block's dot
// product is integer: VNNI `vpdpbusd` (uint8 weight x int8 activation, 4 products
// per 32-bit lane). The row-tiled layout gives each of 16 output rows its own
// lane, so a block's scales apply to 16 rows at once and a tile's outputs leave
// in one register. Written from the formats' math, not copied.
//
//   y[m, n] = sum_b,h d_w[n,b,h] d_a[m,b] (sum_i q_w[n,b,h,i] q_a[m,b,h,i] - offset s_a[m,b,h])
//             + min_w[n,b] d_a[m,b] (s_a[m,b,0] + s_a[m,b,1])
//
// over blocks b of 32 values and their halves h of 16 (only Q6_K's scales differ
// between the halves; min_w is Q4_1's m or minus a K-quant's dmin m).
//
// OpenMP splits the row tiles; each thread streams its tiles' weights once per
// call, prefetching kPrefetchBlocks blocks ahead, unpacking each block into registers
// once for up to kRowsPerPass activation rows (decode batches fit in L2); on AVX-512
// VNNI calls of 10 rows or more pass over two tiles at once, so that each activation
// broadcast feeds two `vpdpbusd`s (`kPairFromRows`). Builds without AVX-512 VNNI but with
// AVX2 take the same integer sums in 8-row halves of each tile, llama.cpp's AVX2 way
// (`vpmaddubsw` pairs of uint8 x int8 products into int16, then `vpmaddwd` into int32;
// Q8_0's signed weights through the sign trick so that no pair saturates); others
// run them in scalar code.
// Plain C ABI over raw pointers, called through ctypes (`kernels/quant_ops.py`).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_layout.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ARBORLM_QUANT_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ARBORLM_QUANT_AVX2 1
#include <immintrin.h>
#endif

using namespace arborlm_quant;

namespace {

// ---- activations -> int8 blocks ---------------------------------------------

#if defined(ARBORLM_QUANT_AVX512) || defined(ARBORLM_QUANT_AVX2)
#define ARBORLM_QUANT_ROW_LANES 1
// 8 activations from i as float32 (bf16 widened exactly).
inline __m256 load_act8(const void* x, int dtype, int64_t i) {
  if (dtype == kF32) return _mm256_loadu_ps(static_cast<const float*>(x) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline int32_t hsum_i32x8(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1));
  return _mm_cvtsi128_si32(x);
}

// One block of `quantize_row` in 8 lanes, the same values bit for bit: max and min pick
// their second operand on NaN exactly where std::max / std::min keep the scalar code's
// first (a NaN is skipped by amax and clamps to -127), rounding is nearbyint's (to even).
inline void quantize_block8(const void* x, int dtype, int64_t at, int8_t* q, float* d, int32_t* s) {
  __m256 v[4];
  __m256 amax8 = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int j = 0; j < 4; ++j) {
    v[j] = load_act8(x, dtype, at + 8 * j);
    amax8 = _mm256_max_ps(_mm256_and_ps(v[j], abs_mask), amax8);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  __m256i qi[4];
  for (int j = 0; j < 4; ++j) {
    __m256 y = _mm256_max_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)), _mm256_set1_ps(-127.0f));
    y = _mm256_min_ps(y, _mm256_set1_ps(127.0f));
    qi[j] = _mm256_cvttps_epi32(_mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // packs work within 128-bit lanes: granule i (4 bytes) of the result holds values
  // 4i.. of qi[i] for i < 4 and 4 (i - 4) + 4.. of qi[i - 4] after; put them in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  *d = amax / 127.0f;
  s[0] = hsum_i32x8(_mm256_add_epi32(qi[0], qi[1]));
  s[1] = hsum_i32x8(_mm256_add_epi32(qi[2], qi[3]));
}
#endif

// Quantize one row of K values (dtype `dtype`) to int8 blocks, ggml's Q8_0 rule:
// d = max|x| / 127, q = round(x / d); also the sums of q per half block.
void quantize_row(const void* x, int dtype, int64_t K, int8_t* q, float* d, int32_t* s) {
#if defined(ARBORLM_QUANT_ROW_LANES)
  for (int64_t b = 0; b < K / kBlock; ++b) quantize_block8(x, dtype, b * kBlock, q + b * kBlock, d + b, s + 2 * b);
#else
  float v[kBlock];
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float amax = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) {
      v[i] = load_value(x, dtype, b * kBlock + i);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum[2] = {0, 0};
    for (int64_t i = 0; i < kBlock; ++i) {
      // A NaN activation is skipped by amax and clamps to -127; its row's output is garbage either way.
      const int32_t qi = static_cast<int32_t>(std::nearbyint(std::min(127.0f, std::max(-127.0f, v[i] * inv))));
      q[b * kBlock + i] = static_cast<int8_t>(qi);
      sum[i / 16] += qi;
    }
    d[b] = amax / 127.0f;
    s[2 * b] = sum[0];
    s[2 * b + 1] = sum[1];
  }
#endif
}

struct Activations {
  const int8_t* q;   // (M, K), value order
  const float* d;    // (M, K / 32)
  const int32_t* s;  // (M, K / 32, 2): sums per half block
  const float* ds;   // (M, K / 32): d * float(s[0] + s[1]), the min term's factor (as the loops computed it)
};

// Activation rows unpacked against each weight block while it sits in registers.
constexpr int kRowsPerPass = 8;

#if defined(ARBORLM_QUANT_ROW_LANES)
// How many blocks (of 16 rows) ahead the tile loops prefetch the weight stream: a
// decode step reads each weight once, and a call's stream (a few hundred KB per thread)
// ends before the hardware prefetcher reaches full depth; with several activation rows
// per block the loads would otherwise wait between the rows' dot products.
constexpr int64_t kPrefetchBlocks = 8;

// Prefetch block blk's quants, scales and mins (addresses past the end are harmless:
// a prefetch never faults).
template <int F>
inline void prefetch_block(const Weight& w, int64_t blk) {
  const char* q = reinterpret_cast<const char*>(w.q + blk * kTile * block_bytes(F));
  for (int64_t off = 0; off < kTile * block_bytes(F); off += 64) _mm_prefetch(q + off, _MM_HINT_T0);
  if constexpr (!is_k_quant(F)) {
    _mm_prefetch(reinterpret_cast<const char*>(w.d + blk * kTile), _MM_HINT_T0);
    if constexpr (F == kQ4_1) _mm_prefetch(reinterpret_cast<const char*>(w.m + blk * kTile), _MM_HINT_T0);
  }
}

#endif

#if defined(ARBORLM_QUANT_AVX512)
inline __m512 load_f16x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 load_u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 load_i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Block blk's quants of 16 rows, chunk c's in wq[c] (values 4c..4c+3 of each row) and,
// for 4-bit formats, wq[c + 4] (values 16 + 4c..): uint8, offset not removed.
template <int F>
inline void unpack_block(const Weight& w, int64_t blk, __m512i* wq) {
  const uint8_t* q = w.q + blk * kTile * block_bytes(F);
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < (F == kQ8_0 ? 8 : 4); ++c) {
    const __m512i raw = _mm512_loadu_si512(q + c * 64);
    if constexpr (F == kQ8_0) {
      wq[c] = raw;
    } else {
      wq[c] = _mm512_and_si512(raw, low);
      wq[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
  }
  // Each plane's bits are byte masks of the chunks' nibbles: add 16 (32) where set.
  for (int p = 0; p < high_planes(F); ++p) {
    const uint64_t* masks = reinterpret_cast<const uint64_t*>(w.h) + (blk * high_planes(F) + p) * 8;
    const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << p));
    for (int j = 0; j < 8; ++j) {  // j = 2 chunk + half
      uint64_t mask;
      std::memcpy(&mask, masks + j, 8);
      __m512i& v = wq[j / 2 + 4 * (j % 2)];
      v = _mm512_mask_add_epi8(v, mask, v, bit);
    }
  }
}

// The block's scales of 16 rows per half (equal but for Q6_K) and min per unit input sum.
struct BlockScales {
  __m512 d[2];
  __m512 min;
};

template <int F>
inline BlockScales block_scales(const Weight& w, int64_t t, int64_t nb, int64_t b, const __m512& dsup,
                                const __m512& msup) {
  const int64_t blk = t * nb + b;
  BlockScales s;
  s.min = _mm512_setzero_ps();
  if constexpr (F == kQ6_K) {
    s.d[0] = _mm512_mul_ps(dsup, load_i8x16(w.sc + (2 * blk) * kTile));
    s.d[1] = _mm512_mul_ps(dsup, load_i8x16(w.sc + (2 * blk + 1) * kTile));
    return s;
  } else if constexpr (is_k_quant(F)) {
    s.d[0] = s.d[1] = _mm512_mul_ps(dsup, load_u8x16(w.sc + blk * kTile));
    s.min = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(msup, load_u8x16(w.sm + blk * kTile)));
  } else {
    s.d[0] = s.d[1] = load_f16x16(w.d + blk * kTile);
    if constexpr (F == kQ4_1) s.min = load_f16x16(w.m + blk * kTile);
  }
  return s;
}

// With few rows two chains of `vpdpbusd` hide its latency; with more the rows
// interleave, and one chain saves each row an add (integer sums: the same bits).
template <int F, int R>
constexpr int kChains = (F == kQ6_K || R < 4) ? 2 : 1;

// Row m's sums over block b of T weight tiles at once (wq[u]: tile u's unpacked block,
// sc[u] its scales): acc[u * stride] += tile u's part of y[m, :]. Each activation broadcast
// feeds the T tiles' `vpdpbusd`s: the broadcasts, not the `vpdpbusd`s, bound the
// loop at one tile (docs/kernels.md). Every tile's operations are those of T = 1 in
// the same order, so its bits do not depend on T.
template <int F, int R, int T>
inline void row_block(const __m512i (&wq)[T][8], const BlockScales (&sc)[T], const Activations& a, int64_t K,
                      int64_t nb, int64_t b, int64_t m, __m512* acc, int stride) {
  constexpr int chains = kChains<F, R>;
  const int8_t* x = a.q + m * K + b * kBlock;
  const int32_t* s = a.s + (m * nb + b) * 2;
  const __m512 da = _mm512_set1_ps(a.d[m * nb + b]);
  __m512i dot[T][2];
  for (int u = 0; u < T; ++u) dot[u][0] = dot[u][1] = _mm512_setzero_si512();
  for (int c = 0; c < 8; ++c) {  // chunks 0-3 are values 0-15, 4-7 values 16-31
    const __m512i xb = _mm512_set1_epi32(load_i32(x + 4 * c));
    for (int u = 0; u < T; ++u) {
      __m512i& chain = dot[u][chains == 2 ? c / 4 : 0];
      chain = _mm512_dpbusd_epi32(chain, wq[u][c], xb);
    }
  }
  for (int u = 0; u < T; ++u) {
    __m512& out = acc[u * stride];
    if constexpr (F == kQ6_K) {  // two scales: each half on its own
      for (int h = 0; h < 2; ++h) {
        const __m512i q = _mm512_sub_epi32(dot[u][h], _mm512_set1_epi32(quant_offset(F) * s[h]));
        out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_mul_ps(sc[u].d[h], da), out);
      }
    } else {
      __m512i q = chains == 2 ? _mm512_add_epi32(dot[u][0], dot[u][1]) : dot[u][0];
      if constexpr (quant_offset(F) != 0) q = _mm512_sub_epi32(q, _mm512_set1_epi32(quant_offset(F) * (s[0] + s[1])));
      out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_mul_ps(sc[u].d[0], da), out);
      if constexpr (F == kQ4_1 || F == kQ4_K || F == kQ5_K) {
        out = _mm512_fmadd_ps(sc[u].min, _mm512_set1_ps(a.ds[m * nb + b]), out);
      }
    }
  }
}

// T adjacent 16-row tiles from t x R activation rows: acc[u * R + r] lane l = y[m0 + r, 16 (t + u) + l].
template <int F, int R, int T>
void tile_rows(const Weight& w, int64_t t, int64_t nb, const Activations& a, int64_t K, int64_t m0, __m512* acc) {
  for (int i = 0; i < T * R; ++i) acc[i] = _mm512_setzero_ps();
  __m512 dsup[T], msup[T];
  for (int u = 0; u < T; ++u) dsup[u] = msup[u] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i wq[T][8];
    BlockScales sc[T];
    for (int u = 0; u < T; ++u) {
      if constexpr (is_k_quant(F)) {
        if (b % kSuper == 0) {  // a new super-block: its d (and dmin) for 16 rows
          const int64_t sup = (t + u) * (nb / kSuper) + b / kSuper;
          dsup[u] = load_f16x16(w.d + sup * kTile);
          if constexpr (F != kQ6_K) msup[u] = load_f16x16(w.m + sup * kTile);
        }
      }
      prefetch_block<F>(w, (t + u) * nb + b + kPrefetchBlocks);
      unpack_block<F>(w, (t + u) * nb + b, wq[u]);
      sc[u] = block_scales<F>(w, t + u, nb, b, dsup[u], msup[u]);
    }
    for (int r = 0; r < R; ++r) row_block<F, R, T>(wq, sc, a, K, nb, b, m0 + r, acc + r, R);
  }
}

// Round 16 float32 to bf16 as `f32_to_bf16` does (nearest even, NaN kept quiet).
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(rounded);
}

// y + bias into the first `cols` columns of out row (dtype `dtype`).
inline void store_tile(__m512 y, const void* bias, int64_t n0, int64_t cols, void* out, int dtype) {
  const __mmask16 mask = static_cast<__mmask16>(cols >= kTile ? 0xffff : (1u << cols) - 1);
  if (bias != nullptr) {
    const __m512 bv = dtype == kF32
        ? _mm512_maskz_loadu_ps(mask, static_cast<const float*>(bias) + n0)
        : _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(bias) + n0)), 16));
    y = _mm512_add_ps(y, bv);
  }
  if (dtype == kF32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + n0, mask, y);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + n0, mask, to_bf16(y));
  }
}

// T adjacent tiles from t (T = 2: paired tiles, `kPairFromRows`; see `row_block`).
template <int F, int R, int T = 1>
void run_tile(const Weight& w, int64_t t, int64_t nb, const Activations& a, int64_t K, int64_t m0, int64_t N,
              const void* bias, void* out, int64_t ldo, int dtype) {
  __m512 acc[T * R];
  tile_rows<F, R, T>(w, t, nb, a, K, m0, acc);
  const int64_t elem = dtype == kF32 ? 4 : 2;
  for (int u = 0; u < T; ++u)
    for (int r = 0; r < R; ++r) {
      void* row = static_cast<char*>(out) + (m0 + r) * ldo * elem;
      store_tile(acc[u * R + r], bias, (t + u) * kTile, N - (t + u) * kTile, row, dtype);
    }
}
#elif defined(ARBORLM_QUANT_AVX2)
// ---- AVX2: each 16-row tile as two halves of 8 rows, one per 32-bit lane --------
//
// A block's chunk c of 64 bytes (values 4c..4c+3 of rows 0-15, `quant_byte_offset`) is
// two 32-byte halves, rows 0-7 and 8-15. `vpmaddubsw` (uint8 weight x int8 activation,
// adjacent pairs summed into int16) saturates past 32767: a pair of 4-bit quants is at
// most 2 x 15 x 127, so several chunks add up in int16 before `vpmaddwd` widens them
// (`chunks_per_i16`); Q8_0's quants are taken signed (stored + 128 ^ 0x80) as
// |w| x sign(a, w), at most 2 x 128 x 127 per pair. The integer sums equal the
// AVX-512 loops' exactly; scales and the float accumulation are the same operations.

inline __m256 load_f16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 load_u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 load_i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Byte i of the result is 0xff where bit i of `bits` is set.
inline __m256i byte_mask(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select);
}

// Chunks (of 4 values) whose `vpmaddubsw` pairs add up in int16 without saturating.
constexpr int chunks_per_i16(int fmt) {
  return fmt == kQ8_0 ? 1 : fmt == kQ6_K ? 2 : 4;  // pairs of at most 2*128*127, 2*63*127, 2*31*127
}

// Half `half` (rows 8 half .. 8 half + 7) of block blk's quants: chunk c in wq[c] and, for
// 4-bit formats, wq[c + 4] (values 16 + 4c..), uint8 with the offset not removed; Q8_0's
// signed.
template <int F>
inline void unpack_half(const Weight& w, int64_t blk, int half, __m256i* wq) {
  const uint8_t* q = w.q + blk * kTile * block_bytes(F) + 32 * half;
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int c = 0; c < (F == kQ8_0 ? 8 : 4); ++c) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 64));
    if constexpr (F == kQ8_0) {
      wq[c] = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80)));
    } else {
      wq[c] = _mm256_and_si256(raw, low);
      wq[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
  }
  for (int p = 0; p < high_planes(F); ++p) {
    const uint64_t* masks = reinterpret_cast<const uint64_t*>(w.h) + (blk * high_planes(F) + p) * 8;
    const __m256i bit = _mm256_set1_epi8(static_cast<char>(16 << p));
    for (int j = 0; j < 8; ++j) {  // j = 2 chunk + half of the values
      uint64_t mask;
      std::memcpy(&mask, masks + j, 8);
      __m256i& v = wq[j / 2 + 4 * (j % 2)];
      v = _mm256_add_epi8(v, _mm256_and_si256(byte_mask(static_cast<uint32_t>(mask >> (32 * half))), bit));
    }
  }
}

struct BlockScales8 {
  __m256 d[2];
  __m256 min;
};

template <int F>
inline BlockScales8 block_scales_half(const Weight& w, int64_t t, int64_t nb, int64_t b, int half, const __m256& dsup,
                                      const __m256& msup) {
  const int64_t blk = t * nb + b, at = 8 * half;
  BlockScales8 s;
  s.min = _mm256_setzero_ps();
  if constexpr (F == kQ6_K) {
    s.d[0] = _mm256_mul_ps(dsup, load_i8x8(w.sc + (2 * blk) * kTile + at));
    s.d[1] = _mm256_mul_ps(dsup, load_i8x8(w.sc + (2 * blk + 1) * kTile + at));
    return s;
  } else if constexpr (is_k_quant(F)) {
    s.d[0] = s.d[1] = _mm256_mul_ps(dsup, load_u8x8(w.sc + blk * kTile + at));
    s.min = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(msup, load_u8x8(w.sm + blk * kTile + at)));
  } else {
    s.d[0] = s.d[1] = load_f16x8(w.d + blk * kTile + at);
    if constexpr (F == kQ4_1) s.min = load_f16x8(w.m + blk * kTile + at);
  }
  return s;
}

// Sum over chunks [c0, c0 + n) of the 4-value dot products, per row lane (int32).
template <int F>
inline __m256i chunk_dots(const __m256i* wq, const int8_t* x, int c0, int n) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i total = _mm256_setzero_si256();
  for (int g = c0; g < c0 + n; g += chunks_per_i16(F)) {
    __m256i pairs = _mm256_setzero_si256();
    for (int c = g; c < g + chunks_per_i16(F); ++c) {
      const __m256i xa = _mm256_set1_epi32(load_i32(x + 4 * c));
      if constexpr (F == kQ8_0) {
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(_mm256_sign_epi8(wq[c], wq[c]), _mm256_sign_epi8(xa, wq[c])));
      } else {
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(wq[c], xa));
      }
    }
    total = _mm256_add_epi32(total, _mm256_madd_epi16(pairs, ones));
  }
  return total;
}

// One half tile (8 rows) x R activation rows: acc[r] lane l = y[m0 + r, 16 t + 8 half + l].
template <int F, int R>
void half_tile_rows(const Weight& w, int64_t t, int64_t nb, const Activations& a, int64_t K, int64_t m0, int half,
                    __m256* acc) {
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  __m256 dsup = _mm256_setzero_ps(), msup = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (is_k_quant(F)) {
      if (b % kSuper == 0) {
        const int64_t sup = t * (nb / kSuper) + b / kSuper;
        dsup = load_f16x8(w.d + sup * kTile + 8 * half);
        if constexpr (F != kQ6_K) msup = load_f16x8(w.m + sup * kTile + 8 * half);
      }
    }
    if (half == 0) prefetch_block<F>(w, t * nb + b + kPrefetchBlocks);
    __m256i wq[8];
    unpack_half<F>(w, t * nb + b, half, wq);
    const BlockScales8 sc = block_scales_half<F>(w, t, nb, b, half, dsup, msup);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int8_t* x = a.q + m * K + b * kBlock;
      const int32_t* s = a.s + (m * nb + b) * 2;
      const __m256 da = _mm256_set1_ps(a.d[m * nb + b]);
      // Q8_0's products are signed already: no offset to take off.
      constexpr int32_t offset = F == kQ8_0 ? 0 : quant_offset(F);
      if constexpr (F == kQ6_K) {  // two scales: each half of the values on its own
        for (int h = 0; h < 2; ++h) {
          const __m256i q = _mm256_sub_epi32(chunk_dots<F>(wq, x, 4 * h, 4), _mm256_set1_epi32(offset * s[h]));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(sc.d[h], da), acc[r]);
        }
      } else {
        __m256i q = _mm256_add_epi32(chunk_dots<F>(wq, x, 0, 4), chunk_dots<F>(wq, x, 4, 4));
        if constexpr (offset != 0) q = _mm256_sub_epi32(q, _mm256_set1_epi32(offset * (s[0] + s[1])));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(sc.d[0], da), acc[r]);
        if constexpr (F == kQ4_1 || F == kQ4_K || F == kQ5_K) {
          acc[r] = _mm256_fmadd_ps(sc.min, _mm256_set1_ps(a.ds[m * nb + b]), acc[r]);
        }
      }
    }
  }
}

template <int F, int R, int T = 1>
void run_tile(const Weight& w, int64_t t, int64_t nb, const Activations& a, int64_t K, int64_t m0, int64_t N,
              const void* bias, void* out, int64_t ldo, int dtype) {
  static_assert(T == 1, "tiles pair up on AVX-512 VNNI only");
  for (int half = 0; half < 2; ++half) {
    const int64_t n0 = t * kTile + 8 * half, cols = std::min<int64_t>(8, N - n0);
    if (cols <= 0) return;
    __m256 acc[R];
    half_tile_rows<F, R>(w, t, nb, a, K, m0, half, acc);
    for (int r = 0; r < R; ++r) {
      alignas(32) float y[8];
      _mm256_store_ps(y, acc[r]);
      for (int64_t l = 0; l < cols; ++l) {
        const float bn = bias == nullptr ? 0.0f : load_value(bias, dtype, n0 + l);
        store_value(out, dtype, (m0 + r) * ldo + n0 + l, y[l] + bn);
      }
    }
  }
}
#else
// The same sums in scalar code, one output at a time.
template <int F>
float dot(const Weight& w, int64_t n, int64_t nb, const Activations& a, int64_t m, int64_t K) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const int32_t* s = a.s + (m * nb + b) * 2;
    const float da = a.d[m * nb + b];
    for (int h = 0; h < 2; ++h) {
      int32_t sum = 0;
      for (int64_t i = 16 * h; i < 16 * h + 16; ++i) sum += quant_at<F>(w, nb, n, b, i) * a.q[m * K + b * kBlock + i];
      sum -= quant_offset(F) * s[h];
      acc += static_cast<float>(sum) * (scale_at<F>(w, nb, n, b, h) * da);
    }
    acc += min_at<F>(w, nb, n, b) * (da * static_cast<float>(s[0] + s[1]));
  }
  return acc;
}

template <int F, int R, int T = 1>
void run_tile(const Weight& w, int64_t t, int64_t nb, const Activations& a, int64_t K, int64_t m0, int64_t N,
              const void* bias, void* out, int64_t ldo, int dtype) {
  static_assert(T == 1, "tiles pair up on AVX-512 VNNI only");
  for (int64_t n = t * kTile; n < std::min(N, (t + 1) * kTile); ++n) {
    const float bn = bias == nullptr ? 0.0f : load_value(bias, dtype, n);
    for (int r = 0; r < R; ++r) store_value(out, dtype, (m0 + r) * ldo + n, dot<F>(w, n, nb, a, m0 + r, K) + bn);
  }
}
#endif

// ---- the layer ---------------------------------------------------------------

// Every row of tiles [t, t + T): passes of 2 kRowsPerPass rows (AVX-512), then of
// kRowsPerPass, then the rest in one pass.
template <int F, int T>
void run_rows(const Weight& w, int64_t t, int64_t nb, const Activations& a, int64_t M, int64_t K, int64_t N,
              const void* bias, void* out, int64_t ldo, int dtype) {
  int64_t m0 = 0;
#if defined(ARBORLM_QUANT_AVX512)
  // Twice the rows per unpacked block where the call has them: 4-5% less time at 16 and 32
  // rows over the default model's weights (`bench_quant_stream.py`, a 2-core AVX-512 VM).
  for (; m0 + 2 * kRowsPerPass <= M; m0 += 2 * kRowsPerPass)
    run_tile<F, 2 * kRowsPerPass, T>(w, t, nb, a, K, m0, N, bias, out, ldo, dtype);
#endif
  for (; m0 + kRowsPerPass <= M; m0 += kRowsPerPass)
    run_tile<F, kRowsPerPass, T>(w, t, nb, a, K, m0, N, bias, out, ldo, dtype);
  switch (M - m0) {
    case 7: run_tile<F, 7, T>(w, t, nb, a, K, m0, N, bias, out, ldo, dtype); break;
    case 6: run_tile<F, 6, T>(w, t, nb, a, K, m0, N, bias, out, ldo, dtype); break;
    case 5: run_tile<F, 5, T>(w, t, nb, a, K, m0, N, bias, out, ldo, dtype); break;
    case 4: run_tile<F, 4, T>(w, t, nb, a, K, m0, N, bias, out, ldo, dtype); break;
    case 3: run_tile<F, 3, T>(w, t, nb, a, K, m0, N, bias, out, ldo, dtype); break;
    case 2: run_tile<F, 2, T>(w, t, nb, a, K, m0, N, bias, out, ldo, dtype); break;
    case 1: run_tile<F, 1, T>(w, t, nb, a, K, m0, N, bias, out, ldo, dtype); break;
    default: break;
  }
}

// On AVX-512 VNNI a call of kPairFromRows rows or more runs every pass over two adjacent
// tiles at once: each activation broadcast feeds both tiles' `vpdpbusd`s (`row_block`),
// where one tile's loop waits on the broadcasts. Over the default model's weights
// (`bench_quant_stream.py`, a 2-core Ice Lake VM) two tiles took 0.81-0.90x one tile's
// time at 16-128 rows and 0.85-0.96x at 10-12; from 4 to 9 rows no gain could be told
// from that benchmark's own offset between two builds (up to 7 %, the same code on both
// sides), so fewer rows keep one tile. A row's sums are the same operations in any pass,
// so its bits do not change.
#if defined(ARBORLM_QUANT_AVX512)
constexpr int64_t kPairFromRows = 10;
#else
constexpr int64_t kPairFromRows = 0;  // 0: one tile per pass
#endif

template <int F>
void matmul(const Activations& a, int64_t M, int64_t K, const Weight& w, int64_t N, const void* bias, void* out,
            int64_t ldo, int dtype) {
  const int64_t nb = K / kBlock, tiles = (N + kTile - 1) / kTile;
  const int64_t per_group = kPairFromRows > 0 && M >= kPairFromRows ? 2 : 1, groups = (tiles + per_group - 1) / per_group;
  // guided: each thread first takes a long contiguous run of tiles (one weight stream, as
  // with static), then ever smaller pieces, so a thread the VM slowed down does not hold
  // the other at the barrier; static measured 1.0-1.13x guided's time at 1-32 rows
  // (`bench_quant_stream.py`, 2-core Ice Lake VM), dynamic chunks of 2 or 4 groups
  // 1.04-1.15x static's (they break the streams). Which thread runs a tile never changes
  // its bits.
#pragma omp parallel for schedule(guided)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t t = g * per_group, n = std::min(per_group, tiles - t);
    if constexpr (kPairFromRows > 0) {
      if (n == 2) {
        run_rows<F, 2>(w, t, nb, a, M, K, N, bias, out, ldo, dtype);
        continue;
      }
    }
    for (int64_t u = 0; u < n; ++u) run_rows<F, 1>(w, t + u, nb, a, M, K, N, bias, out, ldo, dtype);
  }
}

int matmul_format(int fmt, const Activations& a, int64_t M, int64_t K, const Weight& w, int64_t N, const void* bias,
                  void* out, int64_t ldo, int dtype) {
  switch (fmt) {
    case kQ8_0: matmul<kQ8_0>(a, M, K, w, N, bias, out, ldo, dtype); return 0;
    case kQ4_0: matmul<kQ4_0>(a, M, K, w, N, bias, out, ldo, dtype); return 0;
    case kQ4_1: matmul<kQ4_1>(a, M, K, w, N, bias, out, ldo, dtype); return 0;
    case kQ4_K: matmul<kQ4_K>(a, M, K, w, N, bias, out, ldo, dtype); return 0;
    case kQ5_K: matmul<kQ5_K>(a, M, K, w, N, bias, out, ldo, dtype); return 0;
    case kQ6_K: matmul<kQ6_K>(a, M, K, w, N, bias, out, ldo, dtype); return 0;
    default: return -1;
  }
}

// The activations of a call, quantized into the calling thread's buffers (kept between calls).
Activations quantize_activations(const void* x, int64_t ldx, int dtype, int64_t M, int64_t K) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int32_t> s;
  thread_local std::vector<float> ds;
  const int64_t nb = K / kBlock, elem = dtype == kF32 ? 4 : 2;
  q.resize(static_cast<size_t>(M * K));
  d.resize(static_cast<size_t>(M * nb));
  s.resize(static_cast<size_t>(M * nb * 2));
  ds.resize(static_cast<size_t>(M * nb));
  // Plain pointers: inside the parallel loop `q` would name each OpenMP thread's own buffer.
  int8_t* qp = q.data();
  float* dp = d.data();
  int32_t* sp = s.data();
  float* dsp = ds.data();
#pragma omp parallel for schedule(static) if (M * K >= (1 << 15))
  for (int64_t m = 0; m < M; ++m) {
    quantize_row(static_cast<const char*>(x) + m * ldx * elem, dtype, K, qp + m * K, dp + m * nb, sp + m * nb * 2);
    for (int64_t b = 0; b < nb; ++b) {
      dsp[m * nb + b] = dp[m * nb + b] * static_cast<float>(sp[(m * nb + b) * 2] + sp[(m * nb + b) * 2 + 1]);
    }
  }
  return Activations{qp, dp, sp, dsp};
}

}  // namespace

extern "C" {

int arborlm_quant_abi_version() { return 2; }

// 1 when this build runs the AVX-512 VNNI loops, 2 the AVX2 ones, 0 the scalar ones.
int arborlm_quant_simd() {
#if defined(ARBORLM_QUANT_AVX512)
  return 1;
#elif defined(ARBORLM_QUANT_AVX2)
  return 2;
#else
  return 0;
#endif
}

// The whole layer in one call (what `quant_ops.NativeQuantOps.linear` calls, once per
// projection): quantize x (M, K) of dtype `dtype` (row stride ldx elements; K a
// multiple of 32) once, then for each of `num_parts` weights stacked by rows (format
// fmts[p], its arrays ptrs[6p..6p+5] = qs, scales, mins, highbits, sub_scales,
// sub_mins (0 where the format has none; quant_layout.h), Ns[p] rows) write its
// columns of out (M, sum Ns) of `dtype` (row stride ldo), adding its slice of bias
// ((sum Ns,) of `dtype`, or null). Returns 0, or -1 for an unknown format (the parts
// before it are written).
int arborlm_quant_linear(const void* x, int64_t ldx, int dtype, int64_t M, int64_t K, int64_t num_parts,
                         const int32_t* fmts, const uint64_t* ptrs, const int64_t* Ns, const void* bias, void* out,
                         int64_t ldo) {
  const Activations a = quantize_activations(x, ldx, dtype, M, K);
  const int64_t elem = dtype == kF32 ? 4 : 2;
  int64_t col = 0;
  for (int64_t p = 0; p < num_parts; ++p) {
    const uint64_t* arrays = ptrs + 6 * p;
    const Weight w{reinterpret_cast<const uint8_t*>(arrays[0]), reinterpret_cast<const uint16_t*>(arrays[1]),
                   reinterpret_cast<const uint16_t*>(arrays[2]), reinterpret_cast<const uint8_t*>(arrays[3]),
                   reinterpret_cast<const uint8_t*>(arrays[4]), reinterpret_cast<const uint8_t*>(arrays[5])};
    const char* part_bias = bias == nullptr ? nullptr : static_cast<const char*>(bias) + col * elem;
    const int status = matmul_format(fmts[p], a, M, K, w, Ns[p], part_bias, static_cast<char*>(out) + col * elem,
                                     ldo, dtype);
    if (status != 0) return status;
    col += Ns[p];
  }
  return 0;
}

}  // extern "C"
