#include "berth/runtime/placed.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <optional>

#include "berth/backends/thread_pool.h"
#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/graph/arena.h"
#include "berth/residency/residency.h"
#include "berth/runtime/plan_request.h"
#include "berth/scheduler/memory.h"
#include "berth/scheduler/scheduler.h"

namespace berth {

namespace {
double gib(size_t b) { return static_cast<double>(b) / (1ull << 30); }

// Host memory available for new allocations: MemAvailable of /proc/meminfo (free memory plus
// reclaimable cache), else the free pages; bytes.
size_t host_available_bytes() {
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    unsigned long long kb = 0;
    bool found = false;
    while (std::fgets(line, sizeof line, f))
      if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
        found = true;
        break;
      }
    std::fclose(f);
    if (found) return static_cast<size_t>(kb) * 1024;
  }
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
}

// Error(invalid_argument) from parsing BERTH_SIM_DEVICE as Error(usage): a bad value is bad
// usage of the command's environment (exit 2), not a bad input file or run.
template <typename F>
auto sim_usage(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    if (e.category() != ErrorCategory::invalid_argument) throw;
    throw Error(ErrorCategory::usage, e.what());
  }
}

// BERTH_SIM_DEVICE names a simulated unified board: "unified:" in any case ("UNIFIED:8G").
bool unified_spec(std::string_view spec) {
  constexpr std::string_view prefix = "unified:";
  if (spec.size() < prefix.size()) return false;
  for (size_t i = 0; i < prefix.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(spec[i])) != prefix[i]) return false;
  return true;
}

// The memory of the simulated discrete device BERTH_SIM_DEVICE=SIZE names; Error(usage) when
// malformed or 0 (KEY=VALUE settings belong to a unified board: "unified:SIZE,KEY=VALUE").
size_t sim_device_size(const std::string& spec) {
  return sim_usage([&] {
    if (spec.find_first_of(",=") != std::string::npos)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("BERTH_SIM_DEVICE={}: KEY=VALUE settings are for a simulated "
                              "unified board (unified:SIZE[,KEY=VALUE...]); a discrete device "
                              "takes a size alone",
                              spec));
    const size_t size = placement::parse_size(spec, "BERTH_SIM_DEVICE");
    // As unified:0: a device of no memory is a mistake, not a way to say "none".
    if (size == 0)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("BERTH_SIM_DEVICE={}: a simulated device's memory must be more "
                              "than 0 (unset BERTH_SIM_DEVICE for no device)",
                              spec));
    return size;
  });
}

// The simulated unified board BERTH_SIM_DEVICE=unified:... names, if any; Error(usage) when
// BERTH_SIM_DEVICE is malformed (a discrete device's size too: run and serve with -ngl 0 open no
// device, and a bad value is still an error there).
std::optional<SimDeviceOptions> sim_board() {
  const char* sim = std::getenv("BERTH_SIM_DEVICE");
  if (!sim || !*sim) return std::nullopt;
  const std::string spec(sim);
  if (!unified_spec(spec)) {
    sim_device_size(spec);
    return std::nullopt;
  }
  return sim_usage([&] { return parse_unified_sim(spec.substr(8), "BERTH_SIM_DEVICE=" + spec); });
}

// A real unified board's integrated GPU, asked when no device is opened (run and serve with
// -ngl 0) and BERTH_SIM_DEVICE names none: device 0's DeviceInfo when it says it shares the host's
// memory (CUDA: cudaDevAttrIntegrated, as on GB10 and Jetson Orin), so that the board's pool
// bounds the plan as it does for `berth plan`, which opens the device. Asked once per process
// (default_serve_context plans many times), through the device-info path the plan uses: the
// device is opened, read and closed, which makes a CUDA context; so only where a CUDA device is
// present (cuda_available(): none is made without one, nor in a build without CUDA) and on Arm
// hosts, where every integrated GPU CUDA supports is (elsewhere a -ngl 0 run touches no device).
std::optional<DeviceInfo> real_board() {
#if defined(__aarch64__)
  if (const char* sim = std::getenv("BERTH_SIM_DEVICE"); sim && *sim) return std::nullopt;
  static const std::optional<DeviceInfo> board = []() -> std::optional<DeviceInfo> {
    if (!cuda_available()) return std::nullopt;
    try {
      DeviceInfo info = make_cuda_device(0)->info();
      if (info.unified) return info;
    } catch (const Error&) {
      // A device that cannot be opened is not one to plan for: as none.
    }
    return std::nullopt;
  }();
  return board;
#else
  return std::nullopt;
#endif
}

// What the OS reports available, bytes: on a simulated unified board its available= (the
// board's memory is the host's), else MemAvailable of this host.
size_t os_available_bytes() {
  if (const auto board = sim_board()) return board->os_available_bytes;
  return host_available_bytes();
}
}  // namespace

std::string PlacementSetup::summary() const {
  // The CPU computes the routed experts of the disk tier too (read into its RAM slots).
  const size_t cpu = plan.cpu_weight_bytes + plan.disk_weight_bytes;
  const std::string disk =
      plan.disk_weight_bytes > 0
          ? fmt::format(
                " ({:.2f} GiB of them routed experts read from disk into {} RAM slot{} per "
                "MoE layer)",
                gib(plan.disk_weight_bytes), plan.ram_slots, plan.ram_slots == 1 ? "" : "s")
          : "";
  if (!device)
    return fmt::format("placement: all {:.2f} GiB of weights on the CPU{} ({})", gib(cpu), disk,
                       plan.how);
  return fmt::format(
      "placement ({}): {:.2f} GiB of weights{} + {:.2f} GiB KV cache + {:.2f} GiB scratch on {}, "
      "{:.2f} GiB of weights on the CPU{}",
      plan.how, gib(plan.gpu_weight_bytes), plan.unified ? " (read in place in host memory)" : "",
      gib(plan.gpu_kv_bytes), gib(plan.scratch_bytes), device->name(), gib(cpu), disk);
}

std::string auto_stream_off(const Model& model, const placement::Plan& plan, size_t host_available,
                            bool extra_copy) {
  const graph::WeightTable& w = model.weights();
  size_t pinned = 0;  // the CPU-held stacked expert tensors' pinned copy
  for (size_t i = 0; i < w.size() && i < plan.home.size(); ++i)
    if (plan.home[i] == placement::Home::cpu && w[i].ne[2] > 1) pinned += w[i].n_bytes;
  if (pinned == 0) return "-";
  // The CPU-held weights must fit in memory with 2 GiB left to everything else (registered in
  // place they are locked there), plus the experts' pinned copy when `extra_copy`: the CPU
  // reads the copy instead of the file's pages where copy_read_by_cpu(), so it costs nothing
  // more there.
  const size_t need = (extra_copy ? pinned : 0) + plan.cpu_weight_bytes + (size_t{2} << 30);
  if (need <= host_available) return {};
  if (extra_copy)
    return fmt::format(
        "the pinned copy of the CPU-held experts ({:.2f} GiB), with the CPU's weights ({:.2f} "
        "GiB) and 2 GiB to spare, needs more than the {:.2f} GiB of host memory available "
        "(--stream-experts N forces it)",
        gib(pinned), gib(plan.cpu_weight_bytes), gib(host_available));
  return fmt::format(
      "the CPU-held weights ({:.2f} GiB, {:.2f} GiB of experts among them pinned for the "
      "device) with 2 GiB to spare need more than the {:.2f} GiB of host memory available "
      "(--stream-experts N forces it)",
      gib(plan.cpu_weight_bytes), gib(pinned), gib(host_available));
}

