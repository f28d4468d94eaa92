#include "berth/backends/cpu_executor.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "berth/core/error.h"
#include "berth/cpu_kernels/gdn.h"
#include "berth/cpu_kernels/ops.h"
#include "berth/cpu_kernels/quant_dot.h"
#include "berth/graph/arena.h"

namespace berth {

using graph::Op;
using graph::OpKind;

CpuExecutor::CpuExecutor(ThreadPool& pool, const graph::WeightTable& weights, const KvView& kv)
    : pool_(pool), weights_(weights), kv_(kv), scratch_(static_cast<size_t>(pool.n_threads())) {}

float* CpuExecutor::worker_scratch(size_t floats) {
  auto& s = scratch_[static_cast<size_t>(ThreadPool::worker_index())];
  if (s.size() < floats) s.resize(floats);
  return s.data();
}

void CpuExecutor::check_ubatch(const graph::Graph& g, std::span<const int32_t> tokens,
                               std::span<const int32_t> positions,
                               std::span<const int32_t> seqs) const {
  if (tokens.size() != static_cast<size_t>(g.n_tokens) || positions.size() != tokens.size() ||
      (!seqs.empty() && seqs.size() != tokens.size()))
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("graph of {} tokens run with {} tokens, {} positions and {} sequence "
                            "ids",
                            g.n_tokens, tokens.size(), positions.size(), seqs.size()));
  // Per sequence, the position its next token must have (-1: none seen yet).
  std::vector<int64_t> next(static_cast<size_t>(kv_.n_seq), -1);
  for (size_t i = 0; i < positions.size(); ++i) {
    const int32_t s = seqs.empty() ? 0 : seqs[i];
    if (s < 0 || s >= kv_.n_seq)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("token {} of the ubatch names sequence {}, outside the KV cache's "
                              "{} sequences",
                              i, s, kv_.n_seq));
    if (positions[i] < 0 || positions[i] >= kv_.n_ctx)
      throw Error(
          ErrorCategory::invalid_argument,
          fmt::format("position {} is outside the context of {} tokens", positions[i], kv_.n_ctx));
    int64_t& nx = next[static_cast<size_t>(s)];
    if (nx >= 0 && positions[i] != nx)
      throw Error(ErrorCategory::invalid_argument,
                  seqs.empty() ? std::string("ubatch positions must be consecutive")
                               : fmt::format("ubatch positions of sequence {} must be "
                                             "consecutive: {} follows {}",
                                             s, positions[i], nx - 1));
    nx = positions[i] + 1;
  }
}

std::span<const float> CpuExecutor::run(const graph::Graph& g, std::span<const int32_t> tokens,
                                        std::span<const int32_t> positions,
                                        std::span<const int32_t> seqs) {
  check_ubatch(g, tokens, positions, seqs);
  ++run_count_;
  // One arena: a value's bytes are reused once its last reader has run (graph::step_arena).
  const std::vector<graph::ValueId> keep = graph::kept_after_step(g);
  const size_t bytes = graph::step_arena(g, keep, offsets_);
  if (arena_.size() * sizeof(float) < bytes) arena_.resize(bytes / sizeof(float));
  ptrs_.resize(g.values.size());
  readable_.assign(g.values.size(), 0);
  for (size_t i = 0; i < g.values.size(); ++i)
    ptrs_[i] = arena_.data() + offsets_[i] / sizeof(float);
  if (g.output >= 0) readable_[static_cast<size_t>(g.output)] = 1;
  for (graph::ValueId v : keep) readable_[static_cast<size_t>(v)] = 1;
  pool_.execute([&] { run_ops(g, {}, tokens, positions, seqs); });
  const graph::ValueInfo& out = g.values[static_cast<size_t>(g.output)];
  return {buf(g.output), static_cast<size_t>(out.rows * out.cols)};
}

void CpuExecutor::bind_expert_table(graph::WeightId gate, const ExpertTable& t) {
  if (gate < 0 || static_cast<size_t>(gate) >= weights_.size() || !t.table || t.n_expert < 1)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("bind_expert_table: weight {} of {} with a table of {} experts at {}",
                            gate, weights_.size(), t.n_expert, static_cast<const void*>(t.table)));
  if (expert_tables_.size() < weights_.size()) expert_tables_.resize(weights_.size());
  expert_tables_[static_cast<size_t>(gate)] = t;
}

void CpuExecutor::bind_expert_source(graph::WeightId gate, ExpertSource* src) {
  if (gate < 0 || static_cast<size_t>(gate) >= weights_.size())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("bind_expert_source: weight {} of {}", gate, weights_.size()));
  if (expert_sources_.size() < weights_.size()) expert_sources_.resize(weights_.size(), nullptr);
  expert_sources_[static_cast<size_t>(gate)] = src;
}

void CpuExecutor::begin_external(const graph::Graph& g, std::span<float* const> value_ptrs) {
  if (value_ptrs.size() != g.values.size())
    throw Error(ErrorCategory::internal, "begin_external: one pointer per value expected");
  ++run_count_;
  ptrs_.assign(value_ptrs.begin(), value_ptrs.end());
  // The caller may reuse the others' bytes within the step (the Scheduler's host arena).
  readable_.assign(g.values.size(), 0);
  if (g.output >= 0) readable_[static_cast<size_t>(g.output)] = 1;
  for (graph::ValueId v : graph::kept_after_step(g)) readable_[static_cast<size_t>(v)] = 1;
}

void CpuExecutor::run_subset(const graph::Graph& g, std::span<const int32_t> op_indices,
                             std::span<const int32_t> tokens, std::span<const int32_t> positions,
                             std::span<const int32_t> seqs) {
  pool_.execute([&] { run_ops(g, op_indices, tokens, positions, seqs); });
}

