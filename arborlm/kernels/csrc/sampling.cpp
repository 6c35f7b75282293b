// Seeded sampling of logits rows, one native pass per row: temperature, softmax, top-k,
// top-p, min-p and the inverse-CDF draw (`cpu_sampling.py`); and the penalties before it,
// applied at the tokens a row has seen only (`arborlm_apply_penalties`).
//
// Why: in torch the same work is a chain of whole-row ops (divide, softmax, topk, sorts,
// cumsum, scatter, the draw's block sums): 4 ms for 8 rows of 49152 tokens and 16 ms for
// 32 on a 2-core CPU, as much as the model's forward at 8 rows. Here a row is two passes
// over its logits in lanes plus a sort of the few tokens the filters can keep.
//
// The math of a row (l: logits, T: temperature, u: a uniform in [0, 1) from the request's
// generator):
//   e_i = exp(l_i / T - max_j l_j / T)          (float32; e of the largest is exactly 1)
//   tokens in rank order: e descending, ties by token id (a stable sort's order);
//   top-k keeps ranks < k; top-p keeps rank r when r == 0 or the mass of ranks < r is at
//   most top_p times the top-k survivors' mass (sums in float64); min-p keeps e >= min_p
//   times the largest (which is 1). Each filter keeps a prefix of the ranks, so the kept
//   tokens are those ranked at or before the last kept one;
//   the draw: the first kept token, in token id order, whose running sum (float64, over
//   blocks of 256 tokens, then inside the block) exceeds u times the kept mass.
// These are the filters and the draw of the torch path (`sampling_filters.filter_probs`,
// Hugging Face's and vLLM's warpers in that order, then `sample_from_probs`), which gives
// the same token for the same u but where rounding differs (its softmax's exp, float32
// cumulative sums).
//
// Plain C ABI over raw pointers, called through ctypes. OpenMP over rows.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "fast_exp.h"

namespace {

constexpr int kAbiVersion = 4;

// Candidate thresholds on e (the largest e is 1), tried from the highest: the tokens at or
// above one are enough (`enough`) when they hold top-k's k tokens, or for top-p alone more
// than top_p of the row's mass (with a margin for the rounding of the sums). Below the
// last, every token is a candidate.
constexpr int kThresholds = 5;
constexpr float kThreshold[kThresholds] = {0x1p-3f, 0x1p-6f, 0x1p-10f, 0x1p-14f, 0x1p-20f};
constexpr double kMassMargin = 1e-6;

// Tokens per block of the draw's block sums.
constexpr int64_t kDrawBlock = 256;

struct Row {
  float temperature;
  int64_t top_k;  // vocab: no top-k
  float top_p;    // 1: no top-p
  float min_p;    // 0: no min-p
  double u;
};

// The last kept token in rank order: token i is kept when e_i > e, or e_i == e and i <= id
// (and always e_i > 0).
struct Cut {
  float e;
  int64_t id;
};

inline bool kept(float v, int64_t i, Cut cut) { return v > 0.f && (v > cut.e || (v == cut.e && i <= cut.id)); }

struct Scratch {
  std::vector<float> e;
  std::vector<double> block_mass;
  std::vector<std::pair<float, int32_t>> cand, grouped;
  std::vector<int64_t> group_start, counts;
  std::vector<double> group_mass;
  std::vector<char> group_sorted;
};

#if defined(__AVX512F__)
// The row passes in 16 lanes (the same loops in plain C++ stay scalar under gcc: 0.5 ms a
// row of 49152 tokens). A row's last vocab % 16 tokens are a masked step, so every token
// takes the same operations wherever it sits.

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// Pass 1: x_i = l_i / T into e, and the row's max; NaN when a logit is NaN (a max alone
// would skip it).
float scaled_max(const float* logits, int64_t vocab, float temperature, float* e) {
  const __m512 t = _mm512_set1_ps(temperature);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < vocab; i += 16) {
    const __mmask16 m = tail_mask(vocab - i);
    const __m512 x = _mm512_div_ps(_mm512_maskz_loadu_ps(m, logits + i), t);
    _mm512_mask_storeu_ps(e + i, m, x);
    mx = _mm512_mask_max_ps(mx, m, mx, x);
    nan |= _mm512_mask_cmp_ps_mask(m, x, x, _CMP_UNORD_Q);
  }
  return nan ? NAN : _mm512_reduce_max_ps(mx);
}

