#include "berth/server/batch_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>

#include "berth/core/error.h"
#include "berth/core/log.h"

namespace berth::server {

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// log-softmax of `logits` at `id` and the `n_top` most likely tokens (descending; ties: lower
// id first).
void fill_logprobs(std::span<const float> logits, int32_t id, int32_t n_top, GeneratedToken& out) {
  float mx = -INFINITY;
  for (float v : logits)
    if (v > mx) mx = v;
  double sum = 0;
  for (float v : logits) sum += std::isfinite(v) ? std::exp(static_cast<double>(v - mx)) : 0.0;
  const double log_z = static_cast<double>(mx) + std::log(sum);
  auto lp = [&](int32_t t) {
    const float v = logits[static_cast<size_t>(t)];
    return std::isfinite(v) ? static_cast<float>(v - log_z) : -INFINITY;
  };
  out.logprob = lp(id);
  if (n_top <= 0) return;
  const size_t n = std::min<size_t>(static_cast<size_t>(n_top), logits.size());
  std::vector<int32_t> idx(logits.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(n), idx.end(),
                    [&](int32_t a, int32_t b) {
                      const float la = logits[static_cast<size_t>(a)];
                      const float lb = logits[static_cast<size_t>(b)];
                      return la > lb || (la == lb && a < b);
                    });
  for (size_t i = 0; i < n; ++i) out.top.emplace_back(idx[i], lp(idx[i]));
}

}  // namespace

BatchEngine::BatchEngine(const Model& model, const Tokenizer& tok, BatchEngineOptions options)
    : model_(model), tok_(tok), options_(std::move(options)) {
  const int32_t np = options_.n_slots;
  if (np < 1)
    throw Error(ErrorCategory::invalid_argument, fmt::format("-np must be at least 1, got {}", np));
  if (options_.queue_limit < 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("--queue must be at least 0, got {}", options_.queue_limit));
  const int64_t n_ctx = options_.n_ctx > 0 ? options_.n_ctx : default_n_ctx(model.hparams());
  check_slot_context(n_ctx, np);
  n_ctx_slot_ = n_ctx / np;
  SessionParams sp = options_.session;
  sp.n_ctx = n_ctx_slot_;
  sp.n_seq = np;
  session_ = std::make_unique<Session>(model, sp);
  slots_.resize(static_cast<size_t>(np));
  info_.resize(static_cast<size_t>(np));
  for (int32_t i = 0; i < np; ++i) {
    Slot& s = slots_[static_cast<size_t>(i)];
    s.id = session_->kv().acquire();  // the lowest free one: i
    BERTH_CHECK(s.id == i, fmt::format("BatchEngine: slot {} got KV sequence {}", i, s.id));
    // Recurrent layers (Qwen3.5) cannot truncate: their prefix reuse goes through checkpoints.
    if (session_->kv().recurrent()) {
      // The slot's spare state rows (SessionParams::n_state_spare), when the session has them.
      std::vector<int32_t> rows;
      const int32_t k = kDeviceCheckpointsPerSlot;
      if (session_->kv().n_state_spare() >= (i + 1) * k)
        for (int32_t r = i * k; r < (i + 1) * k; ++r) rows.push_back(r);
      s.state = std::make_unique<RecurrentSequenceState>(n_ctx_slot_, session_->kv(), s.id,
                                                         std::move(rows));
    } else {
      s.state = std::make_unique<KvSequenceState>(n_ctx_slot_);
    }
    s.cache = std::make_unique<SlotCache>(*s.state);
    info_[static_cast<size_t>(i)] = SlotInfo{i, n_ctx_slot_, false, 0, 0};
  }
  busy_.reserve(slots_.size());
  inputs_.reserve(slots_.size());
  thread_ = std::thread([this] { loop(); });
}

