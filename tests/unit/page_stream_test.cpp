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
#include <filesystem>
#include <fcntl.h>
#include <sys/stat.h>

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

TEST_CASE("page stream: scattered pages over many windows, buffers populated and reused, land exactly where they belong",
          "[proc][page-stream]") {
  // 40 windows with a third of their pages each (1.3 MiB): buffers made after
  // the first 16 MiB are populated at once (PageStream::kPopulateAfter), and
  // after 2 * kBatchWindows windows the buffers are reused, so every window
  // must read zero where nothing came, whatever an earlier one left there.
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::uint64_t base = 0x7f0000000000, windows = 40, per_window = procpages::kWindow / kPage;
  static_assert(PageStream::kPopulateAfter < 16 * (procpages::kWindow / 3));
  std::vector<std::vector<unsigned char>> sent(windows);
  PageStream ps(store, "scattered", "", "process 1: job");
  serve(ps, [&](FakeCriu& c) {
    c.open(1);
    for (std::uint64_t w = 0; w < windows; ++w) {
      sent[w] = dvrtest::random_bytes(procpages::kWindow, 100 + static_cast<unsigned>(w));
      for (std::uint64_t p = w % 3; p < per_window; p += 3)
        c.pages(base + w * procpages::kWindow + p * kPage,
                std::vector<unsigned char>(sent[w].begin() + static_cast<std::ptrdiff_t>(p * kPage),
                                           sent[w].begin() + static_cast<std::ptrdiff_t>((p + 1) * kPage)));
    }
    c.close();
  });
  REQUIRE(ps.complete());
  REQUIRE_FALSE(ps.error());
  ps.finish({});
  for (std::uint64_t w = 0; w < windows; ++w) {
    auto got = region_bytes(store, "scattered", procpages::window_region(1, base + w * procpages::kWindow));
    REQUIRE(got.size() == procpages::kWindow);
    std::vector<unsigned char> expect(procpages::kWindow, 0);
    for (std::uint64_t p = w % 3; p < per_window; p += 3)
      std::memcpy(expect.data() + p * kPage, sent[w].data() + p * kPage, kPage);
    INFO("window " << w);
    CHECK(dvrtest::diff(got.data(), expect.data(), procpages::kWindow) == "");
  }
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

// ---- ImageServer: the images served back to `criu restore --stream` -----------

#include <sys/un.h>

#include "proc/image_server.hpp"

namespace {

using dvr::proc::impl::ImageServer;

// CRIU's side of the image streamer protocol: asks for `file`, returns its
// bytes ("" with *exists = false when the server says it has none).
std::string stream_file(int sk, const std::string& file, bool* exists) {
  std::string msg = "\x0a" + std::string(1, static_cast<char>(file.size())) + file;
  std::uint32_t len = static_cast<std::uint32_t>(msg.size());
  REQUIRE(::send(sk, &len, 4, 0) == 4);
  REQUIRE(::send(sk, msg.data(), msg.size(), 0) == static_cast<ssize_t>(msg.size()));
  std::uint32_t rlen = 0;
  REQUIRE(::recv(sk, &rlen, 4, MSG_WAITALL) == 4);
  std::string reply(rlen, '\0');
  REQUIRE(::recv(sk, reply.data(), rlen, MSG_WAITALL) == static_cast<ssize_t>(rlen));
  *exists = reply == std::string("\x08\x01", 2);
  if (!*exists) return "";
  int p[2];
  REQUIRE(::pipe(p) == 0);
  char byte = 0;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = control;
  m.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &p[1], sizeof(int));
  REQUIRE(::sendmsg(sk, &m, 0) == 1);
  ::close(p[1]);
  std::string out;
  char buf[1 << 16];
  for (ssize_t k; (k = ::read(p[0], buf, sizeof buf)) > 0;)
    out.append(buf, static_cast<std::size_t>(k));
  ::close(p[0]);
  return out;
}

int connect_to(const std::string& path) {
  int sk = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
  REQUIRE(::connect(sk, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return sk;
}

// proc/job: two pagemap entries in two windows, a core image and the metadata.
std::vector<unsigned char> store_job(Store& store, std::uint64_t a, std::uint64_t b) {
  auto pa = dvrtest::random_bytes(3 * kPage, 11), pb = dvrtest::random_bytes(5 * kPage, 12);
  PageStream ps(store, "job", "", "process 1: job");
  serve(ps, [&](FakeCriu& c) {
    c.open(1);
    c.pages(a, pa);
    c.pages(b, pb);
    c.close();
  });
  dvr::proc::impl::Meta meta;
  meta.info.pid = 1;
  meta.paged_images = ps.paged_images();
  std::string text = dvr::proc::impl::encode_meta(meta), core = "core image";
  ps.finish({{"core-1.img", core.data(), core.size(), false, std::nullopt},
             {dvr::proc::impl::kMetaRegion, text.data(), text.size(), false, std::nullopt}});
  pa.insert(pa.end(), pb.begin(), pb.end());
  return pa;  // pages-1.img as CRIU wrote it
}

// Flips a byte of the page whose first 64 bytes are `page`, in the store's pack file.
void damage_page(const std::string& store_dir, const unsigned char* page) {
  std::string pack;
  for (auto& e : std::filesystem::recursive_directory_iterator(store_dir))
    if (e.path().extension() == ".pack") pack = e.path();
  REQUIRE(!pack.empty());
  std::string bytes = dvrtest::read_file(pack);
  auto at = bytes.find(std::string(reinterpret_cast<const char*>(page), 64));
  REQUIRE(at != std::string::npos);
  int fd = ::open(pack.c_str(), O_WRONLY);
  char x = static_cast<char>(bytes[at + 100] ^ 0x40);
  REQUIRE(::pwrite(fd, &x, 1, static_cast<off_t>(at + 100)) == 1);
  ::close(fd);
}

}  // namespace

TEST_CASE("image server: CRIU gets the page image assembled from the windows, the small images from the directory", "[proc][page-stream]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const auto pages = store_job(store, 0x7f0000001000, 0x7f0000800000 - kPage);
  const std::string work = dir / "work";
  ::mkdir(work.c_str(), 0700);
  {
    ImageServer images(store, "job", work);
    CHECK(dvrtest::read_file(work + "/core-1.img") == "core image");
    CHECK_FALSE(std::filesystem::exists(work + "/pages-1.img"));  // never written out
    int sk = connect_to(images.start());
    bool exists = false;
    std::string got = stream_file(sk, "pages-1.img", &exists);
    CHECK(exists);
    REQUIRE(got.size() == pages.size());
    CHECK(dvrtest::diff(got.data(), pages.data(), pages.size()) == "");
    CHECK(stream_file(sk, "core-1.img", &exists) == "core image");
    CHECK(exists);
    procpages::Pagemap pm;
    std::string pmi = stream_file(sk, "pagemap-1.img", &exists);
    CHECK(procpages::parse_pagemap(pmi.data(), pmi.size(), pm));
    for (const char* name : {"nosuch.img", "../store/superblock", "streamer-serve.sock", "."}) {
      stream_file(sk, name, &exists);
      CHECK_FALSE(exists);
    }
    ::close(sk);
    CHECK_FALSE(images.stop());
  }
  // Without streaming, the page image is written as the file CRIU wrote.
  const std::string files = dir / "files";
  ::mkdir(files.c_str(), 0700);
  ImageServer images(store, "job", files);
  images.write_page_images();
  std::string file = dvrtest::read_file(files + "/pages-1.img");
  REQUIRE(file.size() == pages.size());
  CHECK(dvrtest::diff(file.data(), pages.data(), pages.size()) == "");
}

TEST_CASE("image server: a damaged page is reported, and CRIU gets less than the image", "[proc][page-stream]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const auto pages = store_job(store, 0x7f0000001000, 0x7f0000800000 - kPage);
  damage_page(dir.store(), pages.data());  // the first window's data
  const std::string work = dir / "work";
  ::mkdir(work.c_str(), 0700);
  ImageServer images(store, "job", work);
  int sk = connect_to(images.start());
  bool exists = false;
  std::string got = stream_file(sk, "pages-1.img", &exists);
  CHECK(got.size() < pages.size());
  ::close(sk);
  std::exception_ptr e = images.stop();
  REQUIRE(e);
  auto c = dvrtest::catch_error([&] { std::rethrow_exception(e); });
  CHECK(c.code == Errc::corrupt);
  CHECK_THAT(c.what, Catch::Contains("job"));
}

// ---- ImageServer filling: dvr writes the pages into the restored process ------

#include <signal.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>

namespace {

void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

// mm-PID.img with one VmaEntry per (start, end, status).
struct Vma {
  std::uint64_t start, end;
  std::uint32_t status;
  std::uint64_t prot = 3;  // PROT_READ | PROT_WRITE
};

std::string mm_image(const std::vector<Vma>& vmas) {
  std::string mm;
  for (auto& [start, end, status, prot] : vmas) {
    std::string v;
    for (auto [field, value] : {std::pair<int, std::uint64_t>{1, start}, {2, end}, {3, 0}, {4, 0}, {5, prot}, {6, 0x22}, {7, status}, {8, 1}}) {
      put_varint(v, static_cast<std::uint64_t>(field) << 3);
      put_varint(v, value);
    }
    put_varint(mm, (14 << 3) | 2);
    put_varint(mm, v.size());
    mm += v;
  }
  std::string img(8, '\0');
  auto len = static_cast<std::uint32_t>(mm.size());
  img.append(reinterpret_cast<const char*>(&len), 4);
  return img + mm;
}

constexpr std::uint32_t kAnonPrivate = (1u << 0) | (1u << 9), kFilePrivate = (1u << 0) | (1u << 6);

// An 8 MiB range of addresses free in this process (and so in a child
// forked now): the kernel's choice, so that it is one a sanitizer's
// runtime also allows (a fixed address may fall in TSan's shadow memory).
std::uint64_t free_range() {
  void* p = ::mmap(nullptr, 0x800000, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  REQUIRE(p != MAP_FAILED);
  ::munmap(p, 0x800000);
  return reinterpret_cast<std::uint64_t>(p);
}

// A stopped child with 3 pages at `a` (read-write) and 5 at `b` (read-only,
// as CRIU leaves a mapping the process had read-only), all zero.
pid_t stopped_child(std::uint64_t a, std::uint64_t b) {
  pid_t pid = ::fork();
  if (pid == 0) {
    void* pa = ::mmap(reinterpret_cast<void*>(a), 3 * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    void* pb = ::mmap(reinterpret_cast<void*>(b), 5 * kPage, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (pa != reinterpret_cast<void*>(a) || pb != reinterpret_cast<void*>(b)) ::_exit(3);
    ::raise(SIGSTOP);
    ::_exit(0);
  }
  int st = 0;
  REQUIRE(::waitpid(pid, &st, WUNTRACED) == pid);
  REQUIRE(WIFSTOPPED(st));
  return pid;
}

std::vector<unsigned char> read_child(pid_t pid, std::uint64_t addr, std::size_t n) {
  std::vector<unsigned char> out(n);
  iovec l{out.data(), n}, r{reinterpret_cast<void*>(addr), n};
  REQUIRE(::process_vm_readv(pid, &l, 1, &r, 1, 0) == static_cast<ssize_t>(n));
  return out;
}

void kill_child(pid_t pid) {
  ::kill(pid, SIGKILL);
  int st = 0;
  ::waitpid(pid, &st, 0);
}

// proc/job of process `pid`: its pages at a (3) and b (5), and an mm image.
void store_job_of(Store& store, std::uint64_t pid, std::uint64_t a, std::uint64_t b, const std::string& mm,
                  const std::vector<unsigned char>& pa, const std::vector<unsigned char>& pb) {
  PageStream ps(store, "job", "", "process: job");
  serve(ps, [&](FakeCriu& c) {
    c.open(pid);
    c.pages(a, pa);
    c.pages(b, pb);
    c.close();
  });
  dvr::proc::impl::Meta meta;
  meta.info.pid = static_cast<int>(pid);
  meta.paged_images = ps.paged_images();
  std::string text = dvr::proc::impl::encode_meta(meta);
  const std::string mm_name = "mm-" + std::to_string(pid) + ".img";
  ps.finish({{mm_name, mm.data(), mm.size(), false, std::nullopt},
             {dvr::proc::impl::kMetaRegion, text.data(), text.size(), false, std::nullopt}});
}

// The plugin's side: asks dvr to fill `pid`, returns its status.
std::int32_t ask_fill(int sk, pid_t pid) {
  std::int32_t p = pid, status = -1;
  REQUIRE(::send(sk, &p, sizeof p, 0) == sizeof p);
  REQUIRE(::recv(sk, &status, sizeof status, MSG_WAITALL) == sizeof status);
  return status;
}

std::string fill_socket(const ImageServer& images) {
  auto env = images.criu_env();
  REQUIRE(env.size() == 1);
  REQUIRE(env[0].rfind("DVR_CRIU_FILL=", 0) == 0);
  return env[0].substr(std::strlen("DVR_CRIU_FILL="));
}

// A parent may write its own stopped child's memory wherever tests run.
void require_fill() {
  std::string why;
  const bool ok = ImageServer::fill_supported(&why);
  INFO(why);
  REQUIRE(ok);
}

}  // namespace

TEST_CASE("image server: filling writes a process's private anonymous pages into it, read-only mappings too; CRIU gets the rest",
          "[proc][page-stream]") {
  require_fill();
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::uint64_t base = free_range(), a = base + kPage, b = base + 0x800000 - 5 * kPage;
  const auto pa = dvrtest::random_bytes(3 * kPage, 21), pb = dvrtest::random_bytes(5 * kPage, 22);
  pid_t child = stopped_child(a, b);
  // b's first two pages are in a read-only file-backed mapping for CRIU: CRIU restores those.
  store_job_of(store, static_cast<std::uint64_t>(child), a, b,
               mm_image({{a, a + 3 * kPage, kAnonPrivate}, {b, b + 2 * kPage, kFilePrivate, 1}, {b + 2 * kPage, b + 5 * kPage, kAnonPrivate}}), pa,
               pb);
  const std::string work = dir / "work";
  ::mkdir(work.c_str(), 0700);
  {
    ImageServer images(store, "job", work, true);
    CHECK(images.fills());
    // The pagemap CRIU reads keeps only the file-backed pages.
    procpages::Pagemap pm;
    std::string pmi = dvrtest::read_file(work + "/pagemap-" + std::to_string(child) + ".img");
    REQUIRE(procpages::parse_pagemap(pmi.data(), pmi.size(), pm));
    REQUIRE(pm.entries.size() == 1);
    CHECK(pm.entries[0].vaddr == b);
    CHECK(pm.entries[0].pages == 2);
    int sk = connect_to(images.start());
    bool exists = false;
    std::string served = stream_file(sk, "pages-1.img", &exists);
    CHECK(exists);
    REQUIRE(served.size() == 2 * kPage);
    CHECK(dvrtest::diff(served.data(), pb.data(), 2 * kPage) == "");
    CHECK_FALSE(images.all_filled());
    int fk = connect_to(fill_socket(images));
    CHECK(ask_fill(fk, child) == 0);
    CHECK(images.all_filled());
    const auto got_a = read_child(child, a, 3 * kPage), got_b = read_child(child, b + 2 * kPage, 3 * kPage);
    CHECK(dvrtest::diff(got_a.data(), pa.data(), got_a.size()) == "");
    CHECK(dvrtest::diff(got_b.data(), pb.data() + 2 * kPage, got_b.size()) == "");
    CHECK(read_child(child, b, 2 * kPage) == std::vector<unsigned char>(2 * kPage, 0));  // CRIU's part: not written by dvr
    // A PID it has nothing for is answered at once; one that is not there fails.
    CHECK(ask_fill(fk, ::getpid()) == 0);
    ::close(fk);
    ::close(sk);
    CHECK_FALSE(images.stop());
  }
  kill_child(child);
  // Without filling, CRIU gets every page.
  const std::string plain = dir / "plain";
  ::mkdir(plain.c_str(), 0700);
  ImageServer images(store, "job", plain, false);
  CHECK_FALSE(images.fills());
  CHECK(images.criu_env().empty());
  procpages::Pagemap pm;
  std::string pmi = dvrtest::read_file(plain + "/pagemap-" + std::to_string(child) + ".img");
  REQUIRE(procpages::parse_pagemap(pmi.data(), pmi.size(), pm));
  CHECK(pm.present_bytes() == 8 * kPage);
}

TEST_CASE("image server: a damaged page stops the fill with corrupt, and a process gone is an error", "[proc][page-stream]") {
  require_fill();
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::uint64_t base = free_range(), a = base + kPage, b = base + 0x800000 - 5 * kPage;
  const auto pa = dvrtest::random_bytes(3 * kPage, 31), pb = dvrtest::random_bytes(5 * kPage, 32);
  pid_t child = stopped_child(a, b);
  store_job_of(store, static_cast<std::uint64_t>(child), a, b, mm_image({{a, a + 3 * kPage, kAnonPrivate}, {b, b + 5 * kPage, kAnonPrivate}}), pa, pb);
  damage_page(dir.store(), pa.data());
  const std::string work = dir / "work";
  ::mkdir(work.c_str(), 0700);
  ImageServer images(store, "job", work, true);
  REQUIRE(images.fills());
  int sk = connect_to(images.start());
  int fk = connect_to(fill_socket(images));
  CHECK(ask_fill(fk, child) != 0);
  CHECK_FALSE(images.all_filled());
  const auto got = read_child(child, a, 3 * kPage);
  kill_child(child);
  CHECK(ask_fill(fk, child) != 0);  // gone: nothing to fill
  ::close(fk);
  ::close(sk);
  std::exception_ptr e = images.stop();
  REQUIRE(e);
  auto c = dvrtest::catch_error([&] { std::rethrow_exception(e); });
  INFO(c.what);
  CHECK(got == std::vector<unsigned char>(3 * kPage, 0));  // nothing of the damaged chunk written
  CHECK(c.code == Errc::corrupt);
  CHECK_THAT(c.what, Catch::Contains("job"));
}

TEST_CASE("image server: processes with pages at the same addresses are left to CRIU (it shares them copy-on-write)", "[proc][page-stream]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::uint64_t a = 0x7e0000001000;
  const auto p1 = dvrtest::random_bytes(3 * kPage, 41), p2 = dvrtest::random_bytes(2 * kPage, 42);
  PageStream ps(store, "job", "", "two processes");
  serve(ps, [&](FakeCriu& c) {
    c.open(10);
    c.pages(a, p1);
    c.open(11);
    c.pages(a + kPage, p2);  // inside 10's range
    c.close();
  });
  dvr::proc::impl::Meta meta;
  meta.info.pid = 10;
  meta.paged_images = ps.paged_images();
  std::string text = dvr::proc::impl::encode_meta(meta);
  const std::string mm = mm_image({{a, a + 4 * kPage, kAnonPrivate}});
  ps.finish({{"mm-10.img", mm.data(), mm.size(), false, std::nullopt},
             {"mm-11.img", mm.data(), mm.size(), false, std::nullopt},
             {dvr::proc::impl::kMetaRegion, text.data(), text.size(), false, std::nullopt}});
  const std::string work = dir / "work";
  ::mkdir(work.c_str(), 0700);
  ImageServer images(store, "job", work, true);
  CHECK_FALSE(images.fills());
  for (const char* f : {"/pagemap-10.img", "/pagemap-11.img"}) {
    procpages::Pagemap pm;
    std::string pmi = dvrtest::read_file(work + f);
    REQUIRE(procpages::parse_pagemap(pmi.data(), pmi.size(), pm));
    CHECK(pm.present_bytes() > 0);
  }
}

TEST_CASE("mm images: plain private anonymous and writable private file mappings are fillable, touching ones merged; malformed images are refused",
          "[proc][page-stream]") {
  constexpr std::uint32_t kVdso = (1u << 0) | (1u << 3) | (1u << 9), kHeap = (1u << 0) | (1u << 5) | (1u << 9);
  constexpr std::uint32_t kFileShared = (1u << 0) | (1u << 7);
  const std::string mm = mm_image({{0x1000, 0x3000, kAnonPrivate},
                                   {0x3000, 0x5000, kHeap},
                                   {0x5000, 0x6000, kFilePrivate, 1},  // read-only: CRIU's
                                   {0x7000, 0x9000, kVdso},
                                   {0xa000, 0xb000, kAnonPrivate},
                                   {0xb000, 0xc000, kFilePrivate},  // a sealed heap: its copy-on-write pages
                                   {0xd000, 0xe000, kFileShared}});
  std::vector<std::pair<std::uint64_t, std::uint64_t>> r;
  REQUIRE(procpages::private_ranges(mm.data(), mm.size(), r));
  CHECK(r == std::vector<std::pair<std::uint64_t, std::uint64_t>>{{0x1000, 0x5000}, {0xa000, 0xc000}});
  for (std::size_t cut : {std::size_t{3}, std::size_t{11}, mm.size() - 1})
    CHECK_FALSE(procpages::private_ranges(mm.data(), cut, r));
  const std::string unsorted = mm_image({{0x5000, 0x6000, kAnonPrivate}, {0x1000, 0x2000, kAnonPrivate}});
  CHECK_FALSE(procpages::private_ranges(unsorted.data(), unsorted.size(), r));
  const std::string unaligned = mm_image({{0x1001, 0x2000, kAnonPrivate}});
  CHECK_FALSE(procpages::private_ranges(unaligned.data(), unaligned.size(), r));
}
