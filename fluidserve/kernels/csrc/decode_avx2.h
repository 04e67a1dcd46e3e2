#pragma once

#include "common.h"

namespace {

#ifdef FLUIDSERVE_AVX2_LANES
// ---------------------------------- decode attention's inner loops with AVX2 (bf16, 16-key blocks)
//
// Without AVX-512 GCC has no register mode for the 16-lane vectors of common.h: it keeps
// every v16f in memory and converts bf16 piece by piece through the stack, which made the
// decode item (attention.h) a third of a batch-40 decode step on a 2-core EPYC (Zen 3). Its
// score, softmax and value loops have versions on named __m256 registers for bf16 caches
// with 16-key blocks: a key block row (16 keys, transposed) is two 8-key halves, a value row
// chunk of 16 channels two halves, and up to four query rows of a kv head share every load.
// Eight (sixteen) bf16 values widened to float32: each is the top half of its float.
inline __m256 bf16x8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void bf16x16(const c10::BFloat16* p, __m256& lo, __m256& hi) {
  lo = bf16x8(p);
  hi = bf16x8(p + 8);
}

// vexp on eight lanes (the same polynomial, so the same results).
inline __m256 exp8(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  const __m256 n = _mm256_floor_ps(t);
  const __m256 r =
      _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f))),
                    _mm256_mul_ps(n, _mm256_set1_ps(1.428606765330187e-06f)));
  __m256 y = _mm256_set1_ps(1.0f / 720.0f);
  for (float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n),
                                                        _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(underflow, y);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// softmax_row on eight lanes.
inline float softmax_row8(float* row, int visible, int width) {
  std::fill(row + visible, row + width, kNegInf);
  __m256 vm = _mm256_set1_ps(kNegInf);
  for (int i = 0; i < width; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(row + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))));
  __m256 vs = _mm256_setzero_ps();
  for (int i = 0; i < width; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), mx));
    _mm256_storeu_ps(row + i, e);
    vs = _mm256_add_ps(vs, e);
  }
  return 1.0f / hsum8(vs);
}

// Scores of NR query rows (qf rows kMaxHeadDim apart) against one block's keys kt [D, 16].
// With pf, the same kv head's keys in the block kAhead on are prefetched a line (two rows of
// 16 keys) every second step.
template <int NR>
inline void scores16(const float* qf, const c10::BFloat16* kt, int D, float* sc, int width,
                     const c10::BFloat16* pf) {
  __m256 s0a = _mm256_setzero_ps(), s0b = s0a, s1a = s0a, s1b = s0a, s2a = s0a, s2b = s0a,
         s3a = s0a, s3b = s0a;
  for (int d = 0; d < D; ++d) {
    if (pf && d % 2 == 0) prefetch_line_l2(pf + d * 16);
    __m256 lo, hi;
    bf16x16(kt + d * 16, lo, hi);
    fma_row<0, NR>(qf + d, lo, hi, s0a, s0b);
    fma_row<1, NR>(qf + kMaxHeadDim + d, lo, hi, s1a, s1b);
    fma_row<2, NR>(qf + 2 * kMaxHeadDim + d, lo, hi, s2a, s2b);
    fma_row<3, NR>(qf + 3 * kMaxHeadDim + d, lo, hi, s3a, s3b);
  }
  const __m256 out[4][2] = {{s0a, s0b}, {s1a, s1b}, {s2a, s2b}, {s3a, s3b}};
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(sc + r * width, out[r][0]);
    _mm256_storeu_ps(sc + r * width + 8, out[r][1]);
  }
}

// acc[r][d0..d0+16] += sum_j p[r][j] v_j[d0..] over nj value rows vh [16, D] of one block.
// With pf, row j of the same kv head's values in the block kAhead on is prefetched at step j
// of the first 16 channels.
template <int NR>
inline void values16(const float* p, int width, const c10::BFloat16* vh, int nj, int D,
                     float* acc, const c10::BFloat16* pf) {
  for (int d0 = 0; d0 < D; d0 += 16) {
    __m256 a[4][2];  // loaded and stored outside the j loop, named inside it
    for (int r = 0; r < NR; ++r) {
      a[r][0] = _mm256_loadu_ps(acc + r * kMaxHeadDim + d0);
      a[r][1] = _mm256_loadu_ps(acc + r * kMaxHeadDim + d0 + 8);
    }
    __m256 a0a = a[0][0], a0b = a[0][1], a1a = a0a, a1b = a0b, a2a = a0a, a2b = a0b,
           a3a = a0a, a3b = a0b;
    if constexpr (NR > 1) a1a = a[1][0], a1b = a[1][1];
    if constexpr (NR > 2) a2a = a[2][0], a2b = a[2][1];
    if constexpr (NR > 3) a3a = a[3][0], a3b = a[3][1];
    for (int j = 0; j < nj; ++j) {
      if (pf && d0 == 0)
        for (int by = 0; by < D * 2; by += 64)
          prefetch_line_l2(reinterpret_cast<const char*>(pf + j * D) + by);
      __m256 lo, hi;
      bf16x16(vh + j * D + d0, lo, hi);
      fma_row<0, NR>(p + j, lo, hi, a0a, a0b);
      fma_row<1, NR>(p + width + j, lo, hi, a1a, a1b);
      fma_row<2, NR>(p + 2 * width + j, lo, hi, a2a, a2b);
      fma_row<3, NR>(p + 3 * width + j, lo, hi, a3a, a3b);
    }
    const __m256 out[4][2] = {{a0a, a0b}, {a1a, a1b}, {a2a, a2b}, {a3a, a3b}};
    for (int r = 0; r < NR; ++r) {
      _mm256_storeu_ps(acc + r * kMaxHeadDim + d0, out[r][0]);
      _mm256_storeu_ps(acc + r * kMaxHeadDim + d0 + 8, out[r][1]);
    }
  }
}

template <int NR>
inline void rows_of_group(int nr, const float* qf, const c10::BFloat16* kt, int D, float* sc,
                          int width, const c10::BFloat16* pf) {
  if (nr == NR) return scores16<NR>(qf, kt, D, sc, width, pf);
  if constexpr (NR > 1) rows_of_group<NR - 1>(nr, qf, kt, D, sc, width, pf);
}
template <int NR>
inline void values_of_group(int nr, const float* p, int width, const c10::BFloat16* vh, int nj,
                            int D, float* acc, const c10::BFloat16* pf) {
  if (nr == NR) return values16<NR>(p, width, vh, nj, D, acc, pf);
  if constexpr (NR > 1) values_of_group<NR - 1>(nr, p, width, vh, nj, D, acc, pf);
}

constexpr bool kDecodeAvx2 = true;
#else
constexpr bool kDecodeAvx2 = false;
template <int NR>  // never called: the decode item's AVX2 branches are discarded here
inline void rows_of_group(int, const float*, const c10::BFloat16*, int, float*, int,
                          const c10::BFloat16*) {}
template <int NR>
inline void values_of_group(int, const float*, int, const c10::BFloat16*, int, int, float*,
                            const c10::BFloat16*) {}
inline float softmax_row8(float*, int, int) { return 0.0f; }
#endif

}  // namespace
