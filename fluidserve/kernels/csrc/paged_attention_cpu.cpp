// Paged attention over one flattened hybrid batch, on the CPU.
//
// The batch is a concatenation of per-request query runs: prefill chunks of many tokens and
// decodes of one. Every query attends causally to its request's context, which lives in a
// paged KV cache with these layouts:
//   key cache   [num_blocks, num_kv_heads, head_dim, block_size]   (keys transposed per block)
//   value cache [num_blocks, num_kv_heads, block_size, head_dim]
// Keys are transposed so that the scores of one query row against a whole block are head_dim
// multiply-adds of a block_size-wide vector (no horizontal sums); values are row-major so
// that "probability x value row" is a head_dim-wide multiply-add.
//
// A work item is (run, kv head, group of its query heads, tile of query tokens): the query
// heads that share a kv head (grouped-query attention) and a few consecutive tokens form up to
// kMaxRows query rows that share every key and value load. Softmax is computed online, one
// block at a time (flash-attention style), in float32 whatever the cache dtype. Items are
// spread over torch's OpenMP threads dynamically, longest first.
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
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// AVX2 without AVX-512: GCC then has no register mode for the 16-lane vectors below and keeps
// them on the stack, so the hot loops have versions on eight named __m256 lanes.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define FLUIDSERVE_AVX2_LANES 1
#endif

namespace {

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
inline v16f load16(const c10::BFloat16* p) {
  v16u16 h;
  std::memcpy(&h, p, sizeof(h));
  return (v16f)(__builtin_convertvector(h, v16u32) << 16);
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
  const v16i underflow = x < -87.0f;
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  const v16f t = x * 1.44269504088896341f + 0.5f;
  v16f n = __builtin_convertvector(__builtin_convertvector(t, v16i), v16f);  // trunc
  n = n > t ? n - 1.0f : n;                                                   // floor
  const v16f r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  v16f y = splat(1.0f / 720.0f);
  y = y * r + 1.0f / 120.0f;
  y = y * r + 1.0f / 24.0f;
  y = y * r + 1.0f / 6.0f;
  y = y * r + 0.5f;
  y = y * r + 1.0f;
  y = y * r + 1.0f;
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  y = y * (v16f)e;
  return underflow ? splat(0.0f) : y;
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
// arrive from memory: two blocks ahead left the loads exposed.
constexpr int kAhead = 8;
// 16-float chunks of a value row that the decode value pass keeps in registers for four
// rows at a time: 4 x 4 accumulators fill half of AVX-512's 32 registers, but 4 x 4 x 2 of
// AVX2's 16 would spill to the stack on every multiply-add.
#ifdef __AVX512F__
constexpr int kValueChunks = 4;
#else
constexpr int kValueChunks = 1;
#endif
inline void prefetch(const void* p, int bytes) {
  const char* c = static_cast<const char*>(p);
  for (int i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

// One work item, in three passes over its context: scores of every row against every key,
// softmax per row, then the probability-weighted sum of values. Rows are processed four at a
// time so that their accumulators stay in registers while each key or value row is loaded once.
template <typename T, int BS>
void attend(const WorkItem& w, const Batch& b, const T* q, T* out, const T* k_cache,
            const T* v_cache, std::vector<float>& scores) {
  static_assert(BS % 16 == 0, "block size must be a multiple of 16");
  constexpr int NV = BS / 16;
  const int G = b.H / b.Hkv, D = b.D;
  const int R = w.toks * w.heads;
  const int q0 = b.cu_q[w.run];
  const int q_len = b.cu_q[w.run + 1] - q0;
  const int first_pos = b.ctx_lens[w.run] - q_len;
  const int32_t* table = b.tables + w.run * b.table_stride;
  const int max_pos = first_pos + w.tok0 + w.toks - 1;
  const int num_blocks = max_pos / BS + 1;
  const int width = num_blocks * BS;  // keys per score row, padded to whole blocks
  const int64_t kv_stride = static_cast<int64_t>(b.Hkv) * BS * D;  // one physical block
  const int64_t head_off = static_cast<int64_t>(w.kv_head) * BS * D;

  alignas(64) float qf[kMaxRows][kMaxHeadDim];
  int last[kMaxRows];  // position of the row's token: keys 0..last are visible to it
  // Row r is token tok0 + r / heads of the run, query head kv_head * G + head0 + r % heads.
  for (int r = 0; r < R; ++r) {
    const int t = w.tok0 + r / w.heads;
    const int h = w.kv_head * G + w.head0 + r % w.heads;
    const T* qr = q + static_cast<int64_t>(q0 + t) * b.q_row + static_cast<int64_t>(h) * D;
    for (int d = 0; d < D; ++d) qf[r][d] = static_cast<float>(qr[d]) * b.scale;
    last[r] = first_pos + t;
  }
  scores.resize(static_cast<size_t>(R) * width);
  float* sc = scores.data();

  // Pass 1: scores. kt is the block's keys transposed, [D, BS]. Blocks are scattered in
  // memory, so the next one is prefetched while this one is used.
  const int block_bytes = BS * D * sizeof(T);
  for (int blk = 0; blk < num_blocks; ++blk) {
    const T* kt = k_cache + table[blk] * kv_stride + head_off;
    if (blk + 1 < num_blocks) prefetch(k_cache + table[blk + 1] * kv_stride + head_off, block_bytes);
    for (int r0 = 0; r0 < R; r0 += 4) {
      const int nr = std::min(4, R - r0);
      v16f s[4][NV] = {};
      for (int d = 0; d < D; ++d) {
        for (int c = 0; c < NV; ++c) {
          const v16f k = load16(kt + d * BS + 16 * c);
          s[0][c] += qf[r0][d] * k;
          if (nr > 1) s[1][c] += qf[r0 + 1][d] * k;
          if (nr > 2) s[2][c] += qf[r0 + 2][d] * k;
          if (nr > 3) s[3][c] += qf[r0 + 3][d] * k;
        }
      }
      for (int rr = 0; rr < nr; ++rr)
        for (int c = 0; c < NV; ++c) store16(sc + (r0 + rr) * width + blk * BS + 16 * c, s[rr][c]);
    }
  }
  // Pass 2: softmax of each row over its visible keys; invisible ones get probability 0.
  float inv_sum[kMaxRows];
  for (int r = 0; r < R; ++r) inv_sum[r] = softmax_row(sc + r * width, last[r] + 1, width);
  // Pass 3: out_r = sum_j p[r][j] * v_j / sum_r, D / 16 vectors of four rows at a time.
  const int keys = max_pos + 1;
  for (int r0 = 0; r0 < R; r0 += 4) {
    const int nr = std::min(4, R - r0);
    for (int d0 = 0; d0 < D; d0 += 64) {
      const int nd = std::min(64, D - d0) / 16;
      v16f a[4][4] = {};
      for (int blk = 0; blk < num_blocks; ++blk) {
        const T* vb = v_cache + table[blk] * kv_stride + head_off + d0;  // [BS, D]
        if (blk + 1 < num_blocks)
          prefetch(v_cache + table[blk + 1] * kv_stride + head_off + d0, block_bytes);
        const int nj = std::min(BS, keys - blk * BS);
        for (int j = 0; j < nj; ++j) {
          const int key = blk * BS + j;
          v16f v[4];
          for (int c = 0; c < nd; ++c) v[c] = load16(vb + j * D + 16 * c);
          for (int rr = 0; rr < nr; ++rr) {
            const float pr = sc[(r0 + rr) * width + key];
            for (int c = 0; c < nd; ++c) a[rr][c] += pr * v[c];
          }
        }
      }
      for (int rr = 0; rr < nr; ++rr) {
        const int r = r0 + rr;
        const int t = w.tok0 + r / w.heads;
        const int h = w.kv_head * G + w.head0 + r % w.heads;
        T* o = out + (static_cast<int64_t>(q0 + t) * b.H + h) * D + d0;
        for (int c = 0; c < nd; ++c)
          for (int i = 0; i < 16; ++i) o[16 * c + i] = static_cast<T>(a[rr][c][i] * inv_sum[r]);
      }
    }
  }
}

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

#ifdef FLUIDSERVE_AVX2_LANES
// ---------------------------------- decode attention's inner loops with AVX2 (bf16, 16-key blocks)
//
// Without AVX-512 GCC has no register mode for the 16-lane vectors above: it keeps every
// v16f in memory and converts bf16 piece by piece through the stack, which made the decode
// item below a third of a batch-40 decode step on a 2-core EPYC (Zen 3). Its score, softmax
// and value loops have versions on named __m256 registers for bf16 caches with 16-key
// blocks: a key block row (16 keys, transposed) is two 8-key halves, a value row chunk of
// 16 channels two halves, and up to four query rows of a kv head share every load.
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
    if (pf && d % 2 == 0) __builtin_prefetch(pf + d * 16);
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
          __builtin_prefetch(reinterpret_cast<const char*>(pf + j * D) + by);
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

// A decode item: one query token, query heads head0 .. head0 + heads - 1 (whole groups of
// kv heads). Blocks are visited once, all the item's kv heads together (contiguous in the
// cache), with the blocks kAhead ahead prefetched (the first ones before the pass starts, and
// the value pass's first ones during the score pass's last blocks); the score and value
// passes are the ones of ``attend``.
template <typename T, int BS>
void attend_decode(const WorkItem& w, const Batch& b, const T* q, T* out, const T* k_cache,
                   const T* v_cache, std::vector<float>& scores) {
  constexpr int NV = BS / 16;
  // The inner loops on AVX2 registers (above); head_dim is a multiple of 16 (native_supported).
  constexpr bool kAvx2Item = kDecodeAvx2 && std::is_same_v<T, c10::BFloat16> && BS == 16;
  const int G = b.H / b.Hkv, D = b.D;
  const int R = w.heads, h0 = w.head0, kv0 = h0 / G, nkv = R / G;
  const int q0 = b.cu_q[w.run];
  const int ctx = b.ctx_lens[w.run];
  const int32_t* table = b.tables + w.run * b.table_stride;
  const int num_blocks = (ctx - 1) / BS + 1;
  const int width = num_blocks * BS;
  const int64_t kv_stride = static_cast<int64_t>(b.Hkv) * BS * D;
  const int64_t off = static_cast<int64_t>(kv0) * BS * D;
  const int span = nkv * BS * D * static_cast<int>(sizeof(T));  // bytes read per block
  // The block kAhead on is prefetched line by line between this block's loads (each kv
  // head's first rows prefetch that kv head's lines), not in one burst before them: a burst
  // of 128 prefetches fills the line-fill buffers and stalls everything queued behind it
  // (half the kernel's samples sat on them; 40 decodes of 290 tokens: 13.9 -> 11.9 ms on two
  // cores of an Emerald Rapids class Xeon; the AVX2 loops, built for AVX2 on that CPU, 13.6 ->
  // 11.3 ms). In the AVX2 loops always, in the others where every group of rows is their
  // common case; else one burst.
  const bool spread = kAvx2Item || G % 4 == 0;
  const bool spread_values = kAvx2Item || (spread && D % (16 * kValueChunks) == 0);

  alignas(64) float qf[kMaxRows][kMaxHeadDim];
  alignas(64) float acc[kMaxRows][kMaxHeadDim];
  for (int r = 0; r < R; ++r) {
    const T* qr = q + static_cast<int64_t>(q0) * b.q_row + static_cast<int64_t>(h0 + r) * D;
    for (int d = 0; d < D; ++d) qf[r][d] = static_cast<float>(qr[d]) * b.scale;
    std::fill(acc[r], acc[r] + D, 0.0f);
  }
  scores.resize(static_cast<size_t>(R) * width);
  float* sc = scores.data();
  for (int blk = 0; blk < std::min(kAhead, num_blocks); ++blk)
    prefetch(k_cache + table[blk] * kv_stride + off, span);
  for (int blk = 0; blk < num_blocks; ++blk) {  // pass 1: scores
    const T* ahead = blk + kAhead < num_blocks
                         ? k_cache + table[blk + kAhead] * kv_stride + off
                     : blk + kAhead - num_blocks < num_blocks  // the value pass's first blocks
                         ? v_cache + table[blk + kAhead - num_blocks] * kv_stride + off
                         : nullptr;
    if (ahead && !spread) prefetch(ahead, span);
    const T* kb = k_cache + table[blk] * kv_stride + off;
    for (int k = 0; k < nkv; ++k) {
      const T* kt = kb + k * BS * D;  // [D, BS]
      const T* pf = spread && ahead ? ahead + k * BS * D : nullptr;  // kv head k, kAhead on
      for (int r0 = k * G; r0 < (k + 1) * G; r0 += 4) {
        const int nr = std::min(4, (k + 1) * G - r0);
        if constexpr (kAvx2Item) {
          rows_of_group<4>(nr, qf[r0], kt, D, sc + r0 * width + blk * BS, width,
                           r0 == k * G ? pf : nullptr);
          continue;
        }
        if (nr == 4) {  // the common case, with every accumulator in a register
          v16f s[4][NV] = {};
          const T* lead = r0 == k * G ? pf : nullptr;  // the group's first rows prefetch
          for (int d = 0; d < D; ++d)
            for (int c = 0; c < NV; ++c) {
              if (lead && (d * BS + 16 * c) * static_cast<int>(sizeof(T)) % 64 == 0)
                __builtin_prefetch(lead + d * BS + 16 * c);
              const v16f kv = load16(kt + d * BS + 16 * c);
              for (int rr = 0; rr < 4; ++rr) s[rr][c] += qf[r0 + rr][d] * kv;
            }
          for (int rr = 0; rr < 4; ++rr)
            for (int c = 0; c < NV; ++c)
              store16(sc + (r0 + rr) * width + blk * BS + 16 * c, s[rr][c]);
          continue;
        }
        for (int rr = 0; rr < nr; ++rr) {
          v16f s1[NV] = {};
          for (int d = 0; d < D; ++d)
            for (int c = 0; c < NV; ++c) s1[c] += qf[r0 + rr][d] * load16(kt + d * BS + 16 * c);
          for (int c = 0; c < NV; ++c) store16(sc + (r0 + rr) * width + blk * BS + 16 * c, s1[c]);
        }
      }
    }
  }
  float inv_sum[kMaxRows];
  for (int r = 0; r < R; ++r)  // pass 2: softmax over the ctx visible keys
    inv_sum[r] = kAvx2Item ? softmax_row8(sc + r * width, ctx, width)
                           : softmax_row(sc + r * width, ctx, width);
  for (int blk = 0; blk < num_blocks; ++blk) {  // pass 3: probability-weighted values
    const T* ahead =
        blk + kAhead < num_blocks ? v_cache + table[blk + kAhead] * kv_stride + off : nullptr;
    if (ahead && !spread_values) prefetch(ahead, span);
    const T* vb = v_cache + table[blk] * kv_stride + off;
    const int nj = std::min(BS, ctx - blk * BS);
    for (int k = 0; k < nkv; ++k) {
      const T* vh = vb + k * BS * D;  // [BS, D]
      const T* pf = spread_values && ahead ? ahead + k * BS * D : nullptr;
      for (int r0 = k * G; r0 < (k + 1) * G; r0 += 4) {
        const int nr = std::min(4, (k + 1) * G - r0);
        const float* p0 = sc + r0 * width + blk * BS;
        if constexpr (kAvx2Item) {
          values_of_group<4>(nr, p0, width, vh, nj, D, acc[r0], r0 == k * G ? pf : nullptr);
          continue;
        }
        if (nr == 4 && D % (16 * kValueChunks) == 0) {  // the common case, in registers
          const T* lead = r0 == k * G ? pf : nullptr;
          for (int d0 = 0; d0 < D; d0 += 16 * kValueChunks) {
            v16f a[4][kValueChunks];
            for (int rr = 0; rr < 4; ++rr)
              for (int c = 0; c < kValueChunks; ++c)
                a[rr][c] = load16(&acc[r0 + rr][d0 + 16 * c]);
            for (int j = 0; j < nj; ++j) {
              if (lead && d0 == 0)  // row j of the block ahead
                for (int by = 0; by < D * static_cast<int>(sizeof(T)); by += 64)
                  __builtin_prefetch(reinterpret_cast<const char*>(lead + j * D) + by);
              v16f v[kValueChunks];
              for (int c = 0; c < kValueChunks; ++c) v[c] = load16(vh + j * D + d0 + 16 * c);
              for (int rr = 0; rr < 4; ++rr) {
                const float pr = p0[rr * width + j];
                for (int c = 0; c < kValueChunks; ++c) a[rr][c] += pr * v[c];
              }
            }
            for (int rr = 0; rr < 4; ++rr)
              for (int c = 0; c < kValueChunks; ++c)
                store16(&acc[r0 + rr][d0 + 16 * c], a[rr][c]);
          }
          continue;
        }
        for (int rr = 0; rr < nr; ++rr)
          for (int d0 = 0; d0 < D; d0 += 16) {
            v16f a = load16(&acc[r0 + rr][d0]);
            for (int j = 0; j < nj; ++j) a += p0[rr * width + j] * load16(vh + j * D + d0);
            store16(&acc[r0 + rr][d0], a);
          }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    T* o = out + (static_cast<int64_t>(q0) * b.H + h0 + r) * D;
    for (int d = 0; d < D; ++d) o[d] = static_cast<T>(acc[r][d] * inv_sum[r]);
  }
}

std::vector<WorkItem> make_items(const Batch& b, int64_t num_runs, int block_size,
                                 const std::vector<uint8_t>& skip, int threads) {
  const int G = b.H / b.Hkv;
  const int heads = std::min(G, kMaxRows);
  const int toks = std::max(1, kMaxRows / heads);
  // A decode item takes whole kv-head groups, up to kMaxRows query heads. When a batch has
  // only decodes and fewer of them than threads (batch 1), each is split into as many items
  // as there are threads per decode (whole groups still), so that no thread waits.
  int decodes = 0, others = 0;
  for (int32_t s = 0; s < num_runs; ++s)
    if (!skip[s]) (b.cu_q[s + 1] - b.cu_q[s] == 1 ? decodes : others)++;
  int per_decode = std::min(b.H, kMaxRows);
  if (others == 0 && decodes > 0 && decodes < threads) {
    const int split = (threads + decodes - 1) / decodes;
    per_decode = std::max(G, per_decode / split / G * G);
  }
  std::vector<WorkItem> items;
  for (int32_t s = 0; s < num_runs; ++s) {
    if (skip[s]) continue;
    const int q_len = b.cu_q[s + 1] - b.cu_q[s];
    const int first_pos = b.ctx_lens[s] - q_len;
    if (q_len == 1 && G <= kMaxRows && kMaxRows % G == 0) {
      // A decode: whole kv-head groups per item, so each block's keys and values of those
      // heads are read as one contiguous stretch.
      const int per_item = per_decode;
      const int64_t blocks = (b.ctx_lens[s] - 1) / block_size + 1;
      for (int h0 = 0; h0 < b.H; h0 += per_item)
        items.push_back({s, 1, h0 / G, h0, std::min(per_item, b.H - h0), 0, 1,
                         blocks * per_item});
      continue;
    }
    for (int t0 = 0; t0 < q_len; t0 += toks) {
      const int nt = std::min(toks, q_len - t0);
      const int64_t blocks = (first_pos + t0 + nt - 1) / block_size + 1;
      for (int kvh = 0; kvh < b.Hkv; ++kvh)
        for (int h0 = 0; h0 < G; h0 += heads)
          items.push_back({s, 0, kvh, h0, std::min(heads, G - h0), t0, nt, blocks * nt * heads});
    }
  }
  std::sort(items.begin(), items.end(),
            [](const WorkItem& a, const WorkItem& c) { return a.cost > c.cost; });
  return items;
}

template <typename T, int BS>
inline void attend_item(const WorkItem& w, const Batch& b, const T* q, T* out, const T* kc,
                        const T* vc, std::vector<float>& scores) {
  if (w.all_heads)
    attend_decode<T, BS>(w, b, q, out, kc, vc, scores);
  else
    attend<T, BS>(w, b, q, out, kc, vc, scores);
}

template <typename T, int BS>
void run_items(const std::vector<WorkItem>& items, const Batch& b, const T* q, T* out,
               const T* kc, const T* vc) {
  const int64_t n = static_cast<int64_t>(items.size());
  const int threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    std::vector<float> scores;
    for (int64_t i = 0; i < n; ++i) attend_item<T, BS>(items[i], b, q, out, kc, vc, scores);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) attend_item<T, BS>(items[i], b, q, out, kc, vc, scores);
  }
}

template <typename T>
void run(int bs, const std::vector<WorkItem>& items, const Batch& b, const at::Tensor& qt,
         at::Tensor& outt, const at::Tensor& kct, const at::Tensor& vct) {
  const T* q = qt.data_ptr<T>();
  T* out = outt.data_ptr<T>();
  const T* kc = kct.data_ptr<T>();
  const T* vc = vct.data_ptr<T>();
  switch (bs) {
    case 16: return run_items<T, 16>(items, b, q, out, kc, vc);
    case 32: return run_items<T, 32>(items, b, q, out, kc, vc);
    default: TORCH_CHECK(false, "paged_attention: unsupported block size ", bs);
  }
}

template <typename T>
void argmax_impl(const at::Tensor& logits, int64_t S, int64_t V, int64_t* out) {
  const T* data = logits.data_ptr<T>();
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const T* row = data + s * V;
      // Per lane, the largest value so far and the first index holding it.
      v16f vm = splat(kNegInf);
      v16i vi = {}, lane;
      for (int k = 0; k < 16; ++k) lane[k] = k;
      int64_t i = 0;
      for (; i + 16 <= V && i < (1LL << 31) - 16; i += 16) {
        const v16f x = load16(row + i);
        const v16i gt = x > vm;
        vm = gt ? x : vm;
        vi = gt ? lane + static_cast<int32_t>(i) : vi;
      }
      float best = kNegInf;
      int64_t idx = 0;
      for (int k = 0; k < 16; ++k)
        if (vm[k] > best || (vm[k] == best && vi[k] < idx)) best = vm[k], idx = vi[k];
      for (; i < V; ++i)
        if (static_cast<float>(row[i]) > best) best = static_cast<float>(row[i]), idx = i;
      out[s] = idx;  // a row of NaNs or -inf has no maximum: token 0
    }
  });
}

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

// Stores of 16 float lanes into the model dtype, rounding to nearest-even as c10 does.
inline void store16(c10::BFloat16* p, v16f v) {
  const v16u32 b = (v16u32)v;
  v16u32 r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  r = v == v ? r : (v16u32){} + 0x7fc0u;  // NaN stays NaN
  const v16u16 h = __builtin_convertvector(r, v16u16);
  std::memcpy(p, &h, sizeof(h));
}
inline void store16(c10::Half* p, v16f v) {
  for (int i = 0; i < 16; ++i) p[i] = c10::Half(v[i]);
}
// x rounded to the model dtype and back: the "round after each operator" of the eager code.
template <typename T>
inline v16f round16(v16f v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // In registers, as store16 rounds (a round trip through memory cost silu_and_mul 18%).
    const v16u32 b = (v16u32)v;
    const v16u32 r = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    return v == v ? (v16f)r : v;
  } else {
    T tmp[16];
    store16(tmp, v);
    return load16(tmp);
  }
}

