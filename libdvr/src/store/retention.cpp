#include "store/retention.hpp"

#include <time.h>

#include <algorithm>
#include <map>
#include <set>

#include "dvr/proc.hpp"
#include "store/store_impl.hpp"

namespace dvr::detail {

namespace {

// The bucket of a time for a keep-* rule, in UTC.
std::string bucket(std::int64_t time_ns, const char* format) {
  const time_t t = static_cast<time_t>(time_ns / 1000000000);
  struct tm tm {};
  ::gmtime_r(&t, &tm);
  char out[32];
  std::size_t n = std::strftime(out, sizeof out, format, &tm);
  return std::string(out, n);
}

bool is_heap_snapshot(const SnapshotInfo& s) { return s.name.rfind(proc::kHeapPrefix, 0) == 0; }

// When a snapshot was made: its origin time (the sender's, for a received
// one); its commit time where none is known.
std::int64_t made_ns(const SnapshotInfo& s) { return s.origin_time_ns != 0 ? s.origin_time_ns : s.time_ns; }

}  // namespace

void check_policy(const PrunePolicy& p) {
  if (p.keep_within.count() < 0)
    throw Error(Errc::invalid_argument, "PrunePolicy::keep_within is negative (" + std::to_string(p.keep_within.count()) + " s); give 0 or more");
  if (p.keep_last == 0 && p.keep_within.count() == 0 && p.keep_hourly == 0 && p.keep_daily == 0 && p.keep_weekly == 0 && p.keep_monthly == 0)
    throw Error(Errc::invalid_argument,
                "the prune policy keeps nothing, which would remove every snapshot of the session; give at least one rule "
                "(keep_last, keep_within, keep_hourly, keep_daily, keep_weekly, keep_monthly); to remove everything, remove the snapshots by name");
}

std::string format_duration(std::chrono::seconds s) {
  std::int64_t left = s.count();
  if (left == 0) return "0s";
  std::string out;
  for (auto [unit, size] : {std::pair{"d", std::int64_t{86400}}, std::pair{"h", std::int64_t{3600}}, std::pair{"m", std::int64_t{60}},
                            std::pair{"s", std::int64_t{1}}}) {
    if (left >= size) {
      out += std::to_string(left / size) + unit;
      left %= size;
    }
  }
  return out;
}

std::vector<PruneDecision> decide_prune(std::vector<SnapshotInfo> snapshots, const PrunePolicy& policy, const PruneContext& context) {
  check_policy(policy);
  // Newest is the store's commit order (seq), never the clock; the time
  // rules read when each snapshot was made (origin_time_ns).
  std::sort(snapshots.begin(), snapshots.end(), committed_before);
  std::vector<PruneDecision> out(snapshots.size());
  std::vector<std::vector<std::string>> why(snapshots.size());
  std::vector<bool> counted(snapshots.size(), false);
  std::int64_t newest = 0;
  bool any = false;
  for (std::size_t i = 0; i < snapshots.size(); ++i) {
    out[i].snapshot = snapshots[i];
    const SnapshotInfo& s = snapshots[i];
    auto pinned = std::find_if(context.pinned.begin(), context.pinned.end(), [&](const auto& p) { return p.first == s.name; });
    if (s.damaged) {
      out[i].keep = true;
      out[i].reason = "kept: damaged (" + s.damage +
                      "); prune never removes a damaged snapshot: inspect it with `dvr verify`, remove it by name with `dvr rm`";
    } else if (is_heap_snapshot(s) && !context.process_snapshots) {
      out[i].keep = true;
      out[i].reason = "kept: the DVR heap of process snapshot proc/" + s.name.substr(std::string(proc::kHeapPrefix).size()) +
                      ", which goes when that is removed (prune the proc session, or `dvr proc rm`)";
    } else if (pinned != context.pinned.end()) {
      out[i].keep = true;
      out[i].reason = "kept: " + pinned->second;
    } else {
      counted[i] = true;
      newest = any ? std::max(newest, made_ns(s)) : made_ns(s);
      any = true;
    }
  }

  // Each rule counts back from the newest snapshot.
  std::size_t last_left = policy.keep_last;
  struct BucketRule {
    unsigned left;
    const char* name;
    const char* format;
    std::set<std::string> seen;  // buckets kept already (a set: after a clock step, one may recur)
  };
  std::vector<BucketRule> rules = {{policy.keep_hourly, "hourly", "%Y-%m-%dT%H", {}},
                                   {policy.keep_daily, "daily", "%Y-%m-%d", {}},
                                   {policy.keep_weekly, "weekly", "%G-W%V", {}},
                                   {policy.keep_monthly, "monthly", "%Y-%m", {}}};
  const std::int64_t within_ns = policy.keep_within.count() * 1000000000;
  for (std::size_t k = snapshots.size(); k-- > 0;) {
    if (!counted[k]) continue;
    const SnapshotInfo& s = snapshots[k];
    if (last_left > 0) {
      --last_left;
      why[k].push_back("last " + std::to_string(policy.keep_last));
    }
    if (within_ns > 0 && newest - made_ns(s) <= within_ns) why[k].push_back("within " + format_duration(policy.keep_within));
    for (auto& r : rules) {
      if (r.left == 0) continue;
      std::string b = bucket(made_ns(s), r.format);
      if (!r.seen.insert(b).second) continue;  // a newer snapshot of this bucket is kept already
      --r.left;
      why[k].push_back(std::string(r.name) + " " + b);
    }
  }

  for (std::size_t i = 0; i < snapshots.size(); ++i) {
    if (!counted[i]) continue;
    out[i].keep = !why[i].empty();
    for (auto& w : why[i])
      out[i].reason += (out[i].reason.empty() ? "" : ", ") + w;
  }
  // What refers to each snapshot removed (nothing breaks: a manifest lists all
  // its data; the notes say what else is affected).
  for (std::size_t i = 0; i < snapshots.size(); ++i) {
    if (!counted[i] || out[i].keep) continue;
    const std::string& name = snapshots[i].name;
    out[i].reason = "removed";
    if (context.cloned.count(name)) out[i].reason += "; an open clone keeps its data until it is closed";
    for (std::size_t j = 0; j < snapshots.size(); ++j)
      if (j != i && snapshots[j].parent == name && out[j].keep)
        out[i].reason += "; parent of " + snapshots[j].name + ", which stays complete (a snapshot holds all its data)";
    if (context.process_snapshots) out[i].reason += "; its DVR heap snapshots go with it";
  }
  return out;
}

}  // namespace dvr::detail
