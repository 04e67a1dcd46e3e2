#pragma once

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

// Rows from which the stack fuses gate/up and SiLU-and-mul. Below, a step is bound by reading
// its weights from memory, and the fused loop's alternation of gate and up panels defeats the
// prefetch stream that runs from one panel into the next in memory: batch-1 decode steps of
// the race model on a Zen 4 EPYC took 15.9 / 16.9 / 15.7 ms fused against 14.7 / 15.6 / 16.0
// apart (alternated). From 40 rows the product is bound by the multiply-adds, and fused
// batch-40 decode steps took 57.3 / 53.2 ms against 59.3 / 53.9 apart.
constexpr int64_t kFusedSiluMinRows = 32;

// The model's decoder layers (or a pipeline stage's) for one batch, exactly as
// ``DecoderLayer.forward_native`` runs them one after the other from Python: the same
// kernels and oneDNN calls in the same order, so the result is identical; only the
// interpreter's share of a decode step (about 0.15 ms per layer) is gone. (On the AVX-512
// panels, from kFusedSiluMinRows rows, the gate/up linear and SiLU-and-mul are one call,
// tile_linear_silu: the same bits without the gate/up product in memory; a saturated burst
// of the race model on a Zen 4 EPYC, alternated with the two calls: 996/985 -> 1015/1004
// tokens/s.) Per layer: the
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
//
// With ``keep`` (ascending batch rows, each the last of its run) and the attention metadata
// of those rows alone (one query per run: ``keep_cu_q`` = 0, 1, ..., ``keep_ctx_lens`` and
// ``keep_block_tables`` of their runs), the last layer writes every row's keys and values and
// computes the rest for the kept rows only, and the stack returns those rows (padded as their
// own count asks, then cut). LlamaForCausalLM passes the sampled rows where they are fewer
// than the batch's.
std::vector<at::Tensor> decoder_layers(
    at::Tensor h, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& weights,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<at::Tensor>& k_caches,
    const std::vector<at::Tensor>& v_caches, const at::Tensor& slots, const at::Tensor& cu_q,
    const at::Tensor& ctx_lens, const at::Tensor& block_tables, int64_t H, int64_t Hkv,
    int64_t D, double eps, double scale, int64_t min_long_run,
    const std::vector<std::optional<at::Tensor>>& tiles, const std::vector<int64_t>& out_features,
    const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& keep_cu_q,
    const std::optional<at::Tensor>& keep_ctx_lens,
    const std::optional<at::Tensor>& keep_block_tables) {
  const size_t L = k_caches.size();
  TORCH_CHECK(v_caches.size() == L && norms.size() == 2 * L && weights.size() == 4 * L &&
                  biases.size() == 4 * L,
              "decoder_layers: per-layer argument lists of the wrong length");
  TORCH_CHECK(tiles.empty() || (tiles.size() == 4 * L && out_features.size() == 4 * L),
              "decoder_layers: tile weights and out features must come 4 per layer");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decoder_layers: h must be [T, hidden]");
  TORCH_CHECK(!keep || (keep_cu_q && keep_ctx_lens && keep_block_tables),
              "decoder_layers: the kept rows need their attention metadata");
  // A batch small enough for the tile copies runs unpadded: they take any row count. (The
  // last layer of a pruned batch changes all three: it runs on the kept rows only.)
  int64_t T = h.size(0);
  bool tiled = false;
  int64_t rows = T;
  auto shape_for = [&](int64_t n) {
    T = n;
    tiled = !tiles.empty() && T <= kTileMaxRows && tile_linear_supported();
    rows = tiled ? T : padded_rows(T);
  };
  auto pad = [&](const at::Tensor& x) {  // x [T, ...] -> [rows, ...], zero rows appended
    if (rows == T) return x;
    std::vector<int64_t> shape = x.sizes().vec();
    shape[0] = rows;
    at::Tensor padded = at::zeros(shape, x.options());
    padded.narrow(0, 0, T).copy_(x);
    return padded;
  };
  shape_for(T);
  h = pad(h);
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
  auto attention_buffer = [&] {
    return rows != T ? at::zeros({rows, H * D}, h.options())
                     : at::empty({rows, H * D}, h.options());
  };
  at::Tensor o_rows = attention_buffer();
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
    if (keep && i + 1 == L) {
      // The last layer of a batch whose outputs are needed for a few rows only (the sampled
      // ones: every row of a prefill chunk but its last feeds nothing after this layer's
      // keys and values): every row's keys and values are written, then attention, the
      // output projection and the MLP run on the kept rows.
      const at::Tensor kept_q = q.index_select(0, *keep);
      residual = residual.narrow(0, 0, T).index_select(0, *keep);
      shape_for(keep->size(0));
      residual = pad(residual);
      o_rows = attention_buffer();
      o = o_rows.narrow(0, 0, T).view({T, H, D});
      paged_attention(o, kept_q, k, v, k_caches[i], v_caches[i], slots, *keep_cu_q,
                      *keep_ctx_lens, *keep_block_tables, scale, min_long_run);
      if (T == 0) return {at::empty({0, h.size(1)}, h.options()), residual};
    } else {
      paged_attention(o, q, k, v, k_caches[i], v_caches[i], slots, cu_q, ctx_lens,
                      block_tables, scale, min_long_run);
    }
    h = linear(o_rows, 4 * i + 1);
    fused_add_rms_norm(h, residual, norms[2 * i + 1], eps);
    const size_t j = 4 * i + 2;  // gate/up: fused with SiLU-and-mul where the panels can
    at::Tensor act;
    if (tiled && tiles[j] && T >= kFusedSiluMinRows) {
      act = at::empty({rows, out_features[j] / 2}, h.options());
      if (!tile_linear_silu_into(h, *tiles[j], out_features[j], biases[j], act))
        act = at::Tensor();  // (not fusable: the two calls below)
    }
    if (!act.defined()) {
      const at::Tensor gu = linear(h, j);
      act = at::empty({rows, gu.size(1) / 2}, gu.options());
      silu_and_mul(act, gu);
    }
    h = linear(act, 4 * i + 3);
  }
  if (rows != T) return {h.narrow(0, 0, T), residual.narrow(0, 0, T)};
  return {h, residual};
}
