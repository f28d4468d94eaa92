#include "berth/runtime/session.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "berth/core/error.h"
#include "berth/core/log.h"

namespace berth {

int64_t default_n_ctx(const Hparams& hp) { return std::min<int64_t>(4096, hp.n_ctx_train); }

namespace {
int resolve_threads(int32_t n) { return n > 0 ? n : physical_core_count(); }
int64_t resolve_ctx(int64_t n, const Hparams& hp) { return n > 0 ? n : default_n_ctx(hp); }
}  // namespace

Session::Session(const Model& model, SessionParams params)
    : model_(model),
      params_(params),
      pool_(std::make_unique<ThreadPool>(resolve_threads(params.n_threads))),
      kv_(model.kv_layers(), resolve_ctx(params.n_ctx, model.hparams()), params.n_seq,
          params.n_state_spare) {
  if (params_.n_ubatch < 1)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("the ubatch size must be at least 1, got {}", params_.n_ubatch));
  // With a disk tier the model does not fit in RAM: the CPU-held weights that stay in RAM are
  // read in with large O_DIRECT reads instead of page faults (residency/direct_load.h).
  if (!params_.disk.layers.empty() && params_.disk.direct_load && params_.disk.file_bytes) {
    const graph::WeightTable& w = model.weights();
    // Not the token embedding: a step reads only its tokens' rows of it.
    std::vector<bool> load(w.size(), true);
    for (size_t i = 0; i < w.size(); ++i)
      if (w.roles[i] == graph::WeightRole::embedding) load[i] = false;
    for (const DiskTierLayer& l : params_.disk.layers)
      for (graph::WeightId id : l.weights)
        if (id >= 0 && static_cast<size_t>(id) < load.size()) load[static_cast<size_t>(id)] = false;
    if (params_.device && params_.weight_home.size() == w.size())
      for (size_t i = 0; i < w.size(); ++i)
        if (params_.weight_home[i] != placement::Home::cpu) load[i] = false;
    direct_ =
        std::make_unique<DirectWeights>(w, load,
                                        DirectLoadOptions{.path = params_.disk.path,
                                                          .file_bytes = params_.disk.file_bytes,
                                                          .file_size = params_.disk.file_size,
                                                          .reader = params_.disk.reader});
    if (direct_->n_tensors() > 0)
      log::info("read {} CPU-held tensors ({:.1f} MiB) with {} reads in {:.2f} s ({:.2f} GB/s)",
                direct_->n_tensors(), static_cast<double>(direct_->bytes_read()) / (1 << 20),
                io::backend_name(direct_->backend()), direct_->seconds(),
                direct_->seconds() > 0
                    ? static_cast<double>(direct_->bytes_read()) / direct_->seconds() / 1e9
                    : 0.0);
  }
  const graph::WeightTable& weights = direct_ ? direct_->weights() : model.weights();
  if (params_.device) {
    const HybridOptions& h = params_.hybrid;
    residency_ = std::make_unique<Residency>(
        *params_.device, weights, params_.weight_home,
        ResidencyOptions{.pin_host_experts = h.stream_experts_min_tokens > 0 ||
                                             h.host_expert_share > 0 ||
                                             h.expert_slots.slots_per_layer > 0,
                         .copy_host_experts = h.copy_host_experts,
                         .progress = h.progress,
                         .unified = params_.unified});
    if (h.expert_slots.slots_per_layer > 0)
      residency_->enable_expert_slots(model.build_step(1, 1), h.expert_slots);
    kv_.allocate_device(*params_.device, params_.kv_home);
  }
  scheduler_ = std::make_unique<Scheduler>(*pool_, weights, kv_.view(), residency_.get(),
                                           params_.kv_home, params_.hybrid);
  if (!params_.disk.layers.empty()) {
    disk_ = std::make_unique<DiskTier>(weights, params_.disk);
    disk_->bind(scheduler_->cpu());
  }
}

const graph::Graph& Session::graph_for(int32_t n_tokens, int32_t n_outputs, int32_t n_decode) {
  for (const CachedGraph& c : graphs_)
    if (c.n_tokens == n_tokens && c.n_outputs == n_outputs && c.n_decode == n_decode) return c.g;
  // Keep a handful of shapes: decode (1,1) and the full-ubatch prefill shape recur.
  if (graphs_.size() >= 8) graphs_.erase(graphs_.begin() + 2);
  graphs_.push_back(
      CachedGraph{n_tokens, n_outputs, n_decode, model_.build_step(n_tokens, n_outputs)});
  graphs_.back().g.n_decode = n_decode;
  graphs_.back().g.batch_invariant = params_.n_seq > 1;
  return graphs_.back().g;
}