#ifdef FLUIDSERVE_AVX2_LANES
// The elementwise kernels of bf16 on eight lanes of named registers: on AVX2 their 16-lane
// versions below keep every vector on the stack (on a Zen 3, SiLU-and-mul took 5 ns an
// element, 4% of a batch-40 decode step, and RMSNorm 1.6 ns). Same arithmetic in the same
// order, so the same bits: bf16 rounding to nearest-even in registers, NaN kept.
inline __m256 round8_bf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(
      _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb),
      _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
// Stores a vector already rounded to bf16 (low halves zero; a NaN stored as 0x7fc0).
inline void store8_rounded_bf16(c10::BFloat16* p, __m256 v) {
  __m256i h = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7fc0),
                         _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// norm_row's sum of squares in the same order: a[2j] and a[2j + 1] are the low and high
// eight lanes of its acc[j], reduced as it reduces them.
inline float sum_squares8(const c10::BFloat16* x, int64_t n, int64_t& i) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m256 lo, hi;
  for (i = 0; i + 64 <= n; i += 64) {
    bf16x16(x + i, lo, hi);
    a0 = _mm256_fmadd_ps(lo, lo, a0), a1 = _mm256_fmadd_ps(hi, hi, a1);
    bf16x16(x + i + 16, lo, hi);
    a2 = _mm256_fmadd_ps(lo, lo, a2), a3 = _mm256_fmadd_ps(hi, hi, a3);
    bf16x16(x + i + 32, lo, hi);
    a4 = _mm256_fmadd_ps(lo, lo, a4), a5 = _mm256_fmadd_ps(hi, hi, a5);
    bf16x16(x + i + 48, lo, hi);
    a6 = _mm256_fmadd_ps(lo, lo, a6), a7 = _mm256_fmadd_ps(hi, hi, a7);
  }
  for (; i + 16 <= n; i += 16) {
    bf16x16(x + i, lo, hi);
    a0 = _mm256_fmadd_ps(lo, lo, a0), a1 = _mm256_fmadd_ps(hi, hi, a1);
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a4, a6)));
  _mm256_store_ps(lanes + 8, _mm256_add_ps(_mm256_add_ps(a1, a3), _mm256_add_ps(a5, a7)));
  float ss = 0.0f;
  for (float l : lanes) ss += l;
  return ss;
}
#endif

// One row of RMSNorm: out = w * (x * rsqrt(mean(x^2) + eps)).to(T). Sixteen lanes at a time
// with a scalar tail; the sum of squares is accumulated in four vectors (the eager mean also
// sums in a tree, not in order).
template <typename T>
void norm_row(T* out, const T* x, const T* w, int64_t n, double eps) {
  int64_t i = 0;
  float ss;
#ifdef FLUIDSERVE_AVX2_LANES
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    ss = sum_squares8(x, n, i);
  } else