// 16 float32 lanes as two float64 vectors (lanes 0-7, 8-15), converted once per vector and
// added to every sum that takes them.
struct Wide {
  __m512d lo, hi;
  explicit Wide(__m512 v)
      : lo(_mm512_cvtps_pd(_mm512_castps512_ps256(v))),
        hi(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))) {}
};

// `v`'s lanes added to two float64 accumulators (lanes 0-7, 8-15) where `m` is set.
inline void add_pd(__m512d* lo, __m512d* hi, const Wide& v, __mmask16 m) {
  *lo = _mm512_mask_add_pd(*lo, static_cast<__mmask8>(m), *lo, v.lo);
  *hi = _mm512_mask_add_pd(*hi, static_cast<__mmask8>(m >> 8), *hi, v.hi);
}

inline double sum_pd(__m512d lo, __m512d hi) { return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi)); }

// Pass 2: e_i = exp(x_i - mx) in place, exactly 0 below -87.3 (where `exp16` clamps: -inf
// logits, the masked tokens, must never be drawn). Returns the row's mass; with
// `Thresholds`, also the count and mass of the tokens at or above each threshold.
template <bool Thresholds>
double exp_row(float* e, int64_t vocab, float mx, int64_t* counts, double* masses) {
  const __m512 mxv = _mm512_set1_ps(mx), low = _mm512_set1_ps(-87.3f);
  __m512d all_lo = _mm512_setzero_pd(), all_hi = _mm512_setzero_pd();
  __m512d lo[kThresholds], hi[kThresholds];
  for (int t = 0; t < kThresholds; ++t) lo[t] = hi[t] = _mm512_setzero_pd();
  int64_t count[kThresholds] = {};
  for (int64_t i = 0; i < vocab; i += 16) {
    const __mmask16 m = tail_mask(vocab - i);
    const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, e + i), mxv);
    const __m512 v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, low, _CMP_GE_OQ), exp16(d));
    _mm512_mask_storeu_ps(e + i, m, v);
    const Wide w(v);
    add_pd(&all_lo, &all_hi, w, m);
    if constexpr (Thresholds) {
      for (int t = 0; t < kThresholds; ++t) {
        const __mmask16 in = _mm512_mask_cmp_ps_mask(m, v, _mm512_set1_ps(kThreshold[t]), _CMP_GE_OQ);
        count[t] += __builtin_popcount(in);
        add_pd(&lo[t], &hi[t], w, in);
      }
    }
  }
  if constexpr (Thresholds) {
    for (int t = 0; t < kThresholds; ++t) counts[t] = count[t], masses[t] = sum_pd(lo[t], hi[t]);
  }
  return sum_pd(all_lo, all_hi);
}

// The tokens with e >= floor and e > 0, as (e, token id) in token order.
void gather_candidates(const float* e, int64_t vocab, float floor, std::vector<std::pair<float, int32_t>>& cand) {
  cand.clear();
  const __m512 fl = _mm512_set1_ps(floor), zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < vocab; i += 16) {
    const __mmask16 m = tail_mask(vocab - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, e + i);
    uint32_t in = _mm512_mask_cmp_ps_mask(_mm512_mask_cmp_ps_mask(m, v, fl, _CMP_GE_OQ), v, zero, _CMP_GT_OQ);
    for (; in != 0; in &= in - 1) {
      const int64_t j = i + __builtin_ctz(in);
      cand.emplace_back(e[j], static_cast<int32_t>(j));
    }
  }
}

