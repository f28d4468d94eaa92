// DiskTier::Stats (residency/disk_tier.h): the achieved rate's bytes and busy time both come from
// the tier's io::DiskReader over the window since reset_stats(), while bytes_read keeps counting
// the slices the tier asked for. One tiered MoE layer of F32 experts whose slices are 4 whole
// blocks starting 96 bytes into a block: the io_uring backend reads 5 blocks per slice (the
// partial blocks at both ends whole), the pread backend the slice's bytes. The moe_experts op
// runs on the CPU executor with the tier bound; its output matches the same graph reading the
// file's mapping.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "berth/backends/cpu_executor.h"
#include "berth/backends/kv_view.h"
#include "berth/backends/thread_pool.h"
#include "berth/core/error.h"
#include "berth/graph/graph.h"
#include "berth/io/disk_reader.h"
#include "berth/io/mapped_file.h"
#include "berth/residency/disk_tier.h"
#include "test_util.h"

using namespace berth;

namespace {

constexpr int64_t kEmbd = 64, kFf = 64, kVocab = 50;
constexpr int32_t kExperts = 8, kUsed = 2, kSlots = 3;
constexpr size_t kSlice = kEmbd * kFf * sizeof(float);  // 16384: 4 blocks
constexpr size_t kHead = 96;                            // the first tensor's file offset
constexpr size_t kTensor = kSlice * kExperts;

static_assert(kSlice % io::kDirectAlignment == 0 && kTensor % io::kDirectAlignment == 0);

std::vector<float> gaussian(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

TensorView view(const char* name, int64_t ne0, int64_t ne1, int64_t ne2, const void* data) {
  TensorView t;
  t.name = name;
  t.type = GgmlType::F32;
  t.ne = {ne0, ne1, ne2, 1};
  t.n_dims = ne2 > 1 ? 3 : 2;
  t.data = data;
  t.n_bytes = static_cast<size_t>(ne0 * ne1 * ne2) * sizeof(float);
  return t;
}

// The model: token_embd and the router in memory; ffn_{gate,up,down}_exps in the file at
// kHead + t * kTensor (t = 0, 1, 2), then two blocks of padding (no read meets the file's end).
struct Model {
  std::filesystem::path path;
  std::vector<float> embd = gaussian(static_cast<size_t>(kEmbd * kVocab), 1, 1.0f);
  std::vector<float> router = gaussian(static_cast<size_t>(kEmbd * kExperts), 2, 1.0f);
  std::unique_ptr<io::MappedFile> file;
  graph::WeightTable wt;
  graph::WeightId id_embd = graph::kNoWeight, id_router = graph::kNoWeight;
  std::array<graph::WeightId, 3> id_exps{};

  Model() {
    path = test::temp_dir("disk-tier-stats") / "experts.bin";
    std::vector<uint8_t> bytes(kHead + 3 * kTensor + 2 * io::kDirectAlignment, 0);
    for (size_t t = 0; t < 3; ++t) {
      const std::vector<float> w =
          gaussian(kTensor / sizeof(float), static_cast<uint32_t>(3 + t), 0.1f);
      std::memcpy(bytes.data() + kHead + t * kTensor, w.data(), kTensor);
    }
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    out.close();
    REQUIRE(out.good());
    file = std::make_unique<io::MappedFile>(path.string());
    id_embd = wt.add(view("token_embd.weight", kEmbd, kVocab, 1, embd.data()));
    id_router = wt.add(view("blk.0.ffn_gate_inp.weight", kEmbd, kExperts, 1, router.data()));
    const uint8_t* at = file->data() + kHead;
    id_exps[0] = wt.add(view("blk.0.ffn_gate_exps.weight", kEmbd, kFf, kExperts, at));
    id_exps[1] = wt.add(view("blk.0.ffn_up_exps.weight", kEmbd, kFf, kExperts, at + kTensor));
    id_exps[2] = wt.add(view("blk.0.ffn_down_exps.weight", kFf, kEmbd, kExperts, at + 2 * kTensor));
  }

  graph::Graph build(int32_t n_tok) const {
    const graph::MoeParams p{.n_expert = kExperts,
                             .n_expert_used = kUsed,
                             .norm_weights = true,
                             .gate = id_exps[0],
                             .up = id_exps[1],
                             .down = id_exps[2]};
    graph::Builder b(wt, n_tok);
    const graph::ValueId h = b.embed(id_embd, "h");
    const graph::ValueId route = b.moe_route(b.matmul(h, id_router, "router"), p, "route");
    return b.finish(b.moe_experts(h, route, p, "moe"));
  }

  DiskTierOptions tier_options(io::DiskReaderOptions::Backend backend) const {
    DiskTierOptions o;
    o.path = path.string();
    DiskTierLayer l;
    l.layer = 0;
    l.weights = id_exps;
    for (size_t t = 0; t < 3; ++t) l.file_offset[t] = kHead + t * kTensor;
    l.n_expert_used = kUsed;  // no router: nothing predicted (the reads of a step end in it)
    o.layers = {l};
    o.slots_per_layer = kSlots;
    o.reader.backend = backend;
    return o;
  }
};

// Runs the graph on `tokens` (one step of all of them, or one step per token) at positions
// from `pos0`; returns the outputs, concatenated.
std::vector<float> run(CpuExecutor& ex, const Model& m, const std::vector<int32_t>& tokens,
                       int32_t pos0, bool one_by_one) {
  std::vector<float> out;
  const size_t step = one_by_one ? 1 : tokens.size();
  for (size_t i = 0; i < tokens.size(); i += step) {
    const std::vector<int32_t> t(tokens.begin() + static_cast<long>(i),
                                 tokens.begin() + static_cast<long>(i + step));
    std::vector<int32_t> pos(t.size());
    std::iota(pos.begin(), pos.end(), pos0 + static_cast<int32_t>(i));
    const graph::Graph g = m.build(static_cast<int32_t>(t.size()));
    const std::span<const float> y = ex.run(g, t, pos);
    out.insert(out.end(), y.begin(), y.end());
  }
  return out;
}

}  // namespace

TEST_CASE("disk tier: the achieved rate's bytes are the reader's over the stats window") {
  WorkerThreadsGuard workers;  // before the pool: joins oneTBB's workers at the end
  Model m;
  ThreadPool pool(2);
  KvView kv;
  kv.n_ctx = 256;
  std::mt19937 rng(7);
  std::vector<int32_t> prompt(12), decode(24);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % kVocab);
  for (int32_t& t : decode) t = static_cast<int32_t>(rng() % kVocab);

