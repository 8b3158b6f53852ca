// dvr::Arena (see dvr/arena.hpp, docs/arena.md).
//
// Layout, all inside the region so that a snapshot holds it:
//   page 0      Header: magic, version, the bump pointer, bytes in use, the root
//               pointer, the heads of the free lists (absolute addresses: the
//               arena never moves)
//   after it    blocks, handed out by a bump pointer and reused from free lists:
//               small (<= 4 KiB): nine size classes 16 B .. 4 KiB, no header
//               (std::pmr passes the size back on deallocate); a free block
//               holds the next free block's address.
//               large: a 16-byte header before the block (its capacity); free
//               ones form one first-fit list.
#include "dvr/arena.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/hash.hpp"
#include "dvr/error.hpp"

namespace dvr {

namespace {

constexpr std::uint64_t kMagic = 0x414e455241525644ull;  // "DVRARENA"
constexpr std::uint32_t kVersion = 1;
using detail::kPageSize;     // the arena's unit of address, size and growth
constexpr int kClasses = 9;  // 16, 32, ..., 4096
constexpr std::size_t kMaxSmall = 4096;

struct Header {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t classes;
  std::uint64_t committed;
  std::uint64_t bump;
  std::uint64_t used;
  std::uint64_t root;
  std::uint64_t free_small[kClasses];
  std::uint64_t free_large;
};
static_assert(sizeof(Header) <= kPageSize);

std::size_t round_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }

int class_of(std::size_t bytes) {
  int c = 0;
  std::size_t s = 16;
  while (s < bytes) {
    s <<= 1;
    ++c;
  }
  return c;
}

}  // namespace

