// Memory DVR — sessions, regions and named snapshots.
//
// A Session is one application's named set of memory regions inside a store.
// snapshot() captures every region at once under a name; restore() puts them
// back bit-exact. A Session is used from one thread at a time; the regions must
// not be written by other threads while a snapshot or restore runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dvr/store.hpp"

namespace dvr {

/// A named range of memory in a session.
class Region {
 public:
  const std::string& name() const { return name_; }
  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  /// True when the SDK allocated it (alloc()); false for track()ed memory.
  bool sdk_owned() const { return sdk_owned_; }
  /// The region as a span of T (size() / sizeof(T) elements).
  template <class T>
  std::span<T> as() const {
    return {static_cast<T*>(data_), size_ / sizeof(T)};
  }

  Region(std::string name, void* data, std::size_t size, bool sdk_owned)
      : name_(std::move(name)), data_(data), size_(size), sdk_owned_(sdk_owned) {}
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  ~Region();

 private:
  std::string name_;
  void* data_;
  std::size_t size_;
  bool sdk_owned_;
};

struct SnapshotOptions {
  /// Free text kept with the snapshot (shown by `dvr ls` / `dvr info`).
  std::string label;
  /// Replace an existing snapshot of the same name (atomically) instead of
  /// failing with already_exists.
  bool replace = false;
};

class Session {
 public:
  /// Opens session `name` in `store`. Names: 1–128 characters from
  /// [A-Za-z0-9._-], not starting with '.'.
  Session(Store store, std::string name);
  ~Session();
  Session(Session&&) noexcept;
  Session& operator=(Session&&) noexcept;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& name() const;
  Store& store();

  /// Registers caller-owned memory [data, data+size) as region `name`. The memory
  /// must stay valid while tracked. Throws already_exists, invalid_argument
  /// (bad name, size 0, null pointer, overlap with another region).
  Region& track(const std::string& name, void* data, std::size_t size);

  /// Allocates an SDK-owned, page-aligned, zero-filled region of `size` bytes. It
  /// lives until untrack() or the session's end. Throws no_space on mmap failure.
  Region& alloc(const std::string& name, std::size_t size);

  /// Forgets a region (and frees it if SDK-owned). Throws not_found.
  void untrack(const std::string& name);

  /// The region called `name`. Throws not_found.
  Region& region(const std::string& name);
  std::vector<Region*> regions() const;

  /// Captures every region as snapshot `name`. Identical chunks already in the
  /// store are not written again, so a snapshot of unchanged data costs almost
  /// no space. Data is persisted before the snapshot becomes visible: after a
  /// crash it is either fully there or not at all. Throws already_exists (unless
  /// options.replace), invalid_argument (no regions, bad name), no_space (store
  /// full: nothing is published, earlier snapshots are intact).
  SnapshotInfo snapshot(const std::string& name, const SnapshotOptions& options = {});

  /// Puts every region recorded in snapshot `name` back, bit-exact. All data is
  /// checked against its checksum before the first byte of live memory changes:
  /// on any error (not_found, corrupt, invalid_argument when a region is missing
  /// or changed size) live memory is untouched. Regions of the session that the
  /// snapshot does not record are left as they are.
  void restore(const std::string& name);

  /// The snapshot most recently taken or restored by this session object ("" if
  /// none): the parent of the next snapshot.
  const std::string& head() const;

  /// Same as store().list(name()).
  std::vector<SnapshotInfo> list() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace dvr
