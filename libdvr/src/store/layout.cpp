// The store directory: names, the superblock, creating and checking a store, its subdirectories and the gc epoch (docs/format.md).
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/vfs.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <optional>
#include <sstream>

#include "dvr/dvr.hpp"
#include "base/log.hpp"
#include "base/memops.hpp"
#include "base/env.hpp"
#include "format/chunks.hpp"
#include "store/store_impl.hpp"

namespace dvr::detail {

namespace {

// The store's medium: PMem when libpmem2 reports byte or cache-line
// granularity for `probe_file`, else DRAM on tmpfs/ramfs, else disk.
Medium probe_medium(const std::string& probe_file) {
  Fd fd(env().open(probe_file.c_str(), O_RDWR | O_CLOEXEC, 0));
  const bool read_only = !fd && errno == EROFS;  // a store on a read-only mount: nothing is written to it anyway
  if (read_only) fd = open_or_throw(probe_file, O_RDONLY);
  if (!fd) fd = open_or_throw(probe_file, O_RDWR);
  if (!read_only && byte_persistent(fd.get(), probe_file)) return Medium::pmem;
  struct statfs fs {};
  if (::fstatfs(fd.get(), &fs) == 0 && (static_cast<unsigned long>(fs.f_type) == TMPFS_MAGIC || static_cast<unsigned long>(fs.f_type) == RAMFS_MAGIC))
    return Medium::dram;
  return Medium::disk;
}

}  // namespace

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
  // mkdir -p: parents with the default mode, the store itself private. Each
  // directory made is synced into its parent: otherwise a power cut could
  // take the whole store away after its first snapshot returned.
  auto sync_parent = [](const std::string& dir) {
    const auto slash = dir.find_last_of('/');
    const std::string parent = slash == std::string::npos ? "." : slash == 0 ? "/" : dir.substr(0, slash);
    Fd fd(::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));  // outside the store: it may be a link
    if (!fd || env().fsync(fd.get()) != 0) throw_errno(errno, "cannot sync directory " + parent);
  };
  for (std::size_t pos = 1; (pos = path.find('/', pos)) != std::string::npos; ++pos) {
    std::string parent = path.substr(0, pos);
    if (env().mkdir(parent.c_str(), 0755) == 0)
      sync_parent(parent);
    else if (errno != EEXIST)
      throw_errno(errno, "cannot create directory " + parent);
  }
  const bool made = !path_exists(path);
  make_private_dir(path);
  if (made) sync_parent(path);
}

}  // namespace

bool valid_name(const std::string& name) {
  if (name.empty() || name.size() > 128 || name[0] == '.') return false;
  for (unsigned char c : name)
    if (!(std::isalnum(c) || c == '.' || c == '_' || c == '-')) return false;
  return true;
}

namespace {
// One character of `text` at `i`: its bytes when they are well-formed UTF-8
// and no control character, else "" (one byte that cannot be shown as it is:
// a newline in a message would start a line of the sender's choosing).
std::string char_at(const std::string& text, std::size_t i) {
  const unsigned char c = static_cast<unsigned char>(text[i]);
  const std::size_t len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
  std::string ch = text.substr(i, len);
  return c < 0x20 || c == 0x7f || utf8_safe(ch) != ch ? std::string() : ch;
}

// `text` for an error message: valid UTF-8 without NUL (a message is read as
// a C string: what() would end there) or other control characters, each byte
// that is not shown as U+FFFD. No backslash escapes: the front ends escape what they print
// (docs/cli.md, "Text output"), and an escape made here would be escaped
// again.
std::string message_text(const std::string& text) {
  std::string out;
  for (std::size_t i = 0; i < text.size();) {
    const std::string ch = char_at(text, i);
    out += ch.empty() ? "\xef\xbf\xbd" : ch;
    i += ch.empty() ? 1 : ch.size();
  }
  return out;
}
}  // namespace

void check_name(const char* kind, const std::string& name) {
  auto bad = [&](const std::string& why) {
    throw Error(Errc::invalid_argument, std::string(kind) + " name '" + message_text(name) + "' is not valid: " + why +
                                            " (use 1–128 characters from A-Z a-z 0-9 . _ -, not starting with '.')");
  };
  if (name.empty()) bad("it is empty");
  if (name.size() > 128) bad("it is longer than 128 characters");
  if (name[0] == '.') bad("it starts with '.'");
  for (std::size_t i = 0; i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-') continue;
    // The whole character when it is one (é, not its first byte); a control
    // character or a byte that is not UTF-8 by its value.
    const std::string ch = char_at(name, i);
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", c);
    bad(ch.empty() ? "it contains the byte " + std::string(hex) : "it contains '" + ch + "'");
  }
}

