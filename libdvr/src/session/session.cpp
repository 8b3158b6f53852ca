#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

#include <algorithm>
#include <atomic>
#include <optional>
#include <cstring>
#include <mutex>
#include <set>
#include <unordered_map>

#include <pthread.h>

#include "dvr/session.hpp"
#include "format/chunks.hpp"
#include "track/dirty.hpp"
#include "base/memops.hpp"
#include "proc/proc_heaps.hpp"
#include "store/store_impl.hpp"

namespace dvr {

using detail::ChunkRef;
using detail::Manifest;
using detail::ManifestRegion;
using detail::StoreImpl;

Region::~Region() {
  if (sdk_owned_ && data_) ::munmap(data_, detail::round_up_page(size_));
}

const char* tracking_name(Tracking tracking) noexcept {
  return tracking == Tracking::write_protect ? "write_protect" : "hash";
}

namespace {

// How one region's writes are found.
struct RegionTrack {
  detail::AddrRange tracked{0, 0};       // registered whole pages; empty: not tracked
  std::vector<detail::AddrRange> edges;  // partial pages at unaligned ends: always compared
  // The tracker's record is relative to the session's base only after a
  // snapshot or restore covered the region: memory tracked (or allocated)
  // since then is compared by hashing until one does.
  bool synced = false;
  std::string why;                       // why it is not tracked
};

constexpr std::uintptr_t kPage = 4096;

}  // namespace

struct Session::State {
  explicit State(Store s) : store(std::move(s)) {}
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
  // Pages known written from outside (detail::assume_written), per region.
  std::unordered_map<const Region*, std::vector<std::pair<std::uint64_t, std::uint64_t>>> external;
  std::string head;
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

  void start_tracking(Region& r);
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
  const ManifestRegion* base_region(const Region& r) const;
  // Tracking notes of persistent regions (proc_heaps.hpp): written after a
  // snapshot or restore, removed whenever the record they describe ends.
  void publish_notes();
  void drop_note(const Region& r);
};

namespace {
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
    ::pthread_atfork(nullptr, [] {
      std::lock_guard<std::mutex> g(g_notes_mu);
      for (auto& n : g_notes) ::unlink(n.c_str());
      g_notes.clear();
    }, nullptr);
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
    if (t == tracks.end() || t->second.tracked.first == t->second.tracked.second || !t->second.synced || !base_region(*region)) {
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
    detail::heaps::write_note(file, note);  // best effort: a missing note only costs hashing
  }
}

void Session::State::start_tracking(Region& r) {
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
  } else if (tracker->add({inner_b, inner_e}, &t.why)) {
    t.tracked = {inner_b, inner_e};
    if (b < inner_b) t.edges.emplace_back(b & ~(kPage - 1), inner_b);
    if (inner_e < e) t.edges.emplace_back(inner_e, inner_e + kPage);
  } else {
    t.why = "region '" + r.name() + "': " + t.why;
  }
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
  if (auto ex = external.find(&r); ex != external.end() && base_region(r)) {
    out = ex->second;
    return true;
  }
  auto it = tracks.find(&r);
  if (!base_region(r) || it == tracks.end() || it->second.tracked.first == it->second.tracked.second || !it->second.synced)
    return false;
  std::vector<detail::AddrRange> pages;
  if (!tracker->written(it->second.tracked, pages)) {
    // The memory was unmapped and mapped again (or this is a forked child):
    // from now on this region is compared by hashing.
    tracker->remove(it->second.tracked);
    it->second.tracked = {0, 0};
    it->second.why = "region '" + r.name() + "' was remapped; write tracking was lost";
    return false;
  }
  pages.insert(pages.end(), it->second.edges.begin(), it->second.edges.end());
  std::sort(pages.begin(), pages.end());
  auto b = reinterpret_cast<std::uintptr_t>(r.data()), e = b + r.size();
  for (auto& [pb, pe] : pages) {
    std::uintptr_t lo = std::max(pb, b), hi = std::min(pe, e);
    if (lo >= hi) continue;
    if (!out.empty() && out.back().second >= lo - b) out.back().second = std::max<std::uint64_t>(out.back().second, hi - b);
    else out.emplace_back(lo - b, hi - b);
  }
  return true;
}

bool Session::State::changed_since_base(const Region& r, std::vector<std::pair<std::uint64_t, std::uint64_t>>& out, bool* tracked) {
  *tracked = written_since_base(r, out);
  if (*tracked) return true;
  out.clear();
  const ManifestRegion* br = base_region(r);
  if (!br || !base->paged) return false;
  // The region's pages are consecutive in the base's page hash table.
  const std::uint64_t* expect = base->page_hashes.data() + base->first_page[br->first_chunk];
  const std::size_t pages = detail::pages_in(r.size());
  std::vector<char> differs(pages, 0);
  auto data = static_cast<const char*>(r.data());
  detail::parallel_for(pages, r.size(), [&](std::size_t b, std::size_t e) {
    for (std::size_t p = b; p < e; ++p) {
      std::size_t len = std::min<std::uint64_t>(detail::kPageSize, r.size() - p * detail::kPageSize);
      differs[p] = detail::page_hash(data + p * detail::kPageSize, len) != expect[p];
    }
  });
  for (std::size_t p = 0; p < pages; ++p) {
    if (!differs[p]) continue;
    std::uint64_t lo = p * detail::kPageSize, hi = std::min<std::uint64_t>(lo + detail::kPageSize, r.size());
    if (!out.empty() && out.back().second == lo) out.back().second = hi;
    else out.emplace_back(lo, hi);
  }
  return true;
}