#endif
  {
    v16f acc[4] = {};
    for (; i + 64 <= n; i += 64)
      for (int j = 0; j < 4; ++j) {
        const v16f v = load16(x + i + 16 * j);
        acc[j] += v * v;
      }
    for (; i + 16 <= n; i += 16) {
      const v16f v = load16(x + i);
      acc[0] += v * v;
    }
    ss = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
  i = 0;
#ifdef FLUIDSERVE_AVX2_LANES
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8)
      store8_rounded_bf16(out + i, round8_bf16(_mm256_mul_ps(
          bf16x8(w + i), round8_bf16(_mm256_mul_ps(bf16x8(x + i), vinv)))));
  }
#endif
  for (; i + 16 <= n; i += 16)
    store16(out + i, load16(w + i) * round16<T>(load16(x + i) * inv));
  for (; i < n; ++i) {
    const T normed = round_to<T>(static_cast<float>(x[i]) * inv);  // .to(dtype)
    out[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
}

template <typename T>
void add_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                   int64_t T_, int64_t Hd) {
  T* xd = x.data_ptr<T>();
  T* rd = residual.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* xr = xd + t * Hd;
      T* rr = rd + t * Hd;
      int64_t i = 0;
#ifdef FLUIDSERVE_AVX2_LANES
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        for (; i + 8 <= Hd; i += 8)
          store8_rounded_bf16(rr + i, round8_bf16(_mm256_add_ps(bf16x8(rr + i), bf16x8(xr + i))));
#endif
      for (; i + 16 <= Hd; i += 16) store16(rr + i, load16(rr + i) + load16(xr + i));
      for (; i < Hd; ++i)
        rr[i] = round_to<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
      norm_row<T>(xr, rr, w, Hd, eps);
    }
  });
}

template <typename T>
void norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
               int64_t T_, int64_t Hd) {
  T* od = out.data_ptr<T>();
  const T* xd = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) norm_row<T>(od + t * Hd, xd + t * Hd, w, Hd, eps);
  });
}

template <typename T>
void rope_rows(T* base, int64_t heads, int64_t D, const float* c, const float* s) {
  const int64_t h2 = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* x = base + h * D;
    int64_t i = 0;
    for (; i + 16 <= h2; i += 16) {
      const v16f a = load16(x + i), b = load16(x + i + h2);
      const v16f lo = a * load16(c + i) + (-b) * load16(s + i);
      const v16f hi = b * load16(c + i + h2) + a * load16(s + i + h2);
      store16(x + i, lo);
      store16(x + i + h2, hi);
    }
    for (; i < h2; ++i) {
      const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + h2]);
      const float lo = a * c[i] + (-b) * s[i];
      const float hi = b * c[i + h2] + a * s[i + h2];
      x[i] = round_to<T>(lo);
      x[i + h2] = round_to<T>(hi);
    }
  }
}

template <typename T>
void rope_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
               const at::Tensor& sin) {
  const int64_t T_ = q.size(0), H = q.size(1), Hkv = k.size(1), D = q.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cd = cos.data_ptr<float>();
  const float* sd = sin.data_ptr<float>();
  T* qd = q.data_ptr<T>();
  T* kd = k.data_ptr<T>();
  const int64_t qs = q.stride(0), ks = k.stride(0), cs = cos.stride(0);
  at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cd + pos[t] * cs;
      const float* s = sd + pos[t] * cs;
      rope_rows<T>(qd + t * qs, H, D, c, s);
      rope_rows<T>(kd + t * ks, Hkv, D, c, s);
    }
  });
}

#ifdef FLUIDSERVE_AVX2_LANES
// SiLU-and-mul of bf16 on eight lanes (exp8 is vexp's polynomial).
inline int64_t silu_mul8(c10::BFloat16* o, const c10::BFloat16* g, const c10::BFloat16* u,
                         int64_t I) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 gv = bf16x8(g + i);
    const __m256 act = round8_bf16(
        _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign)))));  // F.silu
    store8_rounded_bf16(o + i, round8_bf16(_mm256_mul_ps(act, bf16x8(u + i))));
  }
  return i;
}
#endif

template <typename T>
void silu_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t T_ = x.size(0), I = x.size(1) / 2;
  const T* xd = x.data_ptr<T>();
  T* od = out.data_ptr<T>();
  at::parallel_for(0, T_, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* g = xd + t * 2 * I;
      const T* u = g + I;
      T* o = od + t * I;
      int64_t i = 0;
#ifdef FLUIDSERVE_AVX2_LANES
      if constexpr (std::is_same_v<T, c10::BFloat16>) i = silu_mul8(o, g, u, I);
#endif
      for (; i + 16 <= I; i += 16) {
        const v16f gv = load16(g + i);
        const v16f act = round16<T>(gv / (1.0f + vexp(-gv)));  // F.silu
        store16(o + i, act * load16(u + i));
      }
      for (; i < I; ++i) {
        const float gv = static_cast<float>(g[i]);
        const T act = round_to<T>(gv / (1.0f + std::exp(-gv)));  // F.silu
        o[i] = round_to<T>(static_cast<float>(act) * static_cast<float>(u[i]));
      }
    }
  });
}

// ------------------------------------------------ prefill attention on AMX tiles (bf16)
//
// Whether long runs may take this file's prefill kernel (AMX tiles, or the panels below)
// where it is built: off with FLUIDSERVE_NO_PREFILL_KERNEL set, and then ATen's flash
// attention takes them.
bool g_prefill_kernel = std::getenv("FLUIDSERVE_NO_PREFILL_KERNEL") == nullptr;

// 2^f for |f| <= 1/2 as a degree-4 polynomial, highest power first (relative error < 5e-5,
// well below the bf16 rounding of P): the prefill kernels' softmax, on AMX and on AVX2.
constexpr float kExp2Poly[5] = {9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f,
                                1.0f};

// A long run (a prefill chunk) attends to its paged context with both products on the
// CPU's matrix unit: bf16 dot products into 16 x 16 float32 tiles (TDPBF16PS, 8192
// multiply-adds per instruction), flash-attention style with an online softmax between them.
// The products are taken transposed, S^T = K Q^T and O^T += V^T P^T, so that a tile row holds
// one key (or one channel) for 16 queries: the softmax then runs down 16-query vectors with no
// horizontal reductions, which is where a CPU flash attention spends its time (ATen's ran
// these runs at ~0.35 TFLOP/s on a 2-core Sapphire Rapids VM).
//
// First, once per (run, kv head), the keys the run can see are copied key-major ([key, D])
// and the values channel-major ([D, key]), zero up to a multiple of 32 keys. Then a work item
// (run, kv head, up to kAmxQ query tokens) takes 16-token tiles and, for each query head of
// the group and each 32-key chunk up to the tile's last position: S^T (two tiles), mask and
// scale, running max and sum per query, P rounded to bf16 (as flash attention on GPUs does),
// O^T = O^T * alpha + V^T P^T.
// A prefill kernel's work item: query tokens tok0 .. tok0 + toks - 1 of long run run_index
// (an index into the kernel's own list of runs) against kv head kv_head.
struct LongItem {
  int32_t run_index, kv_head, tok0, toks;
};

// The items of ``runs`` (each with the batch run ``run`` and the ``keys`` it sees), per_item
// query tokens at a time: later query ranges see more keys, so the longest go first, as for
// the per-token kernel's items.
template <typename Run>
std::vector<LongItem> long_items(const Batch& b, const std::vector<Run>& runs, int per_item) {
  std::vector<LongItem> items;
  for (int i = 0; i < static_cast<int>(runs.size()); ++i) {
    const int q_len = b.cu_q[runs[i].run + 1] - b.cu_q[runs[i].run];
    for (int g = 0; g < b.Hkv; ++g)
      for (int t0 = 0; t0 < q_len; t0 += per_item)
        items.push_back({i, g, t0, std::min(per_item, q_len - t0)});
  }
  auto reach = [&](const LongItem& x) {
    const Run& r = runs[x.run_index];
    return r.keys - (b.cu_q[r.run + 1] - b.cu_q[r.run]) + x.tok0;
  };
  std::sort(items.begin(), items.end(),
            [&](const LongItem& x, const LongItem& y) { return reach(x) > reach(y); });
  return items;
}

#ifdef __AVX512F__
// 2^t for t <= 0 on 16 lanes: 2^round(t) times kExp2Poly(t - round(t)). With ``clamp``,
// -inf (a masked score) gives 2^-126, nothing beside a softmax row's sum of at least 1;
// without, t must be finite.
template <bool clamp>
inline __m512 exp2_neg(__m512 t) {
  if constexpr (clamp) t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 5; ++i) y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(y, n);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
constexpr int kAmxQ = 64;  // query tokens per work item

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The kernel asks Linux once for permission to use the tile registers (oneDNN does the same).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

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

struct AmxRun {
  int32_t run, keys, padded;  // keys the run sees; padded to a multiple of 32
  int64_t offset;             // of its kv heads' packed keys (then values) in the buffer
};

// Keys 0 .. keys - 1 of kv head g key-major into kp [padded, D] and values channel-major
// into vt [D, padded], 16 x 16 blocks at a time; the padding is zero.
void amx_pack(const Batch& b, const AmxRun& r, int g, int BS, const uint16_t* kc,
              const uint16_t* vc, uint16_t* kp, uint16_t* vt) {
  const int D = b.D;
  const int64_t kv_stride = static_cast<int64_t>(b.Hkv) * BS * D;
  const int32_t* table = b.tables + r.run * b.table_stride;
  __m512 x[16];
  // Whole 16-key groups: past the context they copy stale cache slots, zeroed below.
  for (int key0 = 0; key0 < r.keys; key0 += 16) {
    const int64_t base = table[key0 / BS] * kv_stride + static_cast<int64_t>(g) * BS * D;
    const uint16_t* kt = kc + base + key0 % BS;       // [D, BS] from column key0 % BS
    const uint16_t* vb = vc + base + (key0 % BS) * D;  // [BS, D] from row key0 % BS
    for (int d0 = 0; d0 < D; d0 += 16) {
      for (int i = 0; i < 16; ++i) x[i] = widen16(kt + (d0 + i) * BS);  // channel d0 + i
      transpose16(x);
      for (int j = 0; j < 16; ++j) narrow16(kp + static_cast<int64_t>(key0 + j) * D + d0, x[j]);
      for (int j = 0; j < 16; ++j) x[j] = widen16(vb + j * D + d0);  // key key0 + j
      transpose16(x);
      for (int i = 0; i < 16; ++i)
        narrow16(vt + static_cast<int64_t>(d0 + i) * r.padded + key0, x[i]);
    }
  }
  std::memset(kp + static_cast<int64_t>(r.keys) * D, 0, (r.padded - r.keys) * D * 2);
  for (int d = 0; d < D; ++d)
    std::memset(vt + static_cast<int64_t>(d) * r.padded + r.keys, 0, (r.padded - r.keys) * 2);
}

