// What every CPU kernel here shares: the includes, the instruction-set switches, the
// description of a flattened batch, and 16-lane float vectors with their loads, stores,
// exponential and reductions (GCC/Clang vector extensions on whatever registers -march
// gives). The kernels are one translation unit, cpu_kernels.cpp, which includes the
// headers of this directory in order.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

// AVX2 without AVX-512: GCC then has no register mode for the 16-lane vectors below and keeps
// them on the stack, so the hot loops have versions on eight named __m256 lanes.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define FLUIDSERVE_AVX2_LANES 1
#endif

// The two matrix kernels: AMX tiles where the compiler targets them (the build then takes
// them for bf16 products and prefill attention), else the float32-FMA panels on AVX2 or
// AVX-512. A build with neither falls back to oneDNN and ATen (stubs in cpu_kernels.cpp).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#define FLUIDSERVE_AMX 1
#elif defined(__AVX2__) && defined(__FMA__)
#define FLUIDSERVE_PANELS 1
// The panels have a second product where the CPU has AVX-512 BF16: its dot product
// (panel_linear.h), chosen per CPU by how fast it issues (bf16_dot_rates).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define FLUIDSERVE_DOT_PANELS 1
#endif
#endif

namespace {

#ifdef FLUIDSERVE_DOT_PANELS
constexpr bool kDotPanelsBuilt = true;
#else
constexpr bool kDotPanelsBuilt = false;
#endif
constexpr int kMaxRows = 16;
constexpr int kMaxHeadDim = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct WorkItem {
  int32_t run;
  int32_t all_heads;  // 1: a decode item over query heads head0.. of several kv heads
  int32_t kv_head;
  int32_t head0;    // first query head of the group, relative to the kv head's group
  int32_t heads;    // query heads in the item
  int32_t tok0;     // first token of the tile, relative to the run
  int32_t toks;     // tokens in the tile
  int64_t cost;     // key blocks x rows: the scheduling order
};

struct Batch {
  const int32_t* cu_q;      // [S + 1] query offsets of the runs in the flattened batch
  const int32_t* ctx_lens;  // [S] context length after the run (its last position + 1)
  const int32_t* tables;    // [S, table_stride] physical block ids
  int64_t table_stride;
  int H, Hkv, D;
  float scale;
  int64_t q_row;  // elements from one token's queries to the next's (a token's H x D is dense)
};

// GCC/Clang vector extensions: the compiler maps them onto the widest registers the CPU has
// (-march=native), so one source serves AVX-512, AVX2 and others.
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// bf16 widened to float32. On AVX-512 in one VPMOVZXWD from memory and a shift: GCC lowers
// the vector extension's convert to two halves widened and reinserted.
inline v16f load16(const c10::BFloat16* p) {
#ifdef __AVX512F__
  return (v16f)_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  v16u16 h;
  std::memcpy(&h, p, sizeof(h));
  return (v16f)(__builtin_convertvector(h, v16u32) << 16);
#endif
}
inline v16f load16(const c10::Half* p) {
  v16f v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

inline v16f splat(float x) { return (v16f){} + x; }

// exp on 16 lanes: 2^n * e^r with n = round(x / ln 2), |r| <= ln2 / 2, and a degree-6
// Taylor polynomial (relative error ~2e-7, like expf). Inputs below -87 give exactly 0, which
// is what masked (-inf) scores need.
inline v16f vexp(v16f x) {
#ifdef __AVX512F__
  // The same arithmetic in AVX-512's own instructions, so the same bits: the clamps as
  // max/min (a NaN stays), the floor in one rounding, and the power of two applied by
  // scalef, exact here as the multiply below is (n in [-126, 127], the polynomial in
  // [0.7, 1.5]). Eight instructions fewer, which counts where the exponential is most of a
  // loop: SiLU-and-mul, the softmax rows.
  const __m512 xi = (__m512)x;
  const __mmask16 keep = _mm512_cmp_ps_mask(xi, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
  x = (v16f)_mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), xi));
  const v16f t = x * 1.44269504088896341f + 0.5f;
  const v16f n =
      (v16f)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
  const v16i underflow = x < -87.0f;
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  const v16f t = x * 1.44269504088896341f + 0.5f;
  v16f n = __builtin_convertvector(__builtin_convertvector(t, v16i), v16f);  // trunc
  n = n > t ? n - 1.0f : n;                                                   // floor
#endif
  const v16f r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  v16f y = splat(1.0f / 720.0f);
  y = y * r + 1.0f / 120.0f;
  y = y * r + 1.0f / 24.0f;
  y = y * r + 1.0f / 6.0f;
  y = y * r + 0.5f;
  y = y * r + 1.0f;
  y = y * r + 1.0f;
#ifdef __AVX512F__
  return (v16f)_mm512_maskz_scalef_ps(keep, (__m512)y, (__m512)n);
#else
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  y = y * (v16f)e;
  return underflow ? splat(0.0f) : y;
#endif
}

