// The plan as a table for people and as JSON for scripts (see plan.h).
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "berth/core/strings.h"
#include "berth/placement/plan.h"

namespace berth::placement {
namespace {

// Bytes of layer l's KV cache where the plan keeps it: f16 on the GPU, f32 on the CPU.
size_t kv_layer_bytes(const Request& req, const Plan& plan, size_t l) {
  return req.kv_bytes.at(l) * (plan.kv_home.at(l) == Home::gpu ? 1 : 2);
}

constexpr double kMiB = 1024.0 * 1024.0;
double to_mib(size_t bytes) { return static_cast<double>(bytes) / kMiB; }

}  // namespace

std::string plan_table(const Request& req, const Plan& plan) {
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
  out += fmt::format("\n{:<{}}  {:<{}}  {:>12}  {}\n", "tensor", name_w, "type", type_w, "MiB",
                     "home");
  for (size_t i = 0; i < req.tensors.size(); ++i) {
    const TensorEntry& t = req.tensors[i];
    out += fmt::format("{:<{}}  {:<{}}  {:>12.3f}  {}\n", names[i], name_w,
                       t.type.empty() ? "-" : t.type, type_w, to_mib(t.bytes),
                       home_name(plan.home.at(i)));
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
  }

  out += fmt::format("\n{:<6} {:>14} {:>14} {:>14} {:>14} {:>14} {:>14}\n", "device", "weights MiB",
                     "KV MiB", "scratch MiB", "margin MiB", "total MiB", "budget MiB");
  if (req.has_device)
    out += fmt::format("{:<6} {:>14.3f} {:>14.3f} {:>14.3f} {:>14.3f} {:>14.3f} {:>14.3f}\n", "GPU",
                       to_mib(plan.gpu_weight_bytes), to_mib(plan.gpu_kv_bytes),
                       to_mib(plan.scratch_bytes), to_mib(plan.margin_bytes),
                       to_mib(plan.gpu_total()), to_mib(plan.budget_bytes));
  out += fmt::format("{:<6} {:>14.3f} {:>14.3f} {:>14} {:>14} {:>14.3f} {:>14}\n", "CPU",
                     to_mib(plan.cpu_weight_bytes), to_mib(plan.cpu_kv_bytes), "-", "-",
                     to_mib(plan.cpu_weight_bytes + plan.cpu_kv_bytes), "-");
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
    devices["GPU"] = {{"name", req.device_name},           {"weights_bytes", plan.gpu_weight_bytes},
                      {"kv_bytes", plan.gpu_kv_bytes},     {"scratch_bytes", plan.scratch_bytes},
                      {"margin_bytes", plan.margin_bytes}, {"total_bytes", plan.gpu_total()},
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
                  {"home", std::string(home_name(plan.kv_home[l]))}});
  j["kv"] = std::move(kv);
  // Names come from the file: replace invalid UTF-8 rather than throw.
  return j.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace berth::placement
