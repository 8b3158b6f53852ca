#include "session/background.hpp"

#include <pthread.h>

#include "dvr/error.hpp"
#include "base/log.hpp"

namespace dvr {

namespace detail {

namespace {

// The writer's chunk reads, through the guard (track/cow.hpp).
class Guarded final : public ChunkGuard {
 public:
  Guarded(BackgroundJob& job) : job_(job), staged_(job.sources.size()) {
    for (std::size_t r = 0; r < job.sources.size(); ++r)
      staged_[r].reset(new std::atomic<std::uint8_t>[(job.sources[r].size + job.store->chunk_size - 1) / job.store->chunk_size]());
  }
  void skip(std::size_t r, std::uint64_t j) override { job_.guard->skip(job_.area[r], j); }
  const char* begin(std::size_t r, std::uint64_t j, const char* live) override {
    if (job_.cancel.load(std::memory_order_relaxed))
      throw Error(Errc::cancelled, "background snapshot '" + StoreImpl::ref(job_.session, job_.name) + "' was cancelled; nothing was published");
    const char* as_was = job_.guard->begin(job_.area[r], j);
    if (!as_was) return live;
    staged_[r][j].store(1, std::memory_order_relaxed);
    return as_was;
  }
  const char* again(std::size_t r, std::uint64_t j) override {
    if (staged_[r][j].load(std::memory_order_relaxed)) return nullptr;
    return job_.guard->again(job_.area[r], j);
  }
  void done(std::size_t r, std::uint64_t j, std::uint64_t) override {
    job_.guard->done(job_.area[r], j);
    const std::uint64_t cs = job_.store->chunk_size;
    job_.bytes_done.fetch_add(std::min<std::uint64_t>(cs, job_.sources[r].size - j * cs), std::memory_order_relaxed);
  }

