// The packed layout of GGUF-quantized weights that `quant_linear.cpp` and
// `quant_dequant.cpp` read (written by `kernels/quant_ops.py::pack_ggml_blocks`).
//
// ggml stores a row as blocks of 32 values, each block its scale (and min) then
// its quants (llama.cpp `ggml-common.h`: block_q8_0 = {fp16 d; int8 qs[32]},
// block_q4_0 = {fp16 d; uint8 qs[16]}, block_q4_1 = {fp16 d, m; uint8 qs[16]};
// a q4 byte j holds value j in its low nibble and value j + 16 in its high one).
// We keep the same bits, reordered for AVX-512: rows go in tiles of kTile = 16
// (the last tile padded with zero rows), and within a tile block b of all 16
// rows is stored together, ordered (chunk, row, 4 bytes), chunk c being ggml's
// quant bytes 4c..4c+3. One 64-byte load then holds 4 quant bytes of each of 16
// rows, so a VNNI dot product against 4 activation bytes broadcast to every lane
// adds 4 products into each row's own 32-bit lane: after all chunks a register
// holds block b's integer dot products of 16 rows, its scales apply with one
// multiply, and the tile's 16 outputs come out in one register (no horizontal
// sums, no partial blocks: K is a whole number of blocks).
//
//   qs:     (tiles, blocks, chunks, 16 rows, 4) uint8; chunks = 8 (Q8_0, stored + 128
//           as uint8 for VNNI's unsigned x signed products) or 4 (Q4_0, Q4_1).
//   scales: (tiles, blocks, 16 rows) fp16, ggml's d; mins the same for Q4_1's m.
//
// Activations are quantized per call to ggml's Q8_0 rule, in value order: int8
// (rows, K), one float32 scale and the int32 sum of the quants per block.

#pragma once

#include <cstdint>
#include <cstring>

namespace arborlm_quant {

constexpr int64_t kBlock = 32;  // values per block
constexpr int64_t kTile = 16;   // rows interleaved together: one per 32-bit lane

// Format codes shared with quant_layout.py (QUANT_FORMATS).
enum Format : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

// Dtype codes shared with cpu_ops.py: float32, bfloat16.
enum Dtype : int { kF32 = 0, kBF16 = 1 };

// Quant bytes per block and row of a format.
constexpr int64_t block_bytes(int fmt) { return fmt == kQ8_0 ? 32 : 16; }

// The value each stored quant is offset by: w = d * (q - offset) (+ m for Q4_1).
constexpr int32_t quant_offset(int fmt) { return fmt == kQ8_0 ? 128 : fmt == kQ4_0 ? 8 : 0; }

// Byte offset in qs of ggml quant byte j (0 <= j < block_bytes) of block b of row n.
inline int64_t quant_byte_offset(int fmt, int64_t nb, int64_t n, int64_t b, int64_t j) {
  return ((n / kTile * nb + b) * kTile * block_bytes(fmt)) + (j / 4) * kTile * 4 + (n % kTile) * 4 + j % 4;
}

// Offset in scales / mins of block b of row n.
inline int64_t scale_offset(int64_t nb, int64_t n, int64_t b) { return (n / kTile * nb + b) * kTile + n % kTile; }

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

// IEEE half -> float, exact (subnormals, inf and NaN included): portable, for builds
// without F16C and for the scalar loops.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float load_value(const void* p, int dtype, int64_t i) {
  return dtype == kF32 ? static_cast<const float*>(p)[i] : bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

inline void store_value(void* p, int dtype, int64_t i, float v) {
  if (dtype == kF32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  }
}

}  // namespace arborlm_quant