std::string did_you_mean(const std::string& want, const std::vector<std::string>& known) {
  const std::size_t limit = std::max<std::size_t>(1, want.size() / 3);
  std::string best;
  std::size_t best_d = limit + 1;
  std::vector<std::size_t> row(want.size() + 1);
  for (auto& k : known) {
    if (k == want || (k.size() > want.size() ? k.size() - want.size() : want.size() - k.size()) > limit) continue;
    for (std::size_t j = 0; j <= want.size(); ++j) row[j] = j;  // Levenshtein, one row
    for (std::size_t i = 1; i <= k.size(); ++i) {
      std::size_t diag = row[0];
      row[0] = i;
      for (std::size_t j = 1; j <= want.size(); ++j) {
        std::size_t up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (k[i - 1] == want[j - 1] ? 0 : 1)});
        diag = up;
      }
    }
    if (row[want.size()] < best_d) {
      best_d = row[want.size()];
      best = k;
    }
  }
  return best.empty() ? "" : " (did you mean '" + best + "'?)";
}

unsigned resolve_threads(unsigned requested) {
  if (requested > kMaxThreads)
    throw Error(Errc::invalid_argument, "StoreOptions::threads is " + std::to_string(requested) + "; give 1 to " + std::to_string(kMaxThreads) +
                                            " threads, or 0 for the default (the CPUs this process may run on)");
  if (requested) return requested;
  if (const char* env = std::getenv("DVR_THREADS"); env && *env) {
    const std::string text = env;
    unsigned long n = 0;
    bool ok = text.size() <= 5 && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (ok) n = std::stoul(text);
    if (!ok || n < 1 || n > kMaxThreads)
      throw Error(Errc::invalid_argument, "DVR_THREADS='" + escape_text(text) + "' is not a thread count; set it to a whole number from 1 to " +
                                              std::to_string(kMaxThreads) + ", or unset it for the default (the CPUs this process may run on)");
    return static_cast<unsigned>(n);
  }
  return affinity_cpus();
}

