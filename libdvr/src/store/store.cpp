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
#include <optional>
#include <sstream>

#include "dvr/dvr.hpp"
#include "base/memops.hpp"
#include "format/chunks.hpp"
#include "store/store_impl.hpp"

namespace dvr {

const char* version() noexcept { return DVR_VERSION; }  // project(VERSION) in CMakeLists.txt

const char* errc_name(Errc code) noexcept {
  switch (code) {
    case Errc::not_found: return "not_found";
    case Errc::already_exists: return "already_exists";
    case Errc::corrupt: return "corrupt";
    case Errc::no_space: return "no_space";
    case Errc::invalid_argument: return "invalid_argument";
    case Errc::io: return "io";
    case Errc::unsupported: return "unsupported";
    case Errc::permission: return "permission";
  }
  return "unknown";
}

const char* medium_name(Medium medium) noexcept {
  switch (medium) {
    case Medium::pmem: return "pmem";
    case Medium::dram: return "dram";
    case Medium::disk: return "disk";
  }
  return "unknown";
}

std::vector<std::string> VerifyReport::damaged_snapshots() const {
  std::set<std::string> names;
  for (auto& p : problems)
    if (!p.snapshot.empty()) names.insert(p.session + "/" + p.snapshot);
  return {names.begin(), names.end()};
}

namespace detail {
namespace {

constexpr const char* kSuperblockMagic = "memory-dvr-store";
constexpr const char* kSuperblockTemp = "DVRSTORE.new";

std::string superblock_text(const std::string& uuid, std::uint32_t chunk_size) {
  std::ostringstream s;
  s << kSuperblockMagic << "\n"
    << "format " << kStoreFormatVersion << "\n"
    << "chunk_size " << chunk_size << "\n"
    << "uuid " << uuid << "\n"
    << "created_ns " << now_ns() << "\n";
  std::string text = s.str();
  text.resize(kPageSize, '\0');  // one page: also the probe libpmem2 maps
  return text;
}

void make_dirs(const std::string& path) {
  // mkdir -p: parents with the default mode, the store itself private.
  for (std::size_t pos = 1; (pos = path.find('/', pos)) != std::string::npos; ++pos) {
    std::string parent = path.substr(0, pos);
    if (::mkdir(parent.c_str(), 0755) != 0 && errno != EEXIST) throw_errno(errno, "cannot create directory " + parent);
  }
  make_private_dir(path);
}

}  // namespace

bool valid_name(const std::string& name) {
  if (name.empty() || name.size() > 128 || name[0] == '.') return false;
  for (unsigned char c : name)
    if (!(std::isalnum(c) || c == '.' || c == '_' || c == '-')) return false;
  return true;
}

void check_name(const char* kind, const std::string& name) {
  auto bad = [&](const std::string& why) {
    throw Error(Errc::invalid_argument, std::string(kind) + " name '" + name + "' is not valid: " + why +
                                            " (use 1–128 characters from A-Z a-z 0-9 . _ -, not starting with '.')");
  };
  if (name.empty()) bad("it is empty");
  if (name.size() > 128) bad("it is longer than 128 characters");
  if (name[0] == '.') bad("it starts with '.'");
  for (unsigned char c : name)
    if (!(std::isalnum(c) || c == '.' || c == '_' || c == '-')) bad("it contains '" + std::string(1, static_cast<char>(c)) + "'");
}

StoreImpl::StoreImpl(const std::string& dir, const StoreOptions& options) {
  if (dir.empty()) throw Error(Errc::invalid_argument, "store path is empty; give a directory (or set $DVR_STORE)");
  path = dir.size() > 1 && dir.back() == '/' ? dir.substr(0, dir.size() - 1) : dir;
  lock_timeout = options.lock_timeout;
  create_or_check(options);
  for (const std::string& sub : {sessions_dir(), tmp_dir(), path + "/packs", pins_dir()}) {
    make_private_dir(sub);
    require_real_dir(sub);
  }
  medium = probe_medium(path + "/" + kSuperblockName);
  packs = std::make_unique<Packs>(path + "/packs", uuid);
}

void StoreImpl::create_or_check(const StoreOptions& options) {
  // Everything that can be refused is checked before anything is written, so
  // pointing dvr at the wrong directory changes nothing there.
  std::uint32_t cs = options.chunk_size;
  if (cs < 4096 || cs > (16u << 20) || (cs & (cs - 1)) != 0)
    throw Error(Errc::invalid_argument, "chunk size " + std::to_string(cs) + " is not a power of two between 4 KiB and 16 MiB");
  std::string sb_path = path + "/" + kSuperblockName;
  auto only_lock_or_empty = [&] {
    auto entries = list_dir(path);
    // A creator killed midway leaves at most these two behind.
    std::erase_if(entries, [](const std::string& e) { return e == "lock" || e == kSuperblockTemp; });
    return entries.empty();
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) throw_errno(errno, "cannot open store " + path);
    if (!options.create)
      throw Error(Errc::not_found, "no store at " + path + "; create one by taking a snapshot there, or pass the right --store");
    make_dirs(path);
    if (::stat(path.c_str(), &st) != 0) throw_errno(errno, "cannot open store " + path);
  }
  if (!S_ISDIR(st.st_mode)) throw Error(Errc::invalid_argument, path + " is not a directory; a store is a directory");
  if (st.st_uid != ::geteuid())
    throw Error(Errc::permission, "store " + path + " is owned by uid " + std::to_string(st.st_uid) + ", not by you (uid " +
                                      std::to_string(::geteuid()) + "); use a store of your own (--store DIR or $DVR_STORE)");
  if (!path_exists(sb_path)) {
    // Files but no superblock: not a store — unless another process has just
    // finished creating it (superblock first, then its directories).
    if (!only_lock_or_empty() && !path_exists(sb_path))
      throw Error(Errc::invalid_argument, path + " is not a Memory DVR store (it holds files but no " + kSuperblockName +
                                              "); choose an empty or new directory for the store");
    if (!options.create && !path_exists(sb_path)) throw Error(Errc::not_found, "no store at " + path + " (empty directory)");
  }
  if ((st.st_mode & 077) != 0 && ::chmod(path.c_str(), 0700) != 0)
    throw_errno(errno, "cannot make store " + path + " private (mode 0700)");

