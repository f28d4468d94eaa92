// Placement: -ngl, -ot, --cpu-moe, --n-cpu-moe, --vram-budget and the automatic plan on
// synthetic requests (sizes in whole MiB so that expectations are exact), the request built
// from a real model, and `berth plan` end to end.
#include <doctest/doctest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/placement/plan.h"
#include "berth/runtime/plan_request.h"
#include "berth/scheduler/scheduler.h"
#include "test_util.h"

using berth::Error;
using berth::ErrorCategory;
using namespace berth::placement;

namespace {

constexpr size_t MiB = size_t{1} << 20;

void add(Request& r, const std::string& name, size_t mib, int32_t layer) {
  TensorEntry t;
  t.name = name;
  t.bytes = mib * MiB;
  t.layer = layer;
  // The role a model would declare (these synthetic requests have no model behind them).
  using berth::graph::WeightRole;
  t.role = name.find("_exps") != std::string::npos   ? WeightRole::routed_expert
           : name.rfind("token_embd", 0) == 0        ? WeightRole::embedding
           : name == "output.weight"                 ? WeightRole::head
           : name.find("norm") != std::string::npos  ? WeightRole::norm
           : name.find("attn_") != std::string::npos ? WeightRole::attention
                                                     : WeightRole::dense_ffn;
  t.type = "q4_K";
  r.tensors.push_back(t);
}

// 4 layers of attention (attn_output `attn_out` MiB) and the FFN `ffn` adds for layer l, plus
// token_embd 100, output_norm 1, output 50, KV 5 MiB per layer, scratch 64, margin 32.
Request layered_request(size_t attn_out,
                        const std::function<void(Request&, const std::string&, int)>& ffn) {
  Request r;
  r.n_layer = 4;
  add(r, "token_embd.weight", 100, -1);
  for (int l = 0; l < 4; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    add(r, p + "attn_norm.weight", 1, l);
    add(r, p + "attn_q.weight", 4, l);
    add(r, p + "attn_k.weight", 2, l);
    add(r, p + "attn_v.weight", 2, l);
    add(r, p + "attn_output.weight", attn_out, l);
    add(r, p + "ffn_norm.weight", 1, l);
    ffn(r, p, l);
  }
  add(r, "output_norm.weight", 1, -1);
  add(r, "output.weight", 50, -1);
  r.kv_bytes.assign(4, 5 * MiB);
  r.scratch_bytes = 64 * MiB;
  r.margin_bytes = 32 * MiB;
  r.has_device = true;
  r.device_name = "CUDA0 (Test GPU)";
  r.device_free_bytes = 100000 * MiB;
  return r;
}

// 4 layers. Per layer: non-expert 15 MiB (attn_norm 1, q 4, k 2, v 2, output 4, ffn_norm 1,
// router 1), routed experts 90 MiB (3 x 30), KV cache 5 MiB. token_embd 100, output_norm 1,
// output 50. Scratch 64, margin 32 (overhead 96). Weights 571 MiB in all.
Request moe_request() {
  return layered_request(4, [](Request& r, const std::string& p, int l) {
    add(r, p + "ffn_gate_inp.weight", 1, l);
    add(r, p + "ffn_gate_exps.weight", 30, l);
    add(r, p + "ffn_up_exps.weight", 30, l);
    add(r, p + "ffn_down_exps.weight", 30, l);
  });
}

// 4 dense layers of 45 MiB (attention 15, ffn_gate/up/down 10 each) + KV 5 MiB.
Request dense_request() {
  return layered_request(5, [](Request& r, const std::string& p, int l) {
    add(r, p + "ffn_gate.weight", 10, l);
    add(r, p + "ffn_up.weight", 10, l);
    add(r, p + "ffn_down.weight", 10, l);
  });
}

Home home_of(const Request& r, const Plan& p, const std::string& name) {
  for (size_t i = 0; i < r.tensors.size(); ++i)
    if (r.tensors[i].name == name) return p.home.at(i);
  FAIL("no tensor " << name);
  return Home::cpu;
}

// The names on the GPU, for readable failures.
std::set<std::string> on_gpu(const Request& r, const Plan& p) {
  std::set<std::string> s;
  for (size_t i = 0; i < r.tensors.size(); ++i)
    if (p.home.at(i) == Home::gpu) s.insert(r.tensors[i].name);
  return s;
}

// Every tensor whose home `expect(tensor)` gives.
template <class F>
void check_homes(const Request& r, const Plan& p, F expect) {
  REQUIRE(p.home.size() == r.tensors.size());
  for (size_t i = 0; i < r.tensors.size(); ++i) {
    CAPTURE(r.tensors[i].name);
    CHECK(p.home[i] == expect(r.tensors[i]));
  }
}

std::vector<Home> homes(std::initializer_list<int> gpu_mask) {
  std::vector<Home> v;
  for (int g : gpu_mask) v.push_back(g ? Home::gpu : Home::cpu);
  return v;
}

Home gpu_if(bool b) { return b ? Home::gpu : Home::cpu; }

size_t sum_bytes(const Request& r, const Plan& p, Home h) {
  size_t s = 0;
  for (size_t i = 0; i < r.tensors.size(); ++i)
    if (p.home[i] == h) s += r.tensors[i].bytes;
  return s;
}

ErrorCategory category_of(const std::function<void()>& f, std::string* what = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (what) *what = e.what();
    return e.category();
  }
  FAIL("no berth::Error thrown");
  return ErrorCategory::internal;
}

}  // namespace

TEST_CASE("-ngl 0, 2, 4 and 99 on a MoE model") {
  Request r = moe_request();
  SUBCASE("-ngl 0: everything on the CPU, no scratch or margin") {
    r.flags.n_gpu_layers = 0;
    const Plan p = make_plan(r);
    check_homes(r, p, [](const TensorEntry&) { return Home::cpu; });
    CHECK(p.kv_home == homes({0, 0, 0, 0}));
    CHECK(p.gpu_total() == 0);
    CHECK(p.cpu_weight_bytes == 571 * MiB);
    CHECK(p.cpu_kv_bytes == 40 * MiB);  // the host keeps f32: twice the 20 MiB of f16
    CHECK(p.how == "-ngl 0");
  }
  SUBCASE("-ngl 2: the last two layers, with their KV cache") {
    r.flags.n_gpu_layers = 2;
    const Plan p = make_plan(r);
    check_homes(r, p, [](const TensorEntry& t) { return gpu_if(t.layer >= 2); });
    CHECK(p.kv_home == homes({0, 0, 1, 1}));
    CHECK(p.gpu_weight_bytes == 2 * 105 * MiB);
    CHECK(sum_bytes(r, p, Home::gpu) == p.gpu_weight_bytes);
    CHECK(sum_bytes(r, p, Home::cpu) == p.cpu_weight_bytes);
    CHECK(p.gpu_kv_bytes == 10 * MiB);
    CHECK(p.scratch_bytes == 64 * MiB);
    CHECK(p.margin_bytes == 32 * MiB);
    CHECK(p.gpu_total() == (210 + 10 + 64 + 32) * MiB);
    CHECK(p.cpu_weight_bytes == (571 - 210) * MiB);
    CHECK(p.budget_bytes == 100000 * MiB);
  }
  SUBCASE("-ngl 4 = n_layer: every layer, the output layer stays on the CPU") {
    r.flags.n_gpu_layers = 4;
    const Plan p = make_plan(r);
    check_homes(r, p, [](const TensorEntry& t) { return gpu_if(t.layer >= 0); });
    CHECK(p.kv_home == homes({1, 1, 1, 1}));
  }
  SUBCASE("-ngl 5 and 99 (> n_layer): the output layer too, token_embd stays") {
    for (int ngl : {5, 99}) {
      r.flags.n_gpu_layers = ngl;
      const Plan p = make_plan(r);
      check_homes(r, p, [](const TensorEntry& t) { return gpu_if(t.name != "token_embd.weight"); });
      CHECK(p.gpu_weight_bytes == 471 * MiB);
      CHECK(p.kv_home == homes({1, 1, 1, 1}));
    }
  }
}

