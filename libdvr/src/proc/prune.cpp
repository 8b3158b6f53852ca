// Store::prune: retention by policy (store/retention.hpp decides). It lives
// here, above store/, like Store::open_snapshot in session/clone.cpp: a
// process snapshot's removal also removes its DVR heap snapshots (proc/).
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>

#include "base/log.hpp"
#include "base/os.hpp"
#include "dvr/proc.hpp"
#include "proc/catalog.hpp"
#include "store/retention.hpp"
#include "store/store_impl.hpp"

namespace dvr {

using detail::StoreImpl;

namespace {

// Names of this session's snapshots that a live clone has pinned (a pin
// whose lock file is held: gc removes the others). Call with the store's
// exclusive data lock held (no clone is being opened meanwhile).
std::set<std::string> cloned_snapshots(StoreImpl& store, const std::string& session) {
  std::set<std::string> out;
  for (auto& pin : store.pin_files()) {
    const std::string lock = pin.substr(0, pin.size() - std::string(detail::kManifestSuffix).size()) + ".lock";
    const int fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;
    const bool live = ::flock(fd, LOCK_EX | LOCK_NB) != 0;
    if (!live) ::flock(fd, LOCK_UN);
    ::close(fd);
    if (!live) continue;
    try {
      detail::Manifest m = detail::decode_manifest(detail::read_file(pin), pin);
      if (m.session == session) out.insert(m.name);
    } catch (const Error&) {
      // An unreadable pin is gc's business; it pins no name we can tell.
    }
  }
  return out;
}

}  // namespace

PruneReport Store::prune(const std::string& session, const PrunePolicy& policy, bool dry_run) {
  detail::check_name("session", session);
  detail::check_policy(policy);
  const bool processes = session == proc::kImageSession;

  // Process snapshots: where their heap snapshots are, read before the store
  // is locked (that opens the heaps' stores, which may be this one).
  std::map<std::string, detail::heaps::HeapImage> heap_images;
  if (processes)
    for (auto& si : list(session)) {
      if (si.damaged) continue;
      try {
        heap_images.emplace(si.name, proc::impl::heap_image_in(*this, proc::info(*this, si.name)));
      } catch (const Error&) {
        // No readable metadata: kept below, named as such.
      }
    }

  PruneReport report;
  report.dry_run = dry_run;
  std::vector<std::string> removed;
  {
    // Decided and removed under the writers' lock, so that a snapshot taken
    // (or replaced) meanwhile is neither removed nor counted, then the data
    // lock, so that nothing is read while manifests go.
    std::lock_guard<std::mutex> guard(impl_->mu);
    StoreImpl::Lock writers(*impl_, true, StoreImpl::Lock::Kind::writers);
    StoreImpl::Lock lock(*impl_, true);
    std::vector<SnapshotInfo> snaps = list(session);
    if (snaps.empty())
      throw Error(Errc::not_found, "no session '" + session + "' in store " + impl_->path + " (it has no snapshots); `dvr ls` lists the sessions");
    detail::PruneContext context;
    context.cloned = cloned_snapshots(*impl_, session);
    context.process_snapshots = processes;
    if (processes)
      for (auto& si : snaps)
        if (!si.damaged && !heap_images.count(si.name))
          context.pinned.emplace_back(si.name, "its process metadata could not be read (or it appeared while pruning); see `dvr proc info " +
                                                   si.name + "`");
    report.decisions = detail::decide_prune(std::move(snaps), policy, context);
    for (auto& d : report.decisions)
      if (!d.keep) removed.push_back(d.snapshot.name);
    report.removed = removed.size();
    if (!dry_run)
      for (auto& name : removed)
        detail::remove_manifest(*impl_, session, name);
  }
  if (!dry_run && processes)
    for (auto& name : removed)
      detail::heaps::remove_heaps(heap_images.at(name));
  DVR_LOG(info, std::string(dry_run ? "prune (dry run) of session '" : "prune of session '") + session + "' in store " + impl_->path + ": " +
                    std::to_string(report.decisions.size() - report.removed) + " kept, " + std::to_string(report.removed) +
                    (dry_run ? " would be removed" : " removed"));
  return report;
}

}  // namespace dvr