 private:
  BackgroundJob& job_;
  std::vector<std::unique_ptr<std::atomic<std::uint8_t>[]>> staged_;
};

}  // namespace

void BackgroundJob::start() {
  worker = std::thread([this] {
    ::pthread_setname_np(::pthread_self(), "dvr-snapshot");
    run();
  });
}

void BackgroundJob::run() {
  const auto t0 = std::chrono::steady_clock::now();
  DVR_LOG(info, "background snapshot " + StoreImpl::ref(session, name) + " started: " + std::to_string(bytes_total.load()) + " bytes to read");
  std::exception_ptr error_out;
  bool handed_back = false;
  std::string discarded;  // what the program discarded under the guard, if it did
  written_after.assign(sources.size(), {});
  lost.assign(sources.size(), {});
  // The guard lets go of the memory, and the session's tracker takes it
  // back. Writes in between are not tracked: every page whose bytes now
  // differ from the new snapshot is recorded as written (after the tracker
  // has it again, so nothing written later is missed either).
  auto give_back = [&](const Manifest* taken) {
    handed_back = true;
    for (std::size_t r = 0; r < sources.size(); ++r) {
      guard->release(area[r]);
      lost[r] = hand_back(r);
      if (taken && lost[r].empty())
        written_after[r] = pages_differing(store->threads, *taken, taken->regions[r], sources[r].data, sources[r].size, {}, true);
    }
    faults = guard->faults();
    copied = guard->copied() * store->chunk_size;
    guard->finish();  // every event it read is handled
    int a = -1;
    std::uint64_t lo = 0, hi = 0;
    if (guard->discarded(&a, &lo, &hi))
      for (std::size_t r = 0; r < sources.size(); ++r)
        if (area[r] == a)
          discarded = "region '" + sources[r].name + "' bytes [" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
    guard.reset();  // the copies aside are freed
  };
  try {
    WriteBatch batch(*store);
    SnapshotWriter writer(batch, session, name, writer_options, &spare);
    Guarded g(*this);
    write_snapshot(writer, sources, base, tracked, &g);
    if (cancel.load()) throw Error(Errc::cancelled, "background snapshot '" + StoreImpl::ref(session, name) + "' was cancelled; nothing was published");
    give_back(&writer.manifest());
    if (!discarded.empty())
      throw Error(Errc::io, "background snapshot '" + StoreImpl::ref(session, name) + "': the program discarded memory of " + discarded +
                                " (madvise MADV_DONTNEED or MADV_REMOVE, or a hole punched) while it was being read, so the snapshot could "
                                "not hold the memory of the call; nothing was published: take it again (a snapshot taken at once, not in the background, holds it)");
    std::exception_ptr after_commit;
    batch.publish({&writer}, &after_commit);
    std::lock_guard<std::mutex> l(mu);
    published = true;
    manifest = std::move(writer.published());
    info = info_from_manifest(manifest);
    error_out = after_commit;
  } catch (...) {
    error_out = std::current_exception();
    try {
      if (!handed_back) give_back(nullptr);
    } catch (...) {
    }
  }
  bytes_done.store(bytes_total.load());
  if (detail::log_enabled(LogLevel::info)) {
    std::string how = published ? "published" : "not published";
    if (error_out) try {
        std::rethrow_exception(error_out);
      } catch (const std::exception& e) {
        how += std::string(" (") + e.what() + ")";
      } catch (...) {
        how += " (an unknown error)";
      }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    detail::log_write(LogLevel::info, "background snapshot " + StoreImpl::ref(session, name) + " finished in " + std::to_string(s) + " s: " + how +
                                          ", " + std::to_string(copied) + " bytes copied aside");
  }
  std::lock_guard<std::mutex> l(mu);
  error = error_out;
  finished = true;
  cv.notify_all();
}

void BackgroundJob::finish_now(const SnapshotInfo& taken) {
  std::lock_guard<std::mutex> l(mu);
  info = taken;
  published = true;
  finished = true;
  bytes_done.store(bytes_total.load());
  cv.notify_all();
}

void BackgroundJob::wait() const {
  std::unique_lock<std::mutex> l(mu);
  cv.wait(l, [&] { return finished; });
}

BackgroundJob::~BackgroundJob() {
  if (worker.joinable()) {
    cancel = true;
    worker.join();
  }
}

}  // namespace detail

// ---- SnapshotJob ----------------------------------------------------------------

namespace {
detail::BackgroundJob& need(const std::shared_ptr<detail::BackgroundJob>& job) {
  if (!job) throw Error(Errc::invalid_argument, "empty SnapshotJob handle: no background snapshot was started");
  return *job;
}
}  // namespace

const std::string& SnapshotJob::name() const { return need(job_).name; }
bool SnapshotJob::background() const { return need(job_).background; }
const std::string& SnapshotJob::note() const { return need(job_).note; }
double SnapshotJob::stall_seconds() const { return need(job_).stall_s; }

SnapshotProgress SnapshotJob::progress() const {
  auto& j = need(job_);
  SnapshotProgress p;
  p.bytes_total = j.bytes_total.load();
  p.bytes_done = std::min(j.bytes_done.load(), p.bytes_total);
  std::lock_guard<std::mutex> l(j.mu);
  p.finished = j.finished;
  return p;
}

bool SnapshotJob::done() const {
  auto& j = need(job_);
  std::lock_guard<std::mutex> l(j.mu);
  return j.finished;
}

bool SnapshotJob::wait_for(std::chrono::milliseconds timeout) const {
  auto& j = need(job_);
  std::unique_lock<std::mutex> l(j.mu);
  return j.cv.wait_for(l, timeout, [&] { return j.finished; });
}

SnapshotInfo SnapshotJob::wait() const {
  auto& j = need(job_);
  j.wait();
  std::lock_guard<std::mutex> l(j.mu);
  if (j.error) std::rethrow_exception(j.error);
  return j.info;
}

void SnapshotJob::cancel() const { need(job_).cancel = true; }

std::uint64_t SnapshotJob::bytes_copied_aside() const {
  auto& j = need(job_);
  std::lock_guard<std::mutex> l(j.mu);
  return j.copied;
}

}  // namespace dvr