inline float hmax(v16f v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}
inline float hsum(v16f v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// Unnormalized softmax of one score row in place: scores from ``visible`` on are masked,
// the row becomes exp(x - max); returns 1 / (sum of the row). ``width``: a multiple of 16.
inline float softmax_row(float* row, int visible, int width) {
  std::fill(row + visible, row + width, kNegInf);
  v16f vm = splat(kNegInf);
  for (int i = 0; i < width; i += 16) {
    const v16f x = load16(row + i);
    vm = x > vm ? x : vm;
  }
  const float mx = hmax(vm);
  v16f vs = {};
  for (int i = 0; i < width; i += 16) {
    const v16f e = vexp(load16(row + i) - mx);
    store16(row + i, e);
    vs += e;
  }
  return 1.0f / hsum(vs);
}

// How many blocks ahead a decode item prefetches its keys and values. A decode spends ~150
// cycles on a block (16 keys of a kv-head group), far less than a scattered block takes to
// arrive from memory: two blocks ahead left the loads exposed when the prefetches went to
// L1. Into L2 (prefetch_l2), four beat eight, and three about equals four: 40 decodes of 290
// tokens on a Zen 4 EPYC, two cores, alternated: 11.45 (8) / 10.81 (4) / 10.76 (3) / 12.22
// (12) ms on churned block tables, 11.46 / 10.81 / 10.64 / 12.06 ms on random ones. Four
// blocks of a 4-kv-head group are ~2400 cycles of work, several memory latencies ahead.
constexpr int kAhead = 4;
// 16-float chunks of a value row that the decode value pass keeps in registers for four
// rows at a time: 4 x 4 accumulators fill half of AVX-512's 32 registers, but 4 x 4 x 2 of
// AVX2's 16 would spill to the stack on every multiply-add.
#ifdef __AVX512F__
constexpr int kValueChunks = 4;
#else
constexpr int kValueChunks = 1;
#endif
// The attention items' prefetches (the decode items' kAhead blocks ahead, the others' one
// block): into L2 (PREFETCHT1), as the panels' far prefetches. A prefetch into L1 holds one
// of the core's few L1 miss buffers until its line arrives from memory, so those buffers, not
// the memory, bounded the decode pass (one core read 7 GB/s of KV where a plain sum streams
// 25); a prefetch into L2 does not, and the load then takes the line from L2. 40 decodes of
// 290 tokens over 16 layers on scattered blocks (``scripts/bench_attention.py --against``
// the L1 version, outputs identical), two cores of a Zen 4 EPYC: 13.6 -> 10.4 ms, the AVX2
// build 16.5 -> 11.4 ms; 8 decodes of 1800 tokens 15.9 -> 10.8 ms.
inline void prefetch_line_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
inline void prefetch_l2(const void* p, int bytes) {
  const char* c = static_cast<const char*>(p);
  for (int i = 0; i < bytes; i += 64) prefetch_line_l2(c + i);
}

#ifdef __AVX512F__
// 16 x 16 float32 transpose in registers: r[i] becomes column i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// 16 bf16 (or any 16-bit) values widened to 32-bit lanes and back, bits unchanged: the
// transposes below move 16-bit data through the float transpose.
inline __m512 widen16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
inline void narrow16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_castps_si512(v)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Row I of an NR-row group (when the group has it): A += x * lo, B += x * hi for x = *src
// broadcast; lo and hi are the two halves of 16 columns. Named accumulators, not an array:
// GCC keeps an array of them in memory and stores every one at every step (half the speed).
template <int I, int NR>
inline void fma_row(const float* src, __m256 lo, __m256 hi, __m256& A, __m256& B) {
  if constexpr (NR > I) {
    const __m256 x = _mm256_broadcast_ss(src);
    A = _mm256_fmadd_ps(x, lo, A);
    B = _mm256_fmadd_ps(x, hi, B);
  }
}
#endif

}  // namespace
