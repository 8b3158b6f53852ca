// The library's side of dvr/log.hpp: cheap checks, then formatting.
#pragma once

#include <string>
#include <string_view>

#include "dvr/log.hpp"

namespace dvr::detail {

/// Whether a message of `level` would be logged (one relaxed atomic load once
/// the level is known): check it before building the message.
bool log_enabled(LogLevel level) noexcept;

/// Logs `message` (escaped here) at `level` to the sink; never throws.
void log_write(LogLevel level, std::string_view message) noexcept;

/// (escape_text, the one escaper of text output, is public: dvr/log.hpp.)
using dvr::escape_text;

/// Forgets the level set and reads $DVR_LOG again, as on first use (for the
/// tests of its parsing; the library reads it once).
void reread_log_env() noexcept;

}  // namespace dvr::detail

/// Logs the std::string expression `message` at `level` (a dvr::LogLevel
/// enumerator name); `message` is not evaluated unless it would be logged.
#define DVR_LOG(level, message)                                                     \
  do {                                                                              \
    if (::dvr::detail::log_enabled(::dvr::LogLevel::level))                         \
      ::dvr::detail::log_write(::dvr::LogLevel::level, std::string_view(message));  \
  } while (0)
