#include "track/cow.hpp"

#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/hash.hpp"
#include "base/os.hpp"
#include "dvr/error.hpp"

namespace dvr::detail {

namespace {
constexpr std::uint64_t kFeatureWpHugetlbfsShmem = 1ull << 12;  // UFFD_FEATURE_WP_HUGETLBFS_SHMEM (5.19)
constexpr std::uint64_t kFeatureWpUnpopulated = 1ull << 13;     // UFFD_FEATURE_WP_UNPOPULATED (6.4)
constexpr unsigned long kIocNew = _IO(0xAA, 0x00);              // USERFAULTFD_IOC_NEW (/dev/userfaultfd, 6.1)
constexpr std::uintptr_t kPage = kPageSize;

// A userfaultfd that also sees faults taken in kernel mode, or -1.
int open_full_uffd(std::string* why) {
  int fd = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
  if (fd >= 0) return fd;
  int err = errno;
  int dev = ::open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
  if (dev >= 0) {
    fd = ::ioctl(dev, kIocNew, O_CLOEXEC | O_NONBLOCK);
    ::close(dev);
    if (fd >= 0) return fd;
  }
  *why = std::string("background snapshots need a userfaultfd that also catches the kernel's writes into the memory (") +
         std::strerror(err) +
         "); run as root or with CAP_SYS_PTRACE, set vm.unprivileged_userfaultfd=1, or grant access to /dev/userfaultfd";
  return -1;
}
}  // namespace

std::unique_ptr<CowGuard> CowGuard::open(std::string* why) {
  std::string what;
  int uffd = open_full_uffd(&what);
  if (uffd < 0) {
    if (why) *why = what;
    return nullptr;
  }
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = kFeatureWpUnpopulated | kFeatureWpHugetlbfsShmem;
  if (::ioctl(uffd, UFFDIO_API, &api) != 0) {
    int err = errno;
    ::close(uffd);
    if (why)
      *why = std::string("userfaultfd lacks write-protection of never-touched and shared memory (") + std::strerror(err) +
             "); background snapshots need Linux 6.4 or newer";
    return nullptr;
  }
  int wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    int err = errno;
    ::close(uffd);
    if (why) *why = std::string("cannot create an eventfd (") + std::strerror(err) + ")";
    return nullptr;
  }
  return std::unique_ptr<CowGuard>(new CowGuard(uffd, wake));
}

CowGuard::CowGuard(int uffd, int wake) : uffd_(uffd), wake_(wake) {}

CowGuard::~CowGuard() {
  if (handler_.joinable()) {
    std::uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_, &one, sizeof one);
    handler_.join();
  }
  for (std::size_t a = 0; a < areas_.size(); ++a)
    release(static_cast<int>(a));
  ::close(uffd_);
  ::close(wake_);
}

int CowGuard::add(AddrRange range, const char* data, std::uint64_t size, std::uint32_t chunk_size, std::string* why) {
  auto ar = std::make_unique<Area>();
  ar->range = range;
  ar->data = data;
  ar->size = size;
  ar->chunk_size = chunk_size;
  const auto b = reinterpret_cast<std::uintptr_t>(data);
  ar->page0 = b & ~(kPage - 1);
  ar->pages = (((b + size + kPage - 1) & ~(kPage - 1)) - ar->page0) / kPage;
  ar->slot = std::make_unique<std::atomic<std::uint32_t>[]>(ar->pages);
  ar->state = std::make_unique<std::atomic<std::uint8_t>[]>(ar->chunks());
  ar->hit = std::make_unique<std::atomic<std::uint8_t>[]>(ar->chunks());
  if (range.first < range.second) {
    uffdio_register reg{};
    reg.range.start = range.first;
    reg.range.len = range.second - range.first;
    reg.mode = UFFDIO_REGISTER_MODE_WP;
    if (::ioctl(uffd_, UFFDIO_REGISTER, &reg) != 0) {
      if (why) *why = std::string("cannot register the memory for copy-before-write (") + std::strerror(errno) + ")";
      return -1;
    }
    ar->registered = true;
    uffdio_writeprotect wp{};
    wp.range = reg.range;
    wp.mode = UFFDIO_WRITEPROTECT_MODE_WP;
    if (::ioctl(uffd_, UFFDIO_WRITEPROTECT, &wp) != 0) {
      if (why) *why = std::string("cannot write-protect the memory (") + std::strerror(errno) + ")";
      uffdio_range r{range.first, range.second - range.first};
      ::ioctl(uffd_, UFFDIO_UNREGISTER, &r);
      return -1;
    }
  }
  pool_pages_ += static_cast<std::uint32_t>(ar->pages);
  areas_.push_back(std::move(ar));
  return static_cast<int>(areas_.size() - 1);
}

void CowGuard::start() {
  // Room for a copy of every page: reserved address space, committed only as
  // pages are copied aside.
  pool_ = Mapping::anonymous(std::size_t{std::max<std::uint32_t>(pool_pages_, 1)} * kPage, "for pages copied aside during a background snapshot");
  // Partial pages at unaligned ends are not protected: copy them now.
  for (auto& ar : areas_) {
    for (std::size_t p = 0; p < ar->pages; ++p) {
      const std::uintptr_t page = ar->page0 + p * kPage;
      if (page >= ar->range.first && page < ar->range.second) continue;
      copy_aside(*ar, p);
    }
  }
  handler_ = std::thread([this] { run(); });
}