size_t default_ram_budget() {
  const size_t avail = os_available_bytes();
  return avail > placement::kRamMargin ? avail - placement::kRamMargin : 0;
}

void use_disk_tier(const gguf::File& file, const Model& model, const placement::Plan& plan,
                   SessionParams& params, const io::DiskReaderOptions& reader) {
  params.disk = {};
  if (plan.ram_slots <= 0) return;
  const graph::WeightTable& w = model.weights();
  params.disk.path = file.path();
  params.disk.slots_per_layer = plan.ram_slots;
  params.disk.reader = reader;
  // BERTH_DISK_READ_AHEAD=0: reads on demand only (for measuring what read-ahead gives).
  const auto off = [](const char* v) {
    const std::string_view s = v ? v : "";
    return s == "0" || s == "off" || s == "false" || s == "no";
  };
  if (off(std::getenv("BERTH_DISK_READ_AHEAD"))) params.disk.read_ahead = false;
  // The mapping, for reading the other CPU-held weights with O_DIRECT at start
  // (BERTH_DIRECT_LOAD=0: fault them in through the mapping instead).
  if (!file.tensors().empty()) {
    const gguf::TensorInfo& t = file.tensors().front();
    params.disk.file_bytes = t.data - (file.data_offset() + t.offset);
    params.disk.file_size = file.file_size();
  }
  if (off(std::getenv("BERTH_DIRECT_LOAD"))) params.disk.direct_load = false;
  for (size_t l = 0; l < plan.layer_ram_slots.size(); ++l) {
    if (plan.layer_ram_slots[l] <= 0) continue;
    DiskTierLayer d;
    d.layer = static_cast<int32_t>(l);
    d.n_expert_used = static_cast<int32_t>(model.hparams().n_expert_used);
    const std::array<std::string, 3> kinds{"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    for (size_t i = 0; i < w.size(); ++i) {
      if (w.layers[i] != static_cast<int32_t>(l)) continue;
      if (w.roles[i] == graph::WeightRole::router) d.router = static_cast<graph::WeightId>(i);
      if (w.roles[i] != graph::WeightRole::routed_expert) continue;
      for (size_t t = 0; t < 3; ++t)
        if (w[static_cast<graph::WeightId>(i)].name.find(kinds[t]) != std::string::npos) {
          const gguf::TensorInfo* ti = file.find_tensor(w[static_cast<graph::WeightId>(i)].name);
          if (!ti)
            throw Error(ErrorCategory::internal,
                        fmt::format("disk tier: tensor '{}' is not in {}",
                                    w[static_cast<graph::WeightId>(i)].name, file.path()));
          d.weights[t] = static_cast<graph::WeightId>(i);
          d.file_offset[t] = file.data_offset() + ti->offset;
        }
    }
    for (size_t t = 0; t < 3; ++t)
      if (d.weights[t] == graph::kNoWeight)
        throw Error(ErrorCategory::internal,
                    fmt::format("disk tier: layer {} has no blk.{}.{}.weight", l, l, kinds[t]));
    params.disk.layers.push_back(d);
  }
}

std::unique_ptr<Device> default_device() {
  // BERTH_SIM_DEVICE, when set, wins over a GPU that is present (the simulated cases of the test
  // suites run the same on a GPU machine).
  if (const char* sim = std::getenv("BERTH_SIM_DEVICE"); sim && *sim) {
    const std::string spec(sim);
    if (!unified_spec(spec)) return make_sim_device(sim_device_size(spec));
    return sim_usage([&] {
      return make_sim_device(parse_unified_sim(spec.substr(8), "BERTH_SIM_DEVICE=" + spec));
    });
  }
  if (cuda_available()) return make_cuda_device(0);
  return nullptr;
}

namespace {

// The flags give the GPU something to compute: -ngl other than 0, or an -ot rule naming it.
bool flags_want_gpu(const placement::Flags& flags) {
  bool wants = flags.n_gpu_layers != 0;
  for (const auto& [re, dev] : flags.overrides)
    if (dev != "CPU" && dev != "cpu") wants = true;
  return wants;
}

// Unified memory as place() decides it, for plan, run and serve alike: on for `device` (null:
// none, or with `has_device` a GPU planned for by --vram-budget) when the flags give the GPU
// something to compute (with -ngl 0 and no -ot rule naming it, unified mode changes nothing,
// whether or not a device was opened: plan opens it to show it, run and serve do not) and
// --unified is on, or auto on a device that says it shares the host's memory. Then one pool:
// the OS's available memory minus the margin (at most the board's memory), not what the device
// reports free (on such boards cudaMemGetInfo counts the page cache as used).
// `shared`: a board whose memory the device shares planned without unified mode (--unified off
// with the GPU computing: the same pool, for both sides of a plan of copies; or nothing
// computing on the GPU, -ngl 0: the pool bounds the CPU's side, strictly)
// (Request::shared_pool_bytes). `discrete`: unified mode on a device with memory of its own
// (--unified on on a discrete GPU), whose KV cache, scratch and margin still take that memory.
struct UnifiedPool {
  bool unified = false, shared = false, discrete = false;
  size_t os_available = 0, pool = 0;
  size_t board = 0;  ///< the board's memory (0: not a board, or --unified on on a discrete GPU)
};

UnifiedPool unified_pool(const Device* device, const placement::Flags& flags, bool has_device) {
  UnifiedPool u;
  const DeviceInfo dinfo = device ? device->info() : DeviceInfo{};
  u.unified = has_device && flags_want_gpu(flags) &&
              (flags.unified == placement::UnifiedMode::on ||
               (flags.unified == placement::UnifiedMode::automatic && dinfo.unified));
  // A unified board: the device says so, or (run and serve with -ngl 0 open none) the simulated
  // board BERTH_SIM_DEVICE names, or a real board's integrated GPU, asked (real_board()).
  const std::optional<SimDeviceOptions> sim = device ? std::nullopt : sim_board();
  const std::optional<DeviceInfo> real = device || sim ? std::nullopt : real_board();
  const bool board = device ? dinfo.unified : sim.has_value() || real.has_value();
  u.shared = !u.unified && board;
  u.discrete = u.unified && device && !dinfo.unified;
  if (!u.unified && !u.shared) return u;
  u.os_available = dinfo.os_available_bytes > 0 ? dinfo.os_available_bytes : os_available_bytes();
  u.pool = u.os_available > placement::kRamMargin ? u.os_available - placement::kRamMargin : 0;
  // A unified board's memory bounds the pool; --unified on on a discrete GPU keeps the
  // weights in host memory, which its VRAM does not bound.
  if (device && dinfo.unified) u.board = dinfo.total_bytes;
  if (sim) u.board = sim->capacity_bytes;
  if (real) u.board = real->total_bytes;
  if (u.board > 0) u.pool = std::min(u.pool, u.board);
  if (!device && flags.vram_budget) u.pool = std::min(u.pool, *flags.vram_budget);
  return u;
}

// The smallest context the default of `serve` is lowered to; below it, a refusal.
constexpr int64_t kMinDefaultContext = 256;

}  // namespace