// Pass 3: each block's mass of the kept tokens (`kept`); returns the kept mass.
double kept_blocks(const float* e, int64_t vocab, Cut cut, std::vector<double>& block_mass) {
  const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  block_mass.assign(blocks, 0.0);
  const __m512 ce = _mm512_set1_ps(cut.e), zero = _mm512_setzero_ps();
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i cid = _mm512_set1_epi32(static_cast<int32_t>(std::min<int64_t>(cut.id, INT32_MAX)));
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kDrawBlock, hi = std::min(vocab, lo + kDrawBlock);
    __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
    for (int64_t i = lo; i < hi; i += 16) {
      const __mmask16 m = tail_mask(hi - i);
      const __m512 v = _mm512_maskz_loadu_ps(m, e + i);
      const __m512i id = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(i)), iota);
      const __mmask16 tie = _mm512_mask_cmp_epi32_mask(_mm512_cmp_ps_mask(v, ce, _CMP_EQ_OQ), id, cid, _MM_CMPINT_LE);
      const __mmask16 in = _mm512_mask_cmp_ps_mask(m, v, zero, _CMP_GT_OQ) &
                           (_mm512_cmp_ps_mask(v, ce, _CMP_GT_OQ) | tie);
      add_pd(&acc_lo, &acc_hi, Wide(v), in);
    }
    block_mass[b] = sum_pd(acc_lo, acc_hi);
    total += block_mass[b];
  }
  return total;
}

#else
// The same passes in plain C++, for CPUs without AVX-512 (each token's float64 sums in
// token order instead of 16 lanes: the same values up to float64 rounding).

float scaled_max(const float* logits, int64_t vocab, float temperature, float* e) {
  float mx = -INFINITY;
  bool nan = false;
  for (int64_t i = 0; i < vocab; ++i) {
    e[i] = logits[i] / temperature;
    mx = e[i] > mx ? e[i] : mx;
    nan |= e[i] != e[i];
  }
  return nan ? NAN : mx;
}

template <bool Thresholds>
double exp_row(float* e, int64_t vocab, float mx, int64_t* counts, double* masses) {
  double total = 0.0;
  for (int t = 0; t < kThresholds && Thresholds; ++t) counts[t] = 0, masses[t] = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    const float d = e[i] - mx;
    e[i] = d >= -87.3f ? exp_nonpositive(d) : 0.f;
    total += e[i];
    for (int t = 0; t < kThresholds && Thresholds; ++t)
      if (e[i] >= kThreshold[t]) ++counts[t], masses[t] += e[i];
  }
  return total;
}

void gather_candidates(const float* e, int64_t vocab, float floor, std::vector<std::pair<float, int32_t>>& cand) {
  cand.clear();
  for (int64_t i = 0; i < vocab; ++i)
    if (e[i] >= floor && e[i] > 0.f) cand.emplace_back(e[i], static_cast<int32_t>(i));
}

double kept_blocks(const float* e, int64_t vocab, Cut cut, std::vector<double>& block_mass) {
  const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  block_mass.assign(blocks, 0.0);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t i = b * kDrawBlock; i < std::min(vocab, (b + 1) * kDrawBlock); ++i)
      if (kept(e[i], i, cut)) block_mass[b] += e[i];
    total += block_mass[b];
  }
  return total;
}
#endif

// Whether the tokens at or above some e, holding `count` tokens and `mass`, hold every token
// top-k and top-p can keep (see `sample_row`). total: the row's mass.
inline bool enough(const Row& row, int64_t vocab, int64_t count, double mass, double total) {
  // Top-k (then top-p trims its survivors): the k largest are there when that many are.
  // Top-p alone: past top_p of the row's mass, the kept ranks end inside them.
  return row.top_k < vocab ? count >= row.top_k : mass > static_cast<double>(row.top_p) * total * (1.0 + kMassMargin);
}

