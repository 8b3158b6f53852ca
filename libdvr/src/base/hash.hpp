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
/// hash64 of the bytes of `a` followed by those of `b`, which lie apart (a
/// stream record's head and its payload).
std::uint64_t hash64_of_two(const void* a, std::size_t a_len, const void* b, std::size_t b_len) noexcept;

/// Size of the pages that are hashed, tracked and restored one by one.
inline constexpr std::uint64_t kPageSize = 4096;
inline constexpr std::uint32_t pages_in(std::uint64_t len) { return static_cast<std::uint32_t>((len + kPageSize - 1) / kPageSize); }

/// XXH3-64 of one page (or of the short last page of a chunk); AVX2 where the
/// CPU has it.
std::uint64_t page_hash(const void* data, std::size_t len) noexcept;
/// page_hash of every page of `len` bytes at `data`, into out[0 .. pages_in(len)).
void hash_pages(const char* data, std::size_t len, std::uint64_t* out) noexcept;
/// A chunk's content address in format v3: XXH3-128 of its pages' hashes.
Hash128 tree_hash(const std::uint64_t* page_hashes, std::size_t count) noexcept;
/// page_hash of `len` (<= kPageSize) zero bytes.
std::uint64_t zero_page_hash(std::size_t len);
/// True when `h` is tree_hash of a chunk of `len` zero bytes.
bool is_zero_tree(const Hash128& h, std::size_t len);

/// True when `h` is hash128 of `len` zero bytes (format v1/v2: the all-zero
/// chunk, never stored).
bool is_zero_chunk(const Hash128& h, std::size_t len);

std::string to_hex(const Hash128& h);

}  // namespace dvr::detail