void BatchEngine::check_slot_context(int64_t n_ctx, int32_t n_slots) {
  const int64_t per = n_ctx / n_slots;
  if (per < 2)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("-c {} over -np {} slot{} leaves {} token{} per slot; each slot needs "
                            "at least 2 (raise -c or lower -np)",
                            n_ctx, n_slots, n_slots == 1 ? "" : "s", per, per == 1 ? "" : "s"));
}

BatchEngine::~BatchEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    stopping_ = true;
    for (Waiting& w : waiting_) w.gen->cancel();
    for (Slot& s : slots_)
      if (s.gen) s.gen->cancel();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<Generation> BatchEngine::submit(GenerationRequest req) {
  using R = Rejected::Reason;
  const int64_t n_prompt = static_cast<int64_t>(req.prompt.size());
  if (n_prompt == 0) throw Rejected(R::invalid, "the prompt has no tokens");
  const int64_t n_vocab = model_.hparams().n_vocab;
  for (size_t i = 0; i < req.prompt.size(); ++i)
    if (req.prompt[i] < 0 || req.prompt[i] >= n_vocab)
      throw Rejected(R::invalid, fmt::format("prompt token {} (at index {}) is outside the "
                                             "vocabulary of {} tokens",
                                             req.prompt[i], i, n_vocab));
  if (n_prompt >= n_ctx_slot_)
    throw Rejected(R::context_exceeded,
                   fmt::format("the prompt of {} tokens does not fit in the context of a slot "
                               "({} tokens, -c / -np): it needs room for at least one more",
                               n_prompt, n_ctx_slot_),
                   n_prompt, n_ctx_slot_);
  if (req.max_tokens < -1)
    throw Rejected(R::invalid, fmt::format("max_tokens must be -1 (no limit) or at least 0, got {}",
                                           req.max_tokens));
  if (req.slot < -1 || req.slot >= n_slots())
    throw Rejected(R::invalid, fmt::format("id_slot {} is not -1 or a slot id in 0..{}", req.slot,
                                           n_slots() - 1));
  const SamplingSettings& ss = req.sampling;
  if (ss.n_top_logprobs < 0 || ss.n_top_logprobs > 20)
    throw Rejected(R::invalid,
                   fmt::format("top_logprobs must be in 0..20, got {}", ss.n_top_logprobs));
  if (!std::isfinite(ss.presence_penalty) || !std::isfinite(ss.frequency_penalty))
    throw Rejected(R::invalid, "presence_penalty and frequency_penalty must be finite");
  for (const auto& [id, bias] : ss.logit_bias) {
    if (id < 0 || id >= n_vocab)
      throw Rejected(R::invalid, fmt::format("logit_bias token {} is outside the vocabulary of {} "
                                             "tokens",
                                             id, n_vocab));
    if (std::isnan(bias) || bias == INFINITY)
      throw Rejected(
          R::invalid,
          fmt::format("logit_bias of token {} must be a number or -inf, got {}", id, bias));
  }
  std::optional<Sampler> sampler;
  try {
    sampler.emplace(ss.sampler, static_cast<int32_t>(n_vocab));
  } catch (const Error& e) {
    throw Rejected(R::invalid, e.what());
  }
  std::shared_ptr<Generation> gen;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw Rejected(R::shutting_down, "the server is shutting down");
    if (n_busy_ + static_cast<int64_t>(waiting_.size()) >=
        static_cast<int64_t>(n_slots()) + options_.queue_limit)
      throw Rejected(R::queue_full,
                     fmt::format("the server holds {} requests, its limit ({} slots and --queue "
                                 "{} waiting)",
                                 n_busy_ + static_cast<int64_t>(waiting_.size()), n_slots(),
                                 options_.queue_limit));
    gen = std::make_shared<Generation>(next_id_++);
    waiting_.push_back(Waiting{gen, std::move(req), std::move(*sampler), Clock::now()});
    metrics_.requests_deferred = static_cast<int64_t>(waiting_.size());
  }
  cv_.notify_all();
  return gen;
}