// Sub-buckets of e by its float32 bits (16 per power of two: exponent and 4 mantissa bits);
// a higher sub-bucket holds only larger e, so rank order is the sub-buckets from the highest,
// each in rank order within.
constexpr int kBucketShift = 19;
constexpr int kBuckets = (0x3f800000 >> kBucketShift) + 1;  // e in (0, 1]

inline int bucket_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<int>(b >> kBucketShift);
}

// The candidates in groups, one per non-empty sub-bucket from the highest; a group's tokens
// are in token order until `ranked` sorts them (only the groups a filter cuts inside are
// sorted: sorting a flat row's tens of thousands of candidates took 2 ms).
struct Groups {
  std::vector<std::pair<float, int32_t>>& items;
  std::vector<int64_t>& start;  // group g: items [start[g], start[g + 1])
  std::vector<double>& mass;    // group g's mass, summed in token order
  std::vector<char>& sorted;

  int64_t size(int64_t g) const { return start[g + 1] - start[g]; }
  const std::pair<float, int32_t>* ranked(int64_t g) {
    auto* first = items.data() + start[g];
    if (!sorted[g]) {
      std::sort(first, first + size(g), [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      sorted[g] = 1;
    }
    return first;
  }
};

// Group `cand` (token order) by sub-bucket into `g`'s vectors.
void group_candidates(const std::vector<std::pair<float, int32_t>>& cand, Groups& g, std::vector<int64_t>& counts) {
  counts.assign(kBuckets, 0);
  for (const auto& c : cand) ++counts[bucket_of(c.first)];
  std::vector<int64_t> at(kBuckets, -1);  // each non-empty sub-bucket's group
  g.start.assign(1, 0);
  for (int b = kBuckets - 1; b >= 0; --b)
    if (counts[b] > 0) {
      at[b] = static_cast<int64_t>(g.start.size()) - 1;
      g.start.push_back(g.start.back() + counts[b]);
    }
  const int64_t groups = static_cast<int64_t>(g.start.size()) - 1;
  g.mass.assign(groups, 0.0);
  g.sorted.assign(groups, 0);
  g.items.resize(cand.size());
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  for (const auto& c : cand) {
    const int64_t k = at[bucket_of(c.first)];
    g.items[fill[k]++] = c;
    g.mass[k] += c.first;
  }
}

// The last kept token of a row with top-k or top-p (and maybe min-p), among the candidates
// at or above `floor` (which hold every token these can keep). total: the row's mass.
//
// Rank positions are (group, count kept in it). Top-k keeps whole groups while they fit in
// k, then the first k - (those) of the next. Top-p's mass before a token is the masses of
// the groups above its own plus the tokens before it in its own group, in rank order
// (float64): a group whose whole mass still fits under top_p times the survivors' mass is
// kept whole, the first that does not is walked token by token (its first token of the row
// is always kept). Min-p then drops the kept tokens below min_p (the largest e is 1).
Cut cut_sorted(const float* e, int64_t vocab, float floor, const Row& row, double total, Scratch& s) {
  gather_candidates(e, vocab, floor, s.cand);
  Groups g{s.grouped, s.group_start, s.group_mass, s.group_sorted};
  group_candidates(s.cand, g, s.counts);
  const int64_t groups = static_cast<int64_t>(g.start.size()) - 1;  // > 0: the largest e is 1
  int64_t last = groups - 1, n = g.size(last);  // the cut: group `last`, its first n tokens
  double survivors = total;
  if (row.top_k < vocab) {
    int64_t above = 0;
    for (int64_t k = 0; k < groups; ++k) {
      if (above + g.size(k) >= row.top_k) {
        last = k, n = row.top_k - above;
        break;
      }
      above += g.size(k);
    }
    if (n < g.size(last) || last < groups - 1) {  // top-p scales by the survivors' mass
      survivors = 0.0;
      for (int64_t k = 0; k < last; ++k) survivors += g.mass[k];
      const auto* items = g.ranked(last);
      for (int64_t j = 0; j < n; ++j) survivors += items[j].first;
    }
  }
  if (row.top_p < 1.f) {
    const double limit = static_cast<double>(row.top_p) * survivors;
    double before = 0.0;
    for (int64_t k = 0; k <= last; ++k) {
      const int64_t size = k == last ? n : g.size(k);
      double whole = g.mass[k];
      if (size < g.size(k)) {  // top-k's cut group: the mass of its first `size`
        whole = 0.0;
        const auto* items = g.ranked(k);
        for (int64_t j = 0; j < size; ++j) whole += items[j].first;
      }
      if (before + whole <= limit) {
        before += whole;
        continue;
      }
      const auto* items = g.ranked(k);
      int64_t j = k == 0 ? 1 : 0;  // the row's first token is kept whatever its mass
      before += k == 0 ? items[0].first : 0.0;
      for (; j < size && before <= limit; ++j) before += items[j].first;
      last = k, n = j;
      break;
    }
  }
  if (row.min_p > 0.f) {
    const float floor_p = row.min_p;  // min_p times the largest e, which is 1
    while (last > 0 && g.ranked(last)[0].first < floor_p) n = g.size(--last);
    const auto* items = g.ranked(last);
    while (n > 1 && items[n - 1].first < floor_p) --n;
  }
  const auto& cut = g.ranked(last)[n - 1];
  return {cut.first, cut.second};
}

// The draw in token id order over the kept tokens (`kept_blocks`' sums, `kept` mass).
int64_t draw(const float* e, int64_t vocab, Cut cut, const std::vector<double>& block_mass, double mass, double u) {
  const double target = u * mass;
  double before = 0.0;
  int64_t b = 0;
  const int64_t blocks = static_cast<int64_t>(block_mass.size());
  while (b + 1 < blocks && before + block_mass[b] <= target) before += block_mass[b++];
  int64_t last = -1;
  for (; b < blocks; ++b) {  // rounding can put the target past a block's own sum: go on
    for (int64_t i = b * kDrawBlock; i < std::min(vocab, (b + 1) * kDrawBlock); ++i) {
      if (!kept(e[i], i, cut)) continue;
      before += e[i];
      last = i;
      if (before > target) return i;
    }
  }
  if (last >= 0) return last;
  for (int64_t i = vocab - 1; i >= 0; --i)  // the target past every token: the last kept one
    if (kept(e[i], i, cut)) return i;
  return -1;
}

// One row's token, or -1 when its probabilities are not finite or sum to 0.
int64_t sample_row(const float* logits, int64_t vocab, const Row& row, Scratch& s) {
  s.e.resize(vocab);
  float* e = s.e.data();
  const float mx = scaled_max(logits, vocab, row.temperature, e);
  if (!std::isfinite(mx)) return -1;
  Cut cut{0.f, -1};  // every token of positive e
  if (row.top_k < vocab || row.top_p < 1.f) {
    int64_t counts[kThresholds];
    double masses[kThresholds];
    const double total = exp_row<true>(e, vocab, mx, counts, masses);
    if (!std::isfinite(total) || !(total > 0.0)) return -1;
    float floor = 0.f;  // every token, unless a threshold holds enough
    for (int t = 0; t < kThresholds; ++t) {
      if (enough(row, vocab, counts[t], masses[t], total)) {
        floor = kThreshold[t];
        break;
      }
    }
    cut = cut_sorted(e, vocab, floor, row, total, s);
  } else {
    const double total = exp_row<false>(e, vocab, mx, nullptr, nullptr);
    if (!std::isfinite(total) || !(total > 0.0)) return -1;
    if (row.min_p > 0.f) cut = {row.min_p, vocab};  // e >= min_p (the largest e is 1)
  }
  const double mass = kept_blocks(e, vocab, cut, s.block_mass);
  if (!std::isfinite(mass) || !(mass > 0.0)) return -1;
  return draw(e, vocab, cut, s.block_mass, mass, row.u);
}

// Repetition, frequency and presence penalties of one row, at the tokens it has seen only
// (the torch ops build (B, V) counts and masks: 5-14 ms a step at 32 rows of 1000 tokens).
// Each touched logit goes through the same float32 operations in the same order as
// `sampling.apply_penalties`' torch path, so the results are the same bits: repetition
// (prompt and output tokens, once each: positive logits divided by the penalty, others
// multiplied), then `l - frequency * count`, then `- presence`. Ids outside [0, vocab) are
// skipped. counts, seen: vocab zeros, left zero.
void penalise_row(float* logits, int64_t vocab, const int32_t* out, int64_t n_out, const int32_t* prompt,
                  int64_t n_prompt, const float* repetition, const float* frequency, const float* presence,
                  int32_t* counts, uint8_t* seen) {
  const auto valid = [vocab](int32_t id) { return id >= 0 && id < vocab; };
  for (int64_t i = 0; i < n_out; ++i)
    if (valid(out[i])) ++counts[out[i]];
  if (repetition != nullptr) {
    const float pen = *repetition;
    for (const auto& [ids, n] : {std::pair{prompt, n_prompt}, std::pair{out, n_out}})
      for (int64_t i = 0; i < n; ++i) {
        const int32_t id = ids[i];
        if (!valid(id) || seen[id]) continue;
        seen[id] = 1;
        const float l = logits[id];
        logits[id] = l > 0.f ? l / pen : l * pen;
      }
    for (const auto& [ids, n] : {std::pair{prompt, n_prompt}, std::pair{out, n_out}})
      for (int64_t i = 0; i < n; ++i)
        if (valid(ids[i])) seen[ids[i]] = 0;
  }
  for (int64_t i = 0; i < n_out; ++i) {
    const int32_t id = out[i];
    if (!valid(id) || counts[id] == 0) continue;  // 0: already applied (or nothing to apply)
    if (frequency != nullptr) {
      float l = logits[id] - *frequency * static_cast<float>(counts[id]);
      logits[id] = l - *presence * 1.0f;
    }
    counts[id] = 0;
  }
}

// The largest value of x[0, n) and the first index holding it, as torch's `max(dim=-1)`
// on the CPU: NaN and the first NaN's index when the row holds one; an all -inf row gives
// -inf at 0. In lanes, 4 accumulators of 16: each lane keeps its first strict maximum
// (so a tie keeps the earlier position), then the smallest index among the lanes equal
// to the maximum wins; -0 and +0 compare equal, and the value returned is x at the index.
void max_with_index(const float* x, int64_t n, float* value, int64_t* index) {
  int64_t best = 0;
  int64_t i = 0;
#if defined(__AVX512F__)
  constexpr int64_t kStep = 64;
  if (n >= kStep) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 top[4];
    __m512i at[4];
    __mmask16 nan = 0;
    for (int a = 0; a < 4; ++a) {
      top[a] = _mm512_loadu_ps(x + 16 * a);
      at[a] = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * a));
      nan |= _mm512_cmp_ps_mask(top[a], top[a], _CMP_UNORD_Q);
    }
    for (i = kStep; i + kStep <= n; i += kStep) {
      for (int a = 0; a < 4; ++a) {
        const __m512 v = _mm512_loadu_ps(x + i + 16 * a);
        const __mmask16 up = _mm512_cmp_ps_mask(v, top[a], _CMP_GT_OQ);
        top[a] = _mm512_mask_mov_ps(top[a], up, v);
        at[a] = _mm512_mask_mov_epi32(at[a], up, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(i + 16 * a))));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      }
    }
    if (nan) {  // rare: the first NaN, as torch reports it
      for (int64_t j = 0; j < n; ++j)
        if (std::isnan(x[j])) {
          *value = x[j];
          *index = j;
          return;
        }
    }
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3])));
    int32_t first = INT32_MAX;
    for (int a = 0; a < 4; ++a)
      first = std::min(first, _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(top[a], _mm512_set1_ps(m), _CMP_EQ_OQ),
                                                           at[a]));
    best = first;
  }
