// The packed layout of GGUF-quantized weights that `quant_linear.cpp` and
// `quant_dequant.cpp` read (written by `kernels/quant_layout.py::pack_ggml_blocks`).
//
// ggml stores a row as blocks (llama.cpp `ggml-common.h`): Q8_0 / Q4_0 / Q4_1 of 32
// values, an fp16 scale d (Q4_1 also a min m) and the quants; the K-quants of 256
// values, an fp16 d (Q4_K / Q5_K also dmin) and 6-bit (Q6_K: int8) scales of 8 blocks
// of 32 (Q6_K: 16 of 16). `kernels/ggml_blocks.py` reads every format into blocks of
// 32: 8-bit quants (Q8_0) or the low 4 bits of each quant in Q4's byte order (byte j:
// value j in the low nibble, value j + 16 in the high one), the bits above them apart.
// We keep those bits, reordered for AVX-512: rows go in tiles of kTile = 16 (the last
// tile padded with zero rows), and within a tile block b of all 16 rows is stored
// together, ordered (chunk, row, 4 bytes), chunk c being quant bytes 4c..4c+3. One
// 64-byte load then holds 4 quant bytes of each of 16 rows, so a VNNI dot product
// against 4 activation bytes broadcast to every lane adds 4 products into each row's
// own 32-bit lane: after all chunks a register holds block b's integer dot products
// of 16 rows, its scales apply with one multiply, and the tile's 16 outputs come out
// in one register (no horizontal sums, no partial blocks: K is whole blocks).
//
//   qs:         (tiles, blocks, chunks, 16 rows, 4) uint8; chunks = 8 (Q8_0, stored
//               + 128 as uint8 for VNNI's unsigned x signed products) or 4.
//   scales:     (tiles, blocks, 16) fp16 d; K-quants (tiles, super-blocks, 16) d.
//   mins:       the same for Q4_1's m and Q4_K / Q5_K's dmin.
//   highbits:   Q5_K (1 plane), Q6_K (2): (tiles, blocks, planes, 4 chunks, 2 halves)
//               64-bit masks, bit 4r + v = plane bit of value 16 half + 4 chunk + v of
//               row r: the byte mask of the chunk's low (half 0) or high nibbles.
//   sub_scales: Q4_K / Q5_K (tiles, blocks, 16) uint8 sc; Q6_K (tiles, blocks, 2, 16)
//               int8, one per half block. sub_mins: Q4_K / Q5_K (tiles, blocks, 16) m.
//
// Values: Q8_0 d q, Q4_0 d (q - 8), Q4_1 d q + m, Q4_K / Q5_K (d sc) q - dmin m,
// Q6_K (d sc) (q - 32). Activations are quantized per call to ggml's Q8_0 rule, in
// value order: int8 (rows, K), a float32 scale per block and the int32 sums of the
// quants per half block.

#pragma once

#include <cstdint>
#include <cstring>

namespace arborlm_quant {

constexpr int64_t kBlock = 32;  // values per block
constexpr int64_t kTile = 16;   // rows interleaved together: one per 32-bit lane
constexpr int64_t kSuper = 8;   // blocks per K-quant super-block

// Format codes shared with quant_layout.py (QUANT_FORMATS).
enum Format : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5 };

// Dtype codes shared with cpu_ops.py: float32, bfloat16.
enum Dtype : int { kF32 = 0, kBF16 = 1 };

// The arrays of a packed weight (quant_layout.py's QuantWeight.arrays() order).
struct Weight {
  const uint8_t* q;    // qs
  const uint16_t* d;   // scales (fp16)
  const uint16_t* m;   // mins (fp16) or null
  const uint8_t* h;    // highbits or null
  const uint8_t* sc;   // sub_scales (uint8; int8 for Q6_K) or null
  const uint8_t* sm;   // sub_mins or null
};

constexpr bool is_k_quant(int fmt) { return fmt >= kQ4_K; }

// High-bit planes beyond the low 4 bits.
constexpr int high_planes(int fmt) { return fmt == kQ5_K ? 1 : fmt == kQ6_K ? 2 : 0; }

// Quant bytes per block and row of a format.
constexpr int64_t block_bytes(int fmt) { return fmt == kQ8_0 ? 32 : 16; }

// The value each stored quant is offset by.
constexpr int32_t quant_offset(int fmt) {
  return fmt == kQ8_0 ? 128 : fmt == kQ4_0 ? 8 : fmt == kQ6_K ? 32 : 0;
}

// Byte offset in qs of quant byte j (0 <= j < block_bytes) of block b of row n.
inline int64_t quant_byte_offset(int fmt, int64_t nb, int64_t n, int64_t b, int64_t j) {
  return ((n / kTile * nb + b) * kTile * block_bytes(fmt)) + (j / 4) * kTile * 4 + (n % kTile) * 4 + j % 4;
}

// Offset of row n's entry in a (tiles, X, 16) array at index x.
inline int64_t row_offset(int64_t X, int64_t n, int64_t x) { return (n / kTile * X + x) * kTile + n % kTile; }

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

// ---- one value's parts, for the scalar loops ----------------------------------

// The stored quant of value i of block b of row n (before the offset).
template <int F>
inline int32_t quant_at(const Weight& w, int64_t nb, int64_t n, int64_t b, int64_t i) {
  if constexpr (F == kQ8_0) return w.q[quant_byte_offset(F, nb, n, b, i)];
  const uint8_t byte = w.q[quant_byte_offset(F, nb, n, b, i % 16)];
  int32_t q = i < 16 ? (byte & 0x0f) : (byte >> 4);
  for (int p = 0; p < high_planes(F); ++p) {
    const int64_t mask = (((n / kTile * nb + b) * high_planes(F) + p) * 4 + (i % 16) / 4) * 2 + i / 16;
    const int64_t bit = (n % kTile) * 4 + i % 4;
    q |= ((w.h[mask * 8 + bit / 8] >> (bit % 8)) & 1) << (4 + p);
  }
  return q;
}

// The scale of half h (values 16h..16h+15) of block b of row n.
template <int F>
inline float scale_at(const Weight& w, int64_t nb, int64_t n, int64_t b, int h) {
  if constexpr (!is_k_quant(F)) return f16_to_f32(w.d[row_offset(nb, n, b)]);
  const float d = f16_to_f32(w.d[row_offset(nb / kSuper, n, b / kSuper)]);
  if constexpr (F == kQ6_K) return d * static_cast<float>(static_cast<int8_t>(w.sc[row_offset(2 * nb, n, 2 * b + h)]));
  return d * static_cast<float>(w.sc[row_offset(nb, n, b)]);
}

// What block b of row n adds per unit of its inputs' sum: Q4_1's m, minus Q4_K / Q5_K's dmin m.
template <int F>
inline float min_at(const Weight& w, int64_t nb, int64_t n, int64_t b) {
  if constexpr (F == kQ4_1) return f16_to_f32(w.m[row_offset(nb, n, b)]);
  if constexpr (F == kQ4_K || F == kQ5_K) {
    return -(f16_to_f32(w.m[row_offset(nb / kSuper, n, b / kSuper)]) * static_cast<float>(w.sm[row_offset(nb, n, b)]));
  }
  return 0.0f;
}

}  // namespace arborlm_quant

