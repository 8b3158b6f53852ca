// Unit tests of the manifest codec (libdvr/src/manifest.hpp): round trip,
// truncation, bit flips, version handling and tables that lie.
#include <cstring>

#include "base/hash.hpp"
#include "format/manifest.hpp"
#include "test_support.hpp"

using dvr::Errc;
using dvr::detail::ChunkRef;
using dvr::detail::decode_manifest;
using dvr::detail::encode_manifest;
using dvr::detail::Manifest;
using dvrtest::catch_error;

namespace {

constexpr std::uint32_t kCs = 4096;

// Two regions (one of 2 full chunks + a 5-byte tail, one of 100 bytes), one
// zero chunk, labels with odd characters.
Manifest sample() {
  Manifest m;
  m.session = "sess";
  m.name = "snap-1";
  m.parent = "snap-0";
  m.label = std::string("label with spaces, / and a NUL \0 inside", 39);
  m.time_ns = 1'700'000'000'123'456'789;
  m.chunk_size = kCs;
  m.stored_bytes = 3 * kCs;
  m.regions.push_back({"weights", 2 * kCs + 5, false, 0, 3});
  m.regions.push_back({"arena", 100, true, 3, 1});
  for (std::uint32_t i = 0; i < 4; ++i) {
    ChunkRef c;
    c.hash = {0x1111111111111111ull * (i + 1), 0xABCDEF0000000000ull + i};
    c.pack = i == 1 ? 0 : 7;  // chunk 1 is the all-zero chunk
    c.length = i < 2 ? kCs : (i == 2 ? 5 : 100);
    c.offset = i == 1 ? 0 : 4096ull * (i + 1);
    m.chunks.push_back(c);
    m.page_hashes.push_back(0x5151515151515151ull * (i + 3));  // one page per chunk (kCs is a page)
  }
  // Page 0 of chunk 3 is stored apart; page 0 of chunk 2 is all zero.
  m.overlays.push_back({2, 0, 0, 0});
  m.overlays.push_back({3, 0, 7, 4096ull * 9});
  return m;
}

// Recomputes the checksum after a deliberate edit, so only the check under test can object.
std::string reseal(std::string bytes) {
  std::uint64_t body;
  std::memcpy(&body, bytes.data() + 16, 8);
  std::uint64_t sum = dvr::detail::hash64(bytes.data(), body);
  std::memcpy(bytes.data() + body, &sum, 8);
  return bytes;
}

template <class T>
void poke(std::string& bytes, std::size_t at, T v) {
  std::memcpy(bytes.data() + at, &v, sizeof v);
}

}  // namespace

TEST_CASE("manifest: encode/decode round trip keeps every field", "[manifest]") {
  Manifest m = sample();
  std::string bytes = encode_manifest(m);
  Manifest d = decode_manifest(bytes, "sess/snap-1");
  CHECK(d.session == m.session);
  CHECK(d.name == m.name);
  CHECK(d.parent == m.parent);
  CHECK(d.label == m.label);
  CHECK(d.label.size() == 39);
  CHECK(d.time_ns == m.time_ns);
  CHECK(d.chunk_size == m.chunk_size);
  CHECK(d.stored_bytes == m.stored_bytes);
  CHECK(d.logical_bytes() == 2 * kCs + 5 + 100);
  REQUIRE(d.regions.size() == 2);
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(d.regions[i].name == m.regions[i].name);
    CHECK(d.regions[i].size == m.regions[i].size);
    CHECK(d.regions[i].sdk_owned == m.regions[i].sdk_owned);
    CHECK(d.regions[i].first_chunk == m.regions[i].first_chunk);
    CHECK(d.regions[i].chunk_count == m.regions[i].chunk_count);
  }
  REQUIRE(d.chunks.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    INFO("chunk " << i);
    CHECK(d.chunks[i].hash == m.chunks[i].hash);
    CHECK(d.chunks[i].pack == m.chunks[i].pack);
    CHECK(d.chunks[i].length == m.chunks[i].length);
    CHECK(d.chunks[i].offset == m.chunks[i].offset);
  }
  CHECK(d.chunks[1].is_zero());
  CHECK_FALSE(d.chunks[0].is_zero());
  CHECK(d.paged);
  CHECK(d.page_hashes.empty());  // not in the file: hydrated from page hash files
  CHECK_FALSE(d.hydrated());
  REQUIRE(d.overlays.size() == 2);
  CHECK(d.overlays[1].chunk == 3);
  CHECK(d.overlays[1].page == 0);
  CHECK(d.overlays[1].pack == 7);
  CHECK(d.overlays[1].offset == 4096ull * 9);
  CHECK(d.has_overlays(2));
  CHECK(d.has_overlays(3));
  CHECK_FALSE(d.has_overlays(0));
  CHECK(d.pages_of(0) == 1);
  CHECK(d.zero_chunk(1));
  CHECK_FALSE(d.zero_chunk(0));
  CHECK(d.checksum == dvr::detail::manifest_checksum(bytes));
  // Encoding is deterministic: the decoded manifest encodes to the same bytes.
  CHECK(encode_manifest(d) == bytes);
}

