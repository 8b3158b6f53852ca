#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <cstring>
#include <mutex>
#include <set>
#include <unordered_map>

#include <pthread.h>

#include "dvr/jobs.hpp"
#include "dvr/session.hpp"
#include "format/chunks.hpp"
#include "track/dirty.hpp"
#include "base/log.hpp"
#include "base/memops.hpp"
#include "base/pagemap.hpp"
#include "base/progress.hpp"
#include "base/sigbus.hpp"
#include "track/heap_note.hpp"
#include "store/store_impl.hpp"
#include "store/reader.hpp"
#include "store/writer.hpp"
#include "session/background.hpp"
#include "track/cow.hpp"

namespace dvr {

using detail::ChunkRef;
using detail::Manifest;
using detail::ManifestRegion;
using detail::StoreImpl;

Region::~Region() {
  if (sdk_owned_ && data_) ::munmap(data_, detail::round_up_page(size_));
}

const char* tracking_name(Tracking tracking) noexcept { return tracking == Tracking::write_protect ? "write_protect" : "hash"; }

namespace {

// How one region's writes are found.
struct RegionTrack {
  detail::AddrRange tracked{0, 0};       // registered whole pages; empty: not tracked
  std::vector<detail::AddrRange> edges;  // partial pages at unaligned ends: always compared
  // The tracker's record is relative to the session's base only after a
  // snapshot or restore covered the region: memory tracked (or allocated)
  // since then is compared by hashing until one does.
  bool synced = false;
  // Shared memory of ours (a persistent heap): a forked child maps it too,
  // and what the child writes is not in this process's page tables. The
  // number of fork()s when tracking began (g_forks): after another one, the
  // region is compared by hashing.
  bool shared = false;
  std::uint64_t forks = 0;
  std::string why;  // why it is not tracked
  // Bytes written after a background snapshot that the tracker did not see
  // (while the snapshot held the memory): region-relative, sorted; part of
  // what changed since the base until the next snapshot or restore.
  detail::ByteRanges after;
};

constexpr std::uintptr_t kPage = detail::kPageSize;  // (as an address)

}  // namespace

namespace {

// What a restore copies: bytes [lo, hi) of chunk `chunk` of the target, into
// live memory at dst[chunk]; pages [p0, p1) are the pages holding them, all
// checked before the first byte of live memory changes. A job copies only
// the bytes that may differ, not whole pages: a page of an unaligned region
// spans two memory pages, and writing the one that was not written would
// cost a protection fault (and a copy) for bytes already right.
struct RestoreJob {
  std::size_t chunk;
  std::uint32_t p0, p1;
  std::uint64_t lo, hi;
};
struct RestorePlan {
  std::vector<RestoreJob> jobs;
  std::vector<char*> dst;
  std::vector<const ManifestRegion*> region_of;
  std::vector<detail::AddrRange> unprotect;  // tracked ranges about to be mostly overwritten
  std::uint64_t work = 0;                    // for parallel_for
};

// The source pages of a restore that have no page-table entry in this
// process yet ("cold"), in a session's first restore: they are read with
// pread, not through the pack's mapping (docs/performance.md, "Reading
// packs"). A read fault on a file mapping maps up to 16 pages around the one
// asked for; on a VM with shadow page tables each entry costs a few
// microseconds, so pages read far apart through a fresh mapping cost 30-62 us
// each (3277 pages 80 KiB apart in a 256 MiB tmpfs file) against 2.5-5 us for
// a pread of each. A process restoring once after a crash or a restart
// (an MPI job's restore_latest, `dvr` restoring a fresh process) pays pread
// only. Later restores of the session read through the mapping, so that the
// pages a loop restores again and again (a Jupyter undo, a scene flip) are
// faulted in once and then a memcpy away (a pread every time cost twice the
// memcpy: 13-17 ms against 26-30 ms for 3277 pages). Where the kernel cannot
// tell which pages are mapped (before Linux 6.7), everything is read through
// the mapping.
class ColdPages {
 public:
  ColdPages(const detail::Packs& packs, const Manifest& m, const RestorePlan& plan, bool enabled) {
    if (!enabled) return;
    std::map<std::uint32_t, std::pair<std::uintptr_t, std::uintptr_t>> span;  // per pack: the lowest and highest address read
    auto note = [&](std::uint32_t pack, std::uint64_t offset, std::uint64_t len) {
      const char* at = pack ? packs.mapped(pack, offset, len) : nullptr;
      if (!at) return;
      const auto a = reinterpret_cast<std::uintptr_t>(at);
      auto [it, fresh] = span.try_emplace(pack, a, a + len);
      if (!fresh) it->second = {std::min(it->second.first, a), std::max(it->second.second, a + len)};
    };
    for (auto& j : plan.jobs) {
      detail::ChunkView v = detail::view_of(m, j.chunk);
      if (!v.overlay_count) {
        if (!v.ref->is_zero()) note(v.ref->pack, v.ref->offset + j.lo, j.hi - j.lo);
        continue;
      }
      for (std::uint32_t p = j.p0; p < j.p1; ++p) {
        detail::PageLoc at = v.location(p);
        note(at.pack, at.offset, v.page_length(p));
      }
    }
    known_ = true;
    for (auto& [pack, r] : span) {
      const std::uintptr_t lo = r.first & ~std::uintptr_t{detail::kPageSize - 1};
      const std::uintptr_t hi = (r.second + detail::kPageSize - 1) & ~std::uintptr_t{detail::kPageSize - 1};
      if (!detail::present_ranges(lo, hi, present_)) {
        known_ = false;
        present_.clear();
        return;
      }
    }
    std::sort(present_.begin(), present_.end());
  }
  /// Whether the page at `p` (an address in a pack's read mapping) is cold.
  bool cold(const char* p) const {
    if (!known_) return false;
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = std::upper_bound(present_.begin(), present_.end(), a,
                               [](std::uintptr_t x, const std::pair<std::uintptr_t, std::uintptr_t>& r) { return x < r.second; });
    return it == present_.end() || it->first > a;
  }

 private:
  bool known_ = false;
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> present_;  // ascending
};

// A buffer of the calling thread for cold pages read with pread (at most
// kColdPiece bytes at a time).
constexpr std::size_t kColdPiece = 256u << 10;
char* cold_buffer() {
  thread_local std::unique_ptr<char[]> buf;
  if (!buf) buf = std::make_unique<char[]>(kColdPiece);
  return buf.get();
}

}  // namespace

struct Session::State {
  explicit State(Store s) : store(std::move(s)) {}
  ~State() { settle(true); }
  Store store;
  std::string name;
  SessionOptions options;
  // Declared before the regions: regions (and their memory) go first.
  std::unique_ptr<detail::WriteTracker> tracker;
  bool tracker_probed = false;
  std::string tracker_why;
  std::vector<std::unique_ptr<Region>> regions;
  std::unordered_map<const Region*, RegionTrack> tracks;
  std::unordered_map<const Region*, std::string> heap_files;  // persistent regions
  std::string head;
  // A restore ran in this session: the next ones read the packs through
  // their mappings (ColdPages: pages restored again stay a memcpy away).
  bool restored = false;
  // The manifest of `head` while live memory equals it except for pages the
  // tracker reports as written; empty when that is not known.
  std::optional<Manifest> base;
  // The previous base, kept for its memory: the next snapshot's manifest is
  // built in it (megabytes of tables for large regions, which fresh memory
  // would have to fault in page by page).
  Manifest spare;
  void replace_base(Manifest&& m) {
    if (base) spare = std::move(*base);
    base = std::move(m);
  }

