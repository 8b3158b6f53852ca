// The page server dvr is to `criu dump --page-server` (proc/page_stream.hpp),
// with the test playing CRIU's side of the protocol: pages land in the store
// as windows at their virtual addresses, each pagemap is stored as the image
// CRIU would have written, a second dump stores only the pages that changed,
// and malformed streams are refused with nothing published while the stream is
// still read to its end (so that CRIU can finish and resume the job).
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <functional>
#include <thread>

#include "dvr/proc.hpp"
#include "proc/page_stream.hpp"
#include "proc/proc_pages.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::TempDir;
using dvr::proc::impl::PageStream;
using dvr::proc::kImageSession;
namespace procpages = dvr::detail::procpages;

namespace {

constexpr std::uint64_t kPage = 4096;

struct Psi {
  std::uint32_t cmd;
  std::uint64_t nr_pages;
  std::uint64_t vaddr;
  std::uint64_t dst_id;
};

// CRIU's side of one dump: writes messages to `sk`, reads the answers.
struct FakeCriu {
  int sk;
  void send_all(const void* p, std::size_t n) {
    auto* c = static_cast<const char*>(p);
    while (n) {
      ssize_t k = ::send(sk, c, n, MSG_NOSIGNAL);
      if (k <= 0) throw std::runtime_error("send failed");
      c += k;
      n -= static_cast<std::size_t>(k);
    }
  }
  template <class T>
  T answer() {
    T v{};
    if (::recv(sk, &v, sizeof v, MSG_WAITALL) != sizeof v) throw std::runtime_error("no answer");
    return v;
  }
  void open(std::uint64_t pid) {
    Psi h{4, 0, 0, pid << 8 | 1};
    send_all(&h, sizeof h);
    CHECK(answer<char>() == 0);  // no parent offered
  }
  void pages(std::uint64_t vaddr, const std::vector<unsigned char>& data) {
    Psi h{6u | (4u << 16), data.size() / kPage, vaddr, 0};
    send_all(&h, sizeof h);
    send_all(data.data(), data.size());
  }
  void raw(std::uint32_t cmd, std::uint64_t nr, std::uint64_t vaddr) {
    Psi h{cmd, nr, vaddr, 0};
    send_all(&h, sizeof h);
  }
  void close() {
    Psi h{0x1024, 0, 0, 0};
    send_all(&h, sizeof h);
    CHECK(answer<std::int32_t>() == 0);
  }
};

// One dump: `play` runs as CRIU on another thread while the stream serves.
template <class Play>
void serve(PageStream& ps, Play play) {
  int fd = ::dup(ps.criu_socket());
  ps.close_criu_socket();
  std::thread criu([&] {
    FakeCriu c{fd};
    try {
      play(c);
    } catch (const std::exception&) {
    }
    ::close(fd);
  });
  try {
    ps.serve();
  } catch (...) {
    criu.join();
    throw;
  }
  criu.join();
}

std::vector<unsigned char> region_bytes(Store& store, const std::string& name, const std::string& region) {
  Clone c = store.open_snapshot(kImageSession, name);
  Region& r = c.region(region);
  auto* p = static_cast<const unsigned char*>(r.data());
  return std::vector<unsigned char>(p, p + r.size());
}

}  // namespace

