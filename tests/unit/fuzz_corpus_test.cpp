// Writes the seed corpus of the libFuzzer targets (tests/fuzz/README.md) with
// the library's own encoders: small valid inputs and near-valid ones (cut
// short, one byte changed). Hidden: it runs only when asked for,
//   DVR_FUZZ_CORPUS=tests/fuzz/corpus build/tests/dvr-unit-tests "[fuzz-corpus]"
// and rewrites tests/fuzz/corpus/<target>/. Deterministic: the same files
// every time, except the random store ids inside manifests and streams.
#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>

#include "dvr/transfer.hpp"
#include "proc/metadata.hpp"
#include "proc/proc_heaps.hpp"
#include "proc/proc_pages.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::TempDir;
namespace fs = std::filesystem;
namespace procpages = dvr::detail::procpages;

namespace {

struct Corpus {
  std::string dir;
  void put(const std::string& target, const std::string& name, const std::string& bytes, bool near_valid = true) {
    fs::create_directories(dir + "/" + target);
    dvrtest::write_file(dir + "/" + target + "/" + name, bytes);
    if (!near_valid || bytes.size() < 4) return;
    dvrtest::write_file(dir + "/" + target + "/" + name + "-cut", bytes.substr(0, bytes.size() / 2));
    std::string flipped = bytes;
    flipped[flipped.size() / 3] = static_cast<char>(flipped[flipped.size() / 3] ^ 0x40);
    dvrtest::write_file(dir + "/" + target + "/" + name + "-flip", flipped);
  }
};

std::string send_to_string(const Store& store, const std::string& ref, const transfer::Options& options, const std::string& tmp) {
  int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  transfer::send(store, ref, fd, options);
  ::close(fd);
  return dvrtest::read_file(tmp);
}

}  // namespace

TEST_CASE("fuzz corpus: writes the seed inputs of tests/fuzz", "[.][fuzz-corpus]") {
  const char* out = std::getenv("DVR_FUZZ_CORPUS");
  REQUIRE(out);
  Corpus c{out};
  for (const char* t : {"fuzz_manifest", "fuzz_stream", "fuzz_pagemap", "fuzz_heap_image"})
    fs::remove_all(c.dir + "/" + t);

  // Manifests and streams of a small store: 4 KiB chunks, a region of
  // patterned data, one of zeros, one ending inside a page; then an
  // incremental snapshot with a few pages changed (overlays, page records).
  TempDir tmp;
  Store store = Store::open(tmp.store(), StoreOptions{.chunk_size = 4096});
  std::vector<unsigned char> a(8192), z(16384, 0), odd(3000);
  for (std::size_t i = 0; i < a.size(); ++i)
    a[i] = static_cast<unsigned char>(i * 7 % 251);
  dvrtest::fill_random(odd.data(), odd.size(), 3);
  {
    Session s(store, "s");
    s.track("a", a.data(), a.size());
    s.track("z", z.data(), z.size());
    s.track("odd", odd.data(), odd.size());
    s.snapshot("one", {.label = "first"});
    a[5000] ^= 1;
    odd[10] ^= 1;
    s.snapshot("two");
  }
  c.put("fuzz_manifest", "one", dvrtest::read_file(dvrtest::manifest_path(store, "s", "one")));
  c.put("fuzz_manifest", "two", dvrtest::read_file(dvrtest::manifest_path(store, "s", "two")));
  const std::string file = tmp / "stream";
  transfer::Options raw;
  raw.compress = transfer::Compress::none;
  c.put("fuzz_stream", "one-raw", send_to_string(store, "s/one", raw, file));
  transfer::Options zstd;
  zstd.compress = transfer::Compress::zstd;
  c.put("fuzz_stream", "one-zstd", send_to_string(store, "s/one", zstd, file));
  // Relative to a base the receiver lacks: refused as not_found, after the header.
  transfer::Options based = zstd;
  based.base = "one";
  c.put("fuzz_stream", "two-on-one", send_to_string(store, "s/two", based, file), false);

  // Pagemaps: CRIU's layout, with present and absent (parent) entries.
  procpages::Pagemap pm;
  pm.pages_id = 3;
  pm.entries = {{0x400000, 2, true, procpages::kPePresent}, {0x7f0000000000, 16, true, procpages::kPePresent},
                {0x7f0000100000, 4, false, procpages::kPeParent}, {0x7ffffffde000, 1, true, procpages::kPePresent}};
  c.put("fuzz_pagemap", "four-entries", procpages::encode_pagemap(pm));
  pm.entries = {{0x1000, 1, true, procpages::kPePresent}};
  c.put("fuzz_pagemap", "one-entry", procpages::encode_pagemap(pm), false);

  // Heap images and process metadata (the same target parses both).
  dvr::detail::heaps::HeapImage image;
  image.snapshot = "proc.job";
  image.heaps = {{"/dev/shm/store", "job", "heap", "/dev/shm/store/heaps/job/heap", 1u << 20},
                 {"/var/tmp/other", "sim", "grid", "/var/tmp/other/heaps/sim/grid", 4096}};
  c.put("fuzz_heap_image", "two-heaps", dvr::detail::heaps::format_image(image));
  dvr::proc::impl::Meta meta;
  meta.info.pid = 4242;
  meta.info.command = "/usr/bin/job --steps 10";
  meta.info.criu_version = "4.1.1";
  meta.info.image_bytes = 123456;
  meta.info.kernel = "6.1.0-18-amd64";
  meta.paged_images = {{"pages-1.img", "pagemap-4242.img", 8192}};
  meta.empty_images = {"tty-info.img"};
  c.put("fuzz_heap_image", "meta", dvr::proc::impl::encode_meta(meta));

  std::uintmax_t total = 0;
  for (auto& e : fs::recursive_directory_iterator(c.dir))
    if (e.is_regular_file()) {
      CHECK(e.file_size() <= 16384);  // small seeds: a few KiB each
      total += e.file_size();
    }
  std::cout << "fuzz corpus: " << total << " bytes in " << c.dir << "\n";
}