TEST_CASE("-ngl on a dense model, and a tied head (no output.weight)") {
  Request r = dense_request();
  r.flags.n_gpu_layers = 3;
  Plan p = make_plan(r);
  check_homes(r, p, [](const TensorEntry& t) { return gpu_if(t.layer >= 1); });
  CHECK(p.kv_home == homes({0, 1, 1, 1}));

  // Without output.weight the head reads token_embd: it follows the output layer.
  r.tensors.pop_back();
  r.flags.n_gpu_layers = 99;
  p = make_plan(r);
  CHECK(home_of(r, p, "token_embd.weight") == Home::gpu);
  r.flags.n_gpu_layers = 4;
  p = make_plan(r);
  CHECK(home_of(r, p, "token_embd.weight") == Home::cpu);
  CHECK(home_of(r, p, "output_norm.weight") == Home::cpu);
}

TEST_CASE("--cpu-moe and --n-cpu-moe") {
  Request r = moe_request();
  r.flags.n_gpu_layers = 99;
  SUBCASE("--cpu-moe") {
    r.flags.cpu_moe = true;
    const Plan p = make_plan(r);
    check_homes(r, p, [](const TensorEntry& t) {
      return gpu_if(t.name != "token_embd.weight" && !t.routed_expert());
    });
    CHECK(p.kv_home == homes({1, 1, 1, 1}));
    CHECK(p.gpu_weight_bytes == (471 - 360) * MiB);
    CHECK(p.how == "-ngl 99 --cpu-moe");
  }
  SUBCASE("--n-cpu-moe 2") {
    r.flags.n_cpu_moe = 2;
    const Plan p = make_plan(r);
    check_homes(r, p, [](const TensorEntry& t) {
      return gpu_if(t.name != "token_embd.weight" && !(t.routed_expert() && t.layer < 2));
    });
    CHECK(p.kv_home == homes({1, 1, 1, 1}));
  }
  SUBCASE("--n-cpu-moe with -ngl 2 and more layers than the model has") {
    r.flags.n_gpu_layers = 2;
    r.flags.n_cpu_moe = 3;
    const Plan p = make_plan(r);
    check_homes(r, p, [](const TensorEntry& t) {
      return gpu_if(t.layer >= 2 && !(t.routed_expert() && t.layer < 3));
    });
    r.flags.n_cpu_moe = 100;
    const Plan q = make_plan(r);
    check_homes(r, q,
                [](const TensorEntry& t) { return gpu_if(t.layer >= 2 && !t.routed_expert()); });
  }
  SUBCASE("--cpu-moe on a dense model changes nothing") {
    Request d = dense_request();
    d.flags.n_gpu_layers = 99;
    const Plan a = make_plan(d);
    d.flags.cpu_moe = true;
    CHECK(make_plan(d).home == a.home);
  }
}

TEST_CASE("-ot: first match wins and overrides -ngl, --cpu-moe and --n-cpu-moe") {
  Request r = moe_request();
  SUBCASE("equivalent of --n-cpu-moe 2 by regex") {
    r.flags.n_gpu_layers = 99;
    add_override(r.flags, "blk\\.[0-1]\\.ffn_(gate|up|down)_exps=CPU");
    const Plan p = make_plan(r);
    Request n = moe_request();
    n.flags.n_gpu_layers = 99;
    n.flags.n_cpu_moe = 2;
    CHECK(p.home == make_plan(n).home);
  }
  SUBCASE("first matching rule wins; -ot beats -ngl 0") {
    r.flags.n_gpu_layers = 0;
    add_override(r.flags, "blk\\.3\\.=GPU,blk\\.=CPU");
    add_override(r.flags, "output=cuda0");  // case-insensitive device; matches output_norm too
    const Plan p = make_plan(r);
    check_homes(r, p, [](const TensorEntry& t) {
      return gpu_if(t.layer == 3 || t.name.rfind("output", 0) == 0);
    });
    CHECK(p.kv_home == homes({0, 0, 0, 1}));
    CHECK(p.how == "-ngl 0 -ot blk\\.3\\.=GPU -ot blk\\.=CPU -ot output=cuda0");
  }
  SUBCASE("-ot beats --cpu-moe") {
    r.flags.n_gpu_layers = 99;
    r.flags.cpu_moe = true;
    add_override(r.flags, "blk\\.3\\.ffn_(gate|up|down)_exps=GPU");
    const Plan p = make_plan(r);
    CHECK(home_of(r, p, "blk.3.ffn_up_exps.weight") == Home::gpu);
    CHECK(home_of(r, p, "blk.3.ffn_gate_exps.weight") == Home::gpu);
    CHECK(home_of(r, p, "blk.2.ffn_up_exps.weight") == Home::cpu);
  }
  SUBCASE("a layer's expert tensors split between the devices is refused before loading") {
    // The executor runs a layer's routed experts as one op over gate, up and down.
    r.flags.n_gpu_layers = 99;
    r.flags.cpu_moe = true;
    add_override(r.flags, "blk\\.3\\.ffn_up_exps=GPU");
    try {
      (void)make_plan(r);
      FAIL("a plan with blk.3's experts on two devices was accepted");
    } catch (const Error& e) {
      CHECK(e.category() == ErrorCategory::invalid_argument);
      const std::string m = e.what();
      CHECK(m.find("blk.3.ffn_") != std::string::npos);
      CHECK(m.find("must live together") != std::string::npos);
      CHECK(m.find("-ot blk\\.3\\.ffn_up_exps=GPU") != std::string::npos);
    }
  }
  SUBCASE("splitting a layer's attention: the KV cache follows attn_q") {
    r.flags.n_gpu_layers = 99;
    add_override(r.flags, "blk\\.1\\.attn_q\\.=CPU");
    add_override(r.flags, "blk\\.2\\.attn_(k|v)\\.=CPU");
    const Plan p = make_plan(r);
    CHECK(p.kv_home == homes({1, 0, 1, 1}));
    CHECK(home_of(r, p, "blk.1.attn_k.weight") == Home::gpu);
    CHECK(home_of(r, p, "blk.2.attn_k.weight") == Home::cpu);
    CHECK(p.gpu_kv_bytes == 15 * MiB);
    CHECK(p.cpu_kv_bytes == 10 * MiB);  // one layer of 5 MiB f16, kept as f32
  }
  SUBCASE("the first attention tensor, else the first other one, anchors the KV cache") {
    // By role, not name: layer 1's norms come first in the table but attn_kv_a (attention)
    // anchors; layer 2 has no attention tensor, so its first tensor does.
    Request q;
    q.n_layer = 3;
    add(q, "blk.0.attn_norm.weight", 1, 0);
    add(q, "blk.0.attn_qkv.weight", 4, 0);
    add(q, "blk.1.ffn_norm.weight", 1, 1);
    add(q, "blk.1.attn_norm.weight", 1, 1);
    add(q, "blk.1.attn_kv_a.weight", 1, 1);
    add(q, "blk.2.ffn_norm.weight", 1, 2);
    add(q, "blk.2.ffn_up.weight", 1, 2);
    q.kv_bytes = {MiB, MiB, MiB};
    q.has_device = true;
    q.device_free_bytes = 10000 * MiB;
    q.flags.n_gpu_layers = 0;
    add_override(q.flags, "attn_qkv=GPU,blk\\.1\\.attn_kv_a=GPU,blk\\.2\\.ffn_norm=GPU");
    const Plan p = make_plan(q);
    CHECK(p.kv_home == homes({1, 1, 1}));
    CHECK(on_gpu(q, p) == std::set<std::string>{"blk.0.attn_qkv.weight", "blk.1.attn_kv_a.weight",
                                                "blk.2.ffn_norm.weight"});
    // The layer's norm alone on the GPU moves no KV cache there.
    Request q2 = q;
    q2.flags.overrides.clear();
    add_override(q2.flags, "blk\\.1\\.attn_norm=GPU");
    CHECK(make_plan(q2).kv_home == homes({0, 0, 0}));
  }
}

