// The one logging wrapper: every berth library logs through these functions (spdlog inside).
// Logs go to stderr so that stdout carries only a command's output (generated text, tables).
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace berth::log {

enum class Level { trace, debug, info, warn, error, off };

/// Sets the minimum level that is printed (default: warn, so commands stay quiet).
void set_level(Level level);
/// Parses "trace|debug|info|warn|error|off"; throws berth::Error(invalid_argument) otherwise.
Level parse_level(std::string_view name);

void write(Level level, std::string_view message);
bool enabled(Level level);

template <class... Args>
void debug(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(Level::debug)) write(Level::debug, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void info(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(Level::info)) write(Level::info, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void warn(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(Level::warn)) write(Level::warn, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void error(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(Level::error)) write(Level::error, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace berth::log
