// Chunk views (format/chunks.hpp): view_of() over a manifest's chunks, page
// hashes and overlays; ChunkView::location() with overlays; check_chunk()
// finding a flipped byte (in the chunk, in an overlay page, in the manifest's
// hashes; not in bytes an overlay hides); read_chunk() giving the logical
// bytes of every kind of chunk, or corrupt naming the chunk; and chunks in
// missing or short packs. The manifests are built here by hand, on packs
// written directly, in both formats: paged (v3: page hashes, tree hash,
// overlays) and whole-chunk (v1/v2: XXH3-128 of the bytes).
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "format/chunks.hpp"
#include "format/pack.hpp"
#include "test_support.hpp"

using namespace dvr;
using namespace dvr::detail;
using dvrtest::catch_error;
using dvrtest::TempDir;

namespace {

using Bytes = std::vector<unsigned char>;
constexpr std::uint32_t kChunk = 4 * kPageSize;  // 16 KiB chunks of 4 pages
const std::string kUuid = "00112233445566778899aabbccddeeff";

void put(Packs& packs, std::uint32_t id, std::uint64_t offset, const Bytes& data) {
  auto w = packs.writer(id, offset, data.size());
  w.reserve(0, data.size());
  w.copy(0, data.data(), data.size(), true);
  w.finish();
  packs.end_writes();
}

Bytes zeros(std::size_t n) { return Bytes(n, 0); }

Bytes cat(std::initializer_list<Bytes> parts) {
  Bytes out;
  for (auto& p : parts)
    out.insert(out.end(), p.begin(), p.end());
  return out;
}

Bytes slice(const Bytes& b, std::size_t from, std::size_t len) { return {b.begin() + from, b.begin() + from + len}; }

// Page hashes of `logical` (the chunk's bytes as a snapshot holds them).
std::vector<std::uint64_t> page_hashes_of(const Bytes& logical) {
  std::vector<std::uint64_t> h(pages_in(logical.size()));
  hash_pages(reinterpret_cast<const char*>(logical.data()), logical.size(), h.data());
  return h;
}

// One pack holding four chunks' data, and a paged (v3) manifest over them:
//   chunk 0: 4 pages, stored whole at kAt0;
//   chunk 1: all zero but page 2, which is an overlay at kOv1;
//   chunk 2: 2 pages + 100 bytes stored at kAt2, page 0 zeroed by an overlay
//            (pack 0, offset 0), page 1 an overlay at kOv2;
//   chunk 3: all zero, no overlays.
// Regions: r0 = chunks 0-2 (2 chunks + 8292 bytes), r1 = chunk 3.
struct Fixture {
  static constexpr std::uint64_t kAt0 = 4096, kOv1 = 64 * 1024, kAt2 = 128 * 1024, kOv2 = 192 * 1024;
  static constexpr std::uint32_t kShort = 2 * kPageSize + 100;
  TempDir tmp;
  std::string dir = tmp / "packs";
  Packs packs;
  Bytes stored0 = dvrtest::random_bytes(kChunk, 1);
  Bytes overlay1 = dvrtest::random_bytes(kPageSize, 2);
  Bytes stored2 = dvrtest::random_bytes(kShort, 3);
  Bytes overlay2 = dvrtest::random_bytes(kPageSize, 4);
  std::vector<Bytes> logical;  // what each chunk holds
  Manifest m;

  Fixture() : packs((dvrtest::fs::create_directory(dir), dir), kUuid) {
    packs.create(1, 1 << 20, 1 << 20);
    put(packs, 1, kAt0, stored0);
    put(packs, 1, kOv1, overlay1);
    put(packs, 1, kAt2, stored2);
    put(packs, 1, kOv2, overlay2);
    logical = {
        stored0,
        cat({zeros(2 * kPageSize), overlay1, zeros(kPageSize)}),
        cat({zeros(kPageSize), overlay2, slice(stored2, 2 * kPageSize, 100)}),
        zeros(kChunk),
    };
    m.session = "s";
    m.name = "n";
    m.chunk_size = kChunk;
    m.paged = true;
    m.regions = {{"r0", 2 * kChunk + kShort, true, 0, 3}, {"r1", kChunk, false, 3, 1}};
    const std::uint64_t where[4] = {kAt0, 0, kAt2, 0};
    const std::uint32_t pack[4] = {1, 0, 1, 0};
    for (int i = 0; i < 4; ++i) {
      auto h = page_hashes_of(logical[i]);
      ChunkRef ref;
      ref.hash = tree_hash(h.data(), h.size());
      ref.pack = pack[i];
      ref.length = static_cast<std::uint32_t>(logical[i].size());
      ref.offset = where[i];
      m.chunks.push_back(ref);
      m.page_hashes.insert(m.page_hashes.end(), h.begin(), h.end());
    }
    m.overlays = {{1, 2, 1, kOv1}, {2, 0, 0, 0}, {2, 1, 1, kOv2}};
    m.index();
    REQUIRE(m.hydrated());
  }