  // The lock file also guards creation, so two processes opening a new store
  // at once agree on one superblock. Opening an existing store takes no lock:
  // its superblock never changes.
  std::string lock_path = path + "/lock";
  lock_fd_ = Fd(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!lock_fd_) {
    if (errno == EACCES || errno == EPERM) throw_errno(errno, "cannot open store " + path);
    throw_errno(errno, "cannot create lock file " + lock_path + " (is " + path + " a writable directory?)");
  }
  owner_pid_ = ::getpid();
  std::optional<Lock> creating;
  if (!path_exists(sb_path)) creating.emplace(*this, true);
  if (!path_exists(sb_path)) {
    if (!only_lock_or_empty())  // someone else is creating it right now and failed midway
      throw Error(Errc::invalid_argument, path + " is not a Memory DVR store (it holds files but no " + kSuperblockName +
                                              "); choose an empty or new directory for the store");
    // Written under a fixed temporary name (which an interrupted creation may
    // leave behind, and the next one overwrites), then renamed into place.
    std::string tmp = path + "/" + kSuperblockTemp;
    {
      Fd fd = open_or_throw(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW, 0600);
      std::string text = superblock_text(random_hex(), cs);
      write_all(fd.get(), text.data(), text.size(), tmp);
      fsync_or_throw(fd.get(), tmp);
    }
    if (::rename(tmp.c_str(), sb_path.c_str()) != 0) throw_errno(errno, "cannot publish " + sb_path);
    fsync_dir(path);
  }

