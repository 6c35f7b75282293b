// bf16 linear layer for decode-sized batches on AVX-512 BF16 CPUs without AMX.
//
// Why: at a decode step's few rows oneDNN's bf16 GEMM streams the weights well
// below the memory's speed on this kind of CPU (per-call setup, blocking tuned
// for larger batches). This kernel reads each weight once per call: the weight
// is packed at load into blocks of 16 output columns with pairs of input
// features interleaved (the VNNI layout `vdpbf16ps` reads; `kernels/linear_avx512.py`
// packs it), and up to 4 rows share each pass over a 64-column tile.
//
// Summation order: within each block of `k_block` input features, one float32
// accumulator per output takes x[2i] w[2i] + x[2i+1] w[2i+1] pair after pair
// (one `vdpbf16ps`), and the blocks' sums are added in order; then one rounding
// to bf16 (nearest even), after the bias. With the block the caller picks
// (`linear_avx512.k_block_for`: 512, or 1024 for K > 1024) that is the order
// oneDNN's avx512_core_bf16 GEMM takes on the default model's shapes at decode
// sizes (measured: bit-identical there), so greedy tokens do not move; elsewhere
// the two may differ in the last bit of a few outputs, as two float32 summation
// orders do.
//
// Plain C ABI over raw pointers, called through ctypes (`kernels/cpu_gemv.py`).
// Strides are in elements.

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define ARBORLM_AVX512_BF16 1
#endif

namespace {

constexpr int64_t kBlockN = 16;  // output columns per VNNI block (one zmm of float32)
constexpr int64_t kTileBlocks = 4;  // blocks per tile: 64 columns, 4 accumulators per row
constexpr int64_t kTileRows = 4;  // rows sharing one pass over a tile's weights

#if ARBORLM_AVX512_BF16
inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_value(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rows [r0, r0 + R) times the blocks [b0, b0 + nb) of the packed weight.
template <int R>
void tile(const uint16_t* x, int64_t x_stride, int64_t r0, int64_t K, int64_t k_block, const uint16_t* packed,
          int64_t b0, int64_t nb, const uint16_t* bias, uint16_t* out, int64_t out_stride) {
  __m512 total[R][kTileBlocks];
  for (int r = 0; r < R; ++r)
    for (int64_t b = 0; b < kTileBlocks; ++b) total[r][b] = _mm512_setzero_ps();
  const int64_t block_elems = K * kBlockN;  // bf16 per packed block of 16 columns
  for (int64_t k0 = 0; k0 < K; k0 += k_block) {
    const int64_t k1 = k0 + k_block < K ? k0 + k_block : K;
    __m512 acc[R][kTileBlocks];
    for (int r = 0; r < R; ++r)
      for (int64_t b = 0; b < kTileBlocks; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 2) {
      __m512bh w[kTileBlocks];
      for (int64_t b = 0; b < nb; ++b)
        w[b] = (__m512bh)_mm512_loadu_si512(packed + (b0 + b) * block_elems + k * kBlockN);
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, x + (r0 + r) * x_stride + k, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int64_t b = 0; b < nb; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xb, w[b]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t b = 0; b < nb; ++b) total[r][b] = _mm512_add_ps(total[r][b], acc[r][b]);
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      alignas(64) float v[kBlockN];
      _mm512_store_ps(v, total[r][b]);
      uint16_t* o = out + (r0 + r) * out_stride + (b0 + b) * kBlockN;
      const int64_t n0 = (b0 + b) * kBlockN;
      for (int64_t j = 0; j < kBlockN; ++j)
        o[j] = round_bf16(bias == nullptr ? v[j] : v[j] + bf16_value(bias[n0 + j]));
    }
  }
}
#endif

}  // namespace

extern "C" {

int arborlm_gemv_abi_version() { return 2; }

// 1 when this build has the kernel (the CPU has AVX-512 BF16), else 0.
int arborlm_linear_bf16_avx512_ready() {
#if ARBORLM_AVX512_BF16
  return 1;
#else
  return 0;
#endif
}

// out[r, n] = bf16(sum_k x[r, k] w[n, k] (+ bias[n])) for r < rows, n < N. packed:
// N / 16 blocks of K / 2 pairs of 16 columns x 2 features, block b holding
// packed[b][i][j][t] = w[16 b + j][2 i + t]; N % 16 == 0, K % 2 == 0. bias: N bf16 or null.
// k_block: input features summed apart (even, > 0) before the blocks' sums are added.
void arborlm_linear_bf16_avx512(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t K, int64_t k_block,
                                const uint16_t* packed, int64_t N, const uint16_t* bias, uint16_t* out,
                                int64_t out_stride) {
#if ARBORLM_AVX512_BF16
  const int64_t num_blocks = N / kBlockN;
  const int64_t num_tiles = (num_blocks + kTileBlocks - 1) / kTileBlocks;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t b0 = t * kTileBlocks;
    const int64_t nb = num_blocks - b0 < kTileBlocks ? num_blocks - b0 : kTileBlocks;
    int64_t r = 0;
    for (; r + kTileRows <= rows; r += kTileRows)
      tile<kTileRows>(x, x_stride, r, K, k_block, packed, b0, nb, bias, out, out_stride);
    for (; r < rows; ++r) tile<1>(x, x_stride, r, K, k_block, packed, b0, nb, bias, out, out_stride);
  }
#else
  (void)x; (void)x_stride; (void)rows; (void)K; (void)k_block; (void)packed; (void)N; (void)bias; (void)out; (void)out_stride;
#endif
}

}  // extern "C"
