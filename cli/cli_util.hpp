// Small helpers shared by the dvr command and dvr-bench: sizes, times, JSON.
#pragma once

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace dvr::cli {

/// "1G", "512M", "64K", "4096" → bytes (binary units). Throws invalid_argument.
inline std::uint64_t parse_size(const std::string& text) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (...) {
    used = 0;
  }
  // Decimal digits only: no "inf", "nan", hex or leading blanks, which stod takes.
  const bool decimal = !text.empty() && (std::isdigit(static_cast<unsigned char>(text[0])) || text[0] == '.') &&
                       text.substr(0, used).find_first_of("xX") == std::string::npos;
  if (used == 0 || !decimal || !std::isfinite(v)) throw std::invalid_argument("size '" + text + "' is not a size like 512M or 1G");
  if (v <= 0) throw std::invalid_argument("size '" + text + "' is not more than 0 (give a size like 512M or 1G)");
  std::string unit = text.substr(used);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  if (unit.size() > 1 && (unit.back() == 'i')) unit.pop_back();
  double mult = 1;
  if (unit.empty())
    mult = 1;
  else if (unit == "K" || unit == "k")
    mult = 1024.0;
  else if (unit == "M" || unit == "m")
    mult = 1024.0 * 1024;
  else if (unit == "G" || unit == "g")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "t")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else
    throw std::invalid_argument("size '" + text + "' has an unknown unit (use K, M, G or T)");
  if (v * mult > 1125899906842624.0 * 1024)  // 1 EiB: more than any machine, and within 64 bits
    throw std::invalid_argument("size '" + text + "' is too large");
  return static_cast<std::uint64_t>(v * mult);
}

/// "10m", "2s", "1h30m", "1d", "90" (seconds) → seconds. Throws invalid_argument.
inline double parse_duration(const std::string& text) {
  double total = 0;
  std::size_t k = 0;
  bool any = false;
  while (k < text.size()) {
    std::size_t used = 0;
    double v = 0;
    try {
      v = std::stod(text.substr(k), &used);
    } catch (...) {
      used = 0;
    }
    const bool decimal = std::isdigit(static_cast<unsigned char>(text[k])) || text[k] == '.';
    if (used == 0 || !decimal || !std::isfinite(v) || v < 0 || text.substr(k, used).find_first_of("xX") != std::string::npos) break;
    k += used;
    double mult = 1;
    if (k < text.size()) {
      char u = text[k++];
      mult = u == 's' ? 1 : u == 'm' ? 60 : u == 'h' ? 3600 : u == 'd' ? 86400 : u == 'w' ? 604800 : -1;
      if (mult < 0) break;
    } else if (any) {
      break;  // "1h30": a number without a unit after the first part
    }
    total += v * mult;
    any = true;
    if (total > 100.0 * 366 * 86400) throw std::invalid_argument("duration '" + text + "' is longer than a century");
    if (k == text.size()) return total;
  }
  throw std::invalid_argument("duration '" + text + "' is not a duration like 30s, 10m, 2h or 1h30m");
}

inline std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

inline std::string format_seconds(double s) {
  char buf[32];
  if (s < 1e-3)
    std::snprintf(buf, sizeof buf, "%.0f µs", s * 1e6);
  else if (s < 1)
    std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.2f s", s);
  return buf;
}

inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          out += b;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

/// A number as JSON: 6 significant digits; null for infinity and NaN,
/// which JSON cannot spell ("inf" would make the whole line unreadable).
inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

/// Seconds since an arbitrary start, monotonic.
inline double seconds_now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace dvr::cli
