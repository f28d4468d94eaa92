#include "berth/runtime/cpu_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "berth/core/error.h"
#include "berth/cpu_kernels/ops.h"
#include "berth/cpu_kernels/quant_dot.h"

namespace berth {

using graph::Op;
using graph::OpKind;

CpuExecutor::CpuExecutor(ThreadPool& pool, const graph::WeightTable& weights, KvCache& kv)
    : pool_(pool), weights_(weights), kv_(kv), scratch_(static_cast<size_t>(pool.n_threads())) {}

float* CpuExecutor::worker_scratch(size_t floats) {
  auto& s = scratch_[static_cast<size_t>(ThreadPool::worker_index())];
  if (s.size() < floats) s.resize(floats);
  return s.data();
}

std::span<const float> CpuExecutor::run(const graph::Graph& g, std::span<const int32_t> tokens,
                                        std::span<const int32_t> positions) {
  if (tokens.size() != static_cast<size_t>(g.n_tokens) || positions.size() != tokens.size())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("graph of {} tokens run with {} tokens and {} positions", g.n_tokens,
                            tokens.size(), positions.size()));
  for (size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] < 0 || positions[i] >= kv_.n_ctx())
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("position {} is outside the context of {} tokens", positions[i],
                              kv_.n_ctx()));
    if (i > 0 && positions[i] != positions[i - 1] + 1)
      throw Error(ErrorCategory::invalid_argument, "ubatch positions must be consecutive");
  }
  if (bufs_.size() < g.values.size()) bufs_.resize(g.values.size());
  for (size_t i = 0; i < g.values.size(); ++i) {
    const size_t n = static_cast<size_t>(g.values[i].rows * g.values[i].cols);
    if (bufs_[i].size() < n) bufs_[i].resize(n);
  }
  for (const Op& op : g.ops) run_op(g, op, tokens, positions);
  const graph::ValueInfo& out = g.values[static_cast<size_t>(g.output)];
  return {buf(g.output), static_cast<size_t>(out.rows * out.cols)};
}