  // The chunk's hash again after page_hashes changed.
  void rehash(std::size_t chunk) { m.chunks[chunk].hash = tree_hash(m.hashes_of(chunk), m.pages_of(chunk)); }

  std::string check(std::size_t chunk) {
    ChunkView v = view_of(m, chunk);
    map_chunk(packs, v);
    return check_chunk(packs, v);
  }

  Bytes read(std::size_t chunk) {
    ChunkView v = view_of(m, chunk);
    Bytes out(v.ref->length, 0xEE);
    read_chunk(packs, v, reinterpret_cast<char*>(out.data()), "snapshot s/n chunk " + std::to_string(chunk));
    return out;
  }
};

bool same(PageLoc a, PageLoc b) { return a.pack == b.pack && a.offset == b.offset; }

}  // namespace

TEST_CASE("chunks: view_of gives each chunk its reference, page hashes and own overlays", "[chunks]") {
  Fixture f;
  const std::size_t overlays[4] = {0, 1, 2, 0};
  for (std::size_t i = 0; i < 4; ++i) {
    INFO("chunk " << i);
    ChunkView v = view_of(f.m, i);
    CHECK(v.ref == &f.m.chunks[i]);
    CHECK(v.paged);
    CHECK(v.pages == f.m.hashes_of(i));
    CHECK(v.overlay_count == overlays[i]);
    for (std::size_t k = 0; k < v.overlay_count; ++k)
      CHECK(v.overlays[k].chunk == i);
    CHECK(v.page_count() == (i == 2 ? 3u : 4u));
  }
  ChunkView v2 = view_of(f.m, 2);
  CHECK(v2.page_length(0) == kPageSize);
  CHECK(v2.page_length(2) == 100);
  CHECK(v2.overlays == f.m.overlays.data() + 1);
  // Only a zero chunk without overlays is all zero.
  CHECK_FALSE(view_of(f.m, 0).all_zero());
  CHECK_FALSE(view_of(f.m, 1).all_zero());
  CHECK(view_of(f.m, 3).all_zero());
  // A paged manifest not hydrated yet has no page hashes to give.
  Manifest bare = f.m;
  bare.page_hashes.clear();
  REQUIRE_FALSE(bare.hydrated());
  CHECK(view_of(bare, 0).pages == nullptr);
  // An owned copy keeps all of it after the manifest is gone.
  std::vector<OwnedChunk> owned;
  {
    Manifest copy = f.m;
    for (std::size_t i = 0; i < 4; ++i)
      owned.emplace_back(view_of(copy, i));
  }
  for (std::size_t i = 0; i < 4; ++i) {
    ChunkView o = owned[i].view();
    CHECK(o.ref->offset == f.m.chunks[i].offset);
    CHECK(o.ref->hash == f.m.chunks[i].hash);
    CHECK(o.overlay_count == overlays[i]);
    CHECK(std::vector<std::uint64_t>(o.pages, o.pages + o.page_count()) ==
          std::vector<std::uint64_t>(f.m.hashes_of(i), f.m.hashes_of(i) + f.m.pages_of(i)));
  }
}

TEST_CASE("chunks: location takes a page from its overlay, else from its place in the chunk", "[chunks]") {
  Fixture f;
  ChunkView c0 = view_of(f.m, 0), c1 = view_of(f.m, 1), c2 = view_of(f.m, 2), c3 = view_of(f.m, 3);
  for (std::uint32_t p = 0; p < 4; ++p) {
    INFO("page " << p);
    CHECK(same(c0.location(p), {1, Fixture::kAt0 + p * kPageSize}));
    CHECK(same(c3.location(p), {0, 0}));  // all zero: stored nowhere
  }
  CHECK(same(c1.location(0), {0, 0}));
  CHECK(same(c1.location(2), {1, Fixture::kOv1}));  // the overlay of a zero chunk
  CHECK(same(c1.location(3), {0, 0}));
  CHECK(same(c2.location(0), {0, 0}));  // zeroed by its overlay
  CHECK(same(c2.location(1), {1, Fixture::kOv2}));
  CHECK(same(c2.location(2), {1, Fixture::kAt2 + 2 * kPageSize}));
}