std::unique_ptr<Device> placement_device(const placement::Flags& flags) {
  return flags_want_gpu(flags) ? default_device() : nullptr;
}

namespace {
// Plan::slot_seed: the experts each layer's slots start with, from the slot policy by the code
// that loads them (seed_slots), so that `berth plan` shows what the run will hold.
void seed_plan_slots(PlacementSetup& s, const ExpertSlotsOptions& xs) {
  placement::Plan& p = s.plan;
  p.slot_seed.clear();
  p.slot_policy.clear();
  p.slots_move = true;
  if (p.expert_slots <= 0) return;
  std::vector<int32_t> blocks;
  int32_t n_expert = 0;
  for (size_t l = 0; l < p.layer_slots.size(); ++l)
    if (p.layer_slots[l] > 0) blocks.push_back(static_cast<int32_t>(l));
  for (const placement::TensorEntry& t : s.request.tensors)
    if (t.routed_expert() && t.layer >= 0 && static_cast<size_t>(t.layer) < p.layer_slots.size() &&
        p.layer_slots[static_cast<size_t>(t.layer)] > 0)
      n_expert = std::max(n_expert, t.n_expert);
  if (blocks.empty() || n_expert <= p.expert_slots) return;
  const std::shared_ptr<SlotPolicy> policy =
      xs.policy ? xs.policy : std::shared_ptr<SlotPolicy>(default_slot_policy());
  const std::vector<std::vector<int32_t>> seeds =
      seed_slots(*policy, blocks, n_expert, p.expert_slots);
  p.slot_seed.assign(p.layer_slots.size(), {});
  for (size_t i = 0; i < blocks.size(); ++i) p.slot_seed[static_cast<size_t>(blocks[i])] = seeds[i];
  p.slot_policy = policy->name();
  p.slots_move = policy->moves();
}

// place() into `s`, whose device the caller set: on a throw `s` keeps it.
void place_into(PlacementSetup& s, const Model& model, const placement::Flags& flags,
                SessionParams& params, bool progress_to_stderr, bool plan_only);
}  // namespace

int64_t default_serve_context(const Model& model, const placement::Flags& flags,
                              const SessionParams& params, std::unique_ptr<Device>& device,
                              std::string* note) {
  const Hparams& hp = model.hparams();
  const int64_t n = hp.n_ctx_train > 0 ? hp.n_ctx_train : 4096;
  // Without a device, run and serve plan for none (--vram-budget is ignored there).
  placement::Flags f = flags;
  if (!device) f.vram_budget.reset();
  // The plan serve would make with `c` tokens (place() as serve calls it, quietly); the device
  // comes back after each.
  const auto plan_at = [&](int64_t c) {
    SessionParams p = params;
    p.n_ctx = c;
    PlacementSetup s;
    s.device = std::move(device);
    try {
      place_into(s, model, f, p, false, /*plan_only=*/true);
    } catch (...) {
      device = std::move(s.device);
      throw;
    }
    device = std::move(s.device);
    return s;
  };
  // What a plan holds against what it draws on: the KV cache (f16 where the GPU keeps it, f32
  // on the CPU) beside what it cannot push out: the weights other than routed experts (those
  // can go to the disk tier or the CPU), the recurrent state, the GPU's scratch and margin.
  struct Sizing {
    int64_t context = 0;
    size_t kv = 0, memory = 0, fixed = 0, gpu_layers = 0, cpu_layers = 0;
    // On a board's one pool (unified, or --unified off): the KV cache counted at f32 (as the CPU
    // holds it) whoever holds it, 0 elsewhere. There the criterion does not depend on the plan's
    // shape (which changes with the context and the board: f16 on the GPU beside its scratch and
    // margin, f32 on the CPU), so it holds for every smaller context and every larger board.
    size_t kv_f32 = 0;
    bool scratch = false, state = false;
    std::string where;
    size_t left() const { return memory > fixed ? memory - fixed : 0; }
    bool within_half() const { return (kv_f32 > 0 ? kv_f32 : kv) <= left() / 2; }
  };
  const auto sizing = [&](int64_t c, const PlacementSetup& s) {
    const placement::Plan& p = s.plan;
    const placement::Request& r = s.request;
    Sizing z;
    z.context = c;
    for (placement::Home h : p.kv_home) (h == placement::Home::gpu ? z.gpu_layers : z.cpu_layers)++;
    z.kv = p.gpu_kv_bytes + p.cpu_kv_bytes - p.state_bytes;  // both sides hold state
    const bool any_gpu = p.any_on_gpu();
    if (p.unified) {
      z.memory = p.pool_bytes;
      z.where = p.activation_bytes > 0 && p.whole_pool_bytes > p.pool_bytes
                    ? fmt::format("the unified pool of {} less the activations",
                                  placement::mib(p.whole_pool_bytes))
                    : std::string("the unified pool");
    } else if (r.shared_pool && flags_want_gpu(f)) {
      z.memory = r.shared_pool_bytes;
      z.where = "the board's pool (--unified off)";
    } else {
      const bool ram_limit = r.ram_budget_bytes != placement::kNoRamBudget;
      z.memory = (any_gpu ? p.budget_bytes : 0) +
                 (ram_limit ? r.ram_budget_bytes : physical_memory_bytes());
      z.where = fmt::format("{}{}", any_gpu ? "the GPU's budget and " : "",
                            ram_limit ? "the RAM budget" : "this machine's memory");
    }
    const bool pool = p.unified || (r.shared_pool && flags_want_gpu(f));
    if (pool)
      for (size_t b : r.kv_bytes) z.kv_f32 += 2 * b;
    z.fixed = p.state_bytes + (pool ? 0 : p.scratch_bytes + p.margin_bytes);
    for (const placement::TensorEntry& t : r.tensors)
      if (!t.routed_expert()) z.fixed += t.bytes;
    z.scratch = !pool && p.scratch_bytes > 0;
    z.state = p.state_bytes > 0;
    return z;
  };
  const auto terms = [](const Sizing& z) {
    return fmt::format(
        "the KV cache ({:.1f} MiB at {} tokens as the plan holds it: {} layers f16 on the GPU, {} "
        "f32 on the CPU{}) takes at most half of the {:.1f} MiB of {} ({:.1f} MiB) left beside "
        "{:.1f} MiB of weights other than routed experts{}{}",
        static_cast<double>(z.kv) / (1 << 20), z.context, z.gpu_layers, z.cpu_layers,
        z.kv_f32 > 0 ? fmt::format("; counted at f32 whoever holds it, {:.1f} MiB",
                                   static_cast<double>(z.kv_f32) / (1 << 20))
                     : std::string(),
        static_cast<double>(z.left()) / (1 << 20), z.where,
        static_cast<double>(z.memory) / (1 << 20), static_cast<double>(z.fixed) / (1 << 20),
        z.scratch ? ", the GPU's scratch and margin" : "",
        z.state ? " and the recurrent state" : "");
  };
  // The plan at `c` fits, with its KV cache within half of what it leaves; `z` its sizing.
  const auto accepts = [&](int64_t c, Sizing* z) {
    try {
      const PlacementSetup s = plan_at(c);
      *z = sizing(c, s);
      return z->within_half();
    } catch (const Error& e) {
      if (e.category() != ErrorCategory::out_of_memory) throw;
      return false;
    }
  };
  const int64_t least =
      std::max<int64_t>(kMinDefaultContext, 2 * int64_t{std::max(params.n_seq, 1)});
  const std::string refused = fmt::format(
      "-c not given: the model's context_length {} cannot be lowered to a usable context ({} "
      "tokens at least)",
      n, least);
  const std::string give = "give -c N to ask for a context anyway (the plan says whether it fits)";
  Sizing z;
  if (accepts(n, &z)) return n;
  const int64_t c0 = std::min(n, (least + 255) / 256 * 256);
  if (c0 < least || !accepts(c0, &z)) {
    if (z.context == c0)  // the plan fits, its KV cache not within half
      throw Error(ErrorCategory::out_of_memory, fmt::format("{}: {}; {}", refused, terms(z), give));
    try {
      (void)plan_at(c0);
    } catch (const Error& e) {
      if (e.category() != ErrorCategory::out_of_memory) throw;
      throw Error(ErrorCategory::out_of_memory,
                  fmt::format("{}: at {} tokens the plan does not fit: {}; {}", refused, c0,
                              e.what(), give));
    }
    throw Error(ErrorCategory::out_of_memory, fmt::format("{}; {}", refused, give));
  }
  // The largest multiple of 256 the plan accepts: accepts(lo * 256), not hi * 256.
  int64_t lo = c0 / 256, hi = (n + 255) / 256;
  Sizing best = z;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    Sizing m;
    if (accepts(mid * 256, &m)) {
      lo = mid;
      best = m;
    } else {
      hi = mid;
    }
  }
  if (note)
    *note = fmt::format(
        "-c not given: the model's context_length {} lowered to {} tokens, the most (a multiple "
        "of 256) for which the plan fits and {}",
        n, best.context, terms(best));
  return best.context;
}

