// Memory DVR — coordinated snapshots across MPI ranks, with partner copies
// (docs/mpi.md). Library dvr_mpi (target dvr::mpi), built when MPI is found.
//
//   dvr::mpi::Session s(dvr::Store::open(node_local_dir), "heat", MPI_COMM_WORLD);
//   double* u = static_cast<double*>(s.local().alloc("u", bytes).data());
//   if (auto name = s.restore_latest()) step = step_of(*name);   // collective
//   for (...) { compute(); if (step % N == 0) s.snapshot("step-" + ...); }   // collective
//
// Every rank keeps its part in its own store (its "node"). snapshot(name) is a
// two-phase commit: each rank snapshots locally, an MPI_Allreduce votes, and
// only when every rank committed does each rank record the global snapshot as
// complete (a commit record with a sequence number). Then each rank sends its
// partner (a rank on another node) what the partner lacks of its part, over
// MPI, as a verified stream; the partner keeps it in its store (session
// NAME.rank-R). restore_latest() agrees on the newest snapshot complete on all
// ranks — taking a rank's part from its partner when its own store lost it —
// and restores it everywhere. Retention keeps the newest `keep` global
// snapshots on both sides.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dvr/session.hpp"
#include "dvr/store.hpp"

namespace dvr::mpi {

struct Options {
  /// The partner of rank r is (r + partner_offset) mod size; 0 means size / 2
  /// (ranks split in two halves, standing for two nodes). A partner must be on
  /// another node for its copy to survive the loss of this one.
  int partner_offset = 0;
  /// Send partner copies after each global snapshot.
  bool partner_copies = true;
  /// Global snapshots kept (own parts and partner copies); 0 keeps all.
  std::size_t keep = 3;
  /// zstd level of partner copies (0: none).
  int level = 1;
};

/// One global snapshot as this rank sees it.
struct GlobalInfo {
  std::string name;
  std::uint64_t seq = 0;            // commit order (1, 2, ...)
  std::uint64_t stored_bytes = 0;   // this rank's part: bytes added locally
  std::uint64_t partner_bytes = 0;  // bytes this rank sent to its partner
  double seconds = 0;               // the whole collective call, on this rank
  /// Where `seconds` went on this rank (the phases of docs/mpi.md). The local
  /// snapshot and the partner copy overlap (the copy is streamed from memory
  /// while the local one is stored), so these need not add up to `seconds`.
  double local_seconds = 0;      // this rank's local snapshot
  double vote_seconds = 0;       // the vote, waiting for the slowest rank
  double commit_seconds = 0;     // the commit records and their vote
  double partner_seconds = 0;    // sending this rank's copy and receiving its client's, until both ended
  double retention_seconds = 0;  // removing what `keep` no longer keeps
};

class DVR_EXPORT Session {
 public:
  /// Collective over `comm`. Opens session `name` in this rank's `store`.
  Session(Store store, std::string name, MPI_Comm comm, const Options& options = {});
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  /// The rank's own session: track() / alloc() its regions here.
  dvr::Session& local();
  int rank() const;
  int size() const;
  int partner() const;  // the rank that keeps this rank's copies

  /// Collective. Snapshots every rank's regions as `name`, commits it only if
  /// every rank succeeded, then sends the partner copies and applies
  /// retention. Throws on every rank if any rank failed (the snapshot is then
  /// not committed anywhere and is never chosen by restore_latest()).
  GlobalInfo snapshot(const std::string& name);

  /// Collective. The newest global snapshot every rank can restore (from its
  /// own store or from its partner's copy), restored on every rank; no value
  /// when there is none (a fresh start). Throws on every rank if a rank fails.
  std::optional<std::string> restore_latest();

  /// Global snapshots committed, oldest first, as this rank's records say.
  std::vector<GlobalInfo> committed() const;

  struct DVR_NO_EXPORT State;  // hidden: dvr_mpi's own

 private:
  std::unique_ptr<State> state_;
};

}  // namespace dvr::mpi
