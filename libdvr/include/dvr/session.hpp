// Memory DVR — sessions, regions and named snapshots.
//
// A Session is one application's named set of memory regions inside a store.
// snapshot() captures every region at once under a name; restore() puts them
// back bit-exact. A Session is used from one thread at a time; the regions must
// not be written by other threads while a snapshot or restore runs (a
// background snapshot only blocks them while it starts).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dvr/store.hpp"

namespace dvr {

/// A named range of memory in a session.
class DVR_EXPORT Region {
 public:
  const std::string& name() const { return name_; }
  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  /// True when the SDK allocated it (alloc()); false for track()ed memory.
  bool sdk_owned() const { return sdk_owned_; }
  /// The region as a span of T (size() / sizeof(T) elements).
  template <class T>
  std::span<T> as() const {
    return {static_cast<T*>(data_), size_ / sizeof(T)};
  }

  Region(std::string name, void* data, std::size_t size, bool sdk_owned) : name_(std::move(name)), data_(data), size_(size), sdk_owned_(sdk_owned) {}
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  ~Region();

 private:
  std::string name_;
  void* data_;
  std::size_t size_;
  bool sdk_owned_;
};

/// How a session finds what changed since its last snapshot or restore.
enum class Tracking {
  /// userfaultfd write-protection with PAGEMAP_SCAN (Linux 6.7+): the kernel
  /// records the pages written, so a snapshot reads only chunks with written
  /// pages and a restore copies back only what differs. The first write to a
  /// page after a snapshot or restore costs one protection fault.
  write_protect,
  /// No tracking: every snapshot hashes all memory (identical chunks are still
  /// stored once) and every restore copies everything back. Works everywhere.
  hash,
};
DVR_EXPORT const char* tracking_name(Tracking tracking) noexcept;

struct SessionOptions {
  /// The mechanism wanted. write_protect falls back to hash, per region, where
  /// the kernel or the memory does not allow it (tracking_note() says why).
  /// The environment variable DVR_TRACKING=hash forces hash.
  Tracking tracking = Tracking::write_protect;
};

struct SnapshotOptions {
  /// Free text kept with the snapshot (shown by `dvr ls` / `dvr info`).
  /// Must be valid UTF-8 (snapshot() throws invalid_argument otherwise);
  /// snapshots received from elsewhere may carry any bytes, which `dvr`
  /// and its JSON show escaped as \xNN (docs/cli.md).
  std::string label;
  /// Replace an existing snapshot of the same name (atomically) instead of
  /// failing with already_exists.
  bool replace = false;
  /// Return as soon as the regions are write-protected and copy them into the
  /// store on other threads while the program runs on (Session::background()
  /// is the handle). The snapshot is still exactly the memory at the call: a
  /// write to a page not yet copied waits until that page is copied aside.
  /// See Session::snapshot_background() for when it is taken at once instead.
  bool background = false;
  /// Bytes of region memory read so far out of those the snapshot reads (the
  /// chunks with written pages, or all memory when it hashes); see
  /// dvr::Progress for the contract. When it throws, the snapshot is
  /// abandoned with nothing published and the exception propagates. Not
  /// used for a background snapshot (SnapshotJob::progress() is its gauge;
  /// one taken at once instead reports here).
  Progress progress;
};

/// How Session::restore() runs.
struct RestoreOptions {
  /// Bytes checked, then bytes written: total is twice the bytes the restore
  /// copies into live memory (each is checked against its checksum first,
  /// then copied). See dvr::Progress for the contract: an exception while
  /// checking leaves live memory untouched and propagates at once; one
  /// thrown after the first live byte was written is deferred until the
  /// restore is complete (memory is then exactly the snapshot).
  Progress progress;
};

/// How far a background snapshot has got.
struct SnapshotProgress {
  std::uint64_t bytes_done = 0;   // region bytes read into the store so far
  std::uint64_t bytes_total = 0;  // region bytes it reads in all
  bool finished = false;          // published, failed or cancelled
};

namespace detail {
struct BackgroundJob;
}

/// A snapshot being taken in the background (Session::snapshot_background()).
/// Copies share one job; any thread may ask a handle about it. It stays valid
/// after the session has moved on or ended.
class DVR_EXPORT SnapshotJob {
 public:
  SnapshotJob() = default;
  /// False for an empty handle (Session::background() when there is none).
  explicit operator bool() const { return job_ != nullptr; }