std::vector<SlotInfo> BatchEngine::slots() const {
  std::lock_guard<std::mutex> lock(mu_);
  return info_;
}

EngineMetrics BatchEngine::metrics() const {
  std::lock_guard<std::mutex> lock(mu_);
  EngineMetrics m = metrics_;
  m.requests_processing = n_busy_;
  m.requests_deferred = static_cast<int64_t>(waiting_.size());
  return m;
}

void BatchEngine::close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
}

int64_t BatchEngine::n_in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return n_busy_ + static_cast<int64_t>(waiting_.size());
}

void BatchEngine::cancel_all() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Waiting& w : waiting_) w.gen->cancel();
    for (Slot& s : slots_)
      if (s.gen) s.gen->cancel();
  }
  cv_.notify_all();
}

void BatchEngine::hold_queue(bool on) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = on;
  }
  cv_.notify_all();
}

void BatchEngine::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (!held_ || stopping_) assign_locked();
    if (n_busy_ == 0) {
      if (stopping_ && waiting_.empty()) break;
      cv_.wait(lock, [this] { return stopping_ || (!waiting_.empty() && !held_); });
      continue;
    }
    lock.unlock();
    step();
    lock.lock();
  }
}

// Moves waiting requests to idle slots, in arrival order. A request without a slot choice takes
// the idle slot whose cache shares the longest prefix with its prompt when that prefix is at
// least kMinSimilarity of the prompt (with cache_prompt; llama-server's slot_prompt_similarity),
// else the least recently used idle slot, so that a slot's cache is not spent on a request that
// shares little with it.
void BatchEngine::assign_locked() {
  constexpr double kMinSimilarity = 0.5;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Waiting& w = *it;
    if (w.gen->cancelled()) {
      GenerationTimings t;
      t.n_prompt = static_cast<int64_t>(w.req.prompt.size());
      t.queued_ms = ms_since(w.submitted);
      w.gen->finish(FinishReason::cancelled, t);
      it = waiting_.erase(it);
      continue;
    }
    // The free slot that brings back the most of the prompt (at least kMinSimilarity of it),
    // else the least recently used. What a slot brings back is SlotCache::reuse: for a
    // recurrent state (Qwen3.5) only up to a checkpoint, which can be far less than the shared
    // prefix. A slot sharing more with the prompt than it can bring back (a recurrent state past
    // the point of divergence, no checkpoint before it) is taken last: the prompt would gain
    // nothing there and would end a state that a request continuing it could still use.
    Slot* best = nullptr;
    Slot* fallback = nullptr;
    bool fallback_loses = false;
    int64_t best_reuse = 0;
    for (Slot& s : slots_) {
      if (s.gen || (w.req.slot >= 0 && s.id != w.req.slot)) continue;
      const SlotCache::PrefixReuse r =
          w.req.cache_prompt ? s.cache->reuse(w.req.prompt) : SlotCache::PrefixReuse{};
      const int64_t reuse = r.restorable;
      // A shared prefix it cannot bring back (never for a state that can truncate).
      const bool loses = r.restorable < r.shared;
      if (!fallback || (fallback_loses && !loses) ||
          (fallback_loses == loses && s.last_used < fallback->last_used)) {
        fallback = &s;
        fallback_loses = loses;
      }
      if (static_cast<double>(reuse) < kMinSimilarity * static_cast<double>(w.req.prompt.size()))
        continue;
      if (!best || reuse > best_reuse || (reuse == best_reuse && s.last_used < best->last_used)) {
        best = &s;
        best_reuse = reuse;
      }
    }
    if (!best) best = fallback;
    if (!best) {
      ++it;
      continue;
    }
    Slot& s = *best;
    s.gen = w.gen;
    s.req = std::move(w.req);
    s.sampler.emplace(std::move(w.sampler));
    s.t = GenerationTimings{};
    s.t.n_prompt = static_cast<int64_t>(s.req.prompt.size());
    s.t.queued_ms = ms_since(w.submitted);
    s.pending = -1;
    s.recent.clear();
    s.admitted = ++use_counter_;
    it = waiting_.erase(it);
    ++n_busy_;
    int64_t n_cached = 0;
    try {
      n_cached = s.cache->prepare(s.req.prompt, s.req.cache_prompt);
    } catch (const std::exception& e) {
      s.cache->clear();
      n_cached = 0;
      log::warn("slot {}: the prefix cache failed ({}); starting from an empty cache", s.id,
                e.what());
    }
    s.n_prompt_done = n_cached;
    s.t.n_cached = n_cached;
    metrics_.n_cached_total += n_cached;
    for (int32_t t : s.req.prompt) {
      s.sampler->accept(t);
      note_recent(s, t);
    }
    SlotInfo& info = info_[static_cast<size_t>(s.id)];
    info.is_processing = true;
    info.id_task = s.gen->id();
    info.n_cached = n_cached;
    s.gen->start(s.id, n_cached, s.t.queued_ms);
  }
}

