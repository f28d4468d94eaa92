// Pieces of the matmul family shared by matmul.cu and moe.cu (host-side launchers; the kernels
// live in matmul.cu so each template is compiled once).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "berth/core/error.h"
#include "berth/core/tensor.h"
#include "berth/core/types.h"

namespace berth::gpu::detail {

// Calls FN<T>(args...) for the runtime type t (CUDA code is C++17: no template lambdas).
#define BERTH_TYPE_CASE(FN, T, ...)        \
  case ::berth::GgmlType::T:               \
    FN<::berth::GgmlType::T>(__VA_ARGS__); \
    break;
#define BERTH_DISPATCH(t, FN, ...)                                                                 \
  switch (t) {                                                                                     \
    BERTH_TYPE_CASE(FN, F32, __VA_ARGS__)                                                          \
    BERTH_TYPE_CASE(FN, F16, __VA_ARGS__)                                                          \
    BERTH_TYPE_CASE(FN, BF16, __VA_ARGS__)                                                         \
    BERTH_TYPE_CASE(FN, Q4_0, __VA_ARGS__)                                                         \
    BERTH_TYPE_CASE(FN, Q4_1, __VA_ARGS__)                                                         \
    BERTH_TYPE_CASE(FN, Q5_0, __VA_ARGS__)                                                         \
    BERTH_TYPE_CASE(FN, Q5_1, __VA_ARGS__)                                                         \
    BERTH_TYPE_CASE(FN, Q8_0, __VA_ARGS__)                                                         \
    BERTH_TYPE_CASE(FN, Q2_K, __VA_ARGS__)                                                         \
    BERTH_TYPE_CASE(FN, Q3_K, __VA_ARGS__)                                                         \
    BERTH_TYPE_CASE(FN, Q4_K, __VA_ARGS__)                                                         \
    BERTH_TYPE_CASE(FN, Q5_K, __VA_ARGS__)                                                         \
    BERTH_TYPE_CASE(FN, Q6_K, __VA_ARGS__)                                                         \
    default:                                                                                       \
      throw ::berth::Error(                                                                        \
          ::berth::ErrorCategory::unsupported,                                                     \
          "GPU kernels: weight type " + std::string(::berth::type_name(t)) + " is not supported"); \
  }

/// Tokens handled by one GEMV launch (accumulators per thread).
inline constexpr int kGemvTok = 8;

/// Largest n_tok matmul serves with the GEMV path (token chunks of kGemvTok) for quantized
/// (resp. float) weights, and moe_experts with its GEMV path; above, the f16 tensor-core paths.
/// Defaults and measurements in matmul.cu; tests and benchmarks may change them (not thread
/// safe: set before launching).
int& gemv_max_tok();
int& gemv_max_tok_float();

int& moe_gemv_max_tok();
bool matmul_uses_gemv(GgmlType t, int64_t n_tok);

/// Whether dense_gemm_mma serves n_rows prompt rows of an n_out x n_in matrix on this device
/// (moe_gemm_mma() on, n_in a multiple of 64, sizes within its grid, compute capability and
/// code >= 8.0); the caller also needs a 16-byte aligned xh.
bool dense_gemm_mma_applies(int64_t n_in, int64_t n_rows, int64_t n_out);
/// out [n_rows, n_out] (f32, n_out contiguous) = xh [n_rows, n_in] (f16, n_in contiguous,
/// 16-byte aligned) . W^T with W [n_out, n_in] of `type` (ggml rows, n_in contiguous), on the
/// grouped mma.sync GEMM of moe.cu with one group: weight groups decoded to f16 in shared
/// memory, each output accumulated over n_in in one ascending chain (its bits depend on its row
/// of xh and column of W only). Throws Error(internal) outside dense_gemm_mma_applies or for an
/// unaligned xh.
void dense_gemm_mma(GgmlType type, const void* w, int64_t n_in, int64_t n_out, const __half* xh,
                    int64_t n_rows, float* out, cudaStream_t stream);

inline size_t align_up(size_t v, size_t a = 256) { return (v + a - 1) / a * a; }

bool is_quantized(GgmlType t);
/// Throws Error(unsupported) when `t` is not supported, Error(invalid_argument) when n is not a
/// multiple of its block size.
void check_type(GgmlType t, int64_t n, const char* what);

/// Bytes of the int8 activations (plus the per-32 metadata) of `rows` rows of n elements.
size_t qact_bytes(int64_t rows, int64_t n);

/// Quantized activations: q [rows, n] int8, then meta [rows, n/32] float4 {d, d*sum(q[0..15]),
/// d*sum(q[16..31]), 0} at byte offset align_up(rows * n).
struct QAct {
  int8_t* q;
  float4* meta;
};
QAct qact_at(void* p, int64_t rows, int64_t n);

/// Quantizes rows of x ([rows, n], n % 32 == 0) into qa. When `up` is given, the values are
/// silu(x) * up (SwiGLU fused into the quantization). The same launch sets zero[0, n_zero) to 0.
void quantize_act(const float* x, const float* up, int64_t rows, int64_t n, QAct qa, cudaStream_t s,
                  unsigned* zero = nullptr, int64_t n_zero = 0);

/// A routed GEMV (moe_experts' decode path): grid row y = (token, slot) pair p = t * k + j; the
/// pair's expert e = route[t, j] picks the matrix at w + e * expert_bytes (by_slot: at
/// w + (t * (slot_end - slot_begin) + j - slot_begin) * expert_bytes, the order moe_experts
/// stages them in); pairs whose slot is outside [slot_begin, slot_end), whose id is invalid or
/// whose expert is masked out exit at once. Activation row p / act_div, output row p.
struct GemvRoute {
  const float* route = nullptr;
  int k = 0;
  int act_div = 1;
  const uint8_t* mask = nullptr;
  int n_expert = 0;
  int64_t pairs = 0;
  size_t expert_bytes = 0;
  int slot_begin = 0;
  int slot_end = 1 << 30;
  bool by_slot = false;
  /// Grouped by expert (quantized weights, never by_slot): grid row y computes group y =
  /// groups[y] = {expert e, first entry m0 in group_list, count n (0: no group, the row exits),
  /// unused}: the pairs group_list[m0 .. m0 + n) of expert e, n <= kMoeGroupTok, their weights
  /// loaded once for all n (moe_gather with tile kMoeGroupTok writes both). Each pair's output row
  /// gets the bits the ungrouped launch gives it. Null: one grid row per pair, as above.
  const int4* groups = nullptr;
  const int32_t* group_list = nullptr;
};

/// Pairs of one expert a grouped routed GEMV block computes (GemvRoute::groups).
inline constexpr int kMoeGroupTok = 4;

/// out[t * out_stride + r] = W[r] . x[t] for r < n_out, t < n_tok (n_tok <= kGemvTok; 1 with a
/// route). Quantized types read qa, float types read xf.
void gemv(GgmlType type, const void* w, int64_t n_in, int64_t n_out, const float* xf, QAct qa,
          int64_t n_tok, float* out, int64_t out_stride, const GemvRoute& route, cudaStream_t s);
/// A GEMV of n_tok <= kGemvTok tokens on 1-3 matrices of one type and n_in, in one launch; each
/// job's rows as gemv() computes them (job j's output [n_tok, n_out_j], n_out_j contiguous).
/// Quantized types read activations `qa` (quantize_act of the n_tok rows), float types x (f32
/// [n_tok, n_in]). The jobs must agree on the lanes per row, which follow each matrix's shape
/// (gemv_one_token_lanes_agree; float jobs also on 16-byte alignment).
void gemv_one_token(const MatmulJob* jobs, int n_jobs, int64_t n_in, QAct qa, const float* x,
                    cudaStream_t s, int64_t n_tok = 1);
/// Whether matmul_group runs a decode step of 2..kGemvTok tokens as it runs one token (one launch
/// per weight type for up to 3 matrices) instead of one launch per matrix (true by default; the
/// same bits). BERTH_GEMV_GROUP_TOK=0 (or false, off, no) sets it false (benchmarks compare).
bool& gemv_group_tokens();
bool gemv_one_token_lanes_agree(const MatmulJob* jobs, int n_jobs, int64_t n_in);

/// moe_experts' decode GEMVs on quantized weights with their neighbours in the same launch.
/// moe_gemv_gate_up: G = gate GEMV and U = up GEMV of each pair (route r, whose expert_bytes is
/// the gate's; up_expert_bytes the up matrix's), both [pairs, n_ff], then aq (rows = pairs) =
/// quantize_act(G, U) of each pair, written by the last of the pair's blocks to finish.
/// moe_gemv_down: Y [pairs, n_embd] = down GEMV of aq, then out [n_tok, n_embd] = the sum over
/// each token's valid slots, in slot order, of its route weight times Y (moe_combine's order),
/// written by the last pair block of each token and x block. Same type for gate and up. `count`:
/// moe_gemv_counts() words, zero on entry (each kernel adds to its own part).
struct MoeGemvFuse {
  const uint8_t* up_w = nullptr;
  size_t up_expert_bytes = 0;
  float* gate_out = nullptr;
  float* up_out = nullptr;
  int8_t* aq = nullptr;
  float4* aqm = nullptr;
  float* out = nullptr;
  unsigned* count = nullptr;
};
/// Counter words both fused launches of one call need: pairs (gate/up) + n_tok times the down
/// GEMV's x blocks.
int64_t moe_gemv_counts(GgmlType down_type, int64_t n_ff, int64_t n_embd, int64_t n_tok,
                        int64_t pairs);
void moe_gemv_gate_up(GgmlType type, const void* gate, const void* up, size_t up_expert_bytes,
                      int64_t n_embd, int64_t n_ff, QAct hq, float* G, float* U, QAct aq,
                      unsigned* count, const GemvRoute& r, cudaStream_t s);
void moe_gemv_down(GgmlType type, const void* down, int64_t n_ff, int64_t n_embd, QAct aq, float* Y,
                   float* out, unsigned* count, const GemvRoute& r, cudaStream_t s);

/// Dequantizes rows of W into dst [n_rows, n_in] (f16 when `half_out`, else f32). Row i of dst
/// is row rows[i] of W (zeros when outside [0, n_w_rows)) when `rows` is given, else row
/// row0 + i.
void dequant_rows(GgmlType type, const void* w, int64_t n_in, int64_t n_w_rows, const int32_t* rows,
                  int64_t row0, int64_t n_rows, void* dst, bool half_out, cudaStream_t s);

/// dst [rows, n] f16 = x rows (row i of dst is row src_rows[i] / div of x when src_rows is
/// given; rows i >= *count are skipped when count is given).
void to_half(const float* x, int64_t rows, int64_t n, const int32_t* src_rows, int div,
             const int32_t* count, void* dst, cudaStream_t s);

}  // namespace berth::gpu::detail
