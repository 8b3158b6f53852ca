// Manifest files of a store: reading (with page hashes), publishing atomically, recognising versions.
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

void StoreImpl::hydrate(Manifest& m) const {
  if (!m.paged || m.hydrated()) return;
  m.page_hashes.assign(m.first_page.back(), 0);
  m.untrusted.clear();
  for (std::size_t i = 0; i < m.chunks.size(); ++i) {
    ChunkView v = view_of(m, i);
    std::uint64_t* out = m.page_hashes.data() + m.first_page[i];
    const std::uint32_t n = v.page_count();
    bool have = true;
    if (v.ref->is_zero()) {
      for (std::uint32_t p = 0; p < n; ++p)
        out[p] = zero_page_hash(v.page_length(p));
    } else {
      have = packs->stored_hashes(v.ref->pack, v.ref->offset, n, out);
    }
    for (std::size_t k = 0; k < v.overlay_count; ++k) {
      const Overlay& o = v.overlays[k];
      if (!o.pack)
        out[o.page] = zero_page_hash(v.page_length(o.page));
      else if (have)
        have = packs->stored_hashes(o.pack, o.offset, 1, out + o.page);
    }
    if (have && tree_hash(out, n) == v.ref->hash) continue;
    // No page hash file, or one that disagrees with the manifest: hash the
    // stored pages themselves. If they disagree too, the chunk is damaged,
    // which every reader finds when it checks the pages it uses.
    try {
      for (std::uint32_t p = 0; p < n; ++p) {
        PageLoc at = v.location(p);
        const std::uint32_t len = v.page_length(p);
        if (!at.pack) {
          out[p] = zero_page_hash(len);
          continue;
        }
        const char* bytes = packs->read(at.pack, at.offset, len);
        if (!guarded(bytes, len, [&] { out[p] = page_hash(bytes, len); })) throw packs->unreadable(at.pack, at.offset, bytes);
      }
    } catch (const Error&) {
      // Unreadable: left for the reader's checks to report.
    }
    if (!(tree_hash(out, n) == v.ref->hash)) m.untrusted.push_back(i);
  }
}

Manifest StoreImpl::load_manifest(const std::string& session, const std::string& name, std::string* raw, bool with_page_hashes) const {
  check_name("session", session);
  check_name("snapshot", name);
  std::string file = manifest_path(session, name);
  std::string bytes;
  try {
    if (path_exists(session_dir(session))) require_real_dir(session_dir(session));
    bytes = read_file(file);
  } catch (const Error& e) {
    if (e.code() != Errc::not_found) throw;
    // The hint names the store: a shell's default store may be another one.
    if (!path_exists(session_dir(session))) {
      std::vector<std::string> sessions;
      try {
        sessions = session_names();
      } catch (const Error&) {
      }
      throw Error(Errc::not_found, "no snapshot '" + ref(session, name) + "': there is no session '" + session + "' in store " + path +
                                       did_you_mean(session, sessions) + "; `" + dvr_for(path) + " ls` lists the sessions");
    }
    std::vector<std::string> names;
    try {
      names = snapshot_names(session);
    } catch (const Error&) {
    }
    throw Error(Errc::not_found, "no snapshot '" + ref(session, name) + "' in store " + path + did_you_mean(name, names) + "; `" + dvr_for(path) +
                                     " ls " + session + "` lists its snapshots");
  }
  Manifest m = decode_manifest(bytes, ref(session, name) + " (" + file + ")");
  if (m.session != session || m.name != name || m.chunk_size != chunk_size)
    throw Error(Errc::corrupt, "manifest " + file + " records snapshot '" + ref(m.session, m.name) + "' with chunk size " +
                                   std::to_string(m.chunk_size) + "; it was moved or belongs to another store — remove it with `" + dvr_for(path) + " rm " + shell_word(ref(session, name)) + "`");
  if (raw) *raw = std::move(bytes);
  if (with_page_hashes) hydrate(m);
  return m;
}

void StoreImpl::publish_manifest(Manifest& m) {
  if (!path_exists(session_dir(m.session))) {
    make_private_dir(session_dir(m.session));
    fsync_dir(sessions_dir());  // the new session directory must survive a crash too
  }
  require_real_dir(session_dir(m.session));
  encode_manifest(m, encoded_);
  m.checksum = manifest_checksum(encoded_);
  // Counted before the rename (StoreImpl::count_change); own: the batch
  // indexes what it published (index_published) before any refresh.
  count_change(true);
  write_file_atomic(tmp_dir(), manifest_path(m.session, m.name), encoded_);
}

bool StoreImpl::manifest_unchanged(const Manifest& m) const {
  FileKey key;
  return key_of(manifest_path(m.session, m.name), key) && key.checksum == m.checksum;
}

bool StoreImpl::manifest_indexed(const std::string& session, const std::string& name, std::uint64_t checksum) const {
  auto it = indexed_.find(manifest_path(session, name));
  return it != indexed_.end() && it->second.key.checksum == checksum;
}

SnapshotInfo info_from_manifest(const Manifest& m) {
  SnapshotInfo i;
  i.session = m.session;
  i.name = m.name;
  i.parent = m.parent;
  i.label = m.label;
  i.time_ns = m.time_ns;
  i.seq = m.seq;
  i.origin_time_ns = m.origin_time_ns;
  i.logical_bytes = m.logical_bytes();
  i.stored_bytes = m.stored_bytes;
  i.chunks = m.chunks.size();
  for (std::size_t k = 0; k < m.chunks.size(); ++k)
    i.zero_chunks += m.zero_chunk(k) ? 1 : 0;
  for (auto& r : m.regions)
    i.regions.push_back({r.name, r.size, r.sdk_owned});
  i.tracking = (m.flags & kManifestTrackedWrites) ? "write_protect" : "hash";
  i.chunks_read = m.chunks_read;
  return i;
}

bool committed_before(const SnapshotInfo& a, const SnapshotInfo& b) {
  if (a.seq != b.seq) return a.seq < b.seq;
  if (a.time_ns != b.time_ns) return a.time_ns < b.time_ns;
  return a.name < b.name;
}

void order_snapshots(std::vector<SnapshotInfo>& snaps) {
  // Those that record no seq first, by time and name; they are numbered 1, 2, ...
  std::sort(snaps.begin(), snaps.end(), committed_before);
  std::uint64_t n = 0;
  for (auto& s : snaps)
    if (s.seq == 0) s.seq = ++n;
}

}  // namespace dvr::detail
