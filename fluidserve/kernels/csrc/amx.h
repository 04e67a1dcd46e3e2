#pragma once

#include "common.h"
#include "elementwise.h"
#include "long_runs.h"

#ifdef FLUIDSERVE_AMX

namespace {

// ------------------------------------------------ prefill attention on AMX tiles (bf16)
//
// A long run (a prefill chunk) attends to its paged context with both products on the
// CPU's matrix unit: bf16 dot products into 16 x 16 float32 tiles (TDPBF16PS, 8192
// multiply-adds per instruction), flash-attention style with an online softmax between them.
// The products are taken transposed, S^T = K Q^T and O^T += V^T P^T, so that a tile row holds
// one key (or one channel) for 16 queries: the softmax then runs down 16-query vectors with no
// horizontal reductions, which is where a CPU flash attention spends its time (ATen's ran
// these runs at ~0.35 TFLOP/s on a 2-core Sapphire Rapids VM).
//
// First, once per (run, kv head), the keys the run can see are copied key-major ([key, D])
// and the values channel-major within each 32-key chunk ([chunk][D][32 keys]: a V^T tile is
// 1 KB in one piece; as [D, key] rows, 2048 keys put its 16 rows a power of two apart, all in
// one cache set, and those loads took a fifth of the kernel's time), zero up to a multiple of
// 32 keys. Then a work item (run, kv head, up to kAmxQ query tokens) takes 16-token tiles
// and, for each query head of the group and each 32-key chunk up to the tile's last position:
// S^T (two tiles, multiplied a chunk ahead, so that the matrix unit works while the vector
// units take the softmax), mask and scale, running max and sum per query, P rounded to bf16
// (as flash attention on GPUs does), O^T += V^T P^T. The running max is raised lazily
// (kLazyRescale): O^T is rescaled only when a chunk passes it by far, and accumulates in tile
// registers the whole way, 64 channels at a time (past head_dim 64, each further 64 in a pass
// of its own over the probabilities kept from the first). Measured on a 2-core AMX Xeon VM
// against the kernel before (an O^T rescale and store every chunk, [D, key] values):
// 0.61-0.78x the time (`scripts/bench_attention.py --against`, race model shapes, head_dim
// 64); Llama-3-8B's heads (32, 8 kv, head_dim 128), one 1024-token prompt: 0.73x (139 vs
// 190 ms, `--heads 32,8,128 --prefill 1x1024`).
constexpr int kAmxQ = 64;  // query tokens per work item
// Tiles: 0 and 1 hold S^T, 2 to 5 O^T (kOTiles of 16 channels), 6 and 7 a product's
// operands (the intrinsics take tile numbers as literals: macros, not constants).
#define AMX_A 6
#define AMX_B 7
constexpr int kOTiles = 4;

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

struct AmxRun {
  int32_t run, keys, padded;  // keys the run sees; padded to a multiple of 32
  int64_t offset;             // of its kv heads' packed keys (then values) in the buffer
};

// Keys 0 .. keys - 1 of kv head g key-major into kp [padded, D] and values channel-major
// by 32-key chunks into vt [padded / 32, D, 32], 16 x 16 blocks at a time; the padding is
// zero.
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
        narrow16(vt + (static_cast<int64_t>(key0 / 32) * D + d0 + i) * 32 + key0 % 32, x[i]);
    }
  }
  std::memset(kp + static_cast<int64_t>(r.keys) * D, 0, (r.padded - r.keys) * D * 2);
  if (r.keys < r.padded)  // the padding: the end of the last chunk
    for (int d = 0; d < D; ++d)
      std::memset(vt + (static_cast<int64_t>(r.keys / 32) * D + d) * 32 + r.keys % 32, 0,
                  (r.padded - r.keys) * 2);
}

// The running max of a query's scores (log2 units) is raised only when a chunk's max passes
// it by more than this: until then P = 2^(s - m) <= 2^8 (no overflow in float32 sums, bf16
// keeps its relative precision), and O needs no rescaling, so that it stays in tile
// registers from the first key to the last.
constexpr float kLazyRescale = 8.0f;