TEST_CASE("chunks: read_chunk gives the logical bytes of every kind of chunk", "[chunks]") {
  Fixture f;
  for (std::size_t i = 0; i < 4; ++i) {
    INFO("chunk " << i);
    CHECK(f.check(i) == "");
    CHECK(dvrtest::diff(f.read(i), f.logical[i]) == "");
  }
  // From an owned copy too, and from a Packs that has mapped nothing yet.
  OwnedChunk owned(view_of(f.m, 2));
  Packs fresh(f.dir, kUuid);
  Bytes out(f.logical[2].size());
  read_chunk(fresh, owned.view(), reinterpret_cast<char*>(out.data()), "owned chunk");
  CHECK(dvrtest::diff(out, f.logical[2]) == "");
}

TEST_CASE("chunks: check_chunk finds a flipped byte in a chunk, an overlay page or the manifest's hashes", "[chunks]") {
  Fixture f;
  const std::string pack = f.packs.path_of(1);

  SECTION("in a stored chunk: named by pack and page offset; read_chunk refuses it") {
    dvrtest::flip_byte(pack, Fixture::kAt0 + kPageSize + 10);
    std::string why = f.check(0);
    CHECK_THAT(
        why, Catch::Contains("checksum mismatch") && Catch::Contains(pack) && Catch::Contains("offset " + std::to_string(Fixture::kAt0 + kPageSize)));
    auto c = catch_error([&] { f.read(0); });
    CHECK(c.code == Errc::corrupt);
    CHECK_THAT(c.what, Catch::Contains("snapshot s/n chunk 0") && Catch::Contains("damaged") && Catch::Contains(pack));
    CHECK(f.check(1) == "");  // the others are intact
    CHECK(f.check(2) == "");
    dvrtest::flip_byte(pack, Fixture::kAt0 + kPageSize + 10);  // back
    CHECK(f.check(0) == "");
    CHECK(dvrtest::diff(f.read(0), f.logical[0]) == "");
  }
  SECTION("in an overlay page") {
    dvrtest::flip_byte(pack, Fixture::kOv1 + 4095);
    CHECK_THAT(f.check(1), Catch::Contains("checksum mismatch") && Catch::Contains("offset " + std::to_string(Fixture::kOv1)));
    CHECK(catch_error([&] { f.read(1); }).code == Errc::corrupt);
    dvrtest::flip_byte(pack, Fixture::kOv2);
    CHECK_THAT(f.check(2), Catch::Contains("offset " + std::to_string(Fixture::kOv2)));
  }
  SECTION("in the partial last page of a chunk") {
    dvrtest::flip_byte(pack, Fixture::kAt2 + 2 * kPageSize + 99);
    CHECK_THAT(f.check(2), Catch::Contains("offset " + std::to_string(Fixture::kAt2 + 2 * kPageSize)));
  }
  SECTION("in stored bytes an overlay hides: nothing is wrong") {
    dvrtest::flip_byte(pack, Fixture::kAt2 + 5);              // page 0, zeroed by its overlay
    dvrtest::flip_byte(pack, Fixture::kAt2 + kPageSize + 5);  // page 1, replaced by its overlay
    CHECK(f.check(2) == "");
    CHECK(dvrtest::diff(f.read(2), f.logical[2]) == "");
  }
  SECTION("in the manifest's page hashes") {
    f.m.page_hashes[f.m.first_page[0] + 2] ^= 1;
    CHECK_THAT(f.check(0), Catch::Contains("page hashes in its manifest do not match"));
    auto c = catch_error([&] { f.read(0); });
    CHECK(c.code == Errc::corrupt);
    CHECK_THAT(c.what, Catch::Contains("snapshot s/n chunk 0"));
    // With the chunk hash made to match, the page itself is found to differ.
    f.rehash(0);
    CHECK_THAT(f.check(0), Catch::Contains("checksum mismatch") && Catch::Contains("offset " + std::to_string(Fixture::kAt0 + 2 * kPageSize)));
  }
  SECTION("a zero page whose hash is not that of zeros") {
    f.m.page_hashes[f.m.first_page[3] + 1] ^= 1;
    f.rehash(3);
    CHECK_THAT(f.check(3), Catch::Contains("all-zero page has the wrong checksum"));
    CHECK(catch_error([&] { f.read(3); }).code == Errc::corrupt);
  }
}

