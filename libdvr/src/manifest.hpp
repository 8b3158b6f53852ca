// Snapshot manifests: the region table and chunk list of one snapshot.
// Binary layout: docs/format.md, "Manifest files".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "hash.hpp"

namespace dvr::detail {

inline constexpr std::uint32_t kManifestVersion = 2;  // 2 added flags bit 0 and chunks_read
inline constexpr std::uint32_t kManifestTrackedWrites = 1u << 0;  // flags: taken with write-protect tracking

/// Where a chunk's bytes are. pack == 0 marks the all-zero chunk (not stored).
struct ChunkRef {
  Hash128 hash;
  std::uint32_t pack = 0;
  std::uint32_t length = 0;  // logical (= stored) length in bytes
  std::uint64_t offset = 0;  // byte offset in the pack file, page-aligned
  bool is_zero() const { return pack == 0; }
};

struct ManifestRegion {
  std::string name;
  std::uint64_t size = 0;
  bool sdk_owned = false;
  std::uint64_t first_chunk = 0;  // index into Manifest::chunks
  std::uint64_t chunk_count = 0;
};

struct Manifest {
  std::string session;
  std::string name;
  std::string parent;
  std::string label;
  std::int64_t time_ns = 0;
  std::uint32_t chunk_size = 0;
  std::uint64_t stored_bytes = 0;
  std::uint32_t flags = 0;
  std::uint64_t chunks_read = 0;  // chunks hashed to take the snapshot
  std::vector<ManifestRegion> regions;
  std::vector<ChunkRef> chunks;

  std::uint64_t logical_bytes() const;
};

std::string encode_manifest(const Manifest& m);

/// Parses and checks a manifest. `where` names it in errors. Throws corrupt
/// (bad magic, checksum, truncation, inconsistent tables) or unsupported (a
/// newer format version).
Manifest decode_manifest(std::string_view bytes, const std::string& where);

}  // namespace dvr::detail