Arena::Arena(Session& session, std::string name, const ArenaOptions& o)
    : session_(session), name_(std::move(name)), address_(o.address), reserve_(o.reserve), grow_step_(o.grow_step) {
  if (address_ == 0 || address_ % kPageSize || reserve_ == 0 || reserve_ % kPageSize || o.initial < 2 * kPageSize || o.initial > reserve_ ||
      o.grow_step == 0 || o.grow_step % kPageSize || o.initial % kPageSize)
    throw Error(Errc::invalid_argument, "arena '" + name_ +
                                            "': address, reserve, initial and grow_step must be whole pages, "
                                            "initial at least two pages and at most reserve");
  void* p = ::mmap(base(), reserve_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
  char where[64];
  std::snprintf(where, sizeof where, "[%#llx, %#llx)", static_cast<unsigned long long>(address_),
                static_cast<unsigned long long>(address_ + reserve_));
  if (p == MAP_FAILED) {
    if (errno == EEXIST)
      throw Error(Errc::already_exists, "arena '" + name_ + "': the address range " + where +
                                            " is already in use (another arena, a library or a mapping); choose another ArenaOptions::address");
    throw Error(Errc::no_space, "arena '" + name_ + "': cannot reserve " + where + ": " + std::strerror(errno));
  }
  if (p != base()) {  // a kernel without MAP_FIXED_NOREPLACE put it elsewhere
    ::munmap(p, reserve_);
    throw Error(Errc::already_exists, "arena '" + name_ + "': the address range " + where + " is not available here");
  }
  if (::mprotect(base(), o.initial, PROT_READ | PROT_WRITE) != 0) {
    ::munmap(base(), reserve_);
    throw Error(Errc::no_space, "arena '" + name_ + "': cannot commit " + std::to_string(o.initial) + " bytes");
  }
  auto* h = static_cast<Header*>(base());
  std::memset(h, 0, sizeof *h);
  h->magic = kMagic;
  h->version = kVersion;
  h->classes = kClasses;
  h->committed = o.initial;
  h->bump = address_ + kPageSize;
  try {
    session_.track(name_, base(), o.initial);
  } catch (...) {
    ::munmap(base(), reserve_);
    throw;
  }
}

Arena::~Arena() {
  try {
    session_.untrack(name_);
  } catch (const Error&) {
  }
  ::munmap(base(), reserve_);
}

std::size_t Arena::committed() const { return static_cast<const Header*>(base())->committed; }
std::size_t Arena::used() const { return static_cast<const Header*>(base())->used; }
void Arena::set_root(void* p) { static_cast<Header*>(base())->root = reinterpret_cast<std::uint64_t>(p); }
void* Arena::root() const { return reinterpret_cast<void*>(static_cast<const Header*>(base())->root); }

void Arena::resize(std::size_t n) {
  auto* h = static_cast<Header*>(base());
  std::size_t cur = h->committed;
  if (n > cur && ::mprotect(static_cast<char*>(base()) + cur, n - cur, PROT_READ | PROT_WRITE) != 0) throw std::bad_alloc();
  try {
    session_.untrack(name_);
    session_.track(name_, base(), n);
  } catch (...) {
    try {
      session_.track(name_, base(), cur);
    } catch (...) {
    }
    if (n > cur) ::mprotect(static_cast<char*>(base()) + cur, n - cur, PROT_NONE);
    throw std::bad_alloc();  // what std::pmr expects of a resource
  }
  if (n < cur) {
    ::madvise(static_cast<char*>(base()) + n, cur - n, MADV_DONTNEED);
    ::mprotect(static_cast<char*>(base()) + n, cur - n, PROT_NONE);
  }
  h->committed = n;
}

void* Arena::do_allocate(std::size_t bytes, std::size_t alignment) {
  auto* h = static_cast<Header*>(base());
  if (bytes == 0) bytes = 1;
  if (alignment == 0 || (alignment & (alignment - 1)) || alignment > kPageSize) throw std::bad_alloc();
  if (bytes > reserve_) throw std::bad_alloc();  // also keeps the sums below from wrapping
  std::uint64_t user = 0, end = 0;
  if (bytes <= kMaxSmall && alignment <= 16) {
    int c = class_of(bytes);
    if (std::uint64_t f = h->free_small[c]) {
      h->free_small[c] = *reinterpret_cast<std::uint64_t*>(f);
      h->used += std::size_t{16} << c;
      return reinterpret_cast<void*>(f);
    }
    user = round_up(h->bump, 16);
    end = user + (std::size_t{16} << c);
  } else if (bytes <= kMaxSmall) {
    // Small with a large alignment: its class's free list when the head is
    // aligned enough (blocks of a class at least as large as the alignment
    // were carved at that alignment), else from the bump pointer.
    int c = class_of(std::max(bytes, alignment));
    if (std::uint64_t f = h->free_small[c]; f && f % alignment == 0) {
      h->free_small[c] = *reinterpret_cast<std::uint64_t*>(f);
      h->used += std::size_t{16} << c;
      return reinterpret_cast<void*>(f);
    }
    user = round_up(h->bump, std::max<std::size_t>(alignment, 16));
    end = user + (std::size_t{16} << c);
  } else {
    std::size_t cap = round_up(bytes, 16);
    // First fit among freed large blocks, wasting at most half.
    std::uint64_t* link = &h->free_large;
    for (std::uint64_t b = *link; b; link = reinterpret_cast<std::uint64_t*>(b), b = *link) {
      std::uint64_t have = *reinterpret_cast<std::uint64_t*>(b - 16);
      if (have >= cap && have <= 2 * cap && b % alignment == 0) {
        *link = *reinterpret_cast<std::uint64_t*>(b);
        h->used += have;
        return reinterpret_cast<void*>(b);
      }
    }
    user = round_up(h->bump + 16, std::max<std::size_t>(alignment, 16));
    end = user + cap;
  }
  if (end > address_ + h->committed) {
    std::size_t want = round_up(end - address_, grow_step_);
    if (want > reserve_) {
      if (end - address_ > reserve_) throw std::bad_alloc();  // the reservation is full
      want = reserve_;
    }
    resize(want);
    h = static_cast<Header*>(base());
  }
  if (bytes > kMaxSmall) *reinterpret_cast<std::uint64_t*>(user - 16) = end - user;
  h->bump = end;
  h->used += end - user;
  return reinterpret_cast<void*>(user);
}

void Arena::do_deallocate(void* p, std::size_t bytes, std::size_t alignment) {
  if (!p) return;
  auto* h = static_cast<Header*>(base());
  auto a = reinterpret_cast<std::uint64_t>(p);
  if (bytes == 0) bytes = 1;
  if (bytes <= kMaxSmall) {
    int c = class_of(alignment > 16 ? std::max(bytes, alignment) : bytes);
    *reinterpret_cast<std::uint64_t*>(a) = h->free_small[c];
    h->free_small[c] = a;
    h->used -= std::size_t{16} << c;
    return;
  }
  std::uint64_t cap = *reinterpret_cast<std::uint64_t*>(a - 16);
  *reinterpret_cast<std::uint64_t*>(a) = h->free_large;
  h->free_large = a;
  h->used -= cap;
}

void Arena::restore(const std::string& snapshot) {
  SnapshotInfo info = session_.store().info(session_.name(), snapshot);
  std::size_t want = 0;
  for (auto& r : info.regions)
    if (r.name == name_) want = r.size;
  const std::size_t cur = committed();
  if (want == 0 || want == cur) {
    session_.restore(snapshot);
    return;
  }
  if (want > reserve_ || want % kPageSize)
    throw Error(Errc::invalid_argument, "arena '" + name_ + "': snapshot '" + snapshot + "' records it with " + std::to_string(want) +
                                            " bytes, which does not fit its reservation of " + std::to_string(reserve_));
  // Re-register the region at the recorded size, keeping every byte of the
  // present one until the restore succeeded.
  if (want > cur && ::mprotect(static_cast<char*>(base()) + cur, want - cur, PROT_READ | PROT_WRITE) != 0)
    throw Error(Errc::no_space, "arena '" + name_ + "': cannot commit " + std::to_string(want) + " bytes");
  auto retrack = [&](std::size_t n) {
    session_.untrack(name_);
    session_.track(name_, base(), n);
  };
  try {
    retrack(want);
    session_.restore(snapshot);
    const auto* h = static_cast<const Header*>(base());
    if (h->magic != kMagic || h->version != kVersion || h->committed != want)
      throw Error(Errc::corrupt, "region '" + name_ + "' of snapshot '" + snapshot + "' is not an arena of this kind");
  } catch (...) {
    try {
      retrack(cur);
    } catch (...) {
    }
    if (want > cur) ::mprotect(static_cast<char*>(base()) + cur, want - cur, PROT_NONE);
    throw;
  }
  // The header now says `want` (it was restored too); release what is past it.
  if (want < cur) {
    ::madvise(static_cast<char*>(base()) + want, cur - want, MADV_DONTNEED);
    ::mprotect(static_cast<char*>(base()) + want, cur - want, PROT_NONE);
  }
}

}  // namespace dvr