void Session::State::rearm() {
  if (!tracker) return;
  // One thread: protecting a fully written GiB again takes ~2 ms that way,
  // but longer on two, because protecting pages while another CPU runs this
  // process makes every page-table walk interrupt that CPU to flush its TLB.
  for (auto& [region, t] : tracks) {
    if (t.tracked.first == t.tracked.second || tracker->reprotect(t.tracked)) continue;
    tracker->remove(t.tracked);
    t.tracked = {0, 0};
    t.why = "region '" + region->name() + "' was remapped; write tracking was lost";
  }
}

Session::Session(Store store, std::string name, const SessionOptions& options)
    : state_(std::make_unique<State>(std::move(store))) {
  state_->name = std::move(name);
  state_->options = options;
  detail::check_name("session", state_->name);
}

Tracking Session::tracking(const std::string& name) const {
  for (auto& r : state_->regions)
    if (r->name() == name) {
      auto& t = state_->tracks[r.get()];
      return t.tracked.first != t.tracked.second ? Tracking::write_protect : Tracking::hash;
    }
  throw Error(Errc::not_found, "session '" + state_->name + "' has no region '" + name + "'");
}

std::string Session::tracking_note() const {
  std::string note;
  for (auto& r : state_->regions) {
    auto& t = state_->tracks[r.get()];
    if (!t.why.empty() && note.find(t.why) == std::string::npos) note += (note.empty() ? "" : "; ") + t.why;
  }
  return note;
}

Session::~Session() {
  if (state_)
    for (auto& [region, file] : state_->heap_files) state_->drop_note(*region);
}

namespace detail {
void assume_written(Session& s, const std::string& region, std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges) {
  s.state_->external[&s.region(region)] = std::move(ranges);
}
bool base_on_if(Session& s, const std::string& name, std::uint64_t checksum) {
  try {
    s.base_on(name);
  } catch (const Error&) {
    return false;  // removed or damaged since: compare by hash instead
  }
  if (s.state_->base && s.state_->base->checksum == checksum) return true;
  s.state_->base.reset();
  s.state_->head.clear();
  return false;
}
}  // namespace detail
Session::Session(Session&&) noexcept = default;
Session& Session::operator=(Session&&) noexcept = default;

const std::string& Session::name() const { return state_->name; }
Store& Session::store() { return state_->store; }
const std::string& Session::head() const { return state_->head; }
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

void Session::autosave(std::chrono::milliseconds every, std::size_t keep) {
  if (every.count() > 0 && keep == 0)
    throw Error(Errc::invalid_argument, "autosave for session '" + state_->name + "' must keep at least one snapshot");
  state_->autosave_every = every.count() > 0 ? every : std::chrono::milliseconds(0);
  state_->autosave_keep = keep;
  // Continue the numbering of earlier runs, so names never repeat.
  for (auto& info : list()) state_->autosave_next = std::max(state_->autosave_next, autosave_number(info.name) + 1);
  state_->last_snapshot = std::chrono::steady_clock::now();
}

std::optional<SnapshotInfo> Session::checkpoint_point() {
  if (state_->autosave_every.count() == 0 || std::chrono::steady_clock::now() - state_->last_snapshot < state_->autosave_every)
    return std::nullopt;
  SnapshotInfo taken = snapshot(kAutosavePrefix + std::to_string(state_->autosave_next++), {.label = "autosave"});
  // Retention: the newest `keep` autosaves stay (by number; named ones are not
  // autosaves and are never touched).
  std::vector<std::uint64_t> numbers;
  for (auto& info : list())
    if (auto n = autosave_number(info.name)) numbers.push_back(n);
  std::sort(numbers.begin(), numbers.end());
  for (std::size_t i = 0; i + state_->autosave_keep < numbers.size(); ++i) {
    try {
      state_->store.remove(state_->name, kAutosavePrefix + std::to_string(numbers[i]));
    } catch (const Error& e) {
      if (e.code() != Errc::not_found) throw;  // removed meanwhile by someone else
    }
  }
  return taken;
}
std::optional<SnapshotInfo> Session::latest() const { return state_->store.latest(state_->name); }

std::vector<Region*> Session::regions() const {
  std::vector<Region*> out;
  for (auto& r : state_->regions) out.push_back(r.get());
  return out;
}

Region& Session::region(const std::string& name) {
  for (auto& r : state_->regions)
    if (r->name() == name) return *r;
  throw Error(Errc::not_found, "session '" + state_->name + "' has no region '" + name + "'");
}

