// Row-wise operators of the decoder layer and the sampler: argmax, rounding to the model
// dtype, (add +) RMSNorm, RoPE, SiLU-and-mul, each over rows of sixteen lanes.
#pragma once

#include "common.h"

namespace {

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
// (On AVX-512 the narrowing is one VPMOVDW; GCC's lowering of the vector extension's
// convert is a VPERMI2W on a table loaded for each store.)
inline void store16(c10::BFloat16* p, v16f v) {
  const v16u32 b = (v16u32)v;
  v16u32 r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  r = v == v ? r : (v16u32){} + 0x7fc0u;  // NaN stays NaN
#ifdef __AVX512F__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)r));
#else
  const v16u16 h = __builtin_convertvector(r, v16u16);
  std::memcpy(p, &h, sizeof(h));
#endif
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
      for (; i + 32 <= I; i += 32) {  // two at a time: the exponentials' chains overlap
        const v16f g0 = load16(g + i), g1 = load16(g + i + 16);
        const v16f a0 = round16<T>(g0 / (1.0f + vexp(-g0)));  // F.silu
        const v16f a1 = round16<T>(g1 / (1.0f + vexp(-g1)));
        store16(o + i, a0 * load16(u + i));
        store16(o + i + 16, a1 * load16(u + i + 16));
      }
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

}  // namespace