  std::string text = read_file(sb_path);
  std::istringstream in(text.substr(0, text.find('\0')));
  std::string magic, key;
  std::getline(in, magic);
  if (magic != kSuperblockMagic)
    throw Error(Errc::invalid_argument, sb_path + " is not a Memory DVR superblock; " + path + " is not a store");
  std::map<std::string, std::string> kv;
  std::string value;
  while (in >> key >> value) kv[key] = value;
  format_version = static_cast<std::uint32_t>(std::strtoul(kv["format"].c_str(), nullptr, 10));
  if (format_version == 0) throw Error(Errc::corrupt, sb_path + " has no format version; the store's superblock is damaged");
  if (format_version > kStoreFormatVersion)
    throw Error(Errc::unsupported, "store " + path + " has format version " + std::to_string(format_version) +
                                       ", newer than this dvr supports (" + std::to_string(kStoreFormatVersion) +
                                       "); upgrade Memory DVR to open it");
  chunk_size = static_cast<std::uint32_t>(std::strtoul(kv["chunk_size"].c_str(), nullptr, 10));
  uuid = kv["uuid"];
  if (chunk_size < 4096 || (chunk_size & (chunk_size - 1)) != 0 || uuid.size() != 32)
    throw Error(Errc::corrupt, sb_path + " is damaged (bad chunk_size or uuid)");
}

StoreImpl::Lock::Lock(const StoreImpl& s, bool exclusive, Kind kind) : fd_(-1) {
  if (s.owner_pid_ != ::getpid()) {
    // A forked child shares its parent's open lock files, and flock() locks
    // belong to the open file: parent and child would both hold them
    // "exclusively". Give the child locks of its own, and make it re-read the
    // store before trusting anything cached.
    Fd fresh(::open((s.path + "/lock").c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
    if (!fresh) throw_errno(errno, "cannot reopen the lock of store " + s.path + " after fork");
    s.lock_fd_ = std::move(fresh);
    s.writers_fd_ = Fd();
    s.owner_pid_ = ::getpid();
    s.forked_ = true;
  }
  if (kind == Kind::writers && !s.writers_fd_) {
    // Created on first use: stores made before it existed get it then.
    const std::string file = s.path + "/" + kWritersLockName;
    s.writers_fd_ = Fd(::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!s.writers_fd_) throw_errno(errno, "cannot open the writers' lock " + file + " of store " + s.path);
  }
  fd_ = kind == Kind::writers ? s.writers_fd_.get() : s.lock_fd_.get();
  if (s.lock_timeout.count() >= 0) {
    // Bounded (StoreOptions::lock_timeout): the CRIU plugin runs while the
    // process it dumps is frozen, and that process may hold this lock (frozen
    // inside a snapshot).
    auto deadline = std::chrono::steady_clock::now() + s.lock_timeout;
    while (::flock(fd_, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK && errno != EINTR) throw_errno(errno, "cannot lock store " + s.path);
      if (std::chrono::steady_clock::now() >= deadline)
        throw Error(Errc::io, "store " + s.path + " stayed locked by another process for " +
                                  std::to_string(s.lock_timeout.count()) +
                                  " ms (lock_timeout): another process is inside a snapshot, restore or gc there, or "
                                  "frozen inside one (a process being dumped); nothing was changed: try again once it "
                                  "is done, or give a longer lock_timeout");
      ::usleep(2000);
    }
    return;
  }
  while (::flock(fd_, exclusive ? LOCK_EX : LOCK_SH) != 0) {
    if (errno != EINTR) throw_errno(errno, "cannot lock store " + s.path);
  }
}

StoreImpl::Lock::~Lock() { ::flock(fd_, LOCK_UN); }

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
      for (std::uint32_t p = 0; p < n; ++p) out[p] = zero_page_hash(v.page_length(p));
    } else {
      have = packs->stored_hashes(v.ref->pack, v.ref->offset, n, out);
    }
    for (std::size_t k = 0; k < v.overlay_count; ++k) {
      const Overlay& o = v.overlays[k];
      if (!o.pack) out[o.page] = zero_page_hash(v.page_length(o.page));
      else if (have) have = packs->stored_hashes(o.pack, o.offset, 1, out + o.page);
    }
    if (have && tree_hash(out, n) == v.ref->hash) continue;
    // No page hash file, or one that disagrees with the manifest: hash the
    // stored pages themselves. If they disagree too, the chunk is damaged,
    // which every reader finds when it checks the pages it uses.
    try {
      for (std::uint32_t p = 0; p < n; ++p) {
        PageLoc at = v.location(p);
        out[p] = at.pack ? page_hash(packs->read(at.pack, at.offset, v.page_length(p)), v.page_length(p))
                         : zero_page_hash(v.page_length(p));
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
    if (!path_exists(session_dir(session)))
      throw Error(Errc::not_found, "no snapshot '" + ref(session, name) + "': there is no session '" + session + "' in store " +
                                       path + "; `dvr ls` lists the sessions");
    throw Error(Errc::not_found, "no snapshot '" + ref(session, name) + "' in store " + path +
                                     "; `dvr ls " + session + "` lists its snapshots");
  }
  Manifest m = decode_manifest(bytes, ref(session, name) + " (" + file + ")");
  if (m.session != session || m.name != name || m.chunk_size != chunk_size)
    throw Error(Errc::corrupt, "manifest " + file + " records snapshot '" + ref(m.session, m.name) +
                                   "' with chunk size " + std::to_string(m.chunk_size) +
                                   "; it was moved or belongs to another store — remove it with `dvr rm`");
  if (raw) *raw = std::move(bytes);
  if (with_page_hashes) hydrate(m);
  return m;
}

std::vector<std::string> StoreImpl::pin_files() const {
  std::vector<std::string> out;
  for (auto& f : list_dir(pins_dir()))
    if (f.size() > 5 && f.compare(f.size() - 5, 5, kManifestSuffix) == 0 && f[0] != '.') out.push_back(pins_dir() + "/" + f);
  return out;
}

std::vector<std::string> StoreImpl::session_names() const {
  std::vector<std::string> out;
  for (auto& n : list_dir(sessions_dir()))
    if (valid_name(n)) out.push_back(n);  // anything else was not made by dvr
  return out;
}

std::vector<std::string> StoreImpl::snapshot_names(const std::string& session) const {
  std::vector<std::string> out;
  if (path_exists(session_dir(session))) require_real_dir(session_dir(session));
  std::string suffix = kManifestSuffix;
  for (auto& f : list_dir(session_dir(session)))
    if (f.size() > suffix.size() && f.compare(f.size() - suffix.size(), suffix.size(), suffix) == 0 &&
        valid_name(f.substr(0, f.size() - suffix.size())))
      out.push_back(f.substr(0, f.size() - suffix.size()));
  return out;
}

void StoreImpl::publish_manifest(Manifest& m) {
  if (!path_exists(session_dir(m.session))) {
    make_private_dir(session_dir(m.session));
    fsync_dir(sessions_dir());  // the new session directory must survive a crash too
  }
  require_real_dir(session_dir(m.session));
  encode_manifest(m, encoded_);
  m.checksum = manifest_checksum(encoded_);
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

std::string StoreImpl::read_epoch() const {
  try {
    return read_file(path + "/epoch");
  } catch (const Error& e) {
    if (e.code() == Errc::not_found) return "";
    throw;
  }
}

void StoreImpl::bump_epoch() { write_file_atomic(tmp_dir(), path + "/epoch", random_hex()); }

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
      live_[{r.pack, r.offset}] = l.length;
    }
    // The first refs are the stored chunks, in order. A chunk with overlays is
    // not stored whole at its location: its hash must not lead dedup there.
    while (chunk < m.chunks.size() && m.chunks[chunk].is_zero()) ++chunk;
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
    live_.erase({r.pack, r.offset});
  }
}