TEST_CASE("-ot parsing: comma lists, and errors naming the rule") {
  Flags f;
  add_override(f, "a=CPU,b{1,2}=GPU,[x,y]z=CUDA0");
  REQUIRE(f.overrides.size() == 3);
  CHECK(f.overrides[0] == std::pair<std::string, std::string>{"a", "CPU"});
  CHECK(f.overrides[1] == std::pair<std::string, std::string>{"b{1,2}", "GPU"});
  CHECK(f.overrides[2] == std::pair<std::string, std::string>{"[x,y]z", "CUDA0"});
  add_override(f, "(?=x)y=CPU");  // '=' inside the regex: the rule splits at the last one
  CHECK(f.overrides.back().first == "(?=x)y");

  struct Bad {
    const char* arg;
    const char* mention;
  };
  for (const Bad& b :
       {Bad{"exps", "no '='"}, Bad{"blk[=CPU", "invalid regex"},
        Bad{"exps=TPU", "unknown device 'TPU'"}, Bad{"=CPU", "empty"}, Bad{"", "REGEX=DEVICE"},
        Bad{"a=CPU,", "no '='"}, Bad{"a=CPU,b=CUDA1", "unknown device 'CUDA1'"}}) {
    CAPTURE(b.arg);
    Flags g;
    std::string what;
    CHECK(category_of([&] { add_override(g, b.arg); }, &what) == ErrorCategory::invalid_argument);
    CHECK(what.find("-ot") != std::string::npos);
    CHECK(what.find(b.mention) != std::string::npos);
    CHECK(g.overrides.empty());  // nothing appended from a list with a bad rule
  }
  // Rules put into Flags directly are checked by make_plan too.
  Request r = moe_request();
  r.flags.overrides = {{"exps(", "CPU"}};
  CHECK(category_of([&] { make_plan(r); }) == ErrorCategory::invalid_argument);
}

TEST_CASE("bad flags and requests are invalid_argument errors naming the flag") {
  Request r = moe_request();
  std::string what;
  r.flags.n_gpu_layers = -2;
  CHECK(category_of([&] { make_plan(r); }, &what) == ErrorCategory::invalid_argument);
  CHECK(what.find("-ngl -2") != std::string::npos);
  r.flags.n_gpu_layers = 1;
  r.flags.n_cpu_moe = -1;
  CHECK(category_of([&] { make_plan(r); }, &what) == ErrorCategory::invalid_argument);
  CHECK(what.find("--n-cpu-moe -1") != std::string::npos);
  r.flags.n_cpu_moe = 0;
  r.kv_bytes.pop_back();
  CHECK(category_of([&] { make_plan(r); }) == ErrorCategory::invalid_argument);
  r = moe_request();
  r.tensors[1].layer = 4;
  CHECK(category_of([&] { make_plan(r); }, &what) == ErrorCategory::invalid_argument);
  CHECK(what.find(r.tensors[1].name) != std::string::npos);
}

TEST_CASE("a plan that exceeds the budget is refused with every term named") {
  Request r = moe_request();
  r.flags.n_gpu_layers = 99;
  r.flags.vram_budget = 300 * MiB;
  std::string what;
  CHECK(category_of([&] { make_plan(r); }, &what) == ErrorCategory::out_of_memory);
  INFO(what);
  for (const char* s :
       {"plan needs 587.0 MiB", "CUDA0 (Test GPU)", "budget is 300.0 MiB", "--vram-budget",
        "weights 471.0 MiB", "KV cache 20.0 MiB", "scratch 64.0 MiB", "margin 32.0 MiB", "-ngl 99"})
    CHECK(what.find(s) != std::string::npos);
  CHECK(what.find('\n') == std::string::npos);

  // The device's free memory is the budget when it is the smaller.
  r.flags.vram_budget.reset();
  r.device_free_bytes = 500 * MiB;
  CHECK(category_of([&] { make_plan(r); }, &what) == ErrorCategory::out_of_memory);
  CHECK(what.find("budget is 500.0 MiB (free on the device)") != std::string::npos);
  // A --vram-budget above the device's free memory is named as capped (found by a new-user
  // trial: it was dropped silently).
  r.flags.vram_budget = 100000 * MiB;
  CHECK(category_of([&] { make_plan(r); }, &what) == ErrorCategory::out_of_memory);
  CHECK(what.find("budget is 500.0 MiB (free on the device; --vram-budget 100000.0 MiB asks for "
                  "more)") != std::string::npos);
  r.flags.vram_budget.reset();

  // Exactly the budget fits; -ngl 0 needs nothing, not even scratch and margin.
  r.device_free_bytes = 587 * MiB;
  CHECK(make_plan(r).gpu_total() == 587 * MiB);
  r.device_free_bytes = 0;
  r.flags.n_gpu_layers = 0;
  CHECK(make_plan(r).gpu_total() == 0);

  // The hint fits the case: --cpu-moe is not suggested twice, nor to a dense model, and a budget
  // below scratch + margin says so.
  r = moe_request();
  r.flags.n_gpu_layers = 99;
  r.flags.cpu_moe = true;
  r.flags.vram_budget = 100 * MiB;
  CHECK(category_of([&] { make_plan(r); }, &what) == ErrorCategory::out_of_memory);
  CHECK(what.find("lower -ngl, or leave out -ngl") != std::string::npos);
  Request d = dense_request();
  d.flags.n_gpu_layers = 99;
  d.flags.vram_budget = 100 * MiB;
  CHECK(category_of([&] { make_plan(d); }, &what) == ErrorCategory::out_of_memory);
  CHECK(what.find("cpu-moe") == std::string::npos);
  d.flags.vram_budget = 90 * MiB;  // scratch 64 + margin 32 = 96
  CHECK(category_of([&] { make_plan(d); }, &what) == ErrorCategory::out_of_memory);
  CHECK(what.find("does not even hold the scratch and margin") != std::string::npos);
  CHECK(what.find("give a larger --vram-budget") != std::string::npos);
  // When the device's free memory is the limit, a larger --vram-budget cannot help.
  d.flags.vram_budget = 1000 * MiB;
  d.device_free_bytes = 90 * MiB;
  CHECK(category_of([&] { make_plan(d); }, &what) == ErrorCategory::out_of_memory);
  CHECK(what.find("the device's free memory does not even hold") != std::string::npos);
  CHECK(what.find("larger --vram-budget") == std::string::npos);

  // The automatic plan fails only for what -ot pins to the GPU.
  r = moe_request();
  r.flags.vram_budget = 200 * MiB;
  add_override(r.flags, "exps=GPU");
  CHECK(category_of([&] { make_plan(r); }, &what) == ErrorCategory::out_of_memory);
  CHECK(what.find("weights 360.0 MiB") != std::string::npos);
}