#endif
  for (; i < n; ++i) {  // the tail (or the whole row without AVX-512)
    if (std::isnan(x[i])) {  // the first NaN: the lanes, if any ran, saw none
      *value = x[i];
      *index = i;
      return;
    }
    if (x[i] > x[best]) best = i;
  }
  *value = x[best];
  *index = best;
}

}  // namespace

extern "C" {

int arborlm_sampling_abi_version() { return kAbiVersion; }

// tokens[i] = the draw of logits row r = rows[i] with temperatures[r], top_ks[r] (clamped to
// [1, vocab]), top_ps[r], min_ps[r] (one per logits row) and uniforms[i]; -1 where that row
// cannot be drawn from. logits: rows of `vocab` float32 `stride` apart. Returns 0, or 1 on
// bad arguments.
int arborlm_sample_rows(const float* logits, int64_t stride, int64_t vocab, int64_t n, const int64_t* rows,
                        const float* temperatures, const int64_t* top_ks, const float* top_ps, const float* min_ps,
                        const double* uniforms, int64_t* tokens) {
  if (vocab <= 0 || vocab > INT32_MAX || n < 0 || stride < vocab) return 1;
#pragma omp parallel if (n > 1)
  {
    // Kept per thread across calls: a fresh one zero-filled a row's worth of floats each call
    // (a speculative verify step draws its chain rows one call each).
    thread_local Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = rows[i];
      const Row row{temperatures[r], std::min(std::max<int64_t>(top_ks[r], 1), vocab), top_ps[r], min_ps[r],
                    uniforms[i]};
      tokens[i] = row.temperature > 0.f ? sample_row(logits + r * stride, vocab, row, scratch) : -1;
    }
  }
  return 0;
}