static void check_new_region(const std::vector<std::unique_ptr<Region>>& regions, const std::string& session,
                             const std::string& name, const void* data, std::size_t size) {
  detail::check_name("region", name);
  for (auto& r : regions)
    if (r->name() == name)
      throw Error(Errc::already_exists, "session '" + session + "' already has a region '" + name + "'; untrack() it first");
  if (size == 0) throw Error(Errc::invalid_argument, "region '" + name + "' has size 0; regions must hold at least one byte");
  if (data == nullptr) return;
  auto b = reinterpret_cast<std::uintptr_t>(data), e = b + size;
  if (e < b) throw Error(Errc::invalid_argument, "region '" + name + "' wraps around the address space");
  for (auto& r : regions) {
    auto rb = reinterpret_cast<std::uintptr_t>(r->data()), re = rb + r->size();
    if (b < re && rb < e)
      throw Error(Errc::invalid_argument, "region '" + name + "' overlaps region '" + r->name() +
                                              "'; a byte may belong to one region only");
  }
}

Region& Session::track(const std::string& name, void* data, std::size_t size) {
  if (!data) throw Error(Errc::invalid_argument, "region '" + name + "': pointer is null");
  check_new_region(state_->regions, state_->name, name, data, size);
  state_->regions.push_back(std::make_unique<Region>(name, data, size, false));
  state_->start_tracking(*state_->regions.back());
  return *state_->regions.back();
}