void amx_item(const LongItem& w, const std::vector<AmxRun>& runs, const Batch& b,
              const uint16_t* q, uint16_t* out, const uint16_t* packed) {
  const AmxRun& r = runs[w.run_index];
  const int D = b.D, G = b.H / b.Hkv, DC = D / 32, DB = D / 16;
  const int q0 = b.cu_q[r.run];
  const int q_len = b.cu_q[r.run + 1] - q0;
  const int first_pos = b.ctx_lens[r.run] - q_len;
  const uint16_t* kp = packed + r.offset + static_cast<int64_t>(w.kv_head) * 2 * r.padded * D;
  const uint16_t* vt = kp + static_cast<int64_t>(r.padded) * D;
  const float c = b.scale * 1.4426950408889634f;  // scores in log2 units

  alignas(64) uint16_t qt[kMaxHeadDim / 32][16 * 32];  // Q^T, VNNI: [d pair][query][2]
  alignas(64) float st[32 * 16];                       // S^T of one chunk: [key][query]
  alignas(64) uint16_t pt[16 * 32];                    // P^T, VNNI: [key pair][query][2]
  alignas(64) float cb[2][16 * 16];
  alignas(64) float ot[kMaxHeadDim * 16];  // O^T: [channel][query]
  static const __m512i pair_idx = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int t0 = w.tok0; t0 < w.tok0 + w.toks; t0 += 16) {
    const int nt = std::min(16, w.tok0 + w.toks - t0);
    // Position of each query lane; padding lanes see every key (their output is dropped).
    const __m512i qpos = _mm512_mask_blend_epi32(
        _mm512_cmplt_epi32_mask(lanes, _mm512_set1_epi32(nt)), _mm512_set1_epi32(1 << 30),
        _mm512_add_epi32(lanes, _mm512_set1_epi32(first_pos + t0)));
    const int min_pos = first_pos + t0, max_pos = first_pos + t0 + nt - 1;
    const int chunks = max_pos / 32 + 1;
    for (int hh = 0; hh < G; ++hh) {
      const int h = w.kv_head * G + hh;
      for (int dc = 0; dc < DC; ++dc) {  // as 32-bit pairs: a 16 x 16 transpose per 32 d
        __m512 y[16];
        for (int t = 0; t < 16; ++t)
          y[t] = t < nt ? _mm512_loadu_ps(reinterpret_cast<const float*>(
                              q + static_cast<int64_t>(q0 + t0 + t) * b.q_row +
                              static_cast<int64_t>(h) * D + 32 * dc))
                        : _mm512_setzero_ps();
        transpose16(y);
        for (int i = 0; i < 16; ++i) _mm512_store_ps(reinterpret_cast<float*>(qt[dc] + 32 * i), y[i]);
      }
      __m512 m = _mm512_set1_ps(kNegInf), l = _mm512_setzero_ps();
      std::fill(ot, ot + D * 16, 0.0f);
      for (int ch = 0; ch < chunks; ++ch) {
        const int key0 = 32 * ch;
        _tile_zero(0);
        _tile_zero(1);
        for (int dc = 0; dc < DC; ++dc) {
          _tile_loadd(3, qt[dc], 64);
          _tile_loadd(2, kp + static_cast<int64_t>(key0) * D + 32 * dc, D * 2);
          _tile_dpbf16ps(0, 2, 3);
          _tile_loadd(2, kp + static_cast<int64_t>(key0 + 16) * D + 32 * dc, D * 2);
          _tile_dpbf16ps(1, 2, 3);
        }
        _tile_stored(0, st, 64);
        _tile_stored(1, st + 256, 64);
        __m512 x[32];
        const bool edge = key0 + 31 > min_pos;  // some key of the chunk is after some query
        __m512 mx = _mm512_set1_ps(kNegInf);
        for (int j = 0; j < 32; ++j) {
          x[j] = _mm512_load_ps(st + 16 * j);
          if (edge)
            x[j] = _mm512_mask_blend_ps(
                _mm512_cmplt_epi32_mask(qpos, _mm512_set1_epi32(key0 + j)), x[j],
                _mm512_set1_ps(kNegInf));
          mx = _mm512_max_ps(mx, x[j]);
        }
        const __m512 m_new = _mm512_max_ps(m, _mm512_mul_ps(mx, _mm512_set1_ps(c)));
        // m is -inf until a lane has seen a key: its alpha is then 0 (nothing to rescale).
        const __m512 alpha = exp2_neg<true>(_mm512_sub_ps(m, m_new));
        m = m_new;
        const __m512 neg_m = _mm512_sub_ps(_mm512_setzero_ps(), m_new);
        __m512 sum = _mm512_setzero_ps();
        auto probabilities = [&](auto exp2) {
          for (int j = 0; j < 32; j += 2) {
            const __m512 p0 = exp2(_mm512_fmadd_ps(x[j], _mm512_set1_ps(c), neg_m));
            const __m512 p1 = exp2(_mm512_fmadd_ps(x[j + 1], _mm512_set1_ps(c), neg_m));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            const __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
            _mm512_store_si512(pt + 16 * j, _mm512_permutexvar_epi16(pair_idx, pb));
          }
        };
        if (edge)  // masked scores are -inf
          probabilities([](__m512 t) { return exp2_neg<true>(t); });
        else
          probabilities([](__m512 t) { return exp2_neg<false>(t); });
        l = _mm512_fmadd_ps(l, alpha, sum);
        _tile_loadd(3, pt, 64);
        for (int db = 0; db < DB; ++db) {
          const int tile = db & 1;  // two accumulators in flight
          if (tile == 0) {
            _tile_zero(0);
            _tile_loadd(2, vt + static_cast<int64_t>(16 * db) * r.padded + key0, r.padded * 2);
            _tile_dpbf16ps(0, 2, 3);
            _tile_stored(0, cb[0], 64);
          } else {
            _tile_zero(1);
            _tile_loadd(2, vt + static_cast<int64_t>(16 * db) * r.padded + key0, r.padded * 2);
            _tile_dpbf16ps(1, 2, 3);
            _tile_stored(1, cb[1], 64);
          }
          float* o = ot + 16 * db * 16;
          for (int d = 0; d < 16; ++d)
            _mm512_store_ps(o + 16 * d, _mm512_fmadd_ps(_mm512_load_ps(o + 16 * d), alpha,
                                                        _mm512_load_ps(cb[tile] + 16 * d)));
        }
      }
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
      for (int d0 = 0; d0 < D; d0 += 16) {  // O^T rows d0 .. d0 + 15 become 16-channel rows
        __m512 y[16];
        for (int i = 0; i < 16; ++i) y[i] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + i) * 16), inv);
        transpose16(y);
        for (int t = 0; t < nt; ++t) {
          v16f row;
          std::memcpy(&row, &y[t], 64);
          store16(reinterpret_cast<c10::BFloat16*>(
                      out + (static_cast<int64_t>(q0 + t0 + t) * b.H + h) * D + d0), row);
        }
      }
    }
  }
}

// Runs flagged in ``long_run`` on AMX tiles; false when this batch cannot use them (then the
// caller takes ATen's flash attention).
bool kernel_long_runs(const Batch& b, int64_t S, int BS, const std::vector<uint8_t>& long_run,
                   const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache,
                   const at::Tensor& v_cache) {
  if (!g_prefill_kernel || q.scalar_type() != at::kBFloat16 || b.D % 32 != 0 ||
      !amx_permitted())
    return false;
  std::vector<AmxRun> runs;
  int64_t total = 0;
  for (int32_t s = 0; s < S; ++s) {
    if (!long_run[s]) continue;
    const int keys = b.ctx_lens[s];
    const int padded = (keys + 31) / 32 * 32;
    runs.push_back({s, keys, padded, total});
    total += static_cast<int64_t>(b.Hkv) * 2 * padded * b.D;
  }
  const std::vector<LongItem> items = long_items(b, runs, kAmxQ);
  std::vector<uint16_t> packed(total);
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int64_t n_pack = static_cast<int64_t>(runs.size()) * b.Hkv;
  const int64_t n = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), std::max(n, n_pack))));
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {  // every tile used is 16 rows of 64 bytes
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_pack; ++i) {
      const AmxRun& r = runs[i / b.Hkv];
      const int g = static_cast<int>(i % b.Hkv);
      uint16_t* kp = packed.data() + r.offset + static_cast<int64_t>(g) * 2 * r.padded * b.D;
      amx_pack(b, r, g, BS, kc, vc, kp, kp + static_cast<int64_t>(r.padded) * b.D);
    }
    _tile_loadconfig(&cfg);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) amx_item(items[i], runs, b, qd, od, packed.data());
    _tile_release();
  }
  return true;
}

// ------------------------------------------------ small-batch linears on AMX tiles (bf16)
//
// y = x W^T (+ b) for up to kTileMaxRows rows: the decode steps of a batch, where the product
// is bound by reading W. oneDNN's kernels read a bf16 weight at ~22 GB/s at 1-16 rows but at
// ~16 GB/s at 48 (the padded size of 40 decodes), where each weight tile is multiplied by
// three activation tiles: the weight loads then stall on memory in turn with the products.
// Here W is copied once into the 1 KB tiles TDPBF16PS reads, two 16-column strips side by
// side per k-step ([N/32][K/32][2][16 k-pairs][16 columns x 2]), so that one thread reads its
// share of W as one sequential stream, prefetched into L2 kTilePrefetch k-steps ahead. Each
// pair of strips meets two row tiles of x at a time (2 x 2 accumulators, every x tile used
// twice per load); rows beyond the first 32 take a second pass over the pair's tiles, which
// are still in L2. x's tiles are read in place (row stride K), so K must be a multiple of 32.
constexpr int64_t kTileMaxRows = 64;
constexpr int kTilePrefetch = 16;  // k-steps (2 KB each) ahead

at::Tensor tile_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "tile_pack: a [N, K] bf16 weight expected");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 32 == 0, "tile_pack: K must be a multiple of 32, got ", K);
  const at::Tensor wc = w.contiguous();
  const int64_t pairs = (N + 31) / 32, kt = K / 32;
  at::Tensor out = at::zeros({pairs, kt, 2, 16, 32}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k = 0; k < kt; ++k)
        for (int s = 0; s < 2; ++s)
          for (int c = 0; c < 16; ++c) {
            const int64_t n = p * 32 + s * 16 + c;
            if (n >= N) continue;
            uint16_t* t = dst + ((p * kt + k) * 2 + s) * 512;
            for (int r = 0; r < 16; ++r) {
              t[r * 32 + 2 * c] = src[n * K + k * 32 + 2 * r];
              t[r * 32 + 2 * c + 1] = src[n * K + k * 32 + 2 * r + 1];
            }
          }
  });
  return out;
}

// One 16 x 16 float32 accumulator tile (in ``c``) into rows r0.. and columns n0.. of y,
// plus the bias, rounded to bf16; rows >= M and columns >= N are dropped.
inline void tile_out(const float* c, uint16_t* y, int64_t ldy, int64_t r0, int64_t M,
                     int64_t n0, int64_t N, const float* bias) {
  const int64_t nc = std::min<int64_t>(16, N - n0);
  if (nc <= 0) return;
  for (int64_t r = 0; r < 16 && r0 + r < M; ++r) {
    v16f v = load16(c + r * 16);
    if (bias) v += load16(bias + n0);
    alignas(64) c10::BFloat16 tmp[16];
    store16(tmp, v);
    std::memcpy(y + (r0 + r) * ldy + n0, tmp, nc * sizeof(uint16_t));
  }
}

// y = x W^T (+ b), y [m, N] for x [m, K]. x's rows are taken 16 at a time, the last tile only
// as many as remain (a tile register reads as many rows as it is configured for), so the
// batch is neither padded nor are padding rows multiplied.
void tile_linear_into(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                      const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t m = x.size(0), K = x.size(1), kt = K / 32, pairs = packed.size(0);
  if (m == 0) return;
  at::Tensor bf;  // float32, zero up to the packed width (tile_out reads 16 at a time)
  if (bias && bias->defined()) {
    bf = at::zeros({pairs * 32}, x.options().dtype(at::kFloat));
    bf.narrow(0, 0, N).copy_(*bias);
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const auto* xd = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wd = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yd = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t ldy = y.stride(0), ldx = K * 2;  // bytes between x's rows
  // Row tiles and passes over each pair of strips. With whole tiles, each pass takes two
  // (registers 0, 1, 4 and 2, 3, 5); with a partial last tile, the first pass takes tile 0
  // and that tile (registers 2, 3, 5 configured for its rows), every further pass one more.
  const int64_t tiles = (m + 15) / 16, last = m - 16 * (tiles - 1);
  const bool whole = last == 16;
  const int64_t passes = whole ? (tiles + 1) / 2 : std::max<int64_t>(1, tiles - 1);
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  for (int t : {0, 1, 4}) cfg.rows[t] = tiles == 1 ? last : 16;
  for (int t : {2, 3, 5}) cfg.rows[t] = last;
  const int threads = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), pairs)));
  const uint16_t* w_end = wd + pairs * kt * 1024;
  // Every pass over a pair prefetches its share of the stream, so that the reads from memory
  // go on during the passes that find the pair in L2.
  const int64_t pf_step = (32 + passes - 1) / passes * 64;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    const int64_t p0 = pairs * tid / threads, p1 = pairs * (tid + 1) / threads;
    alignas(64) float c[4][256];
    _tile_loadconfig(&cfg);
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* w = wd + p * kt * 1024;  // this pair's k-steps, 2 tiles each
      const char* pf = reinterpret_cast<const char*>(w + kTilePrefetch * 1024);
      for (int64_t pass = 0; pass < passes; ++pass) {
        // Row tile t0 in registers 0, 1, 4; with ``two``, tile t1 in 2, 3, 5.
        const int64_t t0 = whole ? 2 * pass : pass, t1 = whole ? t0 + 1 : tiles - 1;
        const bool two = whole ? t1 < tiles : pass == 0 && tiles > 1;
        const char* a0 = reinterpret_cast<const char*>(xd + 16 * t0 * K);
        const char* a1 = reinterpret_cast<const char*>(xd + 16 * t1 * K);
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t k = 0; k < kt; ++k) {
          const uint16_t* b = w + k * 1024;
          if (pf + pf_step <= reinterpret_cast<const char*>(w_end))
            for (int o = 0; o < pf_step; o += 64) _mm_prefetch(pf + o, _MM_HINT_T1);
          pf += pf_step;
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + 512, 64);
          _tile_loadd(4, a0 + k * 64, ldx);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, a1 + k * 64, ldx);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        for (int i = 0; i < 2; ++i)
          tile_out(c[i], yd, ldy, 16 * t0, m, p * 32 + 16 * i, N, bp);
        if (two) {
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
          for (int i = 0; i < 2; ++i)
            tile_out(c[2 + i], yd, ldy, 16 * t1, m, p * 32 + 16 * i, N, bp);
        }
      }
    }
    _tile_release();
  }
}