  // Autosave: period (0 = off), how many to keep, next number, last snapshot.
  std::chrono::milliseconds autosave_every{0};
  std::size_t autosave_keep = 0;
  std::uint64_t autosave_next = 1;
  std::chrono::steady_clock::time_point last_snapshot = std::chrono::steady_clock::now();
  // While autosave is on: this process's record in STORE/run/ (dvr/jobs.hpp),
  // so dvr serve lists the autosave and alerts when one fails or is late.
  std::optional<JobRecord> autosave_record;
  bool autosave_record_warned = false;
  // Writes it again (best effort: a store that cannot take it still gets its
  // autosaves; said once at warn).
  void publish_autosave_record();
  // Removes it, unless this is a forked child (the record is the parent's).
  void drop_autosave_record();

  // `fresh`: memory just mapped that nothing was written to (alloc()); it
  // is registered without write-protecting it (WriteTracker::add).
  void start_tracking(Region& r, bool fresh = false);
  void stop_tracking(const Region& r);
  // Region-relative byte ranges written since `base`, sorted; false when
  // unknown (not tracked, or tracking was lost), i.e. everything may differ.
  bool written_since_base(const Region& r, std::vector<std::pair<std::uint64_t, std::uint64_t>>& out);
  // Like written_since_base(), but for a region the tracker does not cover,
  // finds the pages whose hashes differ from the base's (hash mode); false
  // when there is no base to compare with.
  // *tracked tells which of the two it was.
  bool changed_since_base(const Region& r, std::vector<std::pair<std::uint64_t, std::uint64_t>>& out, bool* tracked);
  // After a successful snapshot or restore: protect the written pages again.
  void rearm();
  // The regions as the writer's sources, each with what changed since the
  // base when that is known; *tracked_any: some of it came from the tracker.
  std::vector<detail::RegionSource> sources(bool* tracked_any);
  // After a snapshot was published: it is the new base and head.
  void adopt(Manifest&& m);
  // The pages a restore of `m` copies (see RestorePlan).
  RestorePlan plan_restore(const Manifest& m, const std::string& ref);
  const ManifestRegion* base_region(const Region& r) const;
  // Tracking notes of persistent regions (track/heap_note.hpp): written after a
  // snapshot or restore, removed whenever the record they describe ends.
  void publish_notes();
  void drop_note(const Region& r);

