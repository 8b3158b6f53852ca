// An open-addressing hash map from 64-bit keys, for the store's hottest table
// (the use count of every stored location: each snapshot looks up one entry
// per chunk). One array, linear probing, deletion by backward shift: a lookup
// costs about one cache miss instead of a node chase.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dvr::detail {

template <class Value>
class FlatMap {
 public:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};  // never a key

  Value* find(std::uint64_t key) {
    if (slots_.empty()) return nullptr;
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return &slots_[i].value;
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

  /// The value of `key`, default-constructed first if absent.
  Value& operator[](std::uint64_t key) {
    if ((count_ + 1) * 4 > slots_.size() * 3) grow();
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return slots_[i].value;
      if (slots_[i].key == kEmpty) {
        slots_[i].key = key;
        slots_[i].value = Value{};
        ++count_;
        return slots_[i].value;
      }
    }
  }

  void erase(std::uint64_t key) {
    if (slots_.empty()) return;
    std::size_t i = home(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == kEmpty) return;
      i = (i + 1) & mask_;
    }
    // Move later entries of the probe sequence back over the hole, so that
    // lookups never stop early at it.
    for (std::size_t j = (i + 1) & mask_; slots_[j].key != kEmpty; j = (j + 1) & mask_) {
      std::size_t h = home(slots_[j].key);
      bool between = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (between) continue;
      slots_[i] = slots_[j];
      i = j;
    }
    slots_[i].key = kEmpty;
    --count_;
  }

  void clear() {
    slots_.clear();
    mask_ = 0;
    count_ = 0;
  }
  std::size_t size() const { return count_; }

 private:
  struct Slot {
    std::uint64_t key = kEmpty;
    Value value{};
  };
  std::size_t home(std::uint64_t key) const { return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ull) >> 17) & mask_; }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(old.empty() ? 1024 : old.size() * 2, Slot{});
    mask_ = slots_.size() - 1;
    count_ = 0;
    for (auto& s : old)
      if (s.key != kEmpty) (*this)[s.key] = s.value;
  }
  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
  std::size_t count_ = 0;
};

}  // namespace dvr::detail