TEST_CASE("manifest: an empty-string and zero-region manifest round-trips", "[manifest]") {
  Manifest m;
  m.session = "s";
  m.name = "n";
  m.chunk_size = 65536;
  Manifest d = decode_manifest(encode_manifest(m), "s/n");
  CHECK(d.parent.empty());
  CHECK(d.label.empty());
  CHECK(d.regions.empty());
  CHECK(d.chunks.empty());
  CHECK(d.chunk_size == 65536);
}

TEST_CASE("manifest: every truncation length is rejected as corrupt", "[manifest]") {
  std::string bytes = encode_manifest(sample());
  REQUIRE(bytes.size() > 100);
  for (std::size_t len = 0; len < bytes.size(); ++len) {
    INFO("truncated to " << len << " of " << bytes.size() << " bytes");
    auto e = catch_error([&] { decode_manifest(std::string_view(bytes).substr(0, len), "sess/snap-1 (file)"); });
    CHECK(e.code == Errc::corrupt);
    CHECK_THAT(e.what, Catch::Contains("sess/snap-1"));
  }
  // Extended by garbage is just as wrong.
  auto e = catch_error([&] { decode_manifest(bytes + "x", "sess/snap-1"); });
  CHECK(e.code == Errc::corrupt);
}

TEST_CASE("manifest: a changed byte anywhere is rejected", "[manifest]") {
  const std::string good = encode_manifest(sample());
  for (std::size_t i = 0; i < good.size(); ++i) {
    for (unsigned mask : {0x01u, 0x80u, 0xFFu}) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ mask);
      INFO("byte " << i << " of " << good.size() << " xor " << mask);
      auto e = catch_error([&] { decode_manifest(bad, "sess/snap-1"); });
      if (i >= 8 && i < 12 && e.code == Errc::unsupported) {
        // The version field: a flip that makes the version look newer is reported
        // as "newer format" (the version is checked before the checksum).
        CHECK_THAT(e.what, Catch::Contains("upgrade"));
        continue;
      }
      CHECK(e.code == Errc::corrupt);
      CHECK_THAT(e.what, Catch::Contains("sess/snap-1"));
    }
  }
}

TEST_CASE("manifest: a newer format version is unsupported, not corrupt", "[manifest]") {
  std::string bytes = encode_manifest(sample());
  poke<std::uint32_t>(bytes, 8, dvr::detail::kManifestVersion + 1);
  bytes = reseal(bytes);
  auto e = catch_error([&] { decode_manifest(bytes, "sess/snap-1"); });
  CHECK(e.code == Errc::unsupported);
  CHECK_THAT(e.what, Catch::Contains("sess/snap-1"));
  CHECK_THAT(e.what, Catch::Contains("upgrade"));

  poke<std::uint32_t>(bytes, 8, 99);
  e = catch_error([&] { decode_manifest(reseal(bytes), "sess/snap-1"); });
  CHECK(e.code == Errc::unsupported);
}

