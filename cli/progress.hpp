// Progress of long operations on stderr: a bar on a terminal, JSON lines for
// tools, or nothing (dvr --progress=auto|bar|json|none; docs/cli.md).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "dvr/store.hpp"

namespace dvr::cli {

enum class ProgressMode {
  automatic,  // a bar when stderr is a terminal, else nothing
  bar,        // a bar (even when stderr is not a terminal)
  json,       // one JSON line per update: {"schema_version":1,"op":..,"done":..,"total":..,"rate":..,"eta_s":..}
  none,
};

/// "auto", "bar", "json", "none" → the mode. Throws invalid_argument naming --progress.
ProgressMode parse_progress_mode(const std::string& text);

/// Reports one operation (`op`: "verify", "import", ...). Its callback() is a
/// dvr::Progress for the library call; updates are shown at most ten times a
/// second (the first and the last always), and finish() (or the destructor)
/// clears the bar. Safe to call from several threads.
class ProgressReporter {
 public:
  ProgressReporter(std::string op, ProgressMode mode);
  ~ProgressReporter();
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  /// The callback to hand to the library; empty when nothing is shown.
  /// It refers to this reporter, which must outlive the call.
  Progress callback();
  void update(std::uint64_t done, std::uint64_t total);
  /// Clears the bar (a JSON stream gets nothing more). Idempotent.
  void finish();

 private:
  std::string op_;
  ProgressMode mode_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point start_;
  double last_ = -1;
  std::uint64_t last_done_ = 0, last_total_ = 0;
  bool drawn_ = false, finished_ = false, any_ = false;
};

}  // namespace dvr::cli
