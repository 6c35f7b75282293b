// Dequantize rows of a packed GGUF weight (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K;
// quant_layout.h) to float32 or bf16: the embedding lookup (only the looked-up rows
// of a quantized table) and prefills, whose many rows are faster as one bf16 GEMM
// over the dequantized weight than as int8 dot products.
//
// llama.cpp's `dequantize_row_*` on our reordered bytes, the same float operations
// in the same order (the quant minus its offset is exact in float): Q8_0 d q, Q4_0
// d (q - 8), Q4_1 d q + m, Q4_K / Q5_K (d sc) q - dmin m, Q6_K (d sc) (q - 32).
// OpenMP splits the rows.

#include <cstdint>

#include "quant_layout.h"

using namespace arborlm_quant;

namespace {

// Dequantize row n of W (nb blocks) into y (nb * 32 values, dtype `dtype`).
template <int F>
void dequantize_row(const Weight& w, int64_t nb, int64_t n, void* y, int dtype) {
  const float offset = static_cast<float>(quant_offset(F));
  for (int64_t b = 0; b < nb; ++b) {
    const float scale[2] = {scale_at<F>(w, nb, n, b, 0), scale_at<F>(w, nb, n, b, 1)};
    const float min = min_at<F>(w, nb, n, b);
    for (int64_t i = 0; i < kBlock; ++i) {
      const float q = static_cast<float>(quant_at<F>(w, nb, n, b, i)) - offset;
      // Q8_0, Q4_0 and Q6_K have no min: ggml's value is the product alone (no + 0.0f,
      // which would turn a -0.0f into +0.0f).
      const float v = F == kQ4_1 || F == kQ4_K || F == kQ5_K ? scale[i / 16] * q + min : scale[i / 16] * q;
      store_value(y, dtype, b * kBlock + i, v);
    }
  }
}

template <int F>
void dequantize_rows(const Weight& w, int64_t K, const int64_t* rows, int64_t num_rows, void* out, int64_t ldo,
                     int dtype) {
  const int64_t elem = dtype == kF32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (num_rows * K >= (1 << 16))
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t n = rows == nullptr ? r : rows[r];
    dequantize_row<F>(w, K / kBlock, n, static_cast<char*>(out) + r * ldo * elem, dtype);
  }
}

}  // namespace

extern "C" {

// out (num_rows, K) of dtype `dtype` (row stride ldo elements) = rows `rows` (int64,
// num_rows of them; null = rows 0..num_rows-1) of W (N rows of format `fmt`; its six
// arrays as in `arborlm_quant_linear`, `arrays`). Returns 0; -1 for an unknown format;
// -2 when a row id is outside [0, N) (nothing is written then).
int arborlm_quant_dequantize(int fmt, const uint64_t* arrays, int64_t N, int64_t K, const int64_t* rows,
                             int64_t num_rows, void* out, int64_t ldo, int dtype) {
  if (rows != nullptr) {
    for (int64_t r = 0; r < num_rows; ++r) {
      if (rows[r] < 0 || rows[r] >= N) return -2;
    }
  } else if (num_rows > N) {
    return -2;
  }
  const Weight w{reinterpret_cast<const uint8_t*>(arrays[0]), reinterpret_cast<const uint16_t*>(arrays[1]),
                 reinterpret_cast<const uint16_t*>(arrays[2]), reinterpret_cast<const uint8_t*>(arrays[3]),
                 reinterpret_cast<const uint8_t*>(arrays[4]), reinterpret_cast<const uint8_t*>(arrays[5])};
  switch (fmt) {
    case kQ8_0: dequantize_rows<kQ8_0>(w, K, rows, num_rows, out, ldo, dtype); return 0;
    case kQ4_0: dequantize_rows<kQ4_0>(w, K, rows, num_rows, out, ldo, dtype); return 0;
    case kQ4_1: dequantize_rows<kQ4_1>(w, K, rows, num_rows, out, ldo, dtype); return 0;
    case kQ4_K: dequantize_rows<kQ4_K>(w, K, rows, num_rows, out, ldo, dtype); return 0;
    case kQ5_K: dequantize_rows<kQ5_K>(w, K, rows, num_rows, out, ldo, dtype); return 0;
    case kQ6_K: dequantize_rows<kQ6_K>(w, K, rows, num_rows, out, ldo, dtype); return 0;
    default: return -1;
  }
}

}  // extern "C"