void CpuExecutor::run_ops(const graph::Graph& g, std::span<const int32_t> subset,
                          std::span<const int32_t> tokens, std::span<const int32_t> positions,
                          std::span<const int32_t> seqs) {
  // The ops to run: all of g in order, or the listed indices (ascending).
  const size_t n_list = subset.empty() ? g.ops.size() : subset.size();
  auto op_at = [&](size_t j) -> const Op& {
    return g.ops[subset.empty() ? j : static_cast<size_t>(subset[j])];
  };
  for (size_t i = 0; i < n_list;) {
    const Op& op = op_at(i);
    const auto t0 =
        profiling_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    size_t n_ops = 1;
    if (op.kind == OpKind::matmul) {
      // Consecutive matmuls of one input (Q/K/V, gate/up) run as one parallel region: one
      // activation quantization and one barrier instead of one each.
      const Op* first = &op;
      while (i + n_ops < n_list && &op_at(i + n_ops) == first + n_ops &&
             first[n_ops].kind == OpKind::matmul && first[n_ops].inputs[0] == op.inputs[0])
        ++n_ops;
      matmul_group(g, std::span<const Op>(first, n_ops));
    } else {
      run_op(g, op, tokens, positions, seqs);
    }
    if (profiling_) {
      OpTime& pt = prof_[static_cast<size_t>(op.kind)];
      pt.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      pt.calls += static_cast<int64_t>(n_ops);
    }
    i += n_ops;
  }
}

std::span<const float> CpuExecutor::value(const graph::Graph& g, graph::ValueId v) const {
  if (v < 0 || static_cast<size_t>(v) >= g.values.size() ||
      static_cast<size_t>(v) >= ptrs_.size() || ptrs_[static_cast<size_t>(v)] == nullptr)
    throw Error(ErrorCategory::invalid_argument, fmt::format("no value {} in the last run", v));
  if (static_cast<size_t>(v) >= readable_.size() || !readable_[static_cast<size_t>(v)])
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("value {} ({}) of the last run was not kept: run() keeps the output "
                            "and each moe_route output; the bytes of other values are reused",
                            v, g.values[static_cast<size_t>(v)].name));
  const graph::ValueInfo& vi = g.values[static_cast<size_t>(v)];
  return {ptrs_[static_cast<size_t>(v)], static_cast<size_t>(vi.rows * vi.cols)};
}

