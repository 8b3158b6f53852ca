#include "base/log.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "dvr/error.hpp"

namespace dvr {

namespace {

constexpr int kUnset = -1;
std::atomic<int> g_level{kUnset};

std::mutex& sink_mutex() {
  static std::mutex mu;
  return mu;
}
using Sink = std::function<void(LogLevel, std::string_view)>;
std::shared_ptr<const Sink>& sink_slot() {
  static std::shared_ptr<const Sink> sink;  // null: the default sink
  return sink;
}

void default_sink(LogLevel level, std::string_view message) {
  std::string line = "dvr[" + std::to_string(::getpid()) + "] " + log_level_name(level) + ": ";
  line.append(message);
  line += '\n';
  const char* p = line.data();
  std::size_t left = line.size();
  while (left > 0) {
    ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

// $DVR_LOG, once. Returns the level and, for an invalid value, the warning.
LogLevel level_from_env(std::string* warning) {
  const char* env = std::getenv("DVR_LOG");
  if (!env || !*env) return LogLevel::warn;
  try {
    return parse_log_level(env);
  } catch (const Error& e) {
    *warning = std::string("ignoring DVR_LOG: ") + e.what();
    return LogLevel::warn;
  }
}

// Reads $DVR_LOG into g_level unless a level is set already.
void read_env_level() noexcept {
  std::string warning;
  {
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    if (g_level.load(std::memory_order_relaxed) != kUnset) return;
    g_level.store(static_cast<int>(level_from_env(&warning)), std::memory_order_relaxed);
  }
  if (!warning.empty()) detail::log_write(LogLevel::warn, warning);
}

LogLevel current_level() noexcept {
  int v = g_level.load(std::memory_order_relaxed);
  if (v != kUnset) return static_cast<LogLevel>(v);
  read_env_level();
  return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed));
}

}  // namespace

const char* log_level_name(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::error:
      return "error";
    case LogLevel::warn:
      return "warn";
    case LogLevel::info:
      return "info";
    case LogLevel::debug:
      return "debug";
  }
  return "?";
}

LogLevel parse_log_level(std::string_view text) {
  for (LogLevel l : {LogLevel::error, LogLevel::warn, LogLevel::info, LogLevel::debug})
    if (text == log_level_name(l)) return l;
  throw Error(Errc::invalid_argument,
              "log level '" + detail::escape_text(text) + "' is not one of error, warn, info, debug (set DVR_LOG to one of them)");
}

void set_log_level(LogLevel level) noexcept {
  (void)current_level();  // $DVR_LOG is read (and warned about) once, before it is overridden
  g_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

LogLevel log_level() noexcept { return current_level(); }

void set_log_sink(std::function<void(LogLevel, std::string_view)> sink) {
  auto next = sink ? std::make_shared<const Sink>(std::move(sink)) : nullptr;
  std::lock_guard<std::mutex> lock(sink_mutex());
  sink_slot() = std::move(next);
}

namespace detail {

void reread_log_env() noexcept {
  g_level.store(kUnset, std::memory_order_relaxed);
  read_env_level();
}

bool log_enabled(LogLevel level) noexcept { return static_cast<int>(level) <= static_cast<int>(current_level()); }

void log_write(LogLevel level, std::string_view message) noexcept {
  try {
    std::shared_ptr<const Sink> sink;
    {
      std::lock_guard<std::mutex> lock(sink_mutex());
      sink = sink_slot();
    }
    const std::string line = escape_text(message);
    if (sink)
      (*sink)(level, line);
    else
      default_sink(level, line);
  } catch (...) {
    // Logging never fails an operation.
  }
}

std::string escape_text(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    switch (c) {
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\\':
        out += "\\\\";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          static const char hex[] = "0123456789abcdef";
          out += "\\x";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

}  // namespace detail
}  // namespace dvr
