// Which snapshots a PrunePolicy keeps (Store::prune's decisions, without any
// I/O: the tests give it fabricated times).
#pragma once

#include <set>
#include <string>
#include <vector>

#include "dvr/store.hpp"

namespace dvr::detail {

/// Throws invalid_argument for a policy that keeps nothing.
void check_policy(const PrunePolicy& policy);

/// What else refers to the snapshots being decided on.
struct PruneContext {
  /// Names of snapshots an open clone has pinned.
  std::set<std::string> cloned;
  /// Names of process snapshots whose heap snapshots go with them.
  bool process_snapshots = false;
  /// Names that must be kept whatever the policy says, with why
  /// (name, reason), e.g. a process snapshot that appeared while pruning.
  std::vector<std::pair<std::string, std::string>> pinned;
};

/// Decides for each of `snapshots` (one session's, any order): damaged ones
/// and DVR heap snapshots (proc.NAME) are kept with their reason and not
/// counted; the others are kept by the policy's rules (restic's `forget`:
/// each rule counts back from the newest) or removed, with notes of what
/// refers to them. Returns the decisions oldest first.
std::vector<PruneDecision> decide_prune(std::vector<SnapshotInfo> snapshots, const PrunePolicy& policy, const PruneContext& context = {});

/// "2h", "1d12h", "90s": a duration as prune's reasons write it.
std::string format_duration(std::chrono::seconds s);

}  // namespace dvr::detail
