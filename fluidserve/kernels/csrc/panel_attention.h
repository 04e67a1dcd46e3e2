#pragma once

#include "common.h"
#include "long_runs.h"
#include "panel_linear.h"

#ifdef FLUIDSERVE_PANELS

namespace {

// ---------------------------------- prefill attention on the panels (AVX2 or AVX-512, no AMX)
//
// A long run (a prefill chunk) attends to its paged context flash-attention style, both
// products on the panel kernel (panel_linear.h), transposed as on the AMX tiles: S^T = K Q^T and
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
//
// Where the panels' product is the bf16 dot product (g_prefill_dot: set with the linears',
// --panel-product), both products run on the dot panels instead: K and V^T stay bf16 (copied
// 16 x 16 at a time through the registers), Q^T and P^T are laid out in pairs of channels and
// of keys, and O^T is turned back into rows 16 x 16 at a time. On a 2-core Zen 4 EPYC, the
// 16 layers' attention of eight 256-token prompts took 86 instead of 173 ms, of one 2048-token
// prompt 424 instead of 825 ms (a prefill step of the race model: 8 x 256 tokens 1915 -> 1850
// ms, 2048 tokens 2590 -> 2213 ms).
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
  int64_t offset;     // of its kv heads' packed keys, then values, in the buffer (elements)
};
// The prefill kernel's product (panel_linear.h): bf16 dot products where the CPU has them and
// the linears take them (model/worker.py sets it with theirs), else float32 FMAs.
bool g_prefill_dot = false;
// What the products read K and V^T in: float32 rows for the FMA, bf16 (its bits) for the dot.
template <bool Dot>
using LongElem = std::conditional_t<Dot, uint16_t, float>;
template <bool Dot>
inline LongElem<Dot> long_elem(c10::BFloat16 v) {
  if constexpr (Dot)
    return v.x;
  else
    return static_cast<float>(v);
}

// Keys 0 .. keys - 1 of kv head g, key-major into kp [keys, D] and channel-major into vt
// [D, keys] (float32 for the FMA, bf16 for the dot product).
template <bool Dot>
void long_pack(const Batch& b, const LongRun& r, int g, int BS, const c10::BFloat16* kc,
               const c10::BFloat16* vc, LongElem<Dot>* kp, LongElem<Dot>* vt) {
  const int D = b.D;
  const int64_t kv_stride = static_cast<int64_t>(b.Hkv) * BS * D;
  const int32_t* table = b.tables + r.run * b.table_stride;
#ifdef FLUIDSERVE_DOT_PANELS
  if constexpr (Dot) {  // bf16 bits as they are, 16 x 16 blocks through the registers
    __m512 x[16];
    for (int key0 = 0; key0 < r.keys; key0 += 16) {  // (blocks are whole 16-key groups)
      const int nk = std::min(16, r.keys - key0);
      const int64_t base = table[key0 / BS] * kv_stride + static_cast<int64_t>(g) * BS * D;
      const uint16_t* kt = &kc[base + key0 % BS].x;       // [D, BS] from column key0 % BS
      const uint16_t* vb = &vc[base + (key0 % BS) * D].x;  // [BS, D] from row key0 % BS
      for (int d0 = 0; d0 < D; d0 += 16) {
        for (int i = 0; i < 16; ++i) x[i] = widen16(kt + (d0 + i) * BS);  // channel d0 + i
        transpose16(x);
        for (int j = 0; j < nk; ++j) narrow16(kp + static_cast<int64_t>(key0 + j) * D + d0, x[j]);
        for (int j = 0; j < 16; ++j) x[j] = widen16(vb + j * D + d0);  // key key0 + j
        transpose16(x);
        for (int i = 0; i < 16; ++i)  // the columns past the keys: stale slots, zeroed below
          narrow16(vt + static_cast<int64_t>(d0 + i) * r.ldv + key0, x[i]);
      }
    }
    for (int d = 0; d < D; ++d)
      std::fill(vt + static_cast<int64_t>(d) * r.ldv + r.keys,
                vt + static_cast<int64_t>(d + 1) * r.ldv, uint16_t{0});
    return;
  }
#endif
  for (int key0 = 0; key0 < r.keys; key0 += BS) {
    const int nk = std::min(BS, r.keys - key0);
    const int64_t base = table[key0 / BS] * kv_stride + static_cast<int64_t>(g) * BS * D;
    const c10::BFloat16* kt = kc + base;  // [D, BS]
    const c10::BFloat16* vb = vc + base;  // [BS, D]
    for (int j = 0; j < nk; ++j)
      for (int d = 0; d < D; ++d)
        kp[static_cast<int64_t>(key0 + j) * D + d] = long_elem<Dot>(kt[d * BS + j]);
    for (int d = 0; d < D; ++d)
      for (int j = 0; j < nk; ++j)
        vt[static_cast<int64_t>(d) * r.ldv + key0 + j] = long_elem<Dot>(vb[j * D + d]);
  }
}