void BatchEngine::note_recent(Slot& s, int32_t id) {
  const int32_t window = s.sampler->params().repeat_last_n;
  if (window <= 0) return;
  s.recent.push_back(id);
  while (static_cast<int32_t>(s.recent.size()) > window) s.recent.pop_front();
}

// One forward step over every busy slot: the decode token of each generating slot, then prompt
// chunks of prefilling slots in order of admission, up to -ub tokens (StepPacker).
void BatchEngine::step() {
  const auto start = Clock::now();
  // Start to start of two decode-only steps in a row (counted once this one is known to be one).
  const double gap = last_decode_start_
                         ? std::chrono::duration<double>(start - *last_decode_start_).count()
                         : -1.0;
  last_decode_start_.reset();
  busy_.clear();
  for (Slot& s : slots_) {
    if (!s.gen) continue;
    if (s.gen->cancelled())
      end(s, FinishReason::cancelled);
    else
      busy_.push_back(&s);
  }
  if (busy_.empty()) return;
  std::sort(busy_.begin(), busy_.end(),
            [](const Slot* a, const Slot* b) { return a->admitted < b->admitted; });
  inputs_.clear();
  for (const Slot* s : busy_) {
    StepInput in;
    in.kv_seq = s->id;
    in.n_past = s->state->n_past();
    in.decode = s->n_prompt_done == static_cast<int64_t>(s->req.prompt.size());
    in.tokens = in.decode ? std::span<const int32_t>(&s->pending, 1)
                          : std::span<const int32_t>(s->req.prompt)
                                .subspan(static_cast<size_t>(s->n_prompt_done));
    // A state kept by checkpoints (Qwen3.5's recurrent layers cannot be cut back): the prompt's
    // last token waits for a step of its own, so that a checkpoint can be taken just before it
    // (step's results below). The same prompt again then evaluates only that token; a
    // checkpoint at the prompt's end could not serve it (its last token's logits are needed).
    if (!in.decode && in.tokens.size() > 1 && s->cache->keeps_checkpoints()) {
      in.tokens = in.tokens.first(in.tokens.size() - 1);
      in.stops_short = true;
    }
    inputs_.push_back(in);
  }
  packer_.pack(inputs_, options_.session.n_ubatch);

  // A step whose output rows all belong to slots that sample greedily without penalties,
  // logprobs or a logit bias (device_pickable): the device picks each row's token and only the
  // ids come back, instead of n_vocab logits per row to the host and a pass over each (the same
  // choice: ties to the lower id).
  std::span<const int32_t> picked;
  int64_t n_rows = 0;  // output rows the slots take
  bool device_pick = session_->device() != nullptr;
  for (size_t i = 0; i < busy_.size() && device_pick; ++i)
    if (packer_.taken(i) > 0 && packer_.out_row(i) >= 0) {
      device_pick = device_pickable(busy_[i]->req.sampling);
      ++n_rows;
    }
  device_pick = device_pick && n_rows > 0;
  const auto t0 = Clock::now();
  std::span<const float> logits;
  try {
    if (device_pick)
      picked = session_->eval_step_select(packer_.tokens(), packer_.positions(), packer_.seqs(),
                                          packer_.n_out(), packer_.n_decode());
    else
      logits = session_->eval_step(packer_.tokens(), packer_.positions(), packer_.seqs(),
                                   packer_.n_out(), packer_.n_decode());
  } catch (const std::exception& e) {
    for (size_t i = 0; i < busy_.size(); ++i)
      if (packer_.taken(i) > 0) fail(*busy_[i], e.what());
    return;
  }
  const double ms = ms_since(t0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++metrics_.n_decode_total;
    metrics_.n_step_seqs_total += packer_.n_seqs();
    metrics_.max_step_seqs = std::max(metrics_.max_step_seqs, packer_.n_seqs());
    metrics_.tokens_device_picked_total += device_pick ? n_rows : 0;
    if (packer_.n_prompt() == 0) {
      ++metrics_.decode_steps_total;
      metrics_.decode_rows_total += packer_.n_decode();
      metrics_.decode_step_seconds_total += ms / 1e3;
      if (gap >= 0) {
        ++metrics_.decode_intervals_total;
        metrics_.decode_interval_seconds_total += gap;
      }
    }
  }
  if (packer_.n_prompt() == 0) last_decode_start_ = start;
  const auto n_vocab = static_cast<size_t>(session_->n_vocab());
  for (size_t i = 0; i < busy_.size(); ++i) {
    const int64_t n = packer_.taken(i);
    if (n == 0) continue;
    Slot& s = *busy_[i];
    const int32_t r = packer_.out_row(i);
    const std::span<const float> row =
        r < 0 || device_pick ? std::span<const float>()
                             : logits.subspan(static_cast<size_t>(r) * n_vocab, n_vocab);
    const int32_t pick = r < 0 || !device_pick ? -1 : picked[static_cast<size_t>(r)];
    try {
      s.state->advance(n);
      s.cache->append(inputs_[i].tokens.first(static_cast<size_t>(n)));
      if (inputs_[i].decode) {
        const auto t1 = Clock::now();
        sample(s, row, pick);
        s.t.predicted_ms += ms + ms_since(t1);
        continue;
      }
      s.n_prompt_done += n;
      s.t.n_evaluated += n;
      s.t.prompt_ms += ms;
      {
        std::lock_guard<std::mutex> lock(mu_);
        metrics_.prompt_tokens_total += n;
        metrics_.prompt_seconds_total += ms / 1e3;
      }
      s.gen->progress(s.n_prompt_done);
      if (r < 0) {  // more of the prompt to come
        if (inputs_[i].stops_short &&
            s.n_prompt_done + 1 == static_cast<int64_t>(s.req.prompt.size()))
          s.cache->checkpoint();  // all of the prompt but its last token, held back for this
        continue;
      }
      if (s.req.max_tokens == 0) {
        end(s, FinishReason::length);
        continue;
      }
      const auto t1 = Clock::now();
      sample(s, row, pick);
      s.t.predicted_ms += ms_since(t1);
    } catch (const std::exception& e) {
      if (s.gen) fail(s, e.what());
    }
  }
}