PlacementSetup place(const Model& model, const placement::Flags& flags, SessionParams& params,
                     bool progress_to_stderr, bool plan_only) {
  return place(model, flags, params, progress_to_stderr, plan_only,
               flags_want_gpu(flags) || plan_only ? default_device() : nullptr);
}

PlacementSetup place(const Model& model, const placement::Flags& flags, SessionParams& params,
                     bool progress_to_stderr, bool plan_only, std::unique_ptr<Device> device) {
  PlacementSetup s;
  s.device = std::move(device);
  place_into(s, model, flags, params, progress_to_stderr, plan_only);
  return s;
}

namespace {

// Host bytes of the f32 activations CpuExecutor allocates for a plan that puts nothing on the
// GPU: its arena (graph::step_arena), as large as the larger step's: a ubatch of `n_ub` tokens
// (at most the context), or one token.
size_t cpu_step_arena_bytes(const Model& model, int32_t n_ub) {
  size_t total = 0;
  std::vector<size_t> offsets;
  for (const int32_t n : {n_ub, int32_t{1}}) {
    const graph::Graph g = model.build_step(n, 1);
    total = std::max(total, graph::step_arena(g, graph::kept_after_step(g), offsets));
  }
  return total;
}

void place_into(PlacementSetup& s, const Model& model, const placement::Flags& flags,
                SessionParams& params, bool progress_to_stderr, bool plan_only) {
  const bool wants_gpu = flags_want_gpu(flags);
  std::string device_name = s.device ? s.device->name() : std::string("GPU (--vram-budget)");
  size_t free_bytes = s.device ? s.device->free_bytes() : 0;
  bool has_device = s.device != nullptr;
  std::vector<std::string> notes;
  if (plan_only && !s.device) {
    if (flags.vram_budget) {
      device_name = "GPU (none found)";
      free_bytes = *flags.vram_budget;
      has_device = true;
      notes.push_back("planned for a GPU with --vram-budget; none found");
    } else {
      notes.push_back(
          "no GPU found: everything runs on the CPU (--vram-budget SIZE plans for a GPU of "
          "that size)");
    }
  }
  const int64_t n_ctx = params.n_ctx > 0 ? params.n_ctx : default_n_ctx(model.hparams());
  // What unified memory says: (warn, text); a warning for a flag that cannot act.
  std::vector<std::pair<bool, std::string>> unified_msgs;
  const DeviceInfo dinfo = s.device ? s.device->info() : DeviceInfo{};
  const UnifiedPool up = unified_pool(s.device.get(), flags, has_device);
  const bool unified = up.unified;
  const size_t os_available = up.os_available;
  size_t pool = up.pool;  // less the CPU's activations when they do not fit beside the plan
  if (unified) {
    unified_msgs.emplace_back(
        false,
        fmt::format(
            "unified memory{}: weights held once; {} reads the weights it computes in host memory "
            "({})",
            flags.unified == placement::UnifiedMode::on ? " (--unified on)" : " (detected)",
            device_name,
            !s.device ? "planned"
            : dinfo.pageable_access
                ? "pageableMemoryAccess 1: the file's pages in place"
                : "pageableMemoryAccess 0: one page-locked copy, the file's pages released"));
  } else if (flags.unified == placement::UnifiedMode::on) {
    unified_msgs.emplace_back(true, !wants_gpu
                                        ? "--unified on ignored: -ngl 0 puts nothing on the GPU"
                                        : "--unified on ignored: no GPU found");
  }
  // --ram-budget: given (kNoRamBudget: none) or MemAvailable minus the margin (unified: the
  // pool, of which make_plan gives the CPU what the device's side leaves).
  // Read when planning: the pool may be lowered below for the CPU's activations.
  const size_t host_ram_budget = flags.ram_budget ? *flags.ram_budget : default_ram_budget();
  const auto ram_budget = [&] {
    return !flags.ram_budget && (unified || up.shared) ? pool : host_ram_budget;
  };
  // --stream-experts auto plans with the streaming buffers' room, then keeps streaming only
  // when experts stay on the CPU and host memory holds their pinned copy (re-planning without
  // the room otherwise).
  int32_t& stream = params.hybrid.stream_experts_min_tokens;
  bool auto_stream = stream == kStreamExpertsAuto && !unified;
  if (unified) {
    // Nothing is copied to the device: no streamed experts, no staged decode share.
    if (stream > 0)
      unified_msgs.emplace_back(
          true, fmt::format(
                    "--stream-experts {} ignored: on unified memory no expert is copied to the GPU",
                    stream));
    if (params.hybrid.host_expert_share > 0)
      unified_msgs.emplace_back(
          true, "--host-expert-share ignored: on unified memory no expert is copied to the GPU");
    stream = 0;
    params.hybrid.host_expert_share = 0;
  }
  if (params.n_seq > 1 && stream != 0 && !unified) {
    // The scheduler never streams a step of several sequences (its rows' experts would be
    // computed on the GPU or the CPU by the step's size, so a row's bits would follow its
    // neighbours): no streaming buffers to plan. (auto: silently, as where nothing streams.)
    if (!auto_stream)
      unified_msgs.emplace_back(
          true, fmt::format("--stream-experts {}: off: steps of several sequences ({}) never "
                            "stream, so that a sequence's results do not depend on the others "
                            "(a session of one sequence streams)",
                            stream, params.n_seq));
    stream = 0;
    auto_stream = false;
  }
  if (auto_stream) stream = kStreamExpertsAutoTokens;
  // The flags make() plans with: `flags`, or -ngl 0 where the automatic plan on a board's pool
  // falls back to everything on the CPU beside its (much smaller) activations.
  placement::Flags plan_flags = flags;
  bool cpu_fallback = false;
  const auto make = [&] {
    // The KV cache holds n_seq sequences of n_ctx positions: plan for all of its rows.
    // Scratch for the largest step: -ub tokens, or the whole cache when that is smaller.
    const int64_t rows = n_ctx * std::max(params.n_seq, 1);
    s.request =
        plan_request(model, rows, static_cast<int32_t>(std::min<int64_t>(params.n_ubatch, rows)),
                     plan_flags, device_name, unified || up.shared ? pool : free_bytes, has_device,
                     stream, params.hybrid.host_expert_share,
                     std::max(params.n_seq, 1) + std::max(params.n_state_spare, 0));
    s.request.ram_budget_bytes = ram_budget();
    if (unified) {
      s.request.unified = true;
      s.request.pool_bytes = pool;
      s.request.activation_reserve_bytes = up.pool - pool;
      s.request.os_available_bytes = os_available;
      s.request.pool_margin_bytes = placement::kRamMargin;
      s.request.device_reported_free_bytes = free_bytes;
      s.request.board_bytes = up.board;
      s.request.n_expert_used = static_cast<int32_t>(model.hparams().n_expert_used);
      if (dinfo.gpu_gbps > 0) s.request.rates.gpu_gbps = dinfo.gpu_gbps;
      if (dinfo.cpu_gbps > 0) s.request.rates.cpu_gbps = dinfo.cpu_gbps;
      if (dinfo.gpu_tflops > 0) s.request.rates.gpu_tflops = dinfo.gpu_tflops;
      if (dinfo.cpu_tflops > 0) s.request.rates.cpu_tflops = dinfo.cpu_tflops;
      if (up.discrete) s.request.discrete_free_bytes = free_bytes;
    } else if (up.shared) {
      s.request.shared_pool = true;
      s.request.shared_pool_bytes = pool;
      s.request.activation_reserve_bytes = up.pool - pool;
      s.request.device_reported_free_bytes = free_bytes;
      s.request.board_bytes = up.board;
      s.request.os_available_bytes = os_available;
      s.request.pool_margin_bytes = placement::kRamMargin;
    }
    s.plan = placement::make_plan(s.request);
    // The how of -ngl 0, "-ngl 0 (unified memory)" or "-ngl 0", told as the automatic plan's.
    if (cpu_fallback && s.plan.how.starts_with("-ngl 0")) {
      const std::string was = unified ? "-ngl 0 (unified memory)" : "-ngl 0";
      s.plan.how.replace(
          0, s.plan.how.starts_with(was) ? was.size() : 6,
          fmt::format(
              "automatic ({}: everything on the CPU, where no split fits beside its activations)",
              unified ? "unified memory" : "the board's pool, --unified off"));
    }
  };
  const auto info = [&](std::string line) {
    if (plan_only)
      notes.push_back(std::move(line));
    else
      log::info("{}", line);
  };
  for (auto& [warn, text] : unified_msgs) {
    if (plan_only)
      notes.push_back(std::move(text));
    else if (warn)
      log::warn("{}", text);
    else if (progress_to_stderr)  // run, serve: the line plan shows, where the load lines go
      std::fprintf(stderr, "note: %s\n", text.c_str());
    else
      log::info("{}", text);
  }
  bool stream_refused = false;
  try {
    make();
  } catch (const Error& e) {
    // auto's streaming buffers count as scratch; a plan of explicit flags that fits only
    // without them plans without them (a plan that does not fit either way reports the smaller
    // need). The automatic plan fits them in itself.
    if (!auto_stream || e.category() != ErrorCategory::out_of_memory) throw;
    stream = 0;
    make();
    stream_refused = true;
    info(
        "--stream-experts auto: off: the plan fits the device only without the streaming "
        "buffers (--stream-experts N forces them)");
  }
  bool any_gpu = false;
  const auto find_gpu = [&] { any_gpu = s.plan.any_on_gpu(); };
  find_gpu();
  // On a board's one pool (--unified off) the automatic plan puts everything on the CPU where no
  // split fits beside the GPU's scratch: with the streaming buffers in it, one that fits without
  // them may have been missed; plan without them then.
  if (auto_stream && !stream_refused && !any_gpu && up.shared && wants_gpu) {
    stream = 0;
    make();
    stream_refused = true;
    find_gpu();
  }
  if (auto_stream && !stream_refused && any_gpu && has_device) {
    const bool copies = !s.device || !registers_host_experts(*s.device);
    // A copy needs no room of its own (the CPU reads it instead of the file's pages), so a
    // failed registration may fall back to one (HybridOptions::copy_host_experts stays true).
    const std::string off =
        auto_stream_off(model, s.plan, os_available_bytes(), copies && !copy_read_by_cpu());
    if (!off.empty()) {
      stream = 0;
      make();
      // Not a warning: the user asked for nothing; prefill keeps the CPU path.
      if (off != "-") info(fmt::format("--stream-experts auto: off: {}", off));
    }
  }
  // The disk tier reads its experts into its own RAM slots: nothing may pin or stream the
  // whole expert tensors (that would read every page of them).
  if (s.plan.ram_slots > 0) {
    if (stream > 0 && !auto_stream)
      info(
          fmt::format("--stream-experts {}: off: the routed experts are on the disk tier", stream));
    stream = 0;
    if (params.hybrid.host_expert_share > 0)
      info("--host-expert-share: off: the routed experts are on the disk tier");
    params.hybrid.host_expert_share = 0;
    make();
  }
  // One pool (unified memory, or a board's memory planned with copies) also holds the CPU's
  // activations, which grow with -ub: when they do not fit beside the plan, plan again for the
  // pool less them (the disk tier takes more experts), and refuse when that does not fit either.
  if (unified || up.shared) {
    const auto pool_use = [&] {
      const placement::Plan& p = s.plan;
      if (unified) return p.pool_total();
      return (p.any_on_gpu() ? p.gpu_total() : 0) + p.ram_total();
    };
    // What the plan holds, term by term (for a refusal).
    const auto plan_terms = [&] {
      const placement::Plan& p = s.plan;
      std::string t = fmt::format("weights {} + KV cache {}",
                                  placement::mib(p.gpu_weight_bytes + p.cpu_weight_bytes),
                                  placement::mib(p.gpu_kv_bytes + p.cpu_kv_bytes));
      if (p.ram_slot_bytes > 0)
        t += fmt::format(" + RAM expert slots {}", placement::mib(p.ram_slot_bytes));
      if (pool_use() > p.ram_total() + p.gpu_weight_bytes + p.gpu_kv_bytes)
        t += fmt::format(
            " + the GPU's scratch, margin and slots {}",
            placement::mib(pool_use() - p.ram_total() - p.gpu_weight_bytes - p.gpu_kv_bytes));
      return t;
    };
    // One name whether a device was opened or not (run and serve with -ngl 0 open none; plan
    // does): the board is BERTH_SIM_DEVICE's, or the real one asked once.
    const std::string pool_name = "the board's pool";
    // The activations a plan for -ub u adds to the pool: with nothing on the GPU, the CPU
    // executor's arena; a split plan, the scheduler's host buffers (the values a split step
    // passes between the CPU and the GPU and the CPU ops' own, one buffer each) for the decode
    // steps and a ubatch of u tokens, the shapes the runtime keeps within them
    // (HybridOptions::step_host_bytes). Kept per -ub and split (building the steps is the cost).
    std::map<std::string, size_t> act_cache;
    const auto split_now = [&] { return s.plan.any_on_gpu() && s.device != nullptr; };
    const auto act_for = [&](int64_t u) -> size_t {
      const int64_t n = std::min(u, n_ctx);
      std::string key = fmt::format("{}:{}:{}:{}:", n, split_now(), s.plan.expert_slots, stream);
      if (split_now()) {
        for (placement::Home h : s.plan.home) key += static_cast<char>('0' + static_cast<int>(h));
        key += ':';
        for (placement::Home h : s.plan.kv_home)
          key += static_cast<char>('0' + static_cast<int>(h));
        for (int32_t c : s.plan.layer_slots) key += fmt::format(",{}", c);
      }
      auto it = act_cache.find(key);
      if (it != act_cache.end()) return it->second;
      size_t bytes = 0;
      if (!split_now()) {
        bytes = cpu_step_arena_bytes(model, static_cast<int32_t>(n));
      } else {
        SessionParams p = params;
        p.n_ubatch = static_cast<int32_t>(n);
        const auto steps = step_schedules(model, s, p);  // a decode step, then the ubatch
        // Decode steps of 1..K tokens (K sequences, at most 64: scheduler.cpp captures those
        // once per token count and kind, greedy on the device or sampled, and keeps them), each
        // K rows of the one-token step's buffers.
        const size_t k = static_cast<size_t>(std::clamp(params.n_seq, 1, 64));
        bytes = plan_memory(steps.front().second, model.weights()).host_bytes * k * (k + 1) +
                plan_memory(steps.back().second, model.weights()).host_bytes;
      }
      return act_cache.emplace(std::move(key), bytes).first->second;
    };
    int64_t n_ub = std::min<int64_t>(params.n_ubatch, n_ctx);
    size_t act = act_for(params.n_ubatch);
    // What the activations are, for a ubatch of u tokens.
    const auto act_what = [&](int64_t u) {
      return fmt::format("{} a ubatch of {} token{}",
                         split_now() ? "the scheduler's host buffers for the decode steps and"
                                     : "the CPU's activations for",
                         u, u == 1 ? "" : "s");
    };
    int64_t lowered_from = 0;  // the default -ub this was lowered from (0: not lowered)
    const auto act_text = [&] {
      return fmt::format("{} ({}), {}", act_what(n_ub),
                         n_ub < params.n_ubatch ? std::string("-ub, capped by -c")
                         : lowered_from > 0
                             ? fmt::format("the default -ub lowered from {}", lowered_from)
                         : params.n_ubatch_auto ? std::string("the default -ub")
                                                : std::string("-ub"),
                         placement::mib(act));
    };
    // Makes the plan for -ub u that fits the pool with its activations: first for the whole pool,
    // then for the pool less the activations (the disk tier takes more routed experts). False,
    // with the pool restored, when neither fits; s.plan is then whatever was made last.
    const auto fits_with_ub = [&](int64_t u, bool whole_pool_first) {
      params.n_ubatch = static_cast<int32_t>(u);
      const auto attempt = [&](size_t for_pool) {
        pool = for_pool;
        try {
          make();
        } catch (const Error& e) {
          if (e.category() != ErrorCategory::out_of_memory) throw;
          return false;
        }
        find_gpu();
        // A plan for the pool less a reserve fits only where its own activations fit in that
        // reserve: its notes and budgets name the reserve as the activations (a plan for the
        // pool less 726 MiB that held 774 MiB of host buffers said both).
        const size_t a = act_for(u);
        return pool_use() + a <= up.pool && (for_pool == up.pool || a <= up.pool - for_pool);
      };
      if (whole_pool_first && attempt(up.pool)) return true;
      // A split plan made for less pool computes more on the CPU, whose host buffers grow: plan
      // again for the pool less the larger buffers while they grow (a few rounds reach all of
      // the CPU-held layers).
      size_t a = act_for(u);
      for (int round = 0; round < 8 && a < up.pool; ++round) {
        if (attempt(up.pool - a)) return true;
        const size_t grown = act_for(u);
        if (grown <= a) break;
        a = grown;
      }
      // The automatic plan: everything on the CPU, for the pool less the CPU's activations at
      // this -ub (a split's host buffers are much larger; planning for the pool less those
      // missed the all-CPU plan that fits: a 3200M board lowered -ub to 512 where 3000M ran
      // -ub 2048 on the CPU).
      if (flags.n_gpu_layers < 0 && flags.overrides.empty() && !cpu_fallback) {
        plan_flags.n_gpu_layers = 0;
        cpu_fallback = true;
        const size_t arena = cpu_step_arena_bytes(model, static_cast<int32_t>(std::min(u, n_ctx)));
        if (arena < up.pool && (attempt(up.pool - arena) || attempt(up.pool))) return true;
        plan_flags = flags;
        cpu_fallback = false;
      }
      pool = up.pool;
      return false;
    };
    std::vector<std::string> plan_notes;  // notes of the final plan (s.plan may be re-made)
    if (act > 0 && pool_use() + act > up.pool) {
      const size_t base = pool_use();
      const std::string base_terms = plan_terms();
      const std::string asked_text = act_text();
      const int64_t asked_ub = params.n_ubatch, was = n_ub;
      const size_t was_act = act;
      const std::string was_what = act_what(was);
      // First the -ub asked for (or the default) with the pool less its activations; then, -ub
      // not given, the largest halved -ub whose plan (either way) fits.
      bool done = fits_with_ub(asked_ub, /*whole_pool_first=*/false);
      if (done) {
        act = act_for(asked_ub);
        // A split plan made for less pool may hold larger host buffers (more on the CPU).
        info(fmt::format("{}, do not fit beside the plan in the pool of {}: planned for the {} {}",
                         asked_text, placement::mib(up.pool), placement::mib(pool),
                         act == was_act
                             ? std::string("they leave")
                             : fmt::format("left beside the plan's own, {}", placement::mib(act))));
      }
      // The largest halved -ub that fits: the remedy named, or (-ub not given) the one taken.
      int64_t fits_ub = 0;
      for (int64_t u = was / 2; !done && u >= 1 && fits_ub == 0; u /= 2)
        if (fits_with_ub(u, /*whole_pool_first=*/true)) fits_ub = u;
      if (!done && params.n_ubatch_auto && fits_ub > 0) {
        n_ub = fits_ub;
        lowered_from = was;
        act = act_for(fits_ub);
        const std::string lowered = fmt::format(
            "-ub lowered from {} to {}: {}, {}, do not fit beside the plan in {} of {}, nor "
            "beside a plan for the pool less them (set -ub to choose)",
            was, n_ub, was_what, placement::mib(was_act), pool_name, placement::mib(up.pool));
        if (plan_only)
          plan_notes.push_back(lowered);  // the plan's, once it is final
        else if (progress_to_stderr)      // run, serve: where the other plan notes go
          std::fprintf(stderr, "note: %s\n", lowered.c_str());
        else
          log::warn("{}", lowered);
        done = true;
      }
      if (!done) {
        const std::string remedy = fits_ub > 0
                                       ? fmt::format("lower -ub: -ub {} fits", fits_ub)
                                       : "lower -c, use a smaller quantization or a larger board";
        if (was_act >= up.pool)
          throw Error(ErrorCategory::out_of_memory,
                      fmt::format("plan does not fit {} of {}: {} alone exceed it ({})", pool_name,
                                  placement::mib(up.pool), asked_text, remedy));
        throw Error(ErrorCategory::out_of_memory,
                    fmt::format("plan does not fit {} of {}: the plan holds {} ({}), and {} more; "
                                "planning for the {} they leave does not fit either ({})",
                                pool_name, placement::mib(up.pool), placement::mib(base),
                                base_terms, asked_text, placement::mib(up.pool - was_act), remedy));
      }
    }
    // -ngl 0 (or nothing on the GPU) on a board: a --ram-budget above the pool is capped by it,
    // and said so, as the unified plan says it for the CPU's side.
    if (!unified && !any_gpu && flags.ram_budget &&
        (*flags.ram_budget == placement::kNoRamBudget || *flags.ram_budget > up.pool))
      info(*flags.ram_budget == placement::kNoRamBudget
               ? fmt::format("--ram-budget none: the plan is still capped at {} of {}", pool_name,
                             placement::mib(up.pool))
               : fmt::format("--ram-budget {} is more than {} of {}: the plan is capped at it",
                             placement::mib(*flags.ram_budget), pool_name,
                             placement::mib(up.pool)));
    // A plan made for the whole pool that leaves room for its activations: plan again for the
    // pool less them, so that what the plan says is left to either side (the budgets, the
    // CPU's cap) is what the activations leave; kept where it is the same plan's activations.
    if (act > 0 && pool == up.pool && act < up.pool) {
      const size_t whole = pool;
      const placement::Plan kept = s.plan;
      const placement::Request kept_req = s.request;
      bool same = false;
      pool = up.pool - act;
      try {
        make();
        find_gpu();
        same = act_for(n_ub) == act && pool_use() <= pool;
      } catch (const Error& e) {
        if (e.category() != ErrorCategory::out_of_memory) throw;
      }
      if (!same) {
        pool = whole;
        s.plan = kept;
        s.request = kept_req;
        find_gpu();
      }
    }
    s.plan.notes.insert(s.plan.notes.end(), plan_notes.begin(), plan_notes.end());
    s.plan.activation_bytes = act;
    s.plan.activations_host_buffers = split_now();
    s.plan.whole_pool_bytes = act > 0 ? up.pool : 0;
    // A split step's host buffers hold the steps the runtime keeps to what was counted.
    params.hybrid.step_host_bytes = split_now() ? act : 0;
    // Host buffers below 64 MiB (an all-GPU plan's logits and token ids) need no line.
    if (act > 0 && (!split_now() || act >= (size_t{64} << 20)))
      info(fmt::format("{}, counted in the pool: {} of {}{}", act_text(),
                       placement::mib(pool_use() + act), placement::mib(up.pool),
                       split_now() ? " (other step shapes reuse that room: the least recently "
                                     "used is freed)"
                                   : ""));
  }
  // Expert slots (--residency adaptive): the plan's count, on its layers.
  ExpertSlotsOptions& xs = params.hybrid.expert_slots;
  xs.slots_per_layer = s.plan.expert_slots;
  xs.layers.clear();
  for (int32_t c : s.plan.layer_slots) xs.layers.push_back(c > 0);
  seed_plan_slots(s, xs);
  if (plan_only) {
    s.plan.notes.insert(s.plan.notes.begin(), notes.begin(), notes.end());
    if (!any_gpu && auto_stream) stream = 0;
    if (any_gpu && s.device) {
      params.weight_home = s.plan.home;
      params.kv_home = s.plan.kv_home;
    }
    return;
  }
  for (const std::string& note : s.plan.notes) log::warn("{}", note);
  if (!any_gpu || !s.device) {
    if (auto_stream) stream = 0;
    xs.slots_per_layer = 0;
    s.device.reset();
    params.device = nullptr;
    return;
  }
  params.device = s.device.get();
  params.unified = unified;
  params.weight_home = s.plan.home;
  params.kv_home = s.plan.kv_home;
  if (progress_to_stderr && !unified) {
    const bool tty = isatty(STDERR_FILENO) == 1;
    const std::string name = s.device->name();
    auto t0 =
        std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
    auto last = std::make_shared<int>(-1);
    params.hybrid.progress = [tty, name, t0, last](size_t done, size_t total) {
      const int pct = total ? static_cast<int>(done * 100 / total) : 100;
      if (tty && pct != *last) {
        const int fill = pct / 4;
        std::fprintf(stderr, "\rloading weights to %s [%-25s] %3d%% %.2f/%.2f GiB", name.c_str(),
                     std::string(static_cast<size_t>(fill), '#').c_str(), pct, gib(done),
                     gib(total));
        std::fflush(stderr);
      }
      *last = pct;
      if (done == total) {
        const double sec =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - *t0).count();
        // GiB for model-sized totals; a tiny model in MiB rather than "0.00 GiB".
        const std::string size = total >= (size_t{1} << 30)
                                     ? fmt::format("{:.2f} GiB", gib(total))
                                     : fmt::format("{:.1f} MiB", gib(total) * 1024.0);
        std::fprintf(stderr, "%sloaded %s of weights to %s in %.1f s\n", tty ? "\r\x1b[K" : "",
                     size.c_str(), name.c_str(), sec);
      }
    };
  }
}

}  // namespace

