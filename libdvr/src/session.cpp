#include <sys/mman.h>

#include <cstdlib>

#include <algorithm>
#include <atomic>
#include <optional>
#include <cstring>
#include <unordered_map>

#include "dvr/session.hpp"
#include "dirty.hpp"
#include "memops.hpp"
#include "store_impl.hpp"

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
  std::string head;
  // The manifest of `head` while live memory equals it except for pages the
  // tracker reports as written; empty when that is not known.
  std::optional<Manifest> base;

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
  // After a successful snapshot or restore: protect the written pages again.
  void rearm();
  const ManifestRegion* base_region(const Region& r) const;
};

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
  auto it = tracks.find(&r);
  if (!base_region(r) || it == tracks.end() || it->second.tracked.first == it->second.tracked.second) return false;
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

void Session::State::rearm() {
  if (!tracker) return;
  // Protecting a gigabyte of written pages again takes ~10 ms: split the work
  // into page-aligned pieces and use every core.
  constexpr std::uintptr_t kPiece = 64u << 20;
  struct Piece {
    RegionTrack* track;
    const Region* region;
    detail::AddrRange range;
  };
  std::vector<Piece> pieces;
  std::uint64_t bytes = 0;
  for (auto& [region, t] : tracks) {
    if (t.tracked.first == t.tracked.second) continue;
    for (std::uintptr_t b = t.tracked.first; b < t.tracked.second; b += kPiece)
      pieces.push_back({&t, region, {b, std::min(b + kPiece, t.tracked.second)}});
    bytes += t.tracked.second - t.tracked.first;
  }
  std::vector<char> lost(pieces.size(), 0);
  detail::parallel_for(pieces.size(), bytes / 64, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) lost[i] = !tracker->reprotect(pieces[i].range);
  });
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    RegionTrack& t = *pieces[i].track;
    if (!lost[i] || t.tracked.first == t.tracked.second) continue;
    tracker->remove(t.tracked);
    t.tracked = {0, 0};
    t.why = "region '" + pieces[i].region->name() + "' was remapped; write tracking was lost";
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

Session::~Session() = default;
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

void Session::untrack(const std::string& name) {
  auto& rs = state_->regions;
  auto it = std::find_if(rs.begin(), rs.end(), [&](auto& r) { return r->name() == name; });
  if (it == rs.end()) throw Error(Errc::not_found, "session '" + state_->name + "' has no region '" + name + "'");
  state_->stop_tracking(**it);
  rs.erase(it);
}

