#include "berth/residency/disk_tier.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <numeric>

#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/cpu_kernels/ops.h"
#include "berth/io/mapped_file.h"

namespace berth {

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
constexpr size_t kAlign = io::kDirectAlignment;
size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

class DiskTier::Layer final : public CpuExecutor::ExpertSource {
 public:
  Layer(DiskTier& tier, const DiskTierLayer& spec, uint8_t* base, int32_t n_slots,
        const std::array<size_t, 3>& slice, const std::array<size_t, 3>& area)
      : tier_(tier), spec_(spec), base_(base), slice_(slice), area_(area) {
    const TensorView& g = tier.weights_[spec.weights[0]];
    n_expert_ = static_cast<int32_t>(g.ne[2]);
    slot_bytes_ = area[0] + area[1] + area[2];
    slots_.resize(static_cast<size_t>(n_slots));
    expert_slot_.assign(static_cast<size_t>(n_expert_), -1);
    score_.assign(static_cast<size_t>(n_expert_), 0.0);
    needed_.assign(static_cast<size_t>(n_expert_), 0);
    for (size_t t = 0; t < 3; ++t) names_[t] = tier.weights_[spec.weights[t]].name;
  }

  int32_t capacity() const override { return static_cast<int32_t>(slots_.size()); }

  void will_need(std::span<int32_t> experts, std::span<int64_t> tokens, const float* h,
                 int64_t n_tok) override {
    poll_loading();
    // Experts in RAM (or being read) first: the op computes them while the others are read.
    {
      order_.resize(experts.size());
      std::iota(order_.begin(), order_.end(), 0);
      std::stable_partition(order_.begin(), order_.end(), [&](int32_t i) {
        return expert_slot_[static_cast<size_t>(experts[static_cast<size_t>(i)])] >= 0;
      });
      op_experts_.resize(experts.size());
      op_tokens_.resize(experts.size());
      for (size_t i = 0; i < order_.size(); ++i) {
        op_experts_[i] = experts[static_cast<size_t>(order_[i])];
        op_tokens_[i] = tokens[static_cast<size_t>(order_[i])];
      }
      std::copy(op_experts_.begin(), op_experts_.end(), experts.begin());
      std::copy(op_tokens_.begin(), op_tokens_.end(), tokens.begin());
    }
    op_scan_ = 0;
    op_h_ = h;
    op_n_tok_ = n_tok;
    op_predicted_ = false;
    // Scores: each call counts inc_, which grows by 2^(1/half-life) per token (the same as
    // decaying every score), rescaled before it overflows.
    inc_ *= std::exp2(static_cast<double>(n_tok) / tier_.opt_.half_life_tokens);
    if (inc_ > 1e200) {
      for (double& s : score_) s /= inc_;
      inc_ = 1.0;
    }
    std::fill(needed_.begin(), needed_.end(), 0);
    for (size_t i = 0; i < experts.size(); ++i) {
      score_[static_cast<size_t>(experts[i])] += inc_ * static_cast<double>(tokens[i]);
      needed_[static_cast<size_t>(experts[i])] = 1;
    }
    // Score the last decode prediction for this layer: of its experts that were not in RAM, the
    // share this op uses.
    if (has_prediction_) {
      prec_used_ *= kPrecisionDecay;
      prec_total_ *= kPrecisionDecay;
      for (int32_t e : predicted_missing_) {
        const bool used = needed_[static_cast<size_t>(e)] != 0;
        prec_total_ += 1;
        prec_used_ += used ? 1 : 0;
        ++tier_.stats_.predicted_missing;
        tier_.stats_.predicted_used += used;
      }
      has_prediction_ = false;
    }
    // On demand: the first group's missing experts (later groups read at their acquire()).
    const size_t first = std::min(experts.size(), slots_.size());
    for (size_t i = 0; i < first; ++i) {
      const int32_t e = experts[i];
      if (expert_slot_[static_cast<size_t>(e)] >= 0) continue;
      const int32_t s = victim(/*for_ahead=*/false);
      if (s < 0) break;  // every slot holds a needed expert or is being read
      start_read(s, e, /*ahead=*/false);
    }
    // Ahead: the next tiered layer's likely experts, from this layer's input; at decode now, in
    // prefill once every expert of this op has its read issued (in acquire()).
    if (next_ && tier_.opt_.read_ahead && n_tok == 1 && h) {
      next_->read_ahead(h, 1);
      op_predicted_ = true;
    }
  }

