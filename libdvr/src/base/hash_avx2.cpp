// XXH3-128 and XXH3-64 compiled for AVX2 (this file only is built with -mavx2); hash.cpp
// calls it when the CPU has AVX2. Same function, same results, faster code path.
#include "base/hash.hpp"

#if defined(__x86_64__)
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

namespace dvr::detail {
Hash128 hash128_avx2(const void* data, std::size_t len) noexcept {
  XXH128_hash_t h = XXH3_128bits(data, len);
  return {h.low64, h.high64};
}
std::uint64_t hash64_avx2(const void* data, std::size_t len) noexcept { return XXH3_64bits(data, len); }
}  // namespace dvr::detail
#endif