TEST_CASE("automatic plan on a MoE model at several budgets") {
  Request r = moe_request();
  const auto plan_for = [&](size_t budget_mib) {
    r.flags.vram_budget = budget_mib * MiB;
    return make_plan(r);
  };
  SUBCASE("scratch + margin alone exceed the budget: all on the CPU") {
    const Plan p = plan_for(90);
    check_homes(r, p, [](const TensorEntry&) { return Home::cpu; });
    CHECK(p.kv_home == homes({0, 0, 0, 0}));
    CHECK(p.gpu_total() == 0);
    REQUIRE(p.notes.size() == 1);
    CHECK(p.notes[0].find("everything runs on the CPU") != std::string::npos);
  }
  SUBCASE("exactly the non-expert parts and their KV caches") {
    const Plan p = plan_for(96 + 81);
    check_homes(r, p, [](const TensorEntry& t) {
      return gpu_if((t.layer >= 0 && !t.routed_expert()) || t.name == "output_norm.weight");
    });
    CHECK(p.kv_home == homes({1, 1, 1, 1}));
    CHECK(p.gpu_total() == 177 * MiB);
    CHECK(p.how.find("--n-cpu-moe 4") != std::string::npos);
  }
  SUBCASE("the output matrix and the last layer's experts") {
    const Plan p = plan_for(96 + 81 + 50 + 90 + 89);
    check_homes(r, p, [](const TensorEntry& t) {
      return gpu_if(t.name != "token_embd.weight" && !(t.routed_expert() && t.layer < 3));
    });
    CHECK(p.how.find("about -ngl 5 --n-cpu-moe 3") != std::string::npos);
  }
  SUBCASE("the output matrix does not fit but an expert layer does: it is skipped") {
    Request big = moe_request();
    big.tensors.back().bytes = 200 * MiB;  // output.weight
    big.flags.vram_budget = (96 + 81 + 90) * MiB;
    const Plan p = make_plan(big);
    CHECK(home_of(big, p, "output.weight") == Home::cpu);
    CHECK(home_of(big, p, "blk.3.ffn_up_exps.weight") == Home::gpu);
    CHECK(home_of(big, p, "blk.2.ffn_up_exps.weight") == Home::cpu);
  }
  SUBCASE("experts stop at the first layer that does not fit (a suffix, as --n-cpu-moe)") {
    for (TensorEntry& t : r.tensors)
      if (t.layer == 2 && t.routed_expert()) t.bytes = 60 * MiB;  // layer 2's experts: 180 MiB
    // After attention and the output 190 MiB are left: layer 3's experts (90) fit, layer 2's do
    // not, so layers 1 and 0 stay on the CPU although one of them would fit; token_embd fits.
    const Plan p = plan_for(96 + 81 + 50 + 190);
    check_homes(r, p,
                [](const TensorEntry& t) { return gpu_if(!(t.routed_expert() && t.layer < 3)); });
  }
  SUBCASE("two expert layers: the same as --n-cpu-moe 2") {
    const Plan p = plan_for(96 + 81 + 50 + 180 + 89);
    Request n = moe_request();
    n.flags.n_gpu_layers = 99;
    n.flags.n_cpu_moe = 2;
    CHECK(p.home == make_plan(n).home);
    CHECK(p.kv_home == homes({1, 1, 1, 1}));
  }
  SUBCASE("everything, token_embd last") {
    const Plan p = plan_for(96 + 571 + 20);
    check_homes(r, p, [](const TensorEntry&) { return Home::gpu; });
    CHECK(p.gpu_total() == 687 * MiB);
    const Plan q = plan_for(96 + 571 + 20 - 1);
    CHECK(on_gpu(r, q).count("token_embd.weight") == 0);
    CHECK(on_gpu(r, q).size() == r.tensors.size() - 1);
  }
  SUBCASE("not all non-expert parts fit: whole layers from the last, as -ngl would") {
    // A layer is 105 MiB + 5 MiB KV; the non-expert parts need 81.
    const Plan p = plan_for(96 + 80);
    check_homes(r, p, [](const TensorEntry&) { return Home::cpu; });
    REQUIRE(p.notes.size() == 1);
    CHECK(p.notes[0].find("no layer fits") != std::string::npos);
    // With the experts pinned to the CPU a layer is 20 MiB: three fit in 60.
    r.flags.cpu_moe = true;
    const Plan q = plan_for(96 + 60);
    check_homes(r, q,
                [](const TensorEntry& t) { return gpu_if(t.layer >= 1 && !t.routed_expert()); });
    CHECK(q.kv_home == homes({0, 1, 1, 1}));
    CHECK(q.how.find("like -ngl 3") != std::string::npos);
  }
  SUBCASE("--n-cpu-moe pins and the automatic plan fills the rest") {
    r.flags.n_cpu_moe = 3;
    const Plan p = plan_for(100000);
    check_homes(r, p,
                [](const TensorEntry& t) { return gpu_if(!(t.routed_expert() && t.layer < 3)); });
  }
  SUBCASE("the device's free memory bounds the budget") {
    r.device_free_bytes = (96 + 81) * MiB;
    const Plan p = plan_for(100000);
    CHECK(p.budget_bytes == 177 * MiB);
    CHECK(p.gpu_total() == 177 * MiB);
  }
}

TEST_CASE("automatic plan on a dense model: whole layers when not all fit") {
  Request r = dense_request();
  // A layer is 45 MiB + 5 MiB KV; all four and output_norm need 201.
  r.flags.vram_budget = (96 + 120) * MiB;
  const Plan p = make_plan(r);
  Request n = dense_request();
  n.flags.n_gpu_layers = 2;
  CHECK(p.home == make_plan(n).home);
  CHECK(p.kv_home == homes({0, 0, 1, 1}));
  CHECK(p.gpu_total() == (96 + 100) * MiB);

  r.flags.vram_budget = (96 + 201 + 50) * MiB;
  const Plan q = make_plan(r);
  check_homes(r, q, [](const TensorEntry& t) { return gpu_if(t.name != "token_embd.weight"); });
  CHECK(q.how.find("all layers and the output") != std::string::npos);
}

TEST_CASE("no device: everything on the CPU, GPU flags only warn") {
  Request r = moe_request();
  r.has_device = false;
  r.flags.n_gpu_layers = 99;
  add_override(r.flags, "exps=GPU,norm=CPU");
  const Plan p = make_plan(r);
  check_homes(r, p, [](const TensorEntry&) { return Home::cpu; });
  CHECK(p.kv_home == homes({0, 0, 0, 0}));
  CHECK(p.budget_bytes == 0);
  CHECK(p.gpu_total() == 0);
  REQUIRE(p.notes.size() == 2);
  CHECK(p.notes[0].find("-ngl 99 ignored: no GPU found") != std::string::npos);
  CHECK(p.notes[1].find("-ot exps=GPU ignored") != std::string::npos);
  CHECK(p.how.find("no GPU") != std::string::npos);

  // No warning when nothing asks for the GPU; flags are still checked.
  r.flags = Flags{};
  CHECK(make_plan(r).notes.empty());
  r.flags.n_gpu_layers = -5;
  CHECK(category_of([&] { make_plan(r); }) == ErrorCategory::invalid_argument);
}

TEST_CASE("parse_size") {
  CHECK(parse_size("24G", "--vram-budget") == size_t{24} << 30);
  CHECK(parse_size("1.5GiB", "--vram-budget") == size_t{3} << 29);
  CHECK(parse_size("512M", "--vram-budget") == size_t{512} << 20);
  CHECK(parse_size("512mb", "--vram-budget") == size_t{512} << 20);
  CHECK(parse_size("64k", "--vram-budget") == size_t{64} << 10);
  CHECK(parse_size("2T", "--vram-budget") == size_t{2} << 40);
  CHECK(parse_size("1000000", "--vram-budget") == 1000000);
  CHECK(parse_size("100B", "--vram-budget") == 100);
  CHECK(parse_size("0", "--vram-budget") == 0);
  CHECK(parse_size("0.5K", "--vram-budget") == 512);
  CHECK(parse_size(".5K", "--vram-budget") == 512);
  CHECK(parse_size("1.0000000001K", "--vram-budget") == 1024);  // rounded down to bytes
  CHECK(parse_size("16777215T", "--vram-budget") == (size_t{16777215} << 40));
  for (const char* bad :
       {"-1", "abc", "", "1.5", "12X", "G", ".", "1e9", "1.2.3G", " 1G", "99999999999999999999",
        "16777216T", "18446744073709551616", "17179869184.5G"}) {
    CAPTURE(bad);
    std::string what;
    CHECK(category_of([&] { parse_size(bad, "--vram-budget"); }, &what) ==
          ErrorCategory::invalid_argument);
    CHECK(what.find("--vram-budget '" + std::string(bad) + "'") != std::string::npos);
  }
}