  // The background snapshot started last (track/cow.hpp, session/background.hpp)
  // and its regions, in the order of its sources.
  std::shared_ptr<detail::BackgroundJob> job;
  std::vector<Region*> job_regions;
  // Waits for it (asking it to stop first when `cancel`) and takes its
  // outcome over: the new base and head, or, when nothing was published,
  // hashing against the old base (its tracking marks are gone).
  void settle(bool cancel);
  // Throws invalid_argument for a bad snapshot name, or when there are no
  // regions to snapshot.
  void check_regions(const std::string& snapshot) const {
    detail::check_name("snapshot", snapshot);
    if (regions.empty())
      throw Error(Errc::invalid_argument, "session '" + name + "' has no regions to snapshot as '" + snapshot + "'; track() or alloc() memory first");
  }
  void settle_if_done() {
    if (job && !job->settled && job->worker.joinable()) {
      std::lock_guard<std::mutex> l(job->mu);
      if (!job->finished) return;
    }
    settle(false);
  }
};

namespace {
// fork()s of this process since the first shared region was tracked (the
// parent side of pthread_atfork), for RegionTrack::forks.
std::atomic<std::uint64_t> g_forks{0};
std::uint64_t count_forks() {
  static std::once_flag once;
  std::call_once(once, [] { ::pthread_atfork(nullptr, [] { g_forks.fetch_add(1, std::memory_order_relaxed); }, nullptr); });
  return g_forks.load(std::memory_order_relaxed);
}

// What /proc/self/maps says of [b, e): whether every byte is mapped readable
// and writable, and whether any of it is a MAP_SHARED mapping (the fourth
// permission letter 's'). Unreadable maps: nothing known (ok, shared), and
// the caller compares by hashing, which is always right.
struct MemoryProbe {
  bool writable = true;  // mapped, readable and writable, all of it
  bool shared = false;
};
MemoryProbe probe_memory(std::uintptr_t b, std::uintptr_t e) {
  MemoryProbe m;
  std::FILE* f = std::fopen("/proc/self/maps", "re");
  if (!f) {
    m.shared = true;
    return m;
  }
  char line[512];
  std::uintptr_t covered = b;  // mappings are listed in address order
  while (std::fgets(line, sizeof line, f)) {
    unsigned long lo = 0, hi = 0;
    char perms[8] = {};
    if (std::sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3 || hi <= b || lo >= e) continue;
    if (lo > covered || perms[0] != 'r' || perms[1] != 'w') m.writable = false;
    if (perms[3] == 's') m.shared = true;
    covered = std::max<std::uintptr_t>(covered, hi);
  }
  std::fclose(f);
  if (covered < e) m.writable = false;
  return m;
}

// Every tracking note this process has published. A fork invalidates them
// all: the child's copy of a heap mapping is not write-tracked, so what it
// writes would not show in the parent's marks.
std::mutex g_notes_mu;
std::set<std::string> g_notes;
void forget_note(const std::string& note) {
  std::lock_guard<std::mutex> g(g_notes_mu);
  g_notes.erase(note);
}
void remember_note(const std::string& note) {
  static std::once_flag once;
  std::call_once(once, [] {
    ::pthread_atfork(
        nullptr,
        [] {
          std::lock_guard<std::mutex> g(g_notes_mu);
          for (auto& n : g_notes)
            ::unlink(n.c_str());
          g_notes.clear();
        },
        nullptr);
  });
  std::lock_guard<std::mutex> g(g_notes_mu);
  g_notes.insert(note);
}
}  // namespace

void Session::State::drop_note(const Region& r) {
  auto it = heap_files.find(&r);
  if (it == heap_files.end()) return;
  std::string note = detail::heaps::note_path(it->second);
  ::unlink(note.c_str());
  forget_note(note);
}

void Session::State::publish_notes() {
  if (!base) return;
  for (auto& [region, file] : heap_files) {
    auto t = tracks.find(region);
    // (Writes after a background snapshot are not all in the marks.)
    if (t == tracks.end() || t->second.tracked.first == t->second.tracked.second || !t->second.synced || !t->second.after.empty() ||
        !base_region(*region)) {
      ::unlink(detail::heaps::note_path(file).c_str());
      continue;
    }
    detail::heaps::TrackNote note;
    note.start = t->second.tracked.first;
    note.end = t->second.tracked.second;
    note.data = reinterpret_cast<std::uintptr_t>(region->data());
    note.size = region->size();
    note.snapshot = base->name;
    note.checksum = base->checksum;
    remember_note(detail::heaps::note_path(file));  // before it exists: a fork meanwhile removes it
    detail::heaps::write_note(file, note);          // best effort: a missing note only costs hashing
  }
}

void Session::State::start_tracking(Region& r, bool fresh) {
  RegionTrack t;
  const char* env = std::getenv("DVR_TRACKING");
  if (options.tracking == Tracking::hash || (env && std::string(env) == "hash")) {
    tracks[&r] = t;  // hash was asked for: no note
    return;
  }
  if (!tracker_probed) {
    tracker = detail::WriteTracker::open(&tracker_why);
    tracker_probed = true;
  }
  auto b = reinterpret_cast<std::uintptr_t>(r.data()), e = b + r.size();
  std::uintptr_t inner_b = (b + kPage - 1) & ~(kPage - 1), inner_e = e & ~(kPage - 1);
  if (!tracker) {
    t.why = tracker_why;
  } else if (inner_b >= inner_e) {
    t.why = "region '" + r.name() + "' holds no whole page";
  } else if (!fresh && !heap_files.count(&r) && probe_memory(inner_b, inner_e).shared) {
    // Memory others write too (a fork child, another mapping of the same
    // file or memfd, a hole punched in it): none of it shows in this
    // process's page tables, so only hashing sees it.
    t.why = "region '" + r.name() + "' is shared memory (MAP_SHARED): other processes and mappings write it unseen";
  } else if (tracker->add({inner_b, inner_e}, &t.why, !fresh)) {
    // Unprotected (fresh): the tracker reports every page as written until
    // the first snapshot or restore of the region protects it, and nothing
    // asks it before then (synced is false until that snapshot or restore).
    t.tracked = {inner_b, inner_e};
    if (heap_files.count(&r)) {
      t.shared = true;
      t.forks = count_forks();
    }
    if (b < inner_b) t.edges.emplace_back(b & ~(kPage - 1), inner_b);
    if (inner_e < e) t.edges.emplace_back(inner_e, inner_e + kPage);
  } else {
    t.why = "region '" + r.name() + "': " + t.why;
  }
  if (!t.why.empty())
    DVR_LOG(info, "session '" + name + "': region '" + r.name() + "' falls back to hash tracking (every snapshot reads it whole): " + t.why);
  tracks[&r] = t;
}

void Session::State::stop_tracking(const Region& r) {
  auto it = tracks.find(&r);
  if (it == tracks.end()) return;
  if (tracker && it->second.tracked.first != it->second.tracked.second) tracker->remove(it->second.tracked);
  tracks.erase(it);
}

const ManifestRegion* Session::State::base_region(const Region& r) const {
  if (!base) return nullptr;
  for (auto& mr : base->regions)
    if (mr.name == r.name()) return mr.size == r.size() ? &mr : nullptr;
  return nullptr;
}

bool Session::State::written_since_base(const Region& r, std::vector<std::pair<std::uint64_t, std::uint64_t>>& out) {
  auto it = tracks.find(&r);
  if (!base_region(r) || it == tracks.end() || it->second.tracked.first == it->second.tracked.second || !it->second.synced) return false;
  if (it->second.shared && it->second.forks != g_forks.load(std::memory_order_relaxed)) {
    // A child process shares this heap since a fork(): its writes are not
    // in our page tables. From now on this region is compared by hashing.
    tracker->remove(it->second.tracked);
    it->second.tracked = {0, 0};
    it->second.why = "region '" + r.name() + "' is shared with a child process since fork(); write tracking cannot see its writes";
    DVR_LOG(info, "session '" + name + "': " + it->second.why + "; it falls back to hash tracking");
    drop_note(r);
    return false;
  }
  std::vector<detail::AddrRange> pages;
  if (!tracker->written(it->second.tracked, pages)) {
    // The memory was unmapped and mapped again (or this is a forked child):
    // from now on this region is compared by hashing.
    tracker->remove(it->second.tracked);
    it->second.tracked = {0, 0};
    it->second.why = "region '" + r.name() + "' was remapped; write tracking was lost";
    DVR_LOG(info, "session '" + name + "': " + it->second.why + "; it falls back to hash tracking");
    return false;
  }
  pages.insert(pages.end(), it->second.edges.begin(), it->second.edges.end());
  auto b = reinterpret_cast<std::uintptr_t>(r.data()), e = b + r.size();
  for (auto& [lo, hi] : it->second.after)
    pages.emplace_back(b + lo, b + hi);
  std::sort(pages.begin(), pages.end());
  for (auto& [pb, pe] : pages) {
    std::uintptr_t lo = std::max(pb, b), hi = std::min(pe, e);
    if (lo >= hi) continue;
    if (!out.empty() && out.back().second >= lo - b)
      out.back().second = std::max<std::uint64_t>(out.back().second, hi - b);
    else
      out.emplace_back(lo - b, hi - b);
  }
  return true;
}

bool Session::State::changed_since_base(const Region& r, std::vector<std::pair<std::uint64_t, std::uint64_t>>& out, bool* tracked) {
  *tracked = written_since_base(r, out);
  if (*tracked) return true;
  out.clear();
  const ManifestRegion* br = base_region(r);
  if (!br || !base->paged) return false;
  out = detail::pages_differing(detail::impl_of(store).threads, *base, *br, static_cast<const char*>(r.data()), r.size());
  return true;
}

void Session::State::rearm() {
  if (!tracker) return;
  // One thread: protecting a fully written GiB again takes ~2 ms that way,
  // but longer on two, because protecting pages while another CPU runs this
  // process makes every page-table walk interrupt that CPU to flush its TLB.
  for (auto& [region, t] : tracks) {
    t.after.clear();
    if (t.tracked.first == t.tracked.second || tracker->reprotect(t.tracked)) continue;
    tracker->remove(t.tracked);
    t.tracked = {0, 0};
    t.why = "region '" + region->name() + "' was remapped; write tracking was lost";
  }
}

Session::Session(Store store, std::string name, const SessionOptions& options) : state_(std::make_unique<State>(std::move(store))) {
  state_->name = std::move(name);
  state_->options = options;
  detail::check_name("session", state_->name);
}

Tracking Session::tracking(const std::string& name) const {
  state_->settle_if_done();
  for (auto& r : state_->regions)
    if (r->name() == name) {
      auto& t = state_->tracks[r.get()];
      return t.tracked.first != t.tracked.second ? Tracking::write_protect : Tracking::hash;
    }
  throw Error(Errc::not_found, "session '" + state_->name + "' has no region '" + name + "'");
}

std::string Session::tracking_note() const {
  state_->settle_if_done();
  std::string note;
  for (auto& r : state_->regions) {
    auto& t = state_->tracks[r.get()];
    if (!t.why.empty() && note.find(t.why) == std::string::npos) note += (note.empty() ? "" : "; ") + t.why;
  }
  return note;
}

Session::~Session() {
  if (state_) state_->settle(true);
  // A record whose last autosave failed stays (dvr serve's autosave_failed
  // alert) until it is dismissed; the others go with the session.
  if (state_ && state_->autosave_record && state_->autosave_record->last_error.empty()) state_->drop_autosave_record();
  if (state_)
    for (auto& [region, file] : state_->heap_files)
      state_->drop_note(*region);
}

Session::Session(Session&&) noexcept = default;
Session& Session::operator=(Session&&) noexcept = default;

const std::string& Session::name() const { return state_->name; }
Store& Session::store() { return state_->store; }
const std::string& Session::head() const {
  state_->settle_if_done();
  return state_->head;
}
std::vector<SnapshotInfo> Session::list() const { return state_->store.list(state_->name); }

namespace {
constexpr const char* kAutosavePrefix = "autosave-";

// N of "autosave-N", or 0 for any other name.
std::uint64_t autosave_number(const std::string& name) {
  if (name.rfind(kAutosavePrefix, 0) != 0) return 0;
  std::string digits = name.substr(std::strlen(kAutosavePrefix));
  if (digits.empty() || digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos) return 0;
  return std::stoull(digits);
}
}  // namespace

void Session::State::publish_autosave_record() {
  if (!autosave_record) return;
  try {
    write_job(store.path(), *autosave_record);
  } catch (const Error& e) {
    if (!autosave_record_warned) DVR_LOG(warn, "session '" + name + "': " + e.what() + " (dvr serve will not list its autosave)");
    autosave_record_warned = true;
  }
}

void Session::State::drop_autosave_record() {
  if (autosave_record && autosave_record->pid == ::getpid()) remove_job(store.path(), *autosave_record);
  autosave_record.reset();
}

void Session::autosave(std::chrono::milliseconds every, std::size_t keep) {
  if (every.count() > 0 && keep == 0)
    throw Error(Errc::invalid_argument, "autosave for session '" + state_->name + "' must keep at least one snapshot");
  state_->autosave_every = every.count() > 0 ? every : std::chrono::milliseconds(0);
  state_->autosave_keep = keep;
  // Continue the numbering of earlier runs, so names never repeat.
  for (auto& info : list())
    state_->autosave_next = std::max(state_->autosave_next, autosave_number(info.name) + 1);
  state_->last_snapshot = std::chrono::steady_clock::now();
  if (state_->autosave_every.count() == 0) {
    state_->drop_autosave_record();
    return;
  }
  JobRecord r;
  if (state_->autosave_record && state_->autosave_record->pid == ::getpid()) r = *state_->autosave_record;  // keeps its last autosave
  r.pid = ::getpid();
  r.start_ticks = process_start_ticks(r.pid);
  r.kind = "autosave";
  r.session = state_->name;
  r.command = process_command(r.pid);
  r.interval_s = static_cast<double>(every.count()) / 1000.0;
  if (!r.started_ns) r.started_ns = detail::now_ns();  // the interval counts from now
  state_->autosave_record = std::move(r);
  state_->publish_autosave_record();
}

std::optional<SnapshotInfo> Session::checkpoint_point() {
  // A background snapshot still running: the autosave waits for the next point.
  if (state_->job && !state_->job->settled) {
    if (!SnapshotJob(state_->job).done()) return std::nullopt;
    state_->settle(false);
  }
  if (state_->autosave_every.count() == 0 || std::chrono::steady_clock::now() - state_->last_snapshot < state_->autosave_every) return std::nullopt;
  if (state_->autosave_record && state_->autosave_record->pid != ::getpid()) state_->autosave_record.reset();  // a forked child's copy
  SnapshotInfo taken;
  try {
    taken = snapshot(kAutosavePrefix + std::to_string(state_->autosave_next++), {.label = "autosave"});
  } catch (const Error& e) {
    if (state_->autosave_record) {
      state_->autosave_record->last_error = e.what();
      state_->publish_autosave_record();
    }
    throw;
  }
  if (state_->autosave_record) {
    state_->autosave_record->last_dump = state_->name + "/" + taken.name;
    state_->autosave_record->last_dump_ns = detail::now_ns();
    state_->autosave_record->last_error.clear();
    state_->publish_autosave_record();
  }
  DVR_LOG(info, "session '" + state_->name + "': autosave " + taken.name + " taken (" + std::to_string(taken.stored_bytes) + " bytes stored)");
  // Retention: the newest `keep` autosaves stay (by number; named ones are not
  // autosaves and are never touched).
  std::vector<std::uint64_t> numbers;
  for (auto& info : list())
    if (auto n = autosave_number(info.name)) numbers.push_back(n);
  std::sort(numbers.begin(), numbers.end());
  for (std::size_t i = 0; i + state_->autosave_keep < numbers.size(); ++i) {
    try {
      state_->store.remove(state_->name, kAutosavePrefix + std::to_string(numbers[i]));
      DVR_LOG(info, "session '" + state_->name + "': autosave " + kAutosavePrefix + std::to_string(numbers[i]) + " removed (keeping the newest " +
                        std::to_string(state_->autosave_keep) + ")");
    } catch (const Error& e) {
      if (e.code() != Errc::not_found) throw;  // removed meanwhile by someone else
    }
  }
  return taken;
}
std::optional<SnapshotInfo> Session::latest() const { return state_->store.latest(state_->name); }

std::vector<Region*> Session::regions() const {
  std::vector<Region*> out;
  for (auto& r : state_->regions)
    out.push_back(r.get());
  return out;
}

Region& Session::region(const std::string& name) {
  for (auto& r : state_->regions)
    if (r->name() == name) return *r;
  throw Error(Errc::not_found, "session '" + state_->name + "' has no region '" + name + "'");
}

static void check_new_region(const std::vector<std::unique_ptr<Region>>& regions, const std::string& session, const std::string& name,
                             const void* data, std::size_t size) {
  detail::check_name("region", name);
  for (auto& r : regions)
    if (r->name() == name) throw Error(Errc::already_exists, "session '" + session + "' already has a region '" + name + "'; untrack() it first");
  if (size == 0) throw Error(Errc::invalid_argument, "region '" + name + "' has size 0; regions must hold at least one byte");
  if (data == nullptr) return;
  auto b = reinterpret_cast<std::uintptr_t>(data), e = b + size;
  if (e < b) throw Error(Errc::invalid_argument, "region '" + name + "' wraps around the address space");
  for (auto& r : regions) {
    auto rb = reinterpret_cast<std::uintptr_t>(r->data()), re = rb + r->size();
    if (b < re && rb < e)
      throw Error(Errc::invalid_argument, "region '" + name + "' overlaps region '" + r->name() + "'; a byte may belong to one region only");
  }
}

Region& Session::track(const std::string& name, void* data, std::size_t size) {
  state_->settle(false);
  if (!data) throw Error(Errc::invalid_argument, "region '" + name + "': pointer is null");
  check_new_region(state_->regions, state_->name, name, data, size);
  // A restore writes the region and a snapshot reads it: memory that is not
  // mapped read-write would crash the program there, not here.
  const auto b = reinterpret_cast<std::uintptr_t>(data);
  if (size > 0 && !probe_memory(b, b + size).writable)
    throw Error(Errc::invalid_argument, "region '" + name + "': its memory is not all mapped readable and writable (read-only, PROT_NONE or "
                                        "unmapped); track memory the program can write");
  state_->regions.push_back(std::make_unique<Region>(name, data, size, false));
  state_->start_tracking(*state_->regions.back());
  return *state_->regions.back();
}

Region& Session::alloc(const std::string& name, std::size_t size) {
  state_->settle(false);
  check_new_region(state_->regions, state_->name, name, nullptr, size);
  void* p = ::mmap(nullptr, detail::round_up_page(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw Error(Errc::no_space, "cannot allocate " + std::to_string(size) + " bytes for region '" + name + "': out of memory");
  state_->regions.push_back(std::make_unique<Region>(name, p, size, true));
  // Nothing is written yet: filling the region costs one page fault per
  // page, not two (1.5 s instead of 2.6 s for 512 MiB on this VM).
  state_->start_tracking(*state_->regions.back(), true);
  return *state_->regions.back();
}

Region& Session::alloc(const std::string& name, std::size_t size, const AllocOptions& options) {
  if (!options.persistent) return alloc(name, size);
  state_->settle(false);
  check_new_region(state_->regions, state_->name, name, nullptr, size);
  StoreImpl& store = detail::impl_of(state_->store);
  const std::string dir = store.path + "/heaps/" + state_->name;
  detail::make_private_dir(store.path + "/heaps");
  detail::make_private_dir(dir);
  const std::string file = dir + "/" + name;
  const std::size_t length = detail::round_up_page(size);
  int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) detail::throw_errno(errno, "cannot open heap file " + file + " of region '" + name + "'");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    detail::throw_errno(e, "cannot stat heap file " + file);
  }
  if (st.st_size != 0 && static_cast<std::uint64_t>(st.st_size) != length) {
    ::close(fd);
    throw Error(Errc::invalid_argument, "heap file " + file + " of region '" + name + "' holds " + std::to_string(st.st_size) + " bytes, but " +
                                            std::to_string(length) +
                                            " were asked for; alloc() it with its size, "
                                            "or delete the file to start an empty heap");
  }
  if (st.st_size == 0) {
    // Reserve the space now: a full file system is an error here, not a
    // SIGBUS at the first write.
    int e = ::posix_fallocate(fd, 0, static_cast<off_t>(length));
    if (e != 0) {
      ::close(fd);
      ::unlink(file.c_str());
      if (e == ENOSPC || e == EFBIG || e == EDQUOT)
        throw Error(Errc::no_space, "no space for heap file " + file + " (" + std::to_string(length) + " bytes) of region '" + name + "'");
      detail::throw_errno(e, "cannot size heap file " + file);
    }
  }
  void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) detail::throw_errno(e, "cannot map heap file " + file + " of region '" + name + "'");
  state_->regions.push_back(std::make_unique<Region>(name, p, size, true));
  state_->heap_files[state_->regions.back().get()] = file;
  // Registering protects every page anew: an earlier note no longer holds.
  state_->drop_note(*state_->regions.back());
  state_->start_tracking(*state_->regions.back());
  return *state_->regions.back();
}

