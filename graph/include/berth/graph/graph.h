// The step graph: the op IR that models emit and executors run.
//
// A graph describes one forward step over a ubatch of `n_tokens` tokens (prefill: many,
// decode: one). It names no device: every op names the weights it reads (by index into the
// model's WeightTable) and placement/executors decide where each op runs. Activations are
// f32 matrices of shape [rows, cols], row-major (cols contiguous), where a row is one token.
//
// Inputs at run time: the token ids and positions of the ubatch (n_tokens int32 each).
// The graph's output value holds the logits, [n_out, n_vocab], one row per requested token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "berth/core/tensor.h"

namespace berth::graph {

using ValueId = int32_t;
using WeightId = int32_t;
inline constexpr ValueId kNoValue = -1;
inline constexpr WeightId kNoWeight = -1;

/// What a weight is for, as the architecture that reads it declares: placement decides homes by
/// role (and by layer), never by the tensor's name (only `-ot REGEX=DEVICE` matches names).
enum class WeightRole : uint8_t {
  other,          ///< none of the below (placement keeps it with its layer)
  embedding,      ///< token embeddings (token_embd)
  norm,           ///< a norm's scale (per layer, or the output norm with layer -1)
  attention,      ///< attention projections, their biases and per-head norms; a Gated
                  ///< DeltaNet's projections, conv and gates (the layer's token mixer)
  dense_ffn,      ///< a dense feed-forward's matrices
  router,         ///< a MoE layer's router (ffn_gate_inp)
  routed_expert,  ///< stacked routed experts (ffn_{gate,up,down}_exps)
  shared_expert,  ///< a MoE layer's shared expert
  head,           ///< the output projection to the vocabulary
};
std::string_view role_name(WeightRole r);

/// The weights a model reads, in a fixed order; ops refer to them by index. Each entry is a view
/// of the weight as stored (type, shape, bytes in host memory) with its role and its layer (-1:
/// none, e.g. token_embd, output_norm, output).
struct WeightTable {
  std::vector<TensorView> tensors;
  std::vector<WeightRole> roles;
  std::vector<int32_t> layers;
  WeightId add(TensorView t, WeightRole role = WeightRole::other, int32_t layer = -1) {
    tensors.push_back(std::move(t));
    roles.push_back(role);
    layers.push_back(layer);
    return static_cast<WeightId>(tensors.size() - 1);
  }
  const TensorView& operator[](WeightId id) const { return tensors.at(static_cast<size_t>(id)); }
  WeightRole role(WeightId id) const { return roles.at(static_cast<size_t>(id)); }
  int32_t layer(WeightId id) const { return layers.at(static_cast<size_t>(id)); }
  size_t size() const { return tensors.size(); }
};

/// Rotary embedding layouts. `adjacent`: pairs (x[2i], x[2i+1]) — GGUF `llama` files.
/// `neox`: pairs (x[i], x[i + n_rot/2]) — GPT-NeoX / Qwen files. (RoFormer, arXiv:2104.09864.)
enum class RopeMode { adjacent, neox };

enum class OpKind {
  /// out[t] = row tokens[t] of weight (ne = {n_embd, n_vocab}), dequantized. out [n_tokens, n_embd]
  embed,
  /// out = in / sqrt(mean(in^2) + eps) * weight (per row; weight ne = {cols}). With
  /// Op::norm_group = g > 0, each run of g consecutive columns (one attention head) is normalised
  /// on its own and the weight has ne = {g} (Qwen3's per-head Q/K norm).
  rms_norm,
  /// out[t, o] = sum_i weight[o, i] * in[t, i]; weight ne = {n_in, n_out}. out [rows, n_out]
  matmul,
  /// out = in0 + in1 (same shape)
  add,
  /// out = silu(in0) * in1, silu(z) = z / (1 + exp(-z)) (SwiGLU, arXiv:2002.05202)
  swiglu,
  /// Rotary position embedding of each head of `in` ([rows, n_head * head_dim]) at the
  /// ubatch's positions; the first n_rot dims of each head rotate, theta_i = pos *
  /// base^(-2i/n_rot).
  rope,
  /// Causal grouped-query attention. in0 = q [n_tokens, n_head*head_dim], in1 = k,
  /// in2 = v ([n_tokens, n_head_kv*head_dim]). Appends k, v to the KV cache of `layer` at the
  /// ubatch's positions, then each token attends to cache positions 0..its own position.
  /// out [n_tokens, n_head*head_dim].
  attention,
  /// out = the last `n_out` rows of in0 (selects the tokens whose logits are wanted).
  take_last_rows,
  /// out[t, :] = in0[t, :] + weight (a bias row; weight ne = {cols}, F32).
  add_bias,
  /// Router of a Mixture-of-Experts layer. in0 = router logits [n_tokens, n_expert]. For each
  /// token: p = softmax(logits) (computed in double), the n_expert_used largest p are selected
  /// (ties: lowest expert id first; selected in descending p), their weights are the selected p,
  /// divided by their sum when MoeParams::norm_weights. out [n_tokens, 2 * n_expert_used]:
  /// columns [0, k) hold the expert ids (as exact float integers), [k, 2k) the weights
  /// (rounded to float from double). Shazeer et al. 2017 (arXiv:1701.06538); Mixtral
  /// (arXiv:2401.04088) renormalises, Qwen3-MoE too.
  moe_route,
  /// Routed experts. in0 = h [n_tokens, n_embd] (the normed FFN input), in1 = the moe_route
  /// output. Weights (MoeParams) are stacked expert tensors: gate/up ne = {n_embd, n_ff_exp,
  /// n_expert}, down ne = {n_ff_exp, n_embd, n_expert}; expert e's matrix is rows
  /// [e * n_out, (e + 1) * n_out) of the 2-D view. out[t] = sum over the token's slots j (in slot
  /// order) of MoeParams' slot range whose expert the op computes (MoeParams::set: all, a list,
  /// or the experts a layer's slot table marks resident / not resident at run time) of
  /// w_j * down_e(silu(gate_e h_t) * up_e h_t); zero when none is. Each expert is separate work
  /// an executor may place on its own device: two ops over disjoint expert sets add up to the
  /// whole layer.
  moe_experts,
  /// Columns of each group: in0 [rows, n_group * group]; out [rows, n_group * SliceParams::len],
  /// out[r, j * len + i] = in0[r, j * group + offset + i] (0 <= offset, offset + len <= group).
  /// Splits interleaved per-head blocks, e.g. Qwen3.5's attn_q output, per head 256 query
  /// columns then 256 gate columns: offset 0 gives the queries, offset 256 the gates.
  head_slice,
  /// out = in0 * sigmoid(in1), sigmoid(z) = 1 / (1 + exp(-z)). in1 has in0's shape (an
  /// elementwise gate: the attention output gate of Qwen3.5 / Qwen3-Next) or [rows, 1] (one
  /// gate per row, broadcast over the columns: the shared-expert gate of qwen35moe). out has
  /// in0's shape.
  sigmoid_mul,
  /// Causal depthwise conv1d over a per-sequence rolling state, then SiLU (the short
  /// convolution of a Gated DeltaNet layer). in0 = x [n_tokens, C]; weight = ssm_conv1d
  /// (ne {kernel, C}, F32: channel c's taps at [c * kernel + i], i = 0 the oldest input).
  /// State: the conv state of layer SsmParams::layer (KvView::conv), kernel - 1 rows of C per
  /// sequence, row kernel - 2 the newest input. Each token t of sequence s (Graph inputs' seq
  /// ids) is computed in ubatch order against s's state: out[t, c] = silu(sum_i w[c, i] *
  /// window_t,c[i]) where the window is the last `kernel` inputs of s up to and including t;
  /// the state then holds s's last kernel - 1 inputs. A sequence's state is taken as zero at
  /// position 0 (its first token). out [n_tokens, C].
  ssm_conv,
  /// The gated delta rule of a Gated DeltaNet layer (arXiv:2412.06464), with its gates and the
  /// L2 norm of q and k. in0 = y [n_tokens, 2 * H_k * d_k + H_v * d_v], the conv output: the
  /// q heads, then the k heads (H_k of d_k each), then the v heads (H_v of d_v); in1 = alpha
  /// [n_tokens, H_v] (W_ssm_alpha x), in2 = b [n_tokens, H_v] (W_ssm_beta x); weight = ssm_a
  /// (ne {H_v}, F32, stored as -exp(A_log)), SsmParams::dt_bias = ssm_dt.bias (ne {H_v}, F32).
  /// Per token (of sequence s, in ubatch order) and V head h, with K head j = h mod H_k:
  ///   q, k = l2_norm(q_j), l2_norm(k_j) (eps SsmParams::eps); beta = sigmoid(b_h);
  ///   g = ssm_a_h * softplus(alpha_h + dt_bias_h);  S_h = exp(g) S_h;
  ///   S_h += k (beta (v_h - S_h^T k))^T;  out[t, h * d_v + i] = (S_h^T q)_i / sqrt(d_k)
  /// S_h: sequence s's f32 state of layer SsmParams::layer (KvView::ssm), d_k x d_v per V head
  /// (d_v contiguous), zero at position 0. out [n_tokens, H_v * d_v].
  gated_delta,
  /// Gated RMSNorm per group (the GDN output norm, "norm before gate"): in0 = x, in1 = z (same
  /// shape [rows, n * g], g = Op::norm_group), weight ne {g}: out = x / sqrt(mean_group(x^2) +
  /// eps) * weight * silu(z), each run of g columns normalised on its own. out: x's shape.
  rms_norm_gated,
};

std::string_view op_name(OpKind k);
/// The number of op kinds (OpKind values are 0 .. kNumOpKinds - 1; rms_norm_gated is the last).
inline constexpr size_t kNumOpKinds = static_cast<size_t>(OpKind::rms_norm_gated) + 1;

/// The ops the Qwen3.5 hybrids added (head_slice, sigmoid_mul, ssm_conv, gated_delta,
/// rms_norm_gated).
constexpr bool is_hybrid_op(OpKind k) {
  return k == OpKind::head_slice || k == OpKind::sigmoid_mul || k == OpKind::ssm_conv ||
         k == OpKind::gated_delta || k == OpKind::rms_norm_gated;
}

struct RopeParams {
  int32_t n_head = 0;
  int32_t head_dim = 0;
  int32_t n_rot = 0;
  float freq_base = 10000.0f;
  RopeMode mode = RopeMode::adjacent;
};

struct AttentionParams {
  int32_t layer = 0;  ///< KV cache slot
  int32_t n_head = 0;
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;
  float scale = 1.0f;  ///< applied to q.k, usually 1/sqrt(head_dim)
};

/// Which experts a moe_experts op computes (MoeParams::set).
enum class ExpertSet : uint8_t {
  all,   ///< every expert
  list,  ///< the experts in MoeParams::experts (ascending)
  /// The experts the layer's expert->slot table marks resident (slot >= 0) at the step that
  /// runs the op: the device's side of a layer with expert slots (residency/expert_slots.h),
  /// reading each expert's matrices from its slot. Known only at run time.
  resident,
  /// The experts that table marks not resident (slot -1): the CPU's side of such a layer, reading
  /// the table's host mirror as of the step. Known only at run time.
  not_resident,
};
std::string_view expert_set_name(ExpertSet s);  ///< "all", "list", "resident", "not resident"

struct MoeParams {
  int32_t n_expert = 0;
  int32_t n_expert_used = 0;
  bool norm_weights = true;   ///< moe_route: renormalise the selected weights
  WeightId gate = kNoWeight;  ///< moe_experts: ffn_gate_exps
  WeightId up = kNoWeight;    ///< moe_experts: ffn_up_exps
  WeightId down = kNoWeight;  ///< moe_experts: ffn_down_exps
  /// moe_experts: which experts this op computes (see ExpertSet). A non-empty `experts` with
  /// set == all means list (the older spelling).
  ExpertSet set = ExpertSet::all;
  std::vector<int32_t> experts;  ///< moe_experts, set == list: the expert ids (ascending)
  /// moe_experts, set == resident: the slots of the layer's table (C; expert ids map to [0, C)).
  int32_t n_slots = 0;
  /// moe_experts: the route slots this op computes, [slot_begin, slot_end) of each token's
  /// n_expert_used (top-k order; slot_end -1 = all). Ops over disjoint slot ranges (or disjoint
  /// expert sets) of one route add up to the layer.
  int32_t slot_begin = 0;
  int32_t slot_end = -1;
  /// Whether the experts this op computes are fixed by the graph (set all or list), not by a
  /// run-time table.
  bool static_experts() const { return set == ExpertSet::all || set == ExpertSet::list; }
  /// True when this op computes expert e (static_experts() only). Throws Error(internal) for the
  /// run-time sets (resident, not_resident): their answer is in the layer's slot table.
  bool has_expert(int32_t e) const;
  /// True when this op computes route slot j (0 <= j < n_expert_used).
  bool has_slot(int32_t j) const { return j >= slot_begin && (slot_end < 0 || j < slot_end); }
};

/// head_slice: which columns of each group of `group` are kept.
struct SliceParams {
  int32_t group = 0;
  int32_t offset = 0;
  int32_t len = 0;
};

/// ssm_conv and gated_delta: the recurrent layer and its shapes.
struct SsmParams {
  int32_t layer = 0;     ///< the layer whose recurrent state (KvView::conv / ssm) the op uses
  int32_t n_k_head = 0;  ///< gated_delta: H_k (ssm.group_count)
  int32_t n_v_head = 0;  ///< gated_delta: H_v (ssm.time_step_rank), a multiple of H_k
  int32_t d_k = 0;       ///< gated_delta: K head size (ssm.state_size)
  int32_t d_v = 0;       ///< gated_delta: V head size (ssm.inner_size / H_v)
  float eps = 0.0f;      ///< gated_delta: the L2 norm's eps
  WeightId dt_bias = kNoWeight;  ///< gated_delta: ssm_dt.bias
};

struct Op {
  OpKind kind;
  std::vector<ValueId> inputs;
  ValueId output = kNoValue;
  WeightId weight = kNoWeight;
  float eps = 0.0f;        ///< rms_norm, rms_norm_gated
  int32_t n_out = 0;       ///< take_last_rows
  RopeParams rope;         ///< rope
  AttentionParams attn;    ///< attention
  int32_t norm_group = 0;  ///< rms_norm: > 0 normalises each run of this many columns;
                           ///< rms_norm_gated: the group (required)
  MoeParams moe;           ///< moe_route, moe_experts
  SliceParams slice;       ///< head_slice
  SsmParams ssm;           ///< ssm_conv, gated_delta
  std::string name;        ///< for traces, e.g. "blk.3.attn_q"
};

/// Shape of an activation value: rows x cols f32, cols contiguous.
struct ValueInfo {
  int64_t rows = 0;
  int64_t cols = 0;
  std::string name;
};

/// One forward step. Values are written exactly once, by the op that outputs them, and ops are
/// in a valid execution order (each op's inputs were produced by earlier ops).
struct Graph {
  int32_t n_tokens = 0;
  /// Decode rows: the last n_decode tokens of the step are generating sequences' tokens (each
  /// the only token of its sequence in the step), the others prompt tokens; every value's last
  /// min(rows, n_decode) rows are decode rows (take_last_rows keeps a suffix). A device computes
  /// a row by its kind, never by the step's size (issue 19: per-sequence results never depend
  /// on the batch). -1 (the default): 1 for a one-token step, else 0 (decode_rows()).
  int32_t n_decode = -1;
  /// Whether a prompt row's bits must not depend on the step's size either (a session of several
  /// sequences, whose prompt chunks share steps with other sequences' tokens). False (a session
  /// of one sequence): a device may multiply prompt rows by shape-dependent means (cuBLAS).
  bool batch_invariant = true;