TEST_CASE("plan_json has the documented fields and agrees with the plan") {
  Request r = moe_request();
  r.flags.n_gpu_layers = 3;
  r.flags.cpu_moe = true;
  const Plan p = make_plan(r);
  const nlohmann::json j = nlohmann::json::parse(plan_json(r, p));
  CHECK(j.at("how") == "-ngl 3 --cpu-moe");
  CHECK(j.at("budget_bytes") == 100000 * MiB);
  CHECK(j.at("notes").is_array());
  const auto& gpu = j.at("devices").at("GPU");
  CHECK(gpu.at("name") == "CUDA0 (Test GPU)");
  CHECK(gpu.at("weights_bytes") == p.gpu_weight_bytes);
  CHECK(gpu.at("weights_bytes") == 3 * 15 * MiB);
  CHECK(gpu.at("kv_bytes") == 15 * MiB);
  CHECK(gpu.at("scratch_bytes") == 64 * MiB);
  CHECK(gpu.at("margin_bytes") == 32 * MiB);
  CHECK(gpu.at("total_bytes") == p.gpu_total());
  CHECK(gpu.at("budget_bytes") == 100000 * MiB);
  const auto& cpu = j.at("devices").at("CPU");
  CHECK(cpu.at("weights_bytes") == p.cpu_weight_bytes);
  CHECK(cpu.at("kv_bytes") == 10 * MiB);  // f32 on the host: twice the 5 MiB of f16
  CHECK(cpu.at("total_bytes") == p.cpu_weight_bytes + 10 * MiB);
  REQUIRE(j.at("tensors").size() == r.tensors.size());
  for (size_t i = 0; i < r.tensors.size(); ++i) {
    const auto& t = j.at("tensors")[i];
    CHECK(t.at("name") == r.tensors[i].name);
    CHECK(t.at("type") == "q4_K");
    CHECK(t.at("bytes") == r.tensors[i].bytes);
    CHECK(t.at("layer") == r.tensors[i].layer);
    CHECK(t.at("home") == (p.home[i] == Home::gpu ? "GPU" : "CPU"));
  }
  REQUIRE(j.at("kv").size() == 4);
  CHECK(j.at("kv")[0].at("home") == "CPU");
  CHECK(j.at("kv")[3].at("layer") == 3);
  CHECK(j.at("kv")[3].at("bytes") == 5 * MiB);
  CHECK(j.at("kv")[3].at("home") == "GPU");

  r.has_device = false;
  const nlohmann::json k = nlohmann::json::parse(plan_json(r, make_plan(r)));
  CHECK_FALSE(k.at("devices").contains("GPU"));
  CHECK(k.at("notes").size() == 1);
}

TEST_CASE("plan_table: a line per tensor, KV runs, totals") {
  Request r = moe_request();
  r.flags.n_gpu_layers = 2;
  const Plan p = make_plan(r);
  const std::string t = plan_table(r, p, /*tensors=*/true);
  INFO(t);
  for (const TensorEntry& e : r.tensors) CHECK(t.find(e.name) != std::string::npos);
  // Without `tensors`, the per-layer summary only.
  const std::string summary = plan_table(r, p);
  CHECK(summary.find("blk.0.attn_q.weight") == std::string::npos);
  CHECK(summary.find("MoE layers") != std::string::npos);
  CHECK(t.find("placement: -ngl 2") != std::string::npos);
  CHECK(t.find("CUDA0 (Test GPU)") != std::string::npos);
  CHECK(t.find("blk.0-1") != std::string::npos);
  CHECK(t.find("blk.2-3") != std::string::npos);
  CHECK(t.find("316.000") != std::string::npos);     // GPU total: 210 + 10 + 64 + 32
  CHECK(t.find("100000.000") != std::string::npos);  // budget
  CHECK(t.find("\nGPU ") != std::string::npos);
  CHECK(t.find("\nCPU ") != std::string::npos);
}

TEST_CASE("plan_request on stories260K") {
  berth::gguf::File file = berth::gguf::File::open(berth::test::stories260k().string());
  std::unique_ptr<berth::Model> model = berth::load_model(file);
  Flags f;
  f.n_gpu_layers = 99;
  const Request r = berth::plan_request(*model, 256, 32, f, "TEST0", size_t{1} << 30, true);
  const int32_t n_layer = static_cast<int32_t>(model->hparams().n_layer);
  CHECK(r.n_layer == n_layer);
  CHECK(r.tensors.size() == model->weights().size());
  CHECK(r.scratch_bytes == berth::device_scratch_bytes(*model, 32, 256));
  CHECK(r.device_name == "TEST0");
  CHECK(r.device_free_bytes == size_t{1} << 30);
  CHECK(r.flags.n_gpu_layers == 99);
  size_t total = 0;
  for (size_t i = 0; i < r.tensors.size(); ++i) {
    const TensorEntry& t = r.tensors[i];
    CAPTURE(t.name);
    CHECK(t.bytes == model->weights().tensors[i].n_bytes);
    CHECK_FALSE(t.type.empty());
    CHECK_FALSE(t.routed_expert());
    if (t.name.rfind("blk.", 0) == 0)
      CHECK(t.name.rfind("blk." + std::to_string(t.layer) + ".", 0) == 0);
    else
      CHECK(t.layer == -1);
    total += t.bytes;
  }
  const std::vector<berth::KvLayer> kv = model->kv_layers();
  REQUIRE(r.kv_bytes.size() == static_cast<size_t>(n_layer));
  for (int32_t l = 0; l < n_layer; ++l)
    CHECK(r.kv_bytes[l] == static_cast<size_t>(kv[l].k_dim + kv[l].v_dim) * 2 * 256);
  CHECK(r.kv_bytes[0] > 0);

  const Plan p = make_plan(r);
  CHECK(p.gpu_weight_bytes + p.cpu_weight_bytes == total);
  CHECK(p.kv_home == std::vector<Home>(n_layer, Home::gpu));
  for (size_t i = 0; i < r.tensors.size(); ++i)
    if (r.tensors[i].layer >= 0) CHECK(p.home[i] == Home::gpu);

  std::string what;
  CHECK(category_of([&] { berth::plan_request(*model, 0, 32, f, "", 0, false); }, &what) ==
        ErrorCategory::invalid_argument);
  CHECK(what.find("-c 0") != std::string::npos);
  CHECK(category_of([&] { berth::plan_request(*model, 16, 0, f, "", 0, false); }, &what) ==
        ErrorCategory::invalid_argument);
  CHECK(what.find("-ub 0") != std::string::npos);
}

TEST_CASE("berth plan on the command line") {
  using berth::test::run_command;
  using berth::test::shell_quote;
  const std::string bin = berth::test::berth_bin();
  const std::string model = shell_quote(berth::test::stories260k().string());

  berth::test::CommandResult r =
      run_command(bin + " plan -m " + model + " --vram-budget 1G -ngl 99 --json");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const nlohmann::json j = nlohmann::json::parse(r.out);
  CHECK(j.at("how").get<std::string>().rfind("-ngl 99", 0) == 0);
  CHECK(j.at("budget_bytes") == size_t{1} << 30);  // less than any GPU berth runs on has free
  REQUIRE(j.at("devices").contains("GPU"));
  CHECK(j.at("devices").at("GPU").at("budget_bytes") == size_t{1} << 30);
  CHECK(j.at("kv").size() == 5);
  for (const auto& kv : j.at("kv")) CHECK(kv.at("home") == "GPU");
  for (const auto& t : j.at("tensors"))
    if (t.at("layer").get<int>() >= 0) CHECK(t.at("home") == "GPU");

  // The table, with -ot through its llama.cpp spelling; the tensors with --tensors only.
  r = run_command(bin + " plan -m " + model + " -c 64 -ub 16 --vram-budget 1G -ngl 99 -ot " +
                  shell_quote("blk\\.0\\.=CPU"));
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("blk.0.attn_q.weight") == std::string::npos);
  r = run_command(bin + " plan -m " + model + " -c 64 -ub 16 --vram-budget 1G -ngl 99 -ot " +
                  shell_quote("blk\\.0\\.=CPU") + " --tensors");
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("blk.0.attn_q.weight") != std::string::npos);
  CHECK(r.out.find("blk.0  ") != std::string::npos);  // layer 0's KV cache on its own line
  CHECK(r.out.find("blk.1-4") != std::string::npos);

  // Too small a budget: exit 1 and one line naming the terms.
  r = run_command(bin + " plan -m " + model + " --vram-budget 1M -ngl 99");
  CHECK(r.exit_code == 1);
  CHECK(r.out.empty());
  CHECK(r.err.rfind("berth: error: plan needs", 0) == 0);
  CHECK(r.err.find("margin 512.0 MiB") != std::string::npos);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);

  // Bad flags: usage errors (exit 2) naming the flag and value.
  r = run_command(bin + " plan -m " + model + " -ot exps");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("-ot 'exps'") != std::string::npos);
  r = run_command(bin + " plan -m " + model + " --vram-budget abc");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--vram-budget: 'abc': not a number") != std::string::npos);
  CHECK(r.err.find("--vram-budget", r.err.find("--vram-budget") + 1) == std::string::npos);  // once
  r = run_command(bin + " plan -m " + model + " -ngl -3");
  CHECK(r.exit_code == 2);
  CHECK(r.out.empty());

  // A flag that changes nothing is a note in the report, said once (not also as a warning).
  r = run_command(bin + " plan -m " + model + " --vram-budget 1G -ngl 99 --cpu-moe");
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("note: --cpu-moe ignored: the model has no routed experts") !=
        std::string::npos);
  CHECK(r.err.find("--cpu-moe ignored") == std::string::npos);
  // run and bench say it as a warning.
  r = run_command(bin + " run -m " + model + " -p hi -n 1 --temp 0 -ngl 0 --cpu-moe");
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("--cpu-moe ignored: the model has no routed experts") != std::string::npos);
}

