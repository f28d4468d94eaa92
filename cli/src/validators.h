// Option validators shared by the commands.
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <string>
#include <type_traits>

namespace berth::cli {

/// Checks a number in [lo, hi] (T: an integer or floating-point type). Unlike CLI::Range, a
/// value that is not a number of T's kind says so ("'x' is not a whole number in 1..256"; CLI's
/// said "Value x not in range"), and NaN is refused. CLI11 puts the option's name before it.
template <class T>
CLI::Validator range(T lo, T hi) {
  constexpr bool whole = std::is_integral_v<T>;
  const std::string span = fmt::format("{}..{}", lo, hi);
  return CLI::Validator(
      [lo, hi, span](std::string& in) -> std::string {
        T v{};
        bool ok = CLI::detail::lexical_cast(in, v);
        if constexpr (!whole) ok = ok && !std::isnan(v);
        if (!ok)
          return fmt::format("'{}' is not {} in {}", in, whole ? "a whole number" : "a number",
                             span);
        if (v < lo || v > hi) return fmt::format("{} is outside {}", in, span);
        return {};
      },
      fmt::format("{} in [{} - {}]", whole ? "INT" : "FLOAT", lo, hi));
}

}  // namespace berth::cli
