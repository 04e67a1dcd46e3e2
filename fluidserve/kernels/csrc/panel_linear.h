#pragma once

#include "common.h"
#include "elementwise.h"

#ifdef FLUIDSERVE_PANELS

namespace {

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
// machine's width; on these panels, at 245-282 (docs/performance.md). Where the CPU issues
// VDPBF16PS as fast as its FMA (AMD Zen 4), the panels multiply with it instead (below).
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

void check_panel_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "tile_pack: a [N, K] bf16 weight expected");
}

// A [N, K] bf16 weight copied into zeroed panels of kPanelCols output columns, [ceil(N /
// kPanelCols)][steps][width]: element (c, k) of a panel's columns at offset pos(c, k) in it.
template <typename Pos>
at::Tensor pack_panels(const at::Tensor& w, int64_t steps, int64_t width, Pos pos) {
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanelCols - 1) / kPanelCols;
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::zeros({panels, steps, width}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int c = 0; c < kPanelCols && p * kPanelCols + c < N; ++c) {
        const uint16_t* row = src + (p * kPanelCols + c) * K;
        uint16_t* panel = dst + p * steps * width;
        for (int64_t k = 0; k < K; ++k) panel[pos(c, k)] = row[k];
      }
  });
  return out;
}

at::Tensor fma_pack(const at::Tensor& w) {
  check_panel_weight(w);
  return pack_panels(w, w.size(1), kPanelCols,
                     [](int c, int64_t k) { return k * kPanelCols + panel_pos(c); });
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
// A group's named accumulators, c<i>a and c<i>b for its rows: zero, or unless ``first`` the
// partial sums in ``part`` (the FMA and the dot-product rows below both start so).
#define FS_DECL(i) __m512 c##i##a = _mm512_setzero_ps(), c##i##b = c##i##a;
#define FS_LOAD(i) part_row512<i, R, false>(part, c##i##a, c##i##b);
#define FS_ACCUMULATORS(first) \
  FS_PANEL_ROWS(FS_DECL)       \
  if (!(first)) {              \
    FS_PANEL_ROWS(FS_LOAD)     \
  }

// As the AVX2 panel_rows below, on 32-column panels: 24 FMAs per two unpacks at 12 rows.
// With PF one line of the stream ``pf`` on is prefetched every k-step (64 bytes a step) into
// L1, and one kPanelPrefetchL2 bytes further on into L2.
template <int R, bool PF>
inline void panel_rows(const float* x, int64_t ldx, const uint16_t* w, int64_t kn, bool first,
                       float (*part)[kPanelCols], const char* pf) {
  FS_ACCUMULATORS(first)
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

#ifdef FLUIDSERVE_DOT_PANELS
// ------------------------------------------------- linears on bf16 dot products (VDPBF16PS)
//
// Where the CPU's bf16 dot product issues as fast as its float32 FMA (a 2-core AMD Zen 4:
// 3.66 G against 3.64 G instructions a second on one core, `python scripts/probe_bf16_dot.py`),
// it does twice the multiply-adds per instruction and needs no unpacks: the weights' pairs of
// k multiply on x's pairs as they are. Panels of 32 columns as above, laid out
// [ceil(N/32)][K/2][32][2]: a k-pair step reads two registers (columns 0-15 and 16-31, each
// lane a column's two k), a row's pair of x broadcast to every lane (one 32-bit broadcast),
// one VDPBF16PS per register and row. A row's sum is taken in the same order whatever rows
// are beside it. K must be even (a packed odd K could not be told from the next even one;
// model widths are even). On that CPU, for the 64 decoder linears of the race model, FMA
// panels -> dot panels (oneDNN bf16): 13.2 -> 12.1 (17.1) ms at 1 row, 78.2 -> 34.5 (50.6) at
// 40, 3868 -> 1665 (1697) at 2048 rows, 0.44 TFLOP/s, ~95% of the probed rate. Where the dot
// product issues at a quarter of the FMA's rate, as on the Emerald Rapids class VM, the FMA
// panels above are twice as fast: the product is chosen per CPU (model/linear.py).
constexpr int kDotCols = 2 * kPanelCols;  // bf16 values of one k-pair step of a panel

at::Tensor dot_pack(const at::Tensor& w) {
  check_panel_weight(w);
  TORCH_CHECK(w.size(1) % 2 == 0, "tile_pack: dot panels need an even K, got ", w.size(1));
  return pack_panels(w, w.size(1) / 2, kDotCols,
                     [](int c, int64_t k) { return (k / 2) * kDotCols + 2 * c + k % 2; });
}

// x's pair of k (2j, 2j + 1) of one row, on every lane.
inline __m512bh dot_pair(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(v);
}

template <int I, int R>
inline void dot_row(const uint16_t* x, __m512bh lo, __m512bh hi, __m512& A, __m512& B) {
  if constexpr (R > I) {
    const __m512bh p = dot_pair(x);
    A = _mm512_dpbf16_ps(A, p, lo);
    B = _mm512_dpbf16_ps(B, p, hi);
  }
}

// part[r] = x[r, :K] . W_panel for R rows (x bf16, row stride ldx; K even), the pairs of k
// in order. With PF, two lines of the stream ``pf`` on (a pair step's 128 bytes) are
// prefetched every step into L1 and a pair step kPanelPrefetchL2 bytes further on into L2.
// Unless ``first``, the sums go on from those in ``part`` (prefill attention's O^T).
template <int R, bool PF>
inline void dot_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K,
                     float (*part)[kPanelCols], const char* pf, bool first) {
  FS_ACCUMULATORS(first)
  const auto step = [&](int64_t j) __attribute__((always_inline)) {
    const __m512bh lo = (__m512bh)_mm512_loadu_si512(w + j * kDotCols);
    const __m512bh hi = (__m512bh)_mm512_loadu_si512(w + j * kDotCols + kPanelCols);
#define FS_DOT(i) dot_row<i, R>(x + i * ldx + 2 * j, lo, hi, c##i##a, c##i##b);
    FS_PANEL_ROWS(FS_DOT)
#undef FS_DOT
  };
  const int64_t pairs = K / 2;
  int64_t j = 0;
  if constexpr (PF)
    for (; j < pairs; ++j) {
      const char* at = pf + 2 * kDotCols * j;
      _mm_prefetch(at, _MM_HINT_T0);
      _mm_prefetch(at + 64, _MM_HINT_T0);
      _mm_prefetch(at + kPanelPrefetchL2, _MM_HINT_T1);
      _mm_prefetch(at + kPanelPrefetchL2 + 64, _MM_HINT_T1);
      step(j);
    }
  for (; j < pairs; ++j) step(j);
#define FS_STORE(i) part_row512<i, R, true>(part, c##i##a, c##i##b);
  FS_PANEL_ROWS(FS_STORE)
#undef FS_STORE
}

template <bool PF, int R = 1>
inline void dot_group(int rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K,
                      float (*part)[kPanelCols], const char* pf = nullptr, bool first = true) {
  if constexpr (R < kPanelRows) {
    if (rows > R) return dot_group<PF, R + 1>(rows, x, ldx, w, K, part, pf, first);
  }
  return dot_rows<R, PF>(x, ldx, w, K, part, pf, first);
}
#endif  // FLUIDSERVE_DOT_PANELS
#undef FS_ACCUMULATORS
#undef FS_LOAD
#undef FS_DECL
#undef FS_PANEL_ROWS

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

#ifndef FLUIDSERVE_DOT_PANELS
constexpr int kDotCols = 0;  // (no such layout in this build)
template <bool PF>
inline void dot_group(int, const uint16_t*, int64_t, const uint16_t*, int64_t,
                      float (*)[kPanelCols], const char* = nullptr, bool = true) {}
#endif

// A bf16 [N, K] weight in panels: for the FMA kernel, or with ``dot`` for the bf16 dot
// product (where the build has it: kDotPanelsBuilt).
at::Tensor tile_pack(const at::Tensor& w, bool dot) {
  TORCH_CHECK(!dot || kDotPanelsBuilt,
              "tile_pack: dot panels need a CPU with AVX-512 BF16 (this build's panels: ",
              kTileKind, ")");
  if (dot) {
#ifdef FLUIDSERVE_DOT_PANELS
    return dot_pack(w);
#endif
  }
  return fma_pack(w);
}

// Whether ``packed`` is a dot-product layout (else the FMA one).
inline bool dot_layout(const at::Tensor& packed) {
  return kDotPanelsBuilt && packed.dim() == 3 && packed.size(2) == kDotCols;
}

// A linear's input as its panels read it: bf16 rows for the dot product, float32 (widened
// once) for the FMA; the bias in float32, zero up to the packed width (read 16 at a time).
struct PanelInput {
  at::Tensor x, bias;
  const uint16_t* xb = nullptr;
  const float* xf = nullptr;
  const float* bp = nullptr;
  int64_t K;
  bool dot;

  PanelInput(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
             const std::optional<at::Tensor>& b)
      : K(x_in.size(1)), dot(dot_layout(packed)) {
    // The FMA panels multiply on x widened to float32 (exactly), the dot ones on x as it is.
    TORCH_CHECK(!dot || x_in.scalar_type() == at::kBFloat16,
                "tile_linear: dot panels take a bf16 input");
    x = dot || x_in.scalar_type() == at::kFloat ? x_in.contiguous()
                                                : x_in.to(at::kFloat).contiguous();
    if (b && b->defined()) {
      bias = at::zeros({packed.size(0) * kPanelCols}, x.options().dtype(at::kFloat));
      bias.narrow(0, 0, N).copy_(*b);
      bp = bias.data_ptr<float>();
    }
    if (dot)
      xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    else
      xf = x.data_ptr<float>();
  }

  // part = rows r0 .. r0 + rows of x times the panel at wp; ``lead``: the first group of its
  // row block, which reads the panel from memory (it prefetches).
  void product(int rows, int64_t r0, const uint16_t* wp, bool lead,
               float (*part)[kPanelCols]) const {
    const char* pf = reinterpret_cast<const char*>(wp) + kPanelPrefetch;
    if (dot) {
      if (lead)
        dot_group<true>(rows, xb + r0 * K, K, wp, K, part, pf);
      else
        dot_group<false>(rows, xb + r0 * K, K, wp, K, part);
    } else {
      if (lead)
        panel_group<true>(rows, xf + r0 * K, K, wp, K, true, part, pf);
      else
        panel_group<false>(rows, xf + r0 * K, K, wp, K, true, part);
    }
  }
};

void tile_linear_into(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                      const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t m = x_in.size(0), panels = packed.size(0);
  if (m == 0) return;
  const PanelInput in(x_in, packed, N, bias);
  const auto* wd = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t ldy = y.stride(0), panel_size = packed.size(1) * packed.size(2);
  AT_DISPATCH_SWITCH(y.scalar_type(), "tile_linear",
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      auto* yd = y.data_ptr<scalar_t>();
      at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
        alignas(64) float part[kPanelRows][kPanelCols];
        for (int64_t b0 = 0; b0 < m; b0 += kRowBlock)
          for (int64_t p = p0; p < p1; ++p)
            for (int64_t r0 = b0; r0 < std::min(m, b0 + kRowBlock); r0 += kPanelRows) {
              const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, m - r0));
              in.product(rows, r0, wd + p * panel_size, r0 == b0, part);
              panel_out(part, rows, yd + r0 * ldy, ldy, p * kPanelCols, N, in.bp);
            }
      });
    }));
}

