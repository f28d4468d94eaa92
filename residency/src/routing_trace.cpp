#include "berth/residency/routing_trace.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include "berth/core/error.h"
#include "berth/core/fp16.h"
#include "berth/core/log.h"
#include "berth/core/strings.h"

namespace berth::residency {
namespace {

[[noreturn]] void fail(ErrorCategory c, std::string message) { throw Error(c, std::move(message)); }

uint32_t load_u32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}
uint64_t load_u64(const uint8_t* p) {
  return uint64_t{load_u32(p)} | uint64_t{load_u32(p + 4)} << 32;
}

void store_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void store_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// "<name>: byte <offset>: token <t>, layer <l> (block <b>): " prefix of record errors.
std::string where(std::string_view name, int64_t offset, int64_t token, int32_t layer,
                  const std::vector<int32_t>& blocks) {
  return fmt::format("{}: byte {}: token {}, layer {} (block {})", name, offset, token, layer,
                     blocks[static_cast<size_t>(layer)]);
}

bool valid_weight(float w) { return std::isfinite(w) && w >= 0.0f; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Shape and trace

std::string_view token_kind_name(TokenKind k) {
  return k == TokenKind::prefill ? "prefill" : "decode";
}

int64_t TraceShape::record_bytes() const {
  return 1 + ids_per_token() * (id_bytes() + (has_weights ? 2 : 0));
}

void validate_trace_shape(const TraceShape& s) {
  auto bad = [](const std::string& m) {
    fail(ErrorCategory::invalid_argument, "routing trace: " + m);
  };
  if (s.n_layer < 1 || static_cast<uint32_t>(s.n_layer) > kMaxTraceLayers)
    bad(fmt::format("n_layer {} is outside 1..{}", s.n_layer, kMaxTraceLayers));
  if (s.n_expert < 1 || static_cast<uint32_t>(s.n_expert) > kMaxTraceExperts)
    bad(fmt::format("n_expert {} is outside 1..{}", s.n_expert, kMaxTraceExperts));
  const int32_t max_used =
      std::min<int32_t>(s.n_expert, static_cast<int32_t>(kMaxTraceExpertsUsed));
  if (s.n_expert_used < 1 || s.n_expert_used > max_used)
    bad(fmt::format("n_expert_used {} is outside 1..{} (n_expert {})", s.n_expert_used, max_used,
                    s.n_expert));
  if (!s.blocks.empty()) {
    if (s.blocks.size() != static_cast<size_t>(s.n_layer))
      fail(ErrorCategory::invalid_argument,
           fmt::format("routing trace: {} block indices for n_layer {}", s.blocks.size(),
                       s.n_layer));
    for (size_t l = 0; l < s.blocks.size(); ++l)
      if (s.blocks[l] < 0 || (l > 0 && s.blocks[l] <= s.blocks[l - 1]))
        fail(ErrorCategory::invalid_argument,
             fmt::format("routing trace: block index {} of MoE layer {} is negative or not above "
                         "the previous one",
                         s.blocks[l], l));
  }
}

int32_t RoutingTrace::layer_of_block(int32_t block) const {
  const auto& b = shape.blocks;
  const auto it = std::lower_bound(b.begin(), b.end(), block);
  return it != b.end() && *it == block ? static_cast<int32_t>(it - b.begin()) : -1;
}

// ---------------------------------------------------------------------------------------------
// Reading

namespace {

// Parses and validates the header and block table of `bytes` (at least what is there). Returns
// the shape (blocks filled) and sets n_tokens.
TraceShape parse_header(std::span<const uint8_t> bytes, std::string_view name, uint64_t* n_tokens) {
  const uint64_t size = bytes.size();
  if (size >= 4 && std::memcmp(bytes.data(), kTraceMagic, 4) != 0)
    fail(
        ErrorCategory::format,
        fmt::format("{}: byte 0: bad magic '{}' (expected 'BRTR'): not a berth routing trace", name,
                    printable(std::string_view(reinterpret_cast<const char*>(bytes.data()), 4))));
  if (size < kTraceHeaderBytes)
    fail(ErrorCategory::format,
         fmt::format("{}: byte {}: truncated header: the file has {} bytes, the header needs {}",
                     name, size, size, kTraceHeaderBytes));
  const uint8_t* p = bytes.data();
  const uint32_t version = load_u32(p + 4);
  if (version != kTraceVersion)
    fail(ErrorCategory::unsupported,
         fmt::format("{}: byte 4: routing trace version {} is not supported (this berth reads "
                     "version {})",
                     name, version, kTraceVersion));
  TraceShape s;
  // Range-check the raw u32 before narrowing.
  const uint32_t raw_layer = load_u32(p + 8), raw_expert = load_u32(p + 12),
                 raw_used = load_u32(p + 16), flags = load_u32(p + 20);
  auto bad = [&](int offset, const std::string& m) {
    fail(ErrorCategory::format, fmt::format("{}: byte {}: {}", name, offset, m));
  };
  if (raw_layer < 1 || raw_layer > kMaxTraceLayers)
    bad(8, fmt::format("n_layer {} is outside 1..{}", raw_layer, kMaxTraceLayers));
  if (raw_expert < 1 || raw_expert > kMaxTraceExperts)
    bad(12, fmt::format("n_expert {} is outside 1..{}", raw_expert, kMaxTraceExperts));
  s.n_layer = static_cast<int32_t>(raw_layer);
  s.n_expert = static_cast<int32_t>(raw_expert);
  if (raw_used < 1 || raw_used > std::min<uint32_t>(raw_expert, kMaxTraceExpertsUsed))
    bad(16, fmt::format("n_expert_used {} is outside 1..{} (n_expert {})", raw_used,
                        std::min<uint32_t>(raw_expert, kMaxTraceExpertsUsed), raw_expert));
  s.n_expert_used = static_cast<int32_t>(raw_used);
  if ((flags & ~kTraceHasWeights) != 0)
    fail(ErrorCategory::unsupported,
         fmt::format("{}: byte 20: unknown flag bits 0x{:x} (this berth knows 0x{:x}: weights)",
                     name, flags & ~kTraceHasWeights, kTraceHasWeights));
  s.has_weights = (flags & kTraceHasWeights) != 0;
  *n_tokens = load_u64(p + 24);
  const uint64_t table_end = static_cast<uint64_t>(s.data_offset());
  s.blocks.resize(static_cast<size_t>(s.n_layer));
  for (int32_t l = 0; l < s.n_layer; ++l) {
    const uint64_t off = kTraceHeaderBytes + uint64_t{4} * static_cast<uint64_t>(l);
    if (off + 4 > size)
      fail(ErrorCategory::format,
           fmt::format("{}: byte {}: truncated block table at layer {}: the file has {} bytes, "
                       "the table of n_layer {} ends at byte {}",
                       name, size, l, size, s.n_layer, table_end));
    const uint32_t b = load_u32(p + off);
    if (b > static_cast<uint32_t>(INT32_MAX))
      fail(ErrorCategory::format, fmt::format("{}: byte {}: layer {}: block index {} is above {}",
                                              name, off, l, b, INT32_MAX));
    if (l > 0 && static_cast<int32_t>(b) <= s.blocks[static_cast<size_t>(l - 1)])
      fail(ErrorCategory::format,
           fmt::format("{}: byte {}: layer {}: block index {} is not above the previous layer's "
                       "({}): the block table must increase strictly",
                       name, off, l, b, s.blocks[static_cast<size_t>(l - 1)]));
    s.blocks[static_cast<size_t>(l)] = static_cast<int32_t>(b);
  }
  return s;
}

// The byte count the header promises, or an error when the file's size disagrees.
void check_size(const TraceShape& s, uint64_t n_tokens, uint64_t size, std::string_view name) {
  const uint64_t start = static_cast<uint64_t>(s.data_offset());
  const uint64_t rec = static_cast<uint64_t>(s.record_bytes());
  const uint64_t have_tokens = (size - start) / rec;  // size >= start (block table parsed)
  if (n_tokens > have_tokens) {
    // The first incomplete record and the part of it where the data ends.
    const uint64_t t = have_tokens;
    const uint64_t in_rec = size - start - t * rec;
    std::string part;
    if (in_rec == 0) {
      part = "its kind byte";
    } else {
      const uint64_t ids_bytes = static_cast<uint64_t>(s.ids_per_token() * s.id_bytes());
      const uint64_t pos = in_rec - 1;
      const bool in_ids = pos < ids_bytes;
      const uint64_t per_layer = static_cast<uint64_t>(s.n_expert_used) *
                                 (in_ids ? static_cast<uint64_t>(s.id_bytes()) : 2);
      const uint64_t layer = (in_ids ? pos : pos - ids_bytes) / per_layer;
      part = fmt::format("layer {} (block {}), its {}", layer, s.blocks[static_cast<size_t>(layer)],
                         in_ids ? "ids" : "weights");
    }
    fail(ErrorCategory::format,
         fmt::format("{}: byte {}: truncated in token {} at {}: the header's n_tokens {} needs "
                     "that many records of {} bytes from byte {}",
                     name, size, t, part, n_tokens, rec, start));
  }
  const uint64_t end = start + n_tokens * rec;
  if (size > end)
    fail(ErrorCategory::format,
         fmt::format("{}: byte {}: {} bytes after the last of the header's n_tokens {} records",
                     name, end, size - end, n_tokens));
}

}  // namespace

RoutingTrace parse_routing_trace(std::span<const uint8_t> bytes, std::string_view name) {
  uint64_t n_tokens = 0;
  RoutingTrace tr;
  tr.shape = parse_header(bytes, name, &n_tokens);
  const TraceShape& s = tr.shape;
  check_size(s, n_tokens, bytes.size(), name);

  const int64_t n = static_cast<int64_t>(n_tokens);
  const int32_t k = s.n_expert_used;
  const int32_t idb = s.id_bytes();
  const int64_t rec = s.record_bytes();
  tr.kinds.resize(static_cast<size_t>(n));
  tr.ids.resize(static_cast<size_t>(n * s.ids_per_token()));
  if (s.has_weights) tr.weights.resize(tr.ids.size());
  std::vector<uint32_t> seen(static_cast<size_t>(s.n_expert), 0);  // stamp per (token, layer)
  uint32_t stamp = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t r0 = s.data_offset() + t * rec;
    const uint8_t kind = bytes[static_cast<size_t>(r0)];
    if (kind > 1)
      fail(ErrorCategory::format,
           fmt::format("{}: byte {}: token {}: kind {} is neither 0 (prefill) nor 1 (decode)", name,
                       r0, t, kind));
    tr.kinds[static_cast<size_t>(t)] = static_cast<TokenKind>(kind);
    const uint8_t* ids = bytes.data() + r0 + 1;
    uint16_t* out = tr.ids.data() + t * s.ids_per_token();
    for (int32_t l = 0; l < s.n_layer; ++l) {
      if (++stamp == 0) {  // wrapped: clear the stamps
        std::fill(seen.begin(), seen.end(), 0);
        stamp = 1;
      }
      for (int32_t j = 0; j < k; ++j) {
        const int64_t i = int64_t{l} * k + j;
        const uint8_t* q = ids + i * idb;
        const uint32_t id = idb == 1 ? uint32_t{q[0]} : uint32_t{q[0]} | uint32_t{q[1]} << 8;
        const int64_t off = r0 + 1 + i * idb;
        if (id >= static_cast<uint32_t>(s.n_expert))
          fail(ErrorCategory::format,
               fmt::format("{}: slot {}: expert id {} >= n_expert {}",
                           where(name, off, t, l, s.blocks), j, id, s.n_expert));
        if (seen[id] == stamp)
          fail(ErrorCategory::format,
               fmt::format("{}: slot {}: expert id {} repeats within the token's top-{}",
                           where(name, off, t, l, s.blocks), j, id, k));
        seen[id] = stamp;
        out[i] = static_cast<uint16_t>(id);
      }
    }
    if (s.has_weights) {
      const int64_t w0 = r0 + 1 + s.ids_per_token() * idb;
      float* wout = tr.weights.data() + t * s.ids_per_token();
      for (int64_t i = 0; i < s.ids_per_token(); ++i) {
        const uint8_t* q = bytes.data() + w0 + 2 * i;
        const float w = fp16_to_f32(static_cast<uint16_t>(q[0] | q[1] << 8));
        if (!valid_weight(w))
          fail(ErrorCategory::format,
               fmt::format("{}: slot {}: weight {} is not a finite value >= 0",
                           where(name, w0 + 2 * i, t, static_cast<int32_t>(i / k), s.blocks), i % k,
                           w));
        wout[i] = w;
      }
    }
  }
  return tr;
}

RoutingTrace read_routing_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  struct stat st {};
  if (!in || ::stat(path.c_str(), &st) != 0)
    fail(ErrorCategory::io,
         fmt::format("{}: cannot open routing trace: {}", path, std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) fail(ErrorCategory::io, fmt::format("{}: not a regular file", path));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  auto read_at = [&](std::vector<uint8_t>& buf, uint64_t n) {
    buf.resize(static_cast<size_t>(n));
    in.seekg(0);
    if (!in.read(reinterpret_cast<char*>(buf.data()), static_cast<std::streamsize>(n)))
      fail(ErrorCategory::io, fmt::format("{}: read of {} bytes failed", path, n));
  };
  // Header and block table first: the size check needs them, and a bogus header must not make
  // us read (or allocate) a large file.
  std::vector<uint8_t> buf;
  read_at(buf, std::min<uint64_t>(size, kTraceHeaderBytes + uint64_t{4} * kMaxTraceLayers));
  uint64_t n_tokens = 0;
  const TraceShape s = parse_header(buf, path, &n_tokens);
  check_size(s, n_tokens, size, path);
  read_at(buf, size);
  return parse_routing_trace(buf, path);
}

// ---------------------------------------------------------------------------------------------
// Writing

RoutingTraceWriter::RoutingTraceWriter(const std::string& path, TraceShape shape)
    : path_(path), shape_(std::move(shape)) {
  validate_trace_shape(shape_);
  if (shape_.blocks.empty())
    for (int32_t l = 0; l < shape_.n_layer; ++l) shape_.blocks.push_back(l);
  f_ = std::fopen(path.c_str(), "wb");
  if (f_ == nullptr)
    fail(ErrorCategory::io,
         fmt::format("{}: cannot create routing trace: {}", path, std::strerror(errno)));
  std::vector<uint8_t> h(static_cast<size_t>(shape_.data_offset()));
  std::memcpy(h.data(), kTraceMagic, 4);
  store_u32(h.data() + 4, kTraceVersion);
  store_u32(h.data() + 8, static_cast<uint32_t>(shape_.n_layer));
  store_u32(h.data() + 12, static_cast<uint32_t>(shape_.n_expert));
  store_u32(h.data() + 16, static_cast<uint32_t>(shape_.n_expert_used));
  store_u32(h.data() + 20, shape_.has_weights ? kTraceHasWeights : 0u);
  store_u64(h.data() + 24, 0);
  for (int32_t l = 0; l < shape_.n_layer; ++l)
    store_u32(h.data() + kTraceHeaderBytes + 4 * l,
              static_cast<uint32_t>(shape_.blocks[static_cast<size_t>(l)]));
  write_bytes(h.data(), h.size());
  record_.resize(static_cast<size_t>(shape_.record_bytes()));
  step_have_.assign(static_cast<size_t>(shape_.n_layer), 0);
}

RoutingTraceWriter::~RoutingTraceWriter() {
  try {
    finish();
  } catch (const Error& e) {
    log::error("{}", e.what());
  }
}

void RoutingTraceWriter::write_bytes(const void* p, size_t n) {
  if (std::fwrite(p, 1, n, f_) != n)
    fail(ErrorCategory::io, fmt::format("{}: write failed after {} tokens: {}", path_, n_tokens_,
                                        std::strerror(errno)));
}

void RoutingTraceWriter::check_token(std::span<const uint16_t> ids, std::span<const float> weights,
                                     int64_t token) const {
  const int64_t n = shape_.ids_per_token();
  if (static_cast<int64_t>(ids.size()) != n)
    fail(ErrorCategory::invalid_argument,
         fmt::format("{}: token {}: {} ids, expected n_layer * n_expert_used = {}", path_, token,
                     ids.size(), n));
  if (static_cast<int64_t>(weights.size()) != (shape_.has_weights ? n : 0))
    fail(ErrorCategory::invalid_argument,
         fmt::format("{}: token {}: {} weights, expected {}", path_, token, weights.size(),
                     shape_.has_weights ? n : 0));
  const int32_t k = shape_.n_expert_used;
  for (int32_t l = 0; l < shape_.n_layer; ++l) {
    for (int32_t j = 0; j < k; ++j) {
      const size_t i = static_cast<size_t>(l) * k + j;
      const auto where = [&] {
        return fmt::format("{}: token {}, layer {} (block {}), slot {}", path_, token, l,
                           shape_.blocks[static_cast<size_t>(l)], j);
      };
      if (ids[i] >= shape_.n_expert)
        fail(ErrorCategory::invalid_argument,
             fmt::format("{}: expert id {} >= n_expert {}", where(), ids[i], shape_.n_expert));
      for (int32_t j2 = 0; j2 < j; ++j2)
        if (ids[static_cast<size_t>(l) * k + j2] == ids[i])
          fail(ErrorCategory::invalid_argument,
               fmt::format("{}: expert id {} repeats within the token's top-{}", where(), ids[i],
                           k));
      if (shape_.has_weights && !valid_weight(weights[i]))
        fail(ErrorCategory::invalid_argument,
             fmt::format("{}: weight {} is not a finite value >= 0", where(), weights[i]));
    }
  }
}

void RoutingTraceWriter::append_token(TokenKind kind, std::span<const uint16_t> ids,
                                      std::span<const float> weights) {
  if (f_ == nullptr)
    fail(ErrorCategory::invalid_argument, fmt::format("{}: append after finish", path_));
  if (kind != TokenKind::prefill && kind != TokenKind::decode)
    fail(ErrorCategory::invalid_argument,
         fmt::format("{}: token {}: kind {} is neither prefill (0) nor decode (1)", path_,
                     n_tokens_, static_cast<int>(kind)));
  check_token(ids, weights, n_tokens_);
  uint8_t* r = record_.data();
  *r++ = static_cast<uint8_t>(kind);
  for (uint16_t id : ids) {
    *r++ = static_cast<uint8_t>(id);
    if (shape_.id_bytes() == 2) *r++ = static_cast<uint8_t>(id >> 8);
  }
  for (float w : weights) {
    const uint16_t h = f32_to_fp16(w);
    *r++ = static_cast<uint8_t>(h);
    *r++ = static_cast<uint8_t>(h >> 8);
  }
  write_bytes(record_.data(), record_.size());
  ++n_tokens_;
}

void RoutingTraceWriter::begin_step(TokenKind kind, int64_t n_tokens) {
  if (in_step_)
    fail(ErrorCategory::invalid_argument,
         fmt::format("{}: begin_step inside a step (after token {})", path_, n_tokens_));
  if (n_tokens < 1 || n_tokens > (int64_t{1} << 24))
    fail(ErrorCategory::invalid_argument,
         fmt::format("{}: begin_step: n_tokens {} is outside 1..2^24", path_, n_tokens));
  in_step_ = true;
  step_kind_ = kind;
  step_tokens_ = n_tokens;
  step_ids_.assign(static_cast<size_t>(n_tokens * shape_.ids_per_token()), 0);
  if (shape_.has_weights) step_weights_.assign(step_ids_.size(), 0.0f);
  std::fill(step_have_.begin(), step_have_.end(), 0);
}

void RoutingTraceWriter::add_layer_route(int32_t layer, const float* route) {
  if (!in_step_)
    fail(ErrorCategory::invalid_argument,
         fmt::format("{}: add_layer_route outside a step (after token {})", path_, n_tokens_));
  if (layer < 0 || layer >= shape_.n_layer)
    fail(ErrorCategory::invalid_argument,
         fmt::format("{}: add_layer_route: layer {} is outside 0..{}", path_, layer,
                     shape_.n_layer - 1));
  if (step_have_[static_cast<size_t>(layer)])
    fail(ErrorCategory::invalid_argument,
         fmt::format("{}: token {}: layer {} given twice in one step", path_, n_tokens_, layer));
  const int32_t k = shape_.n_expert_used;
  for (int64_t t = 0; t < step_tokens_; ++t) {
    const float* row = route + t * 2 * k;
    const size_t base = static_cast<size_t>((t * shape_.n_layer + layer) * k);
    for (int32_t j = 0; j < k; ++j) {
      const float id = row[j];
      if (!(id >= 0.0f && id < static_cast<float>(shape_.n_expert)) || id != std::floor(id))
        fail(ErrorCategory::invalid_argument,
             fmt::format("{}: token {}, layer {}, slot {}: route id {} is not an expert id "
                         "below n_expert {}",
                         path_, n_tokens_ + t, layer, j, id, shape_.n_expert));
      step_ids_[base + static_cast<size_t>(j)] = static_cast<uint16_t>(id);
      if (shape_.has_weights) step_weights_[base + static_cast<size_t>(j)] = row[k + j];
    }
  }
  step_have_[static_cast<size_t>(layer)] = 1;
}

void RoutingTraceWriter::end_step() {
  if (!in_step_)
    fail(ErrorCategory::invalid_argument,
         fmt::format("{}: end_step outside a step (after token {})", path_, n_tokens_));
  for (int32_t l = 0; l < shape_.n_layer; ++l)
    if (!step_have_[static_cast<size_t>(l)])
      fail(ErrorCategory::invalid_argument,
           fmt::format("{}: token {}: end_step without layer {} (block {})", path_, n_tokens_, l,
                       shape_.blocks[static_cast<size_t>(l)]));
  in_step_ = false;
  const int64_t n = shape_.ids_per_token();
  // Validate the whole step before writing any of it.
  for (int64_t t = 0; t < step_tokens_; ++t)
    check_token({step_ids_.data() + t * n, static_cast<size_t>(n)},
                shape_.has_weights
                    ? std::span<const float>(step_weights_.data() + t * n, static_cast<size_t>(n))
                    : std::span<const float>(),
                n_tokens_ + t);
  for (int64_t t = 0; t < step_tokens_; ++t)
    append_token(step_kind_, {step_ids_.data() + t * n, static_cast<size_t>(n)},
                 shape_.has_weights
                     ? std::span<const float>(step_weights_.data() + t * n, static_cast<size_t>(n))
                     : std::span<const float>());
}

void RoutingTraceWriter::finish() {
  if (f_ == nullptr) return;
  std::FILE* f = f_;
  f_ = nullptr;
  uint8_t n[8];
  store_u64(n, static_cast<uint64_t>(n_tokens_));
  const bool ok = std::fseek(f, 24, SEEK_SET) == 0 && std::fwrite(n, 1, 8, f) == 8;
  const int err = errno;
  if (std::fclose(f) != 0 || !ok)
    fail(ErrorCategory::io, fmt::format("{}: finishing the routing trace ({} tokens) failed: {}",
                                        path_, n_tokens_, std::strerror(ok ? errno : err)));
}

void write_routing_trace(const std::string& path, const RoutingTrace& trace) {
  const TraceShape& s = trace.shape;
  validate_trace_shape(s);
  const size_t n = static_cast<size_t>(trace.n_tokens());
  const size_t per = static_cast<size_t>(s.ids_per_token());
  if (trace.ids.size() != n * per || trace.weights.size() != (s.has_weights ? n * per : 0))
    fail(ErrorCategory::invalid_argument,
         fmt::format("{}: routing trace of {} tokens has {} ids and {} weights (expected {} and "
                     "{})",
                     path, n, trace.ids.size(), trace.weights.size(), n * per,
                     s.has_weights ? n * per : 0));
  RoutingTraceWriter w(path, s);
  for (size_t t = 0; t < n; ++t)
    w.append_token(trace.kinds[t], {trace.ids.data() + t * per, per},
                   s.has_weights ? std::span<const float>(trace.weights.data() + t * per, per)
                                 : std::span<const float>());
  w.finish();
}

// ---------------------------------------------------------------------------------------------
// Replay

RoutingReplay::RoutingReplay(RoutingTrace trace, std::string name,
                             std::span<const int32_t> moe_blocks, int32_t n_expert,
                             int32_t n_expert_used)
    : trace_(std::move(trace)) {
  const TraceShape& s = trace_.shape;
  auto list = [](std::span<const int32_t> v) {
    std::string out;
    for (size_t i = 0; i < v.size() && i < 8; ++i) out += fmt::format("{}{}", i ? "," : "", v[i]);
    return v.size() > 8 ? out + fmt::format(",... ({} layers)", v.size()) : out;
  };
  std::string bad;
  if (trace_.n_tokens() == 0)
    bad = "the trace has no tokens";
  else if (s.n_expert != n_expert)
    bad = fmt::format("the trace has n_expert {}, the model {}", s.n_expert, n_expert);
  else if (s.n_expert_used != n_expert_used)
    bad =
        fmt::format("the trace has n_expert_used {}, the model {}", s.n_expert_used, n_expert_used);
  else if (!std::equal(s.blocks.begin(), s.blocks.end(), moe_blocks.begin(), moe_blocks.end()))
    bad = fmt::format("the trace's MoE layers are blocks {}, the model's {}", list(s.blocks),
                      list(moe_blocks));
  if (!bad.empty())
    fail(ErrorCategory::invalid_argument,
         fmt::format("{}: routing trace does not fit the model: {}", name, bad));
  layer_of_block_.assign(static_cast<size_t>(s.blocks.back()) + 1, -1);
  for (int32_t l = 0; l < s.n_layer; ++l)
    layer_of_block_[static_cast<size_t>(s.blocks[static_cast<size_t>(l)])] = l;
}

std::span<const uint16_t> RoutingReplay::ids(int64_t token, int32_t block) const {
  BERTH_CHECK(
      token >= 0 && block >= 0 && static_cast<size_t>(block) < layer_of_block_.size() &&
          layer_of_block_[static_cast<size_t>(block)] >= 0,
      fmt::format("routing replay: token {}, block {} is not a traced MoE layer", token, block));
  return trace_.token_ids(token % trace_.n_tokens(), layer_of_block_[static_cast<size_t>(block)]);
}

// ---------------------------------------------------------------------------------------------
// Text dump

std::string dump_routing_trace(const RoutingTrace& trace, int64_t first, int64_t count,
                               bool header) {
  const TraceShape& s = trace.shape;
  std::string out;
  if (header)
    out = fmt::format(
        "# routing trace: n_layer {}, n_expert {}, n_expert_used {}, n_tokens {}, weights {}\n"
        "# token kind layer block: ids in top-k order{}\n",
        s.n_layer, s.n_expert, s.n_expert_used, trace.n_tokens(), s.has_weights ? "yes" : "no",
        s.has_weights ? " (id:weight)" : "");
  first = std::clamp<int64_t>(first, 0, trace.n_tokens());
  const int64_t end = count >= trace.n_tokens() - first ? trace.n_tokens() : first + count;
  for (int64_t t = first; t < end; ++t) {
    for (int32_t l = 0; l < s.n_layer; ++l) {
      out += fmt::format("{} {} {} {}:", t, token_kind_name(trace.kinds[static_cast<size_t>(t)]), l,
                         s.blocks[static_cast<size_t>(l)]);
      const auto ids = trace.token_ids(t, l);
      for (size_t j = 0; j < ids.size(); ++j) {
        if (s.has_weights)
          out += fmt::format(
              " {}:{:.4f}", ids[j],
              trace.weights[static_cast<size_t>((t * s.n_layer + l) * s.n_expert_used) + j]);
        else
          out += fmt::format(" {}", ids[j]);
      }
      out += '\n';
    }
  }
  return out;
}

}  // namespace berth::residency
