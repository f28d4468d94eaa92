// `berth quantize` on the real stories260K model (all F32, n_embd 64, n_ff 172): which tensors
// change type, that the new bytes are exactly the reference quantizer's, that the metadata is
// copied with general.file_type set, that the Q8_0 model generates the F32 model's text with
// logits in a measured NMSE band, and clean one-line failures on bad input.
#include <doctest/doctest.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "berth/cpu_kernels/quants_ref.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/runtime/session.h"
#include "berth/tools/quantize.h"
#include "test_util.h"

using namespace berth;
namespace fs = std::filesystem;

namespace {

const std::vector<int32_t> kPromptIds = {1, 403, 407, 261, 378};  // "Once upon a time" with BOS

// A Session's ThreadPool pins this (the calling) thread to one core, and a child process
// inherits that affinity: TBB in the child then finds one CPU and warns on stderr when asked for
// workers. Children get the whole machine back, as from a shell.
void unpin_calling_thread() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const long n = sysconf(_SC_NPROCESSORS_CONF);
  for (long i = 0; i < n && i < CPU_SETSIZE; ++i) CPU_SET(static_cast<int>(i), &set);
  (void)sched_setaffinity(0, sizeof(set), &set);  // best effort: the checks below still apply
}

test::CommandResult quantize_cli(const fs::path& in, const fs::path& out, const std::string& type) {
  unpin_calling_thread();
  return test::run_command(test::berth_bin() + " quantize " + test::shell_quote(in.string()) + " " +
                           test::shell_quote(out.string()) + " " + test::shell_quote(type));
}

bool is_ffn_down(const std::string& name) { return name.find("ffn_down") != std::string::npos; }

// Checks the quantized file against the input: metadata copied (file_type and
// quantization_version set), 1-D tensors and `keep(name)` matrices byte-identical, all other
// matrices exactly ref::quantize_row of the F32 rows in `type`.
void check_file(const gguf::File& in, const gguf::File& out, GgmlType type, uint32_t ftype,
                bool (*keep)(const std::string&)) {
  CHECK(out.get_int("general.file_type") == ftype);
  CHECK(out.get_int("general.quantization_version") == 2);
  for (const gguf::KeyValue& kv : in.kvs()) {
    CAPTURE(kv.key);
    const gguf::Value* v = out.find(kv.key);
    REQUIRE(v != nullptr);
    CHECK(v->type() == kv.value.type());
    CHECK(v->to_string(1 << 20) == kv.value.to_string(1 << 20));
  }
  REQUIRE(out.tensors().size() == in.tensors().size());
  for (size_t i = 0; i < in.tensors().size(); ++i) {
    const gguf::TensorInfo& a = in.tensors()[i];
    const gguf::TensorInfo& b = out.tensors()[i];
    CAPTURE(a.name);
    CHECK(b.name == a.name);
    CHECK(b.ne == a.ne);
    CHECK(b.n_dims == a.n_dims);
    const bool quantized = a.n_dims >= 2 && !keep(a.name);
    CHECK(b.type == (quantized ? type : GgmlType::F32));
    if (!quantized) {
      REQUIRE(b.n_bytes == a.n_bytes);
      CHECK(std::memcmp(a.data, b.data, a.n_bytes) == 0);
      continue;
    }
    const int64_t n = a.ne[0], rows = a.n_elements() / n;
    const size_t rb = row_bytes(type, n);
    REQUIRE(b.n_bytes == rb * static_cast<size_t>(rows));
    std::vector<uint8_t> expect(rb);
    for (int64_t r = 0; r < rows; ++r) {
      ref::quantize_row(type, reinterpret_cast<const float*>(a.data) + r * n, expect.data(), n);
      if (std::memcmp(expect.data(), b.data + static_cast<size_t>(r) * rb, rb) != 0) {
        FAIL_CHECK("row ", r, " differs from ref::quantize_row");
        break;
      }
    }
  }
}

int32_t argmax(std::span<const float> x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

double nmse(std::span<const float> got, std::span<const float> ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return num / den;
}

}  // namespace