TEST_CASE("berth plan --ops prints the schedules the run follows") {
  using berth::test::run_command;
  using berth::test::shell_quote;
  const std::string bin = berth::test::berth_bin();
  const std::string model = shell_quote(berth::test::stories260k().string());
  // Without a device: the CPU-only schedules, whatever the placement table says.
  berth::test::CommandResult r =
      run_command("env -u BERTH_SIM_DEVICE " + bin + " plan -m " + model + " --ops");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("decode step (1 token): no device, every op on the CPU") != std::string::npos);
  CHECK(r.out.find("prefill ubatch (2048 tokens): no device") != std::string::npos);  // run's -ub
  // On the simulated device with -ngl 3: the first two layers run before the step, their
  // residual stream is uploaded, the output layer forks back to the CPU.
  r = run_command("BERTH_SIM_DEVICE=1G " + bin + " plan -m " + model +
                  " -c 256 -ub 32 -ngl 3 --ops --json");
  REQUIRE(r.exit_code == 0);
  const nlohmann::json j = nlohmann::json::parse(r.out);
  REQUIRE(j.at("schedules").size() == 2);
  const auto& d = j.at("schedules").at(0);
  CHECK(d.at("n_tokens") == 1);
  CHECK(d.at("device") == "SIM0");
  CHECK(d.at("handoff") == "flags");
  CHECK(j.at("schedules").at(1).at("n_tokens") == 32);
  const auto& segs = d.at("segments");
  REQUIRE(segs.size() == 2);
  CHECK(segs.at(0).at("fork_after") == -1);
  CHECK(segs.at(0).at("outputs").at(0).at("name") == "blk.1.ffn_residual");
  CHECK(segs.at(0).at("outputs").at(0).at("bytes") == 64 * 4);
  // The output layer (output_norm, output) on the CPU: it forks after the last GPU op.
  CHECK(segs.at(1).at("inputs").at(0).at("name") == "blk.4.ffn_residual");
  for (const auto& op : d.at("ops")) {
    const std::string name = op.at("name");
    const bool gpu = name.rfind("blk.2.", 0) == 0 || name.rfind("blk.3.", 0) == 0 ||
                     name.rfind("blk.4.", 0) == 0;
    CAPTURE(name);
    CHECK(op.at("side") == (gpu ? "GPU" : "CPU"));
  }
  CHECK(d.at("bytes_to_device") == 64 * 4);
  CHECK(d.at("bytes_to_host") == 64 * 4);
  // The placement flags of run are accepted, and the text names the hand-off and crossings.
  r = run_command("BERTH_SIM_DEVICE=1G " + bin + " plan -m " + model +
                  " -ngl 99 --stream-experts 0 --host-expert-share 0.5 --warm-workers 0 "
                  "--handoff callback --ops");
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("decode step (1 token): SIM0, hand-off callback") != std::string::npos);
  CHECK(r.out.find("CPU segment 0 (ops 0-0) runs before the step; to the GPU: token_embd") !=
        std::string::npos);
  CHECK(r.err.find("--host-expert-share") == std::string::npos);
}

TEST_CASE(
    "-ot regexes: deep nesting and heavy backtracking end in a message, not a crash or hang") {
  Flags f;
  const std::string nested = std::string(20000, '(') + "a" + std::string(20000, ')') + "=CPU";
  CHECK(category_of([&] { add_override(f, nested); }) == ErrorCategory::invalid_argument);
  // Catastrophic backtracking for a backtracking engine; PCRE2 either sees through it or stops
  // at its match limit with an error naming the rule. Either way this returns.
  for (const char* rule :
       {"(.*)+Q=CPU", "(.*)*Q$=CPU", ".*.*.*.*.*.*.*.*.*.*Q$=CPU", "(a|aa)+Q$=CPU"}) {
    CAPTURE(std::string(rule));
    Request r = moe_request();
    r.flags.n_gpu_layers = 99;
    add_override(r.flags, rule);
    try {
      const Plan p = make_plan(r);
      CHECK(std::any_of(p.notes.begin(), p.notes.end(), [](const std::string& n) {
        return n.find("matches no tensor") != std::string::npos;
      }));
    } catch (const Error& e) {
      CHECK(e.category() == ErrorCategory::invalid_argument);
      CHECK(std::string(e.what()).find("simplify the regex") != std::string::npos);
    }
  }
}

TEST_CASE("flags that change nothing say so") {
  Request d = dense_request();
  d.flags.n_gpu_layers = 99;
  d.flags.cpu_moe = true;
  Plan p = make_plan(d);
  CHECK(std::any_of(p.notes.begin(), p.notes.end(), [](const std::string& n) {
    return n.find("--cpu-moe ignored: the model has no routed experts") != std::string::npos;
  }));
  Request r = moe_request();
  r.flags.n_gpu_layers = 99;
  r.flags.n_cpu_moe = 1000;
  add_override(r.flags, " exps=CPU");
  p = make_plan(r);
  CHECK(std::any_of(p.notes.begin(), p.notes.end(), [](const std::string& n) {
    return n.find("--n-cpu-moe 1000 is more than the 4 layers") != std::string::npos;
  }));
  CHECK(std::any_of(p.notes.begin(), p.notes.end(), [](const std::string& n) {
    return n.find("-ot  exps=CPU matches no tensor") != std::string::npos;
  }));
  // --n-cpu-moe beside --cpu-moe: the latter already puts every layer's experts on the CPU.
  Request both = moe_request();
  both.flags.n_gpu_layers = 99;
  both.flags.cpu_moe = true;
  both.flags.n_cpu_moe = 2;
  p = make_plan(both);
  CHECK(std::any_of(p.notes.begin(), p.notes.end(), [](const std::string& n) {
    return n.find("--n-cpu-moe 2 has no effect with --cpu-moe") != std::string::npos;
  }));
}

namespace {
// moe_request() with 10 experts stacked in each routed-expert tensor (9 MiB per expert per layer:
// gate, up and down 3 MiB each).
Request stacked_moe_request() {
  Request r = moe_request();
  for (TensorEntry& t : r.tensors)
    if (t.routed_expert()) t.n_expert = 10;
  return r;
}
constexpr size_t kTables = 4 * 10 * 4;  // int32 per expert per layer
}  // namespace