TEST_CASE("page stream: pages land in windows at their addresses, pagemaps as CRIU writes them", "[proc][page-stream]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::uint64_t a = 0x7f0000001000, b = 0x7f0000400000 - 2 * kPage;  // b spans two windows
  auto pa = dvrtest::random_bytes(3 * kPage, 1), pb = dvrtest::random_bytes(5 * kPage, 2);
  std::string meta = "hello";
  PageStream ps(store, "job", "", "process 1: job");
  serve(ps, [&](FakeCriu& c) {
    c.open(1);
    c.pages(a, pa);
    c.pages(b, pb);
    c.close();
  });
  REQUIRE(ps.complete());
  REQUIRE_FALSE(ps.error());
  REQUIRE(ps.paged_images().size() == 1);
  CHECK(ps.paged_images()[0].pages == "pages-1.img");
  CHECK(ps.paged_images()[0].pagemap == "pagemap-1.img");
  CHECK(ps.paged_images()[0].size == 8 * kPage);
  ps.finish({{"core-1.img", meta.data(), meta.size(), false, std::nullopt}});

  auto w0 = region_bytes(store, "job", procpages::window_region(1, 0x7f0000000000));
  REQUIRE(w0.size() == procpages::kWindow);
  CHECK(dvrtest::diff(w0.data() + 0x1000, pa.data(), pa.size()) == "");
  CHECK(std::all_of(w0.begin(), w0.begin() + 0x1000, [](unsigned char x) { return x == 0; }));
  CHECK(std::all_of(w0.begin() + 0x4000, w0.end() - 2 * kPage, [](unsigned char x) { return x == 0; }));
  CHECK(dvrtest::diff(w0.data() + procpages::kWindow - 2 * kPage, pb.data(), 2 * kPage) == "");
  auto w1 = region_bytes(store, "job", procpages::window_region(1, 0x7f0000400000));
  CHECK(dvrtest::diff(w1.data(), pb.data() + 2 * kPage, 3 * kPage) == "");

  auto pm_bytes = region_bytes(store, "job", "pagemap-1.img");
  procpages::Pagemap pm;
  REQUIRE(procpages::parse_pagemap(reinterpret_cast<const char*>(pm_bytes.data()), pm_bytes.size(), pm));
  CHECK(pm.pages_id == 1);
  REQUIRE(pm.entries.size() == 2);
  CHECK(pm.entries[0].vaddr == a);
  CHECK(pm.entries[0].pages == 3);
  CHECK(pm.entries[1].vaddr == b);
  CHECK(pm.entries[1].pages == 5);
  CHECK(pm.entries[1].present);
  CHECK(pm.present_bytes() == 8 * kPage);
  CHECK(region_bytes(store, "job", "core-1.img").size() == meta.size());
}

TEST_CASE("page stream: a second dump stores only the pages that changed", "[proc][page-stream]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::uint64_t base = 0x7f0000000000, pages = 2048;  // 8 MiB, two windows
  auto data = dvrtest::random_bytes(pages * kPage, 3);
  auto dump = [&](const std::string& name, const std::string& parent) {
    PageStream ps(store, name, parent, "process 1: job");
    serve(ps, [&](FakeCriu& c) {
      c.open(1);
      c.pages(base, data);
      c.close();
    });
    return ps.finish({});
  };
  SnapshotInfo first = dump("d1", "");
  for (std::uint64_t p = 0; p < pages; p += 100)  // 1% of the pages
    data[p * kPage + 7] ^= 0x5a;
  SnapshotInfo second = dump("d2", "d1");
  CHECK(first.stored_bytes >= pages * kPage);
  CHECK(second.stored_bytes <= first.stored_bytes / 50);
  auto w = region_bytes(store, "d2", procpages::window_region(1, base));
  CHECK(dvrtest::diff(w.data(), data.data(), procpages::kWindow) == "");
}

TEST_CASE("page stream: malformed streams are refused, read to their end, and publish nothing", "[proc][page-stream]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto pg = dvrtest::random_bytes(2 * kPage, 4);
  struct Case {
    const char* what;
    std::function<void(FakeCriu&)> play;
    bool closes;
  };
  std::vector<Case> cases = {
      {"pages before a pagemap", [&](FakeCriu& c) { c.pages(0x1000, pg); c.close(); }, true},
      {"pages out of order", [&](FakeCriu& c) { c.open(1); c.pages(0x10000, pg); c.pages(0x1000, pg); c.close(); }, true},
      {"overlapping pages", [&](FakeCriu& c) { c.open(1); c.pages(0x1000, pg); c.pages(0x2000, pg); c.close(); }, true},
      {"a misaligned address", [&](FakeCriu& c) { c.open(1); c.pages(0x1001, pg); c.close(); }, true},
      {"pages in a parent", [&](FakeCriu& c) { c.open(1); c.raw(2, 4, 0x1000); c.close(); }, true},
      {"an unknown command", [&](FakeCriu& c) { c.open(1); c.raw(77, 0, 0); }, false},
      {"an end in the middle of the pages", [&](FakeCriu& c) { c.open(1); c.raw(6u | (4u << 16), 8, 0x1000); c.send_all(pg.data(), pg.size()); }, false},
  };
  for (auto& k : cases) {
    SECTION(k.what) {
      PageStream ps(store, "bad", "", "");
      dvrtest::catch_error([&] { serve(ps, k.play); });  // serve() throws only when the socket fails
      CHECK(ps.complete() == k.closes);
      auto c = dvrtest::catch_error([&] { ps.finish({}); });
      CHECK(c.threw_dvr());
      CHECK(store.list(kImageSession).empty());
    }
  }
}