void StoreImpl::refresh_index() {
  std::string epoch = read_epoch();
  if (epoch != index_epoch_ || forked_) {
    forked_ = false;
    index_.clear();
    live_.clear();
    uses_.clear();
    indexed_.clear();
    unreadable_.clear();
    index_epoch_ = epoch;
    quarantine_pack_ = 0;
    packs->forget_populated();
  }
  packs->refresh_mappings();
  // First forget every manifest that is gone or was replaced, then add the new
  // ones: a location freed by one manifest and reused by another must never be
  // credited to the old chunk.
  std::map<std::string, FileKey> present;
  std::set<std::string> unstatable;
  for (auto& session : session_names())
    for (auto& name : snapshot_names(session)) {
      std::string file = manifest_path(session, name);
      FileKey key;
      if (key_of(file, key)) present.emplace(file, key);
      else unstatable.insert(file);  // listed but unreadable: its data must not count as free
    }
  for (auto& file : pin_files()) {
    FileKey key;
    if (key_of(file, key)) present.emplace(file, key);
    else unstatable.insert(file);
  }
  for (auto it = indexed_.begin(); it != indexed_.end();) {
    auto p = present.find(it->first);
    if (p != present.end() && p->second == it->second.key) {
      ++it;
    } else {
      drop_refs(it->second.refs);
      it = indexed_.erase(it);
    }
  }
  auto unreadable_before = std::move(unreadable_);
  unreadable_ = std::move(unstatable);
  for (auto& [file, key] : present) {
    if (indexed_.count(file)) continue;
    try {
      Manifest m = decode_manifest(read_file(file), file);
      indexed_[file] = {key, add_refs(m)};
    } catch (const Error&) {
      // Contributes nothing to dedup; verify reports it. While it exists, its
      // data cannot be told apart from free space, so allocate() reuses none.
      unreadable_.insert(file);
    }
  }
  for (auto& f : unreadable_)
    if (!unreadable_before.count(f)) quarantine_pack_ = 0;  // newly unreadable: it may reference that pack too
}

const ChunkRef* StoreImpl::find_chunk(const Hash128& h, const char* data, std::uint32_t length) const {
  auto it = index_.find(h);
  if (it == index_.end() || it->second.length != length) return nullptr;
  const char* stored = packs->mapped(it->second.pack, it->second.offset, length);
  return stored && std::memcmp(stored, data, length) == 0 ? &it->second : nullptr;
}

void StoreImpl::index_published(const std::string& file, const Manifest& m) {
  FileKey key;
  if (!key_of(file, key)) return;  // refresh_index() will find it
  auto it = indexed_.find(file);
  if (it != indexed_.end()) {
    drop_refs(it->second.refs);
    indexed_.erase(it);
  }
  indexed_[file] = {key, add_refs(m)};
}

bool StoreImpl::range_free(std::uint32_t pack, std::uint64_t offset, std::uint64_t length) const {
  if (offset < kPackHeaderSize) return false;
  auto next = live_.lower_bound({pack, offset});
  if (next != live_.end() && next->first.first == pack && next->first.second < offset + length) return false;
  if (next != live_.begin()) {
    auto prev = std::prev(next);
    if (prev->first.first == pack && prev->first.second + round_up_page(prev->second) > offset) return false;
  }
  for (auto& f : in_flight_)
    if (f.pack == pack && f.offset < offset + length && offset < f.offset + f.length) return false;
  return true;
}

StoreImpl::Placement StoreImpl::allocate(std::uint64_t length, std::optional<Placement> hint) {
  auto ids = packs->ids();
  auto usable = [&](std::uint32_t id) {
    return unreadable_.empty() || id == quarantine_pack_;
  };
  // Next fit: right after the previous block of the same snapshot, so that a
  // snapshot's data stays contiguous and no search is needed.
  if (hint && usable(hint->pack) && std::find(ids.begin(), ids.end(), hint->pack) != ids.end() &&
      range_free(hint->pack, hint->offset, length)) {
    std::uint64_t size = packs->size_of(hint->pack);
    if (hint->offset + length <= size) return *hint;
    if (hint->pack == ids.back() && hint->offset + length <= kMaxPackSize) {
      packs->grow(hint->pack, std::min(kMaxPackSize, std::max(hint->offset + length, 2 * size)));
      return *hint;
    }
  }
  // First fit, walking the live ranges (and the blocks in flight) in order.
  std::vector<InFlight> flying = in_flight_;
  std::sort(flying.begin(), flying.end(),
            [](const InFlight& x, const InFlight& y) { return std::tie(x.pack, x.offset) < std::tie(y.pack, y.offset); });
  auto fit = [&](std::uint32_t id, bool may_grow) -> std::optional<Placement> {
    std::uint64_t size = packs->size_of(id), cursor = kPackHeaderSize;
    auto it = live_.lower_bound({id, 0});
    auto fl = std::lower_bound(flying.begin(), flying.end(), id, [](const InFlight& f, std::uint32_t p) { return f.pack < p; });
    for (;;) {
      bool have_live = it != live_.end() && it->first.first == id;
      bool have_fly = fl != flying.end() && fl->pack == id;
      if (!have_live && !have_fly) break;
      std::uint64_t b, e;
      if (have_live && (!have_fly || it->first.second <= fl->offset)) {
        b = it->first.second;
        e = b + round_up_page(it->second);
        ++it;
      } else {
        b = fl->offset;
        e = b + fl->length;
        ++fl;
      }
      if (b >= cursor + length) return Placement{id, cursor};
      cursor = std::max(cursor, e);
    }
    if (size >= cursor + length) return Placement{id, cursor};
    if (may_grow && cursor + length <= kMaxPackSize) {
      packs->grow(id, std::min(kMaxPackSize, std::max(cursor + length, 2 * size)));
      return Placement{id, cursor};
    }
    return std::nullopt;
  };
  for (auto id : ids)
    if (usable(id))
      if (auto p = fit(id, id == ids.back())) return *p;
  std::uint32_t id = ids.empty() ? 1 : ids.back() + 1;
  packs->create(id, std::max(kInitialPackSize, kPackHeaderSize + length), kPackHeaderSize + length);
  if (!unreadable_.empty()) quarantine_pack_ = id;
  return {id, kPackHeaderSize};
}

