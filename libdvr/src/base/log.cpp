#include "base/log.hpp"

#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

}  // namespace detail

namespace {

// The length of the well-formed UTF-8 sequence at s[k] (RFC 3629: no
// overlong forms, no surrogates, nothing above U+10FFFF), or 0; its code
// point in *cp.
std::size_t utf8_sequence(std::string_view s, std::size_t k, char32_t* cp) {
  auto byte = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = byte(k);
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xbf;
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (k + n > s.size()) return 0;
  if (byte(k + 1) < lo || byte(k + 1) > hi) return 0;
  for (std::size_t i = 2; i < n; ++i)
    if (byte(k + i) < 0x80 || byte(k + i) > 0xbf) return 0;
  char32_t v = c & (n == 2 ? 0x1f : n == 3 ? 0x0f : 0x07);
  for (std::size_t i = 1; i < n; ++i)
    v = v << 6 | (byte(k + i) & 0x3f);
  *cp = v;
  return n;
}

// Code points above U+009F that escape_text() escapes: they reorder or break
// lines on a terminal.
bool invisible_control(char32_t cp) {
  return cp == 0x2028 || cp == 0x2029 || cp == 0x200e || cp == 0x200f || (cp >= 0x202a && cp <= 0x202e) || (cp >= 0x2066 && cp <= 0x2069);
}

}  // namespace

// Walks `text` as UTF-8 (utf8_sequence): each byte that is not part of a
// well-formed sequence becomes \xNN; each sequence goes to
// keep(out, code point, its bytes). The one loop of utf8_safe and escape_text.
namespace {
constexpr char kHex[] = "0123456789abcdef";

template <class Keep>
std::string walk_utf8(std::string_view text, Keep keep) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t k = 0; k < text.size();) {
    char32_t cp = 0;
    const std::size_t n = utf8_sequence(text, k, &cp);
    if (n == 0) {  // not UTF-8: the byte itself
      const unsigned char c = static_cast<unsigned char>(text[k]);
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
      ++k;
      continue;
    }
    keep(out, cp, text.substr(k, n));
    k += n;
  }
  return out;
}
}  // namespace

std::string shell_word(std::string_view text) {
  bool plain = !text.empty();
  for (unsigned char c : text)
    plain = plain && (std::isalnum(c) || (c != 0 && std::strchr("/._-+:@%,=", c) != nullptr));
  if (plain) return std::string(text);
  std::string out = "'";
  for (char c : text)
    out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string utf8_safe(std::string_view text) {
  return walk_utf8(text, [](std::string& out, char32_t, std::string_view seq) { out.append(seq); });
}

std::string escape_text(std::string_view text) {
  return walk_utf8(text, [](std::string& out, char32_t cp, std::string_view seq) {
    if (cp == '\\') {
      out += "\\\\";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp < 0x20 || cp == 0x7f) {
      out += "\\x";
      out += kHex[cp >> 4];
      out += kHex[cp & 15];
    } else if ((cp >= 0x80 && cp < 0xa0) || invisible_control(cp)) {
      out += "\\u";
      for (int shift = 12; shift >= 0; shift -= 4)
        out += kHex[(cp >> shift) & 15];
    } else {
      out.append(seq);
    }
  });
}

}  // namespace dvr