bool tile_linear_supported() { return amx_permitted(); }
const char* kTileKind = "amx";

bool tile_packed_matches(const at::Tensor& packed, int64_t K, int64_t N) {
  return packed.dim() == 5 && packed.size(1) * 32 == K && packed.size(0) * 32 >= N;
}
#else
#if !(defined(__AVX2__) && defined(__FMA__))
bool kernel_long_runs(const Batch&, int64_t, int, const std::vector<uint8_t>&, const at::Tensor&,
                   at::Tensor&, const at::Tensor&, const at::Tensor&) {
  return false;
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
// ------------------------------------------- linears on bf16 weights with AVX2 (no AMX)
//
// Where the CPU has neither AMX nor bf16 instructions (AVX2: AMD Zen 3, older Xeons), oneDNN
// has no bf16 kernels and would need the weights widened to float32 (model/linear.py), twice
// the bytes a decode step reads. Here W stays bf16, copied once into panels of 16 output
// columns, [ceil(N/16)][K][16], each one sequential stream. A bf16 value is the top half of
// a float32, so widening 16 of them is two unpacks against zero; the columns are stored in
// the order those unpacks produce within each 128-bit lane, so that the two float32 halves
// are columns 0-7 and 8-15. x is widened once per call; rows are taken up to kPanelRows at a
// time against a panel (2 x kPanelRows float32 accumulators in registers), and a panel is
// re-read from L1/L2 for each further group of rows of a kRowBlock-row block.
//
// With AVX-512 (and no AMX: a Xeon whose matrix unit is absent or hidden, Skylake to Emerald
// Rapids) the same scheme runs on 512-bit registers: panels of 32 columns, the unpacks
// widening 16 columns per register, 12 rows a group (24 accumulators). There oneDNN's bf16
// kernels (VDPBF16PS) reach only about half the float32 FMA rate: on a 2-core Emerald Rapids
// class VM, a [2048, 1024] x [1024, 5632] product ran at 172 GFLOP/s in bf16 and 314 in
// float32 through oneDNN, and at 173 on the AVX2 panels, whose 256-bit FMAs are half the
// machine's width; on these panels, at 245-282 (docs/performance.md). Only that CPU has been
// measured: `--linear-backend packed` keeps oneDNN where its bf16 kernels might be faster.
constexpr int64_t kTileMaxRows = std::numeric_limits<int32_t>::max();
constexpr int64_t kRowBlock = 48;
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FLUIDSERVE_PANELS_512 1
constexpr int kPanelCols = 32;
constexpr int kPanelRows = 12;
const char* kTileKind = "avx512";
#else
constexpr int kPanelCols = 16;
constexpr int kPanelRows = 6;
const char* kTileKind = "avx2";
#endif
// Bytes ahead of the k-step in use that a panel's stream is prefetched into L1 (into the
// next panel at a panel's end), by the first group of rows of a row block, the one that reads
// the panel from memory: the hardware prefetchers do not cross 4 KB pages. Measured on a
// 2-core EPYC (Zen 3), without and with, alternated in one process: the 64 decoder linears of
// the race model at 1 row (medians of 24 rounds) 20.2 -> 16.9 ms, 17.9 -> 21.4 GB/s of
// weights (a plain read of as many bytes: 26-28 GB/s); a whole decode step of the race model
// (alternated step by step, two runs) 21.4/21.7 -> 19.9/20.7 ms at batch 1 and 178.6/177.9 ->
// 175.8/175.5 ms at batch 40. Prefetching in every group instead cost 1% at batch 40 (the
// later groups read the panel from L2). 2, 3 and 6 KB ahead were within a few percent of 4.
constexpr int kPanelPrefetch = 4096;
// A second stream, into L2, kPanelPrefetchL2 bytes further on, at the same pace: one stream
// into L1 keeps too few lines in flight to read the weights at the machine's rate. Measured on
// a 2-core Emerald Rapids class Xeon, the previous source built beside it, rounds alternated
// (the 64 decoder linears of the race model, each weight read from memory, outputs identical):
// 1 row 15.8/14.6 -> 12.6/12.9 ms, 4 rows 16.8 -> 14.3, 16 rows 28.5 -> 25.6, 40 rows 58.9 ->
// 55.6, 256 and 2048 rows unchanged; the AVX2 build there 14.6 -> 12.8 ms at 1 row. 16 and
// 32 KB on were within a few percent of 8; the L2 stream alone (no L1 stream) 5% slower.
constexpr int kPanelPrefetchL2 = 8192;

// Stored position of column c of a panel: the unpacks work within 128-bit lanes, each
// widening four of a lane's eight bf16 values (the low four into the first register, the
// high four into the second), so lane j of the first register holds columns 4j..4j+3 and of
// the second columns kPanelCols/2 + 4j.. (AVX2: 0-3 4-7 | 8-11 12-15 stored as 0-3 8-11 |
// 4-7 12-15).
inline int panel_pos(int c) {
  constexpr int half = kPanelCols / 2;
  return 8 * ((c % half) / 4) + (c >= half ? 4 : 0) + c % 4;
}

at::Tensor tile_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "tile_pack: a [N, K] bf16 weight expected");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanelCols - 1) / kPanelCols;
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::zeros({panels, K, kPanelCols}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int c = 0; c < kPanelCols && p * kPanelCols + c < N; ++c) {
        const uint16_t* row = src + (p * kPanelCols + c) * K;
        uint16_t* col = dst + p * K * kPanelCols + panel_pos(c);
        for (int64_t k = 0; k < K; ++k) col[k * kPanelCols] = row[k];
      }
  });
  return out;
}

#ifdef FLUIDSERVE_PANELS_512
// Row I of an R-row group: A += x * lo, B += x * hi (x = *src broadcast), or its two
// accumulators to (store) or from ``part``. Named accumulators, as in fma_row.
template <int I, int R>
inline void fma_row512(const float* src, __m512 lo, __m512 hi, __m512& A, __m512& B) {
  if constexpr (R > I) {
    const __m512 x = _mm512_set1_ps(*src);
    A = _mm512_fmadd_ps(x, lo, A);
    B = _mm512_fmadd_ps(x, hi, B);
  }
}
template <int I, int R, bool store>
inline void part_row512(float (*part)[kPanelCols], __m512& a, __m512& b) {
  if constexpr (R > I) {
    if constexpr (store) {
      _mm512_storeu_ps(part[I], a);
      _mm512_storeu_ps(part[I] + 16, b);
    } else {
      a = _mm512_loadu_ps(part[I]);
      b = _mm512_loadu_ps(part[I] + 16);
    }
  }
}
#define FS_PANEL_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

// As the AVX2 panel_rows below, on 32-column panels: 24 FMAs per two unpacks at 12 rows.
// With PF one line of the stream ``pf`` on is prefetched every k-step (64 bytes a step) into
// L1, and one kPanelPrefetchL2 bytes further on into L2.
template <int R, bool PF>
inline void panel_rows(const float* x, int64_t ldx, const uint16_t* w, int64_t kn, bool first,
                       float (*part)[kPanelCols], const char* pf) {
#define FS_DECL(i) __m512 c##i##a = _mm512_setzero_ps(), c##i##b = c##i##a;
  FS_PANEL_ROWS(FS_DECL)
#undef FS_DECL
  if (!first) {
#define FS_LOAD(i) part_row512<i, R, false>(part, c##i##a, c##i##b);
    FS_PANEL_ROWS(FS_LOAD)
#undef FS_LOAD
  }
  const __m512i zero = _mm512_setzero_si512();
  const auto step = [&](int64_t k) __attribute__((always_inline)) {
    const __m512i v = _mm512_loadu_si512(w + k * kPanelCols);
    const __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v));
    const __m512 hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v));
#define FS_FMA(i) fma_row512<i, R>(x + i * ldx + k, lo, hi, c##i##a, c##i##b);
    FS_PANEL_ROWS(FS_FMA)
#undef FS_FMA
  };
  int64_t k = 0;
  if constexpr (PF)
    for (; k < kn; ++k) {
      _mm_prefetch(pf + 2 * kPanelCols * k, _MM_HINT_T0);
      _mm_prefetch(pf + kPanelPrefetchL2 + 2 * kPanelCols * k, _MM_HINT_T1);
      step(k);
    }
  for (; k < kn; ++k) step(k);
#define FS_STORE(i) part_row512<i, R, true>(part, c##i##a, c##i##b);
  FS_PANEL_ROWS(FS_STORE)
#undef FS_STORE
}
#undef FS_PANEL_ROWS

#else
// Row I's two accumulators to (store) or from its partial sums (when the group has row I).
template <int I, int R, bool store>
inline void part_row(float (*part)[16], __m256& a, __m256& b) {
  if constexpr (R > I) {
    if constexpr (store) {
      _mm256_storeu_ps(part[I], a);
      _mm256_storeu_ps(part[I] + 8, b);
    } else {
      a = _mm256_loadu_ps(part[I]);
      b = _mm256_loadu_ps(part[I] + 8);
    }
  }
}
// The R rows' accumulators (named, so that they stay in registers) to or from ``part``.
template <int R, bool store>
inline void part_rows(float (*part)[16], __m256& c0a, __m256& c0b, __m256& c1a, __m256& c1b,
                      __m256& c2a, __m256& c2b, __m256& c3a, __m256& c3b, __m256& c4a,
                      __m256& c4b, __m256& c5a, __m256& c5b) {
  part_row<0, R, store>(part, c0a, c0b);
  part_row<1, R, store>(part, c1a, c1b);
  part_row<2, R, store>(part, c2a, c2b);
  part_row<3, R, store>(part, c3a, c3b);
  part_row<4, R, store>(part, c4a, c4b);
  part_row<5, R, store>(part, c5a, c5b);
}

// part[r] = x[r, :kn] . W_panel[:kn] for R rows (x float32, row stride ldx), or with ``first``
// false part[r] + that, k in order whatever R, so that a row's result does not depend on the
// rows beside it (the linears' sums; the prefill kernel's products over a chunk of keys).
// One FMA chain per row and half (2R chains) keeps the FMA units busy from R = 4 up (latency
// 4 x 2 units); below that the weight stream from memory, not the chains, is the bound.
// With PF, one line of the stream ``pf`` on is prefetched every two k-steps (the panel's own
// pace: 64 bytes of weights per two steps) into L1, and one kPanelPrefetchL2 bytes further on
// into L2. The choice is a template argument, not a test in the loop: a per-step test of
// whether to prefetch made the whole [2048, 1024] x [1024, 5632] product ~15% slower on a
// 2-core EPYC (Zen 3) in a standalone copy (208/212 against 178/189 ms, medians of 9), though
// only one group in eight prefetches.
template <int R, bool PF>
inline void panel_rows(const float* x, int64_t ldx, const uint16_t* w, int64_t kn, bool first,
                       float (*part)[16], const char* pf) {
  __m256 c0a = _mm256_setzero_ps(), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a,
         c3a = c0a, c3b = c0a, c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a;
  if (!first)
    part_rows<R, false>(part, c0a, c0b, c1a, c1b, c2a, c2b, c3a, c3b, c4a, c4b, c5a, c5b);
  const __m256i zero = _mm256_setzero_si256();
  const auto step = [&](int64_t k) __attribute__((always_inline)) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 16));
    const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
    fma_row<0, R>(x + k, lo, hi, c0a, c0b);
    fma_row<1, R>(x + ldx + k, lo, hi, c1a, c1b);
    fma_row<2, R>(x + 2 * ldx + k, lo, hi, c2a, c2b);
    fma_row<3, R>(x + 3 * ldx + k, lo, hi, c3a, c3b);
    fma_row<4, R>(x + 4 * ldx + k, lo, hi, c4a, c4b);
    fma_row<5, R>(x + 5 * ldx + k, lo, hi, c5a, c5b);
  };
  int64_t k = 0;
  if constexpr (PF)
    for (; k + 2 <= kn; k += 2) {
      _mm_prefetch(pf + 32 * k, _MM_HINT_T0);
      _mm_prefetch(pf + kPanelPrefetchL2 + 32 * k, _MM_HINT_T1);
      step(k);
      step(k + 1);
    }
  for (; k < kn; ++k) step(k);
  part_rows<R, true>(part, c0a, c0b, c1a, c1b, c2a, c2b, c3a, c3b, c4a, c4b, c5a, c5b);
}

#endif

// panel_rows for a group of ``rows`` rows (1 to kPanelRows), the row count a template argument.
template <bool PF, int R = 1>
inline void panel_group(int rows, const float* x, int64_t ldx, const uint16_t* w, int64_t kn,
                        bool first, float (*part)[kPanelCols], const char* pf = nullptr) {
  if constexpr (R < kPanelRows) {
    if (rows > R) return panel_group<PF, R + 1>(rows, x, ldx, w, kn, first, part, pf);
  }
  return panel_rows<R, PF>(x, ldx, w, kn, first, part, pf);
}

