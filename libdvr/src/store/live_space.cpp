// LiveSpace: extents in use and the size index of the gaps between them.
#include "store/live_space.hpp"

#include <cstdint>
#include <iterator>

namespace dvr::detail {

void LiveSpace::regap(Map::iterator it) {
  auto& [key, ext] = *it;
  if (ext.gap) gaps_.erase({ext.gap, key.first, key.second});
  std::uint64_t from = base_;
  if (it != extents_.begin()) {
    auto prev = std::prev(it);
    if (prev->first.first == key.first) from = prev->first.second + prev->second.length;
  }
  ext.gap = key.second > from ? key.second - from : 0;
  if (ext.gap) gaps_.insert({ext.gap, key.first, key.second});
}

void LiveSpace::set(std::uint32_t pack, std::uint64_t offset, std::uint64_t length) {
  auto [it, added] = extents_.try_emplace({pack, offset});
  it->second.length = length;
  if (added) regap(it);
  if (auto next = std::next(it); next != extents_.end() && next->first.first == pack) regap(next);
}

void LiveSpace::erase(std::uint32_t pack, std::uint64_t offset) {
  auto it = extents_.find({pack, offset});
  if (it == extents_.end()) return;
  if (it->second.gap) gaps_.erase({it->second.gap, pack, offset});
  auto next = extents_.erase(it);
  if (next != extents_.end() && next->first.first == pack) regap(next);
}

void LiveSpace::clear() {
  extents_.clear();
  gaps_.clear();
}

bool LiveSpace::overlaps(std::uint32_t pack, std::uint64_t offset, std::uint64_t length) const {
  auto next = extents_.lower_bound({pack, offset});
  if (next != extents_.end() && next->first.first == pack && next->first.second < offset + length) return true;
  if (next == extents_.begin()) return false;
  auto prev = std::prev(next);
  return prev->first.first == pack && prev->first.second + prev->second.length > offset;
}

std::uint64_t LiveSpace::end_of(std::uint32_t pack, std::uint64_t floor) const {
  auto it = pack == UINT32_MAX ? extents_.end() : extents_.lower_bound({pack + 1, 0});
  if (it == extents_.begin()) return floor;
  auto last = std::prev(it);
  if (last->first.first != pack) return floor;
  std::uint64_t end = last->first.second + last->second.length;
  return end > floor ? end : floor;
}

}  // namespace dvr::detail
