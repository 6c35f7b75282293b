// Dequantize rows of a packed GGUF weight (Q8_0, Q4_0, Q4_1; quant_layout.h) to
// float32 or bf16: the embedding lookup (only the looked-up rows of a quantized
// table) and prefills, whose many rows are faster as one bf16 GEMM over the
// dequantized weight than as int8 dot products.
//
// w[b, i] = d[b] * (q[b, i] - offset) (+ m[b] for Q4_1), llama.cpp's
// `dequantize_row_q8_0 / q4_0 / q4_1` on our reordered bytes (one row's quant
// bytes of a block are 4-byte pieces, 64 bytes apart); OpenMP splits the rows.

#include <cstdint>

#include "quant_layout.h"

using namespace arborlm_quant;

namespace {

// Dequantize row n of W (nb blocks) into y (nb * 32 values, dtype `dtype`).
template <int F>
void dequantize_row(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, int64_t nb, int64_t n, void* y,
                    int dtype) {
  // The quant minus its offset is exact in float, so d * q rounds once, as ggml's does.
  const float offset = static_cast<float>(quant_offset(F));
  for (int64_t b = 0; b < nb; ++b) {
    const float d = f16_to_f32(wd[scale_offset(nb, n, b)]);
    const float m = F == kQ4_1 ? f16_to_f32(wm[scale_offset(nb, n, b)]) : 0.0f;
    const uint8_t* q = wq + quant_byte_offset(F, nb, n, b, 0);
    float v[kBlock];
    for (int64_t j = 0; j < block_bytes(F); ++j) {
      const uint8_t byte = q[(j / 4) * kTile * 4 + j % 4];
      if (F == kQ8_0) {
        v[j] = d * (static_cast<float>(byte) - offset);
      } else {
        v[j] = d * (static_cast<float>(byte & 0x0f) - offset) + m;
        v[j + 16] = d * (static_cast<float>(byte >> 4) - offset) + m;
      }
    }
    for (int64_t i = 0; i < kBlock; ++i) store_value(y, dtype, b * kBlock + i, v[i]);
  }
}

template <int F>
void dequantize_rows(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, int64_t K, const int64_t* rows,
                     int64_t num_rows, void* out, int64_t ldo, int dtype) {
  const int64_t elem = dtype == kF32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (num_rows * K >= (1 << 16))
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t n = rows == nullptr ? r : rows[r];
    dequantize_row<F>(wq, wd, wm, K / kBlock, n, static_cast<char*>(out) + r * ldo * elem, dtype);
  }
}

}  // namespace

extern "C" {

// out (num_rows, K) of dtype `dtype` (row stride ldo elements) = rows `rows` (int64,
// num_rows of them; null = rows 0..num_rows-1) of W (N rows, format `fmt`, arrays as
// in `arborlm_quant_matmul`). Returns 0; -1 for an unknown format; -2 when a row id
// is outside [0, N) (nothing is written then).
int arborlm_quant_dequantize(int fmt, const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, int64_t N,
                             int64_t K, const int64_t* rows, int64_t num_rows, void* out, int64_t ldo, int dtype) {
  if (rows != nullptr) {
    for (int64_t r = 0; r < num_rows; ++r) {
      if (rows[r] < 0 || rows[r] >= N) return -2;
    }
  } else if (num_rows > N) {
    return -2;
  }
  switch (fmt) {
    case kQ8_0: dequantize_rows<kQ8_0>(wq, wd, nullptr, K, rows, num_rows, out, ldo, dtype); return 0;
    case kQ4_0: dequantize_rows<kQ4_0>(wq, wd, nullptr, K, rows, num_rows, out, ldo, dtype); return 0;
    case kQ4_1: dequantize_rows<kQ4_1>(wq, wd, wm, K, rows, num_rows, out, ldo, dtype); return 0;
    default: return -1;
  }
}

}  // extern "C"
