// The kernel oracle harness: helpers to run a SIMD kernel on every Highway target compiled into
// the binary and supported by this CPU, and to compare it with its scalar twin by NMSE.
//
// Rules every oracle test follows: inputs come fresh from a seeded generator (never zeros);
// outputs are poisoned with NaN before each run so an element the kernel did not write fails;
// the tolerance of each op is written next to the op in the test.
#pragma once

#include <doctest/doctest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace berth::test {

/// Whether target `name` is one BERTH_TEST_SIMD_TARGETS lists (names as hwy::TargetName gives
/// them, separated by spaces or commas); every target when it is unset or empty. The arm64 CI
/// runs each emulated CPU's own targets only (scripts/test-arm64.sh).
inline bool simd_target_selected(const std::string& name) {
  const char* env = std::getenv("BERTH_TEST_SIMD_TARGETS");
  if (env == nullptr || *env == 0) return true;
  std::string spaced = std::string(" ") + env + " ";
  std::replace(spaced.begin(), spaced.end(), ',', ' ');
  return spaced.find(" " + name + " ") != std::string::npos;
}

/// BERTH_TEST_SHAPES=small: the oracle's dot-product cases run fewer and smaller shapes (every
/// kernel path, tile and remainder still runs), for emulated CPUs whose wide SVE qemu runs many
/// times slower (scripts/test-arm64.sh).
inline bool small_shapes() {
  const char* e = std::getenv("BERTH_TEST_SHAPES");
  return e && std::string(e) == "small";
}

/// Calls fn(target_name) once per Highway target that is both compiled in and supported by the
/// CPU (and selected: simd_target_selected), with dynamic dispatch forced to that target;
/// restores normal dispatch afterwards. Fails when no target ran.
template <class Fn>
void for_each_simd_target(Fn&& fn) {
  int n = 0;
  // Highway 1.0.3 returns the targets as a list of single-bit values; HWY_TARGETS is the set
  // compiled into berth_cpu_kernels (its HWY_DISABLED_TARGETS / HWY_WANT_AVX3_DL are PUBLIC).
  for (int64_t bit : hwy::SupportedAndGeneratedTargets()) {
    if ((bit & HWY_TARGETS) == 0) continue;
    const std::string name = hwy::TargetName(bit);
    if (!simd_target_selected(name)) continue;
    hwy::SetSupportedTargetsForTest(bit);
    CAPTURE(name);
    fn(name);
    ++n;
  }
  hwy::SetSupportedTargetsForTest(0);
  CHECK(n >= 1);
}

/// Normalised mean squared error sum((got-ref)^2) / sum(ref^2); a NaN anywhere gives +inf.
inline double nmse(const float* ref, const float* got, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(ref[i]))
      return std::numeric_limits<double>::infinity();
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? num / den : num;
}

/// Fills with NaN so unwritten outputs fail the comparison.
inline void poison(std::vector<float>& v) {
  std::fill(v.begin(), v.end(), std::numeric_limits<float>::quiet_NaN());
}

/// n draws of N(mean, sd) from a generator seeded with `seed`.
inline std::vector<float> gaussian(size_t n, uint64_t seed, float sd = 1.0f, float mean = 0.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(mean, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

}  // namespace berth::test