std::vector<CpuExecutor::OpTime> CpuExecutor::profile() const {
  std::vector<OpTime> out;
  for (size_t k = 0; k < kOpKinds; ++k)
    if (prof_[k].calls > 0) {
      out.push_back(prof_[k]);
      out.back().kind = graph::op_name(static_cast<graph::OpKind>(k));
    }
  std::sort(out.begin(), out.end(),
            [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
  return out;
}

void CpuExecutor::run_op(const graph::Graph& g, const Op& op, std::span<const int32_t> tokens,
                         std::span<const int32_t> positions, std::span<const int32_t> seqs) {
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
          throw Error(
              ErrorCategory::invalid_argument,
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
      const int64_t len = op.norm_group > 0 ? op.norm_group : cols;
      const int64_t n_norm = rows * (cols / len);  // rows of `len` values, consecutive in memory
      pool_.parallel_for(n_norm, std::max<int64_t>(1, 16384 / len), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          cpu::rms_norm(x + r * len, wp, out + r * len, len, op.eps);
      });
      return;
    }
    case OpKind::matmul: {
      matmul_group(g, std::span<const Op>(&op, 1));
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
      // cos/sin of theta_i = pos * base^(-2i / n_rot) per token, computed in double (RoFormer,
      // eq. 15) once per run and rope shape: every layer's Q and K reuse the table.
      if (rope_run_ != run_count_ || rope_n_rot_ != p.n_rot || rope_base_ != p.freq_base) {
        rope_tables_.resize(static_cast<size_t>(rows) * half * 2);
        for (int64_t r = 0; r < rows; ++r) {
          const double pos = positions[static_cast<size_t>(r)];
          float* cs = rope_tables_.data() + r * half * 2;
          for (int32_t i = 0; i < half; ++i) {
            const double theta =
                pos * std::pow(static_cast<double>(p.freq_base), -2.0 * i / p.n_rot);
            cs[i] = static_cast<float>(std::cos(theta));
            cs[half + i] = static_cast<float>(std::sin(theta));
          }
        }
        rope_n_rot_ = p.n_rot;
        rope_base_ = p.freq_base;
        rope_run_ = run_count_;
      }
      pool_.parallel_for(rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* cs = rope_tables_.data() + r * half * 2;
          cpu::rope_inplace(out + r * cols, p.n_head, p.head_dim, p.n_rot, cs, cs + half,
                            p.mode == graph::RopeMode::adjacent);
        }
      });
      return;
    }
    case OpKind::attention: {
      attention(op, buf(op.inputs[0]), buf(op.inputs[1]), buf(op.inputs[2]), rows, cols, out,
                positions, seqs);
      return;
    }
    case OpKind::add_bias: {
      const TensorView& w = weights_[op.weight];
      small_weight_.resize(static_cast<size_t>(cols));
      cpu::get_row(w, 0, small_weight_.data());
      const float* x = buf(op.inputs[0]);
      for (int64_t r = 0; r < rows; ++r)
        cpu::add(x + r * cols, small_weight_.data(), out + r * cols, cols);
      return;
    }
    case OpKind::moe_route: {
      const float* logits = buf(op.inputs[0]);
      const graph::MoeParams& p = op.moe;
      const int32_t k = p.n_expert_used;
      std::vector<int32_t> ids(static_cast<size_t>(k));
      const int32_t* forced = nullptr;
      if (forced_ids_) {
        if (rows != forced_tokens_)
          throw Error(ErrorCategory::internal,
                      fmt::format("{}: forced routes for {} tokens, the op has {} rows", op.name,
                                  forced_tokens_, rows));
        int64_t r = 0;  // this op's number among the graph's moe_route ops
        for (const Op* o = g.ops.data(); o != &op; ++o) r += o->kind == OpKind::moe_route;
        forced = forced_ids_ + r * forced_tokens_ * k;
      }
      for (int64_t t = 0; t < rows; ++t) {
        float* o = out + t * cols;
        if (forced) {
          std::copy_n(forced + t * k, k, ids.data());
          cpu::moe_forced(logits + t * p.n_expert, p.n_expert, k, p.norm_weights, ids.data(),
                          o + k);
        } else {
          cpu::moe_topk(logits + t * p.n_expert, p.n_expert, k, p.norm_weights, ids.data(), o + k);
        }
        for (int32_t j = 0; j < k; ++j) o[j] = static_cast<float>(ids[static_cast<size_t>(j)]);
      }
      return;
    }
    case OpKind::moe_experts: {
      moe_experts(op.moe, buf(op.inputs[0]), buf(op.inputs[1]), rows, out);
      return;
    }
    case OpKind::head_slice: {
      const graph::SliceParams& p = op.slice;
      const float* x = buf(op.inputs[0]);
      const int64_t in_cols = g.values[static_cast<size_t>(op.inputs[0])].cols;
      const int64_t n_group = in_cols / p.group;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < n_group; ++j)
          std::memcpy(out + r * cols + j * p.len, x + r * in_cols + j * p.group + p.offset,
                      static_cast<size_t>(p.len) * sizeof(float));
      return;
    }
    case OpKind::sigmoid_mul: {
      const float* x = buf(op.inputs[0]);
      const float* gate = buf(op.inputs[1]);
      const bool per_row = g.values[static_cast<size_t>(op.inputs[1])].cols == 1 && cols != 1;
      pool_.parallel_for(rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t r0, int64_t r1) {
        float* row = per_row ? worker_scratch(static_cast<size_t>(cols)) : nullptr;
        for (int64_t r = r0; r < r1; ++r) {
          const float* gr = gate + r * cols;
          if (per_row) {  // the row's one gate broadcast over the columns
            std::fill_n(row, cols, gate[r]);
            gr = row;
          }
          cpu::sigmoid_gate(x + r * cols, gr, out + r * cols, cols);
        }
      });
      return;
    }
    case OpKind::ssm_conv: {
      ssm_conv(op, buf(op.inputs[0]), rows, cols, out, positions, seqs);
      return;
    }
    case OpKind::gated_delta: {
      gated_delta(op, buf(op.inputs[0]), buf(op.inputs[1]), buf(op.inputs[2]), rows, out, positions,
                  seqs);
      return;
    }
    case OpKind::rms_norm_gated: {
      const TensorView& w = weights_[op.weight];
      small_weight_.resize(static_cast<size_t>(w.ne[0]));
      cpu::get_row(w, 0, small_weight_.data());
      const float* x = buf(op.inputs[0]);
      const float* z = buf(op.inputs[1]);
      const int64_t len = op.norm_group;
      pool_.parallel_for(rows * (cols / len), std::max<int64_t>(1, 16384 / len),
                         [&](int64_t r0, int64_t r1) {
                           for (int64_t r = r0; r < r1; ++r)
                             cpu::rms_norm_gated(x + r * len, small_weight_.data(), z + r * len,
                                                 out + r * len, len, op.eps);
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

void CpuExecutor::attention(const Op& op, const float* q, const float* k, const float* v,
                            int64_t n_tok, int64_t cols, float* out,
                            std::span<const int32_t> positions, std::span<const int32_t> seqs) {
  const graph::AttentionParams& p = op.attn;
  const KvLayer& kl = kv_.layer(p.layer);
  float* kc = kv_.k.at(static_cast<size_t>(p.layer));
  float* vc = kv_.v.at(static_cast<size_t>(p.layer));
  const auto seq_of = [&](int64_t t) { return seqs.empty() ? 0 : seqs[static_cast<size_t>(t)]; };
  // Every token's K/V row first: a token reads rows of its sequence written in this step.
  for (int64_t t = 0; t < n_tok; ++t) {
    const int64_t row = kv_.row(seq_of(t), positions[static_cast<size_t>(t)]);
    std::memcpy(kc + row * kl.k_dim, k + t * kl.k_dim, static_cast<size_t>(kl.k_dim) * 4);
    std::memcpy(vc + row * kl.v_dim, v + t * kl.v_dim, static_cast<size_t>(kl.v_dim) * 4);
  }
  // Runs: maximal stretches of adjacent tokens of one sequence (consecutive positions).
  runs_.clear();
  for (int64_t t = 0; t < n_tok; ++t) {
    if (t > 0 && seq_of(t) == seq_of(t - 1)) {
      ++runs_.back().n;
      continue;
    }
    runs_.push_back(Run{t, 1, kv_.row(seq_of(t), 0)});
  }
  const int32_t group = p.n_head / p.n_head_kv;
  const int64_t hd = p.head_dim;
  // A query's result depends only on its vector, its position and its sequence's rows (every
  // cpu::attention_* call walks the cache in the same KV tiles with the same online softmax),
  // so how tokens are grouped into tasks never changes the bits.
  if (runs_.size() == static_cast<size_t>(n_tok)) {
    // Decode (one token per sequence): tasks of (token, KV head, block of its query heads); a
    // block reads each K/V row once. Short contexts use blocks of one query (more tasks than KV
    // heads, the K/V rows come from cache); long ones blocks of 4, so K/V stream from memory at
    // most group/4 times.
    int64_t max_kv = 0;
    for (int64_t t = 0; t < n_tok; ++t)
      max_kv = std::max<int64_t>(max_kv, positions[static_cast<size_t>(t)] + 1);
    const int64_t qb = max_kv <= 512 ? 1 : 4;
    const int64_t per_head = (group + qb - 1) / qb;
    const int64_t per_tok = p.n_head_kv * per_head;
    pool_.parallel_for(n_tok * per_tok, 1, [&](int64_t i0, int64_t i1) {
      float* scratch = worker_scratch(static_cast<size_t>(kv_.n_ctx));
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / per_tok, r = i % per_tok;
        const int64_t hk = r / per_head, j0 = (r % per_head) * qb;
        const int64_t nq = std::min<int64_t>(qb, group - j0);
        const int64_t h = hk * group + j0;
        const int64_t n_kv = positions[static_cast<size_t>(t)] + 1;
        const int64_t base = runs_[static_cast<size_t>(t)].base;
        cpu::attention_group(q + t * cols + h * hd, hd, nq, n_kv, kc + base * kl.k_dim + hk * hd,
                             kl.k_dim, vc + base * kl.v_dim + hk * hd, kl.v_dim, p.head_dim,
                             p.scale, out + t * cols + h * hd, hd, scratch);
      }
    });
    return;
  }
  // Prefill: tasks of (run, query head, block of the run's consecutive tokens), each a causal
  // tile that walks the sequence's cache in KV tiles with an online softmax (no score matrix).
  constexpr int64_t kQueryBlock = 32;
  task_first_.clear();
  int64_t n_tasks = 0;
  for (const Run& r : runs_) {
    task_first_.push_back(n_tasks);
    n_tasks += p.n_head * ((r.n + kQueryBlock - 1) / kQueryBlock);
  }
  task_first_.push_back(n_tasks);
  pool_.parallel_for(n_tasks, 1, [&](int64_t i0, int64_t i1) {
    float* scratch = worker_scratch(static_cast<size_t>(kv_.n_ctx));
    size_t ri = static_cast<size_t>(std::upper_bound(task_first_.begin(), task_first_.end(), i0) -
                                    task_first_.begin() - 1);
    for (int64_t i = i0; i < i1; ++i) {
      while (i >= task_first_[ri + 1]) ++ri;
      const Run& r = runs_[ri];
      const int64_t li = i - task_first_[ri];
      const int64_t h = li % p.n_head;
      const int64_t t0 = r.t0 + (li / p.n_head) * kQueryBlock;
      const int64_t nq = std::min(kQueryBlock, r.t0 + r.n - t0);
      const int64_t hk = h / group;
      cpu::attention_causal_tile(
          q + t0 * cols + h * hd, cols, nq, positions[static_cast<size_t>(t0)],
          kc + r.base * kl.k_dim + hk * hd, kl.k_dim, vc + r.base * kl.v_dim + hk * hd, kl.v_dim,
          p.head_dim, p.scale, out + t0 * cols + h * hd, cols, scratch);
    }
  });
}

void CpuExecutor::seq_runs(int64_t n_tok, std::span<const int32_t> seqs) {
  const auto seq_of = [&](int64_t t) { return seqs.empty() ? 0 : seqs[static_cast<size_t>(t)]; };
  runs_.clear();
  for (int64_t t = 0; t < n_tok; ++t) {
    if (t > 0 && seq_of(t) == seq_of(t - 1)) {
      ++runs_.back().n;
      continue;
    }
    runs_.push_back(Run{t, 1, seq_of(t)});
  }
}

void CpuExecutor::ssm_conv(const Op& op, const float* x, int64_t n_tok, int64_t cols, float* out,
                           std::span<const int32_t> positions, std::span<const int32_t> seqs) {
  const int32_t l = op.ssm.layer;
  const TensorView& w = weights_[op.weight];
  const auto kernel = static_cast<int32_t>(w.ne[0]);
  const KvLayer& kl = kv_.layer(l);
  if (kl.conv_dim != (kernel - 1) * cols || !kv_.conv.at(static_cast<size_t>(l)))
    throw Error(ErrorCategory::internal,
                fmt::format("{}: layer {} keeps {} floats of conv state per sequence, the op "
                            "needs {} ({} channels, kernel {})",
                            op.name, l, kl.conv_dim, (kernel - 1) * cols, cols, kernel));
  seq_runs(n_tok, seqs);
  // A sequence starts from zero at its position 0 (only a run's first token can be at 0).
  for (const Run& r : runs_)
    if (positions[static_cast<size_t>(r.t0)] == 0)
      std::fill_n(kv_.conv_state(l, static_cast<int32_t>(r.base)), kl.conv_dim, 0.0f);
  const auto* wp = static_cast<const float*>(w.data);
  // Channel blocks in parallel; each walks the runs in ubatch order (a sequence's runs in order).
  constexpr int64_t kBlock = 64;
  pool_.parallel_for((cols + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    const int64_t c0 = b0 * kBlock, c1 = std::min(cols, b1 * kBlock);
    for (const Run& r : runs_)
      cpu::conv1d_causal(x + r.t0 * cols, cols, out + r.t0 * cols, cols, r.n, wp, kernel,
                         kv_.conv_state(l, static_cast<int32_t>(r.base)), cols, c0, c1, true);
  });
}

void CpuExecutor::gated_delta(const Op& op, const float* y, const float* alpha, const float* b,
                              int64_t n_tok, float* out, std::span<const int32_t> positions,
                              std::span<const int32_t> seqs) {
  const graph::SsmParams& p = op.ssm;
  const int32_t l = p.layer;
  const KvLayer& kl = kv_.layer(l);
  const int64_t hk = p.n_k_head, hv = p.n_v_head, dk = p.d_k, dv = p.d_v;
  if (kl.ssm_dim != hv * dk * dv || !kv_.ssm.at(static_cast<size_t>(l)))
    throw Error(ErrorCategory::internal,
                fmt::format("{}: layer {} keeps {} floats of delta-rule state per sequence, the "
                            "op needs {} ({} V heads of {} x {})",
                            op.name, l, kl.ssm_dim, hv * dk * dv, hv, dk, dv));
  const int64_t y_cols = 2 * hk * dk + hv * dv, qk_cols = 2 * hk * dk, out_cols = hv * dv;
  seq_runs(n_tok, seqs);
  for (const Run& r : runs_)
    if (positions[static_cast<size_t>(r.t0)] == 0)
      std::fill_n(kv_.ssm_state(l, static_cast<int32_t>(r.base)), kl.ssm_dim, 0.0f);
  // Per token: the L2-normalised q and k heads and the gates.
  gdn_qk_.resize(static_cast<size_t>(n_tok * qk_cols));
  gdn_g_.resize(static_cast<size_t>(n_tok * hv));
  gdn_beta_.resize(gdn_g_.size());
  const auto* ssm_a = static_cast<const float*>(weights_[op.weight].data);
  const auto* dt_bias = static_cast<const float*>(weights_[p.dt_bias].data);
  pool_.parallel_for(n_tok, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < 2 * hk; ++j)
        cpu::l2_norm(y + t * y_cols + j * dk, gdn_qk_.data() + t * qk_cols + j * dk, dk, p.eps);
      cpu::gdn_gates(alpha + t * hv, b + t * hv, dt_bias, ssm_a, gdn_g_.data() + t * hv,
                     gdn_beta_.data() + t * hv, hv);
    }
  });
  // Tasks of (V head, block of state columns); each walks the runs in ubatch order. A column's
  // bits depend only on the column (cpu::gated_delta_rule), so the split never changes them.
  const int64_t col_block = std::min<int64_t>(dv, 32);
  const int64_t per_head = (dv + col_block - 1) / col_block;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  const float* qk = gdn_qk_.data();
  pool_.parallel_for(hv * per_head, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / per_head, j = h % hk;  // V head h reads K head h mod H_k
      const auto c0 = static_cast<int32_t>((i % per_head) * col_block);
      const auto c1 = static_cast<int32_t>(std::min<int64_t>(dv, c0 + col_block));
      for (const Run& r : runs_)
        cpu::gated_delta_rule(qk + r.t0 * qk_cols + j * dk, qk_cols,
                              qk + r.t0 * qk_cols + hk * dk + j * dk, qk_cols,
                              y + r.t0 * y_cols + qk_cols + h * dv, y_cols,
                              gdn_g_.data() + r.t0 * hv + h, gdn_beta_.data() + r.t0 * hv + h, hv,
                              r.n, static_cast<int32_t>(dk), static_cast<int32_t>(dv), scale,
                              kv_.ssm_state(l, static_cast<int32_t>(r.base)) + h * dk * dv,
                              out + r.t0 * out_cols + h * dv, out_cols, c0, c1);
    }
  });
}