  // The same steps reading the experts through the mapping.
  std::vector<float> want_prompt, want_decode;
  {
    CpuExecutor ex(pool, m.wt, kv);
    want_prompt = run(ex, m, prompt, 0, false);
    want_decode = run(ex, m, decode, 12, true);
  }

  auto check = [&](io::DiskReaderOptions::Backend backend) {
    DiskTier tier(m.wt, m.tier_options(backend));
    CpuExecutor ex(pool, m.wt, kv);
    tier.bind(ex);
    const io::DiskReader& reader = tier.reader();
    const bool direct = reader.backend() == io::DiskBackend::io_uring;
    // Bytes the kernel returns per expert read: three slices, each 5 blocks with O_DIRECT.
    const uint64_t per_read = direct ? 3 * (kSlice + io::kDirectAlignment) : 3 * kSlice;
    MESSAGE(io::backend_name(reader.backend()));

    // A window before the reset: the prompt (every expert's reads end inside the step).
    CHECK(run(ex, m, prompt, 0, false) == want_prompt);
    DiskTier::Stats st = tier.stats();
    int64_t reads = st.reads_demand + st.reads_ahead;
    CHECK(reads > 0);
    CHECK(st.bytes_read == reads * static_cast<int64_t>(3 * kSlice));
    CHECK(st.reader_bytes == reader.bytes_read());
    CHECK(st.reader_bytes == static_cast<uint64_t>(reads) * per_read);

    // The window after it: decode, one token per step.
    tier.reset_stats();
    const uint64_t base = reader.bytes_read();
    st = tier.stats();
    CHECK(st.bytes_read == 0);
    CHECK(st.reader_bytes == 0);
    CHECK(run(ex, m, decode, 12, true) == want_decode);
    st = tier.stats();
    reads = st.reads_demand + st.reads_ahead;
    CAPTURE(reads);
    CHECK(st.calls == static_cast<int64_t>(decode.size()) * kUsed);
    CHECK(reads > 0);  // 3 slots for 8 experts: decode misses
    CHECK(st.bytes_read == reads * static_cast<int64_t>(3 * kSlice));
    // Exact: what the reader reports for the window, the whole blocks of O_DIRECT included.
    CHECK(st.reader_bytes == reader.bytes_read() - base);
    CHECK(st.reader_bytes == static_cast<uint64_t>(reads) * per_read);
    CHECK(st.busy_seconds > 0.0);
    CHECK(st.bandwidth() == static_cast<double>(st.reader_bytes) / st.busy_seconds);
    if (direct) CHECK(st.reader_bytes > static_cast<uint64_t>(st.bytes_read));
  };
  SUBCASE("pread") { check(io::DiskReaderOptions::Backend::pread); }
  SUBCASE("io_uring where available, else pread") {
    check(io::DiskReaderOptions::Backend::automatic);
  }
}
