// Allocating free pack space for new data (next fit, then best fit among the gaps, then a pack's end), and the space in flight while a snapshot is written.
#include <fcntl.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <optional>
#include <sstream>

#include "dvr/dvr.hpp"
#include "base/memops.hpp"
#include "format/chunks.hpp"
#include "base/progress.hpp"
#include "store/store_impl.hpp"

namespace dvr::detail {

bool StoreImpl::range_free(std::uint32_t pack, std::uint64_t offset, std::uint64_t length) const {
  if (offset < kPackHeaderSize || live_.overlaps(pack, offset, length)) return false;
  for (auto& f : in_flight_)
    if (f.pack == pack && f.offset < offset + length && offset < f.offset + f.length) return false;
  return true;
}

StoreImpl::Placement StoreImpl::allocate(std::uint64_t length, std::optional<Placement> hint, unsigned writer) {
  auto ids = packs->ids();
  // New space (a pack's end) goes to packs of the writer's own on memory
  // media: a tmpfs file is copied into by one writer at a time (its inode
  // lock), so two writers appending to one pack take as long as one
  // (docs/format.md, "Pack files"). Elsewhere, and while some manifest cannot
  // be read (new data then goes to the quarantine pack alone), one pack grows.
  const unsigned ways = medium == Medium::dram && unreadable_.empty() ? std::max(1u, threads) : 1u;
  auto mine = [&](std::uint32_t id) { return (id - 1) % ways == writer % ways; };  // writer 0: pack 1
  // Heap packs (sealed heaps, mapped copy-on-write by their programs) never
  // take new data; the pack that may grow is the writer's newest of the others.
  std::uint32_t newest = 0;
  for (auto id : ids)
    if (!packs->is_heap(id) && mine(id)) newest = id;
  const std::uint64_t first = std::max(kPackHeaderSize, round_up_page(test_first_offset));
  const std::uint64_t max_size = kMaxPackSize + (first - kPackHeaderSize);
  auto usable = [&](std::uint32_t id) { return !packs->is_heap(id) && (unreadable_.empty() || id == quarantine_pack_); };
  auto exists = [&](std::uint32_t id) { return std::binary_search(ids.begin(), ids.end(), id); };
  // Next fit: right after the previous block of the same snapshot, so that a
  // snapshot's data stays contiguous and no search is needed.
  if (hint && usable(hint->pack) && exists(hint->pack) && hint->offset >= first && range_free(hint->pack, hint->offset, length)) {
    std::uint64_t size = packs->size_of(hint->pack);
    if (hint->offset + length <= size) return *hint;
    if (hint->pack == newest && hint->offset + length <= max_size) {
      packs->grow(hint->pack, std::min(max_size, std::max(hint->offset + length, 2 * size)));
      return *hint;
    }
  }
  // The lowest offset in [lo, hi) of `pack` where `length` bytes fit clear of
  // the blocks in flight (few: one per block taken since the last publish).
  std::vector<InFlight> flying = in_flight_;
  std::sort(flying.begin(), flying.end(),
            [](const InFlight& x, const InFlight& y) { return std::tie(x.pack, x.offset) < std::tie(y.pack, y.offset); });
  auto fit_in = [&](std::uint32_t pack, std::uint64_t lo, std::uint64_t hi) -> std::optional<std::uint64_t> {
    std::uint64_t cursor = lo;
    auto fl = std::lower_bound(flying.begin(), flying.end(), pack, [](const InFlight& f, std::uint32_t p) { return f.pack < p; });
    for (; fl != flying.end() && fl->pack == pack; ++fl) {
      if (fl->offset + fl->length <= cursor) continue;
      if (fl->offset >= cursor + length) break;
      cursor = fl->offset + fl->length;
    }
    if (cursor + length <= hi) return cursor;
    return std::nullopt;
  };
  // Best fit among the free gaps between data in use (space of removed
  // snapshots, the unused ends of earlier blocks): the smallest gap that
  // holds `length`, found through the gaps' size index however much the
  // store holds.
  std::optional<Placement> found;
  live_.for_gaps_from(length, [&](const LiveSpace::Gap& g) {
    if (!usable(g.pack) || !exists(g.pack)) return false;
    std::uint64_t lo = std::max(g.begin, first);
    if (lo + length > g.end || g.end > packs->size_of(g.pack)) return false;
    if (auto at = fit_in(g.pack, lo, g.end)) found = Placement{g.pack, *at};
    return found.has_value();
  });
  if (found) return *found;
  // Then the space after each of the writer's packs' last data, growing its newest.
  for (auto id : ids) {
    if (!usable(id) || !mine(id)) continue;
    const std::uint64_t size = packs->size_of(id);
    if (auto at = fit_in(id, live_.end_of(id, first), id == newest ? max_size : size)) {
      if (*at + length > size) packs->grow(id, std::min(max_size, std::max(*at + length, 2 * size)));
      return {id, *at};
    }
  }
  std::uint32_t id = ids.empty() ? 1 : ids.back() + 1;
  while (!mine(id))
    ++id;  // the writer's own (pack ids need not be consecutive)
  packs->create(id, std::max(kInitialPackSize, first + length), first + length);
  if (!unreadable_.empty()) quarantine_pack_ = id;
  return {id, first};
}

StoreImpl::AllocationScope::~AllocationScope() {
  // A snapshot that failed (a full disk, say) gives its space back at once,
  // rather than leaving the file system full until the next gc.
  if (!committed_) {
    for (auto& f : store_.in_flight_)
      store_.packs->punch(f.pack, f.offset, f.length);
    store_.packs->discard_writes();  // and the page hash files as they were
  }
  store_.in_flight_.clear();
  store_.packs->end_writes();
}

std::pair<StoreImpl::Placement, PackWriter> StoreImpl::AllocationScope::take(std::uint64_t length, unsigned writer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (next_.size() <= writer) next_.resize(writer + 1);
  Placement p = store_.allocate(length, next_[writer], writer);
  store_.in_flight_.push_back({p.pack, p.offset, length});
  next_[writer] = Placement{p.pack, p.offset + length};
  return {p, store_.packs->writer(p.pack, p.offset, length)};
}

std::size_t first_damaged(unsigned threads, Packs& packs, const Manifest& m, const std::vector<std::size_t>& which, std::string* why,
                          ProgressMeter* progress) {
  std::uint64_t bytes = 0;
  for (std::size_t i : which) {
    map_chunk(packs, view_of(m, i));
    bytes += m.chunks[i].length;
  }
  std::atomic<std::size_t> first{SIZE_MAX};
  std::mutex mu;
  parallel_for(threads, which.size(), bytes, [&](std::size_t b, std::size_t e) {
    for (std::size_t k = b; k < e && k < first.load() && !(progress && progress->stopped()); ++k) {
      std::string bad = check_chunk(packs, view_of(m, which[k]));
      if (progress) progress->add(m.chunks[which[k]].length);
      if (bad.empty()) continue;
      std::lock_guard<std::mutex> lock(mu);
      if (k < first.load()) {
        first = k;
        *why = std::move(bad);
      }
      return;
    }
  }, progress);
  return first.load();
}

}  // namespace dvr::detail
