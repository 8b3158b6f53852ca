// PAGEMAP_SCAN (Linux 6.7+): what the kernel's page tables say about ranges of
// a process's address space. The UAPI structures are declared here because
// Debian 12 ships 6.1 kernel headers; the values are the kernel's.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <sys/ioctl.h>

namespace dvr::detail {

struct PageRegion {
  std::uint64_t start, end, categories;
};
struct PmScanArg {
  std::uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
  std::uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
constexpr unsigned long kPagemapScan = _IOWR('f', 16, PmScanArg);  // PAGEMAP_SCAN
constexpr std::uint64_t kPageIsWritten = 1ull << 1;                 // PAGE_IS_WRITTEN
constexpr std::uint64_t kPageIsPresent = 1ull << 3;                 // PAGE_IS_PRESENT
constexpr std::uint64_t kScanWpMatching = 1ull << 0;                // PM_SCAN_WP_MATCHING
constexpr std::uint64_t kScanCheckWpAsync = 1ull << 1;              // PM_SCAN_CHECK_WPASYNC

/// The parts of [start, end) of this process whose pages have a page-table
/// entry (PAGE_IS_PRESENT), ascending and merged, appended to `out`. `start`
/// must be page-aligned (`end` is rounded up). false when the kernel cannot
/// tell (before 6.7, or a bad range): then nothing is known.
bool present_ranges(std::uintptr_t start, std::uintptr_t end, std::vector<std::pair<std::uintptr_t, std::uintptr_t>>& out);

}  // namespace dvr::detail
