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
  /// write-protected (nothing else may have them registered). Partial pages
  /// at unaligned ends cannot be protected: their bytes are copied aside now.
  /// `chunk_size` is the snapshot's chunk grid, counted from `data`. Returns
  /// the area's number; -1 (with *why) when the memory cannot be protected
  /// (the registration is undone).
  int add(AddrRange range, const char* data, std::uint64_t size, std::uint32_t chunk_size, std::string* why);
  /// Starts the handler thread (after every add()).
  void start();

  // ---- the snapshot worker, chunk `j` of area `a` --------------------------
  /// The chunk will not be read (inherited from a base, or known zero): its
  /// pages need not be copied aside any more.
  void skip(int a, std::uint64_t j);
  /// Before the chunk is read: from here on every page of it written is
  /// copied aside. True when a page of it was copied aside already: read it
  /// through stage().
  bool begin(int a, std::uint64_t j);
  /// After it was read from live memory: true when a page of it has been
  /// copied aside since begin(), so the read may mix old and new bytes.
  bool touched(int a, std::uint64_t j) const;
  /// The chunk's bytes as they were at protection, into `out` (the chunk's
  /// length): the live bytes with every page copied aside put back. Exact
  /// between begin() and done().
  void stage(int a, std::uint64_t j, char* out) const;
  /// The chunk is stored for good: its pages are no longer copied aside.
  void done(int a, std::uint64_t j);

  /// Unregisters area `a` (its pages are writable again, untracked): the
  /// caller hands the range back to the session's tracker.
  void release(int a);

  /// Protection faults handled so far, and pages copied aside.
  std::uint64_t faults() const { return faults_.load(std::memory_order_relaxed); }
  std::uint64_t copied() const { return copied_.load(std::memory_order_relaxed); }

 private:
  CowGuard(int uffd, int wake);
  struct Area {
    AddrRange range;          // registered whole pages
    const char* data;         // the region
    std::uint64_t size;
    std::uint32_t chunk_size;
    std::uintptr_t page0;     // first memory page holding region bytes
    std::size_t pages;        // memory pages from page0 holding region bytes
    std::unique_ptr<std::atomic<std::uint32_t>[]> slot;  // per memory page: 1 + its copy in pool_, 0 = none
    std::unique_ptr<std::atomic<std::uint8_t>[]> state;  // per chunk: 0 waiting, 1 being read, 2 done
    std::unique_ptr<std::atomic<std::uint8_t>[]> hit;    // per chunk: a page of it was copied aside
    bool registered = false;
    std::uint64_t chunks() const { return (size + chunk_size - 1) / chunk_size; }
  };
  void run();
  void handle(std::uintptr_t address);
  // Copies memory page `page` of area `ar` aside (once), marking its chunks.
  void copy_aside(Area& ar, std::size_t page);
  const char* copy_of(const Area& ar, std::size_t page) const;

  int uffd_;
  int wake_;  // eventfd: stops the handler
  std::vector<std::unique_ptr<Area>> areas_;
  Mapping pool_;  // copies of pages, 4 KiB each, taken in order (reserved, not committed)
  std::uint32_t pool_used_ = 0, pool_pages_ = 0;
  std::thread handler_;
  std::atomic<std::uint64_t> faults_{0}, copied_{0};
};

}  // namespace dvr::detail
