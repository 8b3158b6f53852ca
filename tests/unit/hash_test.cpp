// Unit tests of chunk hashing (libdvr/src/hash.hpp): the CPU-dispatched
// XXH3-128 must give exactly the reference results, since stored chunks are
// addressed by it across machines.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "base/hash.hpp"
#include "test_support.hpp"

using dvr::detail::Hash128;

TEST_CASE("hash: hash128 equals reference XXH3-128 for every length and alignment", "[hash]") {
  auto data = dvrtest::random_bytes(300000, 42);
  std::vector<std::size_t> lengths;
  for (std::size_t n = 0; n <= 600; ++n)
    lengths.push_back(n);
  for (std::size_t n : {1023u, 1024u, 1025u, 4095u, 4096u, 4097u, 65535u, 65536u, 65537u, 250000u})
    lengths.push_back(n);
  for (std::size_t n : lengths) {
    for (std::size_t off : {0u, 1u, 7u}) {
      XXH128_hash_t ref = XXH3_128bits(data.data() + off, n);
      Hash128 got = dvr::detail::hash128(data.data() + off, n);
      INFO("length " << n << " offset " << off);
      CHECK(got.lo == ref.low64);
      CHECK(got.hi == ref.high64);
    }
    CHECK(dvr::detail::hash64(data.data(), n) == XXH3_64bits(data.data(), n));
  }
}

TEST_CASE("hash: is_zero_chunk recognises exactly the all-zero chunk of each length", "[hash]") {
  for (std::size_t n : {1u, 100u, 4096u, 65536u, 65537u}) {
    INFO(n);
    std::vector<unsigned char> z(n, 0);
    CHECK(dvr::detail::is_zero_chunk(dvr::detail::hash128(z.data(), n), n));
    CHECK_FALSE(dvr::detail::is_zero_chunk(dvr::detail::hash128(z.data(), n), n + 1));
    z[n / 2] = 1;
    CHECK_FALSE(dvr::detail::is_zero_chunk(dvr::detail::hash128(z.data(), n), n));
  }
  CHECK(dvr::detail::to_hex(Hash128{1, 2}) == "00000000000000020000000000000001");
}