// Rows r of y, columns n0..n0+kPanelCols (fewer at the end of N), from their finished sums.
template <typename T>
void panel_out(const float (*part)[kPanelCols], int rows, T* y, int64_t ldy, int64_t n0,
               int64_t N, const float* bias) {
  const int64_t nc = std::min<int64_t>(kPanelCols, N - n0);
  for (int r = 0; r < rows; ++r) {
    if (nc == kPanelCols) {  // a whole panel: straight into y (the copy through tmp, a libc
      // memcpy whose wide reload of narrower stores missed store forwarding, was 2.6% of a
      // batch-40 decode step of the race model on an Emerald Rapids class Xeon)
      for (int c = 0; c < kPanelCols; c += 16) {
        v16f v = load16(part[r] + c);
        if (bias) v += load16(bias + n0 + c);
        store16(y + r * ldy + n0 + c, v);
      }
      continue;
    }
    alignas(64) T tmp[kPanelCols];
    for (int c = 0; c < kPanelCols; c += 16) {
      v16f v = load16(part[r] + c);
      if (bias) v += load16(bias + n0 + c);
      store16(tmp + c, v);
    }
    std::memcpy(y + r * ldy + n0, tmp, nc * sizeof(T));
  }
}

void tile_linear_into(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                      const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t m = x_in.size(0), K = x_in.size(1), panels = packed.size(0);
  if (m == 0) return;
  const at::Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous()
                                                         : x_in.to(at::kFloat).contiguous();
  at::Tensor bf;  // float32, zero up to the packed width (read 16 at a time)
  if (bias && bias->defined()) {
    bf = at::zeros({panels * kPanelCols}, x.options());
    bf.narrow(0, 0, N).copy_(*bias);
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const float* xd = x.data_ptr<float>();
  const auto* wd = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t ldy = y.stride(0);
  AT_DISPATCH_SWITCH(y.scalar_type(), "tile_linear",
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      auto* yd = y.data_ptr<scalar_t>();
      at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
        alignas(64) float part[kPanelRows][kPanelCols];
        for (int64_t b0 = 0; b0 < m; b0 += kRowBlock)
          for (int64_t p = p0; p < p1; ++p) {
            const uint16_t* wp = wd + p * K * kPanelCols;
            for (int64_t r0 = b0; r0 < std::min(m, b0 + kRowBlock); r0 += kPanelRows) {
              const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, m - r0));
              // The first group of a row block reads the panel from memory: it prefetches.
              if (r0 == b0)
                panel_group<true>(rows, xd + r0 * K, K, wp, K, true, part,
                                  reinterpret_cast<const char*>(wp) + kPanelPrefetch);
              else
                panel_group<false>(rows, xd + r0 * K, K, wp, K, true, part);
              panel_out(part, rows, yd + r0 * ldy, ldy, p * kPanelCols, N, bp);
            }
          }
      });
    }));
}

// ---------------------------------- prefill attention on the panels (AVX2 or AVX-512, no AMX)
//
// A long run (a prefill chunk) attends to its paged context flash-attention style, both
// products on the panel kernel above, transposed as on the AMX tiles: S^T = K Q^T and
// O^T += V^T P^T, so that one row of S^T (of O^T) is one key (one channel) for kLongQ =
// kPanelCols queries in two registers (Lanes below: 8 lanes with AVX2, 16 with AVX-512), and
// the online softmax runs down those registers with no horizontal reductions. Q^T and P^T are
// the kPanelCols-column bf16 panels; K (key-major) and V^T (channel-major) are the float32
// rows the kernel broadcasts, copied once per (run, kv head). P is rounded to bf16, as on the
// tiles (and as flash attention on GPUs does). A work item is up to kLongPairs (query tile,
// query head) pairs of one kv head: each chunk of keys meets all of them while it is in L1/L2.
// On a 2-core EPYC (Zen 3), against ATen's flash attention in the same process
// (scripts/bench_attention.py), the 16 layers' attention of one 2048-token prompt took 1217
// instead of 1857 ms (113 against 74 GFLOP/s) and of four 512-token prompts 396 instead of
// 917 ms. The micro-kernel itself runs at ~70% of the FMA peak; the softmax (exp2 on a
// degree-4 polynomial, as on the tiles) is most of the rest.
constexpr int kLongQ = kPanelCols;  // query tokens per tile: one panel's columns
constexpr int kLongPairs = 16;      // (query tile, query head) pairs per work item
constexpr int kLongChunk = 96;      // keys per online-softmax step: a multiple of kPanelRows

// The vector half of a panel row, and what the softmax does with it.
#ifdef FLUIDSERVE_PANELS_512
struct Lanes {
  using F = __m512;
  using I = __m512i;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static I load_i(const int32_t* p) { return _mm512_loadu_si512(p); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // s where the query at that lane's position sees key ``key``, else -inf.
  static F causal(F s, int key, I pos) {
    return _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(_mm512_set1_epi32(key), pos), s,
                                _mm512_set1_ps(kNegInf));
  }
  static F exp2_neg(F t) { return ::exp2_neg<true>(t); }
  static I bits(F v) { return _mm512_castps_si512(v); }
  static I srli(I v, int n) { return _mm512_srli_epi32(v, n); }
  static I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  static I and_i(I a, I b) { return _mm512_and_si512(a, b); }
  static I set1_i(int x) { return _mm512_set1_epi32(x); }
  static void store_packed(uint16_t* p, I lo, I hi) {
    _mm512_storeu_si512(p, _mm512_packus_epi32(lo, hi));
  }
};
#else
struct Lanes {
  using F = __m256;
  using I = __m256i;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static I load_i(const int32_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F zero() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F causal(F s, int key, I pos) {
    return _mm256_blendv_ps(
        s, _mm256_set1_ps(kNegInf),
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(key), pos)));
  }
  // 2^t for t <= 0 (or -inf): 2^round(t) times kExp2Poly(t - round(t)); t <= -127 gives
  // exactly 0 (the exponent field of 2^-127 is zero).
  static F exp2_neg(F t) {
    t = _mm256_max_ps(t, _mm256_set1_ps(-127.0f));
    const F n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F f = _mm256_sub_ps(t, n);
    F y = _mm256_set1_ps(kExp2Poly[0]);
    for (int i = 1; i < 5; ++i) y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kExp2Poly[i]));
    const I e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
  static I bits(F v) { return _mm256_castps_si256(v); }
  static I srli(I v, int n) { return _mm256_srli_epi32(v, n); }
  static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static I and_i(I a, I b) { return _mm256_and_si256(a, b); }
  static I set1_i(int x) { return _mm256_set1_epi32(x); }
  static void store_packed(uint16_t* p, I lo, I hi) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_packus_epi32(lo, hi));
  }
};
#endif
constexpr int kHalf = kLongQ / 2;  // lanes of one register
static_assert(sizeof(Lanes::F) == kHalf * sizeof(float), "a panel row is two registers");

struct LongRun {
  int32_t run, keys;  // the keys it sees
  int32_t ldv;        // row stride of its channel-major values: 16 floats past a multiple
                      // of 16, so that the rows the kernel reads together are not a
                      // multiple of 4 KB apart (one L1 set)
  int64_t offset;     // of its kv heads' packed keys, then values, in the buffer (floats)
};
// Keys 0 .. keys - 1 of kv head g in float32, key-major into kp [keys, D] and channel-major
// into vt [D, keys].
void long_pack(const Batch& b, const LongRun& r, int g, int BS, const c10::BFloat16* kc,
               const c10::BFloat16* vc, float* kp, float* vt) {
  const int D = b.D;
  const int64_t kv_stride = static_cast<int64_t>(b.Hkv) * BS * D;
  const int32_t* table = b.tables + r.run * b.table_stride;
  for (int key0 = 0; key0 < r.keys; key0 += BS) {
    const int nk = std::min(BS, r.keys - key0);
    const int64_t base = table[key0 / BS] * kv_stride + static_cast<int64_t>(g) * BS * D;
    const c10::BFloat16* kt = kc + base;  // [D, BS]
    const c10::BFloat16* vb = vc + base;  // [BS, D]
    for (int j = 0; j < nk; ++j)
      for (int d = 0; d < D; ++d)
        kp[static_cast<int64_t>(key0 + j) * D + d] = static_cast<float>(kt[d * BS + j]);
    for (int d = 0; d < D; ++d)
      for (int j = 0; j < nk; ++j)
        vt[static_cast<int64_t>(d) * r.ldv + key0 + j] = static_cast<float>(vb[j * D + d]);
  }
}

// A panel row (finite, non-negative) rounded to bf16 (nearest-even), in the order the panel
// kernel's unpacks read: the pack interleaves its two registers within 128-bit lanes, which
// is panel_pos's order.
inline void store_panel_row(uint16_t* p, Lanes::F lo, Lanes::F hi) {
  const auto round = [](Lanes::F v) {
    const Lanes::I b = Lanes::bits(v);
    const Lanes::I lsb = Lanes::and_i(Lanes::srli(b, 16), Lanes::set1_i(1));
    return Lanes::srli(Lanes::add_i(Lanes::add_i(b, Lanes::set1_i(0x7fff)), lsb), 16);
  };
  Lanes::store_packed(p, round(lo), round(hi));
}

void long_item(const LongItem& w, const std::vector<LongRun>& runs, const Batch& b,
               const uint16_t* q, c10::BFloat16* out, const float* packed) {
  using L = Lanes;
  const LongRun& r = runs[w.run_index];
  const int D = b.D, G = b.H / b.Hkv;
  const int q0 = b.cu_q[r.run];
  const int q_len = b.cu_q[r.run + 1] - q0;
  const int first_pos = b.ctx_lens[r.run] - q_len;
  const float* kp = packed + r.offset + static_cast<int64_t>(w.kv_head) * (r.keys + r.ldv) * D;
  const float* vt = kp + static_cast<int64_t>(r.keys) * D;
  // One (query tile, query head) pair after another meets each chunk of keys while the
  // chunk is in L1/L2; each pair keeps its Q^T panel, running max and sum, and O^T.
  const int tiles = (w.toks + kLongQ - 1) / kLongQ, pairs = tiles * G;
  std::vector<uint16_t> qt(static_cast<size_t>(pairs) * D * kLongQ);  // Q^T: [channel][query]
  std::vector<float> ot(static_cast<size_t>(pairs) * D * kLongQ);     // O^T: [channel][query]
  std::vector<float> ml(static_cast<size_t>(pairs) * 2 * kLongQ);     // running max, sum
  alignas(64) float st[kLongChunk][kLongQ];      // S^T of one chunk: [key][query]
  alignas(64) uint16_t pt[kLongChunk * kLongQ];  // P^T: [key][query], a panel
  // Scores in log2 units, so that P is a power of two.
  const L::F scale = L::set1(b.scale * 1.4426950408889634f);
  const L::F neg_inf = L::set1(kNegInf);
  for (int pr = 0; pr < pairs; ++pr) {
    const int t0 = w.tok0 + kLongQ * (pr / G), nt = std::min(kLongQ, w.tok0 + w.toks - t0);
    const int h = w.kv_head * G + pr % G;
    for (int t = 0; t < kLongQ; ++t) {
      const int col = panel_pos(t);
      const uint16_t* qr =
          q + static_cast<int64_t>(q0 + t0 + t) * b.q_row + static_cast<int64_t>(h) * D;
      uint16_t* qp = qt.data() + static_cast<size_t>(pr) * D * kLongQ + col;
      for (int d = 0; d < D; ++d) qp[d * kLongQ] = t < nt ? qr[d] : 0;
    }
    float* mlp = ml.data() + pr * 2 * kLongQ;
    std::fill(mlp, mlp + kLongQ, kNegInf);
    std::fill(mlp + kLongQ, mlp + 2 * kLongQ, 0.0f);
  }
  const int last_pos = first_pos + w.tok0 + w.toks - 1;
  for (int key0 = 0; key0 <= last_pos; key0 += kLongChunk) {
    for (int pr = 0; pr < pairs; ++pr) {
      const int t0 = w.tok0 + kLongQ * (pr / G), nt = std::min(kLongQ, w.tok0 + w.toks - t0);
      const int min_pos = first_pos + t0, max_pos = first_pos + t0 + nt - 1;
      if (key0 > max_pos) continue;  // the chunk is after every query of the tile
      // Position of each query lane; padding lanes see every key (their output is dropped).
      alignas(64) int32_t pos[kLongQ];
      for (int t = 0; t < kLongQ; ++t) pos[t] = t < nt ? first_pos + t0 + t : 1 << 30;
      const L::I pos_lo = L::load_i(pos), pos_hi = L::load_i(pos + kHalf);
      const uint16_t* qp = qt.data() + static_cast<size_t>(pr) * D * kLongQ;
      float(*op)[kLongQ] = reinterpret_cast<float(*)[kLongQ]>(
          ot.data() + static_cast<size_t>(pr) * D * kLongQ);
      float* mlp = ml.data() + pr * 2 * kLongQ;
      const int nk = std::min(kLongChunk, max_pos + 1 - key0);
      for (int j = 0; j < nk; j += kPanelRows)  // S^T, kPanelRows keys at a time
        panel_group<false>(std::min(kPanelRows, nk - j), kp + static_cast<int64_t>(key0 + j) * D,
                           D, qp, D, true, st + j);
      const bool edge = key0 + nk - 1 > min_pos;  // some key is after some query
      L::F mx_lo = neg_inf, mx_hi = neg_inf;
      for (int j = 0; j < nk; ++j) {
        L::F s_lo = L::mul(L::load(st[j]), scale);
        L::F s_hi = L::mul(L::load(st[j] + kHalf), scale);
        if (edge) {
          s_lo = L::causal(s_lo, key0 + j, pos_lo);
          s_hi = L::causal(s_hi, key0 + j, pos_hi);
        }
        L::store(st[j], s_lo);
        L::store(st[j] + kHalf, s_hi);
        mx_lo = L::max(mx_lo, s_lo);
        mx_hi = L::max(mx_hi, s_hi);
      }
      // Every lane sees key 0 in the first chunk, so m is finite from then on and alpha
      // is 0 there (nothing to rescale yet).
      const L::F m_lo = L::load(mlp), m_hi = L::load(mlp + kHalf);
      const L::F new_lo = L::max(m_lo, mx_lo), new_hi = L::max(m_hi, mx_hi);
      const L::F alpha_lo = L::exp2_neg(L::sub(m_lo, new_lo));
      const L::F alpha_hi = L::exp2_neg(L::sub(m_hi, new_hi));
      L::F sum_lo = L::zero(), sum_hi = sum_lo;
      for (int j = 0; j < nk; ++j) {
        const L::F p_lo = L::exp2_neg(L::sub(L::load(st[j]), new_lo));
        const L::F p_hi = L::exp2_neg(L::sub(L::load(st[j] + kHalf), new_hi));
        sum_lo = L::add(sum_lo, p_lo);
        sum_hi = L::add(sum_hi, p_hi);
        store_panel_row(pt + kLongQ * j, p_lo, p_hi);
      }
      L::store(mlp, new_lo);
      L::store(mlp + kHalf, new_hi);
      float* l = mlp + kLongQ;
      L::store(l, L::fmadd(L::load(l), alpha_lo, sum_lo));
      L::store(l + kHalf, L::fmadd(L::load(l + kHalf), alpha_hi, sum_hi));
      for (int d = 0; d < D; ++d) {
        L::store(op[d], L::mul(L::load(op[d]), alpha_lo));
        L::store(op[d] + kHalf, L::mul(L::load(op[d] + kHalf), alpha_hi));
      }
      for (int d0 = 0; d0 < D; d0 += kPanelRows)  // O^T += V^T P^T, kPanelRows channels
        panel_group<false>(std::min(kPanelRows, D - d0),
                           vt + static_cast<int64_t>(d0) * r.ldv + key0, r.ldv, pt, nk, false,
                           op + d0);
    }
  }
  for (int pr = 0; pr < pairs; ++pr) {
    const int t0 = w.tok0 + kLongQ * (pr / G), nt = std::min(kLongQ, w.tok0 + w.toks - t0);
    const int h = w.kv_head * G + pr % G;
    const float* op = ot.data() + static_cast<size_t>(pr) * D * kLongQ;
    const float* l = ml.data() + pr * 2 * kLongQ + kLongQ;
    for (int t = 0; t < nt; ++t) {
      c10::BFloat16* o = out + (static_cast<int64_t>(q0 + t0 + t) * b.H + h) * D;
      const float inv = 1.0f / l[t];
      for (int d = 0; d < D; ++d) o[d] = static_cast<c10::BFloat16>(op[d * kLongQ + t] * inv);
    }
  }
}