  /// The decode rows among the last `rows` rows of a value (n_decode resolved as documented).
  int64_t decode_rows(int64_t rows) const {
    const int64_t d = n_decode >= 0 ? n_decode : (n_tokens == 1 ? 1 : 0);
    return d < rows ? d : rows;
  }
  std::vector<ValueInfo> values;
  std::vector<Op> ops;
  ValueId output = kNoValue;  ///< logits [n_out, n_vocab]

  /// Adds an activation value; returns its id.
  ValueId add_value(int64_t rows, int64_t cols, std::string name);
  /// Appends `op` (whose output must be a value of this graph); returns op.output.
  ValueId add_op(Op op);

  /// Checks ids, shapes and order; throws Error(internal) describing the first violation.
  void validate(const WeightTable& weights) const;
  /// A human-readable listing, one op per line.
  std::string to_string(const WeightTable& weights) const;
};

/// Convenience builder used by models: each method adds the op and its output value.
class Builder {
 public:
  Builder(const WeightTable& weights, int32_t n_tokens);

  ValueId embed(WeightId w, std::string name);
  ValueId rms_norm(ValueId x, WeightId w, float eps, std::string name);
  ValueId matmul(ValueId x, WeightId w, std::string name);
  ValueId add(ValueId a, ValueId b, std::string name);
  ValueId swiglu(ValueId gate, ValueId up, std::string name);
  ValueId rope(ValueId x, const RopeParams& p, std::string name);
  ValueId attention(ValueId q, ValueId k, ValueId v, const AttentionParams& p, std::string name);
  ValueId take_last_rows(ValueId x, int32_t n_out, std::string name);
  /// Per-head RMSNorm: each run of `group` columns of x normalised with weight w (ne {group}).
  ValueId rms_norm_grouped(ValueId x, WeightId w, int32_t group, float eps, std::string name);
  ValueId add_bias(ValueId x, WeightId bias, std::string name);
  ValueId moe_route(ValueId router_logits, const MoeParams& p, std::string name);
  ValueId moe_experts(ValueId h, ValueId route, const MoeParams& p, std::string name);
  ValueId head_slice(ValueId x, const SliceParams& p, std::string name);
  ValueId sigmoid_mul(ValueId x, ValueId gate, std::string name);
  ValueId ssm_conv(ValueId x, WeightId conv1d, const SsmParams& p, std::string name);
  ValueId gated_delta(ValueId y, ValueId alpha, ValueId b, WeightId ssm_a, const SsmParams& p,
                      std::string name);
  ValueId rms_norm_gated(ValueId x, ValueId z, WeightId w, int32_t group, float eps,
                         std::string name);

  const ValueInfo& info(ValueId v) const { return g_.values.at(static_cast<size_t>(v)); }
  /// Sets the output and returns the finished, validated graph.
  Graph finish(ValueId logits);

 private:
  const WeightTable& weights_;
  Graph g_;
};

}  // namespace berth::graph