TEST_CASE("manifest: tables that contradict each other are corrupt even with a valid checksum", "[manifest]") {
  const std::string good = encode_manifest(sample());
  // Fixed header offsets (docs/format.md): 24 time, 32 chunk_size, 36 region
  // count, 40 chunk count, 48 logical bytes, 56 stored bytes.
  SECTION("chunk size not a power of two") {
    std::string b = good;
    poke<std::uint32_t>(b, 32, 5000);
    CHECK(catch_error([&] { decode_manifest(reseal(b), "x"); }).code == Errc::corrupt);
  }
  SECTION("chunk size zero") {
    std::string b = good;
    poke<std::uint32_t>(b, 32, 0);
    CHECK(catch_error([&] { decode_manifest(reseal(b), "x"); }).code == Errc::corrupt);
  }
  SECTION("logical size disagrees with the regions") {
    std::string b = good;
    poke<std::uint64_t>(b, 48, 12345);
    CHECK(catch_error([&] { decode_manifest(reseal(b), "x"); }).code == Errc::corrupt);
  }
  SECTION("more regions claimed than present") {
    std::string b = good;
    poke<std::uint32_t>(b, 36, 3);
    CHECK(catch_error([&] { decode_manifest(reseal(b), "x"); }).code == Errc::corrupt);
  }
  SECTION("chunk count one too many") {
    std::string b = good;
    poke<std::uint64_t>(b, 40, 5);
    CHECK(catch_error([&] { decode_manifest(reseal(b), "x"); }).code == Errc::corrupt);
  }
  SECTION("chunk count so large that count * 32 wraps around to the real table size") {
    // 2^59 + 4 entries of 32 bytes is 4 * 32 modulo 2^64: the size check alone
    // cannot catch it, and the decoder must not try to allocate 2^59 entries.
    std::string b = good;
    poke<std::uint64_t>(b, 40, (1ull << 59) + 4);
    auto e = catch_error([&] { decode_manifest(reseal(b), "sess/snap-1"); });
    INFO(e.what);
    CHECK(e.code == Errc::corrupt);
  }
  SECTION("a chunk length that does not match its region") {
    Manifest m = sample();
    m.chunks[2].length = 6;
    CHECK(catch_error([&] { decode_manifest(encode_manifest(m), "x"); }).code == Errc::corrupt);
  }
  SECTION("a region with the wrong number of chunks") {
    Manifest m = sample();
    m.regions[0].chunk_count = 2;
    m.regions[1].first_chunk = 2;
    m.regions[1].chunk_count = 2;
    CHECK(catch_error([&] { decode_manifest(encode_manifest(m), "x"); }).code == Errc::corrupt);
  }
  SECTION("regions that do not start where the previous one ended") {
    Manifest m = sample();
    m.regions[1].first_chunk = 2;
    CHECK(catch_error([&] { decode_manifest(encode_manifest(m), "x"); }).code == Errc::corrupt);
  }
  SECTION("chunks not covered by any region") {
    Manifest m = sample();
    m.chunks.push_back(m.chunks[0]);
    CHECK(catch_error([&] { decode_manifest(encode_manifest(m), "x"); }).code == Errc::corrupt);
  }
  SECTION("an overlay on a page the chunk does not have") {
    Manifest m = sample();
    m.overlays[1].page = 1;
    CHECK(catch_error([&] { decode_manifest(encode_manifest(m), "x"); }).code == Errc::corrupt);
  }
  SECTION("an overlay on a chunk that does not exist") {
    Manifest m = sample();
    m.overlays[1].chunk = 4;
    CHECK(catch_error([&] { decode_manifest(encode_manifest(m), "x"); }).code == Errc::corrupt);
  }
  SECTION("an overlay at an offset that is not a page boundary") {
    Manifest m = sample();
    m.overlays[1].offset = 4096 * 9 + 1;
    CHECK(catch_error([&] { decode_manifest(encode_manifest(m), "x"); }).code == Errc::corrupt);
  }
  SECTION("overlays out of order") {
    Manifest m = sample();
    std::swap(m.overlays[0], m.overlays[1]);
    auto e = catch_error([&] { decode_manifest(encode_manifest(m), "x"); });
    CHECK(e.code == Errc::corrupt);
    CHECK_THAT(e.what, Catch::Contains("order"));
  }
  SECTION("bad magic") {
    std::string b = good;
    b[0] = 'X';
    CHECK(catch_error([&] { decode_manifest(reseal(b), "x"); }).code == Errc::corrupt);
  }
}