// Runs flagged in ``long_run`` on the panels; false when this batch cannot use them (then
// the caller takes ATen's flash attention).
bool kernel_long_runs(const Batch& b, int64_t S, int BS, const std::vector<uint8_t>& long_run,
                   const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache,
                   const at::Tensor& v_cache) {
  if (!g_prefill_kernel || q.scalar_type() != at::kBFloat16) return false;
  std::vector<LongRun> runs;
  int64_t total = 0;
  for (int32_t s = 0; s < S; ++s) {
    if (!long_run[s]) continue;
    const int keys = b.ctx_lens[s], ldv = (keys + 15) / 16 * 16 + 16;
    runs.push_back({s, keys, ldv, total});
    total += static_cast<int64_t>(b.Hkv) * (keys + ldv) * b.D;
  }
  const int long_q = kLongQ * std::max(1, kLongPairs / (b.H / b.Hkv));  // query tokens per item
  const std::vector<LongItem> items = long_items(b, runs, long_q);
  std::vector<float> packed(total);
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());  // panel bits
  auto* od = out.data_ptr<at::BFloat16>();
  const auto* kc = k_cache.data_ptr<at::BFloat16>();
  const auto* vc = v_cache.data_ptr<at::BFloat16>();
  const int64_t n_pack = static_cast<int64_t>(runs.size()) * b.Hkv;
  const int64_t n = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), std::max(n, n_pack))));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_pack; ++i) {
      const LongRun& r = runs[i / b.Hkv];
      const int g = static_cast<int>(i % b.Hkv);
      float* kp = packed.data() + r.offset + static_cast<int64_t>(g) * (r.keys + r.ldv) * b.D;
      long_pack(b, r, g, BS, kc, vc, kp, kp + static_cast<int64_t>(r.keys) * b.D);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) long_item(items[i], runs, b, qd, od, packed.data());
  }
  return true;
}

bool tile_linear_supported() { return true; }

bool tile_packed_matches(const at::Tensor& packed, int64_t K, int64_t N) {
  return packed.dim() == 3 && packed.size(1) == K && packed.size(2) == kPanelCols &&
         packed.size(0) * kPanelCols >= N;
}
#else
constexpr int64_t kTileMaxRows = 0;
at::Tensor tile_pack(const at::Tensor&) {
  TORCH_CHECK(false, "tile_pack: this build has no AMX");
}
void tile_linear_into(const at::Tensor&, const at::Tensor&, int64_t,
                      const std::optional<at::Tensor>&, at::Tensor&) {
  TORCH_CHECK(false, "tile_linear: this build has no AMX");
}
bool tile_linear_supported() { return false; }
const char* kTileKind = "";
bool tile_packed_matches(const at::Tensor&, int64_t, int64_t) { return false; }
#endif
#endif

void check_common(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be 4-D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "cache dtypes differ");
}

}  // namespace

// Write this batch's new keys and values (k, v: [T, Hkv, D], each head's D elements dense,
// e.g. views into the fused QKV output) into their cache slots.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots) {
  check_common(k_cache, v_cache);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: int64");
  const int64_t T = k.size(0);
  const int Hkv = k_cache.size(1), D = k_cache.size(2), BS = k_cache.size(3);
  const at::Tensor kc = k.stride(2) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(2) == 1 ? v : v.contiguous();
  const int64_t k_row = kc.stride(0), k_head = kc.stride(1);
  const int64_t v_row = vc.stride(0), v_head = vc.stride(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    const scalar_t* ks = kc.data_ptr<scalar_t>();
    const scalar_t* vs = vc.data_ptr<scalar_t>();
    scalar_t* kd = k_cache.data_ptr<scalar_t>();
    scalar_t* vd = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t blk = slot[t] / BS, off = slot[t] % BS;
        for (int h = 0; h < Hkv; ++h) {
          const scalar_t* kr = ks + t * k_row + h * k_head;
          const scalar_t* vr = vs + t * v_row + h * v_head;
          scalar_t* kt = kd + ((blk * Hkv + h) * D) * BS + off;  // column off of [D, BS]
          for (int d = 0; d < D; ++d) kt[d * BS] = kr[d];
          std::memcpy(vd + ((blk * Hkv + h) * BS + off) * D, vr, D * sizeof(scalar_t));
        }
      }
    });
  });
}

// Long prefill runs go to ATen's flash attention (a blocked GEMM formulation that beats this
// kernel once a run has many queries): keys and values of the run's context are gathered from
// the cache into [Hkv, ctx, D], or taken straight from the batch for a run that starts at 0.
void long_run_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& tables, int64_t run,
                        int q0, int q_len, int ctx, double scale) {
  using at::indexing::Slice;
  const int64_t Hkv = k_cache.size(1), D = k_cache.size(2), BS = k_cache.size(3);
  const at::Tensor qh = q.narrow(0, q0, q_len).transpose(0, 1).unsqueeze(0);  // [1, H, L, D]
  at::Tensor kh, vh;
  std::optional<at::Tensor> mask;
  bool causal = false;
  if (ctx == q_len) {  // the run's own keys are its whole context
    kh = k.narrow(0, q0, q_len).transpose(0, 1).unsqueeze(0);
    vh = v.narrow(0, q0, q_len).transpose(0, 1).unsqueeze(0);
    causal = true;
  } else {
    const int64_t nb = (ctx + BS - 1) / BS;
    const at::Tensor blocks = tables[run].narrow(0, 0, nb).to(at::kLong);
    kh = k_cache.index_select(0, blocks).permute({1, 0, 3, 2}).reshape({Hkv, nb * BS, D})
             .narrow(1, 0, ctx).unsqueeze(0);
    vh = v_cache.index_select(0, blocks).permute({1, 0, 2, 3}).reshape({Hkv, nb * BS, D})
             .narrow(1, 0, ctx).unsqueeze(0);
    const at::Tensor kpos = at::arange(ctx, at::kInt);
    const at::Tensor qpos = at::arange(ctx - q_len, ctx, at::kInt).unsqueeze(1);
    mask = kpos.unsqueeze(0) <= qpos;  // [L, ctx]
  }
#ifdef FLUIDSERVE_PANELS_512
  // Without AMX, ATen's flash attention multiplies bf16 through oneDNN's VDPBF16PS kernels,
  // at about half the float32 FMA rate: 16 layers of a causal 512-token run (16 heads of 64)
  // took 152 ms in bf16 and 100 ms in float32 on a 2-core Emerald Rapids class VM.
  const bool widen = qh.scalar_type() == at::kBFloat16;
#else
  const bool widen = false;
#endif
  const auto wide = [&](const at::Tensor& t) { return widen ? t.to(at::kFloat) : t; };
  const at::Tensor o = at::scaled_dot_product_attention(wide(qh), wide(kh), wide(vh), mask, 0.0,
                                                        causal, scale, /*enable_gqa=*/true);
  out.narrow(0, q0, q_len).copy_(o.squeeze(0).transpose(0, 1));
}

// Attention for one layer over the whole hybrid batch: writes the batch's new keys and
// values (k, v: [T, Hkv, D]) into their cache slots, then fills out[T, H, D] with every
// query's causal attention over its request's paged context. Runs of at least
// ``min_long_run`` tokens take the prefill kernel (bf16 on AMX or AVX2) or else ATen's flash
// attention; all others this file's kernel.
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& slots, const at::Tensor& cu_q, const at::Tensor& ctx_lens,
                     const at::Tensor& block_tables, double scale, int64_t min_long_run) {
  write_kv(k, v, k_cache, v_cache, slots);
  TORCH_CHECK(q.size(2) % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  out.is_contiguous(),
              "q/out: [T, H, D], each token's H x D dense (q may be a view into the fused QKV)");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(cu_q.scalar_type() == at::kInt && ctx_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt,
              "metadata must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && cu_q.is_contiguous() && ctx_lens.is_contiguous(),
              "metadata must be contiguous");
  const int H = q.size(1), D = q.size(2);
  const int Hkv = k_cache.size(1), BS = k_cache.size(3);
  TORCH_CHECK(k_cache.size(2) == D && v_cache.size(2) == BS && v_cache.size(3) == D,
              "cache shapes do not match [NB, Hkv, D, BS] / [NB, Hkv, BS, D]");
  TORCH_CHECK(H % Hkv == 0 && D <= kMaxHeadDim, "unsupported head layout");
  const int64_t S = ctx_lens.size(0);
  if (S == 0) return;
  Batch b{cu_q.data_ptr<int32_t>(), ctx_lens.data_ptr<int32_t>(),
          block_tables.data_ptr<int32_t>(), block_tables.size(1), H, Hkv, D,
          static_cast<float>(scale), q.stride(0)};
  std::vector<uint8_t> long_run(S, 0);
  bool any_long = false;
  for (int64_t s = 0; s < S; ++s) {
    long_run[s] = b.cu_q[s + 1] - b.cu_q[s] >= min_long_run;
    any_long |= long_run[s];
  }
  if (any_long && !kernel_long_runs(b, S, BS, long_run, q, out, k_cache, v_cache)) {
    for (int64_t s = 0; s < S; ++s)
      if (long_run[s])
        long_run_attention(out, q, k, v, k_cache, v_cache, block_tables, s, b.cu_q[s],
                           b.cu_q[s + 1] - b.cu_q[s], b.ctx_lens[s], scale);
  }
  const auto items = make_items(b, S, BS, long_run, at::get_num_threads());
  AT_DISPATCH_SWITCH(q.scalar_type(), "paged_attention",
    AT_DISPATCH_CASE(at::kFloat, [&] { run<scalar_t>(BS, items, b, q, out, k_cache, v_cache); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { run<scalar_t>(BS, items, b, q, out, k_cache, v_cache); })
    AT_DISPATCH_CASE(at::kHalf, [&] { run<scalar_t>(BS, items, b, q, out, k_cache, v_cache); }));
}

// Index of each row's largest value (the lowest index among ties), for greedy sampling:
// one vectorized pass that keeps, per lane, the first index of its maximum.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits: contiguous [S, V]");
  const int64_t S = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({S}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_SWITCH(logits.scalar_type(), "argmax_rows",
    AT_DISPATCH_CASE(at::kFloat, [&] { argmax_impl<scalar_t>(logits, S, V, o); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { argmax_impl<scalar_t>(logits, S, V, o); })
    AT_DISPATCH_CASE(at::kHalf, [&] { argmax_impl<scalar_t>(logits, S, V, o); }));
  return out;
}

// ---------------------------------------------------------------------------------------
// Fused elementwise layers: one call each instead of a handful of PyTorch operators (whose
// dispatch, not arithmetic, dominates at small batches). They round where the eager code
// rounds (to the model dtype after each PyTorch operator), so results match it closely.
// Rows are processed sixteen lanes at a time: a scalar loop (c10 conversions, a serial sum,
// std::exp per element) made them 40% of a 512-token prefill.

// residual += x (in the model dtype); x = rmsnorm(residual) * weight. x, residual: [T, H].
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "contiguous tensors expected");
  const int64_t T = x.size(0), Hd = x.size(1);
  AT_DISPATCH_SWITCH(x.scalar_type(), "fused_add_rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] { add_norm_impl<scalar_t>(x, residual, weight, eps, T, Hd); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { add_norm_impl<scalar_t>(x, residual, weight, eps, T, Hd); })
    AT_DISPATCH_CASE(at::kHalf, [&] { add_norm_impl<scalar_t>(x, residual, weight, eps, T, Hd); }));
}

