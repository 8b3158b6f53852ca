// Progress bars and JSON progress lines (progress.hpp).
#include "progress.hpp"

#include <unistd.h>

#include <cstdio>

#include "cli_util.hpp"
#include "dvr/error.hpp"
#include "output.hpp"

namespace dvr::cli {

ProgressMode parse_progress_mode(const std::string& text) {
  if (text == "auto") return ProgressMode::automatic;
  if (text == "bar") return ProgressMode::bar;
  if (text == "json") return ProgressMode::json;
  if (text == "none") return ProgressMode::none;
  throw Error(Errc::invalid_argument, "--progress must be auto, bar, json or none, not '" + text + "'");
}

ProgressReporter::ProgressReporter(std::string op, ProgressMode mode)
    : op_(std::move(op)), mode_(mode), start_(std::chrono::steady_clock::now()) {
  if (mode_ == ProgressMode::automatic) mode_ = ::isatty(STDERR_FILENO) ? ProgressMode::bar : ProgressMode::none;
}

ProgressReporter::~ProgressReporter() { finish(); }

Progress ProgressReporter::callback() {
  if (mode_ == ProgressMode::none) return {};
  return [this](std::uint64_t done, std::uint64_t total) { update(done, total); };
}

void ProgressReporter::update(std::uint64_t done, std::uint64_t total) {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_ || mode_ == ProgressMode::none) return;
  // Updates can come from several threads: never show a step back.
  if (any_ && total == last_total_ && done < last_done_) return;
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  // total 0: not known yet (a stream from a pipe, CRIU deciding what to
  // dump): bytes and rate only, until a final call with done == total.
  const bool known = total > 0;
  const bool last = known && done >= total;
  if (any_ && !last && t - last_ < 0.1) return;
  if (any_ && last && done == last_done_ && total == last_total_) return;  // the end, once
  any_ = true;
  last_ = t;
  last_done_ = done;
  last_total_ = total;
  const double rate = t > 0 ? static_cast<double>(done) / t : 0;
  const double eta = rate > 0 && total > done ? static_cast<double>(total - done) / rate : 0;
  if (mode_ == ProgressMode::json) {
    json line = document();
    line["op"] = op_;
    line["done"] = done;
    line["total"] = total;
    line["rate"] = rate;
    line["eta_s"] = eta;
    std::fprintf(stderr, "%s\n", line.dump().c_str());
    std::fflush(stderr);
    return;
  }
  if (last) {  // the end: the bar goes (what the program prints next starts clean)
    if (drawn_) std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
    drawn_ = false;
    finished_ = true;
    return;
  }
  if (!known) {
    std::fprintf(stderr, "\r\033[K%s  %s  %s/s", op_.c_str(), format_bytes(static_cast<double>(done)).c_str(), format_bytes(rate).c_str());
    std::fflush(stderr);
    drawn_ = true;
    return;
  }
  const double frac = static_cast<double>(done) / static_cast<double>(total);
  constexpr int kWidth = 24;
  const int fill = static_cast<int>(frac * kWidth);
  std::string bar(static_cast<std::size_t>(fill), '#');
  bar.resize(kWidth, '-');
  std::fprintf(stderr, "\r\033[K%s [%s] %3.0f%%  %s / %s  %s/s  ETA %s", op_.c_str(), bar.c_str(), 100.0 * frac,
               format_bytes(static_cast<double>(done)).c_str(), format_bytes(static_cast<double>(total)).c_str(), format_bytes(rate).c_str(),
               format_seconds(eta).c_str());
  std::fflush(stderr);
  drawn_ = true;
}

void ProgressReporter::finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  if (drawn_) {
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
  }
}

}  // namespace dvr::cli
