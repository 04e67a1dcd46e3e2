// The compiled CPU kernels of fluidserve, one translation unit built once per machine
// (fluidserve/kernels/__init__.py) from the headers of this directory:
//   common.h           includes, instruction-set switches, the batch, 16-lane vectors
//   attention.h        paged attention over a flattened hybrid batch: per-token items
//   decode_avx2.h      its decode loops on AVX2 registers (CPUs without AVX-512)
//   elementwise.h      argmax, RMSNorm, RoPE, SiLU-and-mul
//   long_runs.h        what the two prefill attention kernels share
//   amx.h              prefill attention and small-batch linears on AMX tiles
//   panel_linear.h     linears on bf16 weights in float32-FMA panels (AVX2, AVX-512)
//   panel_attention.h  prefill attention on those panels
//   decoder_stack.h    a stack of decoder layers in one call
// and, below, the entry points Python calls and their bindings.

#include "common.h"
#include "attention.h"
#include "elementwise.h"
#include "long_runs.h"
#include "amx.h"
#include "panel_linear.h"
#include "panel_attention.h"

namespace {

#if !defined(FLUIDSERVE_AMX) && !defined(FLUIDSERVE_PANELS)
// Neither matrix kernel in this build: oneDNN takes the linears, ATen the long runs.
bool kernel_long_runs(const Batch&, int64_t, int, const std::vector<uint8_t>&, const at::Tensor&,
                   at::Tensor&, const at::Tensor&, const at::Tensor&) {
  return false;
}
constexpr int64_t kTileMaxRows = 0;
at::Tensor tile_pack(const at::Tensor&, bool) {
  TORCH_CHECK(false, "tile_pack: this build has no tile kernel (neither AMX nor AVX2)");
}
void tile_linear_into(const at::Tensor&, const at::Tensor&, int64_t,
                      const std::optional<at::Tensor>&, at::Tensor&) {
  TORCH_CHECK(false, "tile_linear: this build has no tile kernel (neither AMX nor AVX2)");
}
bool tile_linear_supported() { return false; }
const char* kTileKind = "";
bool tile_packed_matches(const at::Tensor&, int64_t, int64_t) { return false; }
#endif
#ifndef FLUIDSERVE_PANELS
// The fused gate/up and SiLU runs on the panels only (panel_linear.h).
bool tile_linear_silu_into(const at::Tensor&, const at::Tensor&, int64_t,
                           const std::optional<at::Tensor>&, at::Tensor&) {
  return false;
}
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
// attention; all others the per-token items (attention.h).
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

// Penalties (SamplingParams: repetition, then frequency and presence) on float32 logits
// [S, V], in place: for row rows[j], the tokens of output[j] and, with a repetition penalty,
// of prompt[j] (int64 [P, L], ids outside [0, V) count nowhere). Each row counts its tokens
// in its thread's table of V counters and then changes each distinct token once, clearing
// its counter as it goes: the work grows with the tokens counted, never with the vocabulary.
// The arithmetic is the eager fallback's (sampler.apply_penalties).
void apply_penalties(at::Tensor logits, const at::Tensor& rows, const at::Tensor& output,
                     const at::Tensor& prompt, const at::Tensor& presence,
                     const at::Tensor& frequency, const at::Tensor& repetition) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits: contiguous float32 [S, V]");
  const int64_t S = logits.size(0), V = logits.size(1), P = rows.numel();
  for (const at::Tensor* t : {&rows, &output, &prompt})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kLong, "token ids and rows: int64");
  TORCH_CHECK(output.dim() == 2 && prompt.dim() == 2 && output.size(0) == P &&
              prompt.size(0) == P, "output, prompt: [rows, L]");
  for (const at::Tensor* t : {&presence, &frequency, &repetition})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat && t->numel() == P,
                "penalties: float32 [rows]");
  TORCH_CHECK(V < (1LL << 31), "vocabulary too large");
  const int64_t* rw = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < P; ++j) TORCH_CHECK(0 <= rw[j] && rw[j] < S, "row out of range");
  const int64_t Lo = output.size(1), Lp = prompt.size(1);
  const int64_t *out_ids = output.data_ptr<int64_t>(), *prompt_ids = prompt.data_ptr<int64_t>();
  const float *ps = presence.data_ptr<float>(), *fq = frequency.data_ptr<float>(),
              *rp = repetition.data_ptr<float>();
  float* x = logits.data_ptr<float>();
  constexpr int32_t kInPrompt = 1 << 30;  // (an output has fewer tokens than this)
  at::parallel_for(0, P, 1, [&](int64_t j0, int64_t j1) {
    std::vector<int32_t> seen(V, 0);
    for (int64_t j = j0; j < j1; ++j) {
      float* row = x + rw[j] * V;
      const int64_t *out = out_ids + j * Lo, *pr = prompt_ids + j * Lp;
      const float rep = rp[j], f = fq[j], pres = ps[j];
      const bool repeat = rep != 1.0f;
      for (int64_t i = 0; i < Lo; ++i)
        if (out[i] >= 0 && out[i] < V) ++seen[out[i]];
      if (repeat)
        for (int64_t i = 0; i < Lp; ++i)
          if (pr[i] >= 0 && pr[i] < V) seen[pr[i]] |= kInPrompt;
      auto visit = [&](int64_t t) {
        if (t < 0 || t >= V || seen[t] == 0) return;
        const int32_t n = seen[t] & (kInPrompt - 1);
        seen[t] = 0;
        float v = row[t];
        if (repeat) v = v > 0 ? v / rep : v * rep;
        if (n > 0) {
          const float by = f * static_cast<float>(n);  // (two roundings, as the eager code's)
          v -= by + pres;
        }
        row[t] = v;
      };
      for (int64_t i = 0; i < Lo; ++i) visit(out[i]);
      if (repeat)
        for (int64_t i = 0; i < Lp; ++i) visit(pr[i]);
    }
  });
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