// out = rmsnorm(x) * weight, x unchanged.
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "contiguous tensors expected");
  const int64_t T = x.size(0), Hd = x.size(1);
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] { norm_impl<scalar_t>(out, x, weight, eps, T, Hd); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { norm_impl<scalar_t>(out, x, weight, eps, T, Hd); })
    AT_DISPATCH_CASE(at::kHalf, [&] { norm_impl<scalar_t>(out, x, weight, eps, T, Hd); }));
}

// Rotate-half RoPE in place on q [T, H, D] and k [T, Hkv, D] (row strides may exceed H*D,
// as for views into a fused QKV output); cos, sin: [max_len, D] float32.
void rope(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos,
          const at::Tensor& sin) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && cos.scalar_type() == at::kFloat,
              "positions int64, cos/sin float32");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  k.stride(1) == k.size(2), "q/k: heads contiguous within a token");
  AT_DISPATCH_SWITCH(q.scalar_type(), "rope",
    AT_DISPATCH_CASE(at::kFloat, [&] { rope_impl<scalar_t>(q, k, positions, cos, sin); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { rope_impl<scalar_t>(q, k, positions, cos, sin); })
    AT_DISPATCH_CASE(at::kHalf, [&] { rope_impl<scalar_t>(q, k, positions, cos, sin); }));
}

// out [T, I] = silu(x[:, :I]) * x[:, I:], rounding after each operator like the eager code.
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "contiguous tensors expected");
  AT_DISPATCH_SWITCH(x.scalar_type(), "silu_and_mul",
    AT_DISPATCH_CASE(at::kFloat, [&] { silu_mul_impl<scalar_t>(out, x); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { silu_mul_impl<scalar_t>(out, x); })
    AT_DISPATCH_CASE(at::kHalf, [&] { silu_mul_impl<scalar_t>(out, x); }));
}

// y = x W^T (+ b) on a weight packed by ``tile_pack``, for at most ``tile_max_rows()`` rows.
at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "tile_linear: a contiguous [M, K] bf16 input expected");
  TORCH_CHECK(x.size(0) <= kTileMaxRows, "tile_linear: at most ", kTileMaxRows, " rows");
  TORCH_CHECK(tile_packed_matches(packed, x.size(1), N),
              "tile_linear: the packed weight does not match the input");
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  tile_linear_into(x, packed, N, bias, y);
  return y;
}

int64_t tile_max_rows() { return tile_linear_supported() ? kTileMaxRows : 0; }
std::string tile_kind() { return tile_linear_supported() ? kTileKind : ""; }

// ---------------------------------------------------------------- a stack of decoder layers

// y = x W^T + b on a weight prepacked by ``mkldnn::_reorder_linear_weight``: PyTorch's own
// oneDNN op, reached through the dispatcher as from Python (model/linear.py), without the
// interpreter in between.
// Rows a batch of m tokens is padded to: model/linear.py's ``padded_rows``, the same rule
// (oneDNN caches one primitive per shape; a bounded set of shapes bounds that cache).
int64_t padded_rows(int64_t m) {
  if (m <= 16) return m;
  const int64_t step = m <= 256 ? 16 : m <= 1024 ? 64 : 256;
  return (m + step - 1) / step * step;
}

// A weight prepacked in float32 for a bf16/fp16 model (``linear.widened``: CPUs whose oneDNN
// has no kernels for the model's dtype) takes float32 rows, and its output is rounded back.
at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& w,
                         const std::optional<at::Tensor>& b) {
  const int64_t m = x_in.size(0), rows = padded_rows(m);
  const bool wide = w.scalar_type() == at::kFloat && x_in.scalar_type() != at::kFloat;
  at::Tensor x = wide && rows == m ? x_in.to(at::kFloat) : x_in;
  if (rows != m) {  // as PackedLinear.forward: zero rows appended, then cut off the output
    x = at::zeros({rows, x_in.size(1)}, x_in.options().dtype(w.scalar_type()));
    x.narrow(0, 0, m).copy_(x_in);
  }
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(b);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  op.callBoxed(&stack);
  at::Tensor y = stack[0].toTensor();
  if (rows != m) y = y.narrow(0, 0, m);
  return wide ? y.to(x_in.scalar_type()) : y;
}

// The model's decoder layers (or a pipeline stage's) for one batch, exactly as
// ``DecoderLayer.forward_native`` runs them one after the other from Python: the same
// kernels and oneDNN calls in the same order, so the result is identical; only the
// interpreter's share of a decode step (about 0.15 ms per layer) is gone. Per layer: the
// input and post-attention norm weights (``norms``: 2 per layer), the prepacked QKV, output,
// gate/up and down weights (``weights``: 4 per layer) and their optional biases; optionally
// (``tiles``, empty or 4 per layer, with ``out_features``) their ``tile_pack`` copies, which
// batches of up to kTileMaxRows tokens multiply on instead. Returns (layer output, residual
// stream); the model adds them before its final norm.
//
// A batch of up to kTileMaxRows tokens with tile copies runs unpadded. Any other batch whose
// token count the linears pad (``padded_rows``) is padded once, here, and the
// whole stack runs on the padded rows: the row-wise kernels and the linears carry the
// padding rows along (zero, or the biases' finite images of zero), attention and RoPE see
// only the batch's tokens, and the attention output's padding rows stay zero. Padding each
// linear's input instead cost a zero-filled copy per linear: 64 a step, ~1.1 ms of a 47 ms
// batch-40 decode step, and ~7 MB of copies per layer for a 600-token prefill.
std::vector<at::Tensor> decoder_layers(
    at::Tensor h, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& weights,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<at::Tensor>& k_caches,
    const std::vector<at::Tensor>& v_caches, const at::Tensor& slots, const at::Tensor& cu_q,
    const at::Tensor& ctx_lens, const at::Tensor& block_tables, int64_t H, int64_t Hkv,
    int64_t D, double eps, double scale, int64_t min_long_run,
    const std::vector<std::optional<at::Tensor>>& tiles, const std::vector<int64_t>& out_features) {
  const size_t L = k_caches.size();
  TORCH_CHECK(v_caches.size() == L && norms.size() == 2 * L && weights.size() == 4 * L &&
                  biases.size() == 4 * L,
              "decoder_layers: per-layer argument lists of the wrong length");
  TORCH_CHECK(tiles.empty() || (tiles.size() == 4 * L && out_features.size() == 4 * L),
              "decoder_layers: tile weights and out features must come 4 per layer");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decoder_layers: h must be [T, hidden]");
  // A batch small enough for the tile copies runs unpadded: they take any row count.
  const int64_t T = h.size(0);
  const bool tiled = !tiles.empty() && T <= kTileMaxRows && tile_linear_supported();
  const int64_t rows = tiled ? T : padded_rows(T);
  if (rows != T) {
    at::Tensor padded = at::zeros({rows, h.size(1)}, h.options());
    padded.narrow(0, 0, T).copy_(h);
    h = padded;
  }
  // Linear j of the stack: on its tile copy where it has one and the batch is small enough
  // (a linear without one pads its own input, as packed_linear does).
  auto linear = [&](const at::Tensor& x, size_t j) {
    if (tiled && tiles[j]) {
      at::Tensor y = at::empty({T, out_features[j]}, x.options());
      tile_linear_into(x, *tiles[j], out_features[j], biases[j], y);
      return y;
    }
    return packed_linear(x, weights[j], biases[j]);
  };
  // The attention output, one buffer for every layer: its padding rows are never written.
  at::Tensor o_rows = rows != T ? at::zeros({rows, H * D}, h.options())
                                : at::empty({rows, H * D}, h.options());
  at::Tensor o = o_rows.narrow(0, 0, T).view({T, H, D});
  at::Tensor residual;
  for (size_t i = 0; i < L; ++i) {
    if (!residual.defined()) {
      at::Tensor out = at::empty_like(h);
      rms_norm(out, h, norms[2 * i], eps);
      residual = h;
      h = out;
    } else {
      fused_add_rms_norm(h, residual, norms[2 * i], eps);
    }
    const at::Tensor qkv = linear(h, 4 * i).narrow(0, 0, T);
    at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
    at::Tensor k = qkv.narrow(1, H * D, Hkv * D).view({T, Hkv, D});
    const at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
    rope(q, k, positions, cos, sin);
    paged_attention(o, q, k, v, k_caches[i], v_caches[i], slots, cu_q, ctx_lens,
                    block_tables, scale, min_long_run);
    h = linear(o_rows, 4 * i + 1);
    fused_add_rms_norm(h, residual, norms[2 * i + 1], eps);
    const at::Tensor gu = linear(h, 4 * i + 2);
    at::Tensor act = at::empty({rows, gu.size(1) / 2}, gu.options());
    silu_and_mul(act, gu);
    h = linear(act, 4 * i + 3);
  }
  if (rows != T) return {h.narrow(0, 0, T), residual.narrow(0, 0, T)};
  return {h, residual};
}

// Whether long runs may take the prefill kernel (where it is built); returns the previous value.
bool use_prefill_kernel(bool enabled) {
  const bool previous = g_prefill_kernel;
  g_prefill_kernel = enabled;
  return previous;
}

// The prefill kernel that long bf16 runs take here: "amx", "avx2", "avx512" or "" (ATen's flash
// attention: none built, or switched off).
std::string prefill_kernel() {
  if (!g_prefill_kernel) return "";
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
  return amx_permitted() ? "amx" : "";
#elif defined(__AVX2__) && defined(__FMA__)
  return kTileKind;  // the panels: "avx2" or "avx512"
#else
  return "";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("use_prefill_kernel", &use_prefill_kernel,
        "Allow (or not) the prefill attention kernel; returns the old value");
  m.def("prefill_kernel", &prefill_kernel,
        "The prefill attention kernel of long bf16 runs here: amx, avx2, avx512 or '' (none, or off)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = rmsnorm(residual) * w",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "out = rmsnorm(x) * w", py::call_guard<py::gil_scoped_release>());
  m.def("rope", &rope, "rotate-half RoPE in place", py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "Per-row argmax (first index among ties)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention, "Paged attention over a flattened hybrid batch",
        py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "Scatter new keys/values into the paged cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("tile_pack", &tile_pack, "A bf16 weight copied into the layout tile_linear reads",
        py::call_guard<py::gil_scoped_release>());
  m.def("tile_linear", &tile_linear, "x W^T (+ b) on a tile_pack'ed weight",
        py::call_guard<py::gil_scoped_release>());
  m.def("tile_max_rows", &tile_max_rows, "Rows tile_linear takes here (0: none)");
  m.def("tile_kind", &tile_kind, "The tile_linear kernel built here: amx, avx2 or ''");
  m.def("decoder_layers", &decoder_layers, "A stack of decoder layers for a small batch",
        py::call_guard<py::gil_scoped_release>());
}
