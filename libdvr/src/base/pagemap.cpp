// PAGEMAP_SCAN queries (base/pagemap.hpp).
#include "base/pagemap.hpp"

#include <fcntl.h>
#include <unistd.h>

#include "base/os.hpp"

namespace dvr::detail {

bool present_ranges(std::uintptr_t start, std::uintptr_t end, std::vector<std::pair<std::uintptr_t, std::uintptr_t>>& out) {
  // Opened per query, not kept: CRIU would record an open pagemap by its
  // path (/proc/PID/pagemap), and a restored process has another PID.
  Fd pagemap(::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC));
  if (!pagemap) return false;
  PageRegion vec[512];
  while (start < end) {
    PmScanArg arg{};
    arg.size = sizeof arg;
    arg.start = start;
    arg.end = end;
    arg.vec = reinterpret_cast<std::uint64_t>(vec);
    arg.vec_len = sizeof vec / sizeof vec[0];
    arg.category_mask = kPageIsPresent;
    arg.return_mask = kPageIsPresent;
    const long n = ::ioctl(pagemap.get(), kPagemapScan, &arg);
    if (n < 0) return false;
    for (long i = 0; i < n; ++i) {
      if (!out.empty() && out.back().second == vec[i].start)
        out.back().second = vec[i].end;
      else
        out.emplace_back(vec[i].start, vec[i].end);
    }
    if (arg.walk_end <= start) return false;  // no progress: give up rather than loop
    start = arg.walk_end;
  }
  return true;
}

}  // namespace dvr::detail