StoreImpl::AllocationScope::~AllocationScope() {
  // A snapshot that failed (a full disk, say) gives its space back at once,
  // rather than leaving the file system full until the next gc.
  if (!committed_)
    for (auto& f : store_.in_flight_) store_.packs->punch(f.pack, f.offset, f.length);
  store_.in_flight_.clear();
  store_.packs->end_writes();
}

std::pair<StoreImpl::Placement, PackWriter> StoreImpl::AllocationScope::take(std::uint64_t length) {
  std::lock_guard<std::mutex> lock(mu_);
  Placement p = store_.allocate(length, next_);
  store_.in_flight_.push_back({p.pack, p.offset, length});
  next_ = Placement{p.pack, p.offset + length};
  return {p, store_.packs->writer(p.pack, p.offset, length)};
}

std::size_t first_damaged(Packs& packs, const Manifest& m, const std::vector<std::size_t>& which, std::string* why) {
  std::uint64_t bytes = 0;
  for (std::size_t i : which) {
    map_chunk(packs, view_of(m, i));
    bytes += m.chunks[i].length;
  }
  std::atomic<std::size_t> first{SIZE_MAX};
  std::mutex mu;
  parallel_for(which.size(), bytes, [&](std::size_t b, std::size_t e) {
    for (std::size_t k = b; k < e && k < first.load(); ++k) {
      std::string bad = check_chunk(packs, view_of(m, which[k]));
      if (bad.empty()) continue;
      std::lock_guard<std::mutex> lock(mu);
      if (k < first.load()) {
        first = k;
        *why = std::move(bad);
      }
      return;
    }
  });
  return first.load();
}

SnapshotInfo info_from_manifest(const Manifest& m) {
  SnapshotInfo i;
  i.session = m.session;
  i.name = m.name;
  i.parent = m.parent;
  i.label = m.label;
  i.time_ns = m.time_ns;
  i.logical_bytes = m.logical_bytes();
  i.stored_bytes = m.stored_bytes;
  i.chunks = m.chunks.size();
  for (std::size_t k = 0; k < m.chunks.size(); ++k) i.zero_chunks += m.zero_chunk(k) ? 1 : 0;
  for (auto& r : m.regions) i.regions.push_back({r.name, r.size, r.sdk_owned});
  i.tracking = (m.flags & kManifestTrackedWrites) ? "write_protect" : "hash";
  i.chunks_read = m.chunks_read;
  return i;
}

}  // namespace detail

using detail::StoreImpl;

Store Store::open(const std::string& path, const StoreOptions& options) {
  return Store(std::make_shared<StoreImpl>(path, options));
}

std::string Store::default_path() {
  if (const char* env = std::getenv("DVR_STORE"); env && *env) return env;
  struct stat st {};
  if (::stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode)) return "/dev/shm/dvr-" + std::to_string(::geteuid());
  const char* home = std::getenv("HOME");
  if (!home || !*home) {
    passwd* pw = ::getpwuid(::geteuid());
    home = pw ? pw->pw_dir : "/tmp";
  }
  return std::string(home) + "/.local/share/dvr";
}

