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
//
// This file: the per-token work items (decodes and short runs) and how they are spread over
// the threads; long runs go to a prefill kernel (amx.h, panel_attention.h) where one is built.
#pragma once

#include "common.h"
#include "decode_avx2.h"

namespace {

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
  // memory, so the next one is prefetched into L2 while this one is used (into L1 each line
  // held a miss buffer: runs of 4 tokens over 300 of context, 16 x 4 @ 300 in
  // ``bench_attention.py``, two cores of a Zen 4 EPYC: 14.9 -> 13.1 ms; 8 x 8 @ 600 24.7 ->
  // 23.1 ms).
  const int block_bytes = BS * D * sizeof(T);
  for (int blk = 0; blk < num_blocks; ++blk) {
    const T* kt = k_cache + table[blk] * kv_stride + head_off;
    if (blk + 1 < num_blocks)
      prefetch_l2(k_cache + table[blk + 1] * kv_stride + head_off, block_bytes);
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
          prefetch_l2(v_cache + table[blk + 1] * kv_stride + head_off + d0, block_bytes);
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

// A decode item: one query token, query heads head0 .. head0 + heads - 1 (whole groups of
// kv heads). Blocks are visited once, all the item's kv heads together (contiguous in the
// cache), with the blocks kAhead ahead prefetched into L2 (the first ones before the pass
// starts, and the value pass's first ones during the score pass's last blocks); the score
// and value passes are the ones of ``attend``.
template <typename T, int BS>
void attend_decode(const WorkItem& w, const Batch& b, const T* q, T* out, const T* k_cache,
                   const T* v_cache, std::vector<float>& scores) {
  constexpr int NV = BS / 16;
  // The inner loops on AVX2 registers (decode_avx2.h); head_dim is a multiple of 16
  // (native_supported).
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
    prefetch_l2(k_cache + table[blk] * kv_stride + off, span);
  for (int blk = 0; blk < num_blocks; ++blk) {  // pass 1: scores
    const T* ahead = blk + kAhead < num_blocks
                         ? k_cache + table[blk + kAhead] * kv_stride + off
                     : blk + kAhead - num_blocks < num_blocks  // the value pass's first blocks
                         ? v_cache + table[blk + kAhead - num_blocks] * kv_stride + off
                         : nullptr;
    if (ahead && !spread) prefetch_l2(ahead, span);
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
          // Even and odd channels in two sets of sums, added at the end: one set is four
          // chains of dependent multiply-adds (with 16-key blocks), one a multiply-add
          // latency per channel, which left the pass at half the FMA rate (a batch-40 decode
          // step of the race model on a Zen 4 EPYC: the score pass was ~45% of the kernel).
          // head_dim is even (native_supported: a multiple of 16).
          v16f s[2][4][NV] = {};
          const T* lead = r0 == k * G ? pf : nullptr;  // the group's first rows prefetch
          for (int d = 0; d < D; d += 2)
            for (int e = 0; e < 2; ++e)
              for (int c = 0; c < NV; ++c) {
                const int at = (d + e) * BS + 16 * c;
                if (lead && at * static_cast<int>(sizeof(T)) % 64 == 0)
                  prefetch_line_l2(lead + at);
                const v16f kv = load16(kt + at);
                for (int rr = 0; rr < 4; ++rr) s[e][rr][c] += qf[r0 + rr][d + e] * kv;
              }
          for (int rr = 0; rr < 4; ++rr)
            for (int c = 0; c < NV; ++c)
              store16(sc + (r0 + rr) * width + blk * BS + 16 * c, s[0][rr][c] + s[1][rr][c]);
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
    if (ahead && !spread_values) prefetch_l2(ahead, span);
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
                  prefetch_line_l2(reinterpret_cast<const char*>(lead + j * D) + by);
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

}  // namespace