  void acquire(std::span<const int32_t> experts,
               std::span<std::array<const uint8_t*, 3>> out) override {
    release();
    const double t0 = now_s();
    // Every expert of the group gets a slot (the group is at most capacity()).
    for (int32_t e : experts) {
      int32_t s = expert_slot_[static_cast<size_t>(e)];
      if (s < 0) {
        s = victim(/*for_ahead=*/false, experts);
        if (s < 0) s = settle_one(experts);
        if (s < 0)
          throw Error(
              ErrorCategory::internal,
              fmt::format("disk tier, layer {}: no free RAM slot for expert {}", spec_.layer, e));
        start_read(s, e, /*ahead=*/false);
      }
      slots_[static_cast<size_t>(s)].pinned = true;
      pinned_list_.push_back(s);
    }
    // Wait for the reads; the first error is thrown after all of the group's reads ended.
    std::exception_ptr err;
    for (size_t i = 0; i < experts.size(); ++i) {
      const int32_t e = experts[i];
      Slot& sl = slots_[static_cast<size_t>(expert_slot_[static_cast<size_t>(e)])];
      if (sl.ticket != 0) {
        try {
          tier_.reader_->wait(sl.ticket);
          sl.ticket = 0;
        } catch (...) {
          sl.ticket = 0;
          if (!err) err = std::current_exception();
          drop(sl);
          continue;
        }
      }
      if (sl.error) {  // a read-ahead that failed: the error is this use's
        if (!err) err = sl.error;
        drop(sl);
        continue;
      }
      ++tier_.stats_.calls;
      if (sl.ahead) {
        ++tier_.stats_.ahead_used;
        sl.ahead = false;
      } else if (!sl.fresh) {
        ++tier_.stats_.hits;
      }
      sl.fresh = false;
      const uint8_t* b = base_ + static_cast<size_t>(&sl - slots_.data()) * slot_bytes_;
      out[i] = {b + pad(0, e), b + area_[0] + pad(1, e), b + area_[0] + area_[1] + pad(2, e)};
    }
    tier_.stats_.wait_seconds += now_s() - t0;
    if (err) {
      release();
      std::rethrow_exception(err);
    }
    if (tier_.opt_.read_ahead) read_ahead_in_op();
  }

  void release() override {
    for (int32_t s : pinned_list_) {
      if (s < 0) continue;
      Slot& sl = slots_[static_cast<size_t>(s)];
      sl.pinned = false;
      // Computed: this op needs it no more, so its slot may take a later group's expert.
      if (sl.expert >= 0) needed_[static_cast<size_t>(sl.expert)] = 0;
    }
    pinned_list_.clear();
  }

  // While a group computes: reads of this op's later experts into slots that hold nothing it
  // still needs (empty, computed, or not this op's), never waiting; once every expert of the op
  // has its read issued, in prefill, the next tiered layer's predicted experts.
  void read_ahead_in_op() {
    for (; op_scan_ < op_experts_.size(); ++op_scan_) {
      const int32_t e = op_experts_[op_scan_];
      if (expert_slot_[static_cast<size_t>(e)] >= 0) continue;
      const int32_t s = victim(/*for_ahead=*/false);
      if (s < 0) return;
      start_read(s, e, /*ahead=*/true);
    }
    if (next_ && !op_predicted_ && op_h_ && op_n_tok_ > 1) {
      next_->read_ahead(op_h_, op_n_tok_);
      op_predicted_ = true;
    }
  }

  void set_next(Layer* next) { next_ = next; }

