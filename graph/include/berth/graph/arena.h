// Activation memory of a step: buffers whose lifetimes do not overlap share bytes of one arena.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "berth/graph/graph.h"

namespace berth::graph {

/// Offsets for buffers of `sizes` bytes with lifetimes [birth, death] (inclusive, in any unit of
/// time) in one arena: buffers whose lifetimes overlap get disjoint ranges, each rounded up to 256
/// bytes; first fit in birth order. Fills offsets[i] (bytes; 0 where sizes[i] is 0) and returns
/// the arena's bytes. The three vectors have one entry per buffer.
size_t assign_offsets(const std::vector<size_t>& sizes, const std::vector<int64_t>& birth,
                      const std::vector<int64_t>& death, std::vector<size_t>& offsets);

/// Lifetimes of `g`'s values over the ops `order` (indices into g.ops in the order they run;
/// empty: all of g in order) as CpuExecutor runs them: a run of consecutive matmuls of one input
/// (adjacent in `order` and in g.ops) is one parallel region, its outputs born at its first op
/// and its inputs read until its last. Fills birth and death (one per value, positions in
/// `order`; -1 for a value no listed op touches; a value read before any listed op writes it is
/// born at its first reader).
void op_lifetimes(const Graph& g, std::span<const int32_t> order, std::vector<int64_t>& birth,
                  std::vector<int64_t>& death);

/// The arena of `g`'s values when its ops run one after another in order, as
/// CpuExecutor::run runs them: value v ([rows, cols] f32) lives from the op that writes it to
/// the last op that reads it; a run of consecutive matmuls of one input counts as one op (they
/// run as one parallel region); the graph's output and the values in `keep` live to the end.
/// Fills offsets (bytes, one per value, 256-byte aligned) and returns the arena's bytes.
size_t step_arena(const Graph& g, std::span<const ValueId> keep, std::vector<size_t>& offsets);

/// The values of `g` that CpuExecutor::run keeps readable after the step besides the output:
/// each moe_route output (a layer's routing, read after the step by routing recorders).
std::vector<ValueId> kept_after_step(const Graph& g);

}  // namespace berth::graph
