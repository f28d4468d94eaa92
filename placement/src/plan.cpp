// Placement: flags -> a home per tensor and per layer's KV cache (see plan.h).
#include "berth/placement/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <limits>
#include <memory>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "berth/core/error.h"
#include "internal.h"

namespace berth::placement {

std::string_view home_name(Home h) { return h == Home::gpu ? "GPU" : "CPU"; }

namespace {

[[noreturn]] void bad(std::string message) {
  throw Error(ErrorCategory::invalid_argument, message);
}

std::string lower(std::string_view s) {
  std::string r(s);
  for (char& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

// "CPU" -> cpu; "GPU", "CUDA", "CUDA0" -> gpu (berth drives one GPU); anything else: none.
std::optional<Home> device_home(std::string_view device) {
  const std::string d = lower(device);
  if (d == "cpu") return Home::cpu;
  if (d == "gpu" || d == "cuda" || d == "cuda0") return Home::gpu;
  return std::nullopt;
}

// A compiled -ot regex (PCRE2: Perl-compatible syntax, searched anywhere in the name). Matching
// runs under a backtracking limit, so a pathological pattern is an error instead of a hang.
struct Rule {
  std::shared_ptr<pcre2_code> re;
  Home home;
  std::string text;  // "REGEX=DEVICE" as given, for messages
  /// True when the regex matches somewhere in `name`. Throws Error(invalid_argument) when the
  /// match needs more than kMatchLimit backtracking steps.
  bool search(const std::string& name) const;
};

constexpr uint32_t kMatchLimit = 1000000;

bool Rule::search(const std::string& name) const {
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
      pcre2_match_data_create_from_pattern(re.get(), nullptr), &pcre2_match_data_free);
  std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> mc(
      pcre2_match_context_create(nullptr), &pcre2_match_context_free);
  if (!md || !mc) throw std::bad_alloc();
  pcre2_set_match_limit(mc.get(), kMatchLimit);
  pcre2_set_depth_limit(mc.get(), kMatchLimit);
  const int rc = pcre2_match(re.get(), reinterpret_cast<PCRE2_SPTR>(name.data()), name.size(), 0, 0,
                             md.get(), mc.get());
  if (rc >= 0) return true;
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  PCRE2_UCHAR msg[256];
  pcre2_get_error_message(rc, msg, sizeof msg);
  bad(fmt::format("-ot '{}': matching tensor '{}' failed: {} (simplify the regex)", text, name,
                  reinterpret_cast<const char*>(msg)));
}

Rule compile_rule(const std::string& regex, const std::string& device) {
  const std::string text = regex + "=" + device;
  if (regex.empty()) bad(fmt::format("-ot '{}': the regex before '=' is empty", text));
  const std::optional<Home> home = device_home(device);
  if (!home)
    bad(fmt::format("-ot '{}': unknown device '{}' (expected CPU, GPU, CUDA or CUDA0)", text,
                    device));
  int err = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(regex.data()), regex.size(), 0,
                                   &err, &offset, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    bad(fmt::format("-ot '{}': invalid regex '{}': {} at offset {}", text, regex,
                    reinterpret_cast<const char*>(msg), offset));
  }
  return Rule{std::shared_ptr<pcre2_code>(code, &pcre2_code_free), *home, text};
}

std::vector<Rule> compile_rules(const Flags& flags) {
  std::vector<Rule> rules;
  rules.reserve(flags.overrides.size());
  for (const auto& [regex, device] : flags.overrides) rules.push_back(compile_rule(regex, device));
  return rules;
}

// Splits an -ot list at commas outside (), [] and {}; a backslash protects the next character.
std::vector<std::string> split_rules(std::string_view arg) {
  std::vector<std::string> parts;
  std::string cur;
  int depth = 0;
  bool in_class = false;
  for (size_t i = 0; i < arg.size(); ++i) {
    const char c = arg[i];
    if (c == '\\' && i + 1 < arg.size()) {
      cur += c;
      cur += arg[++i];
      continue;
    }
    if (in_class) {
      if (c == ']') in_class = false;
    } else if (c == '[') {
      in_class = true;
    } else if (c == '(' || c == '{') {
      ++depth;
    } else if ((c == ')' || c == '}') && depth > 0) {
      --depth;
    } else if (c == ',' && depth == 0) {
      parts.push_back(std::move(cur));
      cur.clear();
      continue;
    }
    cur += c;
  }
  parts.push_back(std::move(cur));
  return parts;
}

enum class Group { embd, out_norm, out, attn, exps };

// What unified mode means for a plan that puts everything on the CPU.
constexpr const char* kUnifiedAllCpu =
    ": unified mode stays on, with nothing to read in place; the plan is -ngl 0's (which turns "
    "the mode off), bounded by the same pool, the OS's available memory minus 1 GiB";

struct Unit {
  std::vector<size_t> tensors;  // indices of unpinned tensors
  bool has_kv = false;          // the layer's KV cache moves with this unit
  int32_t layer = -1;
  size_t bytes = 0;
};

}  // namespace

std::string describe_flags(const Flags& f) {
  std::string s = f.n_gpu_layers < 0 ? "automatic" : fmt::format("-ngl {}", f.n_gpu_layers);
  if (f.cpu_moe) s += " --cpu-moe";
  if (f.n_cpu_moe > 0) s += fmt::format(" --n-cpu-moe {}", f.n_cpu_moe);
  for (const auto& [regex, device] : f.overrides) s += fmt::format(" -ot {}={}", regex, device);
  return s;
}

void add_override(Flags& flags, std::string_view arg) {
  if (arg.empty()) bad("-ot '': expected REGEX=DEVICE (e.g. -ot exps=CPU)");
  std::vector<std::pair<std::string, std::string>> parsed;
  for (const std::string& part : split_rules(arg)) {
    const size_t eq = part.rfind('=');
    if (part.empty() || eq == std::string::npos)
      bad(fmt::format("-ot '{}': rule '{}' has no '=' (expected REGEX=DEVICE, e.g. exps=CPU)", arg,
                      part));
    std::string regex = part.substr(0, eq), device = part.substr(eq + 1);
    (void)compile_rule(regex, device);  // throws for a bad regex or device
    parsed.emplace_back(std::move(regex), std::move(device));
  }
  flags.overrides.insert(flags.overrides.end(), parsed.begin(), parsed.end());
}

std::string_view residency_mode_name(ResidencyMode m) {
  switch (m) {
    case ResidencyMode::automatic:
      return "auto";
    case ResidencyMode::fixed:
      return "static";
    case ResidencyMode::adaptive:
      return "adaptive";
  }
  return "?";
}

ResidencyMode parse_residency_mode(std::string_view s) {
  const std::string v = lower(s);
  if (v == "auto") return ResidencyMode::automatic;
  if (v == "static") return ResidencyMode::fixed;
  if (v == "adaptive") return ResidencyMode::adaptive;
  bad(fmt::format("--residency '{}': must be static, adaptive or auto", s));
}

std::string_view unified_mode_name(UnifiedMode m) {
  switch (m) {
    case UnifiedMode::automatic:
      return "auto";
    case UnifiedMode::on:
      return "on";
    case UnifiedMode::off:
      return "off";
  }
  return "?";
}

UnifiedMode parse_unified_mode(std::string_view s) {
  const std::string v = lower(s);
  if (v == "auto") return UnifiedMode::automatic;
  if (v == "on") return UnifiedMode::on;
  if (v == "off") return UnifiedMode::off;
  bad(fmt::format("--unified '{}': must be auto, on or off", s));
}

namespace {

// Bytes per weight of a ggml type as stored (block bytes / block weights, ggml's layouts), for
// the unified cost model's FLOP count; unknown types count as 4.5 bits.
double bytes_per_weight(std::string_view type) {
  const std::string t = lower(type);
  if (t == "f32") return 4;
  if (t == "f16" || t == "bf16") return 2;
  if (t == "q8_0") return 34.0 / 32;
  if (t == "q4_0") return 18.0 / 32;
  if (t == "q4_1") return 20.0 / 32;
  if (t == "q5_0") return 22.0 / 32;
  if (t == "q5_1") return 24.0 / 32;
  if (t == "q2_k") return 84.0 / 256;
  if (t == "q3_k") return 110.0 / 256;
  if (t == "q4_k") return 144.0 / 256;
  if (t == "q5_k") return 176.0 / 256;
  if (t == "q6_k") return 210.0 / 256;
  if (t == "q8_k") return 292.0 / 256;
  return 4.5 / 8;
}

// Modelled seconds per decoded token for reading `bytes` holding `weights` weights at `gbps` and
// multiplying them at `tflops` (2 FLOP per weight).
double unit_seconds(double bytes, double weights, double gbps, double tflops) {
  return bytes / (gbps * 1e9) + 2 * weights / (tflops * 1e12);
}

}  // namespace

Plan make_plan_once(const Request& req, bool probing, int* fallback) {
  const Flags& f = req.flags;
  const int32_t n_layer = req.n_layer;
  if (n_layer < 0) bad(fmt::format("placement request: n_layer {} is negative", n_layer));
  if (req.kv_bytes.size() != static_cast<size_t>(n_layer))
    bad(fmt::format("placement request: {} KV cache sizes for {} layers", req.kv_bytes.size(),
                    n_layer));
  if (!req.state_bytes.empty() && req.state_bytes.size() != static_cast<size_t>(n_layer))
    bad(fmt::format("placement request: {} recurrent state sizes for {} layers",
                    req.state_bytes.size(), n_layer));
  for (const TensorEntry& t : req.tensors)
    if (t.layer < -1 || t.layer >= n_layer)
      bad(fmt::format("placement request: tensor '{}' has layer {} outside [0, {})", t.name,
                      t.layer, n_layer));
  if (f.n_gpu_layers < -1)
    bad(fmt::format("-ngl {}: must be >= 0 (or -1 for the automatic plan)", f.n_gpu_layers));
  if (f.n_cpu_moe < 0) bad(fmt::format("--n-cpu-moe {}: must be >= 0", f.n_cpu_moe));
  const std::vector<Rule> rules = compile_rules(f);

  const size_t n = req.tensors.size();
  Plan plan;
  std::vector<bool> ot_pinned(n, false);  // an -ot rule placed the tensor
  // Adaptive residency: asked for, or by default when the budget cannot hold every weight.
  // (Only for models whose routed-expert tensors stack a known number of experts: slots hold
  // one expert's slices.)
  bool adaptive = false;
  // Where the automatic plan's `how` says what became of the room it left for expert slots
  // (account_plan fills it in once the slots are known); npos: nowhere.
  size_t slots_at = std::string::npos;
  bool unified_all_cpu = false;  // the unified automatic plan found no split and put all on the CPU
  const bool unified = req.unified && req.has_device;
  const bool stacked =
      std::any_of(req.tensors.begin(), req.tensors.end(),
                  [](const TensorEntry& t) { return t.routed_expert() && t.n_expert >= 2; });
  if (req.has_device && stacked && f.residency != ResidencyMode::fixed && !unified) {
    const size_t budget =
        std::min(req.device_free_bytes, f.vram_budget.value_or(std::numeric_limits<size_t>::max()));
    size_t all = req.scratch_bytes + req.margin_bytes;
    for (const TensorEntry& t : req.tensors) all += t.bytes;
    for (size_t l = 0; l < req.kv_bytes.size(); ++l) all += layer_cache_gpu(req, l);
    adaptive = f.residency == ResidencyMode::adaptive || all > budget;
  }
  plan.residency = adaptive ? ResidencyMode::adaptive : ResidencyMode::fixed;
  plan.home.assign(n, Home::cpu);
  plan.kv_home.assign(static_cast<size_t>(n_layer), Home::cpu);
  plan.how = describe_flags(f);
  const auto note = [&](std::string s) { plan.notes.push_back(std::move(s)); };
  plan.unified = unified;
  if (unified) {
    plan.pool_bytes = req.pool_bytes;
    if (f.residency == ResidencyMode::adaptive)
      note(
          "--residency adaptive ignored: on unified memory every expert is held once and the "
          "GPU reads it in place; nothing moves");
  }

  // Groups by role. Without a head of its own the model reads the embedding as its head, which
  // then belongs to the output.
  using graph::WeightRole;
  const bool tied = std::none_of(req.tensors.begin(), req.tensors.end(),
                                 [](const TensorEntry& t) { return t.role == WeightRole::head; });
  std::vector<Group> group(n);
  std::vector<bool> layer_has_exps(static_cast<size_t>(n_layer), false);
  for (size_t i = 0; i < n; ++i) {
    const TensorEntry& t = req.tensors[i];
    if (t.layer >= 0 && t.routed_expert()) layer_has_exps[static_cast<size_t>(t.layer)] = true;
    if (t.layer >= 0)
      group[i] = t.routed_expert() ? Group::exps : Group::attn;
    else if (t.role == WeightRole::embedding)
      group[i] = tied ? Group::out : Group::embd;
    else if (t.role == WeightRole::norm)
      group[i] = Group::out_norm;
    else
      group[i] = Group::out;
  }

  // The tensor whose home is the layer's KV cache's home (-1: the layer has no non-expert one).
  std::vector<int64_t> anchor(static_cast<size_t>(n_layer), -1);
  {
    std::vector<int> rank(static_cast<size_t>(n_layer), 3);  // 0 attention, 1 other
    for (size_t i = 0; i < n; ++i) {
      if (group[i] != Group::attn) continue;
      const int r = req.tensors[i].role == WeightRole::attention ? 0 : 1;
      const auto l = static_cast<size_t>(req.tensors[i].layer);
      if (r < rank[l]) rank[l] = r, anchor[l] = static_cast<int64_t>(i);
    }
  }

  if (!req.has_device) {
    if (f.n_gpu_layers > 0)
      note(
          fmt::format("-ngl {} ignored: no GPU found, everything runs on the CPU", f.n_gpu_layers));
    for (const Rule& r : rules)
      if (r.home == Home::gpu)
        note(fmt::format("-ot {} ignored: no GPU found, the tensors it matches stay on the CPU",
                         r.text));
    if (f.vram_budget)
      note(fmt::format("--vram-budget {} ignored: no GPU found, everything runs on the CPU",
                       mib(*f.vram_budget)));
    plan.how += " (no GPU: all on the CPU)";
  } else {
    // Pins: -ot (first match), then --cpu-moe / --n-cpu-moe.
    std::vector<std::optional<Home>> pin(n);
    for (size_t i = 0; i < n; ++i) {
      const TensorEntry& t = req.tensors[i];
      for (const Rule& r : rules)
        if (r.search(t.name)) {
          pin[i] = r.home;
          ot_pinned[i] = true;
          break;
        }
      if (!pin[i] && t.routed_expert() && t.layer >= 0 && (f.cpu_moe || t.layer < f.n_cpu_moe))
        pin[i] = Home::cpu;
    }

    if (f.n_gpu_layers >= 0) {
      const int32_t first_gpu = n_layer - std::min(f.n_gpu_layers, n_layer);
      const bool out_on_gpu = f.n_gpu_layers > n_layer;
      for (size_t i = 0; i < n; ++i) {
        const TensorEntry& t = req.tensors[i];
        Home h = Home::cpu;
        if (group[i] == Group::attn || group[i] == Group::exps)
          h = t.layer >= first_gpu ? Home::gpu : Home::cpu;
        else if (group[i] == Group::out || group[i] == Group::out_norm)
          h = out_on_gpu ? Home::gpu : Home::cpu;
        plan.home[i] = pin[i].value_or(h);
      }
      for (int32_t l = 0; l < n_layer; ++l) {
        const int64_t a = anchor[static_cast<size_t>(l)];
        plan.kv_home[static_cast<size_t>(l)] =
            a >= 0 ? plan.home[static_cast<size_t>(a)] : (l >= first_gpu ? Home::gpu : Home::cpu);
      }
    } else {
      // Automatic. Pinned tensors first; the rest in units, by priority.
      size_t pinned_gpu = 0;
      for (size_t i = 0; i < n; ++i)
        if (pin[i]) {
          plan.home[i] = *pin[i];
          if (*pin[i] == Home::gpu) pinned_gpu += req.tensors[i].bytes;
        }
      Unit out_norm, out, embd;
      std::vector<Unit> attn(static_cast<size_t>(n_layer)), exps(static_cast<size_t>(n_layer));
      for (int32_t l = 0; l < n_layer; ++l) {
        const auto L = static_cast<size_t>(l);
        attn[L].layer = exps[L].layer = l;
        const int64_t a = anchor[L];
        if (a < 0 || !pin[static_cast<size_t>(a)]) {
          attn[L].has_kv = true;
          attn[L].bytes += layer_cache_gpu(req, L);
        } else {
          // The anchor's -ot rule places the layer's KV cache and state with it.
          plan.kv_home[L] = *pin[static_cast<size_t>(a)];
          if (plan.kv_home[L] == Home::gpu) pinned_gpu += layer_cache_gpu(req, L);
        }
      }
      for (size_t i = 0; i < n; ++i) {
        if (pin[i]) continue;
        const TensorEntry& t = req.tensors[i];
        Unit& u = group[i] == Group::attn       ? attn[static_cast<size_t>(t.layer)]
                  : group[i] == Group::exps     ? exps[static_cast<size_t>(t.layer)]
                  : group[i] == Group::out      ? out
                  : group[i] == Group::out_norm ? out_norm
                                                : embd;
        u.tensors.push_back(i);
        u.bytes += t.bytes;
      }

      const size_t budget = std::min(req.device_free_bytes,
                                     f.vram_budget.value_or(std::numeric_limits<size_t>::max()));
      const size_t overhead = req.scratch_bytes + req.margin_bytes;
      size_t left = budget >= overhead + pinned_gpu ? budget - overhead - pinned_gpu : 0;
      const auto place = [&](const Unit& u) {
        for (size_t i : u.tensors) plan.home[i] = Home::gpu;
        if (u.has_kv) plan.kv_home[static_cast<size_t>(u.layer)] = Home::gpu;
        left -= u.bytes;
      };
      const auto unplace = [&](const Unit& u) {
        for (size_t i : u.tensors) plan.home[i] = Home::cpu;
        if (u.has_kv) plan.kv_home[static_cast<size_t>(u.layer)] = Home::cpu;
        left += u.bytes;
      };
      // One pool holds both sides (unified memory, or a board whose memory the GPU shares planned
      // with copies: --unified off): a unit goes to the GPU only where the CPU's side keeps room
      // for its least beside it (what must stay in RAM and one RAM slot per MoE layer whose
      // routed experts it computes: the disk tier's minimum), within --ram-budget. over(): by how
      // much the plan as it stands misses that (0: it fits); the GPU's side counts its scratch
      // and margin from the start. --unified on on a GPU with memory of its own: its KV cache,
      // scratch and margin must also fit what it reports free.
      const bool pooled = unified || req.shared_pool;
      const size_t pool = unified ? req.pool_bytes : req.shared_pool_bytes;
      const auto over = [&] {
        if (!pooled) return size_t{0};
        const size_t gpu_used = budget - left;
        const CpuSide cs = cpu_side(req, plan.home, plan.kv_home);
        const size_t pool_left = pool > gpu_used ? pool - gpu_used : 0;
        const size_t limit = std::min(req.ram_budget_bytes, pool_left);
        const size_t need = cs.all <= limit ? cs.all : cs.least;
        size_t miss = (gpu_used > pool ? gpu_used - pool : size_t{0}) +
                      (need > limit ? need - limit : size_t{0});
        if (unified && req.discrete_free_bytes > 0) {
          size_t own = overhead;
          for (size_t l = 0; l < plan.kv_home.size(); ++l)
            if (plan.kv_home[l] == Home::gpu) own += layer_cache_gpu(req, l);
          if (own > req.discrete_free_bytes) miss += own - req.discrete_free_bytes;
        }
        return miss;
      };
      // Places `u` and keeps it where the plan fits the pool, or (while it does not yet) where it
      // misses by no more than before.
      size_t missed = over();
      const auto keep = [&](const Unit& u) {
        place(u);
        if (const size_t now = over(); now == 0 || now <= missed) {
          missed = now;
          return true;
        }
        unplace(u);
        return false;
      };
      const auto try_place = [&](const Unit& u) {
        if (u.bytes > left) return false;
        return keep(u);
      };

      if (overhead > budget) {
        if (pinned_gpu == 0)
          note(fmt::format(
              "automatic plan: scratch {} + margin {} exceed the GPU budget of {}; everything "
              "runs on the CPU{}",
              mib(req.scratch_bytes), mib(req.margin_bytes), mib(budget),
              unified ? kUnifiedAllCpu : ""));
        plan.how += unified ? " (the pool holds nothing beside the GPU's scratch and margin: all "
                              "on the CPU)"
                            : " (the budget holds nothing: all on the CPU)";
        if (fallback && unified) *fallback = 1;
      } else if (unified && budget >= overhead + pinned_gpu) {
        // Who computes each unit: the processor with the lower modelled time per token on the
        // shared memory; by time saved per byte while the device's side fits the budget.
        const UnifiedRates& r = req.rates;
        struct Cand {
          const Unit* u;
          double gain, bytes;
        };
        std::vector<Cand> cand;
        const auto consider = [&](const Unit& u) {
          if (u.tensors.empty() && !u.has_kv) return;
          double read = 0, weights = 0;
          for (size_t i : u.tensors) {
            const TensorEntry& t = req.tensors[i];
            // A layer's routed experts: each token reads n_expert_used of n_expert; the token
            // embedding: one row (taken as nothing, so it goes last, as in the discrete plan).
            const double share =
                t.role == WeightRole::embedding ? 0.0
                : t.routed_expert() && t.n_expert > 0 && req.n_expert_used > 0
                    ? std::min(1.0, static_cast<double>(req.n_expert_used) / t.n_expert)
                    : 1.0;
            read += static_cast<double>(t.bytes) * share;
            weights += static_cast<double>(t.bytes) * share / bytes_per_weight(t.type);
          }
          // A layer's KV cache: a token reads all of it (at full context); its recurrent state
          // is read and written.
          if (u.has_kv) {
            const auto L = static_cast<size_t>(u.layer);
            read += static_cast<double>(req.kv_bytes[L] + 2 * layer_state(req, L));
          }
          const double gain = unit_seconds(read, weights, r.cpu_gbps, r.cpu_tflops) -
                              unit_seconds(read, weights, r.gpu_gbps, r.gpu_tflops);
          cand.push_back({&u, gain, static_cast<double>(std::max<size_t>(u.bytes, 1))});
        };
        consider(out_norm);
        consider(out);
        consider(embd);
        for (int32_t l = n_layer - 1; l >= 0; --l) {
          consider(attn[static_cast<size_t>(l)]);
          consider(exps[static_cast<size_t>(l)]);
        }
        std::stable_sort(cand.begin(), cand.end(), [](const Cand& a, const Cand& b) {
          return a.gain / a.bytes > b.gain / b.bytes;
        });
        // A unit that reads (almost) nothing per token, the embedding: to the GPU only when
        // the GPU is the faster processor at all.
        const bool gpu_faster = unit_seconds(1e9, 1e9, r.gpu_gbps, r.gpu_tflops) <=
                                unit_seconds(1e9, 1e9, r.cpu_gbps, r.cpu_tflops);
        size_t on_gpu = 0, cpu_faster = 0;
        for (const Cand& c : cand) {
          if (c.gain < 0 || (c.gain == 0 && !gpu_faster)) {
            ++cpu_faster;
            continue;
          }
          if (try_place(*c.u)) ++on_gpu;
        }
        if (missed > 0 && pinned_gpu == 0 && on_gpu > 0) {
          // No split fits beside the GPU's scratch and margin: everything on the CPU (they
          // then cost nothing), which the checks below accept or refuse. Unless the CPU's least
          // alone misses the CPU's limit (--ram-budget, or the pool) by more than the split
          // does: then the split stays, and its refusal names what is too small.
          std::vector<const Unit*> split;
          for (const Cand& c : cand)
            if (!c.u->tensors.empty() ? plan.home[c.u->tensors.front()] == Home::gpu
                                      : plan.kv_home[static_cast<size_t>(c.u->layer)] == Home::gpu)
              split.push_back(c.u);
          for (const Unit* u : split) unplace(*u);
          const size_t all_cpu_least = cpu_side(req, plan.home, plan.kv_home).least;
          const size_t cpu_limit = std::min(req.ram_budget_bytes, pool);
          const size_t all_cpu_miss = all_cpu_least > cpu_limit ? all_cpu_least - cpu_limit : 0;
          if (all_cpu_miss > missed) {
            for (const Unit* u : split) place(*u);
            if (fallback) *fallback = 2;
          } else {
            on_gpu = 0;
            unified_all_cpu = true;
            if (fallback) *fallback = 1;
            note(fmt::format(
                "automatic plan: nothing fits beside the GPU's scratch and margin in the unified "
                "pool, so everything runs on the CPU (as --vram-budget 0){}",
                kUnifiedAllCpu));
          }
        }
        // Layers whose routed experts the CPU computes: those the flags pin there, and those the
        // pool left it (the first N when they are the leading ones: as --n-cpu-moe N).
        int32_t pinned_layers = 0, left_layers = 0, leading = 0;
        bool lead = true;
        for (int32_t l = 0; l < n_layer; ++l) {
          const Unit& u = exps[static_cast<size_t>(l)];
          const bool cpu_by_unit = !u.tensors.empty() && plan.home[u.tensors.front()] == Home::cpu;
          const bool cpu_by_pin = u.tensors.empty() && layer_has_exps[static_cast<size_t>(l)];
          pinned_layers += cpu_by_pin;
          left_layers += cpu_by_unit;
          if (lead && (cpu_by_unit || cpu_by_pin))
            ++leading;
          else
            lead = false;
        }
        std::string cpu_part;
        if (left_layers > 0 && !unified_all_cpu)
          cpu_part = leading == pinned_layers + left_layers
                         ? fmt::format(
                               "; the CPU computes the routed experts of the first {} "
                               "layers, as --n-cpu-moe {}, where the pool holds no more "
                               "beside the disk tier's minimum",
                               leading, leading)
                         : fmt::format(
                               "; the CPU computes the routed experts of {} more layers, "
                               "where the pool holds no more beside the disk tier's "
                               "minimum",
                               left_layers);
        plan.how += fmt::format(
            " (unified memory, cost model: the GPU computes {} of {} units{}{}{})", on_gpu,
            cand.size(),
            cpu_faster > 0 ? fmt::format(", the CPU is faster for {}", cpu_faster) : "",
            pinned_layers > 0
                ? fmt::format(", and the flags keep the routed experts of {} layers on the CPU",
                              pinned_layers)
                : "",
            cpu_part);
      } else if (budget >= overhead + pinned_gpu) {
        size_t all_attn = out_norm.bytes;
        for (const Unit& u : attn) all_attn += u.bytes;
        if (all_attn <= left) {
          // (Without a pool, all of them fit.)
          try_place(out_norm);
          int32_t attn_on = 0;
          for (int32_t l = n_layer - 1; l >= 0; --l)
            if (try_place(attn[static_cast<size_t>(l)])) ++attn_on;
          const bool out_fits = try_place(out);
          bool any_exps = false;
          for (int32_t l = n_layer - 1; l >= 0; --l) {
            any_exps = any_exps || !exps[static_cast<size_t>(l)].tensors.empty();
            // Adaptive: the room goes to expert slots instead of whole layers' experts.
            if (adaptive || !try_place(exps[static_cast<size_t>(l)])) break;
          }
          try_place(embd);
          // The equivalent flags: the leading layers with no routed expert on the GPU.
          int32_t n_cpu = 0;
          for (; n_cpu < n_layer; ++n_cpu) {
            const Unit& u = exps[static_cast<size_t>(n_cpu)];
            if (!u.tensors.empty() && plan.home[u.tensors.front()] == Home::gpu) break;
          }
          const std::string with_out = out_fits ? " and the output" : "";
          // (Fewer than all only where the board's pool keeps the CPU's least.)
          const std::string attn_layers = attn_on == n_layer
                                              ? std::string("all layers")
                                              : fmt::format("{} of {} layers", attn_on, n_layer);
          const std::string exps_part =
              n_cpu == n_layer ? "no routed experts"
              : n_cpu == 0
                  ? "the routed experts of every layer"
                  : fmt::format("the routed experts of the last {} layers", n_layer - n_cpu);
          plan.how += any_exps
                          ? fmt::format(" (attention of {}{}, {}: about -ngl {} --n-cpu-moe {})",
                                        attn_layers, with_out, exps_part,
                                        out_fits ? n_layer + 1 : n_layer, n_cpu)
                          : fmt::format(" ({}{})", attn_on == n_layer ? "all layers" : attn_layers,
                                        with_out);
          if (any_exps && adaptive) slots_at = plan.how.size() - 1;  // before the ")"
        } else {
          int32_t k = 0;
          for (int32_t l = n_layer - 1; l >= 0; --l) {
            const auto L = static_cast<size_t>(l);
            if (attn[L].bytes + exps[L].bytes > left) break;
            place(exps[L]);
            if (!keep(attn[L])) {
              unplace(exps[L]);
              break;
            }
            ++k;
          }
          plan.how += fmt::format(" (whole layers: like -ngl {})", k);
          if (k == 0 && pinned_gpu == 0)
            note(fmt::format(
                "automatic plan: no layer fits the GPU budget of {} after scratch {} + margin {}; "
                "everything runs on the CPU",
                mib(budget), mib(req.scratch_bytes), mib(req.margin_bytes)));
        }
      }
      // else: the pinned tensors alone do not fit; the check below says so.
      if (!unified && missed > 0 && pinned_gpu == 0 && overhead <= budget) {
        // The board's pool (--unified off) holds no split beside the GPU's scratch and margin:
        // everything on the CPU, which the checks below accept or refuse.
        for (size_t i = 0; i < n; ++i)
          if (!pin[i]) plan.home[i] = Home::cpu;
        for (const Unit& u : attn)
          if (u.has_kv) plan.kv_home[static_cast<size_t>(u.layer)] = Home::cpu;
        plan.how = describe_flags(f) + " (the board's pool holds no split: all on the CPU)";
        slots_at = std::string::npos;
        note(fmt::format(
            "automatic plan: nothing fits beside the GPU's scratch and margin in the {} of the "
            "board's memory that the GPU shares with the CPU (beside the CPU's least: what must "
            "stay in RAM and one RAM slot per MoE layer it computes), so everything runs on the "
            "CPU",
            mib(pool)));
      }
    }
  }

  if (unified && plan.how.find("unified") == std::string::npos) plan.how += " (unified memory)";
  // The tensors the recurrent-state ops read go where their layer's state is (a few KiB each).
  for (size_t i = 0; i < n; ++i) {
    const TensorEntry& t = req.tensors[i];
    if (!t.state_companion || t.layer < 0) continue;
    const Home h = plan.kv_home[static_cast<size_t>(t.layer)];
    if (plan.home[i] == h) continue;
    if (ot_pinned[i])
      note(
          fmt::format("{} stays {} with the recurrent state of layer {} (which follows the "
                      "layer's first token-mixer tensor): the -ot rule that matches it is ignored",
                      t.name, h == Home::gpu ? "on the GPU" : "on the CPU", t.layer));
    plan.home[i] = h;
  }
  // The executor runs a layer's routed experts as one op: its expert tensors must share a home.
  {
    std::vector<std::pair<int64_t, Home>> first(static_cast<size_t>(n_layer), {-1, Home::cpu});
    for (size_t i = 0; i < n; ++i) {
      const TensorEntry& t = req.tensors[i];
      if (!t.routed_expert() || t.layer < 0) continue;
      auto& [j, h] = first[static_cast<size_t>(t.layer)];
      if (j < 0) {
        j = static_cast<int64_t>(i), h = plan.home[i];
      } else if (plan.home[i] != h) {
        bad(
            fmt::format("{} would be on the {} but {} on the {}: the routed-expert tensors of a "
                        "layer must live together (check the -ot rules: {})",
                        t.name, home_name(plan.home[i]), req.tensors[static_cast<size_t>(j)].name,
                        home_name(h), describe_flags(f)));
      }
    }
  }
  // Flags that change nothing.
  const bool has_exps = std::any_of(req.tensors.begin(), req.tensors.end(),
                                    [](const TensorEntry& t) { return t.routed_expert(); });
  if (!has_exps && (f.cpu_moe || f.n_cpu_moe > 0))
    note(fmt::format("{} ignored: the model has no routed experts",
                     f.cpu_moe ? "--cpu-moe" : "--n-cpu-moe"));
  else if (f.cpu_moe && f.n_cpu_moe > 0)
    note(
        fmt::format("--n-cpu-moe {} has no effect with --cpu-moe: every layer's routed experts "
                    "stay on the CPU",
                    f.n_cpu_moe));
  else if (f.n_cpu_moe > n_layer)
    note(fmt::format("--n-cpu-moe {} is more than the {} layers: all routed experts on the CPU",
                     f.n_cpu_moe, n_layer));
  for (const Rule& r : rules)
    if (std::none_of(req.tensors.begin(), req.tensors.end(),
                     [&](const TensorEntry& t) { return r.search(t.name); }))
      note(fmt::format("-ot {} matches no tensor of this model", r.text));

  account_plan(req, plan, ot_pinned, adaptive, slots_at, has_exps, probing);
  // Nothing on the GPU (-ngl 0): no expert can move, whatever the budget.
  if (plan.expert_slots == 0 && !plan.any_on_gpu()) plan.residency = ResidencyMode::fixed;
  return plan;
}

Plan make_plan(const Request& req) {
  int fallback = 0;
  try {
    return make_plan_once(req, /*probing=*/false, &fallback);
  } catch (const Error& e) {
    // Unified memory, automatic plan: it gave the GPU only what the pool holds beside the CPU's
    // least, and everything to the CPU where no split fits; say so with the refusal.
    const Flags& f = req.flags;
    if (e.category() != ErrorCategory::out_of_memory || !req.unified || !req.has_device ||
        f.n_gpu_layers >= 0)
      throw;
    throw Error(ErrorCategory::out_of_memory,
                fmt::format("{}; the automatic plan gives the GPU only what the pool holds beside "
                            "the CPU's least (what must stay in RAM and one RAM slot per MoE "
                            "layer it computes){}",
                            e.what(),
                            fallback == 1   ? ", and tried everything on the CPU"
                            : fallback == 2 ? "; everything on the CPU would miss by more"
                                            : ""));
  }
}

}  // namespace berth::placement