SnapshotInfo Session::snapshot(const std::string& name, const SnapshotOptions& options) {
  detail::check_name("snapshot", name);
  StoreImpl& store = *state_->store.impl_;
  const std::string ref = StoreImpl::ref(state_->name, name);
  if (state_->regions.empty())
    throw Error(Errc::invalid_argument, "session '" + state_->name + "' has no regions to snapshot as '" + name +
                                            "'; track() or alloc() memory first");

  Manifest m;
  m.session = state_->name;
  m.name = name;
  m.parent = state_->head;
  m.label = options.label;
  m.chunk_size = store.chunk_size;
  std::vector<const char*> src;
  // Chunks with no page written since the base snapshot are taken from its
  // manifest; only the others (`todo`) are read.
  std::vector<char> from_base;
  bool tracked_any = false;
  for (auto& r : state_->regions) {
    std::uint64_t count = (r->size() + m.chunk_size - 1) / m.chunk_size;
    const std::size_t first = m.chunks.size();
    m.regions.push_back({r->name(), r->size(), r->sdk_owned(), first, count});
    auto base = static_cast<const char*>(r->data());
    for (std::uint64_t i = 0; i < count; ++i) {
      ChunkRef c;
      c.length = static_cast<std::uint32_t>(std::min<std::uint64_t>(m.chunk_size, r->size() - i * m.chunk_size));
      m.chunks.push_back(c);
      src.push_back(base + i * m.chunk_size);
      from_base.push_back(0);
    }
    std::vector<std::pair<std::uint64_t, std::uint64_t>> written;
    if (state_->written_since_base(*r, written)) {
      tracked_any = true;
      const ManifestRegion* br = state_->base_region(*r);
      for (std::uint64_t i = 0; i < count; ++i) {
        m.chunks[first + i] = state_->base->chunks[br->first_chunk + i];
        from_base[first + i] = 1;
      }
      for (auto& [wb, we] : written)
        for (std::uint64_t i = wb / m.chunk_size; i * m.chunk_size < we && i < count; ++i) from_base[first + i] = 0;
    }
  }

  for (auto& c : m.chunks) detail::is_zero_chunk(c.hash, c.length);  // warm the zero-hash cache

  std::lock_guard<std::mutex> guard(store.mu);
  StoreImpl::Lock lock(store, true);
  if (!options.replace && detail::path_exists(store.manifest_path(m.session, name)))
    throw Error(Errc::already_exists, "snapshot '" + ref + "' exists already; pick another name, pass replace, or `dvr rm " + ref + "` first");
  store.refresh_index();
  if (name == m.parent) {
    // Replacing the head: the new version takes the old one's place in the
    // timeline instead of becoming its own parent.
    try {
      m.parent = store.load_manifest(m.session, name).parent;
    } catch (const Error&) {
      m.parent.clear();
    }
  }
  store.packs->map_all();

  // A chunk taken from the base must still be stored: the base snapshot may
  // have been removed and its space reused since. Such chunks are read again.
  std::vector<std::size_t> todo;
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < m.chunks.size(); ++i) {
    auto& c = m.chunks[i];
    if (from_base[i] && !c.is_zero()) {
      const ChunkRef* live = store.find_chunk(c.hash, c.length);
      if (live) {
        c.pack = live->pack;
        c.offset = live->offset;
      } else {
        from_base[i] = 0;
      }
    }
    if (!from_base[i]) {
      todo.push_back(i);
      total += m.chunks[i].length;
    }
  }
  // Bytes todo[k] onward would need if every chunk were new: bounds the size
  // of the pack blocks a thread asks for near the end of its slice.
  std::vector<std::uint64_t> slot(todo.size() + 1, 0);
  for (std::size_t k = 0; k < todo.size(); ++k) slot[k + 1] = slot[k] + detail::round_up_page(m.chunks[todo[k]].length);

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
    std::uint64_t block_size = std::clamp((slot[e] - slot[b]) / 8, kMinBlock, kMaxBlock);
    std::uint64_t step = kMinReserveStep, written = 0;
    std::unordered_map<detail::Hash128, std::size_t, detail::Hash128Hasher> mine;
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
      block.writer->release(block.used, block.reserved - block.used);  // reserved but not needed
      block.writer->finish();  // on this thread: drains its own non-temporal stores
      block.writer.reset();
    };
    try {
      for (std::size_t k = b; k < e; ++k) {
        const std::size_t i = todo[k];
        auto& c = m.chunks[i];
        c.hash = detail::hash128(src[i], c.length);
        if (detail::is_zero_chunk(c.hash, c.length) && detail::all_zero(src[i], c.length)) {
          c.pack = 0;
          continue;
        }
        // Reuse a stored copy only if it holds exactly these bytes: a hash match
        // alone could be a collision, and a damaged copy must not make a
        // snapshot of intact memory unrestorable.
        const ChunkRef* known = store.find_chunk(c.hash, c.length);
        if (known) {
          const char* stored_copy = store.packs->mapped(known->pack, known->offset, c.length);
          if (!stored_copy || std::memcmp(stored_copy, src[i], c.length) != 0) known = nullptr;
        }
        if (!known) {
          auto it = mine.find(c.hash);
          if (it != mine.end() && std::memcmp(src[it->second], src[i], c.length) == 0) known = &m.chunks[it->second];
        }
        if (known) {
          c.pack = known->pack;
          c.offset = known->offset;
          continue;
        }
        std::uint64_t need = detail::round_up_page(c.length);
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
        if (run.len && run.src + run.len == src[i] && run.dst + run.len == block.used && run.len < kMaxRun) {
          run.len += c.length;
        } else {
          flush();
          run = {block.used, src[i], c.length};
        }
        c.pack = block.at.pack;
        c.offset = block.at.offset + block.used;
        mine.emplace(c.hash, i);
        block.used += need;
        written += need;
      }
      close_block();
    } catch (...) {
      run.len = 0;
      if (block.writer) block.writer->finish();
      throw;
    }
    stored += written;
  });

  std::uint64_t extent = stored.load();
  m.stored_bytes = extent;
  m.chunks_read = todo.size();
  m.flags = tracked_any ? detail::kManifestTrackedWrites : 0;
  m.time_ns = detail::now_ns();
  store.publish_manifest(m);  // the commit point
  allocation.commit();
  store.index_published(store.manifest_path(m.session, m.name), m);
  // Live memory now equals this snapshot: track writes relative to it.
  state_->rearm();
  state_->base = m;
  state_->last_snapshot = std::chrono::steady_clock::now();
  state_->head = name;
  return detail::info_from_manifest(m);
}

