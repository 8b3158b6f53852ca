// Memory DVR — a fixed-address arena for pointer-rich data (docs/arena.md).
//
// A dvr::Arena is a std::pmr::memory_resource over an SDK-owned region mapped
// at a fixed virtual address. Containers and objects allocated from it live
// entirely inside the region, and so does the allocator's own state (free
// lists, the bump pointer, a root pointer). A snapshot of the session
// captures all of it; a restore brings back the containers *and* the
// allocator consistently, at the same addresses, so every pointer into the
// arena is valid again:
//
//   dvr::Session s(store, "scene");
//   dvr::Arena arena(s, "heap");                       // reserved at 0x6e0000000000
//   auto* scene = dvr::make<Scene>(arena, ...);        // std::pmr containers inside
//   arena.set_root(scene);
//   s.snapshot("base");
//   apply_effect(*scene);
//   arena.restore("base");                              // the graph as it was, pointers and all
//
// The rule that follows: pointers *into the arena* stay valid across restores
// in the same process. Objects holding pointers out of it — vtables, function
// pointers, pointers into libraries or the normal heap — are valid only in the
// process that made them. Reopening an arena in a new process (same address,
// then restore()) is supported for plain data.
//
// An Arena is not thread-safe (like std::pmr::unsynchronized_pool_resource).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <memory_resource>
#include <new>
#include <string>
#include <utility>

#include "dvr/session.hpp"

namespace dvr {

struct ArenaOptions {
  /// Where the arena lives. Reserved with MAP_FIXED_NOREPLACE: if anything is
  /// mapped there already, the constructor throws (already_exists).
  std::uintptr_t address = 0x6e0000000000;
  /// Address space reserved; the arena grows up to this.
  std::size_t reserve = std::size_t{64} << 30;
  /// Bytes usable at once (committed and tracked), and the growth step.
  std::size_t initial = std::size_t{64} << 20;
  std::size_t grow_step = std::size_t{64} << 20;
};

class DVR_EXPORT Arena : public std::pmr::memory_resource {
 public:
  /// Reserves the address range, commits options.initial bytes and registers
  /// them as region `name` of `session` (the arena must not outlive it).
  /// Throws already_exists (address range in use), invalid_argument (bad
  /// options, or `name` taken), no_space.
  Arena(Session& session, std::string name, const ArenaOptions& options = {});
  ~Arena() override;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  void* base() const { return reinterpret_cast<void*>(address_); }
  const std::string& name() const { return name_; }
  /// Bytes committed (the region's size now).
  std::size_t committed() const;
  /// Bytes handed out and not freed.
  std::size_t used() const;
  /// True when `p` points into the arena.
  bool contains(const void* p) const {
    auto a = reinterpret_cast<std::uintptr_t>(p);
    return a >= address_ && a < address_ + reserve_;
  }

  /// One pointer kept in the arena's header (hence snapshotted and restored
  /// with it): where a restored arena's objects are found.
  void set_root(void* p);
  void* root() const;
  template <class T>
  T* root_as() const {
    return static_cast<T*>(root());
  }

  /// Restores the session to `snapshot` (Session::restore), first resizing
  /// the arena to the size it had then (it may have grown since, or be new).
  /// Throws what Session::restore throws; on error the arena is unchanged.
  void restore(const std::string& snapshot);

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) override;
  bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override { return this == &other; }

 private:
  void resize(std::size_t committed);  // commits or releases, then re-registers the region
  Session& session_;
  std::string name_;
  std::uintptr_t address_;
  std::size_t reserve_;
  std::size_t grow_step_;
};

/// Constructs a T in the arena with a polymorphic allocator (so T's pmr
/// members allocate from the arena too).
template <class T, class... Args>
T* make(Arena& arena, Args&&... args) {
  std::pmr::polymorphic_allocator<T> alloc(&arena);
  T* p = alloc.allocate(1);
  try {
    alloc.construct(p, std::forward<Args>(args)...);
  } catch (...) {
    alloc.deallocate(p, 1);
    throw;
  }
  return p;
}

/// Destroys and frees what make() built.
template <class T>
void destroy(Arena& arena, T* p) {
  std::pmr::polymorphic_allocator<T> alloc(&arena);
  std::allocator_traits<std::pmr::polymorphic_allocator<T>>::destroy(alloc, p);
  alloc.deallocate(p, 1);
}

}  // namespace dvr