// What tile_linear and tile_linear_silu (``op``) ask of their input.
void check_tile_input(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  // (On AMX this also asks the kernel for the tiles: without that, their first use is SIGILL.)
  TORCH_CHECK(tile_linear_supported(), op, ": no tile kernel on this CPU (tile_kind() is empty)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, op,
              ": a contiguous [M, K] bf16 input expected");
  TORCH_CHECK(x.size(0) <= kTileMaxRows, op, ": at most ", kTileMaxRows, " rows");
  TORCH_CHECK(tile_packed_matches(packed, x.size(1), N), op,
              ": the packed weight does not match the input");
}

// y = x W^T (+ b) on a weight packed by ``tile_pack``, for at most ``tile_max_rows()`` rows.
at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  check_tile_input("tile_linear", x, packed, N);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  tile_linear_into(x, packed, N, bias, y);
  return y;
}

// silu(x W_gate^T) * (x W_up^T) on a gate/up weight packed by ``tile_pack`` ([2I, K], the
// gate's rows first): the bits of tile_linear and silu_and_mul, without the [M, 2I] product
// in memory; where the build has it (the AVX-512 panels, I a multiple of 32).
at::Tensor tile_linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const std::optional<at::Tensor>& bias) {
  check_tile_input("tile_linear_silu", x, packed, N);
  at::Tensor out = at::empty({x.size(0), N / 2}, x.options());
  TORCH_CHECK(tile_linear_silu_into(x, packed, N, bias, out),
              "tile_linear_silu: not fused here (needs the AVX-512 panels and out features a"
              " multiple of 64, got ", N, ", kernel '", kTileKind, "')");
  return out;
}

int64_t tile_max_rows() { return tile_linear_supported() ? kTileMaxRows : 0; }
bool dot_panels_built() { return kDotPanelsBuilt; }