void Session::restore(const std::string& name) {
  StoreImpl& store = *state_->store.impl_;
  const std::string ref = StoreImpl::ref(state_->name, name);
  // Under the shared lock nobody can reuse the space of this snapshot's data
  // while it is read.
  std::lock_guard<std::mutex> guard(store.mu);
  StoreImpl::Lock lock(store, false);
  Manifest m = store.load_manifest(state_->name, name);

  // What to copy: [lo, hi) of chunk `chunk` of the target. Every check happens
  // before the first byte of live memory changes.
  struct Job {
    std::size_t chunk;
    std::uint32_t lo, hi;
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
    for (std::uint64_t i = 0; i < mr.chunk_count; ++i) {
      dst[mr.first_chunk + i] = static_cast<char*>(live->data()) + i * m.chunk_size;
      region_of[mr.first_chunk + i] = &mr;
    }
    std::uint64_t full_bytes = 0;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> written;
    if (state_->written_since_base(*live, written)) {
      // Live memory is the base snapshot except the pages written since: copy
      // the chunks in which the target differs from the base, and the written
      // pages of the others.
      const ManifestRegion* br = state_->base_region(*live);
      std::vector<char> whole(mr.chunk_count, 0);
      for (std::uint64_t i = 0; i < mr.chunk_count; ++i) {
        auto& t = m.chunks[mr.first_chunk + i];
        auto& b = state_->base->chunks[br->first_chunk + i];
        if (!(t.hash == b.hash) || t.length != b.length) {
          whole[i] = 1;
          jobs.push_back({mr.first_chunk + i, 0, t.length});
          full_bytes += t.length;
        }
      }
      for (auto& [wb, we] : written)
        for (std::uint64_t i = wb / m.chunk_size; i * m.chunk_size < we && i < mr.chunk_count; ++i) {
          if (whole[i]) continue;
          std::uint64_t cb = i * m.chunk_size;
          auto lo = static_cast<std::uint32_t>(std::max(wb, cb) - cb);
          auto hi = static_cast<std::uint32_t>(std::min<std::uint64_t>(we, cb + m.chunks[mr.first_chunk + i].length) - cb);
          if (lo < hi) jobs.push_back({mr.first_chunk + i, lo, hi});
        }
    } else {
      for (std::uint64_t i = 0; i < mr.chunk_count; ++i) jobs.push_back({mr.first_chunk + i, 0, m.chunks[mr.first_chunk + i].length});
      full_bytes = mr.size;
    }
    // Writing most of a tracked region page by page would take one protection
    // fault per page: lift the protection first (it is restored afterwards).
    auto& t = state_->tracks[live];
    if (t.tracked.first != t.tracked.second && full_bytes > mr.size / 8) unprotect.push_back(t.tracked);
  }

  store.packs->refresh_mappings();
  std::vector<const char*> src(m.chunks.size(), nullptr);
  std::vector<std::size_t> sources;  // distinct non-zero chunks some job reads
  std::uint64_t verify_bytes = 0, copy_bytes = 0;
  for (auto& j : jobs) {
    auto& c = m.chunks[j.chunk];
    copy_bytes += j.hi - j.lo;
    if (c.is_zero() || src[j.chunk]) continue;
    try {
      src[j.chunk] = store.packs->read(c.pack, c.offset, c.length);
    } catch (const Error& e) {
      throw Error(e.code(), "cannot restore '" + ref + "': " + e.what() + " (live memory was not changed)");
    }
    sources.push_back(j.chunk);
    verify_bytes += c.length;
  }

  std::vector<const char*> checked_data;
  std::vector<const ChunkRef*> checked_refs;
  for (std::size_t i : sources) {
    checked_data.push_back(src[i]);
    checked_refs.push_back(&m.chunks[i]);
  }
  if (std::size_t k = detail::first_damaged(checked_data, checked_refs, verify_bytes); k != SIZE_MAX) {
    std::size_t bad = sources[k];
    auto& c = m.chunks[bad];
    auto* mr = region_of[bad];
    std::uint64_t off = (bad - mr->first_chunk) * m.chunk_size;
    throw Error(Errc::corrupt, "snapshot '" + ref + "' is damaged: region '" + mr->name + "' bytes [" + std::to_string(off) + ", " +
                                   std::to_string(off + c.length) + ") fail their checksum (" + store.packs->path_of(c.pack) +
                                   " offset " + std::to_string(c.offset) +
                                   "); live memory was not changed — restore another snapshot and run `dvr verify`");
  }

  // From here on live memory changes; the tracker is re-armed at the end.
  for (auto& r : unprotect) state_->tracker->unprotect(r);
  detail::parallel_for(jobs.size(), copy_bytes, [&](std::size_t b, std::size_t e) {
    for (std::size_t k = b; k < e; ++k) {
      const Job& j = jobs[k];
      char* to = dst[j.chunk] + j.lo;
      std::size_t len = j.hi - j.lo;
      if (src[j.chunk])
        detail::copy_nt(to, src[j.chunk] + j.lo, len);
      else
        detail::zero_nt(to, len);
    }
  });
  state_->rearm();
  state_->base = std::move(m);
  state_->head = name;
}

}  // namespace dvr
