#include "berth/core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "berth/core/error.h"

namespace berth::log {
namespace {

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> l = [] {
    auto lg = spdlog::stderr_color_mt("berth");
    lg->set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
    lg->set_level(spdlog::level::warn);
    return lg;
  }();
  return *l;
}

spdlog::level::level_enum to_spd(Level l) {
  switch (l) {
    case Level::trace:
      return spdlog::level::trace;
    case Level::debug:
      return spdlog::level::debug;
    case Level::info:
      return spdlog::level::info;
    case Level::warn:
      return spdlog::level::warn;
    case Level::error:
      return spdlog::level::err;
    case Level::off:
      return spdlog::level::off;
  }
  return spdlog::level::info;
}

}  // namespace

void set_level(Level level) { logger().set_level(to_spd(level)); }

Level parse_level(std::string_view name) {
  if (name == "trace") return Level::trace;
  if (name == "debug") return Level::debug;
  if (name == "info") return Level::info;
  if (name == "warn") return Level::warn;
  if (name == "error") return Level::error;
  if (name == "off") return Level::off;
  throw Error(
      ErrorCategory::invalid_argument,
      fmt::format("unknown log level '{}' (expected trace, debug, info, warn, error, off)", name));
}

bool enabled(Level level) { return logger().should_log(to_spd(level)); }

void write(Level level, std::string_view message) { logger().log(to_spd(level), message); }

}  // namespace berth::log
