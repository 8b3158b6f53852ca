// The chunk index and the map of live pack space, kept up to date with the published manifests.
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
#include "base/sigbus.hpp"
#include "format/chunks.hpp"
#include "store/store_impl.hpp"

namespace dvr::detail {

bool StoreImpl::key_of(const std::string& file, FileKey& key) {
  // Inode, size and time alone can repeat when a manifest is removed and a
  // new one of the same name and layout is published (inode reuse, coarse
  // timestamps); the checksum in its trailer tells them apart.
  try {
    Fd fd = open_or_throw(file, O_RDONLY);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return false;
    std::uint64_t sum = 0;
    if (st.st_size >= 16 && ::pread(fd.get(), &sum, 8, st.st_size - 16) != 8) return false;
    key = {static_cast<std::uint64_t>(st.st_ino), static_cast<std::uint64_t>(st.st_size),
           static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec, sum};
    return true;
  } catch (const Error&) {
    return false;
  }
}

std::vector<StoreImpl::Ref> StoreImpl::refs_of(const Manifest& m) {
  std::vector<Ref> refs;
  refs.reserve(m.chunks.size() + m.overlays.size());
  for (auto& c : m.chunks)
    if (!c.is_zero()) refs.push_back({c.offset, c.pack, c.length});
  for (auto& o : m.overlays)
    if (o.pack != 0) refs.push_back({o.offset, o.pack, static_cast<std::uint32_t>(kPageSize)});
  return refs;
}

std::vector<StoreImpl::Ref> StoreImpl::add_refs(const Manifest& m) {
  std::vector<Ref> refs = refs_of(m);
  std::size_t chunk = 0;
  for (std::size_t k = 0; k < refs.size(); ++k) {
    const Ref& r = refs[k];
    Live& l = uses_[location_key(r.pack, r.offset)];
    // Uses of one location may differ in length (a chunk, and a region's
    // shorter tail chunk that deduplicated onto its start): the largest counts.
    if (l.refs++ == 0 || r.length > l.length) {
      l.length = std::max<std::uint64_t>(l.length, r.length);
      live_.set(r.pack, r.offset, round_up_page(l.length));
    }
    // The first refs are the stored chunks, in order. A chunk with overlays is
    // not stored whole at its location: its hash must not lead dedup there.
    while (chunk < m.chunks.size() && m.chunks[chunk].is_zero())
      ++chunk;
    if (chunk >= m.chunks.size()) continue;  // an overlay page
    const ChunkRef& c = m.chunks[chunk++];
    if (!l.indexed && !m.has_overlays(chunk - 1)) {
      l.indexed = true;
      l.hash = c.hash;
      index_.emplace(c.hash, c);
    }
  }
  return refs;
}

void StoreImpl::drop_refs(const std::vector<Ref>& refs) {
  for (auto& r : refs) {
    std::uint64_t key = location_key(r.pack, r.offset);
    Live* l = uses_.find(key);
    if (!l || --l->refs > 0) continue;
    auto ix = l->indexed ? index_.find(l->hash) : index_.end();
    if (ix != index_.end() && ix->second.pack == r.pack && ix->second.offset == r.offset) index_.erase(ix);
    uses_.erase(key);
    live_.erase(r.pack, r.offset);
  }
}

void StoreImpl::refresh_index(bool full) {
  std::string epoch = read_epoch();
  if (epoch != index_epoch_ || forked_) {
    forked_ = false;
    index_.clear();
    live_.clear();
    uses_.clear();
    indexed_.clear();
    retired_.clear();  // their uses were counted in what was just cleared
    unreadable_.clear();
    index_epoch_ = epoch;
    quarantine_pack_ = 0;
    seen_changes_.reset();
    packs->forget_populated();
  }
  packs->refresh_mappings();
  // Nothing changed since the index was last brought up to date: no need to
  // look at every manifest again (the counter is read before the manifests,
  // so a change made while they are read shows as a new count next time).
  const std::optional<std::uint64_t> changes_now = changes(false);
  if (!full && changes_now && seen_changes_ && *changes_now == *seen_changes_) return;
  seen_changes_.reset();  // until this read is complete
  // First forget every manifest that is gone or was replaced, then add the new
  // ones: a location freed by one manifest and reused by another must never be
  // credited to the old chunk.
  std::map<std::string, FileKey> present;
  std::set<std::string> unstatable;
  for (auto& session : session_names())
    for (auto& name : snapshot_names(session)) {
      std::string file = manifest_path(session, name);
      FileKey key;
      if (key_of(file, key))
        present.emplace(file, key);
      else
        unstatable.insert(file);  // listed but unreadable: its data must not count as free
    }
  for (auto& file : pin_files()) {
    FileKey key;
    if (key_of(file, key))
      present.emplace(file, key);
    else
      unstatable.insert(file);
  }
  for (auto it = indexed_.begin(); it != indexed_.end();) {
    auto p = present.find(it->first);
    if (p != present.end() && p->second == it->second.key) {
      ++it;
      continue;
    }
    if (p != present.end())
      retire(std::move(it->second.refs));  // replaced: a reader may still use the old version's space
    else
      drop_refs(it->second.refs);  // removed (under the exclusive lock: no reader left)
    it = indexed_.erase(it);
  }
  auto unreadable_before = std::move(unreadable_);
  unreadable_ = std::move(unstatable);
  for (auto& [file, key] : present) {
    if (indexed_.count(file)) continue;
    try {
      Manifest m = decode_manifest(read_file(file), file);
      indexed_[file] = {key, add_refs(m), m.seq};
    } catch (const Error&) {
      // Contributes nothing to dedup; verify reports it. While it exists, its
      // data cannot be told apart from free space, so allocate() reuses none.
      unreadable_.insert(file);
    }
  }
  for (auto& f : unreadable_)
    if (!unreadable_before.count(f)) quarantine_pack_ = 0;  // newly unreadable: it may reference that pack too
  seen_changes_ = changes_now;
}

void StoreImpl::forget_indexed(const std::string& file) {
  auto it = indexed_.find(file);
  if (it != indexed_.end()) {
    drop_refs(it->second.refs);
    indexed_.erase(it);
  }
}

const ChunkRef* StoreImpl::find_chunk(const Hash128& h, const char* data, std::uint32_t length) const {
  auto it = index_.find(h);
  if (it == index_.end() || it->second.length != length) return nullptr;
  const char* stored = packs->mapped(it->second.pack, it->second.offset, length);
  // Stored bytes that cannot be read (SIGBUS: a truncated pack, a failing
  // medium) are not reused: the chunk is stored anew.
  bool same = false;
  if (stored && !guarded(stored, length, [&] { same = std::memcmp(stored, data, length) == 0; })) same = false;
  return same ? &it->second : nullptr;
}

void StoreImpl::index_published(const std::string& file, const Manifest& m) {
  FileKey key;
  if (!key_of(file, key)) {
    seen_changes_.reset();  // refresh_index() must read it
    return;
  }
  // A version published before this one is retired, not freed (retired_).
  if (auto it = indexed_.find(file); it != indexed_.end()) {
    retire(std::move(it->second.refs));
    indexed_.erase(it);
  }
  indexed_[file] = {key, add_refs(m), m.seq};
}

void StoreImpl::release_retired() {
  // Without waiting: a reader holding the shared lock now may have loaded a
  // replaced version before its rename; one that took the lock later read
  // the new version. (The writers' Lock of the batch reopened lock_fd_ in a
  // forked child, so it is this process's own.)
  if (retired_.empty() || owner_pid_ != ::getpid() || ::flock(lock_fd_.get(), LOCK_EX | LOCK_NB) != 0) return;
  ::flock(lock_fd_.get(), LOCK_UN);
  for (auto& refs : retired_)
    drop_refs(refs);
  retired_.clear();
}

std::uint64_t StoreImpl::next_seq() const {
  std::uint64_t highest = 0, unnumbered = 0;
  for (auto& [file, e] : indexed_) {
    highest = std::max(highest, e.seq);
    unnumbered += e.seq == 0 ? 1 : 0;
  }
  // Unreadable manifests may be numbered too: they count as unnumbered ones,
  // so that the numbers Store::list gives them stay below every new one.
  return std::max(highest, unnumbered + unreadable_.size()) + 1;
}

}  // namespace dvr::detail
