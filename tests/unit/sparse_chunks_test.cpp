// Sparse chunks (store/writer.hpp, Lane::put_sparse): memory known to be zero
// but for a few pages (a CRIU page window: the process's pages at their
// addresses) is stored as the zero chunk with those pages apart, so that it
// costs its pages, not whole chunks. Read back bit-exact, patched by the next
// snapshot like any chunk, and checked by verify.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dvr/dvr.hpp"
#include "store/store_impl.hpp"
#include "store/writer.hpp"
#include "test_support.hpp"

namespace {

using namespace dvr::detail;

constexpr std::uint64_t kPage = 4096, kSize = 8u << 20;

// Writes `data` as snapshot s/NAME (region "w"), `present` its only pages
// that may be other than zero (page indexes); with `base`, against it.
dvr::SnapshotInfo write_window(dvr::Store& store, const std::string& name, const std::vector<unsigned char>& data,
                               const std::vector<std::uint64_t>& present, const std::string& base = "",
                               const ByteRanges& written = {}) {
  StoreImpl& si = impl_of(store);
  std::optional<Manifest> b;
  if (!base.empty()) b = si.load_manifest("s", base);
  WriteBatch batch(si);
  SnapshotWriter w(batch, "s", name, {.parent = base});
  RegionSource r;
  r.name = "w";
  r.data = reinterpret_cast<const char*>(data.data());
  r.size = kSize;
  std::uint64_t at = 0;
  for (std::uint64_t p : present) {
    if (p * kPage > at) r.zero.emplace_back(at, p * kPage);
    at = (p + 1) * kPage;
  }
  if (at < kSize) r.zero.emplace_back(at, kSize);
  if (b) r.written = written;
  write_snapshot(w, {r}, b ? &*b : nullptr, false);
  return batch.publish({&w}).front();
}

std::vector<unsigned char> read_back(dvr::Store& store, const std::string& name) {
  dvr::Clone c = store.open_snapshot("s", name);
  const auto* p = static_cast<const unsigned char*>(c.regions().at(0)->data());
  return {p, p + c.regions()[0]->size()};
}

}  // namespace

TEST_CASE("sparse chunks: a window of a few pages costs those pages, reads back bit-exact and is patched later", "[store][sparse]") {
  dvrtest::TempDir dir;
  dvr::Store store = dvr::Store::open(dir.store());
  const std::uint64_t chunk_pages = store.chunk_size() / kPage;
  std::vector<unsigned char> data(kSize, 0);
  std::vector<std::uint64_t> present;
  // Three pages in each of the first chunks; one of them all zero (present
  // but nothing to store); the last chunk dense (stored whole).
  for (std::uint64_t c = 0; c + 1 < kSize / store.chunk_size(); ++c)
    for (std::uint64_t k : {std::uint64_t{1}, std::uint64_t{7}, chunk_pages - 1}) {
      const std::uint64_t p = c * chunk_pages + k;
      present.push_back(p);
      if (k != 7) dvrtest::fill_random(data.data() + p * kPage, kPage, 1000 + p);
    }
  const std::uint64_t last = kSize / kPage - chunk_pages;
  for (std::uint64_t p = last; p < kSize / kPage; ++p) {
    present.push_back(p);
    dvrtest::fill_random(data.data() + p * kPage, kPage, 5000 + p);
  }
  const std::uint64_t chunks = kSize / store.chunk_size();
  auto first = write_window(store, "a", data, present);
  CHECK(first.stored_bytes == ((chunks - 1) * 2 + chunk_pages) * kPage);
  CHECK(read_back(store, "a") == data);
  const Manifest m = impl_of(store).load_manifest("s", "a");
  CHECK(m.chunks.front().is_zero());
  CHECK(m.has_overlays(0));
  CHECK_FALSE(m.chunks.back().is_zero());

  // One page changed: patched onto the sparse chunk it lies in.
  const std::uint64_t changed = chunk_pages + 1;
  dvrtest::fill_random(data.data() + changed * kPage, kPage, 77);
  auto second = write_window(store, "b", data, present, "a", {{changed * kPage, (changed + 1) * kPage}});
  CHECK(second.stored_bytes == kPage);
  CHECK(read_back(store, "b") == data);
  CHECK(read_back(store, "a") != data);
  CHECK(store.verify().ok());
}
