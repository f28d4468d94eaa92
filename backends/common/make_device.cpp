#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>
#include <vector>

#include "berth/backends/device.h"
#include "berth/core/error.h"
#include "berth/core/strings.h"

namespace berth {
namespace {

// A size with parse_size's syntax (24G, 512M, 1.5GiB, bytes), named as a setting of `spec`.
size_t parse_capacity(std::string_view text, std::string_view spec) {
  return parse_size(text, fmt::format("device '{}': size", spec));
}

// A positive finite number for a rate setting of a unified spec.
double parse_rate(std::string_view key, std::string_view text, std::string_view spec) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || !(v >= 1e-3 && v <= 1e6))
    throw Error(
        ErrorCategory::invalid_argument,
        fmt::format("device '{}': {}={} is not a number from 0.001 to 1000000", spec, key, text));
  return v;
}

}  // namespace

SimDeviceOptions parse_unified_sim(std::string_view text, std::string_view spec) {
  SimDeviceOptions o;
  o.unified = true;
  size_t comma = text.find(',');
  o.capacity_bytes = parse_capacity(text.substr(0, comma), spec);
  std::vector<std::string_view> seen;  // keys given so far: each at most once
  while (comma != std::string_view::npos) {
    text = text.substr(comma + 1);
    comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    const size_t eq = item.find('=');
    const std::string_view key = item.substr(0, eq);
    if (eq == std::string_view::npos)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("device '{}': '{}' is not KEY=VALUE (keys: available, free, "
                              "gpu_gbps, cpu_gbps, gpu_tflops, cpu_tflops, pageable)",
                              spec, item));
    const std::string_view value = item.substr(eq + 1);
    if (std::find(seen.begin(), seen.end(), key) != seen.end())
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("device '{}': '{}' is given twice", spec, key));
    seen.push_back(key);
    if (key == "available") {
      o.os_available_bytes = parse_capacity(value, spec);
      if (o.os_available_bytes == 0)
        throw Error(ErrorCategory::invalid_argument,
                    fmt::format("device '{}': available={} must be more than 0 (leave the key out "
                                "for the whole board)",
                                spec, value));
    } else if (key == "free") {
      o.reported_free_bytes = parse_capacity(value, spec);
      if (o.reported_free_bytes == 0)
        throw Error(ErrorCategory::invalid_argument,
                    fmt::format("device '{}': free={} must be more than 0", spec, value));
    } else if (key == "gpu_gbps")
      o.gpu_gbps = parse_rate(key, value, spec);
    else if (key == "cpu_gbps")
      o.cpu_gbps = parse_rate(key, value, spec);
    else if (key == "gpu_tflops")
      o.gpu_tflops = parse_rate(key, value, spec);
    else if (key == "cpu_tflops")
      o.cpu_tflops = parse_rate(key, value, spec);
    else if (key == "pageable" && (value == "0" || value == "1"))
      o.pageable_access = value == "1";
    else if (key == "pageable")
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("device '{}': pageable={} is not 0 or 1", spec, value));
    else
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("device '{}': unknown setting '{}' (keys: available, free, "
                              "gpu_gbps, cpu_gbps, gpu_tflops, cpu_tflops, pageable)",
                              spec, key));
  }
  if (o.capacity_bytes == 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("device '{}': the board's memory must be more than 0", spec));
  if (o.reported_free_bytes > o.capacity_bytes)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("device '{}': free={} bytes is more than the board's {} bytes", spec,
                            o.reported_free_bytes, o.capacity_bytes));
  if (o.os_available_bytes > o.capacity_bytes)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("device '{}': available={} bytes is more than the board's {} bytes",
                            spec, o.os_available_bytes, o.capacity_bytes));
  if (o.os_available_bytes == 0) o.os_available_bytes = o.capacity_bytes;
  return o;
}

std::unique_ptr<Device> make_device(std::string_view spec) {
  if (spec.substr(0, 4) == "sim:") return make_sim_device(parse_capacity(spec.substr(4), spec));
  if (spec.substr(0, 8) == "unified:")
    return make_sim_device(parse_unified_sim(spec.substr(8), spec));
  if (spec.substr(0, 5) == "cuda:") {
    int index = -1;
    const std::string_view n = spec.substr(5);
    const auto [end, ec] = std::from_chars(n.data(), n.data() + n.size(), index);
    if (ec != std::errc() || end != n.data() + n.size() || index < 0)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("device '{}': expected cuda:N with N a device index", spec));
    return make_cuda_device(index);
  }
  throw Error(ErrorCategory::invalid_argument,
              fmt::format("device '{}': expected sim:SIZE, unified:SIZE or cuda:N", spec));
}

}  // namespace berth