TEST_CASE(
    "--residency adaptive: the budget's room becomes expert slots, the same count per layer") {
  // Automatic at 400 MiB: the non-expert units as before (out_norm 1, 4 x (15 + KV 5), output 50,
  // token_embd 100) and overhead 96 leave 73 MiB: 2 slots of 4 x 9 MiB (and the tables).
  Request r = stacked_moe_request();
  r.flags.vram_budget = 400 * MiB;
  const Plan p = make_plan(r);
  CHECK(p.residency == ResidencyMode::adaptive);
  CHECK(p.expert_slots == 2);
  CHECK(p.layer_slots == std::vector<int32_t>{2, 2, 2, 2});
  CHECK(p.slot_bytes == 2 * 36 * MiB + kTables);
  check_homes(r, p, [](const TensorEntry& t) { return gpu_if(!t.routed_expert()); });
  CHECK(p.gpu_total() == (327 + 72) * MiB + kTables);
  CHECK(p.gpu_total() <= p.budget_bytes);
  CHECK(p.how.find("2 expert slots") != std::string::npos);

  // Static: the plan as before: after the output, 173 MiB hold layer 3's experts (90), then
  // token_embd (100) no longer fits; no slots.
  Request s = r;
  s.flags.residency = ResidencyMode::fixed;
  const Plan ps = make_plan(s);
  CHECK(ps.residency == ResidencyMode::fixed);
  CHECK(ps.expert_slots == 0);
  CHECK(ps.slot_bytes == 0);
  CHECK(home_of(s, ps, "blk.3.ffn_up_exps.weight") == Home::gpu);
  CHECK(home_of(s, ps, "blk.2.ffn_up_exps.weight") == Home::cpu);
  CHECK(home_of(s, ps, "token_embd.weight") == Home::cpu);
  Request s0 = s;  // the same as a request that does not say how many experts a tensor stacks
  for (TensorEntry& t : s0.tensors) t.n_expert = 0;
  s0.flags.residency = ResidencyMode::automatic;
  CHECK(make_plan(s0).home == ps.home);
  CHECK(make_plan(s0).expert_slots == 0);
  // Adaptive places token_embd instead of layer 3's experts; at 430 MiB: 103 MiB of room, 2 x 36.
  CHECK(home_of(r, p, "token_embd.weight") == Home::gpu);
  r.flags.vram_budget = 430 * MiB;
  const Plan pa = make_plan(r);
  CHECK(home_of(r, pa, "blk.3.ffn_up_exps.weight") == Home::cpu);
  CHECK(pa.expert_slots == 2);

  // A budget that holds every weight: auto stays static, everything on the GPU.
  Request big = stacked_moe_request();
  const Plan pb = make_plan(big);
  CHECK(pb.residency == ResidencyMode::fixed);
  CHECK(pb.expert_slots == 0);
  // Asked for, adaptive keeps the routed experts on the CPU with slots, n_expert - 1 at most.
  big.flags.residency = ResidencyMode::adaptive;
  const Plan pbig = make_plan(big);
  CHECK(pbig.expert_slots == 9);
  check_homes(big, pbig, [](const TensorEntry& t) { return gpu_if(!t.routed_expert()); });
  // No device: no slots.
  Request none = stacked_moe_request();
  none.has_device = false;
  none.flags.residency = ResidencyMode::adaptive;
  CHECK(make_plan(none).expert_slots == 0);
  // At most n_expert - 1 slots, however much room.
  Request lots = stacked_moe_request();
  lots.flags.n_gpu_layers = 99;
  lots.flags.cpu_moe = true;
  lots.flags.residency = ResidencyMode::adaptive;
  CHECK(make_plan(lots).expert_slots == 9);
}