bool BatchEngine::device_pickable(const SamplingSettings& s) {
  return s.sampler.temp <= 0.0f && s.sampler.repeat_penalty == 1.0f && s.presence_penalty == 0.0f &&
         s.frequency_penalty == 0.0f && !s.logprobs && s.logit_bias.empty();
}

void BatchEngine::sample(Slot& s, std::span<const float> logits, int32_t picked) {
  const SamplingSettings& ss = s.req.sampling;
  std::span<const float> use = logits;
  if (picked < 0 &&
      (ss.presence_penalty != 0.0f || ss.frequency_penalty != 0.0f || !ss.logit_bias.empty())) {
    s.scratch.assign(logits.begin(), logits.end());
    // The bias first (llama.cpp's chain), then the penalties (all additive here; the repetition
    // penalty, which is not, comes after, in the Sampler).
    for (const auto& [t, bias] : ss.logit_bias) s.scratch[static_cast<size_t>(t)] += bias;
    std::unordered_map<int32_t, int32_t> counts;
    for (int32_t t : s.recent) ++counts[t];
    for (const auto& [t, c] : counts)
      s.scratch[static_cast<size_t>(t)] -=
          static_cast<float>(c) * ss.frequency_penalty + ss.presence_penalty;
    use = s.scratch;
  }
  const int32_t id = picked >= 0 ? picked : s.sampler->sample(use);
  s.sampler->accept(id);
  note_recent(s, id);
  ++s.t.n_predicted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++metrics_.tokens_predicted_total;
  }
  if ((!s.req.ignore_eos && tok_.is_eog(id)) ||
      std::find(s.req.stop_ids.begin(), s.req.stop_ids.end(), id) != s.req.stop_ids.end()) {
    end(s, FinishReason::eos);
    return;
  }
  GeneratedToken out;
  out.id = id;
  if (ss.logprobs) fill_logprobs(logits, id, ss.n_top_logprobs, out);
  s.gen->push(std::move(out));
  if (s.req.max_tokens >= 0 && s.t.n_predicted >= s.req.max_tokens) {
    end(s, FinishReason::length);
  } else if (s.state->n_past() >= n_ctx_slot_) {
    end(s, FinishReason::context);
  } else {
    s.pending = id;
  }
}