// A panel row (finite, non-negative) rounded to bf16 (nearest-even), in the order the panel
// kernel's unpacks read: the pack interleaves its two registers within 128-bit lanes, which
// is panel_pos's order.
inline Lanes::I bf16_bits(Lanes::F v) {  // in the low half of each lane
  const Lanes::I b = Lanes::bits(v);
  const Lanes::I lsb = Lanes::and_i(Lanes::srli(b, 16), Lanes::set1_i(1));
  return Lanes::srli(Lanes::add_i(Lanes::add_i(b, Lanes::set1_i(0x7fff)), lsb), 16);
}
inline void store_panel_row(uint16_t* p, Lanes::F lo, Lanes::F hi) {
  Lanes::store_packed(p, bf16_bits(lo), bf16_bits(hi));
}
#ifdef FLUIDSERVE_DOT_PANELS
// Two rows of P^T (keys j and j + 1, bf16 bits in the low halves) as one k-pair step of a
// dot panel: each query's pair of probabilities in one 32-bit lane.
inline void store_dot_pair(uint16_t* p, __m512i lo0, __m512i hi0, __m512i lo1, __m512i hi1) {
  _mm512_storeu_si512(p, _mm512_or_si512(lo0, _mm512_slli_epi32(lo1, 16)));
  _mm512_storeu_si512(p + kPanelCols, _mm512_or_si512(hi0, _mm512_slli_epi32(hi1, 16)));
}
#endif