std::vector<std::pair<std::string, Schedule>> step_schedules(const Model& model,
                                                             const PlacementSetup& setup,
                                                             const SessionParams& params) {
  const graph::WeightTable& w = model.weights();
  const int64_t n_ctx = params.n_ctx > 0 ? params.n_ctx : default_n_ctx(model.hparams());
  const bool any_gpu = setup.plan.any_on_gpu();
  Device* dev = any_gpu ? setup.device.get() : nullptr;
  Capabilities caps = capabilities(dev, nullptr, w.size());
  const HybridOptions& h = params.hybrid;
  if (dev &&
      (h.stream_experts_min_tokens > 0 || h.host_expert_share > 0 || setup.plan.expert_slots > 0)) {
    caps.pinned.assign(w.size(), false);
    for (size_t i = 0; i < w.size(); ++i)
      caps.pinned[i] = setup.plan.home[i] == placement::Home::cpu && w.tensors[i].ne[2] > 1 &&
                       w.tensors[i].n_bytes > 0;
  }
  if (dev && setup.plan.expert_slots > 0) {
    // The layers Residency gives slots: the plan's, where their experts are pinned.
    caps.slotted.assign(w.size(), 0);
    for (size_t i = 0; i < w.size(); ++i) {
      const int32_t l = w.layers[i];
      if (caps.pinned[i] && w.roles[i] == graph::WeightRole::routed_expert && l >= 0 &&
          static_cast<size_t>(l) < setup.plan.layer_slots.size())
        caps.slotted[i] = setup.plan.layer_slots[static_cast<size_t>(l)];
    }
  }
  const ScheduleOptions opt{.handoff = h.handoff,
                            .stream_experts_min_tokens = h.stream_experts_min_tokens,
                            .host_expert_share = h.host_expert_share,
                            .stream_split = h.stream_split};
  const int32_t n_ub = static_cast<int32_t>(std::min<int64_t>(params.n_ubatch, n_ctx));
  std::vector<std::pair<std::string, Schedule>> out;
  for (const auto& [n_tokens, title] :
       {std::pair<int32_t, std::string>{1, "decode step (1 token)"},
        {n_ub, fmt::format("prefill ubatch ({} token{})", n_ub, n_ub == 1 ? "" : "s")}}) {
    graph::Graph g = model.build_step(n_tokens, 1);
    g.batch_invariant = params.n_seq > 1;  // as Session builds its steps
    out.emplace_back(
        title, make_schedule(g, w, setup.plan.home, setup.plan.kv_home, caps, opt, dev, n_ctx));
  }
  return out;
}