TEST_CASE("--residency adaptive with -ngl, --cpu-moe, --n-cpu-moe and -ot") {
  // -ngl 99 --cpu-moe at 400 MiB: GPU 111 weights + 20 KV + 96 overhead = 227; 173 MiB of room:
  // 4 slots of 36 MiB.
  Request r = stacked_moe_request();
  r.flags.vram_budget = 400 * MiB;
  r.flags.n_gpu_layers = 99;
  r.flags.cpu_moe = true;
  Plan p = make_plan(r);
  CHECK(p.expert_slots == 4);
  CHECK(p.layer_slots == std::vector<int32_t>{4, 4, 4, 4});
  CHECK(p.gpu_total() == (227 + 144) * MiB + kTables);

  // --n-cpu-moe 2 at 500 MiB: layers 2 and 3 keep their experts on the GPU (180 MiB); the 93
  // MiB left give layers 0 and 1 5 slots of 2 x 9 MiB.
  Request n = stacked_moe_request();
  n.flags.vram_budget = 500 * MiB;
  n.flags.n_gpu_layers = 99;
  n.flags.n_cpu_moe = 2;
  p = make_plan(n);
  CHECK(p.expert_slots == 5);
  CHECK(p.layer_slots == std::vector<int32_t>{5, 5, 0, 0});
  CHECK(p.slot_bytes == 5 * 18 * MiB + 2 * 10 * 4);
  CHECK(p.gpu_total() <= p.budget_bytes);

  // -ot placing layer 0's experts on the CPU: that layer gets no slots, the others share the
  // room (173 MiB / 27 MiB: 6).
  Request o = stacked_moe_request();
  o.flags.vram_budget = 400 * MiB;
  o.flags.n_gpu_layers = 99;
  o.flags.cpu_moe = true;
  add_override(o.flags, "blk\\.0\\.ffn_.*_exps=CPU");
  p = make_plan(o);
  CHECK(p.layer_slots == std::vector<int32_t>{0, 6, 6, 6});
  CHECK(p.slot_bytes == 6 * 27 * MiB + 3 * 10 * 4);

  // --residency static with the same flags: no slots, the rest as before.
  r.flags.residency = ResidencyMode::fixed;
  p = make_plan(r);
  CHECK(p.expert_slots == 0);
  CHECK(p.gpu_total() == 227 * MiB);

  // The table and the JSON show the slots per MoE layer.
  const Plan pj = make_plan(n);
  const std::string t = plan_table(n, pj);
  INFO(t);
  CHECK(t.find("residency: adaptive, 5 expert slots per CPU-held MoE layer") != std::string::npos);
  CHECK(t.find("blk.0-1           5 of 10 (expert slots; the rest on the CPU)") !=
        std::string::npos);
  CHECK(t.find("blk.2-3           all 10 (expert tensors on the GPU)") != std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(plan_json(n, pj));
  CHECK(j["residency"] == "adaptive");
  CHECK(j["expert_slots"] == 5);
  CHECK(j["devices"]["GPU"]["slot_bytes"] == pj.slot_bytes);
  REQUIRE(j["moe_layers"].size() == 4);
  CHECK(j["moe_layers"][0]["experts_on_gpu"] == 5);
  CHECK(j["moe_layers"][0]["home"] == "CPU");
  CHECK(j["moe_layers"][3]["experts_on_gpu"] == 10);
  CHECK(j["moe_layers"][3]["slots"] == 0);
  CHECK(parse_residency_mode("Adaptive") == ResidencyMode::adaptive);
  CHECK(category_of([] { (void)parse_residency_mode("dynamic"); }) ==
        ErrorCategory::invalid_argument);
}

TEST_CASE("plan table and JSON: which experts the slots start with") {
  CHECK(expert_ranges(std::vector<int32_t>{9, 0, 1, 2, 3, 7, 3}) == "0-3,7,9");
  CHECK(expert_ranges(std::vector<int32_t>{5}) == "5");
  CHECK(expert_ranges(std::vector<int32_t>{}).empty());
  // --n-cpu-moe 2 at 500 MiB (as above): layers 0 and 1 with 5 slots. make_plan does not know
  // the slots' experts (runtime's place() asks the slot policy): no ids then.
  Request n = stacked_moe_request();
  n.flags.vram_budget = 500 * MiB;
  n.flags.n_gpu_layers = 99;
  n.flags.n_cpu_moe = 2;
  Plan p = make_plan(n);
  REQUIRE(p.layer_slots == std::vector<int32_t>{5, 5, 0, 0});
  nlohmann::json j = nlohmann::json::parse(plan_json(n, p));
  CHECK(j["moe_layers"][0]["gpu_experts"].is_null());
  CHECK(j["moe_layers"][2]["gpu_experts"] == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  CHECK(j["slot_policy"].is_null());
  CHECK(plan_table(n, p).find("blk.0-1           5 of 10 (expert slots; the rest on the CPU)\n") !=
        std::string::npos);
  // Seeds that differ per layer: one line each, ascending runs; fixed ones say so.
  p.slot_seed = {{7, 1, 2, 3, 9}, {0, 1, 2, 3, 4}, {}, {}};
  p.slot_policy = "frequency(cal.trace)";
  p.slots_move = false;
  const std::string t = plan_table(n, p);
  INFO(t);
  CHECK(t.find("policy frequency(cal.trace): the slots hold the experts listed, fixed") !=
        std::string::npos);
  CHECK(t.find("blk.0             5 of 10 (expert slots; the rest on the CPU): 1-3,7,9\n") !=
        std::string::npos);
  CHECK(t.find("blk.1             5 of 10 (expert slots; the rest on the CPU): 0-4\n") !=
        std::string::npos);
  j = nlohmann::json::parse(plan_json(n, p));
  CHECK(j["moe_layers"][0]["gpu_experts"] == std::vector<int32_t>{1, 2, 3, 7, 9});
  CHECK(j["moe_layers"][0]["gpu_experts_move"] == false);
  CHECK(j["slot_policy"] == "frequency(cal.trace)");
  // The same seed on both layers and a policy that moves them: one line.
  p.slot_seed[0] = p.slot_seed[1];
  p.slots_move = true;
  p.slot_policy = "lru";
  const std::string m = plan_table(n, p);
  CHECK(m.find("policy lru: the slots start with the experts listed and follow the routing") !=
        std::string::npos);
  CHECK(m.find("blk.0-1           5 of 10 (expert slots; the rest on the CPU): 0-4\n") !=
        std::string::npos);
  CHECK(nlohmann::json::parse(plan_json(n, p))["moe_layers"][1]["gpu_experts_move"] == true);
  // Static: nothing moves.
  n.flags.residency = ResidencyMode::fixed;
  CHECK(plan_table(n, make_plan(n))
            .find("residency: static (fixed: no expert moves while "
                  "running)") != std::string::npos);
}

TEST_CASE("--ram-budget: routed experts beyond the budget go to the disk tier") {
  // No device: CPU weights 571 MiB, of them 360 MiB routed experts (4 layers x 10 experts x 9
  // MiB); the CPU KV cache 40 MiB (f32). What must stay in RAM: 211 + 40 = 251 MiB.
  Request r = stacked_moe_request();
  r.has_device = false;
  const Plan all = make_plan(r);  // no budget: no tier
  CHECK(all.ram_slots == 0);
  CHECK(all.disk_weight_bytes == 0);
  r.ram_budget_bytes = 1000 * MiB;  // fits: no tier
  CHECK(make_plan(r).ram_slots == 0);

  // 400 MiB: 149 MiB of room; a slot is 3 slices of 3 MiB, each padded by 4 KiB, per layer.
  r.ram_budget_bytes = 400 * MiB;
  const Plan p = make_plan(r);
  const size_t per_slot = 4 * 3 * (3 * MiB + 4096);
  CHECK(p.ram_slots == 4);
  CHECK(p.layer_ram_slots == std::vector<int32_t>{4, 4, 4, 4});
  CHECK(p.ram_slot_bytes == 4 * per_slot);
  CHECK(p.disk_weight_bytes == 360 * MiB);
  CHECK(p.cpu_weight_bytes == 211 * MiB);
  CHECK(p.ram_total() <= 400 * MiB);
  CHECK(p.how.find("disk tier: 4 RAM expert slots per MoE layer") != std::string::npos);
  const std::string table = plan_table(r, p);
  CHECK(table.find("on disk: 6 of 10 (RAM cache of 4 slots)") != std::string::npos);
  CHECK(table.find("tiers: VRAM 0.000 MiB, RAM ") != std::string::npos);
  CHECK(table.find("disk 360.000 MiB") != std::string::npos);
  const auto j = nlohmann::json::parse(plan_json(r, p));
  CHECK(j["tiers"]["disk_bytes"] == 360 * MiB);
  CHECK(j["tiers"]["ram_budget_bytes"] == 400 * MiB);
  CHECK(j["tiers"]["ram_slots"] == 4);
  CHECK(j["tiers"]["ram_bytes"] == p.ram_total());
  CHECK(j["moe_layers"][0]["experts_on_disk"] == 6);
  CHECK(j["moe_layers"][0]["ram_slots"] == 4);

  // What must stay in RAM does not fit; then room for less than one slot per layer: errors
  // when --ram-budget was given, a note and no tier with the default budget.
  r.ram_budget_bytes = 250 * MiB;
  const Plan pdef = make_plan(r);
  CHECK(pdef.ram_slots == 0);
  CHECK(std::any_of(pdef.notes.begin(), pdef.notes.end(), [](const std::string& n) {
    return n.find("exceed the default RAM budget of 250.0 MiB") != std::string::npos;
  }));
  std::string what;
  r.flags.ram_budget = 250 * MiB;
  CHECK(category_of([&] { (void)make_plan(r); }, &what) == ErrorCategory::out_of_memory);
  CHECK(what.find("what must stay in RAM does not fit the --ram-budget 250.0 MiB: CPU-held "
                  "weights other than routed experts 211.0 MiB + KV cache 40.0 MiB") !=
        std::string::npos);
  r.ram_budget_bytes = 260 * MiB;
  r.flags.ram_budget = 260 * MiB;
  CHECK(category_of([&] { (void)make_plan(r); }, &what) == ErrorCategory::out_of_memory);
  CHECK(what.find("not enough for one RAM slot per MoE layer") != std::string::npos);

  // With a device and adaptive residency, the tier drops the GPU expert slots (with a note).
  Request d = stacked_moe_request();
  d.flags.vram_budget = 400 * MiB;
  d.ram_budget_bytes = 300 * MiB;
  const Plan pd = make_plan(d);
  CHECK(pd.ram_slots >= 1);
  CHECK(pd.expert_slots == 0);
  CHECK(pd.slot_bytes == 0);
  CHECK(std::any_of(pd.notes.begin(), pd.notes.end(), [](const std::string& n) {
    return n.find("the disk tier turns the 2 GPU expert slots per layer off") != std::string::npos;
  }));
}

TEST_CASE("the automatic plan says what became of the room it left for expert slots") {
  const auto how_of = [](const Request& r) {
    const Plan p = make_plan(r);
    INFO(p.how);
    return std::pair{p.how, p.expert_slots};
  };
  // The budget's room holds slots (as above: 2 at 400 MiB).
  Request r = stacked_moe_request();
  r.flags.vram_budget = 400 * MiB;
  auto [how, slots] = how_of(r);
  CHECK(slots == 2);
  CHECK(how.find("--n-cpu-moe 4, the rest as expert slots)") != std::string::npos);
  CHECK(how.find("--residency adaptive: 2 expert slots per CPU-held MoE layer") !=
        std::string::npos);

  // A board's one pool (--unified off): the GPU's side takes 399 MiB (327 + 72 MiB of slots)
  // beside the CPU's 360 MiB of routed experts. A pool of 700 MiB leaves the slots 13 MiB, less
  // than one (36 MiB): it said "the rest as expert slots" with none.
  r.shared_pool = true;
  r.shared_pool_bytes = 700 * MiB;
  std::tie(how, slots) = how_of(r);
  CHECK(slots == 0);
  CHECK(how.find("--n-cpu-moe 4, no expert slot fits)") != std::string::npos);
  CHECK(how.find("expert slots") == std::string::npos);
  // 800 MiB: 113 MiB beside both sides, the budget's 73 MiB room holds 2.
  r.shared_pool_bytes = 800 * MiB;
  std::tie(how, slots) = how_of(r);
  CHECK(slots == 2);
  CHECK(how.find("--n-cpu-moe 4, the rest as expert slots)") != std::string::npos);

  // The disk tier turns the slots off: the plan says so, and claims none.
  Request d = stacked_moe_request();
  d.flags.vram_budget = 400 * MiB;
  d.ram_budget_bytes = 300 * MiB;
  std::tie(how, slots) = how_of(d);
  CHECK(slots == 0);
  CHECK(how.find("--n-cpu-moe 4, no expert slots: the disk tier turns them off)") !=
        std::string::npos);
  CHECK(how.find("--residency adaptive:") == std::string::npos);
  CHECK(how.find("; disk tier: ") != std::string::npos);

  // Static residency: no clause.
  r.flags.residency = ResidencyMode::fixed;
  std::tie(how, slots) = how_of(r);
  CHECK(how.find("expert slot") == std::string::npos);
}
