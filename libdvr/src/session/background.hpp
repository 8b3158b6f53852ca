// Background snapshots: the job behind a SnapshotJob handle, and its worker
// (docs/incremental.md, "Background snapshots"). Knows nothing of Session:
// the session hands it the regions, already under a CowGuard, and takes the
// outcome back once it is done.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dvr/session.hpp"
#include "format/manifest.hpp"
#include "store/store_impl.hpp"
#include "store/writer.hpp"
#include "track/cow.hpp"

namespace dvr::detail {

struct BackgroundJob {
  // ---- fixed before the worker starts ----
  std::string name;
  bool background = true;  // false: taken at once (note says why)
  std::string note;
  double stall_s = 0;

  // ---- the worker's inputs (the session keeps them alive and unchanged) ----
  StoreImpl* store = nullptr;
  std::string session;
  WriterOptions writer_options;
  std::vector<RegionSource> sources;
  const Manifest* base = nullptr;
  bool tracked = false;
  Manifest spare;                   // memory lent to the new manifest's tables
  std::unique_ptr<CowGuard> guard;  // every region's memory, protected
  std::vector<int> area;            // per source: its CowGuard area
  /// Hands region r's memory back to the session's write tracker once the
  /// guard let go of it; returns "" or why tracking was lost.
  std::function<std::string(std::size_t r)> hand_back;

  // ---- progress, any thread ----
  std::atomic<std::uint64_t> bytes_done{0}, bytes_total{0};
  std::atomic<bool> cancel{false};

  // ---- the outcome, under mu once finished ----
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  bool finished = false;
  std::exception_ptr error;        // failed (nothing published), or after_commit
  bool published = false;          // the manifest below is in the store
  Manifest manifest;               // as published
  SnapshotInfo info;
  /// Per source: region bytes written after the call whose content differs
  /// from the snapshot (found while handing the memory back), and why write
  /// tracking was lost ("" if not).
  std::vector<ByteRanges> written_after;
  std::vector<std::string> lost;
  std::uint64_t faults = 0, copied = 0;
  bool settled = false;            // the session took the outcome over

  std::thread worker;

  /// Runs the worker on its own thread.
  void start();
  /// Marks a job taken at once as finished.
  void finish_now(const SnapshotInfo& taken);
  void wait() const;
  ~BackgroundJob();

 private:
  void run();
};

}  // namespace dvr::detail