  /// The snapshot's name.
  const std::string& name() const;
  /// Whether it was taken in the background; false when it was taken at once
  /// (note() says why: too little changed, or write-protection unavailable).
  bool background() const;
  const std::string& note() const;
  /// How long the call that started it blocked the caller, in seconds.
  double stall_seconds() const;
  SnapshotProgress progress() const;
  /// Published, failed or cancelled.
  bool done() const;
  /// Waits at most `timeout`; true when done.
  bool wait_for(std::chrono::milliseconds timeout) const;
  /// Waits until it is done and returns the published snapshot. Throws what
  /// failed (no_space, io, cancelled, ...): then nothing was published and
  /// earlier snapshots are intact.
  SnapshotInfo wait() const;
  /// Asks it to stop: when it has not published yet, nothing is published and
  /// wait() throws cancelled. Returns at once.
  void cancel() const;
  /// Bytes of memory copied aside because the program wrote to them before
  /// they were read (each such first write waited for the copy of its chunk).
  /// Known once done.
  std::uint64_t bytes_copied_aside() const;

 private:
  friend class Session;
  explicit SnapshotJob(std::shared_ptr<detail::BackgroundJob> job) : job_(std::move(job)) {}
  std::shared_ptr<detail::BackgroundJob> job_;
};

struct AllocOptions {
  /// Map the region from a file in the store, `STORE/heaps/SESSION/NAME`
  /// (MAP_SHARED), instead of anonymous memory: a persistent heap. Its content
  /// outlives the process (reopening it maps the same bytes, and a size that
  /// differs from the file's is an invalid_argument error), and a whole-process
  /// snapshot (`dvr proc dump`, the CRIU plugin) records it by reference and
  /// snapshots it into the store instead of copying it through CRIU's images.
  bool persistent = false;
};

class DVR_EXPORT Session {
 public:
  /// Opens session `name` in `store`. Names: 1–128 characters from
  /// [A-Za-z0-9._-], not starting with '.'.
  Session(Store store, std::string name, const SessionOptions& options = {});
  ~Session();
  Session(Session&&) noexcept;
  Session& operator=(Session&&) noexcept;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& name() const;
  Store& store();

  /// Registers caller-owned memory [data, data+size) as region `name`. The memory
  /// must stay valid while tracked. Throws already_exists, invalid_argument
  /// (bad name, size 0, null pointer, overlap with another region, memory
  /// not all mapped readable and writable). Memory in a MAP_SHARED mapping
  /// is compared by hashing (docs/incremental.md): others write it unseen.
  Region& track(const std::string& name, void* data, std::size_t size);

  /// Allocates an SDK-owned, page-aligned, zero-filled region of `size` bytes. It
  /// lives until untrack() or the session's end. Throws no_space on mmap failure.
  Region& alloc(const std::string& name, std::size_t size);
  /// Same, with options: options.persistent maps the region from a heap file
  /// in the store (see AllocOptions). Throws no_space when the file cannot be
  /// sized, invalid_argument when an existing heap file has another size.
  Region& alloc(const std::string& name, std::size_t size, const AllocOptions& options);

  /// The heap file of a persistent region ("" for other regions).
  /// Throws not_found.
  std::string heap_path(const std::string& region) const;

  /// Forgets a region (and frees it if SDK-owned). Throws not_found.
  void untrack(const std::string& name);

  /// The region called `name`. Throws not_found.
  Region& region(const std::string& name);
  std::vector<Region*> regions() const;

  /// Captures every region as snapshot `name`. Identical chunks already in the
  /// store are not written again, so a snapshot of unchanged data costs almost
  /// no space. With write_protect tracking, only chunks with pages written
  /// since the last snapshot or restore are read at all; the others are taken
  /// from that snapshot's manifest. Data is persisted before the snapshot becomes visible: after a
  /// crash it is either fully there or not at all. Throws already_exists (unless
  /// options.replace), invalid_argument (no regions, bad name), no_space (store
  /// full: nothing is published, earlier snapshots are intact).
  ///
  /// With options.background, see snapshot_background(): this returns at once
  /// with what is known of the snapshot (session, name, parent, label; pending
  /// set) and background() is the handle.
  SnapshotInfo snapshot(const std::string& name, const SnapshotOptions& options = {});

