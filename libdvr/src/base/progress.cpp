#include "base/progress.hpp"

#include <algorithm>
#include <utility>

namespace dvr::detail {

ProgressMeter::ProgressMeter(const Progress& callback, std::uint64_t total)
    : callback_(callback ? &callback : nullptr), owner_(std::this_thread::get_id()), total_(total),
      next_(std::chrono::steady_clock::now() + kInterval) {}

void ProgressMeter::add(std::uint64_t bytes) {
  if (!callback_) return;
  done_.fetch_add(bytes, std::memory_order_relaxed);
  if (std::this_thread::get_id() == owner_) poll();
}

void ProgressMeter::advance_to(std::uint64_t done) noexcept {
  std::uint64_t was = done_.load(std::memory_order_relaxed);
  while (was < done && !done_.compare_exchange_weak(was, done, std::memory_order_relaxed)) {
  }
}

void ProgressMeter::grow_total(std::uint64_t total) noexcept {
  std::uint64_t was = total_.load(std::memory_order_relaxed);
  while (was < total && !total_.compare_exchange_weak(was, total, std::memory_order_relaxed)) {
  }
}

void ProgressMeter::call(std::uint64_t done, std::uint64_t total) {
  if (stopped()) return;
  try {
    (*callback_)(done, total);
  } catch (...) {
    stopped_.store(!defer_, std::memory_order_relaxed);
    if (!defer_) {
      finished_ = true;  // never called again
      throw;
    }
    deferred_ = std::current_exception();
    finished_ = true;
  }
}

void ProgressMeter::poll() {
  if (!callback_ || finished_) return;
  auto now = std::chrono::steady_clock::now();
  if (now < next_) return;
  const std::uint64_t total = total_.load(std::memory_order_relaxed);
  std::uint64_t done = done_.load(std::memory_order_relaxed);
  // All done is the final call's to say (once), and estimates may be
  // exceeded (a chunk stored twice).
  if (total && done >= total) return;
  if (done <= reported_) return;
  reported_ = done;
  next_ = now + kInterval;
  call(done, total);
}

void ProgressMeter::finish() {
  if (callback_ && !finished_) {
    const std::uint64_t total = std::max({total_.load(std::memory_order_relaxed), done_.load(std::memory_order_relaxed), reported_});
    finished_ = true;
    reported_ = total;
    call(total, total);
  }
  if (deferred_) std::rethrow_exception(std::exchange(deferred_, nullptr));
}

}  // namespace dvr::detail
