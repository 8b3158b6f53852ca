#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <cstring>
#include <unordered_map>

#include "dvr/session.hpp"
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

struct Session::State {
  Store store;
  std::string name;
  std::vector<std::unique_ptr<Region>> regions;
  std::string head;
};

Session::Session(Store store, std::string name) : state_(std::make_unique<State>(State{std::move(store), std::move(name), {}, {}})) {
  detail::check_name("session", state_->name);
}

Session::~Session() = default;
Session::Session(Session&&) noexcept = default;
Session& Session::operator=(Session&&) noexcept = default;

const std::string& Session::name() const { return state_->name; }
Store& Session::store() { return state_->store; }
const std::string& Session::head() const { return state_->head; }
std::vector<SnapshotInfo> Session::list() const { return state_->store.list(state_->name); }

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
  return *state_->regions.back();
}

Region& Session::alloc(const std::string& name, std::size_t size) {
  check_new_region(state_->regions, state_->name, name, nullptr, size);
  void* p = ::mmap(nullptr, detail::round_up_page(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw Error(Errc::no_space, "cannot allocate " + std::to_string(size) + " bytes for region '" + name + "': out of memory");
  state_->regions.push_back(std::make_unique<Region>(name, p, size, true));
  return *state_->regions.back();
}

void Session::untrack(const std::string& name) {
  auto& rs = state_->regions;
  auto it = std::find_if(rs.begin(), rs.end(), [&](auto& r) { return r->name() == name; });
  if (it == rs.end()) throw Error(Errc::not_found, "session '" + state_->name + "' has no region '" + name + "'");
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
  std::uint64_t total = 0;
  for (auto& r : state_->regions) {
    std::uint64_t count = (r->size() + m.chunk_size - 1) / m.chunk_size;
    m.regions.push_back({r->name(), r->size(), r->sdk_owned(), m.chunks.size(), count});
    auto base = static_cast<const char*>(r->data());
    for (std::uint64_t i = 0; i < count; ++i) {
      ChunkRef c;
      c.length = static_cast<std::uint32_t>(std::min<std::uint64_t>(m.chunk_size, r->size() - i * m.chunk_size));
      m.chunks.push_back(c);
      src.push_back(base + i * m.chunk_size);
    }
    total += r->size();
  }

  // Bytes chunk i onward would need if every chunk were new: bounds the size
  // of the pack blocks a thread asks for near the end of its slice.
  std::vector<std::uint64_t> slot(m.chunks.size() + 1, 0);
  for (std::size_t i = 0; i < m.chunks.size(); ++i) slot[i + 1] = slot[i] + detail::round_up_page(m.chunks[i].length);
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
  StoreImpl::AllocationScope allocation(store);

  // One pass per chunk: hash it, and if the store lacks it, copy it into a
  // block of free pack space while it is still in cache. Each thread takes
  // blocks of growing size as it needs them, so a snapshot that adds little
  // takes little space. The index is only read here.
  constexpr std::uint64_t kMinBlock = 1u << 20, kMaxBlock = 64u << 20;
  constexpr std::uint64_t kMinReserveStep = 256u << 10, kMaxReserveStep = 8u << 20;
  constexpr std::uint64_t kMaxRun = 256u << 10;
  std::atomic<std::uint64_t> stored{0};
  detail::parallel_for(m.chunks.size(), total, [&](std::size_t b, std::size_t e) {
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
      for (std::size_t i = b; i < e; ++i) {
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
          std::uint64_t size = std::max(need, std::min(block_size, slot[e] - slot[i]));
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
  m.time_ns = detail::now_ns();
  store.publish_manifest(m);  // the commit point
  allocation.commit();
  store.index_published(store.manifest_path(m.session, m.name), m);
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

  // Every check happens before the first byte of live memory changes.
  std::vector<char*> dst(m.chunks.size());
  std::vector<const ManifestRegion*> region_of(m.chunks.size());
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
  }

  store.packs->refresh_mappings();
  std::vector<const char*> src(m.chunks.size(), nullptr);
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < m.chunks.size(); ++i) {
    auto& c = m.chunks[i];
    total += c.length;
    if (c.is_zero()) continue;
    try {
      src[i] = store.packs->read(c.pack, c.offset, c.length);
    } catch (const Error& e) {
      throw Error(e.code(), "cannot restore '" + ref + "': " + e.what() + " (live memory was not changed)");
    }
  }

  std::atomic<std::size_t> first_bad{SIZE_MAX};
  detail::parallel_for(m.chunks.size(), total, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) {
      if (!src[i]) continue;
      if (!(detail::hash128(src[i], m.chunks[i].length) == m.chunks[i].hash)) {
        std::size_t cur = first_bad.load();
        while (i < cur && !first_bad.compare_exchange_weak(cur, i)) {
        }
        return;
      }
    }
  });
  if (std::size_t bad = first_bad.load(); bad != SIZE_MAX) {
    auto& c = m.chunks[bad];
    auto* mr = region_of[bad];
    std::uint64_t off = (bad - mr->first_chunk) * m.chunk_size;
    throw Error(Errc::corrupt, "snapshot '" + ref + "' is damaged: region '" + mr->name + "' bytes [" + std::to_string(off) + ", " +
                                   std::to_string(off + c.length) + ") fail their checksum (" + store.packs->path_of(c.pack) +
                                   " offset " + std::to_string(c.offset) +
                                   "); live memory was not changed — restore another snapshot and run `dvr verify`");
  }

  detail::parallel_for(m.chunks.size(), total, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) {
      if (src[i])
        detail::copy_nt(dst[i], src[i], m.chunks[i].length);
      else
        detail::zero_nt(dst[i], m.chunks[i].length);
    }
  });
  state_->head = name;
}

}  // namespace dvr