std::vector<std::string> device_option_notes(const Model& model, const SessionParams& params,
                                             bool handoff_set, bool warm_set) {
  std::vector<std::string> out;
  if (params.device) {
    // The expert options act on the MoE layers whose experts stay on the CPU.
    bool any_experts = false;
    int64_t cpu_layers = 0;
    int32_t k = 0;
    const graph::Graph g = model.build_step(1, 1);
    for (const graph::Op& op : g.ops) {
      if (op.kind != graph::OpKind::moe_experts) continue;
      any_experts = true;
      k = op.moe.n_expert_used;
      const auto gate = static_cast<size_t>(op.moe.gate);
      cpu_layers +=
          gate < params.weight_home.size() && params.weight_home[gate] == placement::Home::cpu;
    }
    if (cpu_layers > 0) {
      const double f = params.hybrid.host_expert_share;
      if (f > 0 && params.n_seq > 1) {
        out.push_back(fmt::format(
            "--host-expert-share {} has no effect: steps of several sequences ({}) never take "
            "it, so that a row's results do not depend on the other rows",
            f, params.n_seq));
      } else if (f > 0) {
        // The layers the executor can split (f = 1 gives each of them all its slots).
        const auto cand = host_share_device_slots(g, params.weight_home, 1.0);
        const auto slots = host_share_device_slots(g, params.weight_home, f);
        const auto n_cand =
            std::count_if(cand.begin(), cand.end(), [](int32_t n) { return n > 0; });
        if (n_cand == 0)
          out.push_back(fmt::format(
              "--host-expert-share {} has no effect: no CPU-held MoE layer has the norm before "
              "its experts on the device",
              f));
        else if (std::all_of(slots.begin(), slots.end(), [](int32_t n) { return n == 0; }))
          out.push_back(
              fmt::format("--host-expert-share {} has no effect: it gives the device no slot (F x "
                          "n_expert_used {} x {} CPU-held MoE layers rounds to 0)",
                          f, k, n_cand));
      }
      if (params.hybrid.stream_split && params.hybrid.stream_experts_min_tokens <= 0)
        out.push_back(
            "--stream-split has no effect: no prefill step streams CPU-held experts "
            "(--stream-experts is off)");
      else if (params.hybrid.stream_split && params.n_seq > 1)
        out.push_back(fmt::format(
            "--stream-split has no effect: steps of several sequences ({}) never split, so that "
            "a row's results do not depend on the other rows",
            params.n_seq));
      return out;
    }
    const char* none = any_experts ? "has no effect: no expert tensor stays on the CPU (--cpu-moe "
                                     "or --n-cpu-moe N keeps some there)"
                                   : "has no effect: the model has no routed experts";
    if (params.hybrid.stream_experts_min_tokens > 0)
      out.push_back(
          fmt::format("--stream-experts {} {}", params.hybrid.stream_experts_min_tokens, none));
    if (params.hybrid.host_expert_share > 0)
      out.push_back(
          fmt::format("--host-expert-share {} {}", params.hybrid.host_expert_share, none));
    if (params.hybrid.stream_split) out.push_back(fmt::format("--stream-split {}", none));
    return out;
  }
  const char* why = "has no effect: no GPU holds any weight or KV cache";
  if (params.hybrid.stream_experts_min_tokens > 0)
    out.push_back(
        fmt::format("--stream-experts {} {}", params.hybrid.stream_experts_min_tokens, why));
  if (params.hybrid.host_expert_share > 0)
    out.push_back(fmt::format("--host-expert-share {} {}", params.hybrid.host_expert_share, why));
  if (params.hybrid.stream_split) out.push_back(fmt::format("--stream-split {}", why));
  if (handoff_set) out.push_back(fmt::format("--handoff {}", why));
  if (warm_set)
    out.push_back(fmt::format("--warm-workers {} {}", params.hybrid.warm_workers_us, why));
  return out;
}

}  // namespace berth