  // Reads this layer's predicted experts for tokens whose previous-layer input is h (n_tok rows
  // of n_embd): this layer's router applied to (up to kPredictRows evenly spaced rows of) h, top
  // n_expert_used per row, the experts predicted for most rows first, those not in RAM into slots
  // that are free or hold the coldest unpredicted experts (never one being read, never waiting).
  // Routers of any type (rows dequantized one at a time).
  void read_ahead(const float* h, int64_t n_tok) {
    if (spec_.router == graph::kNoWeight) return;
    const TensorView& r = tier_.weights_[spec_.router];
    if (r.ne[1] != n_expert_ || n_tok < 1) return;
    poll_loading();
    const int64_t n_embd = r.ne[0];
    constexpr int64_t kPredictRows = 16;
    const int64_t rows = std::min(n_tok, kPredictRows);
    const auto k = static_cast<size_t>(std::clamp(spec_.n_expert_used, 1, n_expert_));
    votes_.assign(static_cast<size_t>(n_expert_), 0);
    logits_.assign(static_cast<size_t>(n_expert_ * rows), 0.0f);
    if (r.type != GgmlType::F32) row_.resize(static_cast<size_t>(n_embd));
    for (int32_t e = 0; e < n_expert_; ++e) {
      const float* w = reinterpret_cast<const float*>(r.row(e));
      if (r.type != GgmlType::F32) {
        cpu::get_row(r, e, row_.data());
        w = row_.data();
      }
      for (int64_t j = 0; j < rows; ++j) {
        const float* x = h + (j * n_tok / rows) * n_embd;
        float acc = 0;
        for (int64_t i = 0; i < n_embd; ++i) acc += w[i] * x[i];
        logits_[static_cast<size_t>(j * n_expert_ + e)] = acc;
      }
    }
    order_.resize(static_cast<size_t>(n_expert_));
    for (int64_t j = 0; j < rows; ++j) {
      const float* l = logits_.data() + j * n_expert_;
      std::iota(order_.begin(), order_.end(), 0);
      std::partial_sort(order_.begin(), order_.begin() + static_cast<long>(k), order_.end(),
                        [&](int32_t a, int32_t b) { return l[a] > l[b]; });
      for (size_t i = 0; i < k; ++i) ++votes_[static_cast<size_t>(order_[i])];
    }
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
      return votes_[static_cast<size_t>(a)] > votes_[static_cast<size_t>(b)];
    });
    if (n_tok == 1) {
      // A decode prediction: scored at this layer's next op; read only while precise enough.
      predicted_missing_.clear();
      for (int32_t e : order_)
        if (votes_[static_cast<size_t>(e)] > 0 && expert_slot_[static_cast<size_t>(e)] < 0)
          predicted_missing_.push_back(e);
      has_prediction_ = true;
      ++tier_.stats_.predictions;
      if (prec_used_ < tier_.opt_.min_prediction_precision * prec_total_) return;
      ++tier_.stats_.predictions_read;
    }
    std::fill(needed_.begin(), needed_.end(), 0);
    for (int32_t e : order_)
      if (votes_[static_cast<size_t>(e)] > 0) needed_[static_cast<size_t>(e)] = 1;
    for (int32_t e : order_) {
      if (votes_[static_cast<size_t>(e)] == 0) break;
      if (expert_slot_[static_cast<size_t>(e)] >= 0) continue;
      const int32_t s = victim(/*for_ahead=*/true);
      if (s < 0) break;
      start_read(s, e, /*ahead=*/true);
    }
  }

  // Polls this layer's reads in flight (never blocks); a failed one keeps its error for the use.
  void poll_loading() {
    for (Slot& sl : slots_) {
      if (sl.ticket == 0) continue;
      try {
        if (!tier_.reader_->poll(sl.ticket)) continue;
      } catch (...) {
        sl.error = std::current_exception();
      }
      sl.ticket = 0;
    }
  }

  // A slot being read (a read-ahead, or a later group's read) that holds no expert of `group`:
  // waits for its read to end and returns it (a failed read leaves it empty). -1: none.
  int32_t settle_one(std::span<const int32_t> group) {
    for (size_t s = 0; s < slots_.size(); ++s) {
      Slot& sl = slots_[s];
      if (sl.pinned || sl.ticket == 0) continue;
      if (std::find(group.begin(), group.end(), sl.expert) != group.end()) continue;
      try {
        tier_.reader_->wait(sl.ticket);
      } catch (...) {
        sl.error = std::current_exception();
      }
      sl.ticket = 0;
      if (sl.error) drop(sl);
      return static_cast<int32_t>(s);
    }
    return -1;
  }

  // Waits for every read in flight (destruction).
  void drain() {
    for (Slot& sl : slots_)
      if (sl.ticket != 0) {
        try {
          tier_.reader_->wait(sl.ticket);
        } catch (...) {
        }
        sl.ticket = 0;
      }
  }

 private:
  struct Slot {
    int32_t expert = -1;
    io::Ticket ticket = 0;  // a read in flight
    bool pinned = false;    // acquired by the running op
    bool ahead = false;     // read ahead, not used yet
    bool fresh = false;     // read, not used yet
    std::exception_ptr error;
  };

  size_t pad(size_t t, int32_t e) const {
    return io::direct_layout(spec_.file_offset[t] + static_cast<uint64_t>(e) * slice_[t], slice_[t])
        .pad;
  }

  // A slot for a new expert: not pinned, not being read, not holding an expert the op needs (or,
  // in acquire, one of `group`); empty first, else the lowest score. -1: none.
  int32_t victim(bool for_ahead, std::span<const int32_t> group = {}) {
    int32_t best = -1;
    double best_score = 0;
    for (size_t s = 0; s < slots_.size(); ++s) {
      const Slot& sl = slots_[s];
      if (sl.pinned || sl.ticket != 0) continue;
      if (sl.expert < 0) return static_cast<int32_t>(s);
      if (needed_[static_cast<size_t>(sl.expert)] && (for_ahead || group.empty())) continue;
      if (!group.empty() && std::find(group.begin(), group.end(), sl.expert) != group.end())
        continue;
      const double sc = score_[static_cast<size_t>(sl.expert)];
      if (best < 0 || sc < best_score) best = static_cast<int32_t>(s), best_score = sc;
    }
    return best;
  }

  void drop(Slot& sl) {
    if (sl.expert >= 0) expert_slot_[static_cast<size_t>(sl.expert)] = -1;
    sl.expert = -1;
    sl.ahead = sl.fresh = false;
    sl.error = nullptr;
  }

  void start_read(int32_t s, int32_t e, bool ahead) {
    Slot& sl = slots_[static_cast<size_t>(s)];
    drop(sl);
    uint8_t* b = base_ + static_cast<size_t>(s) * slot_bytes_;
    std::array<io::ReadRequest, 3> req;
    std::array<std::string, 3> what;
    size_t at = 0;
    for (size_t t = 0; t < 3; ++t) {
      const uint64_t off = spec_.file_offset[t] + static_cast<uint64_t>(e) * slice_[t];
      what[t] = fmt::format("{} (expert {})", names_[t], e);
      req[t] = io::ReadRequest{off, slice_[t], b + at + pad(t, e), what[t]};
      at += area_[t];
    }
    sl.ticket = tier_.reader_->submit(req);
    sl.expert = e;
    sl.ahead = ahead;
    sl.fresh = true;
    expert_slot_[static_cast<size_t>(e)] = s;
    tier_.stats_.bytes_read += static_cast<int64_t>(slice_[0] + slice_[1] + slice_[2]);
    ++(ahead ? tier_.stats_.reads_ahead : tier_.stats_.reads_demand);
  }

  DiskTier& tier_;
  DiskTierLayer spec_;
  uint8_t* base_;
  std::array<size_t, 3> slice_, area_;
  std::array<std::string, 3> names_;
  size_t slot_bytes_ = 0;
  int32_t n_expert_ = 0;
  std::vector<Slot> slots_;
  std::vector<int32_t> expert_slot_;
  std::vector<double> score_;
  double inc_ = 1.0;
  std::vector<uint8_t> needed_;
  std::vector<int32_t> pinned_list_;
  std::vector<float> logits_, row_;
  std::vector<int32_t> order_, votes_;
  // The running op: its experts in compute order, their token counts, how far read_ahead_in_op
  // got, its input rows, whether the next layer's experts were predicted from them.
  std::vector<int32_t> op_experts_;
  std::vector<int64_t> op_tokens_;
  size_t op_scan_ = 0;
  const float* op_h_ = nullptr;
  int64_t op_n_tok_ = 0;
  bool op_predicted_ = false;
  // Decode predictions for this layer: the last one's experts that were not in RAM (scored at
  // this layer's next will_need), and the decayed counts of predicted and used ones.
  static constexpr double kPrecisionDecay = 0.95;
  std::vector<int32_t> predicted_missing_;
  bool has_prediction_ = false;
  double prec_used_ = 1, prec_total_ = 1;
  Layer* next_ = nullptr;
};