std::string Session::heap_path(const std::string& region) const {
  for (auto& r : state_->regions)
    if (r->name() == region) {
      auto it = state_->heap_files.find(r.get());
      return it == state_->heap_files.end() ? std::string() : it->second;
    }
  throw Error(Errc::not_found, "session '" + state_->name + "' has no region '" + region + "'");
}

void Session::base_on(const std::string& name) {
  state_->settle(false);
  std::optional<Manifest> m;
  {
    detail::SnapshotReader reader(detail::impl_of(state_->store));
    m = reader.load(state_->name, name);
  }
  // Nothing the tracker recorded is relative to this manifest: compare by hash.
  for (auto& [region, t] : state_->tracks)
    t.synced = false;
  state_->replace_base(std::move(*m));
  state_->head = name;
}

void Session::untrack(const std::string& name) {
  state_->settle(false);
  auto& rs = state_->regions;
  auto it = std::find_if(rs.begin(), rs.end(), [&](auto& r) { return r->name() == name; });
  if (it == rs.end()) throw Error(Errc::not_found, "session '" + state_->name + "' has no region '" + name + "'");
  state_->stop_tracking(**it);
  state_->drop_note(**it);
  state_->heap_files.erase(it->get());
  rs.erase(it);
}

std::vector<detail::RegionSource> Session::State::sources(bool* tracked_any) {
  std::vector<detail::RegionSource> out;
  *tracked_any = false;
  for (auto& r : regions) {
    detail::RegionSource src{r->name(), static_cast<const char*>(r->data()), r->size(), r->sdk_owned(), std::nullopt};
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
    bool tracked = false;
    if (changed_since_base(*r, ranges, &tracked)) {
      *tracked_any = *tracked_any || tracked;
      src.written = std::move(ranges);
    }
    out.push_back(std::move(src));
  }
  return out;
}

