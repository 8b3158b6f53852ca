// dvr-uffd-cost — what the kernel charges for the mechanisms behind write
// tracking and background snapshots, measured alone on this machine (no
// library code), so that their figures in dvr-bench can be read against it.
//
//   dvr-uffd-cost [--size 1G] [--json]
//
// On SIZE of populated anonymous memory:
//   wp_uffdio            UFFDIO_WRITEPROTECT of all of it (what a background
//                        snapshot's call pays; per page-table entry)
//   unregister           UFFDIO_UNREGISTER of it (what a switch between
//                        userfaultfds pays)
//   wp_pagemap_scan      PAGEMAP_SCAN protecting it all again after all of it
//                        was written (asynchronous userfaultfds only)
// and per first write to a protected page, one byte in each of 1% of the
// pages at random (peer: the same writes to unprotected memory):
//   fault_async          asynchronous write-protect (resolved in the kernel)
//   fault_sync_poll      synchronous, a handler thread sleeping in poll()
//   fault_sync_spin      synchronous, a handler thread spinning on read()
// JSON lines: name, value (seconds), unit, peer, peer_value, ratio.
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cli_util.hpp"

using namespace dvr::cli;

namespace {

constexpr std::uint64_t kFeatureWpUnpopulated = 1ull << 13;
constexpr std::uint64_t kFeatureWpAsync = 1ull << 15;
struct PmScanArg {
  std::uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
  std::uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
constexpr unsigned long kPagemapScan = _IOWR('f', 16, PmScanArg);

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what + ": " + std::strerror(errno)); }

struct Uffd {
  explicit Uffd(std::uint64_t features) {
    fd = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
    if (fd < 0) fail("userfaultfd (needs root or vm.unprivileged_userfaultfd=1)");
    uffdio_api api{};
    api.api = UFFD_API;
    api.features = features;
    if (::ioctl(fd, UFFDIO_API, &api) != 0) fail("UFFDIO_API");
  }
  ~Uffd() { ::close(fd); }
  void add(char* p, std::size_t n) {
    uffdio_register reg{};
    reg.range = {reinterpret_cast<std::uint64_t>(p), n};
    reg.mode = UFFDIO_REGISTER_MODE_WP;
    if (::ioctl(fd, UFFDIO_REGISTER, &reg) != 0) fail("UFFDIO_REGISTER");
  }
  void protect(char* p, std::size_t n, bool on) {
    uffdio_writeprotect wp{};
    wp.range = {reinterpret_cast<std::uint64_t>(p), n};
    wp.mode = on ? UFFDIO_WRITEPROTECT_MODE_WP : 0;
    if (::ioctl(fd, UFFDIO_WRITEPROTECT, &wp) != 0 && on) fail("UFFDIO_WRITEPROTECT");
  }
  void remove(char* p, std::size_t n) {
    uffdio_range r{reinterpret_cast<std::uint64_t>(p), n};
    if (::ioctl(fd, UFFDIO_UNREGISTER, &r) != 0) fail("UFFDIO_UNREGISTER");
  }
  int fd;
};

char* populated(std::size_t n) {
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) fail("mmap");
  ::madvise(p, n, MADV_NOHUGEPAGE);
  std::memset(p, 1, n);
  return static_cast<char*>(p);
}

// One byte in each of 1% of the pages, at random; seconds.
double scattered_writes(char* p, std::size_t n, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  const std::size_t pages = n / 4096;
  double t0 = seconds_now();
  for (std::size_t k = 0; k < pages / 100; ++k) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[(x % pages) * 4096 + 8] ^= 1;
  }
  return seconds_now() - t0;
}

// A handler thread lifting the protection of each faulting page.
struct Handler {
  Handler(Uffd& u, bool spin) : uffd(u), thread([this, spin] { run(spin); }) {}
  ~Handler() {
    stop = true;
    thread.join();
  }
  void run(bool spin) {
    uffd_msg msg[16];
    while (!stop.load()) {
      if (!spin) {
        pollfd f{uffd.fd, POLLIN, 0};
        if (::poll(&f, 1, 10) <= 0) continue;
      }
      ssize_t r = ::read(uffd.fd, msg, sizeof msg);
      for (ssize_t i = 0; i < r / static_cast<ssize_t>(sizeof(uffd_msg)); ++i)
        if (msg[i].event == UFFD_EVENT_PAGEFAULT) {
          char* page = reinterpret_cast<char*>(msg[i].arg.pagefault.address & ~std::uint64_t{4095});
          uffd.protect(page, 4096, false);
        }
    }
  }
  Uffd& uffd;
  std::atomic<bool> stop{false};
  std::thread thread;
};

}  // namespace