DiskTier::DiskTier(const graph::WeightTable& weights, DiskTierOptions options)
    : weights_(weights), opt_(std::move(options)) {
  const int32_t c = opt_.slots_per_layer;
  struct Shape {
    std::array<size_t, 3> slice, area;
  };
  std::vector<Shape> shapes;
  size_t total = 0;
  for (const DiskTierLayer& l : opt_.layers) {
    Shape sh{};
    int64_t n_expert = 0;
    for (size_t t = 0; t < 3; ++t) {
      const graph::WeightId id = l.weights[t];
      if (id < 0 || static_cast<size_t>(id) >= weights.size())
        throw Error(
            ErrorCategory::invalid_argument,
            fmt::format("disk tier: layer {} names weight {} of {}", l.layer, id, weights.size()));
      const TensorView& w = weights[id];
      if (t == 0) n_expert = w.ne[2];
      if (w.ne[2] < 2 || w.ne[2] != n_expert || w.n_bytes % static_cast<size_t>(w.ne[2]) != 0)
        throw Error(ErrorCategory::invalid_argument,
                    fmt::format("disk tier: '{}' is not a stack of {} experts", w.name, n_expert));
      sh.slice[t] = w.n_bytes / static_cast<size_t>(w.ne[2]);
      sh.area[t] = round_up(sh.slice[t]) + kAlign;  // room for any direct_layout pad
    }
    if (c < 1 || c > n_expert)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("disk tier: {} RAM slots per layer for layer {} of {} experts", c,
                              l.layer, n_expert));
    shapes.push_back(sh);
    total += (sh.area[0] + sh.area[1] + sh.area[2]) * static_cast<size_t>(c);
  }
  arena_ = io::AlignedBuffer(total);
  io::DiskReaderOptions ro = opt_.reader;
  if (total > 0) ro.fixed_buffers = {{arena_.data(), arena_.size()}};
  reader_ = std::make_unique<io::DiskReader>(opt_.path, ro);
  size_t at = 0;
  for (size_t i = 0; i < opt_.layers.size(); ++i) {
    layers_.push_back(std::make_unique<Layer>(*this, opt_.layers[i], arena_.data() + at, c,
                                              shapes[i].slice, shapes[i].area));
    at += (shapes[i].area[0] + shapes[i].area[1] + shapes[i].area[2]) * static_cast<size_t>(c);
    if (i > 0) layers_[i - 1]->set_next(layers_[i].get());
  }
  // Drop what is resident of the tiered ranges: nothing reads them through the mapping.
  const int fd = ::open(opt_.path.c_str(), O_RDONLY | O_CLOEXEC);
  for (const DiskTierLayer& l : opt_.layers)
    for (size_t t = 0; t < 3; ++t) {
      const TensorView& w = weights[l.weights[t]];
      io::advise_whole_pages(w.data, w.n_bytes, MADV_DONTNEED);
      if (fd >= 0)
        ::posix_fadvise(fd, static_cast<off_t>(l.file_offset[t]), static_cast<off_t>(w.n_bytes),
                        POSIX_FADV_DONTNEED);
    }
  if (fd >= 0) ::close(fd);
  log::info("{}", summary());
}