TEST_CASE("berth quantize to q8_0 and q4_0: matrices with 64-element rows change, ffn_down stays") {
  const fs::path dir = test::temp_dir("quantize");
  gguf::File in = gguf::File::open(test::stories260k().string());
  struct Case {
    const char* name;
    GgmlType type;
    uint32_t ftype;
  };
  for (const Case& c : {Case{"q8_0", GgmlType::Q8_0, 7}, Case{"q4_0", GgmlType::Q4_0, 2},
                        Case{"Q5_1", GgmlType::Q5_1, 9}}) {
    CAPTURE(c.name);
    const fs::path out_path = dir / (std::string(c.name) + ".gguf");
    test::CommandResult r = quantize_cli(test::stories260k(), out_path, c.name);
    CHECK_FALSE(r.signaled);
    REQUIRE(r.exit_code == 0);
    CHECK(r.err.empty());
    // 37 matrices: token_embd, output and 7 per layer x 5; the 5 ffn_down have rows of 172.
    const std::string tn(type_name(c.type));
    CHECK(r.out.find("quantized: 32 tensors to " + tn + "\n") != std::string::npos);
    CHECK(r.out.find("kept:      5 weight matrices in their type\n") != std::string::npos);
    CHECK(r.out.find("5 (f32, row length 172 is not a multiple of 32): blk.0.ffn_down.weight") !=
          std::string::npos);
    CHECK(r.out.find("copied:    11 other tensors") != std::string::npos);
    gguf::File out = gguf::File::open(out_path.string());
    check_file(in, out, c.type, c.ftype, is_ffn_down);
    CHECK(out.file_size() < in.file_size());
  }
}

TEST_CASE("berth quantize to q4_K keeps everything in F32 (no row is a multiple of 256)") {
  const fs::path dir = test::temp_dir("quantize-k");
  const fs::path out_path = dir / "q4_K.gguf";
  test::CommandResult r = quantize_cli(test::stories260k(), out_path, "q4_K");
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("quantized: 0 tensors to q4_K\n") != std::string::npos);
  CHECK(r.out.find("kept:      37 weight matrices in their type\n") != std::string::npos);
  CHECK(r.out.find("32 (f32, row length 64 is not a multiple of 256)") != std::string::npos);
  CHECK(r.out.find("5 (f32, row length 172 is not a multiple of 256)") != std::string::npos);
  gguf::File in = gguf::File::open(test::stories260k().string());
  gguf::File out = gguf::File::open(out_path.string());
  check_file(in, out, GgmlType::Q4_K, 14, [](const std::string&) { return true; });

  // The library reports the same, per tensor.
  ThreadPool pool(2);
  QuantizeReport rep = quantize_model(test::stories260k().string(), (dir / "lib.gguf").string(),
                                      GgmlType::Q4_K, pool);
  CHECK(rep.n_quantized == 0);
  CHECK(rep.n_kept == 37);
  CHECK(rep.n_copied == 11);
  CHECK(rep.bytes_out == rep.bytes_in);
  CHECK(rep.file_bytes_out == out.file_size());
}

// Logits NMSE (sum (q - f)^2 / sum f^2 over the vocabulary) of `model` against the F32 run's
// `ref_logits`, teacher-forced with the F32 run's greedy tokens so every step compares the same
// context. Returns {worst step, mean over steps}.
static std::pair<double, double> logits_nmse(const Model& model, const SessionParams& params,
                                             const std::vector<std::vector<float>>& ref_logits,
                                             const std::vector<int32_t>& ref_tokens) {
  Session s(model, params);
  std::span<const float> l = s.eval(kPromptIds);
  double worst = 0, sum = 0;
  for (size_t step = 0; step < ref_logits.size(); ++step) {
    const double e = nmse(l, ref_logits[step]);
    worst = std::max(worst, e);
    sum += e;
    const int32_t one[1] = {ref_tokens[step]};
    l = s.eval(one);
  }
  return {worst, sum / static_cast<double>(ref_logits.size())};
}