// With Dot, both products on the bf16 dot product: Q^T and P^T in dot panels (each query's
// pair of channels, of keys, in one lane), K and V^T as bf16 rows; a chunk of an odd number of
// keys is multiplied as one more, whose probability is 0 and value 0 (the padding of V^T).
template <bool Dot>
void long_item(const LongItem& w, const std::vector<LongRun>& runs, const Batch& b,
               const uint16_t* q, c10::BFloat16* out, const LongElem<Dot>* packed) {
  using L = Lanes;
  const LongRun& r = runs[w.run_index];
  const int D = b.D, G = b.H / b.Hkv;
  const int q0 = b.cu_q[r.run];
  const int q_len = b.cu_q[r.run + 1] - q0;
  const int first_pos = b.ctx_lens[r.run] - q_len;
  const LongElem<Dot>* kp =
      packed + r.offset + static_cast<int64_t>(w.kv_head) * (r.keys + r.ldv) * D;
  const LongElem<Dot>* vt = kp + static_cast<int64_t>(r.keys) * D;
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
    uint16_t* qp = qt.data() + static_cast<size_t>(pr) * D * kLongQ;
#ifdef FLUIDSERVE_DOT_PANELS
    if (Dot && D % 32 == 0) {  // pairs of channels as 32-bit words, 16 x 16 at a time
      for (int tb = 0; tb < kLongQ; tb += 16)
        for (int p0 = 0; p0 < D / 2; p0 += 16) {
          __m512 y[16];
          for (int t = 0; t < 16; ++t)
            y[t] = tb + t < nt ? _mm512_loadu_ps(reinterpret_cast<const float*>(
                                     q + static_cast<int64_t>(q0 + t0 + tb + t) * b.q_row +
                                     static_cast<int64_t>(h) * D + 2 * p0))
                               : _mm512_setzero_ps();
          transpose16(y);  // y[i]: pair p0 + i of the 16 queries
          for (int i = 0; i < 16; ++i)
            _mm512_storeu_ps(reinterpret_cast<float*>(qp + (p0 + i) * 2 * kLongQ + 2 * tb), y[i]);
        }
    } else
#endif
    for (int t = 0; t < kLongQ; ++t) {
      const uint16_t* qr =
          q + static_cast<int64_t>(q0 + t0 + t) * b.q_row + static_cast<int64_t>(h) * D;
      for (int d = 0; d < D; ++d) {
        // Channel d of query t: its panel position (FMA), or its pair's half (dot).
        const int at = Dot ? d / 2 * 2 * kLongQ + 2 * t + d % 2 : d * kLongQ + panel_pos(t);
        qp[at] = t < nt ? qr[d] : 0;
      }
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
      for (int j = 0; j < nk; j += kPanelRows) {  // S^T, kPanelRows keys at a time
        const int rows = std::min(kPanelRows, nk - j);
        if constexpr (Dot)
          dot_group<false>(rows, kp + static_cast<int64_t>(key0 + j) * D, D, qp, D, st + j);
        else
          panel_group<false>(rows, kp + static_cast<int64_t>(key0 + j) * D, D, qp, D, true,
                             st + j);
      }
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
      [[maybe_unused]] L::I even_lo = L::set1_i(0), even_hi = even_lo;  // Dot: key j - 1's
      for (int j = 0; j < nk; ++j) {
        const L::F p_lo = L::exp2_neg(L::sub(L::load(st[j]), new_lo));
        const L::F p_hi = L::exp2_neg(L::sub(L::load(st[j] + kHalf), new_hi));
        sum_lo = L::add(sum_lo, p_lo);
        sum_hi = L::add(sum_hi, p_hi);
        if constexpr (!Dot) {
          store_panel_row(pt + kLongQ * j, p_lo, p_hi);
        } else {
#ifdef FLUIDSERVE_DOT_PANELS
          uint16_t* at = pt + j / 2 * 2 * kLongQ;
          if (j % 2 == 1) {
            store_dot_pair(at, even_lo, even_hi, bf16_bits(p_lo), bf16_bits(p_hi));
          } else {
            even_lo = bf16_bits(p_lo);
            even_hi = bf16_bits(p_hi);
            if (j + 1 == nk) store_dot_pair(at, even_lo, even_hi, L::set1_i(0), L::set1_i(0));
          }
#endif
        }
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
      for (int d0 = 0; d0 < D; d0 += kPanelRows) {  // O^T += V^T P^T, kPanelRows channels
        const int rows = std::min(kPanelRows, D - d0);
        const LongElem<Dot>* vr = vt + static_cast<int64_t>(d0) * r.ldv + key0;
        if constexpr (Dot)
          dot_group<false>(rows, vr, r.ldv, pt, (nk + 1) / 2 * 2, op + d0, nullptr, false);
        else
          panel_group<false>(rows, vr, r.ldv, pt, nk, false, op + d0);
      }
    }
  }
  for (int pr = 0; pr < pairs; ++pr) {
    const int t0 = w.tok0 + kLongQ * (pr / G), nt = std::min(kLongQ, w.tok0 + w.toks - t0);
    const int h = w.kv_head * G + pr % G;
    const float* op = ot.data() + static_cast<size_t>(pr) * D * kLongQ;
    const float* l = ml.data() + pr * 2 * kLongQ + kLongQ;
#ifdef FLUIDSERVE_PANELS_512
    if (D % 16 == 0) {  // O^T's 16 x 16 blocks turned into 16-channel rows in the registers
      for (int tb = 0; tb < nt; tb += 16) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(l + tb));
        for (int d0 = 0; d0 < D; d0 += 16) {
          __m512 y[16];
          for (int i = 0; i < 16; ++i)
            y[i] = _mm512_mul_ps(_mm512_loadu_ps(op + (d0 + i) * kLongQ + tb), inv);
          transpose16(y);
          for (int t = 0; t < std::min(16, nt - tb); ++t) {
            v16f row;
            std::memcpy(&row, &y[t], sizeof(row));
            store16(out + (static_cast<int64_t>(q0 + t0 + tb + t) * b.H + h) * D + d0, row);
          }
        }
      }
      continue;
    }
#endif
    for (int t = 0; t < nt; ++t) {
      c10::BFloat16* o = out + (static_cast<int64_t>(q0 + t0 + t) * b.H + h) * D;
      const float inv = 1.0f / l[t];
      for (int d = 0; d < D; ++d) o[d] = static_cast<c10::BFloat16>(op[d * kLongQ + t] * inv);
    }
  }
}

template <bool Dot>
void long_runs(const Batch& b, const std::vector<LongRun>& runs,
               const std::vector<LongItem>& items, int64_t total, int BS, const at::Tensor& q,
               at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  // Not zeroed: long_pack writes every element the products read (Dot: V^T's padding too).
  const std::unique_ptr<LongElem<Dot>[]> packed(new LongElem<Dot>[total]);
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
      LongElem<Dot>* kp =
          packed.get() + r.offset + static_cast<int64_t>(g) * (r.keys + r.ldv) * b.D;
      long_pack<Dot>(b, r, g, BS, kc, vc, kp, kp + static_cast<int64_t>(r.keys) * b.D);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) long_item<Dot>(items[i], runs, b, qd, od, packed.get());
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
  if constexpr (kDotPanelsBuilt) {
    if (g_prefill_dot && b.D % 2 == 0) {
      long_runs<true>(b, runs, items, total, BS, q, out, k_cache, v_cache);
      return true;
    }
  }
  long_runs<false>(b, runs, items, total, BS, q, out, k_cache, v_cache);
  return true;
}

}  // namespace

#endif  // FLUIDSERVE_PANELS
