#include "track/cow.hpp"

#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/hash.hpp"
#include "base/memops.hpp"
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
  // EVENT_REMOVE: memory the program discards (madvise DONTNEED/REMOVE)
  // while the snapshot reads it is reported (discarded()).
  api.features = kFeatureWpUnpopulated | kFeatureWpHugetlbfsShmem | UFFD_FEATURE_EVENT_REMOVE;
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

void CowGuard::finish() {
  if (handler_.joinable()) {
    std::uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_, &one, sizeof one);
    handler_.join();
  }
}

CowGuard::~CowGuard() {
  finish();
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
  ar->slot = std::make_unique<std::atomic<std::uint32_t>[]>(ar->chunks());
  ar->state = std::make_unique<std::atomic<std::uint8_t>[]>(ar->chunks());
  ar->group = std::make_unique<std::atomic<std::uint32_t>[]>((ar->chunks() + kGroup - 1) / kGroup);
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
  pool_chunk_ = chunk_size;
  pool_slots_ += ar->chunks();
  areas_.push_back(std::move(ar));
  return static_cast<int>(areas_.size() - 1);
}

void CowGuard::start() {
  // Room for a copy of every chunk: reserved address space, committed only
  // as chunks are copied aside.
  pool_ = Mapping::anonymous(std::max<std::size_t>(pool_slots_ * pool_chunk_, 1), "for memory copied aside during a background snapshot");
  // Bytes outside the protected pages (partial pages at unaligned ends) can
  // change at any time: their chunks are copied now.
  for (auto& ar : areas_) {
    const auto b = reinterpret_cast<std::uintptr_t>(ar->data);
    auto sticks_out = [&](std::uint64_t j) {
      const std::uintptr_t lo = b + j * ar->chunk_size, hi = lo + ar->chunk_len(j);
      return lo < ar->range.first || hi > ar->range.second;
    };
    if (ar->range.first >= ar->range.second) {
      for (std::uint64_t j = 0; j < ar->chunks(); ++j)
        copy_aside(*ar, j);
      continue;
    }
    // Only the first and the last chunk can reach past the whole pages.
    if (sticks_out(0)) copy_aside(*ar, 0);
    if (ar->chunks() > 1 && sticks_out(ar->chunks() - 1)) copy_aside(*ar, ar->chunks() - 1);
  }
  handler_ = std::thread([this] {
    ::pthread_setname_np(::pthread_self(), "dvr-cow");
    run();
  });
}

const char* CowGuard::copy_of(const Area& ar, std::uint64_t j) const {
  std::uint32_t s = ar.slot[j].load(std::memory_order_acquire);
  return s ? pool_.bytes() + std::size_t{s - 1} * pool_chunk_ : nullptr;
}

void CowGuard::copy_aside(Area& ar, std::uint64_t j) {
  if (ar.slot[j].load(std::memory_order_relaxed) || ar.state[j].load(std::memory_order_acquire) == 2) return;
  // Every protected page of the chunk still holds its bytes of the moment of
  // protection: pages are unprotected only once their chunks are copied or
  // done.
  const std::uint32_t s = pool_used_.fetch_add(1) + 1;
  char* to = pool_.bytes() + std::size_t{s - 1} * pool_chunk_;
  {
    RacyReads racy;  // the program writes its other chunks meanwhile
    std::memcpy(to, ar.data + j * ar.chunk_size, ar.chunk_len(j));
  }
  ar.slot[j].store(s, std::memory_order_release);
  copied_.fetch_add(1, std::memory_order_relaxed);
}

void CowGuard::unprotect(const Area& ar, std::uint64_t lo, std::uint64_t hi) {
  const auto b = reinterpret_cast<std::uintptr_t>(ar.data);
  std::uintptr_t from = std::max<std::uintptr_t>((b + lo + kPage - 1) & ~(kPage - 1), ar.range.first);
  std::uintptr_t to = std::min<std::uintptr_t>((b + hi) & ~(kPage - 1), ar.range.second);
  if (from >= to) return;
  uffdio_writeprotect wp{};
  wp.range.start = from;
  wp.range.len = to - from;
  wp.mode = 0;
  ::ioctl(uffd_, UFFDIO_WRITEPROTECT, &wp);  // fails only for memory released meanwhile
}

