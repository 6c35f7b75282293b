// exp for float32 (Cephes `expf`'s range reduction and polynomial), in plain C++ and in
// AVX-512 lanes, shared by the decoder-layer kernels (`cpu_kernels.cpp`) and the sampler
// (`sampling.cpp`). Header only, in an anonymous namespace: each library inlines its own.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// exp(r) of the reduced argument r = x - n ln 2 (|r| <= ln(2) / 2 for x in range), by Cephes
// `expf`'s degree-6 polynomial: what `fast_exp` and `exp_nonpositive` compute after their
// range reduction.
inline float exp_poly(float r) {
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p;
}

// exp(x) for float32 by range reduction and a degree-6 polynomial (Cephes
// `expf`), within 2 ulp; `exp16` below is the same in AVX-512.
inline float fast_exp(float x) {
  x = std::fmin(std::fmax(x, -87.3f), 88.7f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  return std::ldexp(exp_poly(r), static_cast<int>(n));
}

// exp(x) for x <= 0 (the softmax's shifted scores), as `fast_exp` (Cephes `expf`), in
// operations a loop of it vectorizes with: floor and the clamp in integers, 2^n built in
// the exponent bits (below 2^-126 the result is 0).
inline float exp_nonpositive(float x) {
  const float y = x * 1.44269504088896341f + 0.5f;
  int32_t n = static_cast<int32_t>(y);
  n -= static_cast<int32_t>(static_cast<float>(n) > y);  // truncation to floor
  n = n < -127 ? -127 : n;
  const float nf = static_cast<float>(n);
  const float r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  const float p = exp_poly(r);
  const int32_t bits = (n + 127) << 23;
  float pow2;
  std::memcpy(&pow2, &bits, 4);
  return p * pow2;
}

#if defined(__AVX512F__)
// exp's range reduction, shared by `exp16` and `fast_exp16`: x clamped to float32's range,
// n = round(x / ln 2) (into *n), and r = x - n ln 2 (ln 2 in two parts, as Cephes' expf).
inline __m512 exp16_reduce(__m512 x, __m512* n) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  *n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(*n, _mm512_set1_ps(0.693359375f)));
  return _mm512_add_ps(r, _mm512_mul_ps(*n, _mm512_set1_ps(2.12194440e-4f)));
}

inline __m512 exp16(__m512 x) {
  __m512 n;
  const __m512 r = exp16_reduce(x, &n);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// `fast_exp` in lanes, bit for bit: the same operations in the same order, each rounded
// on its own (no fused multiply-add, as the scalar code is compiled), 2^n applied by
// `scalef` (exact, as `ldexp`). For a row's last len % 16 elements, which `fast_exp`
// took one at a time (a libm `ldexp` call each: 5-19 % of a verify chain's attention).
inline __m512 fast_exp16(__m512 x) {
  __m512 n;
  const __m512 r = exp16_reduce(x, &n);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace
