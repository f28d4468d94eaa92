// CUDA kernels of the step graph's ops. Launchers take raw device pointers and a stream, enqueue
// their kernels and return; they never allocate, never synchronise, and are safe to call while
// the stream is being captured into a CUDA graph.
//
// Conventions (as the CPU path, runtime/graph/graph.h):
// - Activations are f32 matrices [rows, cols], row-major (cols contiguous), one row per token.
// - Weights are in ggml's block layout, exactly the bytes of the GGUF tensor, uploaded as is:
//   a matrix mapping n_in -> n_out is n_out rows of n_in elements (ne = {n_in, n_out}).
// - Small weights (norm scales, biases) are passed as f32 vectors (the caller converts them once
//   at upload).
// - Grid sizes depend only on shapes (n_tok, n_ctx, dims), never on values in device memory, so
//   a captured graph stays valid when positions, routing or token ids change between replays.
//   Values that change per step (token ids, positions) are read from device memory.
// - Errors: a launch failure throws berth::Error(internal) with cudaGetErrorString and the
//   kernel's name. Unsupported types throw Error(unsupported) naming the type.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "berth/core/tensor.h"
#include "berth/core/types.h"

namespace berth::gpu {

/// Programmatic dependent launch (compute capability >= 9.0): every kernel is launched so that
/// it may be scheduled while the kernel before it in its stream still runs, and waits at its
/// start for that kernel's completion (src/launch.cuh), which hides the launch latency of a
/// chain of small dependent kernels (a decode step). On by default on such devices; off when
/// the environment variable BERTH_PDL is 0, false, off or no (any case) at the first launch, or
/// after set_pdl(false).
/// Results are the same bits either way. pdl_enabled() reports the setting (not the device).
void set_pdl(bool on);
bool pdl_enabled();

/// True when matmul/embed/moe_experts accept weights of type `t`: F32, F16, BF16, Q4_0, Q4_1,
/// Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (the CPU path's set).
bool supports(GgmlType t);

/// Workspace bytes matmul needs for `n_tok` rows of input of which the last `n_decode` are
/// decode rows (quantized activations, f16 activations, dequantized weight tiles). 0 is a valid
/// answer. n_decode -1: as matmul resolves it.
size_t matmul_workspace_bytes(GgmlType type, int64_t n_in, int64_t n_out, int64_t n_tok,
                              int64_t n_decode = -1, bool invariant = true);

/// out [n_tok, n_out] = x [n_tok, n_in] times w^T, w = n_out rows of n_in elements of `type`.
/// Each row takes the path of its kind, so its bits depend on its kind and its own values only,
/// never on n_tok or the other rows (issue 19):
/// - decode rows, the last n_decode: activations quantized on the device to 8-bit blocks,
///   integer dot products (dp4a) against the weight blocks (float weights: f32 dot products),
///   GEMV launches of up to 8 rows whose per-row arithmetic does not depend on the count;
/// - prompt rows, the first n_tok - n_decode: x rounded to f16 and a tensor-core GEMM of our own
///   (f32 accumulation in a fixed k order, each output element the same instructions whatever
///   the row count; cuBLAS picks algorithms by shape, so it is not used): the mma.sync GEMM
///   decoding weight groups in shared memory (n_in a multiple of 64, compute capability 8.0+,
///   detail::moe_gemm_mma), else a WMMA GEMM on weights dequantized to f16 in chunks of rows. F32
///   weights: prompt rows take the GEMV too (f32 activations, as the CPU path; the kinds then
///   compute alike).
/// With `invariant` false, prompt rows take cuBLAS instead, F32 weights' too (cublasGemmEx on
/// f16 copies, f32 accumulation: faster, but its algorithm, tiles and split-K follow the shape, so
/// a prompt row's bits may change with the number of rows; for a session of one sequence, where no
/// other sequence shares a step). Decode rows are the same either way. n_decode -1: every row is a
/// decode row when n_tok <= 8 (quantized weights) or <= 3 (float weights), else none. `workspace`
/// holds at least matmul_workspace_bytes(...). Errors: Error(invalid_argument) for n_decode outside
/// [-1, n_tok] or a short workspace, unsupported types as supports().
void matmul(GgmlType type, const void* w, int64_t n_in, int64_t n_out, const float* x,
            int64_t n_tok, float* out, void* workspace, size_t workspace_bytes, cudaStream_t stream,
            int64_t n_decode = -1, bool invariant = true);

/// The matmuls of `jobs[0..n_jobs)` on one input x [n_tok, n_in], in job order: each job's out
/// is what matmul() writes for it. When every job takes the GEMV path (small n_tok) and one is
/// quantized, x is quantized once for all of them (a decode step's Q, K and V projections: one
/// launch instead of three). `workspace` holds at least the largest matmul_workspace_bytes of
/// the jobs. x_q8: x's 8-bit blocks are already at the start of `workspace` (left there by the
/// producer of x: attention with a q8_ws that returned true),
/// so they are not made again; only for n_tok == 1 and at most 3 jobs, Error(invalid_argument)
/// otherwise. n_decode: as matmul (the group path serves steps of decode rows only; other steps
/// run matmul per job); invariant as matmul. Errors: as matmul.
void matmul_group(const MatmulJob* jobs, int n_jobs, int64_t n_in, const float* x, int64_t n_tok,
                  void* workspace, size_t workspace_bytes, cudaStream_t stream, bool x_q8 = false,
                  int64_t n_decode = -1, bool invariant = true);

/// out [n_out] = w times swiglu(gate, up) for one decode row: gate, up [n_in] f32, w n_out rows
/// of n_in elements of a quantized `type`. The 8-bit blocks of gate / (1 + exp(-gate)) * up are
/// made in one launch (swiglu()'s arithmetic) and read by the GEMV, so out has the bits of
/// swiglu() then matmul() of one decode row, one launch fewer and swiglu's output never written.
/// `workspace` holds at least matmul_workspace_bytes(type, n_in, n_out, 1). Errors:
/// Error(invalid_argument) for float weights or a short workspace; unsupported types as
/// supports().
void swiglu_matmul(GgmlType type, const void* w, int64_t n_in, int64_t n_out, const float* gate,
                   const float* up, float* out, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream);

/// out [n_tok, n_embd] = rows tokens[t] of w (n_vocab rows of n_embd elements of `type`),
/// dequantized. Token ids are read from device memory; ids outside [0, n_vocab) give zero rows
/// (the host validates ids before a step).
void embed(GgmlType type, const void* w, int64_t n_embd, int64_t n_vocab, const int32_t* tokens,
           int64_t n_tok, float* out, cudaStream_t stream);

/// RMSNorm (Zhang & Sennrich 2019): each run of `group` consecutive values of x [rows, cols]
/// (group divides cols; group == cols for a whole row) becomes v / sqrt(mean(v^2) + eps) * w,
/// w [group] f32 (nullptr: no scale). out may equal x.
void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t cols, int64_t group,
              float eps, cudaStream_t stream);

/// sum = a + b and out = rms_norm(sum) over whole rows, a, b, sum, out [rows, cols], w [cols]
/// (nullptr: no scale): a residual add and the next norm in one launch, bit-identical to add()
/// then rms_norm(group = cols). sum may alias a or b; out must not alias a, b or sum.
void add_rms_norm(const float* a, const float* b, float* sum, const float* w, float* out,
                  int64_t rows, int64_t cols, float eps, cudaStream_t stream);

/// add_rms_norm(a, b_host, ...) once *flag >= value: b_host [rows, cols] is page-locked host
/// memory that a host thread wrote before its release store to *flag (host memory). Each block's
/// first thread waits for the flag (spinning, system-scope acquire), then the block reads b_host
/// with ld.cv. A CPU segment's output read by the residual add after it, in place: the same
/// results as wait_copy_in of b_host into device memory, then add_rms_norm, in one launch.
void wait_add_rms_norm(const uint32_t* flag, uint32_t value, const float* a, const float* b_host,
                       float* sum, const float* w, float* out, int64_t rows, int64_t cols,
                       float eps, cudaStream_t stream);
/// out = a + b, n elements. out may alias a or b.
void add(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream);
/// out[r, c] = x[r, c] + bias[c], x [rows, cols]. out may equal x.
void add_bias(const float* x, const float* bias, float* out, int64_t rows, int64_t cols,
              cudaStream_t stream);
/// out = silu(gate) * up, n elements; silu(z) = z / (1 + exp(-z)) (SwiGLU, arXiv:2002.05202).
void swiglu(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream);

/// Rotary embedding (RoFormer, arXiv:2104.09864) of x [rows, n_head * head_dim] into out (may
/// equal x): in each head the first n_rot dims rotate by theta_i = positions[r] *
/// freq_base^(-2i/n_rot); pairs are (2i, 2i+1) when !neox, (i, i + n_rot/2) when neox.
/// positions: rows int32 in device memory.
void rope(const float* x, float* out, int64_t rows, int32_t n_head, int32_t head_dim, int32_t n_rot,
          float freq_base, bool neox, const int32_t* positions, cudaStream_t stream);

/// For each of `n_jobs` (1 or 2) tensors: rms_norm of every head (group = head_dim), then rope
/// of the result, as rms_norm() then rope() compute them, bit for bit, in one launch (a
/// layer's q and k heads: Qwen3's attn_q_norm / attn_k_norm before RoPE). Errors: as rms_norm
/// and rope; n_jobs outside [1, 2].
void norm_rope(const NormRopeJob* jobs, int n_jobs, int64_t rows, int32_t head_dim, float eps,
               int32_t n_rot, float freq_base, bool neox, const int32_t* positions,
               cudaStream_t stream);

/// One block copies `copies` (n <= 4, device -> page-locked host memory, sizes multiples of 4
/// bytes; meant for a few KiB: one SM does the copying), then stores `value` to *flag (host
/// memory) with system-scope release: a host thread that sees the flag sees the data.
void copy_out_signal(const HostCopy* copies, int n, uint32_t* flag, uint32_t value,
                     cudaStream_t stream);
/// One block waits (spinning, one SM) until *flag >= value (a host thread's release store),
/// then copies `copies` (page-locked host -> device memory, as copy_out_signal's limits).
void wait_copy_in(const uint32_t* flag, uint32_t value, const HostCopy* copies, int n,
                  cudaStream_t stream);

/// Workspace bytes of attention for n_tok query rows, the last n_decode of them decode rows (-1:
/// as attention resolves it), over sequences of n_ctx positions, for the decode path the current
/// device and detail:: switches select now. Errors: Error(invalid_argument) for n_decode outside
/// [-1, n_tok]; Error(internal) when the device cannot be queried.
size_t attention_workspace_bytes(int64_t n_tok, int64_t n_ctx, int32_t n_head, int32_t n_head_kv,
                                 int32_t head_dim, int64_t n_decode = -1);

/// Causal grouped-query attention with an f16 KV cache of several sequences, flash-style (online
/// softmax; the score matrix is never materialised). q [n_tok, n_head*head_dim], k/v [n_tok,
/// n_head_kv*head_dim] (f32, this ubatch). Token t belongs to sequence s_t = seqs[t] (seqs null:
/// every token is sequence 0) at position p_t = positions[t]; its cache row is s_t * n_ctx + p_t
/// (k_cache / v_cache: [n_seq * n_ctx, n_head_kv*head_dim] f16 each, row-major, each sequence
/// n_ctx rows). First writes k, v (rounded to f16) into those rows; then query t attends to rows
/// s_t * n_ctx + [0, p_t] with scores scale * q.k, query head h reading kv head
/// h / (n_head / n_head_kv). out [n_tok, n_head*head_dim]. positions and seqs: n_tok int32 in
/// device memory (a sequence's tokens in the step: consecutive positions, in order); the rows
/// read are taken from them on the device, so one captured graph serves every decode position
/// and sequence.
/// Rows by kind (issue 19; a row's bits depend on its kind and its own sequence, never on n_tok
/// or the other tokens): the last n_decode tokens are decode tokens (each the only token of its
/// sequence in the step) and take the single-token decode kernel (KV splits fixed by n_ctx);
/// the others, prompt tokens, run in blocks of one sequence's consecutive tokens over fixed tiles
/// from position 0 (64 positions; 32 on the tensor-core kernel at head_dim 256), without KV
/// splits: on tensor cores (detail::attention_prefill_mma) for head_dim 64, 128 and 256, where
/// Q and P are rounded to f16 as the operands of the products. n_decode -1: 1 when n_tok == 1, else
/// 0. q8_ws: null, or the workspace of the matmul_group that reads `out` next (at least
/// matmul_workspace_bytes of a quantized type for n_in = n_head * head_dim, one token): the
/// cluster decode kernel (n_tok == 1, head_dim % 32 == 0, compute capability >= 9.0,
/// detail::attention_cluster_decode() on) then also writes out's 8-bit blocks there (the bits
/// quantize_act makes of out) and attention returns true; false: nothing written there.
/// Errors: Error(invalid_argument) for bad head counts, n_ctx < 1, n_decode outside [-1, n_tok]
/// or a short workspace; Error(unsupported) for head_dim odd or above 256.
bool attention(const float* q, const float* k, const float* v, int64_t n_tok,
               const int32_t* positions, uint16_t* k_cache, uint16_t* v_cache, int64_t n_ctx,
               int32_t n_head, int32_t n_head_kv, int32_t head_dim, float scale, float* out,
               void* workspace, size_t workspace_bytes, cudaStream_t stream, void* q8_ws = nullptr,
               const int32_t* seqs = nullptr, int64_t n_decode = -1);

namespace detail {
/// Whether attention serves one-token calls (decode) with its thread-block-cluster kernel on
/// devices of compute capability >= 9.0 (true by default): one launch that also writes the
/// token's K/V row and merges its blocks' partials (plus a merge launch where a long KV range is
/// split over several clusters, below), instead of kv_write + attention + split combine.
/// The environment variable BERTH_ATTN_CLUSTER=0 (or false, off, no) sets it false. Tests and
/// benchmarks turn it off to compare both paths (not thread safe: set before launching).
bool& attention_cluster_decode();
/// The cluster decode kernel's split of a long KV range (the switches below; 0 is the default
/// each time; another value of the environment variable is Error(invalid_argument) on first
/// use; tests and benchmarks set them to compare, not thread safe: set before launching):
/// - A cache that one cluster of 8 blocks covers with 2 slabs (4 or 8 rows) per warp keeps one
///   cluster per (decode token, KV head, head subgroup), 4 query heads per block; so does a
///   split that would give each KV head fewer than 8 blocks (heads that fill the card).
/// - A longer one is split over clusters of 2 blocks, 8 query heads per block where a KV head
///   has at least 8 and head_dim is at most 128 (else 4): as many clusters as the device runs
///   at once for one token, no more than become active within n_ctx. At a position only the
///   clusters with work take part (one per 2 slabs per warp of the token's rows); with more
///   than one, a second launch merges their partials in order.
/// A decode row's bits depend on its position, n_ctx, the head shape, these switches and the
/// device's cluster count, never on the other rows of the step.
/// attention_decode_heads: query heads per block, 4 or 8, for the one cluster and the split
/// alike (BERTH_ATTN_DEC_HEADS; head_dim above 128 always takes 4).
int& attention_decode_heads();
/// attention_decode_clusters: clusters per (token, KV head, subgroup), 1 (one cluster of 8
/// blocks) to 64 (BERTH_ATTN_DEC_CLUSTERS).
int& attention_decode_clusters();
/// attention_decode_cluster_blocks: blocks per cluster of a split range, 1, 2, 4 or 8
/// (BERTH_ATTN_DEC_CB).
int& attention_decode_cluster_blocks();
/// attention_decode_warps: warps per block for head_dim <= 128, 8 or 16 (default 16;
/// BERTH_ATTN_DEC_WARPS; head_dim 256 always runs 8).
int& attention_decode_warps();
/// Whether attention runs prompt rows of head_dim 64, 128 or 256 on its tensor-core kernel
/// (compute capability >= 8.0; Q and P rounded to f16, f32 accumulation) instead of the f32
/// kernel (true by default). BERTH_ATTN_MMA=0 (or false, off, no) sets it false. Tests and
/// benchmarks turn it off to compare both paths (not thread safe: set before launching).
bool& attention_prefill_mma();
/// Whether attention, called now on the current device, runs prompt rows of `head_dim` on the
/// tensor-core kernel (attention_prefill_mma() on, an instance for the head dim, compute
/// capability and code >= 8.0, and both cache pointers 16-byte aligned: `caches_aligned`).
/// The choice attention itself makes; tests pick their tolerance from it.
bool attention_prompt_on_mma(int32_t head_dim, bool caches_aligned);
/// Whether the tensor-core prompt attention computes Q K^T on Hopper's wgmma (head dims 64 and
/// 128, where attention_prompt_on_mma and this build's sm_90a code run: BERTH_SM90A_EXPERIMENTS)
/// instead of mma.sync (false by default: an experiment, measured in docs/performance.md).
/// BERTH_ATTN_WGMMA=1 (or true, on, yes) sets it true (not thread safe).
bool& attention_prefill_wgmma();
/// Whether the wgmma variant can run on the current device (this build's sm_90a code is what the
/// driver loaded). Synchronous: not while a stream captures.
bool attention_wgmma_runs();
/// Whether moe_experts' grouped GEMM (prompt rows), and matmul's prompt rows of invariant calls,
/// run on the mma.sync kernel (compute capability >= 8.0; n_embd and n_ff, resp. n_in, multiples
/// of 64) instead of the WMMA kernels (true by default). BERTH_MOE_MMA=0 (or false, off, no) sets
/// it false. Tests and benchmarks turn it off to compare both paths (not thread safe: set before
/// launching).
bool& moe_gemm_mma();
/// Whether moe_experts' f16 grouped GEMM runs on Hopper's wgmma (where moe_gemm_mma() applies,
/// moe_gemm_int8() is off and this build's sm_90a code runs: CMAKE_CUDA_ARCHITECTURES with 90
/// and BERTH_SM90A_EXPERIMENTS on) instead of mma.sync (false by default: an experiment, measured
/// in docs/performance.md). BERTH_MOE_WGMMA=1 (or true, on, yes) sets it true (not thread safe).
bool& moe_gemm_wgmma();
/// Whether the wgmma kernel can run on the current device (its sm_90a code is what the driver
/// loaded). Synchronous: not while a stream captures.
bool moe_wgmma_runs();
/// Whether moe_experts' grouped GEMM runs prompt rows on int8 tensor cores (activations rounded
/// to 8 bits per 32, as the decode GEMV does; mma.sync m16n8k32) instead of f16 (weights
/// dequantized to f16), where moe_gemm_mma() applies and all three matrices are quantized
/// (false by default: an experiment, measured in docs/performance.md). BERTH_MOE_INT8=1 (or
/// true, on, yes) sets it true. The workspace size depends on it: set it before sizing (not
/// thread safe).
bool& moe_gemm_int8();
/// Whether moe_experts' decode rows (quantized gate, up and down, gate and up of one type, n_ff a
/// multiple of 32) run on two fused launches (gate and up with SwiGLU's quantization; down with
/// the combine) instead of five, with the same bits (false by default: slower on the H200 under
/// graph replay, docs/performance.md). BERTH_MOE_FUSED=1 (or true, on, yes) sets it true. The
/// workspace size depends on it: set it before sizing (not thread safe).
bool& moe_gemv_fused();
/// Whether moe_experts' decode rows of a step of several tokens (the five-launch path, some of
/// gate, up and down quantized) run their routed GEMVs on the quantized matrices grouped by
/// expert: a one-warp kernel lists the step's pairs by expert in tiles of up to 4, and each GEMV
/// block loads its expert's rows once for all pairs of its tile (false by default: on an H100
/// the several-token decode steps of synthetic qwen3-30b-a3b were 7-10% slower with it,
/// docs/performance.md). Each pair's row gets the bits the one-pair-per-block launch gives it
/// (tested), so a row's bits do not depend on the step's other tokens. BERTH_MOE_GROUP=1 (or
/// true, on, yes) sets it true. The workspace size depends on it: set it before sizing (not
/// thread safe).
bool& moe_gemv_group();
/// Whether decode GEMVs (matmul's decode rows, matmul_group, moe_experts' decode rows) on Q4_K,
/// Q5_K and Q6_K weights run on the 64-element-unit kernel (true by default: every loaded weight
/// byte used by the lane that loads it, several rows per lane set sharing the activations'
/// loads) instead of the 32-element-group kernel of the other types. BERTH_GEMV_KQ=0 (or false,
/// off, no) sets it false. The two sum a row in different orders (different rounding). Not
/// thread safe: set before launching. moe_experts' workspace size depends on it and on
/// gemv_kq_rps() and gemv_kq_lanes() (the fused decode's count words): set them before sizing.
bool& gemv_kq();
/// Rows per lane set of that kernel: 0 (default) chooses by the launch's size (2 from 512 blocks
/// of 2-row sets on), 1 or 2 forces it (BERTH_GEMV_KQ_RPS sets it). A row's bits never depend on
/// it (tested).
int& gemv_kq_rps();
/// Lanes per row of that kernel (from the matrix's shape, never the launch's): 0 (default) the
/// group kernel's rule (up to 32, at most 1/8 of the lane steps idle), doubled for a matrix that is
/// not routed while it fills fewer than 256 row blocks, up to its 64-element unit count rounded
/// up to a power of two; 1 32, or the unit count rounded up to a power of two when smaller; 2 the
/// group kernel's rule alone (from n_in). BERTH_GEMV_KQ_LANES sets it (benchmarks compare the
/// rules).
int& gemv_kq_lanes();
/// Minimum resident blocks per SM that single-token launches of that kernel are compiled for
/// (its __launch_bounds__, which caps the registers per thread at 65536 / (128 x it)): 7 (default:
/// at most 72 registers), 0 (no minimum: 70-82 registers by type, 6-7 blocks per SM) or 8 (at
/// most 64, with spills for Q5_K and Q6_K). The arithmetic is the same instructions in any
/// allocation, so a row's bits never depend on it (tested); only the speed does (Qwen3.5-27B
/// decode on an H200: 7 113.9 tok/s, 0 106.1-107.4, docs/performance.md). BERTH_GEMV_KQ_MINB sets
/// it; another value throws Error(invalid_argument).
int& gemv_kq_minb();
/// Whether quantized GEMVs of 2-4 tokens run gemv_q4_kernel (4 accumulators per row, compiled
/// for 5 blocks per SM: at most 102 registers) instead of the 8-token instantiation (126-128
/// registers for the K-quants, 4 blocks per SM). A token's sum is the same butterfly in both
/// (gemv_store's reduce-scatter), so its bits do not change (tested); only the speed may. Off by
/// default until measured; BERTH_GEMV_TOK4=1 (or true, on, yes) sets it.
bool& gemv_tok4();
}  // namespace detail

/// MoE router: for each of n_tok rows of logits [n_tok, n_expert]: p = softmax (in double),
/// the k largest p selected in descending order (ties: lowest id first), weights = selected p,
/// divided by their sum when `norm`. out [n_tok, 2k]: ids as exact floats, then weights
/// (double rounded once to float). Matches berth::cpu::moe_topk exactly. `forced` (device
/// int32 [n_tok, k], or null): the experts to select instead (a routing trace replayed; each
/// row distinct ids < n_expert, unchecked here), weighted as cpu::moe_forced weights them.
void moe_route(const float* logits, int64_t n_tok, int32_t n_expert, int32_t k, bool norm,
               float* out, cudaStream_t stream, const int32_t* forced = nullptr);

/// moe_route of one token (logits [1, n_expert] -> out [1, 2k]), then, in the same launch,
/// copy_out_signal(copies, n, flag, value): a decode step's route (copies may name `out`) and
/// hidden state reach the host with the ready flag of the CPU segment that reads them. Errors:
/// as moe_route and copy_out_signal. `forced`: as moe_route's (one row).
void moe_route_signal(const float* logits, int32_t n_expert, int32_t k, bool norm, float* out,
                      const HostCopy* copies, int n, uint32_t* flag, uint32_t value,
                      cudaStream_t stream, const int32_t* forced = nullptr);

/// The router's matmul and moe_route_signal of one token in one launch (a thread block cluster;
/// on devices without clusters the two launches): logits [1, n_expert] = W x, W [n_expert, n_in]
/// of a float type (F32, F16, BF16; row-major, n_in contiguous) and x [1, n_in] f32, each logit
/// the bits matmul computes; then as moe_route_signal (route [1, 2k], copies, flag). Two
/// launches (matmul's GEMV, moe_route_signal) without cluster kernels or past 4096 experts.
/// Errors: Error(invalid_argument) for a quantized W, and as matmul and moe_route_signal.
/// `forced`: as moe_route's (one row).
void router_route_signal(GgmlType type, const void* w, int64_t n_in, const float* x,
                         int32_t n_expert, int32_t k, bool norm, float* logits, float* route,
                         const HostCopy* copies, int n, uint32_t* flag, uint32_t value,
                         cudaStream_t stream, const int32_t* forced = nullptr);

/// Stacked expert weights of one MoE layer: berth::MoeWeights (core/tensor.h).
using berth::MoeWeights;
/// Slot range and staging of a moe_experts call: berth::MoeSlots (core/tensor.h).
using berth::MoeSlots;

/// Which path moe_experts takes: by_count picks by the token count (the per-pair GEMV up to
/// moe_gemv_max_tok() tokens, the grouped GEMM above: fastest, but a row's bits then depend on
/// how many tokens share its call); gemv and gemm force one, so that a row's bits depend only
/// on its kind (decode rows on the GEMV, prompt rows on the GEMM) in batch-invariant steps.
enum class MoePath { by_count, gemv, gemm };

