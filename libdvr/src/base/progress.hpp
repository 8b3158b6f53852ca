// Progress reports of long operations, as dvr/store.hpp's contract for
// dvr::Progress says: on the calling thread, done never decreasing, at most
// about ten calls a second, one final call with done == total.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <thread>

#include "dvr/store.hpp"

namespace dvr::detail {

/// One operation's progress. Work on any thread adds to it (add()); the
/// thread that created it (the caller of the public operation) calls the
/// callback from poll(), from add() when it is that thread, and from
/// finish(). An empty callback makes every call a no-op.
class ProgressMeter {
 public:
  /// Minimum time between two calls of the callback (but the final one).
  static constexpr std::chrono::milliseconds kInterval{100};

  explicit ProgressMeter(const Progress& callback, std::uint64_t total = 0);
  ProgressMeter(const ProgressMeter&) = delete;
  ProgressMeter& operator=(const ProgressMeter&) = delete;

  explicit operator bool() const noexcept { return callback_ != nullptr; }

  /// `bytes` more done (any thread). On the creating thread this may call the
  /// callback, and so throws what it throws (see poll()).
  void add(std::uint64_t bytes);
  /// Done is now at least `done` (any thread; for work counted elsewhere).
  void advance_to(std::uint64_t done) noexcept;
  /// The total grew to `total` (never shrinks; any thread).
  void grow_total(std::uint64_t total) noexcept;

  /// On the creating thread: calls the callback when kInterval has passed
  /// since the last call (or since the start) and done moved. When the
  /// callback throws, it is not called again, stopped() turns true for the
  /// workers, and the exception propagates here, unless defer() was called:
  /// then it is kept for finish().
  void poll();
  /// From here on, an exception of the callback does not stop the work: it
  /// is thrown by finish() instead (a restore writing live memory).
  void defer() noexcept { defer_ = true; }
  /// The final call, with done == total (total raised to done if it was
  /// short; known late), unless the callback threw before. Rethrows a
  /// deferred exception.
  void finish();

  /// True once the callback threw: workers stop early (the operation fails).
  bool stopped() const noexcept { return stopped_.load(std::memory_order_relaxed); }

 private:
  void call(std::uint64_t done, std::uint64_t total);

  const Progress* callback_;
  std::thread::id owner_;
  std::atomic<std::uint64_t> done_{0}, total_{0};
  std::atomic<bool> stopped_{false};
  bool defer_ = false;
  bool finished_ = false;
  std::exception_ptr deferred_;
  std::uint64_t reported_ = 0;  // last done passed to the callback
  std::chrono::steady_clock::time_point next_;
};

}  // namespace dvr::detail