void Session::State::adopt(Manifest&& m) {
  for (auto& [region, t] : tracks)
    t.synced = true;
  // The notes describe the marks about to be cleared: gone first, so that no
  // moment (nor a failure to write the new ones) leaves a stale one.
  for (auto& [region, file] : heap_files)
    drop_note(*region);
  // Live memory now equals this snapshot: track writes relative to it.
  rearm();
  head = m.name;
  replace_base(std::move(m));
  last_snapshot = std::chrono::steady_clock::now();
  publish_notes();
}

void Session::State::settle(bool cancel) {
  if (!job || job->settled) return;
  if (cancel) job->cancel = true;
  job->wait();
  if (job->worker.joinable()) job->worker.join();
  job->settled = true;
  if (!job->background) return;  // taken at once: adopted then
  std::lock_guard<std::mutex> l(job->mu);
  for (std::size_t r = 0; r < job_regions.size(); ++r) {
    auto& t = tracks[job_regions[r]];
    if (!job->lost[r].empty()) {
      t.tracked = {0, 0};
      t.edges.clear();
      t.why = "region '" + job_regions[r]->name() + "': write tracking was lost after a background snapshot (" + job->lost[r] + ")";
    }
    // Published: live memory is the new snapshot except the pages the tracker
    // marks from the hand-back on and those found written before it. Not
    // published: the marks relative to the old base are gone, so the next
    // snapshot or restore compares with it by hashing.
    t.synced = job->published;
    t.after = job->published ? std::move(job->written_after[r]) : detail::ByteRanges{};
  }
  if (job->published) {
    head = job->manifest.name;
    replace_base(std::move(job->manifest));
    last_snapshot = std::chrono::steady_clock::now();
  }
  job_regions.clear();
}

SnapshotJob Session::background() const {
  state_->settle_if_done();
  return state_->job ? SnapshotJob(state_->job) : SnapshotJob();
}

namespace {
constexpr std::uint64_t kCopyAtCall = 64u << 10;  // untracked regions up to this size are copied aside at the call

// A label is free text, but valid UTF-8: listings and JSON documents show it
// as it is (a label in a stream received from elsewhere is shown escaped).
void check_label(const std::string& label) {
  for (std::size_t k = 0; k < label.size();) {
    const auto c = static_cast<unsigned char>(label[k]);
    std::size_t n = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    bool ok = n > 0 && k + n <= label.size();
    for (std::size_t i = 1; ok && i < n; ++i) {
      const auto d = static_cast<unsigned char>(label[k + i]);
      unsigned char lo = 0x80, hi = 0xbf;
      if (i == 1 && c == 0xe0) lo = 0xa0;
      if (i == 1 && c == 0xed) hi = 0x9f;
      if (i == 1 && c == 0xf0) lo = 0x90;
      if (i == 1 && c == 0xf4) hi = 0x8f;
      ok = d >= lo && d <= hi;
    }
    if (!ok)
      throw Error(Errc::invalid_argument, "the snapshot label has a byte that is not UTF-8 (0x" + [&] {
        char b[4];
        std::snprintf(b, sizeof b, "%02x", c);
        return std::string(b);
      }() + " at offset " + std::to_string(k) + "); labels are text: pass UTF-8 (Python str does)");
    k += n;
  }
}
}  // namespace

