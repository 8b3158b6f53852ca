// libFuzzer target: CRIU's pagemap image parser (proc/proc_pages.hpp,
// parse_pagemap), which reads pagemap-*.img of a dump or a received process
// snapshot. What it accepts must be sorted, non-overlapping and inside the
// 64-bit address space, and must survive encode_pagemap and a second parse.
// The same bytes go to private_ranges (mm-*.img, which decides what a
// restore writes into the restored process): what it accepts is sorted,
// non-empty, page-aligned and non-overlapping ranges.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "proc/proc_pages.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace dvr::detail::procpages;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> anon;
  if (private_ranges(reinterpret_cast<const char*>(data), size, anon))
    for (std::size_t i = 0; i < anon.size(); ++i) {
      if (anon[i].first >= anon[i].second || anon[i].first % 4096 || anon[i].second % 4096) std::abort();
      if (i > 0 && anon[i].first <= anon[i - 1].second) std::abort();  // merged when touching, never overlapping
    }
  Pagemap pm;
  if (!parse_pagemap(reinterpret_cast<const char*>(data), size, pm)) return 0;
  for (std::size_t i = 0; i < pm.entries.size(); ++i) {
    const Entry& e = pm.entries[i];
    const std::uint64_t bytes = e.pages * 4096;
    if (e.pages == 0 || e.vaddr % 4096 || e.vaddr > UINT64_MAX - bytes + 1) std::abort();
    if (i > 0) {
      const Entry& p = pm.entries[i - 1];
      if (e.vaddr < p.vaddr || e.vaddr - p.vaddr < p.pages * 4096) std::abort();  // overlapping or unsorted
    }
  }
  (void)pm.present_bytes();
  std::string img = encode_pagemap(pm);
  Pagemap again;
  if (!parse_pagemap(img.data(), img.size(), again) || again.entries.size() != pm.entries.size() || again.pages_id != pm.pages_id) std::abort();
  for (std::size_t i = 0; i < pm.entries.size(); ++i)
    if (again.entries[i].vaddr != pm.entries[i].vaddr || again.entries[i].pages != pm.entries[i].pages ||
        again.entries[i].present != pm.entries[i].present)
      std::abort();
  return 0;
}