namespace {

// Columns [c0, c1) of out[t] for tokens [t0, t1): the sum over t's slots j (in slot order) that
// the op computes (its slot range, an expert it computes) of weight[t, j] * y[t * k + j], from
// zero. One out-of-line function for both of moe_experts' combines, so they round alike.
[[gnu::noinline]] void moe_combine_rows(const float* route, int32_t k, const graph::MoeParams& p,
                                        const uint8_t* computes, const float* y_all, int64_t n_embd,
                                        int64_t t0, int64_t t1, int64_t c0, int64_t c1,
                                        float* out) {
  for (int64_t t = t0; t < t1; ++t) {
    float* o = out + t * n_embd;
    std::fill(o + c0, o + c1, 0.0f);
    for (int32_t j = 0; j < k; ++j) {
      const auto e = static_cast<int32_t>(route[t * 2 * k + j]);
      if (!computes[e] || !p.has_slot(j)) continue;
      const float w = route[t * 2 * k + k + j];
      const float* y = y_all + (t * k + j) * n_embd;
      for (int64_t c = c0; c < c1; ++c) o[c] += w * y[c];
    }
  }
}

}  // namespace

void CpuExecutor::moe_experts(const graph::MoeParams& p, const float* h, const float* route,
                              int64_t n_tok, float* out) {
  using clock = std::chrono::steady_clock;
  const auto t_entry = clock::now();
  const auto secs = [](clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  const TensorView& wg = weights_[p.gate];
  const TensorView& wu = weights_[p.up];
  const TensorView& wd = weights_[p.down];
  const int64_t n_embd = wg.ne[0], n_ff = wg.ne[1];
  const int32_t k = p.n_expert_used;
  const int64_t n_slots = n_tok * k;

  // Which experts this op computes: fixed by the graph, or by the layer's slot table (its host
  // mirror as of this step).
  moe_mask_.assign(static_cast<size_t>(p.n_expert), 0);
  const ExpertTable* xt = nullptr;
  if (p.static_experts()) {
    for (int32_t e = 0; e < p.n_expert; ++e) moe_mask_[static_cast<size_t>(e)] = p.has_expert(e);
  } else {
    const auto gi = static_cast<size_t>(p.gate);
    if (gi >= expert_tables_.size() || !expert_tables_[gi].table ||
        expert_tables_[gi].n_expert != p.n_expert)
      throw Error(ErrorCategory::internal,
                  fmt::format("moe_experts over the {} experts of '{}': no expert slot table of "
                              "{} experts is bound to that layer",
                              graph::expert_set_name(p.set), wg.name, p.n_expert));
    xt = &expert_tables_[gi];
    const bool want = p.set == graph::ExpertSet::resident;
    for (int32_t e = 0; e < p.n_expert; ++e)
      moe_mask_[static_cast<size_t>(e)] = (xt->table[e] >= 0) == want;
  }
  const uint8_t* computes = moe_mask_.data();
  // Group the (token, slot) pairs by expert: expert e's slots are slot_list[first[e]..first[e+1]),
  // in token order. Pairs whose expert this op does not compute are left out.
  moe_first_.assign(static_cast<size_t>(p.n_expert) + 1, 0);
  for (int64_t t = 0; t < n_tok; ++t)
    for (int32_t j = 0; j < k; ++j) {
      const float idf = route[t * 2 * k + j];
      const auto e = static_cast<int32_t>(idf);
      if (!(idf >= 0.0f) || e >= p.n_expert || static_cast<float>(e) != idf)
        throw Error(ErrorCategory::internal, fmt::format("moe route holds expert id {}", idf));
      if (computes[e] && p.has_slot(j)) ++moe_first_[static_cast<size_t>(e) + 1];
    }
  if (xt && p.set == graph::ExpertSet::not_resident) {
    // The routing the residency policy learns from (past steps only: it is read between steps).
    for (int64_t t = 0; t < n_tok; ++t) {
      for (int32_t j = 0; j < k; ++j) {
        const auto e = static_cast<int32_t>(route[t * 2 * k + j]);
        if (xt->route_log) xt->route_log->push_back(static_cast<uint16_t>(e));
        if (!p.has_slot(j)) continue;
        if (xt->calls) ++*xt->calls;
        if (xt->device_calls && xt->table[e] >= 0) ++*xt->device_calls;
      }
    }
  }
  for (int32_t e = 0; e < p.n_expert; ++e) moe_first_[e + 1] += moe_first_[e];
  const int64_t n_pairs = moe_first_[static_cast<size_t>(p.n_expert)];
  {
    int64_t distinct = 0;
    for (int32_t e = 0; e < p.n_expert; ++e)
      distinct += moe_first_[static_cast<size_t>(e) + 1] > moe_first_[static_cast<size_t>(e)];
    const int64_t expert_bytes = static_cast<int64_t>(
        wg.row_bytes() * n_ff + wu.row_bytes() * n_ff + wd.row_bytes() * n_embd);
    ++moe_reads_.calls;
    moe_reads_.experts += distinct;
    moe_reads_.pairs += n_pairs;
    moe_reads_.bytes += distinct * expert_bytes;
  }
  moe_slots_.resize(static_cast<size_t>(n_pairs));
  {
    std::vector<int64_t>& fill = moe_fill_;  // kept between calls: no allocation per layer
    fill.assign(moe_first_.begin(), moe_first_.end() - 1);
    for (int64_t t = 0; t < n_tok; ++t)
      for (int32_t j = 0; j < k; ++j) {
        const auto e = static_cast<int32_t>(route[t * 2 * k + j]);
        if (computes[e] && p.has_slot(j)) moe_slots_[static_cast<size_t>(fill[e]++)] = t * k + j;
      }
  }

  // Activations of every routed pair, gathered by expert and quantized once per weight format.
  const size_t arb_g = cpu::activation_row_bytes(wg.type, n_embd);
  const size_t arb_u = cpu::activation_row_bytes(wu.type, n_embd);
  const bool same_act = cpu::activation_type(wg.type) == cpu::activation_type(wu.type);
  const size_t arb_d = cpu::activation_row_bytes(wd.type, n_ff);
  auto grow = [](std::vector<uint8_t>& v, size_t n) {
    if (v.size() < n) v.resize(n);
  };
  grow(act_, arb_g * static_cast<size_t>(n_pairs));
  if (!same_act) grow(moe_act_u_, arb_u * static_cast<size_t>(n_pairs));
  grow(moe_act_d_, arb_d * static_cast<size_t>(n_pairs));
  if (moe_gate_.size() < static_cast<size_t>(n_pairs * n_ff)) {
    moe_gate_.resize(static_cast<size_t>(n_pairs * n_ff));
    moe_up_.resize(static_cast<size_t>(n_pairs * n_ff));
  }
  if (moe_y_.size() < static_cast<size_t>(n_slots * n_embd))
    moe_y_.resize(static_cast<size_t>(n_slots * n_embd));
  // Each token's activations are quantized once, then copied to its pairs' places in expert
  // order (quantization is deterministic per row: the same bytes as quantizing each pair). A
  // single token (decode) skips the copies: its pairs are one per expert (top-k ids are
  // distinct), and every expert reads the token's row (act_row0 below). Small row counts run on
  // the calling thread: a parallel region would cost more than the work.
  const int64_t row_grain_in = std::max<int64_t>(1, 32768 / n_embd);
  const bool one_token = n_tok == 1;
  grow(moe_act_tok_, (arb_g + (same_act ? 0 : arb_u)) * static_cast<size_t>(n_tok));
  uint8_t* tok_g = moe_act_tok_.data();
  uint8_t* tok_u = same_act ? tok_g : tok_g + arb_g * static_cast<size_t>(n_tok);
  pool_.parallel_for(n_tok, row_grain_in, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* x = h + t * n_embd;
      cpu::quantize_activation(wg.type, x, tok_g + static_cast<size_t>(t) * arb_g, n_embd);
      if (!same_act)
        cpu::quantize_activation(wu.type, x, tok_u + static_cast<size_t>(t) * arb_u, n_embd);
    }
  });
  uint8_t* act_g = one_token ? tok_g : act_.data();
  uint8_t* act_u = one_token ? tok_u : same_act ? act_g : moe_act_u_.data();
  if (!one_token)
    pool_.parallel_for(n_pairs, 4 * row_grain_in, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const auto t = static_cast<size_t>(moe_slots_[static_cast<size_t>(i)] / k);
        std::memcpy(act_g + static_cast<size_t>(i) * arb_g, tok_g + t * arb_g, arb_g);
        if (!same_act)
          std::memcpy(act_u + static_cast<size_t>(i) * arb_u, tok_u + t * arb_u, arb_u);
      }
    });
  // First activation row of an expert whose pairs start at `first` in expert order.
  const auto act_row0 = [&](int64_t first) { return one_token ? 0 : first; };

  // Tasks of (expert, block of output rows): each applies one block of the expert's weights to
  // all of the expert's tokens (grouped GEMM), so every weight byte is read once per step.
  using Task = MoeTask;
  const int64_t n_threads = pool_.n_threads();
  // The experts this op computes, and where their weights are: the stacked tensors, or (a layer
  // with an expert source: the disk tier) what the source gives, in groups of at most its
  // capacity, one parallel region each.
  moe_active_.clear();
  moe_tok_count_.clear();
  for (int32_t e = 0; e < p.n_expert; ++e)
    if (moe_first_[e + 1] > moe_first_[e]) {
      moe_active_.push_back(e);
      moe_tok_count_.push_back(moe_first_[e + 1] - moe_first_[e]);
    }
  ExpertSource* src = static_cast<size_t>(p.gate) < expert_sources_.size()
                          ? expert_sources_[static_cast<size_t>(p.gate)]
                          : nullptr;
  moe_wptr_.resize(static_cast<size_t>(p.n_expert));
  if (src) {
    src->will_need(moe_active_, moe_tok_count_, h, n_tok);
  } else {
    for (int32_t e : moe_active_)
      moe_wptr_[static_cast<size_t>(e)] = {wg.row(int64_t{e} * n_ff), wu.row(int64_t{e} * n_ff),
                                           wd.row(int64_t{e} * n_embd)};
  }
  const size_t rb_g = wg.row_bytes(), rb_u = wu.row_bytes(), rb_d = wd.row_bytes();
  // A source holding fewer experts than the op needs: groups of half its capacity, so that the
  // next group's reads run while one computes (the source reads ahead in acquire()).
  const size_t src_cap = src ? static_cast<size_t>(std::max(1, src->capacity())) : 0;
  const size_t group_cap = !src                            ? std::max<size_t>(1, moe_active_.size())
                           : moe_active_.size() <= src_cap ? src_cap
                                                           : std::max<size_t>(1, src_cap / 2);
  const size_t n_groups = std::max<size_t>(1, (moe_active_.size() + group_cap - 1) / group_cap);
  std::span<const int32_t> group;  // the experts of the current region
  int32_t n_active = 0;
  // Fills `tasks` (kept between calls: no allocation per layer); returns the row block size.
  auto make_tasks = [&](int64_t n_rows, std::vector<Task>& tasks) {
    tasks.clear();
    // About 4 tasks per thread over all active experts, in whole row tiles.
    // (8 per thread measured the same on the H200's Xeon host: 241-248 us per decode call of
    // synthetic qwen3-30b-a3b, 16 threads, against 243-247 with 4; 2 gave 273.)
    const int64_t want =
        std::max<int64_t>(1, (n_threads * 4 + n_active - 1) / std::max<int64_t>(1, n_active));
    int64_t grain = (n_rows + want - 1) / want;
    grain = (grain + cpu::kGemmRowTile - 1) / cpu::kGemmRowTile * cpu::kGemmRowTile;
    for (int32_t e : group)
      for (int64_t r = 0; r < n_rows; r += grain)
        tasks.push_back({e, r, std::min(n_rows, r + grain)});
    return grain;
  };

  // One parallel region for the whole expert FFN. Tasks are claimed in order from one counter:
  // first every (expert, row block) of gate+up, then every (expert, row block) of down. The
  // thread that finishes an expert's last gate/up block applies SwiGLU to that expert's rows,
  // quantizes them for down and marks the expert ready; a down block waits (spins) for its
  // expert. A down block is claimed only after all gate/up blocks are claimed, and claimed
  // blocks run at once, so the wait always ends; experts overlap (one's down with another's
  // gate/up) and the layer costs one barrier instead of two or more.
  //
  // When the down blocks split n_embd into several row blocks (few active experts: decode), the
  // combine runs inside the region too: the thread that finishes the last expert's down block of
  // a row block combines those rows for every token, so no thread reads all the experts' outputs
  // (written by other cores) alone after the region. Otherwise the combine is a parallel loop
  // over tokens after it. Either way each output is the same sum in slot order.
  const std::vector<Task>& t_up = moe_tasks_up_;
  const std::vector<Task>& t_down = moe_tasks_down_;
  uint8_t* act_d = moe_act_d_.data();
  if (moe_n_flags_ < p.n_expert) {  // kept between calls: no allocation per layer
    moe_up_left_ = std::make_unique<std::atomic<int32_t>[]>(static_cast<size_t>(p.n_expert));
    moe_ready_ = std::make_unique<std::atomic<int32_t>[]>(static_cast<size_t>(p.n_expert));
    moe_n_flags_ = p.n_expert;
  }
  std::atomic<int32_t>* up_left = moe_up_left_.get();
  std::atomic<int32_t>* ready = moe_ready_.get();
  const auto combine = [&](int64_t t0, int64_t t1, int64_t c0, int64_t c1) {
    moe_combine_rows(route, k, p, computes, moe_y_.data(), n_embd, t0, t1, c0, c1, out);
  };
  // A source's experts of the current group are released however the region ends.
  struct Release {
    ExpertSource* src = nullptr;
    ~Release() {
      if (src) src->release();
    }
  };
  bool combine_in_region = false;
  const auto t_region = clock::now();
  moe_spans_.assign(static_cast<size_t>(n_threads), ThreadSpan{});
  for (size_t gi = 0; gi < n_groups; ++gi) {
    const size_t g0 = std::min(moe_active_.size(), gi * group_cap);
    group = std::span<const int32_t>(moe_active_)
                .subspan(g0, std::min(group_cap, moe_active_.size() - g0));
    n_active = static_cast<int32_t>(group.size());
    Release rel;
    if (src && !group.empty()) {
      moe_wgroup_.resize(group.size());
      src->acquire(group, moe_wgroup_);
      rel.src = src;
      // acquire() wrote the group's pointers in group order: move them to their experts.
      for (size_t i = 0; i < group.size(); ++i)
        moe_wptr_[static_cast<size_t>(group[i])] = moe_wgroup_[i];
    }
    const int64_t up_grain = make_tasks(n_ff, moe_tasks_up_);
    const int64_t down_grain = make_tasks(n_embd, moe_tasks_down_);
    const int64_t n_blocks = (n_embd + down_grain - 1) / down_grain;
    combine_in_region = n_groups == 1 && n_active > 0 && n_blocks >= 2;
    if (combine_in_region && moe_n_blocks_ < n_blocks) {
      moe_block_left_ = std::make_unique<std::atomic<int32_t>[]>(static_cast<size_t>(n_blocks));
      moe_n_blocks_ = n_blocks;
    }
    std::atomic<int32_t>* block_left = moe_block_left_.get();
    if (combine_in_region)
      for (int64_t bl = 0; bl < n_blocks; ++bl)
        block_left[bl].store(n_active, std::memory_order_relaxed);
    // Only the active experts' flags are read (by their tasks): the others are left as they are.
    const auto up_per_expert = static_cast<int32_t>((n_ff + up_grain - 1) / up_grain);
    for (int32_t e : group) {
      up_left[static_cast<size_t>(e)].store(up_per_expert, std::memory_order_relaxed);
      ready[static_cast<size_t>(e)].store(0, std::memory_order_relaxed);
    }
    const int64_t n_up = static_cast<int64_t>(t_up.size());
    const int64_t n_tasks = n_up + static_cast<int64_t>(t_down.size());
    std::atomic<int64_t> next{0};
    auto run_up = [&](const Task& tk) {
      const int64_t first = moe_first_[tk.e], n = moe_first_[tk.e + 1] - first;
      const std::array<const uint8_t*, 3>& w = moe_wptr_[static_cast<size_t>(tk.e)];
      const auto a0 = static_cast<size_t>(act_row0(first));
      cpu::gemm_rows(wg.type, w[0] + static_cast<size_t>(tk.r0) * rb_g, tk.r1 - tk.r0,
                     act_g + a0 * arb_g, arb_g, n, n_embd, moe_gate_.data() + first * n_ff + tk.r0,
                     n_ff);
      cpu::gemm_rows(wu.type, w[1] + static_cast<size_t>(tk.r0) * rb_u, tk.r1 - tk.r0,
                     act_u + a0 * arb_u, arb_u, n, n_embd, moe_up_.data() + first * n_ff + tk.r0,
                     n_ff);
      if (up_left[static_cast<size_t>(tk.e)].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        for (int64_t i = first; i < first + n; ++i) {
          float* g = moe_gate_.data() + i * n_ff;
          cpu::swiglu(g, moe_up_.data() + i * n_ff, g, n_ff);
          cpu::quantize_activation(wd.type, g, act_d + static_cast<size_t>(i) * arb_d, n_ff);
        }
        ready[static_cast<size_t>(tk.e)].store(1, std::memory_order_release);
      }
    };
    // Down: expert outputs land in y[token * k + slot] (gathered rows, scattered by a row map).
    auto run_down = [&](const Task& tk, double& waited) {
      if (ready[static_cast<size_t>(tk.e)].load(std::memory_order_acquire) == 0) {
        const auto w0 = clock::now();
        for (int spins = 0; ready[static_cast<size_t>(tk.e)].load(std::memory_order_acquire) == 0;
             ++spins) {
          if (spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
          } else {
            std::this_thread::yield();
          }
        }
        waited += secs(w0, clock::now());
      }
      const int64_t first = moe_first_[tk.e], n = moe_first_[tk.e + 1] - first;
      float* tmp = worker_scratch(static_cast<size_t>(n * (tk.r1 - tk.r0)));
      cpu::gemm_rows(wd.type,
                     moe_wptr_[static_cast<size_t>(tk.e)][2] + static_cast<size_t>(tk.r0) * rb_d,
                     tk.r1 - tk.r0, act_d + static_cast<size_t>(first) * arb_d, arb_d, n, n_ff, tmp,
                     tk.r1 - tk.r0);
      for (int64_t s = 0; s < n; ++s)
        std::memcpy(moe_y_.data() + moe_slots_[static_cast<size_t>(first + s)] * n_embd + tk.r0,
                    tmp + s * (tk.r1 - tk.r0), static_cast<size_t>(tk.r1 - tk.r0) * sizeof(float));
      if (combine_in_region &&
          block_left[tk.r0 / down_grain].fetch_sub(1, std::memory_order_acq_rel) == 1)
        combine(0, n_tok, tk.r0, tk.r1);
    };
    const auto t_group = clock::now();
    const double t_off = secs(t_region, t_group);
    pool_.parallel_for(std::min<int64_t>(n_threads, n_tasks), 1, [&](int64_t, int64_t) {
      ThreadSpan& span = moe_spans_[static_cast<size_t>(ThreadPool::worker_index())];
      bool took = false;
      double waited = 0;
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_tasks;) {
        if (!took && span.first < 0) span.first = t_off + secs(t_group, clock::now());
        took = true;
        if (i < n_up)
          run_up(t_up[static_cast<size_t>(i)]);
        else
          run_down(t_down[static_cast<size_t>(i - n_up)], waited);
      }
      if (took) span.last = t_off + secs(t_group, clock::now());
      span.wait += waited;
    });
  }
  const auto t_region_end = clock::now();
  // Combine per token in slot order (fixed, so threads and ubatches never change the bits).
  if (!combine_in_region)
    pool_.parallel_for(n_tok, row_grain_in,
                       [&](int64_t t0, int64_t t1) { combine(t0, t1, 0, n_embd); });
  const auto t_exit = clock::now();
  MoeTiming& mt = moe_timing_;
  const double whole = secs(t_region, t_region_end);
  ++mt.calls;
  mt.combined_in_region += combine_in_region;
  mt.total += secs(t_entry, t_exit);
  mt.before += secs(t_entry, t_region);
  mt.region += whole;  // the groups' regions and the reads between them
  mt.after += secs(t_region_end, t_exit);
  for (const ThreadSpan& sp : moe_spans_) {
    if (sp.first < 0) continue;
    ++mt.thread_calls;
    mt.join += sp.first;
    mt.wait += sp.wait;
    mt.tail += std::max(0.0, whole - sp.last);
  }
}