const char* CowGuard::copy_of(const Area& ar, std::size_t page) const {
  std::uint32_t s = ar.slot[page].load(std::memory_order_acquire);
  return s ? pool_.bytes() + std::size_t{s - 1} * kPage : nullptr;
}

void CowGuard::copy_aside(Area& ar, std::size_t page) {
  if (ar.slot[page].load(std::memory_order_relaxed)) return;
  const std::uintptr_t addr = ar.page0 + page * kPage;
  // The region's bytes in this page (an end page holds fewer).
  const auto b = reinterpret_cast<std::uintptr_t>(ar.data), e = b + ar.size;
  const std::uintptr_t lo = std::max(addr, b), hi = std::min(addr + kPage, e);
  // Its chunks (a page of an unaligned region may straddle two).
  const std::uint64_t c0 = (lo - b) / ar.chunk_size, c1 = (hi - 1 - b) / ar.chunk_size;
  bool wanted = false;
  for (std::uint64_t c = c0; c <= c1; ++c)
    wanted = wanted || ar.state[c].load(std::memory_order_acquire) != 2;
  if (!wanted) return;
  char* to = pool_.bytes() + std::size_t{pool_used_} * kPage;
  std::memcpy(to + (lo - addr), reinterpret_cast<const char*>(lo), hi - lo);
  ar.slot[page].store(++pool_used_, std::memory_order_release);
  for (std::uint64_t c = c0; c <= c1; ++c)
    ar.hit[c].store(1, std::memory_order_release);
  copied_.fetch_add(1, std::memory_order_relaxed);
}

void CowGuard::handle(std::uintptr_t address) {
  const std::uintptr_t page = address & ~(kPage - 1);
  for (auto& ar : areas_) {
    if (page < ar->range.first || page >= ar->range.second) continue;
    copy_aside(*ar, (page - ar->page0) / kPage);
    break;
  }
  // Lifting the protection wakes the writer. It fails only for memory no
  // longer registered (released meanwhile): that woke the writer already.
  uffdio_writeprotect wp{};
  wp.range.start = page;
  wp.range.len = kPage;
  wp.mode = 0;
  ::ioctl(uffd_, UFFDIO_WRITEPROTECT, &wp);
  faults_.fetch_add(1, std::memory_order_relaxed);
}

void CowGuard::run() {
  uffd_msg msgs[64];
  for (;;) {
    pollfd fds[2] = {{uffd_, POLLIN, 0}, {wake_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents) return;
    ssize_t n = ::read(uffd_, msgs, sizeof msgs);
    if (n <= 0) continue;  // EAGAIN: another wake-up took it
    for (ssize_t i = 0; i < n / static_cast<ssize_t>(sizeof(uffd_msg)); ++i)
      if (msgs[i].event == UFFD_EVENT_PAGEFAULT) handle(static_cast<std::uintptr_t>(msgs[i].arg.pagefault.address));
  }
}

void CowGuard::skip(int a, std::uint64_t j) { areas_[static_cast<std::size_t>(a)]->state[j].store(2, std::memory_order_release); }

bool CowGuard::begin(int a, std::uint64_t j) {
  Area& ar = *areas_[static_cast<std::size_t>(a)];
  ar.state[j].store(1, std::memory_order_seq_cst);
  return ar.hit[j].load(std::memory_order_seq_cst) != 0;
}

bool CowGuard::touched(int a, std::uint64_t j) const {
  // Everything read from live memory before this point is ordered before the
  // load: a page written before we read it was copied aside (and marked)
  // before its protection was lifted.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return areas_[static_cast<std::size_t>(a)]->hit[j].load(std::memory_order_acquire) != 0;
}

void CowGuard::stage(int a, std::uint64_t j, char* out) const {
  const Area& ar = *areas_[static_cast<std::size_t>(a)];
  const auto b = reinterpret_cast<std::uintptr_t>(ar.data);
  const std::uint64_t lo = j * ar.chunk_size, hi = std::min<std::uint64_t>(lo + ar.chunk_size, ar.size);
  std::memcpy(out, ar.data + lo, hi - lo);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  // Pages copied aside by now include every page written before memcpy read it.
  for (std::size_t p = (b + lo - ar.page0) / kPage; p * kPage + ar.page0 < b + hi; ++p) {
    const char* copy = copy_of(ar, p);
    if (!copy) continue;
    const std::uintptr_t addr = ar.page0 + p * kPage;
    const std::uintptr_t from = std::max<std::uintptr_t>(addr, b + lo), to = std::min<std::uintptr_t>(addr + kPage, b + hi);
    std::memcpy(out + (from - b - lo), copy + (from - addr), to - from);
  }
}

void CowGuard::done(int a, std::uint64_t j) { areas_[static_cast<std::size_t>(a)]->state[j].store(2, std::memory_order_release); }

void CowGuard::release(int a) {
  Area& ar = *areas_[static_cast<std::size_t>(a)];
  if (!ar.registered) return;
  uffdio_range r{ar.range.first, ar.range.second - ar.range.first};
  ::ioctl(uffd_, UFFDIO_UNREGISTER, &r);  // wakes any writer still waiting
  ar.registered = false;
}

}  // namespace dvr::detail