// 2^t for t <= kLazyRescale on 16 lanes, for the probabilities: 2^floor(t) times a cubic in
// t - floor(t), which VREDUCEPS gives in one instruction (and VSCALEFPS floors t itself), five
// instructions where exp2_neg takes seven. The cubic (fitted to 2^f on [0, 1) for the least
// largest relative error, exact at 0) is within 1.7e-4 of 2^f, ten times below the bf16
// rounding of P; the outputs' errors against a float64 reference were those of the quartic to
// the last digit. Measured on a 2-core AMX Xeon VM (`scripts/bench_attention.py --against`
// the quartic, 16 layers): a 448-token chunk over 512 cached tokens 26.3 -> 24.2 ms, with 30
// decodes beside it 36.4 -> 34.2 ms. With ``clamp``, -inf (a masked score) gives 2^-126.
template <bool clamp>
inline __m512 exp2_cubic(__m512 t) {
  if constexpr (clamp) t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(7.63951018e-2f), f, _mm512_set1_ps(2.28040472e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.95232868e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, t);
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
  // O^T accumulates in tiles 2 to 5, 64 channels at a time: the first group's while the
  // scores and probabilities are computed, each further group's in a pass of its own that
  // takes the probabilities back from ``pbuf`` (1 KB a chunk) and replays the rescales.
  const int groups = (DB + kOTiles - 1) / kOTiles;
  const int max_chunks = (first_pos + w.tok0 + w.toks - 1) / 32 + 1;
  thread_local std::vector<uint16_t> pbuf;
  thread_local std::vector<int> event_chunk;  // chunks whose running max was raised
  thread_local std::vector<float> event_alpha;  // and the rescale of each, 16 queries
  if (groups > 1 && pbuf.size() < static_cast<size_t>(max_chunks) * 512)
    pbuf.resize(static_cast<size_t>(max_chunks) * 512);

  alignas(64) uint16_t qt[kMaxHeadDim / 32][16 * 32];  // Q^T, VNNI: [d pair][query][2]
  alignas(64) float st[2][32 * 16];  // S^T of this chunk and the next: [key][query]
  alignas(64) uint16_t pt[16 * 32];                    // P^T, VNNI: [key pair][query][2]
  alignas(64) float ot[kMaxHeadDim * 16];  // O^T: [channel][query]
  static const __m512i pair_idx = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // The O^T tiles of channel group g (its first nb tiles of 16 channels) and ``ot``.
  auto o_tiles_zero = [](int nb) {
    _tile_zero(2);
    if (nb > 1) _tile_zero(3);
    if (nb > 2) _tile_zero(4);
    if (nb > 3) _tile_zero(5);
  };
  auto o_tiles_out = [](float* o, int nb) {
    _tile_stored(2, o, 64);
    if (nb > 1) _tile_stored(3, o + 256, 64);
    if (nb > 2) _tile_stored(4, o + 512, 64);
    if (nb > 3) _tile_stored(5, o + 768, 64);
  };
  // O^T *= alpha down each channel's 16 queries: out of the tiles and back.
  auto rescale = [&](float* o, int nb, __m512 alpha) {
    o_tiles_out(o, nb);
    for (int i = 0; i < 16 * nb; ++i)
      _mm512_store_ps(o + 16 * i, _mm512_mul_ps(_mm512_load_ps(o + 16 * i), alpha));
    _tile_loadd(2, o, 64);
    if (nb > 1) _tile_loadd(3, o + 256, 64);
    if (nb > 2) _tile_loadd(4, o + 512, 64);
    if (nb > 3) _tile_loadd(5, o + 768, 64);
  };
  // O^T += V^T P^T for chunk ch, channel group g (P^T already in AMX_B).
  auto values = [&](int ch, int g, int nb) {
    for (int i = 0; i < nb; ++i) {
      _tile_loadd(AMX_A, vt + (static_cast<int64_t>(ch) * D + 64 * g + 16 * i) * 32, 64);
      switch (i) {  // tile numbers are immediates
        case 0: _tile_dpbf16ps(2, AMX_A, AMX_B); break;
        case 1: _tile_dpbf16ps(3, AMX_A, AMX_B); break;
        case 2: _tile_dpbf16ps(4, AMX_A, AMX_B); break;
        default: _tile_dpbf16ps(5, AMX_A, AMX_B); break;
      }
    }
  };
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
      __m512 m = _mm512_setzero_ps(), l = _mm512_setzero_ps();
      const int nb0 = std::min(DB, kOTiles);
      o_tiles_zero(nb0);
      event_chunk.clear();
      event_alpha.clear();
      // S^T of a chunk into tiles 0 and 1: issued a chunk ahead, the matrix unit multiplies
      // the next chunk's scores while the vector units take this one's softmax.
      auto scores = [&](int key0) {
        _tile_zero(0);
        _tile_zero(1);
        for (int dc = 0; dc < DC; ++dc) {
          _tile_loadd(AMX_B, qt[dc], 64);
          _tile_loadd(AMX_A, kp + static_cast<int64_t>(key0) * D + 32 * dc, D * 2);
          _tile_dpbf16ps(0, AMX_A, AMX_B);
          _tile_loadd(AMX_A, kp + static_cast<int64_t>(key0 + 16) * D + 32 * dc, D * 2);
          _tile_dpbf16ps(1, AMX_A, AMX_B);
        }
      };
      scores(0);
      _tile_stored(0, st[0], 64);
      _tile_stored(1, st[0] + 256, 64);
      for (int ch = 0; ch < chunks; ++ch) {
        const int key0 = 32 * ch;
        const float* sc = st[ch & 1];
        if (ch + 1 < chunks) scores(key0 + 32);
        __m512 x[32];
        const bool edge = key0 + 31 > min_pos;  // some key of the chunk is after some query
        __m512 mx = _mm512_set1_ps(kNegInf);
        for (int j = 0; j < 32; ++j) {
          x[j] = _mm512_load_ps(sc + 16 * j);
          if (edge)
            x[j] = _mm512_mask_blend_ps(
                _mm512_cmplt_epi32_mask(qpos, _mm512_set1_epi32(key0 + j)), x[j],
                _mm512_set1_ps(kNegInf));
          mx = _mm512_max_ps(mx, x[j]);
        }
        const __m512 m_chunk = _mm512_mul_ps(mx, _mm512_set1_ps(c));
        if (ch == 0) {  // every query sees key 0: each lane's max is finite from here on
          m = m_chunk;
        } else if (_mm512_cmp_ps_mask(m_chunk, _mm512_add_ps(m, _mm512_set1_ps(kLazyRescale)),
                                      _CMP_GT_OQ)) {
          const __m512 m_new = _mm512_max_ps(m, m_chunk);
          const __m512 alpha = exp2_neg<false>(_mm512_sub_ps(m, m_new));
          rescale(ot, nb0, alpha);
          if (groups > 1) {
            event_chunk.push_back(ch);
            event_alpha.resize(event_alpha.size() + 16);
            _mm512_storeu_ps(event_alpha.data() + event_alpha.size() - 16, alpha);
          }
          l = _mm512_mul_ps(l, alpha);
          m = m_new;
        }
        const __m512 neg_m = _mm512_sub_ps(_mm512_setzero_ps(), m);
        __m512 sum = _mm512_setzero_ps();
        // P = 2^(s - m) <= 2^kLazyRescale.
        uint16_t* pc = groups > 1 ? pbuf.data() + static_cast<int64_t>(ch) * 512 : pt;
        auto probabilities = [&](auto exp2) {
          for (int j = 0; j < 32; j += 2) {
            const __m512 p0 = exp2(_mm512_fmadd_ps(x[j], _mm512_set1_ps(c), neg_m));
            const __m512 p1 = exp2(_mm512_fmadd_ps(x[j + 1], _mm512_set1_ps(c), neg_m));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            const __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
            _mm512_storeu_si512(pc + 16 * j, _mm512_permutexvar_epi16(pair_idx, pb));
          }
        };
        if (edge)  // masked scores are -inf
          probabilities([](__m512 t) { return exp2_cubic<true>(t); });
        else
          probabilities([](__m512 t) { return exp2_cubic<false>(t); });
        l = _mm512_add_ps(l, sum);
        _tile_loadd(AMX_B, pc, 64);
        values(ch, 0, nb0);
        if (ch + 1 < chunks) {
          _tile_stored(0, st[(ch + 1) & 1], 64);
          _tile_stored(1, st[(ch + 1) & 1] + 256, 64);
        }
      }
      o_tiles_out(ot, nb0);
      for (int g = 1; g < groups; ++g) {  // the further channel groups, replayed
        const int nb = std::min(DB - kOTiles * g, kOTiles);
        float* o = ot + 64 * 16 * g;
        o_tiles_zero(nb);
        size_t ev = 0;
        for (int ch = 0; ch < chunks; ++ch) {
          if (ev < event_chunk.size() && event_chunk[ev] == ch)
            rescale(o, nb, _mm512_loadu_ps(event_alpha.data() + 16 * ev++));
          _tile_loadd(AMX_B, pbuf.data() + static_cast<int64_t>(ch) * 512, 64);
          values(ch, g, nb);
        }
        o_tiles_out(o, nb);
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

#undef AMX_A
#undef AMX_B

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
  // Not zeroed: amx_pack writes every element the products read, the padding too (a vector
  // zeroed it on the calling thread while the other one waited: ~1 MB a layer for a chunk
  // that sees 1000 keys).
  const std::unique_ptr<uint16_t[]> packed(new uint16_t[total]);
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int64_t n_pack = static_cast<int64_t>(runs.size()) * b.Hkv;
  const int64_t n = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), std::max(n, n_pack))));
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {  // every tile is 16 rows of 64 bytes
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_pack; ++i) {
      const AmxRun& r = runs[i / b.Hkv];
      const int g = static_cast<int>(i % b.Hkv);
      uint16_t* kp = packed.get() + r.offset + static_cast<int64_t>(g) * 2 * r.padded * b.D;
      amx_pack(b, r, g, BS, kc, vc, kp, kp + static_cast<int64_t>(r.padded) * b.D);
    }
    _tile_loadconfig(&cfg);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) amx_item(items[i], runs, b, qd, od, packed.get());
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

at::Tensor tile_pack(const at::Tensor& w, bool dot) {
  TORCH_CHECK(!dot, "tile_pack: dot panels are not built where the CPU has AMX tiles");
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
  return packed.dim() == 5 && packed.size(1) * 32 == K && packed.size(0) == (N + 31) / 32;
}

}  // namespace

#endif  // FLUIDSERVE_AMX