void CowGuard::handle(std::uintptr_t address) {
  const std::uintptr_t page = address & ~(kPage - 1);
  for (auto& arp : areas_) {
    Area& ar = *arp;
    if (page < ar.range.first || page >= ar.range.second) continue;
    const auto b = reinterpret_cast<std::uintptr_t>(ar.data);
    // The chunks this page holds bytes of (two where a chunk boundary of an
    // unaligned region falls inside it): copied aside unless done; then
    // their pages, this one included, may be written.
    const std::uint64_t c0 = (std::max(page, b) - b) / ar.chunk_size;
    const std::uint64_t c1 = (std::min<std::uintptr_t>(page + kPage, b + ar.size) - 1 - b) / ar.chunk_size;
    for (std::uint64_t c = c0; c <= c1; ++c)
      copy_aside(ar, c);
    for (std::uint64_t c = c0; c <= c1; ++c)
      unprotect(ar, c * ar.chunk_size, c * ar.chunk_size + ar.chunk_len(c));
    break;
  }
  // Lifting the protection of the page wakes the writer (a page straddling
  // two chunks is not inside either's whole pages).
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
    // Faults come in bursts: keep reading for a moment before sleeping again
    // (waking a sleeping thread costs more than the fault itself).
    for (int idle = 0; idle < 200;) {
      ssize_t n = ::read(uffd_, msgs, sizeof msgs);
      if (n <= 0) {
        ++idle;
        continue;
      }
      idle = 0;
      for (ssize_t i = 0; i < n / static_cast<ssize_t>(sizeof(uffd_msg)); ++i) {
        if (msgs[i].event == UFFD_EVENT_PAGEFAULT) handle(static_cast<std::uintptr_t>(msgs[i].arg.pagefault.address));
        // The discarding thread goes on as soon as this is read, and zaps the
        // pages: whether before or after the snapshot read them is unknown.
        if (msgs[i].event == UFFD_EVENT_REMOVE)
          removed(static_cast<std::uintptr_t>(msgs[i].arg.remove.start), static_cast<std::uintptr_t>(msgs[i].arg.remove.end));
      }
    }
  }
}

void CowGuard::removed(std::uintptr_t start, std::uintptr_t end) {
  // Only registered memory sends this, and the areas do not change once the
  // handler runs.
  for (std::size_t a = 0; a < areas_.size(); ++a) {
    const Area& ar = *areas_[a];
    if (end <= ar.range.first || ar.range.second <= start) continue;
    if (!discarded_.load(std::memory_order_relaxed)) {
      const auto b = reinterpret_cast<std::uintptr_t>(ar.data);
      discarded_area_ = static_cast<int>(a);
      discarded_lo_ = std::max(start, b) - b;
      discarded_hi_ = std::min<std::uintptr_t>(end, b + ar.size) - b;
      discarded_.store(true, std::memory_order_release);
    }
    return;
  }
}

void CowGuard::count_done(Area& ar, std::uint64_t j) {
  const std::uint64_t g = j / kGroup;
  const std::uint64_t first = g * kGroup, last = std::min(first + kGroup, ar.chunks());
  if (ar.group[g].fetch_add(1) + 1 != last - first) return;
  // The whole group is stored: its pages need no protection any more.
  unprotect(ar, first * ar.chunk_size, (last - 1) * ar.chunk_size + ar.chunk_len(last - 1));
}

void CowGuard::skip(int a, std::uint64_t j) {
  Area& ar = *areas_[static_cast<std::size_t>(a)];
  ar.state[j].store(2, std::memory_order_release);
  count_done(ar, j);
}

const char* CowGuard::begin(int a, std::uint64_t j) {
  Area& ar = *areas_[static_cast<std::size_t>(a)];
  ar.state[j].store(1, std::memory_order_seq_cst);
  return copy_of(ar, j);
}

const char* CowGuard::again(int a, std::uint64_t j) const {
  // Everything read from live memory before this point is ordered before the
  // load: a chunk written before we read it was copied aside before any of
  // its pages became writable.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return copy_of(*areas_[static_cast<std::size_t>(a)], j);
}

void CowGuard::done(int a, std::uint64_t j) {
  Area& ar = *areas_[static_cast<std::size_t>(a)];
  ar.state[j].store(2, std::memory_order_release);
  count_done(ar, j);
}

void CowGuard::release(int a) {
  Area& ar = *areas_[static_cast<std::size_t>(a)];
  if (!ar.registered) return;
  uffdio_range r{ar.range.first, ar.range.second - ar.range.first};
  ::ioctl(uffd_, UFFDIO_UNREGISTER, &r);  // wakes any writer still waiting
  ar.registered = false;
}

}  // namespace dvr::detail
