// Architectures: each reads its hyper-parameters from GGUF metadata, checks and names its
// weights, and emits the step graph (runtime/graph) for a ubatch. Models never choose devices.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "berth/graph/cache.h"
#include "berth/graph/graph.h"

namespace berth::gguf {
class File;
}

namespace berth {

/// Hyper-parameters of the decoder-only transformer families berth runs. Names follow the GGUF
/// keys ("{arch}." prefix omitted): embedding_length -> n_embd, block_count -> n_layer, ...
struct Hparams {
  std::string arch;         ///< general.architecture
  int64_t n_vocab = 0;      ///< rows of token_embd.weight
  int64_t n_ctx_train = 0;  ///< context_length
  int64_t n_embd = 0;       ///< embedding_length
  int64_t n_layer = 0;      ///< block_count
  int64_t n_head = 0;       ///< attention.head_count
  int64_t n_head_kv = 0;    ///< attention.head_count_kv (default n_head)
  /// attention.head_count_kv when the file gives one value per layer (0 on layers without
  /// attention); empty for a scalar. n_head_kv is then the (single) non-zero value.
  std::vector<int64_t> n_head_kv_layer;
  int64_t head_dim = 0;             ///< attention.key_length (default n_embd / n_head)
  int64_t n_ff = 0;                 ///< feed_forward_length
  int64_t n_rot = 0;                ///< rope.dimension_count (default head_dim)
  float rope_freq_base = 10000.0f;  ///< rope.freq_base
  float rms_eps = 1e-5f;            ///< attention.layer_norm_rms_epsilon
  int64_t n_expert = 0;             ///< expert_count (0: dense)
  int64_t n_expert_used = 0;        ///< expert_used_count
  int64_t n_ff_exp = 0;             ///< expert_feed_forward_length (default feed_forward_length)
  bool expert_weights_norm = true;  ///< expert_weights_norm: renormalise the top-k weights
  /// Layers after the main ones that the file holds but berth does not run (Qwen3.5's MTP
  /// block, nextn_predict_layers: blk.{n_layer}.nextn.*), not counted in n_layer.
  int64_t n_layer_skipped = 0;
  // Qwen3.5 hybrids (qwen35, qwen35moe): the Gated DeltaNet layers' shapes (0 elsewhere).
  int64_t full_attention_interval = 0;  ///< full_attention_interval: layer i has attention iff
                                        ///< (i + 1) % it == 0
  int64_t ssm_conv_kernel = 0;          ///< ssm.conv_kernel
  int64_t ssm_d_state = 0;              ///< ssm.state_size: the K (and V) head size
  int64_t ssm_n_group = 0;              ///< ssm.group_count: H_k
  int64_t ssm_dt_rank = 0;              ///< ssm.time_step_rank: H_v
  int64_t ssm_d_inner = 0;              ///< ssm.inner_size: H_v * V head size
  int64_t n_ff_shexp = 0;               ///< expert_shared_feed_forward_length (0: none)
};

/// Reads the common hyper-parameters of `file` for its architecture. Required keys missing ->
/// gguf::GgufError(missing_key) naming the key and file; inconsistent values (e.g. n_head not a
/// multiple of n_head_kv, expert_used_count > expert_count) -> Error(format) naming the keys.
/// MoE keys: expert_count > 0 requires expert_used_count; expert_weights_norm defaults to true
/// (Mixtral and Qwen3-MoE renormalise the selected weights).
Hparams read_hparams(const gguf::File& file);

class Model {
 public:
  virtual ~Model() = default;

  const Hparams& hparams() const { return hp_; }
  const graph::WeightTable& weights() const { return weights_; }
  virtual std::vector<KvLayer> kv_layers() const = 0;

  /// The graph of one step over a ubatch of `n_tokens` tokens whose logits are wanted for the
  /// last `n_outputs` of them (1 for generation, n_tokens to score every position).
  /// Throws Error(invalid_argument) unless 1 <= n_outputs <= n_tokens.
  virtual graph::Graph build_step(int32_t n_tokens, int32_t n_outputs) const = 0;

 protected:
  Hparams hp_;
  graph::WeightTable weights_;
};

/// Creates the model for general.architecture of `file` (which must outlive it: weights are
/// views into its mapping). Throws Error(unsupported) naming the architecture and the supported
/// ones; GgufError(missing_tensor) / Error(format) for absent or mis-shaped tensors.
std::unique_ptr<Model> load_model(const gguf::File& file);

/// Architectures load_model accepts.
std::vector<std::string> supported_architectures();

}  // namespace berth
