// The public Store operations (dvr/store.hpp): open, list, info, remove, stats.
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
#include "base/log.hpp"
#include "base/memops.hpp"
#include "base/env.hpp"
#include "format/chunks.hpp"
#include "store/store_impl.hpp"

namespace dvr {

const char* version() noexcept { return DVR_VERSION; }  // project(VERSION) in CMakeLists.txt

const char* errc_name(Errc code) noexcept {
  switch (code) {
    case Errc::not_found:
      return "not_found";
    case Errc::already_exists:
      return "already_exists";
    case Errc::corrupt:
      return "corrupt";
    case Errc::no_space:
      return "no_space";
    case Errc::invalid_argument:
      return "invalid_argument";
    case Errc::io:
      return "io";
    case Errc::unsupported:
      return "unsupported";
    case Errc::permission:
      return "permission";
    case Errc::cancelled:
      return "cancelled";
  }
  return "unknown";
}

const char* medium_name(Medium medium) noexcept {
  switch (medium) {
    case Medium::pmem:
      return "pmem";
    case Medium::dram:
      return "dram";
    case Medium::disk:
      return "disk";
  }
  return "unknown";
}

std::vector<std::string> VerifyReport::damaged_snapshots() const {
  std::set<std::string> names;
  for (auto& p : problems)
    if (!p.snapshot.empty()) names.insert(p.session + "/" + p.snapshot);
  return {names.begin(), names.end()};
}

using detail::StoreImpl;

Store Store::open(const std::string& path, const StoreOptions& options) {
  auto impl = std::make_shared<StoreImpl>(path, options);
  DVR_LOG(debug, "store " + impl->path + " opened (" + medium_name(impl->medium) + "), up to " + std::to_string(impl->threads) + " threads per call");
  return Store(std::move(impl));
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
unsigned Store::threads() const { return impl_->threads; }

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
      bad.origin_time_ns = bad.time_ns;
      try {  // its place in the order, if its header still shows it
        bad.seq = detail::manifest_seq_hint(detail::read_file(impl_->manifest_path(session, name)));
      } catch (const Error&) {
      }
      out.push_back(std::move(bad));
    }
  }
  detail::order_snapshots(out);
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
  SnapshotInfo i = detail::info_from_manifest(impl_->load_manifest(session, snapshot, nullptr, false));
  if (i.seq != 0) return i;
  // Written before manifest v4: its number comes from its place in the session.
  for (auto& s : list(session))
    if (s.name == snapshot && !s.damaged) i.seq = s.seq;
  return i;
}

void Store::remove(const std::string& session, const std::string& snapshot) {
  detail::check_name("session", session);
  detail::check_name("snapshot", snapshot);
  std::lock_guard<std::mutex> guard(impl_->mu);
  StoreImpl::Lock lock(*impl_, true);
  detail::remove_manifest(*impl_, session, snapshot);
}

namespace detail {

void remove_manifest(StoreImpl& store, const std::string& session, const std::string& snapshot) {
  std::string file = store.manifest_path(session, snapshot);
  if (path_exists(store.session_dir(session))) require_real_dir(store.session_dir(session));
  if (env().unlink(file.c_str()) != 0) {
    if (errno == ENOENT)
      throw Error(Errc::not_found,
                  "no snapshot '" + StoreImpl::ref(session, snapshot) + "' in store " + store.path + "; `dvr ls` lists what exists");
    throw_errno(errno, "cannot remove " + file);
  }
  // Counted after the unlink (a process that misses it frees its space late,
  // never early); this handle drops it from its own index at once.
  store.forget_indexed(file);
  try {
    store.count_change(true);
  } catch (const Error&) {
    // Seen late by other processes (at their next change): the snapshot is gone all the same.
  }
  fsync_dir(store.session_dir(session));
  env().rmdir(store.session_dir(session).c_str());  // only succeeds when empty
}

}  // namespace detail

StoreStats Store::stats() const {
  StoreStats s;
  s.path = impl_->path;
  s.medium = impl_->medium;
  s.format_version = impl_->format_version;
  s.chunk_size = impl_->chunk_size;
  auto snaps = list();
  s.sessions = sessions().size();
  s.snapshots = snaps.size();
  for (auto& i : snaps)
    s.logical_bytes += i.logical_bytes;
  for (auto id : impl_->packs->ids()) {
    s.pack_bytes += detail::file_allocated(impl_->packs->path_of(id));
    ++s.pack_files;
  }
  s.warnings = impl_->permission_warnings();
  return s;
}

}  // namespace dvr
