#pragma once

#include "common.h"

namespace {

// What the two prefill attention kernels (amx.h, panel_attention.h) share: the switch, the
// exponential of their softmax, and how a long run is cut into work items.
//
// Whether long runs may take the prefill kernel (amx.h, or panel_attention.h) where it is
// built: off with FLUIDSERVE_NO_PREFILL_KERNEL set, and then ATen's flash attention takes
// them.
bool g_prefill_kernel = std::getenv("FLUIDSERVE_NO_PREFILL_KERNEL") == nullptr;

// 2^f for |f| <= 1/2 as a degree-4 polynomial, highest power first (relative error < 5e-5,
// well below the bf16 rounding of P): the prefill kernels' softmax, on AMX and on AVX2.
constexpr float kExp2Poly[5] = {9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f,
                                1.0f};

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

}  // namespace