void CpuExecutor::matmul_group(const graph::Graph& g, std::span<const Op> ops) {
  const float* x = buf(ops[0].inputs[0]);
  const int64_t n_tok = g.values[static_cast<size_t>(ops[0].inputs[0])].rows;
  const int64_t n_in = weights_[ops[0].weight].ne[0];
  // Activations quantized once per partner format (usually one for the whole group).
  struct Act {
    GgmlType type;
    size_t offset, row_bytes;
  };
  std::vector<Act> acts;
  std::vector<size_t> act_of(ops.size());
  size_t total = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const GgmlType at = cpu::activation_type(weights_[ops[i].weight].type);
    size_t j = 0;
    while (j < acts.size() && acts[j].type != at) ++j;
    if (j == acts.size()) {
      const size_t arb = cpu::activation_row_bytes(weights_[ops[i].weight].type, n_in);
      acts.push_back({at, total, arb});
      total += arb * static_cast<size_t>(n_tok);
    }
    act_of[i] = j;
  }
  if (act_.size() < total) act_.resize(total);
  for (size_t j = 0; j < acts.size(); ++j) {
    // Any weight type with this partner format quantizes the same way.
    GgmlType wt = GgmlType::F32;
    for (size_t i = 0; i < ops.size(); ++i)
      if (act_of[i] == j) wt = weights_[ops[i].weight].type;
    const Act& a = acts[j];
    uint8_t* dst = act_.data() + a.offset;
    pool_.parallel_for(n_tok, std::max<int64_t>(1, 16384 / n_in), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        cpu::quantize_activation(wt, x + t * n_in, dst + static_cast<size_t>(t) * a.row_bytes,
                                 n_in);
    });
  }
  // Row blocks of every weight, about 4 per thread over the group, in whole row tiles.
  int64_t rows_total = 0;
  for (const Op& op : ops) rows_total += weights_[op.weight].n_rows();
  const int64_t n_threads = pool_.n_threads();
  int64_t grain = (rows_total + n_threads * 4 - 1) / (n_threads * 4);
  grain = std::max<int64_t>(
      cpu::kGemmRowTile, (grain + cpu::kGemmRowTile - 1) / cpu::kGemmRowTile * cpu::kGemmRowTile);
  struct Task {
    uint32_t op;
    int64_t r0, r1;
  };
  std::vector<Task> tasks;
  for (size_t i = 0; i < ops.size(); ++i) {
    const int64_t n_out = weights_[ops[i].weight].n_rows();
    for (int64_t r = 0; r < n_out; r += grain)
      tasks.push_back({static_cast<uint32_t>(i), r, std::min(n_out, r + grain)});
  }
  pool_.parallel_for(static_cast<int64_t>(tasks.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Task& tk = tasks[static_cast<size_t>(i)];
      const Op& op = ops[tk.op];
      const TensorView& w = weights_[op.weight];
      const Act& a = acts[act_of[tk.op]];
      const int64_t n_out = w.n_rows();
      cpu::gemm_rows(w.type, w.row(tk.r0), tk.r1 - tk.r0, act_.data() + a.offset, a.row_bytes,
                     n_tok, n_in, buf(op.output) + tk.r0, n_out);
    }
  });
}

}  // namespace berth