DiskTier::~DiskTier() {
  for (auto& l : layers_) l->drain();
}

void DiskTier::bind(CpuExecutor& cpu) {
  for (size_t i = 0; i < layers_.size(); ++i)
    cpu.bind_expert_source(opt_.layers[i].weights[0], layers_[i].get());
}

size_t DiskTier::arena_bytes() const { return arena_.size(); }
int32_t DiskTier::n_layers() const { return static_cast<int32_t>(layers_.size()); }
int32_t DiskTier::slots_per_layer() const { return opt_.slots_per_layer; }
const io::DiskReader& DiskTier::reader() const { return *reader_; }
DiskTier::Stats DiskTier::stats() const {
  Stats s = stats_;
  s.busy_seconds = reader_->busy_seconds() - busy_base_;
  s.reader_bytes = reader_->bytes_read() - bytes_base_;
  return s;
}
void DiskTier::reset_stats() {
  stats_ = {};
  busy_base_ = reader_->busy_seconds();
  bytes_base_ = reader_->bytes_read();
}

std::string DiskTier::summary() const {
  const Stats& s = stats_;
  return fmt::format(
      "disk tier: {} MoE layers x {} RAM expert slots ({:.1f} MiB), {} reader: {} experts read "
      "({:.1f} MiB), {:.1f}% of needed reads issued ahead, {} RAM hits; next-layer predictions "
      "{:.0f}% precise, {} of {} read",
      layers_.size(), opt_.slots_per_layer, static_cast<double>(arena_.size()) / (1 << 20),
      io::backend_name(reader_->backend()), s.reads_demand + s.reads_ahead,
      static_cast<double>(s.bytes_read) / (1 << 20), 100.0 * s.ahead_hit_rate(), s.hits,
      100.0 * s.prediction_precision(), s.predictions_read, s.predictions);
}

}  // namespace berth
