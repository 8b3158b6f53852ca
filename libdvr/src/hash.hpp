// Chunk hashing: XXH3-128 (content address of a chunk) and XXH3-64 (manifest
// checksums), from Debian's libxxhash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dvr::detail {

struct Hash128 {
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  bool operator==(const Hash128&) const = default;
};

struct Hash128Hasher {
  std::size_t operator()(const Hash128& h) const noexcept { return static_cast<std::size_t>(h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull)); }
};

Hash128 hash128(const void* data, std::size_t len) noexcept;
std::uint64_t hash64(const void* data, std::size_t len) noexcept;

/// True when `h` is the hash of `len` zero bytes (the all-zero chunk, never stored).
bool is_zero_chunk(const Hash128& h, std::size_t len);

std::string to_hex(const Hash128& h);

}  // namespace dvr::detail