std::span<const float> Session::eval(std::span<const int32_t> tokens, bool all_logits) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n == 0) throw Error(ErrorCategory::invalid_argument, "eval: no tokens");
  if (n_past_ + n > kv_.n_ctx())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("{} tokens after {} already in the context exceed the context size of "
                            "{} (raise -c)",
                            n, n_past_, kv_.n_ctx()));
  const int64_t n_vocab = model_.hparams().n_vocab;
  for (int32_t id : tokens)
    if (id < 0 || id >= n_vocab)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("token id {} is outside the vocabulary of {} tokens", id, n_vocab));
  logits_.resize(static_cast<size_t>((all_logits ? n : 1) * n_vocab));
  const int64_t start = n_past_;
  for (int64_t done = 0; done < n;) {
    const int32_t nt = static_cast<int32_t>(std::min<int64_t>(params_.n_ubatch, n - done));
    const bool last = done + nt == n;
    const int32_t n_out = all_logits ? nt : (last ? 1 : 0);
    positions_.resize(static_cast<size_t>(nt));
    for (int32_t i = 0; i < nt; ++i)
      positions_[static_cast<size_t>(i)] = static_cast<int32_t>(start + done + i);
    // A ubatch whose logits nobody wants still needs one output row to make a valid graph.
    // The call's kind, not the ubatch's: a prompt's one-token tail is still prompt rows.
    const graph::Graph& g = graph_for(nt, std::max(n_out, 1), n == 1 ? 1 : 0);
    const auto ub = tokens.subspan(static_cast<size_t>(done), nt);
    std::span<const float> out = scheduler_->run(g, ub, positions_);
    if (all_logits) {
      std::memcpy(logits_.data() + done * n_vocab, out.data(), out.size_bytes());
    } else if (last) {
      std::memcpy(logits_.data(), out.data(), out.size_bytes());
    }
    n_past_ = start + done + nt;
    done += nt;
  }
  (n > 1 ? n_prefill_tokens_ : n_decode_tokens_) += n;
  return logits_;
}

int32_t Session::check_step(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                            std::span<const int32_t> seqs, int32_t n_out, int32_t n_decode) const {
  const auto n = static_cast<int64_t>(tokens.size());
  if (n == 0 || positions.size() != tokens.size() || seqs.size() != tokens.size())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("eval_step: {} tokens, {} positions and {} sequence ids (need the "
                            "same number, at least 1)",
                            tokens.size(), positions.size(), seqs.size()));
  if (n_out < 1 || n_out > n)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("eval_step: {} output rows of a step of {} tokens", n_out, n));
  const int64_t n_vocab = model_.hparams().n_vocab;
  for (int32_t id : tokens)
    if (id < 0 || id >= n_vocab)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("token id {} is outside the vocabulary of {} tokens", id, n_vocab));
  if (n_decode < -1 || n_decode > n)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("eval_step: {} decode tokens in a step of {}", n_decode, n));
  const int32_t n_dec = n_decode >= 0 ? n_decode : (n == 1 ? 1 : 0);
  for (int64_t i = n - n_dec; i < n; ++i)
    for (int64_t j = 0; j < n; ++j)
      if (j != i && seqs[static_cast<size_t>(j)] == seqs[static_cast<size_t>(i)])
        throw Error(ErrorCategory::invalid_argument,
                    fmt::format("eval_step: decode token {} of sequence {} is not the only token "
                                "of its sequence in the step (token {} is too)",
                                i, seqs[static_cast<size_t>(i)], j));
  return n_dec;
}

std::span<const float> Session::eval_step(std::span<const int32_t> tokens,
                                          std::span<const int32_t> positions,
                                          std::span<const int32_t> seqs, int32_t n_out,
                                          int32_t n_decode) {
  const int32_t n_dec = check_step(tokens, positions, seqs, n_out, n_decode);
  const graph::Graph& g = graph_for(static_cast<int32_t>(tokens.size()), n_out, n_dec);
  return scheduler_->run(g, tokens, positions, seqs);
}

int32_t Session::eval_step_argmax(std::span<const int32_t> tokens,
                                  std::span<const int32_t> positions, std::span<const int32_t> seqs,
                                  int32_t n_decode) {
  const int32_t n_dec = check_step(tokens, positions, seqs, 1, n_decode);
  const graph::Graph& g = graph_for(static_cast<int32_t>(tokens.size()), 1, n_dec);
  return scheduler_->run_argmax(g, tokens, positions, seqs);
}