void BatchEngine::end(Slot& s, FinishReason reason) {
  std::shared_ptr<Generation> gen;
  s.sampler.reset();
  s.pending = -1;
  bool stopping = false;
  {
    std::lock_guard<std::mutex> lock(mu_);  // cancel_all() reads s.gen
    gen = std::move(s.gen);
    s.gen.reset();
    s.last_used = ++use_counter_;
    --n_busy_;
    metrics_.tokens_predicted_seconds_total += s.t.predicted_ms / 1e3;
    SlotInfo& info = info_[static_cast<size_t>(s.id)];
    info.is_processing = false;
    info.n_cached = static_cast<int64_t>(s.cache->tokens().size());
    stopping = stopping_;
  }
  gen->finish(reason, s.t);
  // The turn boundary (beside the prompt's end, step()): the state holds the prompt and the
  // reply's evaluated tokens (not the last sampled one) and SlotCache records exactly those,
  // whatever ended the request: a stop string, a vanished client or a cancel in prefill arrive as
  // a cancel between steps, where the two agree too. The chat's next turn continues this state
  // without a checkpoint; a prompt that branches off it later (the next turn's reply
  // regenerated, its user message edited) restores here instead of at the prompt's end and
  // evaluates none of the reply again. Taken after finish(): the copy (the recurrent state, to
  // the host) does not delay this request's answer. None at shutdown.
  if (stopping) return;
  try {
    s.cache->checkpoint();
  } catch (const std::exception& e) {
    log::warn("slot {}: no checkpoint at the end of the reply ({})", s.id, e.what());
  }
}

void BatchEngine::fail(Slot& s, const std::string& message) {
  log::error("slot {}: request {} failed: {}", s.id, s.gen->id(), message);
  std::shared_ptr<Generation> gen;
  s.sampler.reset();
  s.pending = -1;
  try {
    s.cache->clear();
  } catch (const std::exception&) {
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    gen = std::move(s.gen);
    s.gen.reset();
    s.last_used = ++use_counter_;
    --n_busy_;
    SlotInfo& info = info_[static_cast<size_t>(s.id)];
    info.is_processing = false;
    info.n_cached = 0;
  }
  gen->fail(message, s.t);
}

}  // namespace berth::server