/// Workspace bytes of moe_experts for n_tok tokens (with `slots`: the staging room).
size_t moe_workspace_bytes(const MoeWeights& w, int64_t n_tok, const MoeSlots& slots = {},
                           MoePath path = MoePath::by_count);

/// Routed experts: out [n_tok, n_embd] = for each token, the sum over its slots j (in slot
/// order) in [slots.begin, slots.end) whose expert e = route[t, j] has expert_mask[e] != 0 of
/// route[t, k + j] * down_e(silu(gate_e h_t) * up_e h_t); zero rows for tokens with no such slot.
/// h [n_tok, n_embd], route [n_tok, 2k] (moe_route's output), expert_mask n_expert bytes, all in
/// device memory; the weights in device memory or (slots.stage, or reading in place) pinned
/// host memory. Tokens are gathered per expert (several tokens may pick one expert; an expert
/// no token picks costs nothing) and each expert's tokens go through grouped GEMV/GEMM.
/// With slots.by_table (expert slots), w.gate/up/down are the slot arrays ([n_slots] experts'
/// matrices each, as stored) and the pairs computed are those whose expert e has
/// slots.table[e] in [0, n_slots) (device memory, read by the kernels: a captured graph follows
/// its changes), reading slot table[e]; expert_mask is ignored.
/// Throws Error(invalid_argument) for a bad shape, slot range or too small a workspace.
/// `path`: MoePath (the GEMM path also needs n_embd and n_ff multiples of 32).
void moe_experts(const MoeWeights& w, const float* h, const float* route, int64_t n_tok,
                 const uint8_t* expert_mask, float* out, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream, const MoeSlots& slots = {}, MoePath path = MoePath::by_count);

/// Greedy selection: ids[r] = argmax of logits row r ([rows, n_vocab]); ties: lowest id.
void argmax(const float* logits, int64_t rows, int64_t n_vocab, int32_t* ids, cudaStream_t stream);

/// Workspace bytes of top_k for one row of n_vocab logits.
size_t top_k_workspace_bytes(int64_t n_vocab, int32_t k);
/// The k (1..256) largest logits of one row [n_vocab], in descending order (ties: lowest id
/// first): ids[k], values[k].
void top_k(const float* logits, int64_t n_vocab, int32_t k, int32_t* ids, float* values,
           void* workspace, size_t workspace_bytes, cudaStream_t stream);

// --- Qwen3.5 hybrids: Gated DeltaNet and gated-attention ops (graph.h's head_slice, sigmoid_mul,
// rms_norm_gated, ssm_conv, gated_delta; CPU twins in cpu_kernels/gdn.h). Matrices are f32
// [rows, cols] with cols contiguous. Recurrent states are per sequence: token t belongs to
// sequence seqs[t] (seqs null: all sequence 0) at position positions[t] (both n_tok int32 in
// device memory, read by the kernels, so a captured graph replays with new ones); a token at
// position 0 starts its sequence from a zero state (the buffer's old contents are not read).
// The last n_decode rows are decode rows, each the only token of its sequence in the step (run
// in parallel); the first n_tok - n_decode rows are prompt rows, run in row order (any
// sequences, none of them a decode row's). Errors: Error(invalid_argument) for bad sizes.