std::span<const int32_t> Session::eval_step_select(std::span<const int32_t> tokens,
                                                   std::span<const int32_t> positions,
                                                   std::span<const int32_t> seqs, int32_t n_out,
                                                   int32_t n_decode) {
  const int32_t n_dec = check_step(tokens, positions, seqs, n_out, n_decode);
  const graph::Graph& g = graph_for(static_cast<int32_t>(tokens.size()), n_out, n_dec);
  return scheduler_->run_select(g, tokens, positions, seqs);
}

int32_t Session::eval_argmax(int32_t token) {
  if (!params_.device) {
    std::span<const float> l = eval(std::span<const int32_t>(&token, 1));
    return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
  }
  if (n_past_ + 1 > kv_.n_ctx())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("1 token after {} already in the context exceeds the context size of "
                            "{} (raise -c)",
                            n_past_, kv_.n_ctx()));
  if (token < 0 || token >= model_.hparams().n_vocab)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("token id {} is outside the vocabulary of {} tokens", token,
                            model_.hparams().n_vocab));
  positions_.assign(1, static_cast<int32_t>(n_past_));
  const int32_t id =
      scheduler_->run_argmax(graph_for(1, 1, 1), std::span<const int32_t>(&token, 1), positions_);
  ++n_past_;
  ++n_decode_tokens_;
  return id;
}

void Session::truncate(int64_t n) {
  if (n < 0 || n > n_past_)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("truncate({}) outside 0..{}", n, n_past_));
  if (n > 0 && n < n_past_ && kv_.recurrent())
    throw Error(ErrorCategory::unsupported,
                fmt::format("truncate({}): the recurrent state of {} cannot be cut back from {} "
                            "to {} tokens (only to 0)",
                            n, model_.hparams().arch, n_past_, n));
  if (n == 0 && kv_.recurrent()) kv_.reset_state(0);
  n_past_ = n;
}

void Session::rewind(int64_t n, std::span<const float> state) {
  if (n < 0 || n > n_past_)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("rewind({}) outside 0..{}", n, n_past_));
  if (!kv_.recurrent()) {
    if (!state.empty())
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("rewind({}): a state of {} floats for a model without recurrent "
                              "layers",
                              n, state.size()));
    truncate(n);
    return;
  }
  kv_.restore_state(0, state);
  n_past_ = n;
}

GenerateStats generate(Session& session, const Tokenizer& tok, Sampler& sampler,
                       std::span<const int32_t> prompt, int32_t n_predict,
                       const TokenCallback& on_token) {
  using clock = std::chrono::steady_clock;
  auto secs = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
  GenerateStats st;
  if (prompt.empty()) throw Error(ErrorCategory::invalid_argument, "the prompt has no tokens");
  for (int32_t t : prompt) sampler.accept(t);

  auto t0 = clock::now();
  std::span<const float> logits = session.eval(prompt);
  st.prompt_seconds = secs(clock::now() - t0);
  st.n_prompt = static_cast<int64_t>(prompt.size());

  // Greedy decoding with a device: the device picks each token (Session::eval_argmax).
  const SamplerParams& spar = sampler.params();
  const bool device_greedy =
      session.device() != nullptr && spar.temp <= 0 && spar.repeat_penalty == 1.0f;
  int32_t picked = -1;  // the token the device chose at the last step
  StreamDecoder dec(tok);
  auto t1 = clock::now();
  while (true) {
    if (n_predict >= 0 && st.n_generated >= n_predict) {
      st.stop = StopReason::n_predict;
      break;
    }
    const int32_t id = picked >= 0 ? picked : sampler.sample(logits);
    ++st.n_generated;
    sampler.accept(id);
    if (tok.is_eog(id)) {
      st.stop = StopReason::eos;
      break;
    }
    std::string text = dec.push(id);
    if (on_token && !on_token(id, text)) {
      st.stop = StopReason::callback;
      break;
    }
    if (n_predict >= 0 && st.n_generated >= n_predict) {
      st.stop = StopReason::n_predict;
      break;
    }
    if (session.n_past() >= session.n_ctx()) {
      st.stop = StopReason::context_full;
      break;
    }
    if (device_greedy) {
      picked = session.eval_argmax(id);
    } else {
      const int32_t one[1] = {id};
      logits = session.eval(one);
    }
    ++st.n_decode_steps;
  }
  std::string rest = dec.flush();
  if (!rest.empty() && on_token) on_token(-1, rest);
  st.decode_seconds = secs(clock::now() - t1);
  return st;
}

}  // namespace berth
