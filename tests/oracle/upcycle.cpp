// Upcycled-MoE test files from a dense llama GGUF. See upcycle.h.

#include "upcycle.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/types.h"

namespace berth::oracle {
namespace {

std::vector<int64_t> shape_of(const gguf::TensorInfo& t) {
  return std::vector<int64_t>(t.ne.begin(), t.ne.begin() + std::max<uint32_t>(t.n_dims, 1));
}

std::string shape_string(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

/// The tensor `name` of src, checked to have exactly shape `want`.
const gguf::TensorInfo& tensor_with_shape(const gguf::File& src, const std::string& name,
                                          const std::vector<int64_t>& want) {
  const gguf::TensorInfo& t = src.tensor(name);  // GgufError(missing_tensor)
  if (shape_of(t) != want) {
    throw Error(ErrorCategory::format, "upcycle: " + src.path() + ": tensor '" + name +
                                           "' has shape " + shape_string(shape_of(t)) +
                                           ", expected " + shape_string(want));
  }
  return t;
}

int64_t positive_key(const gguf::File& src, const std::string& k) {
  const int64_t v = src.get_int(k);  // GgufError(missing_key / wrong_type)
  if (v <= 0 || v > INT32_MAX) {
    throw Error(ErrorCategory::format, "upcycle: " + src.path() + ": key '" + k + "' = " +
                                           std::to_string(v) + ", expected a positive count");
  }
  return v;
}

/// A standard normal draw: Box-Muller over two 53-bit uniforms of a std::mt19937_64 (whose
/// output sequence the C++ standard fixes), so a seed gives the same values everywhere.
double normal_draw(std::mt19937_64& gen) {
  const double u1 = 1.0 - static_cast<double>(gen() >> 11) * 0x1.0p-53;  // (0, 1]
  const double u2 = static_cast<double>(gen() >> 11) * 0x1.0p-53;        // [0, 1)
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

/// `t`'s bytes repeated n_expert times: a stacked tensor of identical experts.
std::vector<uint8_t> repeat_bytes(const gguf::TensorInfo& t, int n_expert) {
  std::vector<uint8_t> out;
  out.reserve(static_cast<size_t>(t.n_bytes) * static_cast<size_t>(n_expert));
  for (int e = 0; e < n_expert; ++e) out.insert(out.end(), t.data, t.data + t.n_bytes);
  return out;
}

/// Rows of a Q or K weight (ne {n_embd, n_heads * head_dim}, any type) reordered within each
/// head from adjacent-pair RoPE order to NeoX order: new row i = old row 2i and new row
/// n_rot/2 + i = old row 2i + 1 for i < n_rot/2; rows n_rot..head_dim-1 stay in place.
std::vector<uint8_t> permute_rows_to_neox(const gguf::TensorInfo& t, int64_t head_dim,
                                          int64_t n_rot) {
  const size_t rb = row_bytes(t.type, t.ne[0]);
  const int64_t n_rows = t.ne[1];
  std::vector<uint8_t> out(static_cast<size_t>(t.n_bytes));
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t head = r / head_dim, j = r % head_dim;
    int64_t old_j = j;
    if (j < n_rot / 2) {
      old_j = 2 * j;
    } else if (j < n_rot) {
      old_j = 2 * (j - n_rot / 2) + 1;
    }
    std::memcpy(out.data() + r * rb, t.data + (head * head_dim + old_j) * rb, rb);
  }
  return out;
}

}  // namespace

gguf::Writer make_upcycled(const gguf::File& src, const UpcycleOptions& opt) {
  if (src.architecture() != "llama") {
    throw Error(ErrorCategory::unsupported, "upcycle: " + src.path() +
                                                ": general.architecture is '" + src.architecture() +
                                                "', expected 'llama'");
  }
  if (src.get_int_opt("llama.expert_count").value_or(0) > 0) {
    throw Error(ErrorCategory::unsupported,
                "upcycle: " + src.path() + ": already has experts (llama.expert_count > 0)");
  }
  if (opt.n_expert < 1 || opt.n_expert_used < 1 || opt.n_expert_used > opt.n_expert) {
    throw Error(ErrorCategory::invalid_argument,
                "upcycle: n_expert = " + std::to_string(opt.n_expert) +
                    ", n_expert_used = " + std::to_string(opt.n_expert_used) +
                    ": need n_expert >= 1 and 1 <= n_expert_used <= n_expert");
  }
  const bool qwen = opt.style == UpcycleStyle::qwen3moe;
  const std::string arch = qwen ? "qwen3moe" : "llama";

  const int64_t n_embd = positive_key(src, "llama.embedding_length");
  const int64_t n_layer = positive_key(src, "llama.block_count");
  const int64_t n_head = positive_key(src, "llama.attention.head_count");
  const int64_t n_ff = positive_key(src, "llama.feed_forward_length");
  const int64_t head_dim = src.has("llama.attention.key_length")
                               ? positive_key(src, "llama.attention.key_length")
                               : n_embd / n_head;
  const int64_t n_rot = src.has("llama.rope.dimension_count")
                            ? positive_key(src, "llama.rope.dimension_count")
                            : head_dim;
  if (head_dim <= 0 || n_rot % 2 != 0 || n_rot > head_dim) {
    throw Error(ErrorCategory::format, "upcycle: " + src.path() + ": head_dim " +
                                           std::to_string(head_dim) + " and n_rot " +
                                           std::to_string(n_rot) +
                                           " must satisfy 0 < n_rot <= head_dim, n_rot even");
  }

  gguf::Writer w(3, src.alignment());
  // ---- metadata: everything copied, llama.* renamed for qwen3moe -------------------------
  const std::string llama_prefix = "llama.";
  for (const gguf::KeyValue& kv : src.kvs()) {
    if (kv.key == "general.alignment") continue;  // the Writer writes its own
    std::string k = kv.key;
    if (qwen && k.rfind(llama_prefix, 0) == 0) k = arch + "." + k.substr(llama_prefix.size());
    w.set(k, kv.value);
  }
  w.set_string("general.architecture", arch);
  w.set_u32(arch + ".expert_count", static_cast<uint32_t>(opt.n_expert));
  w.set_u32(arch + ".expert_used_count", static_cast<uint32_t>(opt.n_expert_used));
  if (qwen) {
    w.set_u32("qwen3moe.expert_feed_forward_length", static_cast<uint32_t>(n_ff));
    if (!src.has("llama.attention.key_length")) {
      w.set_u32("qwen3moe.attention.key_length", static_cast<uint32_t>(head_dim));
    }
    if (!src.has("llama.attention.value_length")) {
      w.set_u32("qwen3moe.attention.value_length", static_cast<uint32_t>(head_dim));
    }
    if (!src.has("llama.rope.freq_base")) w.set_f32("qwen3moe.rope.freq_base", 10000.0f);
  }

  // ---- tensors --------------------------------------------------------------------------------
  std::set<std::string> ffn_names;
  for (int64_t l = 0; l < n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    for (const char* n : {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}) {
      ffn_names.insert(p + n);
    }
  }
  for (const gguf::TensorInfo& t : src.tensors()) {
    if (ffn_names.count(t.name)) continue;
    const bool is_qk = t.name.size() > 4 && t.name.rfind("blk.", 0) == 0 &&
                       (t.name.ends_with(".attn_q.weight") || t.name.ends_with(".attn_k.weight"));
    if (qwen && opt.permute_qk && is_qk) {
      if (t.n_dims != 2 || t.ne[1] % head_dim != 0) {
        throw Error(ErrorCategory::format, "upcycle: " + src.path() + ": tensor '" + t.name +
                                               "' has shape " + shape_string(shape_of(t)) +
                                               ", expected [n_embd, n_heads * " +
                                               std::to_string(head_dim) + "]");
      }
      w.add_tensor(t.name, t.type, shape_of(t), permute_rows_to_neox(t, head_dim, n_rot));
      continue;
    }
    w.add_tensor(t.name, t.type, shape_of(t), std::span<const uint8_t>(t.data, t.n_bytes));
  }
  std::mt19937_64 gen(opt.seed);
  const int64_t ne = opt.n_expert;
  for (int64_t l = 0; l < n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    const gguf::TensorInfo& gate = tensor_with_shape(src, p + "ffn_gate.weight", {n_embd, n_ff});
    const gguf::TensorInfo& up = tensor_with_shape(src, p + "ffn_up.weight", {n_embd, n_ff});
    const gguf::TensorInfo& down = tensor_with_shape(src, p + "ffn_down.weight", {n_ff, n_embd});
    std::vector<float> router(static_cast<size_t>(n_embd * ne));
    for (float& r : router) r = static_cast<float>(normal_draw(gen));
    std::vector<uint8_t> router_bytes(router.size() * sizeof(float));
    std::memcpy(router_bytes.data(), router.data(), router_bytes.size());
    w.add_tensor(p + "ffn_gate_inp.weight", GgmlType::F32, {n_embd, ne}, router_bytes);
    w.add_tensor(p + "ffn_gate_exps.weight", gate.type, {n_embd, n_ff, ne},
                 repeat_bytes(gate, opt.n_expert));
    w.add_tensor(p + "ffn_up_exps.weight", up.type, {n_embd, n_ff, ne},
                 repeat_bytes(up, opt.n_expert));
    w.add_tensor(p + "ffn_down_exps.weight", down.type, {n_ff, n_embd, ne},
                 repeat_bytes(down, opt.n_expert));
  }
  return w;
}

void write_upcycled(const std::string& src, const std::string& dst, UpcycleStyle style,
                    int n_expert, int n_expert_used, uint64_t seed) {
  const gguf::File file = gguf::File::open(src);
  make_upcycled(
      file, {.style = style, .n_expert = n_expert, .n_expert_used = n_expert_used, .seed = seed})
      .write(dst);
}

}  // namespace berth::oracle