/// head_slice: x [rows, n_group * group] -> out [rows, n_group * len],
/// out[r, j * len + i] = x[r, j * group + offset + i]. Requires group > 0, offset >= 0, len >= 0,
/// offset + len <= group. out must not overlap x.
void head_slice(const float* x, float* out, int64_t rows, int64_t n_group, int32_t group,
                int32_t offset, int32_t len, cudaStream_t stream);

/// out = x * sigmoid(gate), computed as x / (1 + exp(-gate)); x/out [rows, cols]; gate [rows,
/// cols], or [rows, 1] when per_row (one gate per row broadcast over the columns). out may alias
/// x, or gate when gate has out's shape (not a per-row gate of a row of cols > 1).
void sigmoid_mul(const float* x, const float* gate, float* out, int64_t rows, int64_t cols,
                 bool per_row, cudaStream_t stream);

/// Gated RMSNorm per group: x, z, out [rows, cols] (cols a multiple of group), w [group] f32:
/// out = x / sqrt(mean_group(x^2) + eps) * w * silu(z), each run of `group` columns on its own
/// (sum of squares in double). out may alias x or z. One warp per run.
void rms_norm_gated(const float* x, const float* z, const float* w, float* out, int64_t rows,
                    int64_t cols, int32_t group, float eps, cudaStream_t stream);

/// ssm_conv: causal depthwise conv1d + SiLU over per-sequence rolling state.
/// x, out [n_tok, channels] (must not overlap each other or the state); w [channels][kernel]
/// (channel c's taps at w[c * kernel + i], i = 0 oldest); state: sequence s's conv state at
/// state + s * (kernel - 1) * channels, kernel - 1 rows of `channels` (row kernel - 2 the newest
/// input). out[t, c] = silu(sum_i w[c * kernel + i] * window[i]), the window the last `kernel`
/// inputs of t's sequence up to and including t; the state then holds the last kernel - 1.
/// Sequences, positions and n_decode as the section's comment says (positions required).
/// Requires 1 <= kernel <= 8, 0 <= n_decode <= n_tok.
void ssm_conv(const float* x, float* out, int64_t n_tok, int64_t channels, const float* w,
              int32_t kernel, float* state, const int32_t* positions, const int32_t* seqs,
              int64_t n_decode, cudaStream_t stream);

/// Workspace gated_delta needs (the normalised q/k rows and gates of n_tok tokens).
size_t gated_delta_workspace_bytes(int64_t n_tok, int32_t hk, int32_t hv, int32_t dk);

/// gated_delta: the gated delta rule with its L2 norms and gates. y [n_tok, 2*hk*dk + hv*dv]
/// (q heads, k heads, v heads), alpha, b [n_tok, hv], ssm_a, dt_bias [hv] f32; state: sequence
/// s's state at state + s * hv*dk*dv, V head h's d_k x d_v block at + h*dk*dv (d_v contiguous:
/// S[i][j] at [i*dv + j]). Per token and V head h, with K head h % hk: q, k = l2_norm (x /
/// sqrt(sum x^2 + eps), as cpu::l2_norm); g = ssm_a * softplus(alpha + dt_bias) (softplus(u) = u
/// for u > 20); beta = sigmoid(b); S = exp(g) S; S += k (beta (v - S^T k))^T; out[t, h*dv + j] =
/// (S^T q)_j / sqrt(dk). out [n_tok, hv*dv], must not overlap y or the state. Sequences,
/// positions and n_decode as the section's comment says (positions required). Two launches: the
/// norms and gates into ws, then the recurrence (the state in registers, tokens in order).
/// ws: at least gated_delta_workspace_bytes, 16-byte aligned. Requires 1 <= dk <= 256, 1 <= dv <=
/// 256, hv % hk == 0, 0 <= n_decode <= n_tok; Error(invalid_argument) otherwise.
void gated_delta(const float* y, const float* alpha, const float* b, const float* ssm_a,
                 const float* dt_bias, int64_t n_tok, int32_t hk, int32_t hv, int32_t dk,
                 int32_t dv, float eps, float* state, const int32_t* positions, const int32_t* seqs,
                 int64_t n_decode, float* out, void* ws, size_t ws_bytes, cudaStream_t stream);

}  // namespace berth::gpu