TEST_CASE("the q8_0 model generates the f32 model's text, logits within an NMSE band") {
  const fs::path dir = test::temp_dir("quantize-run");
  const fs::path q8_path = dir / "q8_0.gguf", q4_path = dir / "q4_0.gguf";
  REQUIRE(quantize_cli(test::stories260k(), q8_path, "q8_0").exit_code == 0);
  REQUIRE(quantize_cli(test::stories260k(), q4_path, "q4_0").exit_code == 0);
  gguf::File f32_file = gguf::File::open(test::stories260k().string());
  gguf::File q8_file = gguf::File::open(q8_path.string());
  gguf::File q4_file = gguf::File::open(q4_path.string());
  std::unique_ptr<Model> f32_model = load_model(f32_file);
  std::unique_ptr<Model> q8_model = load_model(q8_file);
  std::unique_ptr<Model> q4_model = load_model(q4_file);
  const SessionParams params{.n_threads = 2, .n_ctx = 128, .n_ubatch = 512};

  // The F32 run: 32 greedy steps, keeping each step's logits.
  constexpr int kSteps = 32;
  Session s32(*f32_model, params);
  std::span<const float> l = s32.eval(kPromptIds);
  std::vector<std::vector<float>> ref_logits;
  std::vector<int32_t> ref_tokens;
  for (int step = 0; step < kSteps; ++step) {
    ref_logits.emplace_back(l.begin(), l.end());
    ref_tokens.push_back(argmax(l));
    const int32_t one[1] = {ref_tokens.back()};
    l = s32.eval(one);
  }

  // The Q8_0 run, free-running greedy: the same first 20 tokens (measured: all 32 agree).
  Session s8(*q8_model, params);
  l = s8.eval(kPromptIds);
  std::vector<int32_t> q8_tokens;
  for (int step = 0; step < 20; ++step) {
    q8_tokens.push_back(argmax(l));
    const int32_t one[1] = {q8_tokens.back()};
    l = s8.eval(one);
  }
  CHECK(q8_tokens == std::vector<int32_t>(ref_tokens.begin(), ref_tokens.begin() + 20));

  // Measured on x86-64 (AVX2 / AVX-512 kernels), Q8_0 weights with Q8_0 activations in every
  // matmul: worst step 7.5e-4 (one step whose logits have a small norm; the others < 3e-4), mean
  // 1.1e-4; with F32 activations the weights alone give 4.6e-4 / 6.4e-5. Bounds: ~3x and ~5x
  // margin. Q4_0 weights give worst 6.2, mean 0.21, so the band tells 8 from 4 bits apart.
  const auto [worst8, mean8] = logits_nmse(*q8_model, params, ref_logits, ref_tokens);
  MESSAGE("q8_0 vs f32 logits NMSE over ", kSteps, " steps: worst ", worst8, ", mean ", mean8);
  CHECK(worst8 > 0);  // the weights did change
  CHECK(worst8 < 2e-3);
  CHECK(mean8 < 5e-4);
  const auto [worst4, mean4] = logits_nmse(*q4_model, params, ref_logits, ref_tokens);
  MESSAGE("q4_0 vs f32 logits NMSE: worst ", worst4, ", mean ", mean4);
  CHECK(mean4 > 5e-4);
}

TEST_CASE("berth quantize fails with one line on bad input") {
  const fs::path dir = test::temp_dir("quantize-bad");
  struct Bad {
    fs::path in, out;
    std::string type, mention;
  };
  const fs::path model = test::stories260k();
  for (const Bad& b : {Bad{model, dir / "a.gguf", "q4_9", "unknown quantization type 'q4_9'"},
                       Bad{model, dir / "b.gguf", "iq2_xxs", "unknown quantization type 'iq2_xxs'"},
                       Bad{model, dir / "c.gguf", "q8_K", "unknown quantization type 'q8_K'"},
                       Bad{dir / "missing.gguf", dir / "d.gguf", "q8_0", "missing.gguf"},
                       Bad{model, dir / "no-such-dir" / "e.gguf", "q8_0", "no-such-dir/e.gguf"},
                       Bad{model, model, "q8_0", "is the input file"}}) {
    CAPTURE(b.type);
    CAPTURE(b.out.string());
    test::CommandResult r = quantize_cli(b.in, b.out, b.type);
    CAPTURE(r.err);
    CHECK_FALSE(r.signaled);
    CHECK(r.exit_code == 1);
    CHECK(r.out.empty());
    CHECK(r.err.rfind("berth: error: ", 0) == 0);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.err.find(b.mention) != std::string::npos);
    if (b.out != model) CHECK_FALSE(fs::exists(b.out));
  }
  // The input survived the attempt to overwrite it.
  CHECK(gguf::File::open(model.string()).tensors().size() == 48);
  // Missing arguments are a usage error (exit 2).
  test::CommandResult r =
      test::run_command(test::berth_bin() + " quantize " + test::shell_quote(model.string()));
  CHECK(r.exit_code == 2);
}
