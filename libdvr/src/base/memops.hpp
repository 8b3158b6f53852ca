// Bulk memory operations for restore and the work split across cores.
#pragma once

#include <cstddef>
#include <functional>

namespace dvr::detail {

/// Copies with non-temporal (streaming) stores, so restoring gigabytes does not
/// evict the application's working set from the caches.
void copy_nt(void* dst, const void* src, std::size_t len) noexcept;

/// Fills with zeros using non-temporal stores.
void zero_nt(void* dst, std::size_t len) noexcept;

/// True when all `len` bytes are zero.
bool all_zero(const void* data, std::size_t len) noexcept;

/// While it lives, this thread's memory accesses are not checked by
/// ThreadSanitizer (a no-op in other builds): for reading memory that the
/// program may be writing at the same time by design — a background snapshot,
/// where the kernel's write protection orders the writes after the reads they
/// must follow, which ThreadSanitizer cannot see.
class RacyReads {
 public:
  RacyReads() noexcept;
  ~RacyReads();
  RacyReads(const RacyReads&) = delete;
  RacyReads& operator=(const RacyReads&) = delete;
};

class ProgressMeter;

/// Runs fn(begin, end) over [0, count) split into contiguous slices, on at
/// most `threads` threads (a store's StoreImpl::threads), fewer when
/// `work_bytes` is too small to pay for them. Exceptions from fn are rethrown
/// (the first one). With a `progress` meter, the calling thread only waits
/// and reports progress (fn runs on `threads` other threads, or on the
/// calling thread when one is enough); when its callback throws, the meter
/// is stopped (fn should return early when progress->stopped()) and the
/// callback's exception is rethrown once every slice has returned.
void parallel_for(unsigned threads, std::size_t count, std::size_t work_bytes, const std::function<void(std::size_t, std::size_t)>& fn,
                  ProgressMeter* progress = nullptr);

/// The number of CPUs this thread may run on (sched_getaffinity), at least 1.
unsigned affinity_cpus() noexcept;

}  // namespace dvr::detail