SnapshotJob Session::snapshot_background(const std::string& name, const SnapshotOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  State& st = *state_;
  check_label(options.label);
  st.settle(false);
  st.check_regions(name);
  StoreImpl& store = detail::impl_of(st.store);
  detail::check_new_snapshot(store, st.name, name, options.replace);
  auto job = std::make_shared<detail::BackgroundJob>();
  job->name = name;
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  auto at_once = [&](const std::string& why) {
    SnapshotOptions now = options;
    now.background = false;
    SnapshotInfo info = snapshot(name, now);
    job->background = false;
    job->note = why + "; it was taken at once";
    job->bytes_total = info.logical_bytes;
    job->finish_now(info);
    job->stall_s = elapsed();
    job->settled = true;
    st.job = job;
    return SnapshotJob(job);
  };
  // Every region must be under the guard: write-tracked (its whole pages can
  // be protected), or small enough to copy aside now.
  for (auto& r : st.regions) {
    auto& t = st.tracks[r.get()];
    if (t.tracked.first == t.tracked.second && r->size() > kCopyAtCall)
      return at_once("region '" + r->name() + "' is not write-tracked (" + (t.why.empty() ? std::string("hash tracking was asked for") : t.why) + ")");
  }
  // What must be read: from the tracker's marks only (a region without them
  // is hashed in the background, not here).
  bool tracked_any = false;
  std::vector<detail::RegionSource> sources;
  std::uint64_t read = 0, total = 0;
  const std::uint32_t cs = store.chunk_size;
  for (auto& r : st.regions) {
    detail::RegionSource src{r->name(), static_cast<const char*>(r->data()), r->size(), r->sdk_owned(), std::nullopt};
    detail::ByteRanges ranges;
    if (st.written_since_base(*r, ranges)) {
      tracked_any = true;
      std::uint64_t last_chunk = ~std::uint64_t(0);
      for (auto& [lo, hi] : ranges)
        for (std::uint64_t c = lo / cs; c * cs < hi; ++c)
          if (c != last_chunk) {
            read += std::min<std::uint64_t>(cs, r->size() - c * cs);
            last_chunk = c;
          }
      src.written = std::move(ranges);
    } else {
      read += r->size();
    }
    total += r->size();
    sources.push_back(std::move(src));
  }
  if (read * 4 < total)
    return at_once("only " + std::to_string(read) + " of " + std::to_string(total) +
                   " bytes are in chunks written since the last snapshot, which is quicker to copy than to write-protect");
  std::string why;
  job->guard = detail::CowGuard::open(&why);
  if (!job->guard) return at_once(why);
  // From here the memory moves from the tracker to the guard: the marks are
  // consumed (in `sources`), and the notes describing them go first.
  for (auto& [region, file] : st.heap_files)
    st.drop_note(*region);
  for (std::size_t i = 0; i < st.regions.size(); ++i) {
    Region& r = *st.regions[i];
    auto& t = st.tracks[&r];
    if (t.tracked.first != t.tracked.second) st.tracker->remove(t.tracked);
    int area = job->guard->add(t.tracked, static_cast<const char*>(r.data()), r.size(), cs, &why);
    if (area < 0) {
      // Undo: everything goes back to the tracker, compared by hashing next.
      job->guard.reset();
      for (std::size_t k = 0; k <= i; ++k) {
        auto& tk = st.tracks[st.regions[k].get()];
        std::string lost;
        if (tk.tracked.first != tk.tracked.second && !st.tracker->add(tk.tracked, &lost)) {
          tk.tracked = {0, 0};
          tk.why = "region '" + st.regions[k]->name() + "': " + lost;
        }
        tk.synced = false;
      }
      return at_once("region '" + r.name() + "' cannot be protected for a background snapshot (" + why + ")");
    }
    job->area.push_back(area);
  }
  job->guard->start();
  st.job_regions.clear();
  for (auto& r : st.regions)
    st.job_regions.push_back(r.get());
  job->hand_back = [&st, regions = st.job_regions](std::size_t r) -> std::string {
    auto& t = st.tracks.at(regions[r]);
    std::string lost;
    if (t.tracked.first != t.tracked.second && !st.tracker->add(t.tracked, &lost)) return lost;
    return "";
  };
  job->store = &store;
  job->session = st.name;
  job->writer_options = {.label = options.label, .parent = st.head, .replace = options.replace};
  job->sources = std::move(sources);
  job->base = st.base ? &*st.base : nullptr;
  job->tracked = tracked_any;
  job->spare = std::move(st.spare);
  st.spare = Manifest{};
  job->bytes_total = read;
  st.job = job;
  job->start();
  job->stall_s = elapsed();
  return SnapshotJob(job);
}

SnapshotInfo Session::snapshot(const std::string& name, const SnapshotOptions& options) {
  if (options.background) {
    SnapshotJob job = snapshot_background(name, options);
    if (!job.background()) return job.wait();
    SnapshotInfo info;
    info.session = state_->name;
    info.name = name;
    info.parent = state_->job->writer_options.parent;
    info.label = options.label;
    info.pending = true;
    return info;
  }
  check_label(options.label);
  state_->settle(false);
  state_->check_regions(name);
  // What changed since the base: asked of the tracker, or found by hashing,
  // before the store is locked.
  bool tracked = false;
  std::vector<detail::RegionSource> sources = state_->sources(&tracked);

  detail::WriteBatch batch(detail::impl_of(state_->store));
  detail::SnapshotWriter writer(batch, state_->name, name, {.label = options.label, .parent = state_->head, .replace = options.replace},
                                &state_->spare);
  state_->spare = Manifest{};
  detail::ProgressMeter meter(options.progress);
  detail::write_snapshot(writer, sources, state_->base ? &*state_->base : nullptr, tracked, nullptr, &meter);
  meter.finish();  // before the commit: a callback that throws here still publishes nothing
  std::exception_ptr after_commit;
  batch.publish({&writer}, &after_commit);
  state_->adopt(std::move(writer.published()));
  SnapshotInfo info = detail::info_from_manifest(*state_->base);
  DVR_LOG(debug, "snapshot " + StoreImpl::ref(info.session, info.name) + ": " + std::to_string(info.logical_bytes) + " bytes, " +
                     std::to_string(info.chunks_read) + " chunks read (" + info.tracking + "), " + std::to_string(info.stored_bytes) +
                     " bytes stored");
  if (after_commit) std::rethrow_exception(after_commit);
  return info;
}

// Maps the packs that hold what a restore will read (before ColdPages and
// check_restore, which read through those mappings from several threads).
void map_sources(detail::Packs& packs, const Manifest& m, const RestorePlan& plan, const std::string& ref) {
  try {
    std::size_t last = SIZE_MAX;
    for (auto& j : plan.jobs)
      if (j.chunk != last) detail::map_chunk(packs, detail::view_of(m, last = j.chunk));
  } catch (const Error& e) {
    throw Error(e.code(), "cannot restore '" + ref + "': " + e.what() + " (live memory was not changed)");
  }
}