  /// Starts snapshot `name` in the background and returns once every region
  /// is write-protected (userfaultfd in synchronous mode). Worker threads copy
  /// the regions into the store while the program runs on; the program's
  /// first write to a page not yet copied waits until that page is copied
  /// aside, so the snapshot is exactly the memory at the call. Threads may
  /// write the regions as soon as this returns (not while it runs).
  ///
  /// It is taken at once instead, and the handle is returned done, with
  /// note() saying why, when that is quicker or the only way: when less
  /// than a quarter of the regions' memory must be read (an incremental
  /// snapshot of a few changed pages takes less than write-protecting
  /// everything), when a region is not write-tracked (Tracking::hash), or when
  /// the kernel or the process's privileges do not allow a userfaultfd that
  /// catches the kernel's own writes (see docs/incremental.md).
  ///
  /// Errors known at the call are thrown at the call (bad name,
  /// already_exists, no regions); failures while copying (no_space, io) are
  /// reported by the handle's wait(), with nothing published. Until it is
  /// done, restore(), snapshot(), base_on(), track(), alloc() and untrack()
  /// first wait for it; destroying the session cancels it. Pages copied aside
  /// take memory until it ends (at most the regions' size). A child forked
  /// while it runs must not use the session (its worker threads are not in
  /// the child).
  SnapshotJob snapshot_background(const std::string& name, const SnapshotOptions& options = {});

  /// The background snapshot started last, while the session has not taken
  /// another snapshot or restored since (an empty handle otherwise).
  SnapshotJob background() const;

  /// Puts every region recorded in snapshot `name` back, bit-exact. With
  /// write_protect tracking only what differs is copied: the pages written
  /// since the last snapshot or restore, and the chunks in which the target
  /// differs from that snapshot. All data to be copied is checked against its
  /// checksum before the first byte of live memory changes:
  /// on any error (not_found, corrupt, invalid_argument when a region is missing
  /// or changed size) live memory is untouched. Regions of the session that the
  /// snapshot does not record are left as they are.
  void restore(const std::string& name);
  /// Same, with options (progress).
  void restore(const std::string& name, const RestoreOptions& options);

  /// The snapshot most recently taken or restored by this session object ("" if
  /// none): the parent of the next snapshot.
  const std::string& head() const;

  /// Declares that live memory is probably close to snapshot `name` of this
  /// session without restoring it (say, the same data loaded again, or a new
  /// dump of a process dumped before): the next snapshot takes `name` as its
  /// parent, compares every region recorded there page by page with it (by
  /// hash: all memory is read) and stores only the pages that differ. Reads
  /// only the manifest; live memory is not changed. Throws not_found, corrupt.
  void base_on(const std::string& name);

  /// Same as store().list(name()).
  std::vector<SnapshotInfo> list() const;

  /// Same as store().open_snapshot(name(), snapshot): a copy-on-write view of
  /// one of this session's snapshots, beside the live regions.
  Clone clone(const std::string& snapshot);
  Clone clone(const std::string& snapshot, const CloneOptions& options);

  /// Same as store().latest(name()): the newest intact snapshot, if any.
  std::optional<SnapshotInfo> latest() const;

  /// Turns on autosave: at the first checkpoint_point() once `every` has
  /// passed since the session's last snapshot, a snapshot named
  /// "autosave-N" (N counting up) is taken, labelled "autosave", and only the
  /// newest `keep` autosaves are kept. Named snapshots are never removed.
  /// every = 0 turns autosave off. Throws invalid_argument for keep = 0.
  /// While it is on, the process announces it in the store's job registry
  /// (dvr/jobs.hpp: STORE/run/PID.autosave.SESSION.json, kind "autosave",
  /// updated after each autosave), so `dvr serve` lists it and raises
  /// autosave_failed and autosave_late alerts; the record goes when autosave
  /// is turned off or the session ends, except after a failed autosave.
  void autosave(std::chrono::milliseconds every, std::size_t keep);

  /// A safe point for autosave: call it where the regions are consistent (say,
  /// between time steps). Costs a clock read when nothing is due. Returns the
  /// autosave taken, if one was; an autosave that fails throws its error (and
  /// is recorded as the job record's last error; the next one is tried at the
  /// next point).
  std::optional<SnapshotInfo> checkpoint_point();

  /// The change-tracking mechanism in use for region `name`. Throws not_found.
  Tracking tracking(const std::string& region) const;
  /// Why write_protect tracking is not in use for some region ("" when it is
  /// in use for all of them, or hash was asked for).
  std::string tracking_note() const;

 private:
  struct DVR_NO_EXPORT State;  // hidden: libdvr's own
  std::unique_ptr<State> state_;
};

}  // namespace dvr