Region& Session::alloc(const std::string& name, std::size_t size) {
  check_new_region(state_->regions, state_->name, name, nullptr, size);
  void* p = ::mmap(nullptr, detail::round_up_page(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw Error(Errc::no_space, "cannot allocate " + std::to_string(size) + " bytes for region '" + name + "': out of memory");
  state_->regions.push_back(std::make_unique<Region>(name, p, size, true));
  state_->start_tracking(*state_->regions.back());
  return *state_->regions.back();
}

Region& Session::alloc(const std::string& name, std::size_t size, const AllocOptions& options) {
  if (!options.persistent) return alloc(name, size);
  check_new_region(state_->regions, state_->name, name, nullptr, size);
  StoreImpl& store = *state_->store.impl_;
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
    throw Error(Errc::invalid_argument, "heap file " + file + " of region '" + name + "' holds " + std::to_string(st.st_size) +
                                            " bytes, but " + std::to_string(length) + " were asked for; alloc() it with its size, "
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
  StoreImpl& store = *state_->store.impl_;
  std::optional<Manifest> m;
  {
    std::lock_guard<std::mutex> guard(store.mu);
    StoreImpl::Lock lock(store, false);
    store.packs->refresh_mappings();
    m = store.load_manifest(state_->name, name);
  }
  // Nothing the tracker recorded is relative to this manifest: compare by hash.
  for (auto& [region, t] : state_->tracks) t.synced = false;
  state_->replace_base(std::move(*m));
  state_->head = name;
}

void Session::untrack(const std::string& name) {
  auto& rs = state_->regions;
  auto it = std::find_if(rs.begin(), rs.end(), [&](auto& r) { return r->name() == name; });
  if (it == rs.end()) throw Error(Errc::not_found, "session '" + state_->name + "' has no region '" + name + "'");
  state_->stop_tracking(**it);
  state_->drop_note(**it);
  state_->external.erase(it->get());
  state_->heap_files.erase(it->get());
  rs.erase(it);
}

namespace {

// Region-relative byte ranges -> per-page and per-chunk "written" marks.
struct WrittenPages {
  std::vector<char> page;   // page of the region written since the base
  std::vector<char> chunk;  // chunk holds a written page
  WrittenPages(const std::vector<std::pair<std::uint64_t, std::uint64_t>>& ranges, std::uint64_t size, std::uint32_t chunk_size)
      : page(detail::pages_in(size), 0), chunk((size + chunk_size - 1) / chunk_size, 0) {
    for (auto& [b, e] : ranges)
      for (std::uint64_t p = b / detail::kPageSize; p * detail::kPageSize < e && p < page.size(); ++p) {
        page[p] = 1;
        chunk[p * detail::kPageSize / chunk_size] = 1;
      }
  }
};

enum class Plan : std::uint8_t { inherit, patch, whole };

// Work estimate for parallel_for: scattered pages cost far more than their
// bytes (a page-table walk and often a fault each), so each counts as 16 KiB.
constexpr std::uint64_t kPageWork = 16u << 10;

}  // namespace

SnapshotInfo Session::snapshot(const std::string& name, const SnapshotOptions& options) {
  using detail::kPageSize;
  detail::check_name("snapshot", name);
  StoreImpl& store = *state_->store.impl_;
  const std::string ref = StoreImpl::ref(state_->name, name);
  if (state_->regions.empty())
    throw Error(Errc::invalid_argument, "session '" + state_->name + "' has no regions to snapshot as '" + name +
                                            "'; track() or alloc() memory first");

  Manifest m = std::move(state_->spare);
  state_->spare = Manifest{};
  m.regions.clear();
  m.chunks.clear();
  m.page_hashes.clear();
  m.overlays.clear();
  m.untrusted.clear();
  m.paged = true;
  m.session = state_->name;
  m.name = name;
  m.parent = state_->head;
  m.label = options.label;
  m.chunk_size = store.chunk_size;
  const std::uint32_t pages_per_chunk = detail::pages_in(m.chunk_size);
  std::vector<const char*> src;
  // Per region: the pages written since the base, when the tracker knows them.
  std::vector<std::optional<WrittenPages>> written(state_->regions.size());
  std::vector<const ManifestRegion*> base_regions(state_->regions.size(), nullptr);
  bool tracked_any = false;
  for (std::size_t ri = 0; ri < state_->regions.size(); ++ri) {
    Region& r = *state_->regions[ri];
    std::uint64_t count = (r.size() + m.chunk_size - 1) / m.chunk_size;
    m.regions.push_back({r.name(), r.size(), r.sdk_owned(), m.chunks.size(), count});
    auto base = static_cast<const char*>(r.data());
    for (std::uint64_t i = 0; i < count; ++i) {
      ChunkRef c;
      c.length = static_cast<std::uint32_t>(std::min<std::uint64_t>(m.chunk_size, r.size() - i * m.chunk_size));
      m.chunks.push_back(c);
      src.push_back(base + i * m.chunk_size);
    }
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
    bool tracked = false;
    if (state_->changed_since_base(r, ranges, &tracked)) {
      tracked_any = tracked_any || tracked;
      written[ri].emplace(ranges, r.size(), m.chunk_size);
      base_regions[ri] = state_->base_region(r);
    }
  }
  m.index();
  m.page_hashes.assign(m.first_page.back(), 0);

  std::lock_guard<std::mutex> guard(store.mu);
  StoreImpl::Lock lock(store, true);
  if (!options.replace && detail::path_exists(store.manifest_path(m.session, name)))
    throw Error(Errc::already_exists, "snapshot '" + ref + "' exists already; pick another name, pass replace, or `dvr rm " + ref + "` first");
  store.refresh_index();
  if (name == m.parent) {
    // Replacing the head: the new version takes the old one's place in the
    // timeline instead of becoming its own parent.
    try {
      m.parent = store.load_manifest(m.session, name, nullptr, false).parent;
    } catch (const Error&) {
      m.parent.clear();
    }
  }
  store.packs->map_all();

  // Chunks with no page written since the base are taken from its manifest,
  // provided the base is still stored exactly as the session knows it (it may
  // have been removed and its space reused). A chunk with a few written pages
  // keeps the base's stored bytes and gets those pages stored apart
  // (overlays); other chunks are hashed and stored whole.
  const Manifest* base = state_->base && state_->base->paged &&
                                 store.manifest_indexed(state_->base->session, state_->base->name, state_->base->checksum)
                             ? &*state_->base
                             : nullptr;
  std::vector<Plan> plan(m.chunks.size(), Plan::whole);
  std::vector<std::size_t> base_chunk(m.chunks.size(), 0);
  // Patched chunk i: its written pages are pages[page_from[i] .. page_from[i+1]).
  std::vector<std::uint32_t> pages;
  std::vector<std::uint32_t> page_from(m.chunks.size() + 1, 0);
  for (std::size_t ri = 0; base && ri < m.regions.size(); ++ri) {
    const ManifestRegion* br = base_regions[ri];
    if (!written[ri] || !br) continue;
    const ManifestRegion& mr = m.regions[ri];
    for (std::uint64_t j = 0; j < mr.chunk_count; ++j) {
      std::size_t i = mr.first_chunk + j, bi = br->first_chunk + j;
      base_chunk[i] = bi;
      page_from[i] = page_from[i + 1] = static_cast<std::uint32_t>(pages.size());
      if (!base->trusted(bi)) continue;  // its stored copy is damaged: read the live bytes again
      if (!written[ri]->chunk[j]) {
        plan[i] = Plan::inherit;
        continue;
      }
      for (std::uint32_t p = 0; p < m.pages_of(i); ++p)
        if (written[ri]->page[j * pages_per_chunk + p]) pages.push_back(p);
      // Pages stored apart afterwards: the base's overlays and the written
      // pages that are not among them.
      std::size_t apart = base->first_overlay[bi + 1] - base->first_overlay[bi];
      for (std::size_t x = page_from[i]; x < pages.size(); ++x) {
        bool already = false;
        for (std::uint32_t k = base->first_overlay[bi]; k < base->first_overlay[bi + 1] && !already; ++k)
          already = base->overlays[k].page == pages[x];
        apart += already ? 0 : 1;
      }
      if (apart * 4 <= m.pages_of(i)) plan[i] = Plan::patch;
      else pages.resize(page_from[i]);
      page_from[i + 1] = static_cast<std::uint32_t>(pages.size());
    }
  }
  // (Ranges are meaningful for patched chunks only.)
  auto patch_count = [&](std::size_t i) { return page_from[i + 1] - page_from[i]; };
  std::vector<std::size_t> todo;
  std::vector<std::uint64_t> slot{0};  // slot[k]: bytes todo[0..k) could need at most
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < m.chunks.size(); ++i) {
    if (plan[i] == Plan::inherit) {
      m.chunks[i] = base->chunks[base_chunk[i]];
      std::copy_n(base->hashes_of(base_chunk[i]), m.pages_of(i), m.page_hashes.begin() + static_cast<std::ptrdiff_t>(m.first_page[i]));
      continue;
    }
    std::uint64_t need = plan[i] == Plan::patch ? patch_count(i) * kPageSize : detail::round_up_page(m.chunks[i].length);
    todo.push_back(i);
    slot.push_back(slot.back() + need);
    total += plan[i] == Plan::patch ? patch_count(i) * kPageWork : need;
  }
  // The overlays of patched chunk i go to patched[ov_from[i] ..], ov_count[i]
  // of them (room for the base's and one per written page). Sized here, so
  // that the workers allocate nothing.
  std::vector<std::size_t> ov_from(m.chunks.size(), 0);
  std::vector<std::uint32_t> ov_count(m.chunks.size(), 0);
  std::size_t ov_room = 0;
  for (std::size_t i : todo)
    if (plan[i] == Plan::patch) {
      ov_from[i] = ov_room;
      ov_room += base->first_overlay[base_chunk[i] + 1] - base->first_overlay[base_chunk[i]] + patch_count(i);
    }
  std::vector<detail::Overlay> patched(ov_room);

  StoreImpl::AllocationScope allocation(store);

  // One pass per chunk: hash it, and if the store lacks it, copy it into a
  // block of free pack space while it is still in cache. Each thread takes
  // blocks of growing size as it needs them, so a snapshot that adds little
  // takes little space. The index is only read here.
  constexpr std::uint64_t kMinBlock = 1u << 20, kMaxBlock = 64u << 20;
  constexpr std::uint64_t kMinReserveStep = 256u << 10, kMaxReserveStep = 8u << 20;
  constexpr std::uint64_t kMaxRun = 256u << 10;
  std::atomic<std::uint64_t> stored{0};
  detail::parallel_for(todo.size(), total, [&](std::size_t b, std::size_t e) {
    struct Block {
      StoreImpl::Placement at;
      std::uint64_t length = 0, used = 0, reserved = 0;
      std::optional<detail::PackWriter> writer;
    } block;
    // Blocks start at an eighth of what the slice could need (at least 1 MiB)
    // and double: few blocks for big snapshots, small ones for small snapshots.
    std::uint64_t block_size = detail::round_up_page(std::clamp((slot[e] - slot[b]) / 8, kMinBlock, kMaxBlock));
    std::uint64_t step = kMinReserveStep, written_here = 0;
    std::unordered_map<detail::Hash128, std::size_t, detail::Hash128Hasher> mine;
    std::vector<std::uint32_t> changed;  // pages of the current patched chunk that changed
    struct {
      std::uint64_t dst = 0;
      const char* src = nullptr;
      std::uint64_t len = 0;
    } run;
    auto flush = [&] {
      if (run.len) block.writer->copy(run.dst, run.src, run.len);
      run.len = 0;
    };
    auto close_block = [&] {
      if (!block.writer) return;
      flush();
      // Space reserved but not used stays allocated: it is free space the next
      // snapshot fills without faulting its pages in again (gc punches it).
      block.writer->finish();  // on this thread: drains its own non-temporal stores
      block.writer.reset();
    };
    // Stores `len` bytes from `from`, whose page hashes are `hashes`, in free
    // pack space; k: position in todo.
    auto place = [&](std::size_t k, const char* from, std::uint64_t len, const std::uint64_t* hashes) -> detail::PageLoc {
      std::uint64_t need = detail::round_up_page(len);
      if (!block.writer || block.used + need > block.length) {
        close_block();
        std::uint64_t size = std::max(need, std::min(block_size, slot[e] - slot[k]));
        block_size = std::min(block_size * 2, kMaxBlock);
        auto placed = allocation.take(size);
        block.at = placed.first;
        block.length = size;
        block.used = block.reserved = 0;
        block.writer.emplace(std::move(placed.second));
      }
      if (block.used + need > block.reserved) {
        // Reserve in growing steps: few calls for big snapshots, little
        // over-reservation for small ones.
        std::uint64_t take = std::min(std::max(step, block.used + need - block.reserved), block.length - block.reserved);
        block.writer->reserve(block.reserved, take);
        block.reserved += take;
        step = std::min(step * 2, kMaxReserveStep);
      }
      if (run.len && run.src + run.len == from && run.dst + run.len == block.used && run.len < kMaxRun) {
        run.len += len;
      } else {
        flush();
        run = {block.used, from, len};
      }
      detail::PageLoc at{block.at.pack, block.at.offset + block.used};
      block.writer->set_hashes(block.used, hashes, detail::pages_in(len));
      block.used += need;
      written_here += need;
      return at;
    };
    try {
      for (std::size_t k = b; k < e; ++k) {
        const std::size_t i = todo[k];
        auto& c = m.chunks[i];
        std::uint64_t* hashes = m.page_hashes.data() + m.first_page[i];
        const std::uint32_t npages = m.pages_of(i);
        if (k + 1 < e && plan[todo[k + 1]] == Plan::patch) {
          // Written pages are scattered: start loading the next chunk's
          // while this one is hashed, instead of stalling on each in turn.
          const std::size_t next = todo[k + 1];
          for (std::uint32_t x = page_from[next]; x < page_from[next + 1]; ++x)
            for (std::uint64_t line = 0; line < 512; line += 64) __builtin_prefetch(src[next] + pages[x] * kPageSize + line);
        }
        if (plan[i] == Plan::patch) {
          // The base's stored bytes, with the written pages that changed
          // stored apart.
          const std::size_t bi = base_chunk[i];
          detail::ChunkView was = detail::view_of(*base, bi);
          c = *was.ref;
          std::copy_n(was.pages, npages, hashes);
          detail::Overlay* ov = patched.data() + ov_from[i];
          std::uint32_t n_ov = static_cast<std::uint32_t>(was.overlay_count);
          std::copy_n(was.overlays, n_ov, ov);
          changed.clear();
          for (std::uint32_t x = page_from[i]; x < page_from[i + 1]; ++x) {
            const std::uint32_t p = pages[x];
            const char* now = src[i] + p * kPageSize;
            const std::uint32_t len = was.page_length(p);
            const std::uint64_t h = detail::page_hash(now, len);
            if (h == was.pages[p]) {
              // Written but perhaps unchanged: compare with the stored page.
              detail::PageLoc at = was.location(p);
              const char* old = at.pack ? store.packs->mapped(at.pack, at.offset, len) : nullptr;
              if (at.pack ? old && std::memcmp(old, now, len) == 0 : detail::all_zero(now, len)) continue;
            }
            hashes[p] = h;
            changed.push_back(p);
          }
          c.hash = detail::tree_hash(hashes, npages);
          if (changed.empty()) {
            ov_count[i] = n_ov;
            for (std::uint32_t x = 0; x < n_ov; ++x) ov[x].chunk = i;
            continue;
          }
          // Back to content stored whole before (a trial undone by hand, say):
          // point at that copy, after comparing the bytes.
          if (const ChunkRef* known = store.find_chunk(c.hash, src[i], c.length)) {
            c.pack = known->pack;
            c.offset = known->offset;
            ov_count[i] = 0;
            continue;
          }
          for (std::uint32_t p : changed) {
            const char* now = src[i] + p * kPageSize;
            const std::uint32_t len = was.page_length(p);
            const std::uint64_t h = hashes[p];
            detail::Overlay o{i, p, 0, 0};
            if (!(h == detail::zero_page_hash(len) && detail::all_zero(now, len))) {
              detail::PageLoc at = place(k, now, len, &hashes[p]);
              o.pack = at.pack;
              o.offset = at.offset;
            }
            std::uint32_t pos = 0;
            while (pos < n_ov && ov[pos].page < p) ++pos;
            if (pos == n_ov || ov[pos].page != p) {
              std::copy_backward(ov + pos, ov + n_ov, ov + n_ov + 1);
              ++n_ov;
            }
            ov[pos] = o;
          }
          for (std::uint32_t x = 0; x < n_ov; ++x) ov[x].chunk = i;
          ov_count[i] = n_ov;
          continue;
        }
        detail::hash_pages(src[i], c.length, hashes);
        c.hash = detail::tree_hash(hashes, npages);
        if (detail::is_zero_tree(c.hash, c.length) && detail::all_zero(src[i], c.length)) {
          c.pack = 0;
          c.offset = 0;
          continue;
        }
        // Reuse a stored copy, or one written by this snapshot, only if it
        // holds exactly these bytes.
        const ChunkRef* known = store.find_chunk(c.hash, src[i], c.length);
        if (!known) {
          auto it = mine.find(c.hash);
          if (it != mine.end() && std::memcmp(src[it->second], src[i], c.length) == 0) known = &m.chunks[it->second];
        }
        if (known) {
          c.pack = known->pack;
          c.offset = known->offset;
          continue;
        }
        detail::PageLoc at = place(k, src[i], c.length, hashes);
        c.pack = at.pack;
        c.offset = at.offset;
        mine.emplace(c.hash, i);
      }
      close_block();
    } catch (...) {
      run.len = 0;
      if (block.writer) block.writer->finish();
      throw;
    }
    stored += written_here;
  });

  for (std::size_t i = 0; i < m.chunks.size(); ++i) {
    if (plan[i] == Plan::inherit) {
      for (std::uint32_t k = base->first_overlay[base_chunk[i]]; k < base->first_overlay[base_chunk[i] + 1]; ++k) {
        m.overlays.push_back(base->overlays[k]);
        m.overlays.back().chunk = i;
      }
    } else if (plan[i] == Plan::patch) {
      m.overlays.insert(m.overlays.end(), patched.begin() + static_cast<std::ptrdiff_t>(ov_from[i]),
                        patched.begin() + static_cast<std::ptrdiff_t>(ov_from[i] + ov_count[i]));
    }
  }
  m.index();
  m.stored_bytes = stored.load();
  m.chunks_read = todo.size();
  m.flags = tracked_any ? detail::kManifestTrackedWrites : 0;
  m.time_ns = detail::now_ns();
  std::exception_ptr after_commit;
  try {
    store.publish_manifest(m);  // the commit point
  } catch (const Error& e) {
    // Only syncing the directory may have failed after the rename: then the
    // snapshot exists, and its space must not be given back.
    if (!store.manifest_unchanged(m)) throw;
    after_commit = std::make_exception_ptr(Error(e.code(), "snapshot '" + ref + "' was taken, but " + e.what() +
                                                                 "; it may not survive a crash of the machine"));
  }
  allocation.commit();
  store.index_published(store.manifest_path(m.session, m.name), m);
  for (auto& [region, t] : state_->tracks) t.synced = true;
  // The notes describe the marks about to be cleared: gone first, so that no
  // moment (nor a failure to write the new ones) leaves a stale one.
  for (auto& [region, file] : state_->heap_files) state_->drop_note(*region);
  // Live memory now equals this snapshot: track writes relative to it.
  state_->rearm();
  state_->replace_base(std::move(m));
  state_->last_snapshot = std::chrono::steady_clock::now();
  state_->head = name;
  state_->external.clear();
  state_->publish_notes();
  if (after_commit) std::rethrow_exception(after_commit);
  return detail::info_from_manifest(*state_->base);
}

void Session::restore(const std::string& name) {
  using detail::kPageSize;
  StoreImpl& store = *state_->store.impl_;
  const std::string ref = StoreImpl::ref(state_->name, name);
  // Under the shared lock nobody can reuse the space of this snapshot's data
  // while it is read.
  std::lock_guard<std::mutex> guard(store.mu);
  StoreImpl::Lock lock(store, false);
  const Manifest* base = state_->base ? &*state_->base : nullptr;
  // Rolling back to the base (the usual case: one snapshot, many trials)
  // needs no reading and decoding of its manifest when it is unchanged.
  std::optional<Manifest> loaded;
  store.packs->refresh_mappings();  // before page hashes are read from the packs
  if (!base || base->name != name || !store.manifest_unchanged(*base)) loaded = store.load_manifest(state_->name, name);
  const Manifest& m = loaded ? *loaded : *base;
  const std::uint32_t pages_per_chunk = detail::pages_in(m.chunk_size);

  // What to copy: pages [p0, p1) of chunk `chunk` of the target. Every check
  // happens before the first byte of live memory changes.
  struct Job {
    std::size_t chunk;
    std::uint32_t p0, p1;
  };
  std::vector<Job> jobs;
  std::vector<char*> dst(m.chunks.size());
  std::vector<const ManifestRegion*> region_of(m.chunks.size());
  std::vector<detail::AddrRange> unprotect;  // tracked ranges about to be mostly overwritten
  for (auto& mr : m.regions) {
    Region* live = nullptr;
    for (auto& r : state_->regions)
      if (r->name() == mr.name) live = r.get();
    if (!live)
      throw Error(Errc::invalid_argument, "snapshot '" + ref + "' records region '" + mr.name + "' (" + std::to_string(mr.size) +
                                              " bytes) but this session has no such region; track() or alloc() it with that size, then restore");
    if (live->size() != mr.size)
      throw Error(Errc::invalid_argument, "region '" + mr.name + "' is " + std::to_string(live->size()) + " bytes now but " +
                                              std::to_string(mr.size) + " bytes in snapshot '" + ref +
                                              "'; resize it to match before restoring (nothing was changed)");
    for (std::uint64_t j = 0; j < mr.chunk_count; ++j) {
      dst[mr.first_chunk + j] = static_cast<char*>(live->data()) + j * m.chunk_size;
      region_of[mr.first_chunk + j] = &mr;
    }
    std::uint64_t copy_bytes = 0;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
    const ManifestRegion* br = nullptr;
    std::optional<WrittenPages> w;
    bool tracked = false;
    if (state_->changed_since_base(*live, ranges, &tracked)) {
      // Live memory is the base snapshot except the pages written since: copy
      // the pages in which the target differs from the base, and the written
      // pages.
      br = state_->base_region(*live);
      w.emplace(ranges, mr.size, m.chunk_size);
    }
    for (std::uint64_t j = 0; j < mr.chunk_count; ++j) {
      const std::size_t i = mr.first_chunk + j;
      const std::uint32_t n = detail::pages_in(m.chunks[i].length);  // (older formats have no page hashes)
      auto add = [&](std::uint32_t p0, std::uint32_t p1) {
        jobs.push_back({i, p0, p1});
        copy_bytes += std::min<std::uint64_t>(p1 * kPageSize, m.chunks[i].length) - p0 * kPageSize;
      };
      if (!br) {
        add(0, n);
        continue;
      }
      const ChunkRef &t = m.chunks[i], &b = base->chunks[br->first_chunk + j];
      const bool same_kind =
          m.paged == base->paged && t.length == b.length && base->trusted(br->first_chunk + j) && m.trusted(i);
      if (same_kind && t.hash == b.hash && !w->chunk[j]) continue;
      if (!same_kind || (!m.paged && !(t.hash == b.hash))) {
        add(0, n);
        continue;
      }
      // Page by page: differing page hashes, or written since the base.
      const std::uint64_t *th = m.paged ? m.hashes_of(i) : nullptr, *bh = m.paged ? base->hashes_of(br->first_chunk + j) : nullptr;
      const bool chunk_same = t.hash == b.hash;
      for (std::uint32_t p = 0; p < n;) {
        auto needed = [&](std::uint32_t q) { return w->page[j * pages_per_chunk + q] || (!chunk_same && th[q] != bh[q]); };
        if (!needed(p)) {
          ++p;
          continue;
        }
        std::uint32_t q = p + 1;
        while (q < n && needed(q)) ++q;
        add(p, q);
        p = q;
      }
    }
    // Writing most of a tracked region page by page would take one protection
    // fault per page: lift the protection first (it is restored afterwards).
    auto& t = state_->tracks[live];
    if (t.tracked.first != t.tracked.second && copy_bytes > mr.size / 8) unprotect.push_back(t.tracked);
  }

  // Check every byte about to be copied: page by page against the page
  // hashes, or (older formats) whole chunks.
  store.packs->refresh_mappings();
  std::uint64_t copy_bytes = 0, work = 0;
  std::vector<std::size_t> touched;
  for (auto& j : jobs) {
    copy_bytes += std::min<std::uint64_t>(j.p1 * kPageSize, m.chunks[j.chunk].length) - j.p0 * kPageSize;
    work += std::max<std::uint64_t>(kPageWork, (j.p1 - j.p0) * kPageSize);
    if (touched.empty() || touched.back() != j.chunk) touched.push_back(j.chunk);
  }
  auto damaged = [&](std::size_t chunk, std::uint64_t lo, std::uint64_t hi, const std::string& why) {
    auto* mr = region_of[chunk];
    std::uint64_t off = (chunk - mr->first_chunk) * m.chunk_size;
    return Error(Errc::corrupt, "snapshot '" + ref + "' is damaged: region '" + mr->name + "' bytes [" + std::to_string(off + lo) + ", " +
                                    std::to_string(off + hi) + ") " + why +
                                    "; live memory was not changed — restore another snapshot and run `dvr verify`");
  };
  try {
    for (std::size_t i : touched) detail::map_chunk(*store.packs, detail::view_of(m, i));
  } catch (const Error& e) {
    throw Error(e.code(), "cannot restore '" + ref + "': " + e.what() + " (live memory was not changed)");
  }
  for (std::size_t i : touched)
    if (!m.trusted(i)) throw damaged(i, 0, m.chunks[i].length, "do not match the checksum in its manifest");
  if (!m.paged) {
    std::string why;
    std::size_t bad = detail::first_damaged(*store.packs, m, touched, &why);
    if (bad != SIZE_MAX) throw damaged(touched[bad], 0, m.chunks[touched[bad]].length, "fail their checksum: " + why);
  } else {
    std::atomic<std::size_t> bad{SIZE_MAX};
    std::atomic<std::uint32_t> bad_page{0};
    detail::parallel_for(jobs.size(), work, [&](std::size_t b, std::size_t e) {
      for (std::size_t k = b; k < e && bad.load() == SIZE_MAX; ++k) {
        if (k + 1 < e) {
          // Scattered pages: start loading the next job's while this one is hashed.
          detail::PageLoc next = detail::view_of(m, jobs[k + 1].chunk).location(jobs[k + 1].p0);
          if (const char* ahead = next.pack ? store.packs->mapped(next.pack, next.offset, kPageSize) : nullptr)
            for (std::uint64_t line = 0; line < 512; line += 64) __builtin_prefetch(ahead + line);
        }
        detail::ChunkView v = detail::view_of(m, jobs[k].chunk);
        for (std::uint32_t p = jobs[k].p0; p < jobs[k].p1; ++p) {
          detail::PageLoc at = v.location(p);
          std::uint32_t len = v.page_length(p);
          const char* bytes = at.pack ? store.packs->mapped(at.pack, at.offset, len) : nullptr;
          std::uint64_t h = bytes ? detail::page_hash(bytes, len) : detail::zero_page_hash(len);
          if ((at.pack && !bytes) || h != v.pages[p]) {
            std::size_t none = SIZE_MAX;
            if (bad.compare_exchange_strong(none, k)) bad_page = p;
            return;
          }
        }
      }
    });
    if (bad.load() != SIZE_MAX) {
      const Job& j = jobs[bad.load()];
      std::uint64_t lo = std::uint64_t{bad_page.load()} * kPageSize;
      detail::PageLoc at = detail::view_of(m, j.chunk).location(bad_page.load());
      throw damaged(j.chunk, lo, std::min<std::uint64_t>(lo + kPageSize, m.chunks[j.chunk].length),
                    "fail their checksum (" + store.packs->path_of(at.pack) + " offset " + std::to_string(at.offset) + ")");
    }
  }

  // From here on live memory changes; the tracker is re-armed at the end.
  for (auto& r : unprotect) state_->tracker->unprotect(r);
  detail::parallel_for(jobs.size(), work, [&](std::size_t b, std::size_t e) {
    for (std::size_t k = b; k < e; ++k) {
      const Job& j = jobs[k];
      detail::ChunkView v = detail::view_of(m, j.chunk);
      const std::uint64_t end = std::min<std::uint64_t>(j.p1 * kPageSize, v.ref->length);
      if (!v.overlay_count) {
        // Pages stored together: one copy.
        char* to = dst[j.chunk] + j.p0 * kPageSize;
        if (v.ref->is_zero()) detail::zero_nt(to, end - j.p0 * kPageSize);
        else detail::copy_nt(to, store.packs->mapped(v.ref->pack, v.ref->offset + j.p0 * kPageSize, end - j.p0 * kPageSize), end - j.p0 * kPageSize);
        continue;
      }
      for (std::uint32_t p = j.p0; p < j.p1; ++p) {
        detail::PageLoc at = v.location(p);
        std::uint32_t len = v.page_length(p);
        char* to = dst[j.chunk] + p * kPageSize;
        if (at.pack) detail::copy_nt(to, store.packs->mapped(at.pack, at.offset, len), len);
        else detail::zero_nt(to, len);
      }
    }
  });
  for (auto& [region, file] : state_->heap_files) state_->drop_note(*region);  // before the marks are cleared
  state_->rearm();
  for (auto& mr : m.regions)
    for (auto& r : state_->regions)
      if (r->name() == mr.name) state_->tracks[r.get()].synced = true;
  if (loaded) state_->replace_base(std::move(*loaded));
  state_->head = name;
  state_->external.clear();
  state_->publish_notes();
}

}  // namespace dvr