// Checks every byte a restore will copy against its checksum. Throws corrupt
// (naming the region, the bytes and the pack) or what mapping the packs
// throws; live memory is not touched.
void check_restore(unsigned threads, detail::Packs& packs, const Manifest& m, const RestorePlan& plan, const ColdPages& cold,
                   const std::string& ref, detail::ProgressMeter& meter) {
  using detail::kPageSize;
  // Check every byte about to be copied: page by page against the page
  // hashes, or (older formats) whole chunks.
  const auto& jobs = plan.jobs;
  const auto& region_of = plan.region_of;
  const std::uint64_t work = plan.work;
  std::vector<std::size_t> touched;
  for (auto& j : jobs)
    if (touched.empty() || touched.back() != j.chunk) touched.push_back(j.chunk);
  auto damaged = [&](std::size_t chunk, std::uint64_t lo, std::uint64_t hi, const std::string& why) {
    auto* mr = region_of[chunk];
    std::uint64_t off = (chunk - mr->first_chunk) * m.chunk_size;
    return Error(Errc::corrupt, "snapshot '" + ref + "' is damaged: region '" + mr->name + "' bytes [" + std::to_string(off + lo) + ", " +
                                    std::to_string(off + hi) + ") " + why +
                                    "; live memory was not changed — restore another snapshot and run `dvr verify`");
  };
  for (std::size_t i : touched)
    if (!m.trusted(i)) throw damaged(i, 0, m.chunks[i].length, "do not match the checksum in its manifest");
  if (!m.paged) {
    std::string why;
    std::size_t bad = detail::first_damaged(threads, packs, m, touched, &why, &meter);
    if (bad != SIZE_MAX) throw damaged(touched[bad], 0, m.chunks[touched[bad]].length, "fail their checksum: " + why);
  } else {
    std::atomic<std::size_t> bad{SIZE_MAX};
    std::atomic<std::uint32_t> bad_page{0};
    detail::parallel_for(threads, jobs.size(), work, [&](std::size_t b, std::size_t e) {
      for (std::size_t k = b; k < e && bad.load() == SIZE_MAX && !meter.stopped(); ++k) {
        if (k + 1 < e) {
          // Scattered pages: start loading the next job's while this one is
          // hashed (its first two pages: a written page of an unaligned
          // region spans two of the region's).
          detail::ChunkView nv = detail::view_of(m, jobs[k + 1].chunk);
          for (std::uint32_t p = jobs[k + 1].p0; p < std::min(jobs[k + 1].p1, jobs[k + 1].p0 + 2); ++p) {
            detail::PageLoc next = nv.location(p);
            if (const char* ahead = next.pack ? packs.mapped(next.pack, next.offset, kPageSize) : nullptr)
              for (std::uint64_t line = 0; line < 512; line += 64)
                __builtin_prefetch(ahead + line);
          }
        }
        detail::ChunkView v = detail::view_of(m, jobs[k].chunk);
        if (!v.overlay_count && !v.ref->is_zero()) {
          const std::uint64_t lo = std::uint64_t{jobs[k].p0} * kPageSize;
          const std::uint64_t hi = std::min<std::uint64_t>(std::uint64_t{jobs[k].p1} * kPageSize, m.chunks[jobs[k].chunk].length);
          const char* first = packs.mapped(v.ref->pack, v.ref->offset + lo, hi - lo);
          if (first && cold.cold(first)) {
            // Pages stored together and not mapped here: read with pread in
            // pieces, each page hashed in the buffer.
            char* buf = cold_buffer();
            for (std::uint64_t piece = lo; piece < hi; piece += kColdPiece) {
              const std::uint64_t n = std::min<std::uint64_t>(kColdPiece, hi - piece);
              try {
                packs.copy_mapped(v.ref->pack, v.ref->offset + piece, buf, n);
              } catch (const Error& failed) {
                throw Error(failed.code(), "cannot restore '" + ref + "': " + failed.what() + " (live memory was not changed)");
              }
              for (std::uint64_t off = 0; off < n; off += kPageSize) {
                const auto p = static_cast<std::uint32_t>((piece + off) / kPageSize);
                if (detail::page_hash(buf + off, v.page_length(p)) != v.pages[p]) {
                  std::size_t none = SIZE_MAX;
                  if (bad.compare_exchange_strong(none, k)) bad_page = p;
                  return;
                }
              }
            }
            meter.add(jobs[k].hi - jobs[k].lo);
            continue;
          }
        }
        for (std::uint32_t p = jobs[k].p0; p < jobs[k].p1; ++p) {
          detail::PageLoc at = v.location(p);
          std::uint32_t len = v.page_length(p);
          const char* bytes = at.pack ? packs.mapped(at.pack, at.offset, len) : nullptr;
          std::uint64_t h = detail::zero_page_hash(len);
          if (bytes && cold.cold(bytes)) {
            char* buf = cold_buffer();
            try {
              packs.copy_mapped(at.pack, at.offset, buf, len);
            } catch (const Error& failed) {
              throw Error(failed.code(), "cannot restore '" + ref + "': " + failed.what() + " (live memory was not changed)");
            }
            h = detail::page_hash(buf, len);
          } else if (bytes && !detail::guarded(bytes, len, [&] { h = detail::page_hash(bytes, len); }))
            throw Error(Errc::corrupt, "cannot restore '" + ref + "': " + packs.unreadable(at.pack, at.offset, bytes).what() + " (live memory was not changed)");
          if ((at.pack && !bytes) || h != v.pages[p]) {
            std::size_t none = SIZE_MAX;
            if (bad.compare_exchange_strong(none, k)) bad_page = p;
            return;
          }
        }
        meter.add(jobs[k].hi - jobs[k].lo);
      }
    }, &meter);
    if (bad.load() != SIZE_MAX) {
      const RestoreJob& j = jobs[bad.load()];
      std::uint64_t lo = std::uint64_t{bad_page.load()} * kPageSize;
      detail::PageLoc at = detail::view_of(m, j.chunk).location(bad_page.load());
      throw damaged(j.chunk, lo, std::min<std::uint64_t>(lo + kPageSize, m.chunks[j.chunk].length),
                    "fail their checksum (" + packs.path_of(at.pack) + " offset " + std::to_string(at.offset) + ")");
    }
  }
}

// Copies checked pack data into live memory (non-temporal stores); a read
// that takes SIGBUS (the pack truncated since it was checked, a failing
// medium) throws corrupt or io naming the pack.
static void copy_checked(detail::Packs& packs, const ColdPages& cold, std::uint32_t pack, std::uint64_t offset, char* to, std::size_t len) {
  const char* from = packs.mapped(pack, offset, len);
  if (!from) throw Error(Errc::corrupt, "pack file " + packs.path_of(pack) + " changed during the restore; run `dvr verify`");
  if (cold.cold(from)) {
    char* buf = cold_buffer();
    for (std::size_t done = 0; done < len;) {
      const std::size_t n = std::min(len - done, kColdPiece);
      try {
        packs.copy_mapped(pack, offset + done, buf, n);
      } catch (const Error& e) {
        throw Error(e.code(), std::string(e.what()) + " (live memory was partly restored: restore again from an intact snapshot)");
      }
      detail::copy_nt(to + done, buf, n);
      done += n;
    }
    return;
  }
  if (!detail::guarded(from, len, [&] { detail::copy_nt(to, from, len); })) {
    Error e = packs.unreadable(pack, offset, from);
    throw Error(e.code(), std::string(e.what()) + " (live memory was partly restored: restore again from an intact snapshot)");
  }
}

// Copies a checked plan into live memory (non-temporal stores, every core).
void copy_restore(unsigned threads, detail::Packs& packs, const Manifest& m, const RestorePlan& plan, const ColdPages& cold,
                  detail::ProgressMeter& meter) {
  using detail::kPageSize;
  detail::parallel_for(threads, plan.jobs.size(), plan.work, [&](std::size_t b, std::size_t e) {
    for (std::size_t k = b; k < e; ++k) {
      const RestoreJob& j = plan.jobs[k];
      meter.add(j.hi - j.lo);  // deferred: a callback's exception does not stop the copy
      detail::ChunkView v = detail::view_of(m, j.chunk);
      if (!v.overlay_count) {
        // Pages stored together: one copy.
        char* to = plan.dst[j.chunk] + j.lo;
        if (v.ref->is_zero())
          detail::zero_nt(to, j.hi - j.lo);
        else
          copy_checked(packs, cold, v.ref->pack, v.ref->offset + j.lo, to, j.hi - j.lo);
        continue;
      }
      for (std::uint32_t p = j.p0; p < j.p1; ++p) {
        detail::PageLoc at = v.location(p);
        const std::uint64_t page = std::uint64_t{p} * kPageSize;
        const std::uint64_t lo = std::max(j.lo, page), hi = std::min(j.hi, page + v.page_length(p));
        char* to = plan.dst[j.chunk] + lo;
        if (at.pack)
          copy_checked(packs, cold, at.pack, at.offset + (lo - page), to, hi - lo);
        else
          detail::zero_nt(to, hi - lo);
      }
    }
  }, &meter);
}

