#include "base/memops.hpp"

#include "base/progress.hpp"

#include <sched.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace dvr::detail {

void copy_nt(void* dst, const void* src, std::size_t len) noexcept {
#if defined(__x86_64__)
  auto d = static_cast<char*>(dst);
  auto s = static_cast<const char*>(src);
  // Align the destination to 16 bytes with a normal copy, stream the middle.
  std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(d) & 15)) & 15;
  if (head > len) head = len;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  len -= head;
  std::size_t blocks = len / 64;
  for (std::size_t i = 0; i < blocks; ++i) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
    d += 64;
    s += 64;
  }
  std::memcpy(d, s, len - blocks * 64);
  _mm_sfence();
#else
  std::memcpy(dst, src, len);
#endif
}

void zero_nt(void* dst, std::size_t len) noexcept {
#if defined(__x86_64__)
  auto d = static_cast<char*>(dst);
  std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(d) & 15)) & 15;
  if (head > len) head = len;
  std::memset(d, 0, head);
  d += head;
  len -= head;
  const __m128i z = _mm_setzero_si128();
  std::size_t blocks = len / 64;
  for (std::size_t i = 0; i < blocks; ++i) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), z);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), z);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), z);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), z);
    d += 64;
  }
  std::memset(d, 0, len - blocks * 64);
  _mm_sfence();
#else
  std::memset(dst, 0, len);
#endif
}

bool all_zero(const void* data, std::size_t len) noexcept {
  auto p = static_cast<const unsigned char*>(data);
  // Compare the buffer with itself shifted by one: all zero iff the first byte
  // is zero and every byte equals its successor.
  return len == 0 || (p[0] == 0 && std::memcmp(p, p + 1, len - 1) == 0);
}

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
RacyReads::RacyReads() noexcept { __tsan_ignore_thread_begin(); }
RacyReads::~RacyReads() { __tsan_ignore_thread_end(); }
#else
RacyReads::RacyReads() noexcept = default;
RacyReads::~RacyReads() = default;
#endif

unsigned affinity_cpus() noexcept {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return std::max(1u, std::thread::hardware_concurrency());
  return static_cast<unsigned>(std::max(1, CPU_COUNT(&set)));
}

void parallel_for(unsigned max_threads, std::size_t count, std::size_t work_bytes, const std::function<void(std::size_t, std::size_t)>& fn,
                  ProgressMeter* progress) {
  constexpr std::size_t kMinBytesPerThread = 8u << 20;
  std::size_t threads = std::max(1u, max_threads);
  threads = std::min({threads, count, std::max<std::size_t>(1, work_bytes / kMinBytesPerThread)});
  if (progress && !*progress) progress = nullptr;
  if (threads <= 1) {
    if (count) fn(0, count);  // progress->add() on this thread reports as it goes
    return;
  }
  std::exception_ptr first_error;
  std::mutex mu;
  std::condition_variable all_done;
  std::size_t running = 0;
  auto run = [&](std::size_t b, std::size_t e) {
    try {
      fn(b, e);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!first_error) first_error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu);
    if (--running == 0) all_done.notify_all();
  };
  std::vector<std::thread> pool;
  std::size_t per = count / threads, extra = count % threads, begin = 0;
  // Without progress, the calling thread takes the first slice itself.
  const std::size_t first_worker = progress ? 0 : 1;
  std::size_t first_end = per + (extra > 0 ? 1 : 0);
  begin = progress ? 0 : first_end;
  running = threads - first_worker;
  for (std::size_t t = first_worker; t < threads; ++t) {
    std::size_t n = per + (t < extra ? 1 : 0);
    pool.emplace_back(run, begin, begin + n);
    begin += n;
  }
  std::exception_ptr progress_error;
  if (!progress) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ++running;
    }
    run(0, first_end);
  } else {
    std::unique_lock<std::mutex> lock(mu);
    while (running > 0) {
      all_done.wait_for(lock, ProgressMeter::kInterval);
      if (running == 0 || progress_error) continue;
      lock.unlock();
      try {
        progress->poll();
      } catch (...) {
        progress_error = std::current_exception();
      }
      lock.lock();
    }
  }
  for (auto& th : pool)
    th.join();
  if (progress_error) std::rethrow_exception(progress_error);
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace dvr::detail
