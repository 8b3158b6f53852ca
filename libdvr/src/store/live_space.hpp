// The pack space in use, in address order, with the free gaps between used
// extents indexed by size: allocation finds a gap in O(log n) however many
// snapshots the store holds (store/space.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <utility>

namespace dvr::detail {

class LiveSpace {
 public:
  using Key = std::pair<std::uint32_t, std::uint64_t>;  // (pack, offset)

  /// Marks [offset, offset + length) of `pack` in use (length rounded up to
  /// pages by the caller); an extent already at `offset` becomes `length` long.
  void set(std::uint32_t pack, std::uint64_t offset, std::uint64_t length);
  /// Frees the extent at `offset` (nothing if there is none).
  void erase(std::uint32_t pack, std::uint64_t offset);
  void clear();

  /// Whether [offset, offset + length) of `pack` overlaps an extent in use.
  bool overlaps(std::uint32_t pack, std::uint64_t offset, std::uint64_t length) const;
  /// The end of the last extent of `pack` (`floor` when it holds none, or
  /// when that end lies below `floor`).
  std::uint64_t end_of(std::uint32_t pack, std::uint64_t floor) const;

  /// A free gap between two extents of one pack (or between `base` and a
  /// pack's first extent): [begin, end).
  struct Gap {
    std::uint32_t pack;
    std::uint64_t begin, end;
  };
  /// Calls `f(gap)` for the gaps of at least `length` bytes, smallest first
  /// (ties: lowest pack and offset), until it returns true.
  template <class F>
  void for_gaps_from(std::uint64_t length, F&& f) const {
    for (auto it = gaps_.lower_bound({length, 0, 0}); it != gaps_.end(); ++it) {
      auto [len, pack, next] = *it;
      if (f(Gap{pack, next - len, next})) return;
    }
  }

  std::size_t size() const { return extents_.size(); }
  /// The space before each pack's first extent counts from here.
  explicit LiveSpace(std::uint64_t base) : base_(base) {}

 private:
  struct Extent {
    std::uint64_t length = 0;
    std::uint64_t gap = 0;  // free bytes between the previous extent (or base_) and this one
  };
  using Map = std::map<Key, Extent>;
  // Recomputes the gap in front of `it` from its predecessor and re-indexes it.
  void regap(Map::iterator it);

  std::uint64_t base_;
  Map extents_;
  std::set<std::tuple<std::uint64_t, std::uint32_t, std::uint64_t>> gaps_;  // (gap length, pack, offset of the extent after it)
};

}  // namespace dvr::detail
