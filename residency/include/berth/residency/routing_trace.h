// Routing traces: the experts a Mixture-of-Experts model's routers chose, token by token and
// layer by layer, recorded from a run or generated (trace_gen.h), replayed by benchmarks so that
// residency policies are measured on realistic routing rather than on what random weights pick.
//
// File format, version 1 (berth's own; all integers little-endian, no padding):
//
//   offset  size            field
//   0       4               magic "BRTR" (bytes 0x42 0x52 0x54 0x52)
//   4       4   u32         version = 1
//   8       4   u32         n_layer: MoE layers recorded, 1..kMaxTraceLayers
//   12      4   u32         n_expert: experts per MoE layer, 1..kMaxTraceExperts
//   16      4   u32         n_expert_used: experts chosen per token (top-k), 1..min(n_expert, 256)
//   20      4   u32         flags: bit 0 (kTraceHasWeights) = routing weights follow the ids;
//                           the other bits must be 0
//   24      8   u64         n_tokens: token records that follow
//   32      4*n_layer u32   block[l]: the model's layer index (GGUF "blk.N") of MoE layer l,
//                           strictly increasing (models with leading dense layers, e.g.
//                           DeepSeek's first_k_dense_replace, start above 0)
//   then n_tokens records of record_bytes() each, in the order the model processed the tokens:
//     u8                    kind: 0 = prefill (a prompt token), 1 = decode (a generated token)
//     ids                   n_layer * n_expert_used expert ids, [n_layer][n_expert_used] with
//                           the n_expert_used axis contiguous, in the router's top-k order
//                           (descending weight); u8 each when n_expert <= 256, else u16;
//                           distinct within one (token, layer)
//     weights (bit 0)       n_layer * n_expert_used routing weights as IEEE binary16, same
//                           order; finite and >= 0 (the weights the router applied, after any
//                           renormalisation)
//
// Size: 32 + 4 * n_layer + n_tokens * (1 + n_layer * n_expert_used * (id bytes + 2 if weights)).
// A 100k-token trace of a 48-layer, 128-expert, top-8 model is 38.5 MB (77 MB with weights).
// The file has no alignment: readers decode it byte by byte. Nothing follows the last record.
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace berth::residency {

inline constexpr char kTraceMagic[4] = {'B', 'R', 'T', 'R'};
inline constexpr uint32_t kTraceVersion = 1;
inline constexpr uint32_t kTraceHasWeights = 1u << 0;  ///< flags bit 0
inline constexpr uint32_t kTraceHeaderBytes = 32;      ///< before the block table
inline constexpr uint32_t kMaxTraceLayers = 4096;
inline constexpr uint32_t kMaxTraceExperts = 65536;
inline constexpr uint32_t kMaxTraceExpertsUsed = 256;

/// What a token was: one of a prompt's tokens (processed in a prefill ubatch) or a generated one
/// (one decode step). Stored as the record's first byte.
enum class TokenKind : uint8_t { prefill = 0, decode = 1 };
std::string_view token_kind_name(TokenKind k);  ///< "prefill" / "decode"

/// The shape of a trace (the header without n_tokens).
struct TraceShape {
  int32_t n_layer = 0;        ///< MoE layers
  int32_t n_expert = 0;       ///< experts per MoE layer
  int32_t n_expert_used = 0;  ///< top-k
  bool has_weights = false;   ///< records carry routing weights
  /// Model layer index of each MoE layer, n_layer entries, strictly increasing; empty means
  /// 0..n_layer-1 (a model whose every layer is MoE).
  std::vector<int32_t> blocks;

  int64_t ids_per_token() const { return int64_t{n_layer} * n_expert_used; }
  int32_t id_bytes() const { return n_expert <= 256 ? 1 : 2; }
  /// Bytes of one token record in the file.
  int64_t record_bytes() const;
  /// Bytes of the header and block table (where the first record starts).
  int64_t data_offset() const { return kTraceHeaderBytes + int64_t{4} * n_layer; }
};

/// Throws Error(invalid_argument) naming the field when `s` is outside the format's limits
/// (n_layer 1..4096, n_expert 1..65536, n_expert_used 1..min(n_expert, 256), blocks empty or
/// n_layer strictly increasing values >= 0).
void validate_trace_shape(const TraceShape& s);

/// A routing trace in memory.
struct RoutingTrace {
  TraceShape shape;              ///< blocks always filled (n_layer entries) after read or generate
  std::vector<TokenKind> kinds;  ///< [n_tokens]
  /// Expert ids, [n_tokens][n_layer][n_expert_used], the n_expert_used axis contiguous, each
  /// token's ids at one layer in top-k order and distinct, every id < n_expert.
  std::vector<uint16_t> ids;
  /// Routing weights in the layout of `ids` when shape.has_weights, else empty.
  std::vector<float> weights;

  int64_t n_tokens() const { return static_cast<int64_t>(kinds.size()); }
  /// The n_expert_used ids token `t` routed to at MoE layer `layer` (0 <= layer < n_layer).
  std::span<const uint16_t> token_ids(int64_t t, int32_t layer) const {
    return {ids.data() + (t * shape.n_layer + layer) * shape.n_expert_used,
            static_cast<size_t>(shape.n_expert_used)};
  }
  /// All ids of token `t`, [n_layer][n_expert_used].
  std::span<const uint16_t> token_ids(int64_t t) const {
    return {ids.data() + t * shape.ids_per_token(), static_cast<size_t>(shape.ids_per_token())};
  }
  /// The MoE layer index of model layer `block`, or -1 when the trace has no such layer (a
  /// dense layer).
  int32_t layer_of_block(int32_t block) const;
};

/// Decodes a trace from `bytes`; `name` (a file path) starts every error message.
/// Throws Error(format) for a bad magic, a header field out of range, a block table that is not
/// strictly increasing, a file shorter or longer than the header says, a kind byte other than
/// 0/1, an id >= n_expert, an id repeated within one token's top-k at one layer, a weight that is
/// negative, infinite or NaN; Error(unsupported) for another version or unknown flag bits. Each
/// message names the byte offset and, inside records, the token, the layer (and its block).
RoutingTrace parse_routing_trace(std::span<const uint8_t> bytes, std::string_view name);

/// Reads and validates the trace file at `path` (as parse_routing_trace). Checks the file's size
/// against its header before reading the records, so memory is bounded by the file's size.
/// Throws Error(io) when the file cannot be opened or read.
RoutingTrace read_routing_trace(const std::string& path);

/// Writes `trace` to `path` (replacing it). Throws Error(invalid_argument) when the trace is
/// inconsistent (shape limits, array sizes, ids out of range or repeated, bad weights) and
/// Error(io) when the file cannot be written.
void write_routing_trace(const std::string& path, const RoutingTrace& trace);

/// Writes a trace as it is produced, token by token or step by step, holding one step in memory.
/// n_tokens in the header is written when the writer finishes (finish() or the destructor), so a
/// run that ends early still leaves a valid trace of the tokens appended.
/// Not thread-safe: one thread appends.
class RoutingTraceWriter {
 public:
  /// Creates (truncates) `path` and writes the header. Throws Error(invalid_argument) for a bad
  /// shape, Error(io) when the file cannot be created.
  RoutingTraceWriter(const std::string& path, TraceShape shape);
  ~RoutingTraceWriter();
  RoutingTraceWriter(const RoutingTraceWriter&) = delete;
  RoutingTraceWriter& operator=(const RoutingTraceWriter&) = delete;

  /// Appends one token: `ids` [n_layer][n_expert_used] (top-k order), `weights` in the same
  /// layout when the shape has weights (else empty). Throws Error(invalid_argument) naming the
  /// token and layer for a kind other than prefill/decode, a wrong size, an id >= n_expert, a
  /// repeated id or a bad weight (nothing is written then); Error(io) when a write fails.
  void append_token(TokenKind kind, std::span<const uint16_t> ids,
                    std::span<const float> weights = {});

  /// Step-wise recording, the way an executor sees routing: begin_step, then for each MoE layer
  /// (any order) the moe_route output of the step's `n_tokens` tokens, then end_step, which
  /// appends the step's tokens in order. `route` is [n_tokens][2 * n_expert_used], row-major:
  /// columns [0, k) the ids as exact float integers, [k, 2k) the weights (graph.h, moe_route).
  /// Throws Error(invalid_argument) for a layer out of range or given twice, a bad id or weight,
  /// end_step with a layer missing (the step stays open), or begin_step inside a step. An
  /// end_step that finds a bad token drops the whole step: nothing of it is written.
  void begin_step(TokenKind kind, int64_t n_tokens);
  void add_layer_route(int32_t layer, const float* route);
  void end_step();

  /// Writes n_tokens into the header and closes the file. Throws Error(io) when that fails.
  /// Idempotent; appending afterwards throws Error(invalid_argument).
  void finish();

  int64_t n_tokens() const { return n_tokens_; }
  const TraceShape& shape() const { return shape_; }

 private:
  void check_token(std::span<const uint16_t> ids, std::span<const float> weights,
                   int64_t token) const;
  void write_bytes(const void* p, size_t n);

  std::string path_;
  TraceShape shape_;
  std::FILE* f_ = nullptr;
  int64_t n_tokens_ = 0;
  std::vector<uint8_t> record_;
  // Current step (begin_step .. end_step).
  bool in_step_ = false;
  TokenKind step_kind_ = TokenKind::decode;
  int64_t step_tokens_ = 0;
  std::vector<uint16_t> step_ids_;   // [step_tokens][n_layer][k]
  std::vector<float> step_weights_;  // same layout
  std::vector<uint8_t> step_have_;   // [n_layer]
};

/// Forces a run's routing from a trace (`bench model --routing-trace`): the run's token i
/// (prompt and generated tokens counted together from 0, in processing order) takes the
/// trace's token i mod n_tokens, so a trace shorter than the run repeats. The weights the
/// executor applies are its own (the router's probabilities of the forced experts), unless it
/// chooses to use the trace's.
class RoutingReplay {
 public:
  /// `moe_blocks`: the model's MoE layer indices in order; `n_expert`, `n_expert_used`: the
  /// model's. Throws Error(invalid_argument) naming `name` (the trace file) and the model's and
  /// the trace's values when the trace has no tokens or any of them differ.
  RoutingReplay(RoutingTrace trace, std::string name, std::span<const int32_t> moe_blocks,
                int32_t n_expert, int32_t n_expert_used);
  /// The n_expert_used ids (top-k order) of run token `token` >= 0 at model layer `block`, a MoE
  /// layer (else Error(internal)).
  std::span<const uint16_t> ids(int64_t token, int32_t block) const;
  const RoutingTrace& trace() const { return trace_; }

 private:
  RoutingTrace trace_;
  std::vector<int32_t> layer_of_block_;  // [max block + 1], -1 for dense layers
};

/// A text dump of tokens [first, first + count) (clamped to the trace): with `header`, two '#'
/// lines (the shape, the columns), then one line per (token, layer): "<token> <prefill|decode>
/// <layer> <block>: <id> <id> ..." with ids in top-k order, each followed by ":<weight>"
/// (4 decimals) when the trace has weights.
std::string dump_routing_trace(const RoutingTrace& trace, int64_t first = 0,
                               int64_t count = INT64_MAX, bool header = true);

}  // namespace berth::residency