StoreImpl::StoreImpl(const std::string& dir, const StoreOptions& options) {
  if (dir.empty()) throw Error(Errc::invalid_argument, "store path is empty; give a directory (or set $DVR_STORE)");
  // Absolute: CRIU, its plugin and the heap shim run in other working
  // directories and open paths under the store (a relative store made
  // `dvr proc restore` fail on CRIU's pidfile), and two handles of one store
  // must compare equal by path.
  path = dir;
  if (path.front() != '/') {
    std::error_code ec;
    const auto cwd = std::filesystem::current_path(ec);
    if (ec) throw Error(Errc::io, "store path " + escape_text(dir) + " is relative and the working directory is gone (" + ec.message() + "); give an absolute path");
    path = (cwd / path).string();
  }
  while (path.size() > 1 && path.back() == '/')
    path.pop_back();
  lock_timeout = options.lock_timeout;
  threads = resolve_threads(options.threads);
  create_or_check(options);
  bool made = false;
  for (const std::string& sub : {sessions_dir(), tmp_dir(), path + "/packs", pins_dir()}) {
    if (!path_exists(sub)) made = true;
    make_private_dir(sub);
    require_real_dir(sub);
  }
  if (made) {
    // A new store gets its epoch token now, while there is room: gc rewrites
    // it in place when the file system is full (bump_epoch).
    // Written in place (no one compares it yet; a torn token only makes a
    // reader rebuild its index), synced with the directories below.
    const std::string epoch = path + "/epoch";
    Fd fd(env().open(epoch.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (fd) {
      const std::string token = random_hex();
      write_all(fd.get(), token.data(), token.size(), epoch);
      fsync_or_throw(fd.get(), epoch);
    } else if (errno != EEXIST) {
      throw_errno(errno, "cannot create " + epoch);
    }
    fsync_dir(path);  // a power cut must not take the new directories (and what they will hold) away
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
    if (!options.create) throw Error(Errc::not_found, "no store at " + path + "; create one by taking a snapshot there, or give the right directory (dvr --store DIR, memdvr.Store(DIR))");
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
  if ((st.st_mode & 077) != 0) {
    if (::chmod(path.c_str(), 0700) != 0) throw_errno(errno, "cannot make store " + path + " private (mode 0700)");
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    loosened_at_open = "store directory " + path + " was mode " + mode +
                       " (open to group or others), made private (0700) again; find out who loosened it, and run `dvr verify` before trusting its snapshots";
    DVR_LOG(warn, loosened_at_open);
  }

  // The lock file also guards creation, so two processes opening a new store
  // at once agree on one superblock. Opening an existing store takes no lock:
  // its superblock never changes.
  std::string lock_path = path + "/lock";
  lock_fd_ = Fd(env().open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  // A store on a read-only mount (a backup, a file-system snapshot): its lock
  // file opened for reading still takes locks, so listing, verifying,
  // restoring and exporting work; whatever would write fails with EROFS.
  if (!lock_fd_ && errno == EROFS) lock_fd_ = Fd(env().open(lock_path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0));
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
    if (env().rename(tmp.c_str(), sb_path.c_str()) != 0) throw_errno(errno, "cannot publish " + sb_path);
    fsync_dir(path);
  }

  std::string text = read_file(sb_path);
  std::istringstream in(text.substr(0, text.find('\0')));
  std::string magic, key;
  std::getline(in, magic);
  // Empty or all zero bytes: a store's superblock whose contents were lost
  // (a file system that lost the data of a file it kept), not a foreign file.
  if (text.find_first_not_of('\0') == std::string::npos)
    throw Error(Errc::corrupt, "corrupt superblock " + sb_path + ": it is " + (text.empty() ? "empty" : "all zero bytes") +
                                   "; restore it from a backup of the store (the snapshots are still in " + path + ")");
  if (magic != kSuperblockMagic) throw Error(Errc::invalid_argument, sb_path + " is not a Memory DVR superblock; " + path + " is not a store");
  std::map<std::string, std::string> kv;
  std::string value;
  while (in >> key >> value)
    kv[key] = value;
  format_version = static_cast<std::uint32_t>(std::strtoul(kv["format"].c_str(), nullptr, 10));
  if (format_version == 0) throw Error(Errc::corrupt, "corrupt superblock " + sb_path + ": it has no format version; restore it from a backup of the store");
  if (format_version > kStoreFormatVersion)
    throw Error(Errc::unsupported, "store " + path + " has format version " + std::to_string(format_version) + ", newer than this dvr supports (" +
                                       std::to_string(kStoreFormatVersion) + "); upgrade Memory DVR to open it");
  // Exactly one page in format 1 (docs/format.md): a shorter or longer file was cut
  // short or written over, whatever its first lines still say.
  if (text.size() != kPageSize)
    throw Error(Errc::corrupt, "corrupt superblock " + sb_path + ": it is " + std::to_string(text.size()) + " bytes, not " + std::to_string(kPageSize) +
                                   " (it was truncated or overwritten); restore it from a backup of the store");
  chunk_size = static_cast<std::uint32_t>(std::strtoul(kv["chunk_size"].c_str(), nullptr, 10));
  uuid = kv["uuid"];
  if (chunk_size < 4096 || (chunk_size & (chunk_size - 1)) != 0 || uuid.size() != 32)
    throw Error(Errc::corrupt, "corrupt superblock " + sb_path + ": bad chunk_size or uuid; restore it from a backup of the store");
}

std::vector<std::string> StoreImpl::permission_warnings() const {
  std::vector<std::string> out;
  if (!loosened_at_open.empty()) out.push_back(loosened_at_open);
  // Everything dvr creates is 0700 (directories) or 0600 (files): any bit for
  // group or others was set by someone else.
  struct Kind {
    const char* what;
    std::vector<std::string> examples;
    std::uint64_t count = 0;
  } dirs{"directory", {}, 0}, files{"file", {}, 0};
  auto check = [](Kind& kind, const std::string& p) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0 || S_ISLNK(st.st_mode) || (st.st_mode & 077) == 0) return;
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    if (kind.examples.size() < 3) kind.examples.push_back(p + " (mode " + mode + ")");
    ++kind.count;
  };
  auto walk = [&](const std::string& dir, int depth, auto& self) -> void {
    check(dirs, dir);
    std::vector<std::string> entries;
    try {
      entries = list_dir(dir);
    } catch (const Error&) {
      return;  // unreadable: the operations that need it report it
    }
    for (auto& e : entries) {
      std::string p = dir + "/" + e;
      struct stat st {};
      if (::lstat(p.c_str(), &st) != 0) continue;
      if (S_ISDIR(st.st_mode) && depth > 0)
        self(p, depth - 1, self);
      else if (S_ISDIR(st.st_mode))
        check(dirs, p);
      else
        check(files, p);
    }
  };
  walk(path, 2, walk);  // the store, its subdirectories, the sessions' directories
  for (Kind* k : {&dirs, &files}) {
    if (k->count == 0) continue;
    std::string line = std::to_string(k->count) + " " + k->what + (k->count == 1 ? "" : "s") + " of store " + path +
                       " open to group or others (dvr makes them " + (k == &dirs ? "0700" : "0600") + "): " + k->examples[0];
    for (std::size_t i = 1; i < k->examples.size(); ++i)
      line += ", " + k->examples[i];
    if (k->count > k->examples.size()) line += ", ...";
    line += std::string("; make them private again (chmod -R go= ") + path + ") and find out who changed them";
    out.push_back(std::move(line));
  }
  return out;
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

bool StoreImpl::has_manifest(const std::string& session, const std::string& name) const {
  check_name("session", session);
  if (!valid_name(name) || !path_exists(session_dir(session))) return false;
  require_real_dir(session_dir(session));
  struct stat st {};
  return ::lstat(manifest_path(session, name).c_str(), &st) == 0;
}

std::string StoreImpl::read_epoch() const {
  try {
    return read_file(path + "/epoch");
  } catch (const Error& e) {
    if (e.code() == Errc::not_found) return "";
    throw;
  }
}

void StoreImpl::bump_epoch() {
  const std::string token = random_hex();
  const std::string file = path + "/epoch";
  try {
    write_file_atomic(tmp_dir(), file, token);
  } catch (const Error& e) {
    if (e.code() != Errc::no_space) throw;
    // A full file system, and gc is how space comes back: the token is
    // written over the old one in place, which needs no new block. Every
    // process compares it under the exclusive lock gc holds, so nobody reads
    // it half-written (and after a power cut no index survives to compare).
    Fd fd(env().open(file.c_str(), O_WRONLY | O_CLOEXEC | O_NOFOLLOW, 0));
    if (!fd || file_size(fd.get(), file) != token.size() ||
        env().pwrite(fd.get(), token.data(), token.size(), 0) != static_cast<ssize_t>(token.size()) || env().fsync(fd.get()) != 0)
      throw;
    DVR_LOG(info, "store " + path + " is full: gc rewrote " + file + " in place");
  }
}

namespace {

// Reads STORE/changes through `fd` (0 when it is still empty), adding one
// when `bump`; the value before. nullopt when it cannot.
std::optional<std::uint64_t> counter_at(int fd, bool bump) {
  if (::flock(fd, bump ? LOCK_EX : LOCK_SH) != 0) return std::nullopt;
  std::uint64_t v = 0;
  ssize_t n = ::pread(fd, &v, sizeof v, 0);
  bool ok = n == 0 || n == static_cast<ssize_t>(sizeof v);
  if (n == 0) v = 0;
  if (ok && bump) {
    std::uint64_t next = v + 1;
    ok = ::pwrite(fd, &next, sizeof next, 0) == static_cast<ssize_t>(sizeof next);
  }
  ::flock(fd, LOCK_UN);
  return ok ? std::optional<std::uint64_t>(v) : std::nullopt;
}

int open_counter(const std::string& store_path) {
  // Not through env(): the counter is not data; after a crash every process
  // starts with a full read of the manifests anyway.
  return ::open((store_path + "/changes").c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
}

}  // namespace

std::optional<std::uint64_t> StoreImpl::changes(bool bump) const { return change_counter(path, bump); }

std::optional<std::uint64_t> change_counter(const std::string& store_path, bool bump) {
  // Opened by path every time (about a microsecond): a counter file replaced
  // or removed is never read through a stale descriptor.
  int fd = open_counter(store_path);
  if (fd < 0) return std::nullopt;
  auto v = counter_at(fd, bump);
  ::close(fd);
  return v;
}

void StoreImpl::count_change(bool own) {
  auto before = changes(true);
  if (!before)
    throw Error(Errc::io, "cannot count a change in " + path + "/changes: " + std::strerror(errno) +
                              " (other processes would not see it; check the store's permissions and free space)");
  // Still current when it was current before and the change is in the index;
  // otherwise the next refresh sees the count differ and re-reads.
  if (own && seen_changes_ && *seen_changes_ == *before) seen_changes_ = *before + 1;
}

}  // namespace dvr::detail