int main(int argc, char** argv) {
  std::uint64_t size = 1ull << 30;
  bool json = false;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--size" && i + 1 < argc)
        size = parse_size(argv[++i]);
      else if (a == "--json")
        json = true;
      else if (a == "-h" || a == "--help") {
        std::cout << "usage: dvr-uffd-cost [--size 1G] [--json]\n";
        return 0;
      } else
        throw std::invalid_argument("unknown argument '" + a + "'");
    }
    const std::size_t n = size;
    struct Row {
      std::string name;
      double value, peer_value;
      std::string peer, note;
    };
    std::vector<Row> rows;
    char* mem = populated(n);
    const double plain = scattered_writes(mem, n, 1);
    {
      Uffd sync(kFeatureWpUnpopulated);
      sync.add(mem, n);
      double t0 = seconds_now();
      sync.protect(mem, n, true);
      double wp = seconds_now() - t0;
      t0 = seconds_now();
      sync.remove(mem, n);
      double unreg = seconds_now() - t0;
      rows.push_back({"wp_uffdio", wp, wp, "self", "UFFDIO_WRITEPROTECT of every populated page"});
      rows.push_back({"unregister", unreg, wp, "wp_uffdio", "UFFDIO_UNREGISTER of the same range"});
    }
    {
      Uffd async(kFeatureWpUnpopulated | kFeatureWpAsync);
      async.add(mem, n);
      async.protect(mem, n, true);
      double faults = scattered_writes(mem, n, 2);
      rows.push_back({"fault_async", faults, plain, "plain_writes", "first writes to 1% of the pages, asynchronous write-protect"});
      std::memset(mem, 2, n);  // everything written
      int pm = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
      if (pm < 0) fail("open /proc/self/pagemap");
      PmScanArg arg{};
      arg.size = sizeof arg;
      arg.flags = 1 | 2;  // PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC
      arg.start = reinterpret_cast<std::uint64_t>(mem);
      arg.end = arg.start + n;
      arg.category_mask = arg.return_mask = 2;  // PAGE_IS_WRITTEN
      double t0 = seconds_now();
      if (::ioctl(pm, kPagemapScan, &arg) < 0) fail("PAGEMAP_SCAN");
      double scan = seconds_now() - t0;
      ::close(pm);
      const double wp = rows[0].value;
      rows.push_back({"wp_pagemap_scan", scan, wp, "wp_uffdio", "PAGEMAP_SCAN protecting every page again after all were written"});
      async.remove(mem, n);
    }
    for (bool spin : {false, true}) {
      Uffd sync(kFeatureWpUnpopulated);
      sync.add(mem, n);
      sync.protect(mem, n, true);
      double faults;
      {
        Handler h(sync, spin);
        faults = scattered_writes(mem, n, spin ? 4 : 3);
      }
      sync.remove(mem, n);
      rows.push_back({spin ? "fault_sync_spin" : "fault_sync_poll", faults, plain, "plain_writes",
                      std::string("first writes to 1% of the pages, synchronous write-protect, handler thread ") +
                          (spin ? "spinning on read()" : "sleeping in poll()")});
    }
    const double writes = static_cast<double>(n / 4096 / 100);
    if (json) {
      std::cout << "{\"name\":\"plain_writes\",\"value\":" << json_number(plain) << ",\"unit\":\"s\",\"peer\":\"self\",\"peer_value\":"
                << json_number(plain) << ",\"ratio\":1,\"bytes\":" << n << "}\n";
      for (auto& r : rows)
        std::cout << "{\"name\":" << json_string(r.name) << ",\"value\":" << json_number(r.value) << ",\"unit\":\"s\",\"peer\":" << json_string(r.peer)
                  << ",\"peer_value\":" << json_number(r.peer_value) << ",\"ratio\":" << json_number(r.peer_value / r.value) << ",\"bytes\":" << n
                  << "}\n";
    } else {
      std::printf("dvr-uffd-cost: %s of populated anonymous memory, %.0f scattered writes\n\n", format_bytes(static_cast<double>(n)).c_str(), writes);
      std::printf("  %-18s %10s %12s   %s\n", "figure", "time", "per item", "what");
      std::printf("  %-18s %10s %9.2f us   %s\n", "plain_writes", format_seconds(plain).c_str(), plain / writes * 1e6, "the same writes, memory not protected");
      for (auto& r : rows) {
        const bool per_write = r.name.rfind("fault", 0) == 0;
        const double per = per_write ? r.value / writes * 1e6 : r.value / static_cast<double>(n / 4096) * 1e9;
        std::printf("  %-18s %10s %9.2f %s   %s\n", r.name.c_str(), format_seconds(r.value).c_str(), per, per_write ? "us" : "ns", r.note.c_str());
      }
    }
    ::munmap(mem, n);
  } catch (const std::exception& e) {
    std::cerr << "dvr-uffd-cost: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