TEST_CASE("chunks: whole-chunk (v1/v2) chunks are checked against XXH3-128 of their bytes", "[chunks]") {
  Fixture f;
  Manifest old;
  old.paged = false;
  old.chunk_size = kChunk;
  old.regions = {{"r", 2 * kChunk, false, 0, 2}};
  ChunkRef stored;
  stored.hash = hash128(f.stored0.data(), f.stored0.size());
  stored.pack = 1;
  stored.length = kChunk;
  stored.offset = Fixture::kAt0;
  ChunkRef zero;
  Bytes z = zeros(kChunk);
  zero.hash = hash128(z.data(), z.size());
  zero.length = kChunk;
  old.chunks = {stored, zero};
  old.index();
  REQUIRE(old.hydrated());
  ChunkView v0 = view_of(old, 0), v1 = view_of(old, 1);
  CHECK_FALSE(v0.paged);
  CHECK(v0.pages == nullptr);
  CHECK(v1.all_zero());
  map_chunk(f.packs, v0);
  CHECK(check_chunk(f.packs, v0) == "");
  CHECK(check_chunk(f.packs, v1) == "");
  Bytes out(kChunk, 0xEE);
  read_chunk(f.packs, v0, reinterpret_cast<char*>(out.data()), "old chunk");
  CHECK(dvrtest::diff(out, f.stored0) == "");
  read_chunk(f.packs, v1, reinterpret_cast<char*>(out.data()), "old zero chunk");
  CHECK(dvrtest::diff(out, z) == "");
  // A flipped byte anywhere in it.
  dvrtest::flip_byte(f.packs.path_of(1), Fixture::kAt0 + 3 * kPageSize + 1);
  CHECK_THAT(check_chunk(f.packs, v0), Catch::Contains("checksum mismatch") && Catch::Contains(f.packs.path_of(1)));
  auto c = catch_error([&] { read_chunk(f.packs, v0, reinterpret_cast<char*>(out.data()), "old chunk"); });
  CHECK(c.code == Errc::corrupt);
  CHECK_THAT(c.what, Catch::Contains("old chunk") && Catch::Contains("damaged"));
  // A zero chunk whose recorded hash is not that of zeros.
  old.chunks[1].hash.lo ^= 1;
  CHECK_THAT(check_chunk(f.packs, view_of(old, 1)), Catch::Contains("all-zero chunk has the wrong checksum"));
}

TEST_CASE("chunks: a chunk in a missing or short pack is corrupt, naming the pack", "[chunks]") {
  Fixture f;
  SECTION("the chunk's pack is missing") {
    f.m.chunks[0].pack = 5;
    ChunkView v = view_of(f.m, 0);
    auto mapped = catch_error([&] { map_chunk(f.packs, v); });
    CHECK(mapped.code == Errc::corrupt);
    CHECK_THAT(mapped.what, Catch::Contains(f.packs.path_of(5)) && Catch::Contains("missing"));
    // Not mapped: check_chunk cannot read it and says where.
    auto checked = catch_error([&] { check_chunk(f.packs, v); });
    CHECK(checked.code == Errc::corrupt);
    CHECK_THAT(checked.what, Catch::Contains(f.packs.path_of(5)) && Catch::Contains("missing or short pack file"));
    Bytes out(kChunk);
    CHECK(catch_error([&] { read_chunk(f.packs, v, reinterpret_cast<char*>(out.data()), "c"); }).code == Errc::corrupt);
  }
  SECTION("an overlay's pack is missing") {
    f.m.overlays[0].pack = 6;
    auto c = catch_error([&] { f.check(1); });
    CHECK(c.code == Errc::corrupt);
    CHECK_THAT(c.what, Catch::Contains(f.packs.path_of(6)));
  }
  SECTION("the chunk lies past the end of its pack") {
    f.m.chunks[0].offset = (1 << 20) - kPageSize;
    auto c = catch_error([&] { f.check(0); });
    CHECK(c.code == Errc::corrupt);
    CHECK_THAT(c.what, Catch::Contains(f.packs.path_of(1)) && Catch::Contains("truncated"));
  }
}
