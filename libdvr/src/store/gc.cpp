// Store::gc: reclaiming the space of data no snapshot references.
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
#include "base/progress.hpp"
#include "base/env.hpp"
#include "format/chunks.hpp"
#include "store/store_impl.hpp"

namespace dvr {

using detail::StoreImpl;

namespace {

// Leftovers of interrupted commits (tmp/) and pins of clones whose process is
// gone; returns how many files were removed. Call with both locks held.
std::uint64_t remove_leftovers(StoreImpl& store) {
  using namespace detail;
  std::uint64_t removed = 0;
  // Leftovers of interrupted commits: nobody else can be writing (we hold the lock).
  require_real_dir(store.tmp_dir());
  for (auto& f : list_dir(store.tmp_dir())) {
    std::string file = store.tmp_dir() + "/" + f;
    if (env().unlink(file.c_str()) == 0)
      ++removed;
    else if (errno != ENOENT)
      throw_errno(errno, "gc cannot remove leftover " + file);
  }

  // Pins of clones whose process is gone: nobody holds their lock any more.
  for (auto& pin : store.pin_files()) {
    // Live while its lock file is locked (by the clone's process).
    std::string pin_lock = pin.substr(0, pin.size() - std::strlen(kManifestSuffix)) + ".lock";
    int fd = ::open(pin_lock.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    bool dead = fd < 0 ? errno == ENOENT : ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (dead && env().unlink(pin.c_str()) == 0) ++removed;
    if (dead) env().unlink(pin_lock.c_str());
    if (fd >= 0) ::close(fd);
  }
  // Lock files whose pin never appeared (a clone killed while opening).
  for (auto& f : list_dir(store.pins_dir())) {
    if (f.size() <= 5 || f.compare(f.size() - 5, 5, ".lock") != 0) continue;
    std::string pin_lock = store.pins_dir() + "/" + f;
    if (path_exists(pin_lock.substr(0, pin_lock.size() - 5) + kManifestSuffix)) continue;
    int fd = ::open(pin_lock.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) == 0 && env().unlink(pin_lock.c_str()) == 0) ++removed;
    if (fd >= 0) ::close(fd);
  }
  return removed;
}

}  // namespace

GcReport Store::gc(const Progress& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  using namespace detail;
  std::lock_guard<std::mutex> guard(impl_->mu);
  // No snapshot may be half written (its space is in flight), nor data read.
  StoreImpl::Lock writers(*impl_, true, StoreImpl::Lock::Kind::writers);
  StoreImpl::Lock lock(*impl_, true);
  GcReport report;

  report.temp_files_removed = remove_leftovers(*impl_);

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
    for (auto& d : damaged)
      names += (names.empty() ? "" : ", ") + d;
    throw Error(
        Errc::corrupt,
        "gc refused: the manifest of " + names +
            " cannot be read, so gc cannot tell which data it needs; inspect with `" + dvr_for(impl_->path) + " verify`, then remove it with `" + dvr_for(impl_->path) + " rm` and run gc again");
  }

  auto pack_ids = impl_->packs->ids();
  std::vector<std::uint64_t> pack_bytes;
  for (auto id : pack_ids) {
    pack_bytes.push_back(file_allocated(impl_->packs->path_of(id)));
    report.bytes_before += pack_bytes.back();
  }
  // Progress: the packs' space, pack by pack. A callback that throws stops gc
  // between two packs: what was freed is free, nothing else changed.
  ProgressMeter meter(progress, report.bytes_before);

  // Other processes' dedup indexes may point at the data about to be freed:
  // announce first, so that a crash after this point is still safe.
  impl_->bump_epoch();

  for (std::size_t k = 0; k < pack_ids.size(); ++k) {
    if (k) meter.add(pack_bytes[k - 1]);
    const std::uint32_t id = pack_ids[k];
    std::string file = impl_->packs->path_of(id);
    auto it = live.find(id);
    // A heap pack is the sealed heap file of a `dvr run --heap` program, which
    // may still map it copy-on-write: never punched, removed whole once no
    // snapshot references it (the program keeps its own name for the file).
    if (it != live.end() && impl_->packs->is_heap(id)) continue;
    if (it == live.end()) {
      if (env().unlink(file.c_str()) == 0)
        ++report.packs_removed;
      else if (errno != ENOENT)
        throw_errno(errno, "gc cannot remove unused pack " + file);
      env().unlink((file.substr(0, file.size() - 5) + ".hash").c_str());  // its page hashes
      continue;
    }
    auto& ranges = it->second;
    Fd fd = open_or_throw(file, O_RDWR);
    std::uint64_t size = file_size(fd.get(), file);
    std::uint64_t cursor = kPackHeaderSize;
    auto punch = [&](std::uint64_t from, std::uint64_t to) {
      if (to <= from) return;
      if (env().fallocate(fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(from), static_cast<off_t>(to - from)) != 0 &&
          errno != EOPNOTSUPP)
        throw_errno(errno, "cannot free space in " + file);
    };
    for (auto& [b, e] : ranges) {
      punch(cursor, b);
      cursor = std::max(cursor, e);
    }
    punch(cursor, size);
  }
  meter.finish();
  // Pack files half-created by a crash, and page hash files whose pack is gone.
  for (auto& f : list_dir(impl_->path + "/packs")) {
    std::string file = impl_->path + "/packs/" + f;
    bool orphan = f.size() > 5 && f.compare(f.size() - 5, 5, ".hash") == 0 && !path_exists(file.substr(0, file.size() - 5) + ".pack") &&
                  !path_exists(file.substr(0, file.size() - 5) + ".heap");
    if (((f.size() > 4 && f.compare(f.size() - 4, 4, ".new") == 0) || orphan) && env().unlink(file.c_str()) == 0) ++report.temp_files_removed;
  }
  fsync_dir(impl_->path + "/packs");
  impl_->packs->refresh_mappings();
  for (auto id : impl_->packs->ids())
    report.bytes_after += file_allocated(impl_->packs->path_of(id));
  DVR_LOG(info, "gc of store " + impl_->path + ": " + std::to_string(report.bytes_before) + " -> " + std::to_string(report.bytes_after) +
                    " bytes in pack files, " + std::to_string(report.packs_removed) + " packs and " + std::to_string(report.temp_files_removed) +
                    " leftover files removed, in " +
                    std::to_string(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()) + " s");
  return report;
}

}  // namespace dvr
