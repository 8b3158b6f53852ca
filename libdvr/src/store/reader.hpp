// Reading snapshots out of a store, the counterpart of writer.hpp: every
// reader of stored data (restore, clones, send, base_on) holds one while it
// uses manifests and pack data.
#pragma once

#include <mutex>
#include <optional>
#include <string>

#include "format/chunks.hpp"
#include "format/manifest.hpp"
#include "store/store_impl.hpp"

namespace dvr::detail {

/// While it lives, this thread holds the store's mutex and the shared data
/// lock (`lock`): no snapshot's data can be freed or reused meanwhile, though
/// writers may add snapshots (into free space only). The pack mappings are
/// current from its construction on.
class SnapshotReader {
 public:
  explicit SnapshotReader(StoreImpl& store) : store_(store), guard_(store.mu), lock_(store, false) { store_.packs->refresh_mappings(); }
  SnapshotReader(const SnapshotReader&) = delete;
  SnapshotReader& operator=(const SnapshotReader&) = delete;

  StoreImpl& store() { return store_; }
  Packs& packs() { return *store_.packs; }

  /// Reads and checks session/name's manifest with its page hashes; `raw`,
  /// when given, receives the file's bytes. Throws not_found, corrupt.
  Manifest load(const std::string& session, const std::string& name, std::string* raw = nullptr) const {
    return store_.load_manifest(session, name, raw);
  }

  /// `cached` when it is the published version of session/name (nothing is
  /// read: rolling back to a session's base costs no decoding), else the
  /// manifest loaded into `holder`.
  const Manifest& current(const Manifest* cached, const std::string& session, const std::string& name, std::optional<Manifest>& holder) const {
    if (cached && cached->session == session && cached->name == name && store_.manifest_unchanged(*cached)) return *cached;
    holder = load(session, name);
    return *holder;
  }

  /// Chunk `chunk` of `m`, checked against its checksum, into `out`; throws
  /// corrupt naming `what`.
  void read(const Manifest& m, std::size_t chunk, char* out, const std::string& what) { read_chunk(packs(), view_of(m, chunk), out, what); }

 private:
  StoreImpl& store_;
  std::lock_guard<std::mutex> guard_;
  StoreImpl::Lock lock_;
};

}  // namespace dvr::detail
