// The plan as a table for people and as JSON for scripts (see plan.h).
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <span>

#include "berth/core/strings.h"
#include "berth/placement/plan.h"

namespace berth::placement {
namespace {

// Bytes of layer l's KV cache where the plan keeps it: f16 on the GPU, f32 on the CPU.
size_t kv_layer_bytes(const Request& req, const Plan& plan, size_t l) {
  return req.kv_bytes.at(l) * (plan.kv_home.at(l) == Home::gpu ? 1 : 2);
}
// Bytes of layer l's recurrent state (f32, where its KV cache is), 0 for a layer without one.
size_t state_layer_bytes(const Request& req, size_t l) {
  return l < req.state_bytes.size() ? req.state_bytes[l] : 0;
}

constexpr double kMiB = 1024.0 * 1024.0;
double to_mib(size_t bytes) { return static_cast<double>(bytes) / kMiB; }

// Per MoE layer (layers with routed-expert tensors): its expert count, the home of its expert
// tensors, its expert slots.
struct MoeLayer {
  int32_t layer = 0, n_expert = 0, slots = 0, ram_slots = 0;
  Home home = Home::cpu;
  int32_t on_disk() const { return ram_slots > 0 ? n_expert - ram_slots : 0; }
  int32_t on_gpu() const { return home == Home::gpu ? n_expert : slots; }
  // The experts on the GPU when the run starts, ascending (known: false when the plan does not
  // say which experts its slots start with: Plan::slot_seed empty), and whether they move.
  std::vector<int32_t> gpu_experts;
  bool known = true, moves = false;
};

// The experts on the GPU of each MoE layer (see MoeLayer).
void add_gpu_experts(const Plan& plan, MoeLayer& m) {
  m.gpu_experts.clear();
  m.known = true;
  m.moves = false;
  if (m.home == Home::gpu) {
    for (int32_t e = 0; e < m.n_expert; ++e) m.gpu_experts.push_back(e);
  } else if (m.slots > 0) {
    const auto l = static_cast<size_t>(m.layer);
    m.known = l < plan.slot_seed.size() && !plan.slot_seed[l].empty();
    if (m.known) {
      m.gpu_experts = plan.slot_seed[l];
      std::sort(m.gpu_experts.begin(), m.gpu_experts.end());
      m.moves = plan.slots_move;
    }
  }
}

std::vector<MoeLayer> moe_layers(const Request& req, const Plan& plan) {
  std::vector<MoeLayer> out;
  std::vector<int64_t> at(static_cast<size_t>(std::max(req.n_layer, 0)), -1);
  for (size_t i = 0; i < req.tensors.size(); ++i) {
    const TensorEntry& t = req.tensors[i];
    if (!t.routed_expert() || t.layer < 0 || static_cast<size_t>(t.layer) >= at.size()) continue;
    int64_t& k = at[static_cast<size_t>(t.layer)];
    if (k < 0) {
      k = static_cast<int64_t>(out.size());
      out.push_back(MoeLayer{.layer = t.layer, .home = plan.home.at(i)});
      if (static_cast<size_t>(t.layer) < plan.layer_slots.size())
        out.back().slots = plan.layer_slots[static_cast<size_t>(t.layer)];
      if (static_cast<size_t>(t.layer) < plan.layer_ram_slots.size())
        out.back().ram_slots = plan.layer_ram_slots[static_cast<size_t>(t.layer)];
    }
    out[static_cast<size_t>(k)].n_expert =
        std::max(out[static_cast<size_t>(k)].n_expert, t.n_expert);
  }
  std::sort(out.begin(), out.end(),
            [](const MoeLayer& a, const MoeLayer& b) { return a.layer < b.layer; });
  for (MoeLayer& m : out) add_gpu_experts(plan, m);
  return out;
}

}  // namespace

std::string expert_ranges(std::span<const int32_t> ids) {
  std::vector<int32_t> v(ids.begin(), ids.end());
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  std::string out;
  for (size_t a = 0; a < v.size();) {
    size_t b = a + 1;
    while (b < v.size() && v[b] == v[b - 1] + 1) ++b;
    if (!out.empty()) out += ',';
    out += b - a == 1 ? fmt::format("{}", v[a]) : fmt::format("{}-{}", v[a], v[b - 1]);
    a = b;
  }
  return out;
}

std::string plan_table(const Request& req, const Plan& plan, bool tensors) {
  std::string out;
  if (req.has_device)
    out += fmt::format("placement: {}\ndevice: {}, budget {:.3f} MiB\n", plan.how, req.device_name,
                       to_mib(plan.budget_bytes));
  else
    out += fmt::format("placement: {}\ndevice: none\n", plan.how);
  for (const std::string& n : plan.notes) out += fmt::format("note: {}\n", n);

  size_t name_w = std::string_view("tensor").size(), type_w = 4;
  std::vector<std::string> names;  // escaped: names come from the file
  for (const TensorEntry& t : req.tensors) {
    names.push_back(printable(t.name, 200));
    name_w = std::max(name_w, names.back().size());
    type_w = std::max(type_w, t.type.size());
  }
  // Per MoE layer, the experts on the GPU: runs of layers alike.
  const std::vector<MoeLayer> moe = moe_layers(req, plan);
  if (!moe.empty()) {
    // Whether the experts listed move while running: only the slots' do, unless their policy
    // holds them fixed.
    const bool seeded = std::any_of(moe.begin(), moe.end(), [](const MoeLayer& m) {
      return m.slots > 0 && m.home != Home::gpu && m.known;
    });
    std::string moving;
    if (plan.expert_slots > 0 && seeded)
      moving = fmt::format("; policy {}: {}", plan.slot_policy,
                           plan.slots_move ? "the slots start with the experts listed and follow "
                                             "the routing while running"
                                           : "the slots hold the experts listed, fixed");
    else if (plan.expert_slots == 0)
      moving = " (fixed: no expert moves while running)";
    out += fmt::format("\nresidency: {}{}{}\n", residency_mode_name(plan.residency),
                       plan.expert_slots > 0
                           ? fmt::format(", {} expert slots per CPU-held MoE layer ({:.3f} MiB)",
                                         plan.expert_slots, to_mib(plan.slot_bytes))
                           : std::string(),
                       moving);
    out += fmt::format("{:<16}  {}\n", "MoE layers", "experts on the GPU");
    size_t a = 0;
    while (a < moe.size()) {
      size_t b = a + 1;
      while (b < moe.size() && moe[b].layer == moe[b - 1].layer + 1 &&
             moe[b].on_gpu() == moe[a].on_gpu() && moe[b].n_expert == moe[a].n_expert &&
             moe[b].home == moe[a].home && moe[b].ram_slots == moe[a].ram_slots &&
             moe[b].known == moe[a].known && moe[b].gpu_experts == moe[a].gpu_experts)
        ++b;
      const std::string layers = b - a == 1
                                     ? fmt::format("blk.{}", moe[a].layer)
                                     : fmt::format("blk.{}-{}", moe[a].layer, moe[b - 1].layer);
      const MoeLayer& m = moe[a];
      // (n_expert 0: a request that does not say how many experts a tensor stacks.)
      const std::string n = m.n_expert > 0 ? fmt::format(" {}", m.n_expert) : "";
      const std::string what =
          m.home == Home::gpu ? fmt::format("all{} (expert tensors on the GPU)", n)
          : m.slots > 0
              ? fmt::format("{} of {} (expert slots; the rest on the CPU){}", m.slots, m.n_expert,
                            m.known ? ": " + expert_ranges(m.gpu_experts) : std::string())
          : m.n_expert > 0 ? fmt::format("0 of {} (expert tensors on the CPU)", m.n_expert)
                           : std::string("none (expert tensors on the CPU)");
      const std::string disk = m.ram_slots > 0
                                   ? fmt::format("; on disk: {} of {} (RAM cache of {} slots)",
                                                 m.on_disk(), m.n_expert, m.ram_slots)
                                   : std::string();
      out += fmt::format("{:<16}  {}{}\n", layers, what, disk);
      a = b;
    }
  }
  if (tensors) {
    out += fmt::format("\n{:<{}}  {:<{}}  {:>12}  {}\n", "tensor", name_w, "type", type_w, "MiB",
                       "home");
    for (size_t i = 0; i < req.tensors.size(); ++i) {
      const TensorEntry& t = req.tensors[i];
      out += fmt::format("{:<{}}  {:<{}}  {:>12.3f}  {}\n", names[i], name_w,
                         t.type.empty() ? "-" : t.type, type_w, to_mib(t.bytes),
                         home_name(plan.home.at(i)));
    }
  }

  // The KV cache as runs of consecutive layers with the same home.
  if (!plan.kv_home.empty()) {
    out += fmt::format("\n{:<{}}  {:>12}  {}\n", "KV cache (GPU f16, CPU f32)", name_w + type_w + 2,
                       "MiB", "home");
    size_t a = 0;
    while (a < plan.kv_home.size()) {
      size_t b = a;
      size_t bytes = 0;
      while (b < plan.kv_home.size() && plan.kv_home[b] == plan.kv_home[a])
        bytes += kv_layer_bytes(req, plan, b++);
      const std::string layers =
          b - a == 1 ? fmt::format("blk.{}", a) : fmt::format("blk.{}-{}", a, b - 1);
      out += fmt::format("{:<{}}  {:>12.3f}  {}\n", layers, name_w + type_w + 2, to_mib(bytes),
                         home_name(plan.kv_home[a]));
      a = b;
    }
    // The recurrent state, per side (it lives with its layer's KV cache).
    for (const Home side : {Home::gpu, Home::cpu}) {
      size_t n = 0, bytes = 0;
      for (size_t l = 0; l < plan.kv_home.size(); ++l)
        if (plan.kv_home[l] == side && state_layer_bytes(req, l) > 0) {
          ++n;
          bytes += state_layer_bytes(req, l);
        }
      if (n > 0)
        out += fmt::format("{:<{}}  {:>12.3f}  {}\n",
                           fmt::format("recurrent state ({} layer{}, f32)", n, n == 1 ? "" : "s"),
                           name_w + type_w + 2, to_mib(bytes), home_name(side));
    }
  }

  out += fmt::format("\n{:<6} {:>14} {:>14} {:>14} {:>14} {:>14} {:>14} {:>14}\n", "device",
                     "weights MiB", "slots MiB", "KV MiB", "scratch MiB", "margin MiB", "total MiB",
                     "budget MiB");
  if (req.has_device)
    out +=
        fmt::format("{:<6} {:>14.3f} {:>14.3f} {:>14.3f} {:>14.3f} {:>14.3f} {:>14.3f} {:>14.3f}\n",
                    "GPU", to_mib(plan.gpu_weight_bytes), to_mib(plan.slot_bytes),
                    to_mib(plan.gpu_kv_bytes), to_mib(plan.scratch_bytes),
                    to_mib(plan.margin_bytes), to_mib(plan.gpu_total()), to_mib(plan.budget_bytes));
  out += fmt::format("{:<6} {:>14.3f} {:>14} {:>14.3f} {:>14} {:>14} {:>14.3f} {:>14}\n", "CPU",
                     to_mib(plan.cpu_weight_bytes), "-", to_mib(plan.cpu_kv_bytes), "-", "-",
                     to_mib(plan.cpu_weight_bytes + plan.cpu_kv_bytes), "-");
  if (plan.ram_budget_bytes != kNoRamBudget || plan.ram_slots > 0) {
    out += fmt::format("{:<6} {:>14} {:>14.3f} {:>14} {:>14} {:>14} {:>14.3f} {:>14.3f}\n", "RAM",
                       "-", to_mib(plan.ram_slot_bytes), "-", "-", "-", to_mib(plan.ram_total()),
                       to_mib(plan.ram_budget_bytes == kNoRamBudget ? 0 : plan.ram_budget_bytes));
    // Unified memory: the weights the GPU computes are neither in VRAM nor among the CPU's; they
    // are held once in host memory.
    out += fmt::format(
        "tiers: VRAM {:.3f} MiB, {}RAM {:.3f} MiB (CPU weights, KV cache, RAM expert slots), disk "
        "{:.3f} MiB (routed experts read on demand{})\n",
        to_mib(plan.unified ? 0 : plan.gpu_weight_bytes + plan.slot_bytes),
        plan.unified ? fmt::format("host memory {:.3f} MiB (GPU-computed weights, held once), ",
                                   to_mib(plan.gpu_weight_bytes))
                     : std::string(),
        to_mib(plan.ram_total()), to_mib(plan.disk_weight_bytes),
        plan.ram_slots > 0 ? fmt::format(", {} RAM slot{} per MoE layer", plan.ram_slots,
                                         plan.ram_slots == 1 ? "" : "s")
                           : "");
  }
  if (plan.unified)
    out += fmt::format(
        "unified memory: weights held once, {:.3f} MiB (the GPU computes {:.3f} MiB of them from "
        "host memory, the CPU {:.3f} MiB{}; no device copies); the plan holds {:.3f} MiB{} of a "
        "{:.3f} MiB pool "
        "(the OS reports {:.3f} MiB available, minus a margin of {:.3f} MiB; the device reports "
        "{:.3f} MiB free, not used)\n",
        to_mib(plan.gpu_weight_bytes + plan.cpu_weight_bytes + plan.disk_weight_bytes),
        to_mib(plan.gpu_weight_bytes), to_mib(plan.cpu_weight_bytes + plan.disk_weight_bytes),
        plan.disk_weight_bytes > 0
            ? fmt::format(", {:.3f} MiB of which stay on disk and are read into its RAM slots",
                          to_mib(plan.disk_weight_bytes))
            : std::string(),
        to_mib(plan.pool_total()),
        plan.activation_bytes > 0
            ? fmt::format(" and {} {:.3f} MiB",
                          plan.activations_host_buffers ? "the scheduler's host buffers"
                                                        : "the CPU's activations",
                          to_mib(plan.activation_bytes))
            : std::string(),
        to_mib(plan.whole_pool_bytes > 0 ? plan.whole_pool_bytes : plan.pool_bytes),
        to_mib(req.os_available_bytes), to_mib(req.pool_margin_bytes),
        to_mib(req.device_reported_free_bytes));
  return out;
}

std::string plan_json(const Request& req, const Plan& plan) {
  using json = nlohmann::ordered_json;
  json j;
  j["how"] = plan.how;
  j["budget_bytes"] = plan.budget_bytes;
  j["notes"] = plan.notes;
  json devices = json::object();
  if (req.has_device)
    devices["GPU"] = {{"name", req.device_name},
                      {"weights_bytes", plan.gpu_weight_bytes},
                      {"slot_bytes", plan.slot_bytes},
                      {"kv_bytes", plan.gpu_kv_bytes},
                      {"scratch_bytes", plan.scratch_bytes},
                      {"margin_bytes", plan.margin_bytes},
                      {"total_bytes", plan.gpu_total()},
                      {"budget_bytes", plan.budget_bytes}};
  devices["CPU"] = {{"weights_bytes", plan.cpu_weight_bytes},
                    {"kv_bytes", plan.cpu_kv_bytes},
                    {"total_bytes", plan.cpu_weight_bytes + plan.cpu_kv_bytes}};
  j["devices"] = std::move(devices);
  json tensors = json::array();
  for (size_t i = 0; i < req.tensors.size(); ++i) {
    const TensorEntry& t = req.tensors[i];
    tensors.push_back({{"name", t.name},
                       {"role", graph::role_name(t.role)},
                       {"type", t.type},
                       {"bytes", t.bytes},
                       {"layer", t.layer},
                       {"home", std::string(home_name(plan.home.at(i)))}});
  }
  j["tensors"] = std::move(tensors);
  json kv = json::array();
  for (size_t l = 0; l < plan.kv_home.size(); ++l)
    kv.push_back({{"layer", l},
                  {"bytes", kv_layer_bytes(req, plan, l)},
                  {"home", std::string(home_name(plan.kv_home[l]))},
                  {"state_bytes", state_layer_bytes(req, l)}});
  j["kv"] = std::move(kv);
  j["residency"] = std::string(residency_mode_name(plan.residency));
  j["expert_slots"] = plan.expert_slots;
  j["slot_policy"] = plan.slot_policy.empty() ? json(nullptr) : json(plan.slot_policy);
  json moe = json::array();
  for (const MoeLayer& m : moe_layers(req, plan))
    moe.push_back({{"layer", m.layer},
                   {"n_expert", m.n_expert},
                   {"experts_on_gpu", m.on_gpu()},
                   {"gpu_experts", m.known ? json(m.gpu_experts) : json(nullptr)},
                   {"gpu_experts_move", m.moves},
                   {"slots", m.slots},
                   {"home", std::string(home_name(m.home))},
                   {"ram_slots", m.ram_slots},
                   {"experts_on_disk", m.on_disk()}});
  j["moe_layers"] = std::move(moe);
  j["tiers"] = {
      {"vram_bytes", plan.unified ? size_t{0} : plan.gpu_weight_bytes + plan.slot_bytes},
      {"gpu_computed_host_bytes", plan.unified ? plan.gpu_weight_bytes : size_t{0}},
      {"ram_bytes", plan.ram_total()},
      {"disk_bytes", plan.disk_weight_bytes},
      {"ram_budget_bytes",
       plan.ram_budget_bytes == kNoRamBudget ? json(nullptr) : json(plan.ram_budget_bytes)},
      {"ram_slots", plan.ram_slots},
      {"ram_slot_bytes", plan.ram_slot_bytes}};
  if (plan.unified)
    j["unified"] = {
        {"pool_bytes", plan.whole_pool_bytes > 0 ? plan.whole_pool_bytes : plan.pool_bytes},
        {"planned_pool_bytes", plan.pool_bytes},
        {"activation_bytes", plan.activation_bytes},
        {"activations", plan.activations_host_buffers ? "host_buffers" : "cpu"},
        {"os_available_bytes", req.os_available_bytes},
        {"pool_margin_bytes", req.pool_margin_bytes},
        {"device_reported_free_bytes", req.device_reported_free_bytes},
        {"total_bytes", plan.pool_total() + plan.activation_bytes},
        {"weights_bytes", plan.gpu_weight_bytes + plan.cpu_weight_bytes + plan.disk_weight_bytes},
        {"gpu_computes_bytes", plan.gpu_weight_bytes},
        {"cpu_computes_bytes", plan.cpu_weight_bytes + plan.disk_weight_bytes}};
  else
    j["unified"] = nullptr;
  // Names come from the file: replace invalid UTF-8 rather than throw.
  return j.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace berth::placement