// values[r], indices[r] = the maximum of logits row r (`vocab` float32, rows `stride` apart)
// and its first index, as torch's `max(dim=-1)` (`max_with_index`). Returns 0, or 1 on bad
// arguments.
int arborlm_row_max(const float* logits, int64_t stride, int64_t vocab, int64_t rows, float* values,
                    int64_t* indices) {
  if (vocab <= 0 || vocab > INT32_MAX - 64 || rows < 0 || stride < vocab) return 1;
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) max_with_index(logits + r * stride, vocab, values + r, indices + r);
  return 0;
}

// The penalties of `rows` logits rows (`stride` apart, `vocab` wide), in place: row r's
// output ids are out_ids[out_offsets[r], out_offsets[r + 1]) and its prompt ids prompt_ids
// [prompt_offsets[r], ...) (prompt_ids may be null: no prompt). repetition (null: none),
// frequency and presence (both null: none): one float32 per row. Returns 0, or 1 on bad
// arguments.
int arborlm_apply_penalties(float* logits, int64_t stride, int64_t vocab, int64_t rows, const int32_t* out_ids,
                            const int64_t* out_offsets, const int32_t* prompt_ids, const int64_t* prompt_offsets,
                            const float* repetition, const float* frequency, const float* presence) {
  if (vocab <= 0 || vocab > INT32_MAX || rows < 0 || stride < vocab || (frequency == nullptr) != (presence == nullptr))
    return 1;
#pragma omp parallel if (rows > 1)
  {
    std::vector<int32_t> counts(vocab, 0);
    std::vector<uint8_t> seen(vocab, 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* prompt = prompt_ids == nullptr ? nullptr : prompt_ids + prompt_offsets[r];
      const int64_t n_prompt = prompt_ids == nullptr ? 0 : prompt_offsets[r + 1] - prompt_offsets[r];
      penalise_row(logits + r * stride, vocab, out_ids + out_offsets[r], out_offsets[r + 1] - out_offsets[r],
                   prompt, n_prompt, repetition == nullptr ? nullptr : repetition + r,
                   frequency == nullptr ? nullptr : frequency + r, presence == nullptr ? nullptr : presence + r,
                   counts.data(), seen.data());
    }
  }
  return 0;
}

}  // extern "C"