// Plans a restore of `m`: for each region, the pages that differ from live
// memory (everything, unless live memory is known to be the base except the
// pages written since). Throws invalid_argument for a missing or resized
// region; nothing is changed.
RestorePlan Session::State::plan_restore(const Manifest& m, const std::string& ref) {
  using detail::kPageSize;
  const Manifest* base_m = base ? &*base : nullptr;
  const std::uint32_t pages_per_chunk = detail::pages_in(m.chunk_size);
  RestorePlan plan;
  plan.dst.resize(m.chunks.size());
  plan.region_of.resize(m.chunks.size());
  for (auto& mr : m.regions) {
    Region* live = nullptr;
    for (auto& r : regions)
      if (r->name() == mr.name) live = r.get();
    if (!live)
      throw Error(Errc::invalid_argument, "snapshot '" + ref + "' records region '" + mr.name + "' (" + std::to_string(mr.size) +
                                              " bytes) but this session has no such region; track() or alloc() it with that size, then restore");
    if (live->size() != mr.size)
      throw Error(Errc::invalid_argument, "region '" + mr.name + "' is " + std::to_string(live->size()) + " bytes now but " +
                                              std::to_string(mr.size) + " bytes in snapshot '" + ref +
                                              "'; resize it to match before restoring (nothing was changed)");
    for (std::uint64_t j = 0; j < mr.chunk_count; ++j) {
      plan.dst[mr.first_chunk + j] = static_cast<char*>(live->data()) + j * m.chunk_size;
      plan.region_of[mr.first_chunk + j] = &mr;
    }
    std::uint64_t copy_bytes = 0;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
    const ManifestRegion* br = nullptr;
    std::optional<detail::WrittenPages> w;
    bool tracked = false;
    if (changed_since_base(*live, ranges, &tracked)) {
      // Live memory is the base snapshot except the pages written since: copy
      // the pages in which the target differs from the base, and the written
      // pages.
      br = base_region(*live);
      w.emplace(ranges, mr.size, m.chunk_size);
    }
    std::size_t next_written = 0;  // first of `ranges` that may reach the page at hand
    for (std::uint64_t j = 0; j < mr.chunk_count; ++j) {
      const std::size_t i = mr.first_chunk + j;
      const std::uint32_t n = detail::pages_in(m.chunks[i].length);  // (older formats have no page hashes)
      // Bytes [lo, hi) of the chunk, joined to the previous job when they touch.
      auto add_bytes = [&](std::uint64_t lo, std::uint64_t hi) {
        const auto p1 = static_cast<std::uint32_t>((hi + kPageSize - 1) / kPageSize);
        if (!plan.jobs.empty() && plan.jobs.back().chunk == i && plan.jobs.back().hi >= lo) {
          plan.jobs.back().hi = std::max(plan.jobs.back().hi, hi);
          plan.jobs.back().p1 = std::max(plan.jobs.back().p1, p1);
        } else {
          plan.jobs.push_back({i, static_cast<std::uint32_t>(lo / kPageSize), p1, lo, hi});
        }
        copy_bytes += hi - lo;
      };
      auto add = [&](std::uint32_t p0, std::uint32_t p1) {
        add_bytes(std::uint64_t{p0} * kPageSize, std::min<std::uint64_t>(std::uint64_t{p1} * kPageSize, m.chunks[i].length));
      };
      if (!br) {
        add(0, n);
        continue;
      }
      const ChunkRef &t = m.chunks[i], &b = base_m->chunks[br->first_chunk + j];
      const bool same_kind = m.paged == base_m->paged && t.length == b.length && base_m->trusted(br->first_chunk + j) && m.trusted(i);
      if (same_kind && t.hash == b.hash && !w->chunk[j]) continue;
      if (!same_kind || (!m.paged && !(t.hash == b.hash))) {
        add(0, n);
        continue;
      }
      // Page by page: differing page hashes (the whole page), or written
      // since the base (the written bytes only).
      const std::uint64_t *th = m.paged ? m.hashes_of(i) : nullptr, *bh = m.paged ? base_m->hashes_of(br->first_chunk + j) : nullptr;
      const bool chunk_same = t.hash == b.hash;
      const std::uint64_t chunk_at = j * m.chunk_size;
      for (std::uint32_t p = 0; p < n; ++p) {
        if (!chunk_same && th[p] != bh[p]) {
          add(p, p + 1);
        } else if (w->page[j * pages_per_chunk + p]) {
          const std::uint64_t pb = chunk_at + std::uint64_t{p} * kPageSize;
          const std::uint64_t pe = chunk_at + std::min<std::uint64_t>(std::uint64_t{p + 1} * kPageSize, t.length);
          while (next_written < ranges.size() && ranges[next_written].second <= pb)
            ++next_written;
          for (std::size_t x = next_written; x < ranges.size() && ranges[x].first < pe; ++x)
            add_bytes(std::max(ranges[x].first, pb) - chunk_at, std::min(ranges[x].second, pe) - chunk_at);
        }
      }
    }
    // Writing most of a tracked region page by page would take one protection
    // fault per page: lift the protection first (it is restored afterwards).
    auto& t = tracks[live];
    if (t.tracked.first != t.tracked.second && copy_bytes > mr.size / 8) plan.unprotect.push_back(t.tracked);
  }

  for (auto& j : plan.jobs)
    plan.work += std::max<std::uint64_t>(detail::kPageWork, (j.p1 - j.p0) * kPageSize);
  return plan;
}

void Session::restore(const std::string& name) { restore(name, RestoreOptions{}); }

void Session::restore(const std::string& name, const RestoreOptions& options) {
  state_->settle(false);
  using detail::kPageSize;
  const std::string ref = StoreImpl::ref(state_->name, name);
  // Nobody can reuse the space of this snapshot's data while it is read.
  detail::SnapshotReader reader(detail::impl_of(state_->store));
  // Rolling back to the base (the usual case: one snapshot, many trials)
  // needs no reading and decoding of its manifest when it is unchanged.
  std::optional<Manifest> loaded;
  const Manifest& m = reader.current(state_->base ? &*state_->base : nullptr, state_->name, name, loaded);
  RestorePlan plan = state_->plan_restore(m, ref);
  const unsigned threads = detail::impl_of(state_->store).threads;
  std::uint64_t copy_bytes = 0;
  for (auto& j : plan.jobs)
    copy_bytes += j.hi - j.lo;
  detail::ProgressMeter meter(options.progress, 2 * copy_bytes);
  map_sources(reader.packs(), m, plan, ref);
  const ColdPages cold(reader.packs(), m, plan, !state_->restored);
  check_restore(threads, reader.packs(), m, plan, cold, ref, meter);
  if (meter.stopped()) throw Error(Errc::cancelled, "restore of '" + ref + "' stopped by its progress callback; live memory was not changed");
  // A restore refused or cancelled before this point leaves the next one
  // the session's first (ColdPages).
  state_->restored = true;
  // From here on live memory changes; the tracker is re-armed at the end.
  // A progress callback that throws now is rethrown once memory is whole.
  meter.defer();
  meter.advance_to(copy_bytes);  // (old formats check whole chunks: count what is copied)
  for (auto& r : plan.unprotect)
    state_->tracker->unprotect(r);
  copy_restore(threads, reader.packs(), m, plan, cold, meter);
  for (auto& [region, file] : state_->heap_files)
    state_->drop_note(*region);  // before the marks are cleared
  state_->rearm();
  for (auto& mr : m.regions)
    for (auto& r : state_->regions)
      if (r->name() == mr.name) state_->tracks[r.get()].synced = true;
  if (loaded) state_->replace_base(std::move(*loaded));
  state_->head = name;
  state_->publish_notes();
  DVR_LOG(debug, "restore " + ref + ": " + std::to_string(copy_bytes) + " bytes copied");
  meter.finish();
}

}  // namespace dvr
