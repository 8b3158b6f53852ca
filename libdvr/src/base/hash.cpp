#include "base/hash.hpp"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace dvr::detail {

Hash128 hash128_avx2(const void* data, std::size_t len) noexcept;  // hash_avx2.cpp
std::uint64_t hash64_avx2(const void* data, std::size_t len) noexcept;

namespace {
Hash128 hash128_baseline(const void* data, std::size_t len) noexcept {
  XXH128_hash_t h = XXH3_128bits(data, len);
  return {h.low64, h.high64};
}
// Debian builds libxxhash for baseline x86-64 (SSE2, ~6 GB/s here); the AVX2
// code path of the same header hashes ~3x faster. Picked once, at load time.
std::uint64_t hash64_baseline(const void* data, std::size_t len) noexcept { return XXH3_64bits(data, len); }
using HashFn = Hash128 (*)(const void*, std::size_t) noexcept;
using Hash64Fn = std::uint64_t (*)(const void*, std::size_t) noexcept;
bool have_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}
const HashFn hash_impl = have_avx2() ? hash128_avx2 : hash128_baseline;
const Hash64Fn page_hash_impl = have_avx2() ? hash64_avx2 : hash64_baseline;

// Computes f(len) once per distinct length (chunks and pages have few).
template <class T, class F>
T cached_by_length(std::size_t len, F f) {
  static std::mutex mu;
  static std::unordered_map<std::size_t, T> cache;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(len);
    if (it != cache.end()) return it->second;
  }
  T value = f(len);
  std::lock_guard<std::mutex> lock(mu);
  cache.emplace(len, value);
  return value;
}
}  // namespace

Hash128 hash128(const void* data, std::size_t len) noexcept { return hash_impl(data, len); }

std::uint64_t page_hash(const void* data, std::size_t len) noexcept { return page_hash_impl(data, len); }

void hash_pages(const char* data, std::size_t len, std::uint64_t* out) noexcept {
  for (std::size_t off = 0; off < len; off += kPageSize)
    *out++ = page_hash_impl(data + off, std::min<std::size_t>(kPageSize, len - off));
}

Hash128 tree_hash(const std::uint64_t* page_hashes, std::size_t count) noexcept { return hash_impl(page_hashes, count * sizeof(std::uint64_t)); }

std::uint64_t zero_page_hash(std::size_t len) {
  // Nearly always a whole page: computed once, no lock.
  static const std::uint64_t whole = [] {
    std::vector<char> zeros(kPageSize, 0);
    return page_hash(zeros.data(), zeros.size());
  }();
  if (len == kPageSize) return whole;
  return cached_by_length<std::uint64_t>(len, [](std::size_t n) {
    std::vector<char> zeros(n, 0);
    return page_hash(zeros.data(), n);
  });
}

bool is_zero_tree(const Hash128& h, std::size_t len) {
  return cached_by_length<Hash128>(len, [](std::size_t n) {
           std::vector<char> zeros(n, 0);
           std::vector<std::uint64_t> pages(pages_in(n));
           hash_pages(zeros.data(), n, pages.data());
           return tree_hash(pages.data(), pages.size());
         }) == h;
}

std::uint64_t hash64(const void* data, std::size_t len) noexcept { return page_hash_impl(data, len); }

bool is_zero_chunk(const Hash128& h, std::size_t len) {
  return cached_by_length<Hash128>(len, [](std::size_t n) {
           std::vector<char> zeros(n, 0);
           return hash128(zeros.data(), n);
         }) == h;
}

std::string to_hex(const Hash128& h) {
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(h.hi), static_cast<unsigned long long>(h.lo));
  return buf;
}

std::uint64_t hash64_of_two(const void* a, std::size_t a_len, const void* b, std::size_t b_len) noexcept {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, a, a_len);
  XXH3_64bits_update(&state, b, b_len);
  return XXH3_64bits_digest(&state);
}

}  // namespace dvr::detail