void CpuExecutor::run_op(const graph::Graph& g, const Op& op, std::span<const int32_t> tokens,
                         std::span<const int32_t> positions) {
  const graph::ValueInfo& out_info = g.values[static_cast<size_t>(op.output)];
  float* out = buf(op.output);
  const int64_t rows = out_info.rows, cols = out_info.cols;
  const int n_threads = pool_.n_threads();

  switch (op.kind) {
    case OpKind::embed: {
      const TensorView& w = weights_[op.weight];
      for (int64_t t = 0; t < rows; ++t) {
        const int32_t id = tokens[static_cast<size_t>(t)];
        if (id < 0 || id >= w.ne[1])
          throw Error(ErrorCategory::invalid_argument,
                      fmt::format("token id {} is outside the vocabulary of {} tokens", id, w.ne[1]));
        cpu::get_row(w, id, out + t * cols);
      }
      return;
    }
    case OpKind::rms_norm: {
      const float* x = buf(op.inputs[0]);
      const float* wp = nullptr;
      if (op.weight != graph::kNoWeight) {
        const TensorView& w = weights_[op.weight];
        if (w.type == GgmlType::F32) {
          wp = static_cast<const float*>(w.data);
        } else {
          small_weight_.resize(static_cast<size_t>(w.ne[0]));
          cpu::get_row(w, 0, small_weight_.data());
          wp = small_weight_.data();
        }
      }
      pool_.parallel_for(rows, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) cpu::rms_norm(x + r * cols, wp, out + r * cols, cols, op.eps);
      });
      return;
    }
    case OpKind::matmul: {
      matmul(weights_[op.weight], buf(op.inputs[0]), rows, out);
      return;
    }
    case OpKind::add: {
      const float* a = buf(op.inputs[0]);
      const float* b = buf(op.inputs[1]);
      cpu::add(a, b, out, rows * cols);
      return;
    }
    case OpKind::swiglu: {
      const float* a = buf(op.inputs[0]);
      const float* b = buf(op.inputs[1]);
      const int64_t n = rows * cols;
      const int64_t grain = std::max<int64_t>(4096, n / n_threads);
      pool_.parallel_for(n, grain, [&](int64_t i0, int64_t i1) {
        cpu::swiglu(a + i0, b + i0, out + i0, i1 - i0);
      });
      return;
    }
    case OpKind::rope: {
      const graph::RopeParams& p = op.rope;
      const float* x = buf(op.inputs[0]);
      std::memcpy(out, x, static_cast<size_t>(rows * cols) * sizeof(float));
      const int32_t half = p.n_rot / 2;
      pool_.parallel_for(rows, 1, [&](int64_t r0, int64_t r1) {
        float* cs = worker_scratch(static_cast<size_t>(2 * half));
        for (int64_t r = r0; r < r1; ++r) {
          const double pos = positions[static_cast<size_t>(r)];
          for (int32_t i = 0; i < half; ++i) {
            // theta_i = pos * base^(-2i / n_rot), computed in double (RoFormer, eq. 15).
            const double theta =
                pos * std::pow(static_cast<double>(p.freq_base), -2.0 * i / p.n_rot);
            cs[i] = static_cast<float>(std::cos(theta));
            cs[half + i] = static_cast<float>(std::sin(theta));
          }
          cpu::rope_inplace(out + r * cols, p.n_head, p.head_dim, p.n_rot, cs, cs + half,
                            p.mode == graph::RopeMode::adjacent);
        }
      });
      return;
    }
    case OpKind::attention: {
      const graph::AttentionParams& p = op.attn;
      const float* q = buf(op.inputs[0]);
      const float* k = buf(op.inputs[1]);
      const float* v = buf(op.inputs[2]);
      const KvLayer& kl = kv_.layer(p.layer);
      float* kc = kv_.k(p.layer);
      float* vc = kv_.v(p.layer);
      const int64_t n_tok = rows;
      for (int64_t t = 0; t < n_tok; ++t) {
        const int64_t pos = positions[static_cast<size_t>(t)];
        std::memcpy(kc + pos * kl.k_dim, k + t * kl.k_dim, static_cast<size_t>(kl.k_dim) * 4);
        std::memcpy(vc + pos * kl.v_dim, v + t * kl.v_dim, static_cast<size_t>(kl.v_dim) * 4);
      }
      const int32_t group = p.n_head / p.n_head_kv;
      const int64_t hd = p.head_dim;
      if (n_tok == 1) {
        // Decode: one task per KV head; its `group` query heads read each K/V row once.
        const int64_t n_kv = positions[0] + 1;
        pool_.parallel_for(p.n_head_kv, 1, [&](int64_t h0, int64_t h1) {
          float* scratch = worker_scratch(static_cast<size_t>(kv_.n_ctx()));
          for (int64_t hk = h0; hk < h1; ++hk)
            cpu::attention_group(q + hk * group * hd, hd, group, n_kv, kc + hk * hd, kl.k_dim,
                                 vc + hk * hd, kl.v_dim, p.head_dim, p.scale,
                                 out + hk * group * hd, hd, scratch);
        });
        return;
      }
      // Prefill: tasks of (query head, block of consecutive tokens), each a causal tile that
      // walks the cache in KV tiles with an online softmax (no score matrix). A query's result
      // depends only on its position, so blocks, threads and ubatches never change the bits.
      constexpr int64_t kQueryBlock = 32;
      const int64_t n_blocks = (n_tok + kQueryBlock - 1) / kQueryBlock;
      pool_.parallel_for(p.n_head * n_blocks, 1, [&](int64_t i0, int64_t i1) {
        float* scratch = worker_scratch(static_cast<size_t>(kv_.n_ctx()));
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t h = i % p.n_head;
          const int64_t t0 = (i / p.n_head) * kQueryBlock;
          const int64_t nq = std::min(kQueryBlock, n_tok - t0);
          const int64_t hk = h / group;
          cpu::attention_causal_tile(q + t0 * cols + h * hd, cols, nq,
                                     positions[static_cast<size_t>(t0)], kc + hk * hd, kl.k_dim,
                                     vc + hk * hd, kl.v_dim, p.head_dim, p.scale,
                                     out + t0 * cols + h * hd, cols, scratch);
        }
      });
      return;
    }
    case OpKind::take_last_rows: {
      const graph::ValueInfo& in = g.values[static_cast<size_t>(op.inputs[0])];
      const float* x = buf(op.inputs[0]) + (in.rows - rows) * cols;
      std::memcpy(out, x, static_cast<size_t>(rows * cols) * sizeof(float));
      return;
    }
  }
  throw Error(ErrorCategory::internal, fmt::format("op '{}' has an unknown kind", op.name));
}

void CpuExecutor::matmul(const TensorView& w, const float* x, int64_t n_tok, float* out) {
  const int64_t n_in = w.ne[0];
  const int64_t n_out = w.n_rows();
  // Quantize the activations once, in the format the weight type's dot product takes.
  const size_t arb = cpu::activation_row_bytes(w.type, n_in);
  if (act_.size() < arb * static_cast<size_t>(n_tok)) act_.resize(arb * static_cast<size_t>(n_tok));
  uint8_t* act = act_.data();
  pool_.parallel_for(n_tok, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      cpu::quantize_activation(w.type, x + t * n_in, act + static_cast<size_t>(t) * arb, n_in);
  });
  // Split the rows across the pool: about 4 chunks per thread for balance, in whole row tiles.
  const int64_t n_threads = pool_.n_threads();
  int64_t grain = (n_out + n_threads * 4 - 1) / (n_threads * 4);
  grain = std::max<int64_t>(cpu::kGemmRowTile, (grain + cpu::kGemmRowTile - 1) / cpu::kGemmRowTile *
                                                   cpu::kGemmRowTile);
  pool_.parallel_for(n_out, grain, [&](int64_t r0, int64_t r1) {
    cpu::gemm_rows(w.type, w.row(r0), r1 - r0, act, arb, n_tok, n_in, out + r0, n_out);
  });
}

}  // namespace berth
