#include "hash.hpp"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace dvr::detail {

Hash128 hash128_avx2(const void* data, std::size_t len) noexcept;  // hash_avx2.cpp

namespace {
Hash128 hash128_baseline(const void* data, std::size_t len) noexcept {
  XXH128_hash_t h = XXH3_128bits(data, len);
  return {h.low64, h.high64};
}
// Debian builds libxxhash for baseline x86-64 (SSE2, ~6 GB/s here); the AVX2
// code path of the same header hashes ~3x faster. Picked once, at load time.
using HashFn = Hash128 (*)(const void*, std::size_t) noexcept;
HashFn pick_hash() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) return hash128_avx2;
#endif
  return hash128_baseline;
}
const HashFn hash_impl = pick_hash();
}  // namespace

Hash128 hash128(const void* data, std::size_t len) noexcept { return hash_impl(data, len); }

std::uint64_t hash64(const void* data, std::size_t len) noexcept { return XXH3_64bits(data, len); }

bool is_zero_chunk(const Hash128& h, std::size_t len) {
  // Chunks have few distinct lengths (the chunk size and region tails), so the
  // zero hashes are computed once per length.
  static std::mutex mu;
  static std::unordered_map<std::size_t, Hash128> cache;
  Hash128 zero;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(len);
    if (it != cache.end()) return it->second == h;
  }
  std::vector<unsigned char> zeros(len, 0);
  zero = hash128(zeros.data(), len);
  std::lock_guard<std::mutex> lock(mu);
  cache.emplace(len, zero);
  return zero == h;
}

std::string to_hex(const Hash128& h) {
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(h.hi),
                static_cast<unsigned long long>(h.lo));
  return buf;
}

}  // namespace dvr::detail