// How fast one core issues the bf16 dot product (VDPBF16PS: 32 bf16 products summed in pairs
// into 16 float32 lanes) and the float32 FMA (VFMADD231PS: 16 multiply-adds), in instructions
// a second: twelve independent accumulator chains of each in a tight loop, ~10 ms each. The
// dot product does twice the multiply-adds of an FMA, so the dot panels pay where it issues
// at more than half the FMA's rate: on AMD Zen 4 at 0.96-1.0 of it, on an Emerald Rapids class
// Xeon at 0.25 (docs/performance.md). (0, 0) where the build has no AVX-512 BF16.
std::pair<double, double> bf16_dot_rates() {
#if defined(__AVX512BF16__)
  constexpr long kSteps = 2500000;  // of twelve instructions each
  using clock = std::chrono::steady_clock;
  const auto rate = [](auto&& step) {
    const auto t0 = clock::now();
    for (long i = 0; i < kSteps; ++i) step();
    return 12.0 * kSteps / std::chrono::duration<double>(clock::now() - t0).count();
  };
  __m512 a[12], b[12];
  for (int j = 0; j < 12; ++j) a[j] = b[j] = _mm512_setzero_ps();
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  const __m512bh u = (__m512bh)_mm512_set1_epi16(0x3f80);
  const double fma = rate([&] {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm512_fmadd_ps(x, y, a[j]);
    asm volatile("" ::"v"(a[0]), "v"(a[3]), "v"(a[6]), "v"(a[9]));
  });
  const double dot = rate([&] {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) b[j] = _mm512_dpbf16_ps(b[j], u, u);
    asm volatile("" ::"v"(b[0]), "v"(b[3]), "v"(b[6]), "v"(b[9]));
  });
  float sink = 0;  // (keeps every chain live)
  for (int j = 0; j < 12; ++j) sink += _mm512_reduce_add_ps(a[j]) + _mm512_reduce_add_ps(b[j]);
  asm volatile("" ::"x"(sink));
  return {fma, dot};
#else
  return {0.0, 0.0};
#endif
}
std::string tile_kind() { return tile_linear_supported() ? kTileKind : ""; }

#include "decoder_stack.h"

// Whether long runs may take the prefill kernel (where it is built); returns the previous value.
bool use_prefill_kernel(bool enabled) {
  const bool previous = g_prefill_kernel;
  g_prefill_kernel = enabled;
  return previous;
}

// Whether the prefill kernel's panels multiply on the bf16 dot product (where the build has
// it: dot_panels_built), as the linears' panels; returns the previous value.
bool use_prefill_dot(bool enabled) {
#ifdef FLUIDSERVE_PANELS
  TORCH_CHECK(!enabled || kDotPanelsBuilt,
              "use_prefill_dot: the dot product needs a CPU with AVX-512 BF16 (this build's "
              "panels: ", kTileKind, ")");
  const bool previous = g_prefill_dot;
  g_prefill_dot = enabled;
  return previous;
#else
  TORCH_CHECK(!enabled, "use_prefill_dot: this build has no panel prefill kernel");
  return false;
#endif
}

// The prefill kernel that long bf16 runs take here: "amx", "avx2", "avx512" or "" (ATen's flash
// attention: none built, or switched off).
std::string prefill_kernel() {
  if (!g_prefill_kernel) return "";
#ifdef FLUIDSERVE_AMX
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
  m.def("use_prefill_dot", &use_prefill_dot,
        "Multiply (or not) in the panel prefill kernel on the bf16 dot product; returns the"
        " old value");
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
  m.def("apply_penalties", &apply_penalties,
        "Repetition, frequency and presence penalties on float32 logits rows, in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention, "Paged attention over a flattened hybrid batch",
        py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "Scatter new keys/values into the paged cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("tile_pack", &tile_pack,
        "A bf16 weight copied into the layout tile_linear reads (dot: the bf16 dot-product"
        " panels, where dot_panels_built())", py::arg("weight"), py::arg("dot") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("dot_panels_built", &dot_panels_built,
        "Whether this build has panels for the bf16 dot product (AVX-512 BF16 without AMX)");
  m.def("bf16_dot_rates", &bf16_dot_rates,
        "(FMA, bf16 dot) instructions a second on one core; (0, 0) without AVX-512 BF16",
        py::call_guard<py::gil_scoped_release>());
  m.def("tile_linear", &tile_linear, "x W^T (+ b) on a tile_pack'ed weight",
        py::call_guard<py::gil_scoped_release>());
  m.def("tile_linear_silu", &tile_linear_silu,
        "silu(x W_gate^T) * (x W_up^T) on a tile_pack'ed gate/up weight (the AVX-512 panels)",
        py::call_guard<py::gil_scoped_release>());
  m.def("tile_max_rows", &tile_max_rows, "Rows tile_linear takes here (0: none)");
  m.def("tile_kind", &tile_kind, "The tile_linear kernel built here: amx, avx512, avx2 or ''");
  m.def("decoder_layers", &decoder_layers, "A stack of decoder layers for a small batch",
        py::call_guard<py::gil_scoped_release>());
}