#ifdef FLUIDSERVE_PANELS_512
// SiLU-and-mul of a gate/up linear, fused: out = silu(x W_g^T + b_g) * (x W_u^T + b_u) for a
// [2I, K] weight whose first I rows are the gate's (the model's fused gate_up layer), I a
// multiple of kPanelCols. Gate panel p and up panel p + I / kPanelCols are multiplied one
// after the other on the same rows, and the two partial results meet in registers, each
// rounded to bf16 where tile_linear would store it and silu_and_mul would read it, with
// silu_and_mul's arithmetic: the same bits as the two calls, without the [m, 2I] product
// written and read back (silu_and_mul was ~2% of a saturated burst of the race model on a
// Zen 4 EPYC, mostly reading it). False where it does not apply (then the caller takes the
// two calls).
bool tile_linear_silu_into(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                           const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t I = N / 2, m = x_in.size(0);
  if (N % (2 * kPanelCols) != 0 || packed.size(0) * kPanelCols != N ||
      out.scalar_type() != at::kBFloat16 || !out.is_contiguous() || out.size(1) != I)
    return false;
  if (m == 0) return true;
  const PanelInput in(x_in, packed, N, bias);
  const auto* wd = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t half = packed.size(0) / 2, panel_size = packed.size(1) * packed.size(2);
  auto* od = out.data_ptr<at::BFloat16>();
  using T = c10::BFloat16;
  at::parallel_for(0, half, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float gate[kPanelRows][kPanelCols], up[kPanelRows][kPanelCols];
    for (int64_t b0 = 0; b0 < m; b0 += kRowBlock)
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t r0 = b0; r0 < std::min(m, b0 + kRowBlock); r0 += kPanelRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, m - r0));
          in.product(rows, r0, wd + p * panel_size, r0 == b0, gate);
          in.product(rows, r0, wd + (p + half) * panel_size, r0 == b0, up);
          const int64_t n0 = p * kPanelCols;
          for (int r = 0; r < rows; ++r)
            for (int c = 0; c < kPanelCols; c += 16) {
              v16f g = load16(gate[r] + c), u = load16(up[r] + c);
              if (in.bp) {
                g += load16(in.bp + n0 + c);
                u += load16(in.bp + I + n0 + c);
              }
              g = round16<T>(g);  // the product's output, as stored
              u = round16<T>(u);
              const v16f act = round16<T>(g / (1.0f + vexp(-g)));  // F.silu
              store16(od + (r0 + r) * I + n0 + c, act * u);
            }
        }
  });
  return true;
}
#else
bool tile_linear_silu_into(const at::Tensor&, const at::Tensor&, int64_t,
                           const std::optional<at::Tensor>&, at::Tensor&) {
  return false;
}
#endif

bool tile_linear_supported() { return true; }

bool tile_packed_matches(const at::Tensor& packed, int64_t K, int64_t N) {
  // Exactly the panels N needs: the kernel runs every panel it is given.
  if (packed.dim() != 3 || packed.size(0) != (N + kPanelCols - 1) / kPanelCols) return false;
  if (dot_layout(packed)) return K % 2 == 0 && packed.size(1) == K / 2;
  return packed.size(1) == K && packed.size(2) == kPanelCols;
}

}  // namespace

#endif  // FLUIDSERVE_PANELS
