// Memory DVR — thin clones: copy-on-write views of a snapshot.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dvr/session.hpp"
#include "dvr/store.hpp"

namespace dvr {

struct CloneOptions {
  /// Check every chunk of the snapshot against its checksum before the clone
  /// is handed out: one read of the snapshot, no memory used. false opens in
  /// milliseconds and trusts the store (`dvr verify` still checks it).
  bool verify = true;
};

/// A copy-on-write view of one snapshot's regions, mapped from the store's
/// pack files: it costs no memory until written, writes stay private to the
/// clone and never change the snapshot, and any number of clones of one
/// snapshot can live at once. While a clone lives, the data it maps is
/// treated as in use by the store (not reused, not freed by gc), even if the
/// snapshot is removed. Regions are read-write; they go away with the clone.
class DVR_EXPORT Clone {
 public:
  ~Clone();
  Clone(Clone&&) noexcept;
  Clone& operator=(Clone&&) noexcept;
  Clone(const Clone&) = delete;
  Clone& operator=(const Clone&) = delete;

  const std::string& session() const;
  const std::string& snapshot() const;
  /// The region called `name`. Throws not_found.
  Region& region(const std::string& name);
  std::vector<Region*> regions() const;

  struct DVR_NO_EXPORT State;  // opaque (hidden: libdvr's own)

 private:
  explicit Clone(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
  friend class Store;
};

}  // namespace dvr
