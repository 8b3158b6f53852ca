#include "track/dirty.hpp"

#include "base/mapping.hpp"
#include "base/os.hpp"
#include "base/pagemap.hpp"

#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

// Constants newer than the installed kernel headers (Debian 12 ships 6.1
// headers; the features need 6.4 and 6.7). Values are the kernel's UAPI.
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif
namespace {
constexpr std::uint64_t kFeatureWpUnpopulated = 1ull << 13;  // UFFD_FEATURE_WP_UNPOPULATED (6.4)
constexpr std::uint64_t kFeatureWpAsync = 1ull << 15;        // UFFD_FEATURE_WP_ASYNC (6.7)
}  // namespace

namespace dvr::detail {

std::unique_ptr<WriteTracker> WriteTracker::open(std::string* why) {
  auto fail = [&](const std::string& what) -> std::unique_ptr<WriteTracker> {
    if (why) *why = what;
    return nullptr;
  };
  int uffd = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
  if (uffd < 0)
    return fail(std::string("userfaultfd is not available (") + std::strerror(errno) +
                "); check vm.unprivileged_userfaultfd or run a kernel with CONFIG_USERFAULTFD");
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = kFeatureWpAsync | kFeatureWpUnpopulated;
  if (::ioctl(uffd, UFFDIO_API, &api) != 0) {
    int err = errno;
    ::close(uffd);
    return fail(std::string("userfaultfd lacks asynchronous write-protection (") + std::strerror(err) + "); it needs Linux 6.7 or newer");
  }
  int pagemap = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (pagemap < 0) {
    int err = errno;
    ::close(uffd);
    return fail(std::string("cannot open /proc/self/pagemap (") + std::strerror(err) + ")");
  }
  ::close(pagemap);  // opened for each scan: an open one would pin this PID into a CRIU dump
  std::unique_ptr<WriteTracker> t(new WriteTracker(uffd));
  // Probe the whole mechanism on one page of our own.
  long page = ::sysconf(_SC_PAGESIZE);
  Mapping probe_page;
  try {
    probe_page = Mapping::anonymous(static_cast<std::size_t>(page), "for a probe page");
  } catch (const Error&) {
    return fail("cannot map a probe page");
  }
  void* probe = probe_page.data();
  AddrRange r{reinterpret_cast<std::uintptr_t>(probe), reinterpret_cast<std::uintptr_t>(probe) + static_cast<std::uintptr_t>(page)};
  std::string add_why;
  std::vector<AddrRange> written;
  bool ok = t->add(r, &add_why);
  if (ok) {
    static_cast<volatile char*>(probe)[0] = 1;
    ok = t->collect(r, written) && written.size() == 1;
    if (!ok) add_why = "PAGEMAP_SCAN is not available or did not see a write; it needs Linux 6.7 or newer";
    written.clear();
    ok = ok && t->collect(r, written) && written.empty();
    t->remove(r);
  }
  probe_page.reset();
  if (!ok) return fail(add_why);
  return t;
}

WriteTracker::~WriteTracker() { ::close(uffd_); }

bool WriteTracker::add(AddrRange range, std::string* why, bool protect) {
  uffdio_register reg{};
  reg.range.start = range.first;
  reg.range.len = range.second - range.first;
  reg.mode = UFFDIO_REGISTER_MODE_WP;
  if (::ioctl(uffd_, UFFDIO_REGISTER, &reg) != 0) {
    if (why) *why = std::string("cannot register the memory for write tracking (") + std::strerror(errno) + ")";
    return false;
  }
  if (!protect) return true;
  uffdio_writeprotect wp{};
  wp.range = reg.range;
  wp.mode = UFFDIO_WRITEPROTECT_MODE_WP;
  if (::ioctl(uffd_, UFFDIO_WRITEPROTECT, &wp) != 0) {
    if (why) *why = std::string("cannot write-protect the memory (") + std::strerror(errno) + ")";
    remove(range);
    return false;
  }
  return true;
}

void WriteTracker::remove(AddrRange range) {
  uffdio_range r{range.first, range.second - range.first};
  ::ioctl(uffd_, UFFDIO_UNREGISTER, &r);
}

bool WriteTracker::unprotect(AddrRange range) {
  uffdio_writeprotect wp{};
  wp.range.start = range.first;
  wp.range.len = range.second - range.first;
  wp.mode = 0;
  return ::ioctl(uffd_, UFFDIO_WRITEPROTECT, &wp) == 0;
}

namespace {
// PAGEMAP_SCAN over `range` of the process whose pagemap `pagemap` is: the
// pages written since they were last protected (into *out when given),
// protecting them again when `protect`. false when the range is not
// registered for asynchronous write protection.
bool scan_pagemap(int pagemap, AddrRange range, bool protect, std::vector<AddrRange>* out) {
  const bool report = out != nullptr;
  PageRegion vec[512];
  std::uint64_t start = range.first;
  while (start < range.second) {
    PmScanArg arg{};
    arg.size = sizeof arg;
    arg.flags = (protect ? kScanWpMatching : 0) | kScanCheckWpAsync;
    arg.start = start;
    arg.end = range.second;
    arg.vec = report ? reinterpret_cast<std::uint64_t>(vec) : 0;
    arg.vec_len = report ? sizeof vec / sizeof vec[0] : 0;
    arg.category_mask = kPageIsWritten;
    arg.return_mask = kPageIsWritten;
    long n = ::ioctl(pagemap, kPagemapScan, &arg);
    if (n < 0) return false;
    for (long i = 0; report && i < n; ++i) {
      if (!out->empty() && out->back().second == vec[i].start)
        out->back().second = vec[i].end;
      else
        out->emplace_back(vec[i].start, vec[i].end);
    }
    if (arg.walk_end <= start) return false;  // no progress: give up rather than loop
    start = arg.walk_end;
  }
  return true;
}
}  // namespace

bool WriteTracker::scan(AddrRange range, bool protect, std::vector<AddrRange>* out) {
  // /proc/self/pagemap is opened per scan rather than kept open: CRIU would
  // record an open one by its path (/proc/PID/pagemap), and a restored
  // process has another PID.
  Fd pagemap(::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC));
  return pagemap && scan_pagemap(pagemap.get(), range, protect, out);
}

bool written_pages_of(pid_t pid, AddrRange range, std::vector<AddrRange>& out) {
  Fd pagemap(::open(("/proc/" + std::to_string(pid) + "/pagemap").c_str(), O_RDONLY | O_CLOEXEC));
  return pagemap && scan_pagemap(pagemap.get(), range, false, &out);
}

bool reprotect_pages_of(pid_t pid, AddrRange range) {
  Fd pagemap(::open(("/proc/" + std::to_string(pid) + "/pagemap").c_str(), O_RDONLY | O_CLOEXEC));
  return pagemap && scan_pagemap(pagemap.get(), range, true, nullptr);
}

bool WriteTracker::collect(AddrRange range, std::vector<AddrRange>& out) { return scan(range, true, &out); }

bool WriteTracker::written(AddrRange range, std::vector<AddrRange>& out) { return scan(range, false, &out); }

bool WriteTracker::reprotect(AddrRange range) { return scan(range, true, nullptr); }

}  // namespace dvr::detail
