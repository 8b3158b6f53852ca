// Copy-before-write for background snapshots (docs/incremental.md,
// "Background snapshots").
//
// The memory of a snapshot being written in the background is registered with
// a userfaultfd in synchronous write-protect mode. A write to a protected page
// stops the writing thread in the kernel and sends us a message; the handler
// thread copies the page's bytes aside (they are still the bytes at the moment
// of protection) and then lifts the protection, which lets the writer go on.
// The snapshot worker reads each chunk from live memory and learns, chunk by
// chunk, whether a page of it was copied aside meanwhile: then it reads the
// chunk again as it was (live bytes with the copied pages put back). So the
// snapshot holds exactly the memory at the moment of protection, however the
// program writes meanwhile.
//
// A memory range can belong to one userfaultfd only, so the session's
// asynchronous write tracker (track/dirty.hpp) gives the range up while the
// guard holds it, and takes it back afterwards.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/mapping.hpp"
#include "track/dirty.hpp"

namespace dvr::detail {

class CowGuard {
 public:
  /// A guard with its own userfaultfd. It must also catch the kernel's own
  /// writes into the memory (read(2) into a region): a userfaultfd limited to
  /// user-mode faults would make such a system call fail with EFAULT. That
  /// takes root, CAP_SYS_PTRACE, vm.unprivileged_userfaultfd=1 or access to
  /// /dev/userfaultfd; nullptr (with *why) without.
  static std::unique_ptr<CowGuard> open(std::string* why);
  ~CowGuard();
  CowGuard(const CowGuard&) = delete;
  CowGuard& operator=(const CowGuard&) = delete;

  /// Puts region memory under the guard: `data`, `size` are the region's
  /// bytes, `range` the whole pages inside them, which are registered and
  /// write-protected (nothing else may have them registered). `chunk_size`
  /// is the snapshot's chunk grid, counted from `data` (a multiple of the
  /// page size). Partial pages at unaligned ends cannot be protected: the
  /// chunks holding them are copied aside by start(). Returns the area's
  /// number; -1 (with *why) when the memory cannot be protected (nothing
  /// stays registered).
  int add(AddrRange range, const char* data, std::uint64_t size, std::uint32_t chunk_size, std::string* why);
  /// Copies the chunks with unprotected ends aside and starts the handler
  /// thread (after every add()).
  void start();

  // ---- the snapshot worker, chunk `j` of area `a` --------------------------
  /// The chunk will not be read (inherited from a base, or known zero).
  void skip(int a, std::uint64_t j);
  /// Before the chunk is read. Returns its bytes as they were at protection
  /// when they were copied aside already (read those), else nullptr (read
  /// live memory, then ask again()).
  const char* begin(int a, std::uint64_t j);
  /// After it was read from live memory: the bytes as they were, when the
  /// chunk was copied aside meanwhile (the read may mix old and new bytes:
  /// store it again from these); else nullptr.
  const char* again(int a, std::uint64_t j) const;
  /// The chunk is stored for good. Its pages are no longer protected once the
  /// chunks around it are done too (writes to them are not seen: the caller
  /// compares the memory with the snapshot afterwards).
  void done(int a, std::uint64_t j);

  /// Unregisters area `a` (its pages are writable again, untracked): the
  /// caller hands the range back to the session's tracker.
  void release(int a);

  /// Stops the handler thread (after release() of every area): every event
  /// it read has been handled. Idempotent; the destructor calls it.
  void finish();
  /// Whether the program discarded memory of an area while it was under the
  /// guard (madvise(MADV_DONTNEED/MADV_REMOVE), a hole punched): the kernel
  /// zaps those pages without a write, so neither a fault nor a copy aside
  /// preserves them, and chunks read after the zap hold zeros (or mix them
  /// with the old bytes). The snapshot must not be published then. Then
  /// also the first such area and the region bytes [lo, hi) discarded in it.
  /// Valid after finish().
  bool discarded(int* area, std::uint64_t* lo, std::uint64_t* hi) const {
    if (!discarded_.load(std::memory_order_acquire)) return false;
    *area = discarded_area_;
    *lo = discarded_lo_;
    *hi = discarded_hi_;
    return true;
  }

  /// Protection faults handled so far, and chunks copied aside because the
  /// program wrote to them before they were read.
  std::uint64_t faults() const { return faults_.load(std::memory_order_relaxed); }
  std::uint64_t copied() const { return copied_.load(std::memory_order_relaxed); }

 private:
  CowGuard(int uffd, int wake);
  static constexpr std::uint64_t kGroup = 64;  // chunks unprotected together once done
  struct Area {
    AddrRange range;          // registered whole pages
    const char* data;         // the region
    std::uint64_t size;
    std::uint32_t chunk_size;
    std::unique_ptr<std::atomic<std::uint32_t>[]> slot;   // per chunk: 1 + its copy in pool_, 0 = none
    std::unique_ptr<std::atomic<std::uint8_t>[]> state;   // per chunk: 0 waiting, 1 being read, 2 done
    std::unique_ptr<std::atomic<std::uint32_t>[]> group;  // per kGroup chunks: how many are done
    bool registered = false;
    std::uint64_t chunks() const { return (size + chunk_size - 1) / chunk_size; }
    std::uint64_t chunk_len(std::uint64_t j) const { return std::min<std::uint64_t>(chunk_size, size - j * chunk_size); }
  };
  void run();
  void handle(std::uintptr_t address);
  // A UFFD_EVENT_REMOVE for [start, end): recorded when it meets an area.
  void removed(std::uintptr_t start, std::uintptr_t end);
  // Copies chunk j of `ar` aside (once, and only while it is still wanted).
  void copy_aside(Area& ar, std::uint64_t j);
  const char* copy_of(const Area& ar, std::uint64_t j) const;
  // Lifts the protection of the whole pages inside region bytes [lo, hi).
  void unprotect(const Area& ar, std::uint64_t lo, std::uint64_t hi);
  void count_done(Area& ar, std::uint64_t j);

  int uffd_;
  int wake_;  // eventfd: stops the handler
  std::vector<std::unique_ptr<Area>> areas_;
  Mapping pool_;  // copies of chunks, chunk_size each, taken in order (reserved, not committed)
  std::uint64_t pool_chunk_ = 0;
  std::atomic<std::uint32_t> pool_used_{0};
  std::uint64_t pool_slots_ = 0;
  std::thread handler_;
  std::atomic<std::uint64_t> faults_{0}, copied_{0};
  std::atomic<bool> discarded_{false};
  int discarded_area_ = -1;  // written by the handler thread before discarded_ is set
  std::uint64_t discarded_lo_ = 0, discarded_hi_ = 0;
};

}  // namespace dvr::detail
