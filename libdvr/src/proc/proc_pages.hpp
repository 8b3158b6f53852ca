// CRIU page images laid out by virtual address, so that a second dump of a
// job deduplicates against the first even when pages moved in the image.
//
// CRIU writes a process's memory as pages-ID.img: the present pages, back to
// back, in the order of the entries of pagemap-PID.img (vaddr, nr_pages,
// flags). One page more anywhere (a heap that grew) shifts every later page
// in the file, so comparing files page by page finds nothing equal. dvr
// therefore stores a page image as "windows": one region per 4 MiB-aligned
// 4 MiB of the process's address space that holds present pages, each page
// at its virtual offset (absent pages read as zero and cost nothing). A page
// that did not change is at the same place in the same window in every dump.
// Restore rebuilds pages-ID.img from the windows and the stored pagemap.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "base/mapping.hpp"

namespace dvr::detail::procpages {

inline constexpr std::uint64_t kWindow = 4ull << 20;

inline constexpr std::uint32_t kPePresent = 1u << 2;  // PE_PRESENT in CRIU's pagemap.proto: the pages are in the pages image
inline constexpr std::uint32_t kPeParent = 1u << 0;   // PE_PARENT: the pages are in the parent dump's images

struct Entry {
  std::uint64_t vaddr = 0;
  std::uint64_t pages = 0;
  bool present = false;  // its pages are in the pages image
  std::uint32_t flags = 0;  // CRIU's PE_* flags
};

struct Pagemap {
  std::uint32_t pages_id = 0;
  std::vector<Entry> entries;
  std::uint64_t present_bytes() const;
};

/// Decodes pagemap-PID.img (CRIU's image: two magics, then length-prefixed
/// protobuf PagemapHead and PagemapEntry messages; nr_pages is field 5 from
/// CRIU 4.2 on, compat_nr_pages (field 2) before). false when the bytes are
/// not such an image, or entries overlap or are out of order.
bool parse_pagemap(const char* data, std::size_t size, Pagemap& out);

/// The address ranges [start, end) of mm-PID.img's mappings that are plain
/// private memory: private anonymous (VMA_AREA_REGULAR | VMA_ANON_PRIVATE)
/// or writable private file mappings (VMA_FILE_PRIVATE, PROT_WRITE: their
/// dumped pages are the copy-on-write ones), nothing special (no vDSO, vvar,
/// AIO ring, SysV IPC, memfd, shadow stack, guard, hugetlb or plugin
/// mapping), in address order: where a restore may write pages into the
/// restored process itself. false when the bytes are not an mm image.
bool private_ranges(const char* data, std::size_t size, std::vector<std::pair<std::uint64_t, std::uint64_t>>& out);

/// pagemap-ID.img as CRIU writes it (magics, PagemapHead, one PagemapEntry
/// per entry with both page counts): what a dump received as a page stream
/// stores, so that restore finds the image CRIU would have written.
std::string encode_pagemap(const Pagemap& pm);

/// Windows of one page image: anonymous reservations of kWindow bytes with
/// the file's pages mapped in at their virtual offsets (MAP_FIXED), read-only
/// and private for a dump, read-write and shared for a restore (writes go to
/// the file). Unmapped on destruction.
class Windows {
 public:
  struct Window {
    std::uint64_t start = 0;  // virtual address in the dumped process
    void* base = nullptr;     // where it is mapped here
  };
  Windows() = default;
  Windows(const Windows&) = delete;
  Windows& operator=(const Windows&) = delete;

  /// false (with *why) when the map does not fit the file.
  bool build(const Pagemap& pm, int pages_fd, std::uint64_t file_size, bool writable, std::string* why);
  const std::vector<Window>& windows() const { return windows_; }

 private:
  std::vector<Window> windows_;
  std::vector<Mapping> maps_;  // maps_[k] is windows_[k]'s reservation
};

/// Region name of a window: "mem-PAGESID-0000ADDRESS" (16 hex digits).
std::string window_region(std::uint32_t pages_id, std::uint64_t start);

}  // namespace dvr::detail::procpages