Store Store::open_default(const StoreOptions& options) {
  std::string path = default_path();
  // The shared default location must not be a link planted by someone else.
  struct stat st {};
  if (std::getenv("DVR_STORE") == nullptr && ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
    throw Error(Errc::permission, "default store " + path + " is a symbolic link; remove it or set $DVR_STORE");
  return open(path, options);
}

const std::string& Store::path() const { return impl_->path; }
Medium Store::medium() const { return impl_->medium; }
std::uint32_t Store::chunk_size() const { return impl_->chunk_size; }

std::vector<std::string> Store::sessions() const {
  std::vector<std::string> out;
  for (auto& s : impl_->session_names())
    if (!impl_->snapshot_names(s).empty()) out.push_back(s);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<SnapshotInfo> Store::list(const std::string& session) const {
  detail::check_name("session", session);
  std::vector<SnapshotInfo> out;
  for (auto& name : impl_->snapshot_names(session)) {
    try {
      out.push_back(detail::info_from_manifest(impl_->load_manifest(session, name, nullptr, false)));
    } catch (const Error& e) {
      if (e.code() == Errc::not_found) continue;  // removed while listing
      SnapshotInfo bad;
      bad.session = session;
      bad.name = name;
      bad.damaged = true;
      bad.damage = e.what();
      // Its own time is unreadable: order it by when its file was written.
      struct stat st {};
      if (::lstat(impl_->manifest_path(session, name).c_str(), &st) == 0)
        bad.time_ns = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
      out.push_back(std::move(bad));
    }
  }
  std::sort(out.begin(), out.end(), [](const SnapshotInfo& a, const SnapshotInfo& b) {
    return a.time_ns != b.time_ns ? a.time_ns < b.time_ns : a.name < b.name;
  });
  return out;
}

std::vector<SnapshotInfo> Store::list() const {
  std::vector<SnapshotInfo> out;
  for (auto& s : sessions()) {
    auto part = list(s);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

SnapshotInfo Store::info(const std::string& session, const std::string& snapshot) const {
  return detail::info_from_manifest(impl_->load_manifest(session, snapshot, nullptr, false));
}

void Store::remove(const std::string& session, const std::string& snapshot) {
  detail::check_name("session", session);
  detail::check_name("snapshot", snapshot);
  std::lock_guard<std::mutex> guard(impl_->mu);
  StoreImpl::Lock lock(*impl_, true);
  std::string file = impl_->manifest_path(session, snapshot);
  if (detail::path_exists(impl_->session_dir(session))) detail::require_real_dir(impl_->session_dir(session));
  if (::unlink(file.c_str()) != 0) {
    if (errno == ENOENT)
      throw Error(Errc::not_found, "no snapshot '" + StoreImpl::ref(session, snapshot) + "' in store " + impl_->path +
                                       "; `dvr ls` lists what exists");
    detail::throw_errno(errno, "cannot remove " + file);
  }
  detail::fsync_dir(impl_->session_dir(session));
  ::rmdir(impl_->session_dir(session).c_str());  // only succeeds when empty
}

GcReport Store::gc() {
  using namespace detail;
  std::lock_guard<std::mutex> guard(impl_->mu);
  // No snapshot may be half written (its space is in flight), nor data read.
  StoreImpl::Lock writers(*impl_, true, StoreImpl::Lock::Kind::writers);
  StoreImpl::Lock lock(*impl_, true);
  GcReport report;

  // Leftovers of interrupted commits: nobody else can be writing (we hold the lock).
  require_real_dir(impl_->tmp_dir());
  for (auto& f : list_dir(impl_->tmp_dir())) {
    std::string file = impl_->tmp_dir() + "/" + f;
    if (::unlink(file.c_str()) == 0) ++report.temp_files_removed;
    else if (errno != ENOENT) throw_errno(errno, "gc cannot remove leftover " + file);
  }

  // Pins of clones whose process is gone: nobody holds their lock any more.
  for (auto& pin : impl_->pin_files()) {
    // Live while its lock file is locked (by the clone's process).
    std::string pin_lock = pin.substr(0, pin.size() - std::strlen(kManifestSuffix)) + ".lock";
    int fd = ::open(pin_lock.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    bool dead = fd < 0 ? errno == ENOENT : ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (dead && ::unlink(pin.c_str()) == 0) ++report.temp_files_removed;
    if (dead) ::unlink(pin_lock.c_str());
    if (fd >= 0) ::close(fd);
  }
  // Lock files whose pin never appeared (a clone killed while opening).
  for (auto& f : list_dir(impl_->pins_dir())) {
    if (f.size() <= 5 || f.compare(f.size() - 5, 5, ".lock") != 0) continue;
    std::string pin_lock = impl_->pins_dir() + "/" + f;
    if (path_exists(pin_lock.substr(0, pin_lock.size() - 5) + kManifestSuffix)) continue;
    int fd = ::open(pin_lock.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::unlink(pin_lock.c_str()) == 0) ++report.temp_files_removed;
    if (fd >= 0) ::close(fd);
  }

  // What is live: every byte range some manifest (or live clone) references.
  // pack -> (offset -> end), one entry per distinct location however many
  // snapshots share it.
  std::map<std::uint32_t, std::map<std::uint64_t, std::uint64_t>> live;
  auto add_live = [&](const Manifest& m) {
    for (auto& r : StoreImpl::refs_of(m)) {
      auto& end = live[r.pack][r.offset];
      end = std::max(end, r.offset + round_up_page(r.length));
    }
  };
  std::vector<std::string> damaged;
  for (auto& session : impl_->session_names()) {
    for (auto& name : impl_->snapshot_names(session)) {
      try {
        add_live(impl_->load_manifest(session, name, nullptr, false));
      } catch (const Error& e) {
        if (e.code() == Errc::not_found) continue;
        damaged.push_back(StoreImpl::ref(session, name));
      }
    }
  }
  for (auto& pin : impl_->pin_files()) {
    try {
      add_live(decode_manifest(read_file(pin), pin));
    } catch (const Error& e) {
      if (e.code() != Errc::not_found) damaged.push_back("the clone pin " + pin);
    }
  }
  if (!damaged.empty()) {
    std::string names;
    for (auto& d : damaged) names += (names.empty() ? "" : ", ") + d;
    throw Error(Errc::corrupt, "gc refused: the manifest of " + names +
                                   " cannot be read, so gc cannot tell which data it needs; inspect with `dvr verify`, then remove it with `dvr rm` and run gc again");
  }

  auto pack_ids = impl_->packs->ids();
  for (auto id : pack_ids) report.bytes_before += file_allocated(impl_->packs->path_of(id));

  // Other processes' dedup indexes may point at the data about to be freed:
  // announce first, so that a crash after this point is still safe.
  impl_->bump_epoch();

  for (auto id : pack_ids) {
    std::string file = impl_->packs->path_of(id);
    auto it = live.find(id);
    if (it == live.end()) {
      if (::unlink(file.c_str()) == 0) ++report.packs_removed;
      else if (errno != ENOENT) throw_errno(errno, "gc cannot remove unused pack " + file);
      ::unlink((file.substr(0, file.size() - 5) + ".hash").c_str());  // its page hashes
      continue;
    }
    auto& ranges = it->second;
    Fd fd = open_or_throw(file, O_RDWR);
    std::uint64_t size = file_size(fd.get(), file);
    std::uint64_t cursor = kPackHeaderSize;
    auto punch = [&](std::uint64_t from, std::uint64_t to) {
      if (to <= from) return;
      if (::fallocate(fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(from),
                      static_cast<off_t>(to - from)) != 0 &&
          errno != EOPNOTSUPP)
        throw_errno(errno, "cannot free space in " + file);
    };
    for (auto& [b, e] : ranges) {
      punch(cursor, b);
      cursor = std::max(cursor, e);
    }
    punch(cursor, size);
  }
  // Pack files half-created by a crash, and page hash files whose pack is gone.
  for (auto& f : list_dir(impl_->path + "/packs")) {
    std::string file = impl_->path + "/packs/" + f;
    bool orphan = f.size() > 5 && f.compare(f.size() - 5, 5, ".hash") == 0 &&
                  !path_exists(file.substr(0, file.size() - 5) + ".pack");
    if (((f.size() > 4 && f.compare(f.size() - 4, 4, ".new") == 0) || orphan) && ::unlink(file.c_str()) == 0)
      ++report.temp_files_removed;
  }
  fsync_dir(impl_->path + "/packs");
  impl_->packs->refresh_mappings();
  for (auto id : impl_->packs->ids()) report.bytes_after += file_allocated(impl_->packs->path_of(id));
  return report;
}

VerifyReport Store::verify(const Progress& progress) const {
  using namespace detail;
  std::lock_guard<std::mutex> guard(impl_->mu);
  StoreImpl::Lock lock(*impl_, false);
  impl_->packs->refresh_mappings();
  VerifyReport report;

  // Pass 1: every distinct stored chunk, checked once however many snapshots
  // share it (memory grows with distinct chunks, not with references).
  // A chunk is known by where it is stored and what it should hold (for a
  // chunk with overlays, where those pages are stored too).
  using Key = std::tuple<std::uint32_t, std::uint64_t, std::uint32_t, std::uint64_t, std::uint64_t, std::uint64_t, bool>;
  auto key_of_chunk = [](const ChunkView& v) {
    const ChunkRef& c = *v.ref;
    std::uint64_t where = 0;  // where the overlays are (not which chunk they belong to)
    for (std::size_t k = 0; k < v.overlay_count; ++k)
      where = hash64(&v.overlays[k].offset, 8) ^ (where * 0x9E3779B97F4A7C15ull) ^ (std::uint64_t{v.overlays[k].pack} << 32 | v.overlays[k].page);
    return Key{c.pack, c.offset, c.length, c.hash.lo, c.hash.hi, where, v.paged};
  };
  struct Loc {
    std::optional<OwnedChunk> chunk;
    bool readable = false;
    std::string error;
    bool damage = true;  // false: an I/O or permission problem, not proven damage
  };
  std::map<Key, Loc> locs;
  std::vector<std::pair<std::string, std::string>> readable;
  for (auto& session : impl_->session_names()) {
    for (auto& name : impl_->snapshot_names(session)) {
      Manifest m;
      try {
        m = impl_->load_manifest(session, name);
      } catch (const Error& e) {
        if (e.code() == Errc::not_found) continue;  // removed meanwhile
        ++report.snapshots;
        report.problems.push_back({session, name, e.what()});
        continue;
      }
      ++report.snapshots;
      readable.emplace_back(session, name);
      for (std::size_t i = 0; i < m.chunks.size(); ++i) {
        ChunkView v = view_of(m, i);
        if (v.all_zero() && !v.paged) continue;
        auto& loc = locs[key_of_chunk(v)];
        if (!loc.chunk) loc.chunk.emplace(v);
      }
    }
  }
  std::vector<Loc*> work;
  std::uint64_t total = 0;
  for (auto& [key, loc] : locs) {
    try {
      map_chunk(*impl_->packs, loc.chunk->view());
      loc.readable = true;
      total += loc.chunk->ref.length;
    } catch (const Error& e) {
      loc.error = e.what();
      loc.damage = e.code() == Errc::corrupt;
    }
    work.push_back(&loc);
  }
  std::atomic<std::uint64_t> done{0};
  std::mutex progress_mu;
  parallel_for(work.size(), total, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) {
      Loc& loc = *work[i];
      if (!loc.readable) continue;
      try {
        loc.error = check_chunk(*impl_->packs, loc.chunk->view());
      } catch (const Error& err) {
        loc.error = err.what();
      }
      auto now = done.fetch_add(loc.chunk->ref.length) + loc.chunk->ref.length;
      if (progress && (i % 256 == 0 || i + 1 == e)) {
        std::lock_guard<std::mutex> g(progress_mu);
        progress(now, total);
      }
    }
  });
  report.chunks = work.size();
  report.bytes = total;

  // Pass 2, only when something is wrong: name each affected snapshot, with
  // the first few damaged ranges.
  bool any_bad = std::any_of(work.begin(), work.end(), [](const Loc* l) { return !l->error.empty(); });
  for (auto& [session, name] : any_bad ? readable : decltype(readable){}) {
    Manifest m;
    try {
      m = impl_->load_manifest(session, name, nullptr, false);
    } catch (const Error&) {
      continue;  // changed meanwhile; its first pass stands
    }
    std::vector<std::string> items;
    bool damage = false;
    for (auto& r : m.regions)
      for (std::uint64_t i = 0; i < r.chunk_count; ++i) {
        auto& c = m.chunks[r.first_chunk + i];
        auto it = locs.find(key_of_chunk(view_of(m, r.first_chunk + i)));
        if (it == locs.end() || it->second.error.empty()) continue;
        damage = damage || it->second.damage;
        items.push_back("region '" + r.name + "' bytes [" + std::to_string(i * m.chunk_size) + ", " +
                        std::to_string(i * m.chunk_size + c.length) + "): " + it->second.error);
      }
    if (items.empty()) continue;
    std::string what = std::to_string(items.size()) + (damage ? " damaged chunk(s): " : " unreadable chunk(s): ") + items[0];
    for (std::size_t i = 1; i < std::min<std::size_t>(items.size(), 3); ++i) what += "; " + items[i];
    if (items.size() > 3) what += "; ...";
    what += damage ? " — this snapshot cannot be restored; remove it with `dvr rm " + session + "/" + name + "`"
                   : " — check the permissions and health of the store's files, then verify again";
    report.problems.push_back({session, name, what});
  }
  return report;
}

std::vector<RegionDiff> Store::diff(const std::string& session_a, const std::string& snapshot_a, const std::string& session_b,
                                    const std::string& snapshot_b) const {
  using namespace detail;
  std::lock_guard<std::mutex> guard(impl_->mu);
  StoreImpl::Lock lock(*impl_, false);
  impl_->packs->refresh_mappings();
  Manifest a = impl_->load_manifest(session_a, snapshot_a), b = impl_->load_manifest(session_b, snapshot_b);
  const std::string ra = StoreImpl::ref(session_a, snapshot_a), rb = StoreImpl::ref(session_b, snapshot_b);
  std::vector<RegionDiff> out;
  auto find = [](const Manifest& m, const std::string& n) -> const ManifestRegion* {
    for (auto& r : m.regions)
      if (r.name == n) return &r;
    return nullptr;
  };
  auto pages = [](std::uint64_t bytes) { return (bytes + kPageSize - 1) / kPageSize; };
  std::vector<std::string> names;
  for (auto& r : a.regions) names.push_back(r.name);
  for (auto& r : b.regions)
    if (!find(a, r.name)) names.push_back(r.name);
  for (auto& n : names) {
    const ManifestRegion *x = find(a, n), *y = find(b, n);
    RegionDiff d;
    d.name = n;
    d.size_a = x ? x->size : 0;
    d.size_b = y ? y->size : 0;
    d.only_in_a = x && !y;
    d.only_in_b = y && !x;
    if (!x || !y) {
      d.bytes_differ = std::max(d.size_a, d.size_b);
      d.pages_differ = pages(d.bytes_differ);
      out.push_back(d);
      continue;
    }
    std::uint64_t common = std::min(x->size, y->size);
    std::vector<char> ba, bb;
    for (std::uint64_t i = 0; i * a.chunk_size < common; ++i) {
      const ChunkRef& ca = a.chunks[x->first_chunk + i];
      const ChunkRef& cb = b.chunks[y->first_chunk + i];
      std::uint64_t len = std::min<std::uint64_t>(a.chunk_size, common - i * a.chunk_size);
      bool same_kind = a.paged == b.paged && ca.length == cb.length;
      if (same_kind && ca.hash == cb.hash) continue;
      // Both chunks are read (and checked) whole; with page hashes on both
      // sides, pages whose hashes agree are not compared byte by byte.
      ba.resize(ca.length);
      bb.resize(cb.length);
      read_chunk(*impl_->packs, view_of(a, x->first_chunk + i), ba.data(), "snapshot '" + ra + "'");
      read_chunk(*impl_->packs, view_of(b, y->first_chunk + i), bb.data(), "snapshot '" + rb + "'");
      const char *pa = ba.data(), *pb = bb.data();
      const bool by_page = same_kind && a.paged;
      for (std::uint64_t off = 0; off < len; off += kPageSize) {
        std::uint64_t n2 = std::min<std::uint64_t>(kPageSize, len - off), differ = 0;
        if (by_page && a.hashes_of(x->first_chunk + i)[off / kPageSize] == b.hashes_of(y->first_chunk + i)[off / kPageSize]) continue;
        if (std::memcmp(pa + off, pb + off, n2) == 0) continue;
        for (std::uint64_t k = 0; k < n2; ++k) differ += pa[off + k] != pb[off + k];
        d.bytes_differ += differ;
        ++d.pages_differ;
      }
    }
    std::uint64_t extra = std::max(x->size, y->size) - common;
    d.bytes_differ += extra;
    if (extra) d.pages_differ += pages(std::max(x->size, y->size)) - common / kPageSize;
    out.push_back(d);
  }
  return out;
}

std::optional<SnapshotInfo> Store::latest(const std::string& session, std::vector<std::string>* skipped) const {
  using namespace detail;
  auto snaps = list(session);
  std::lock_guard<std::mutex> guard(impl_->mu);
  StoreImpl::Lock lock(*impl_, false);
  impl_->packs->refresh_mappings();
  for (auto it = snaps.rbegin(); it != snaps.rend(); ++it) {
    std::string ref = StoreImpl::ref(session, it->name);
    try {
      if (it->damaged) throw Error(Errc::corrupt, it->damage);
      Manifest m = impl_->load_manifest(session, it->name);
      std::vector<std::size_t> all(m.chunks.size());
      for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
      std::string why;
      if (first_damaged(*impl_->packs, m, all, &why) != SIZE_MAX)
        throw Error(Errc::corrupt, "snapshot '" + ref + "' is damaged: " + why + "; run `dvr verify`");
      return info_from_manifest(m);
    } catch (const Error& e) {
      if (e.code() == Errc::not_found) continue;
      if (skipped) skipped->push_back(ref + ": " + e.what());
    }
  }
  return std::nullopt;
}

StoreStats Store::stats() const {
  StoreStats s;
  s.path = impl_->path;
  s.medium = impl_->medium;
  s.format_version = impl_->format_version;
  s.chunk_size = impl_->chunk_size;
  auto snaps = list();
  s.sessions = sessions().size();
  s.snapshots = snaps.size();
  for (auto& i : snaps) s.logical_bytes += i.logical_bytes;
  for (auto id : impl_->packs->ids()) {
    s.pack_bytes += detail::file_allocated(impl_->packs->path_of(id));
    ++s.pack_files;
  }
  return s;
}

}  // namespace dvr
