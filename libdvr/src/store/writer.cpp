#include "store/writer.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <cstring>
#include <exception>

#include "base/memops.hpp"
#include "base/progress.hpp"
#include "base/os.hpp"
#include "base/env.hpp"
#include "base/sigbus.hpp"
#include "format/chunks.hpp"

namespace dvr::detail {

namespace {

// Blocks of pack space a lane takes: from an eighth of what it could need (at
// least 1 MiB), doubling up to 64 MiB. Reservations on the file system grow
// the same way, from 256 KiB to 8 MiB. Adjacent copies are merged up to
// 256 KiB.
constexpr std::uint64_t kMinBlock = 1u << 20, kMaxBlock = 64u << 20;
constexpr std::uint64_t kMinReserveStep = 256u << 10, kMaxReserveStep = 8u << 20;
constexpr std::uint64_t kMaxRun = 256u << 10;

}  // namespace

bool store_pages_apart(const Manifest& base, std::size_t base_chunk, const std::uint32_t* pages, std::size_t count, std::uint32_t chunk_pages) {
  std::size_t apart = base.first_overlay[base_chunk + 1] - base.first_overlay[base_chunk];
  for (std::size_t x = 0; x < count; ++x) {
    bool already = false;
    for (std::uint32_t k = base.first_overlay[base_chunk]; k < base.first_overlay[base_chunk + 1] && !already; ++k)
      already = base.overlays[k].page == pages[x];
    apart += already ? 0 : 1;
  }
  return apart * 4 <= chunk_pages;
}

bool overlaps_any(const ByteRanges& ranges, std::uint64_t lo, std::uint64_t hi) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), std::make_pair(lo, ~std::uint64_t(0)));
  if (it != ranges.begin() && std::prev(it)->second > lo) return true;
  return it != ranges.end() && it->first < hi;
}

bool inside(const ByteRanges& ranges, std::uint64_t lo, std::uint64_t hi) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), std::make_pair(lo, ~std::uint64_t(0)));
  return it != ranges.begin() && std::prev(it)->first <= lo && hi <= std::prev(it)->second;
}

ByteRanges pages_differing(unsigned threads, const Manifest& base, const ManifestRegion& region, const char* data, std::uint64_t size, const ByteRanges& zero,
                           bool racy) {
  // The region's pages are consecutive in the base's page hash table.
  const std::uint64_t* expect = base.page_hashes.data() + base.first_page[region.first_chunk];
  const std::size_t pages = pages_in(size);
  std::vector<char> differs(pages, 0), known_zero(pages, 0);
  for (auto& [lo, hi] : zero)
    for (std::uint64_t p = (lo + kPageSize - 1) / kPageSize; p < pages && (p + 1) * kPageSize <= hi; ++p)
      known_zero[p] = 1;
  parallel_for(threads, pages, size, [&](std::size_t b, std::size_t e) {
    std::optional<RacyReads> ignore;
    if (racy) ignore.emplace();
    for (std::size_t p = b; p < e; ++p) {
      std::size_t len = std::min<std::uint64_t>(kPageSize, size - p * kPageSize);
      differs[p] = (known_zero[p] ? zero_page_hash(len) : page_hash(data + p * kPageSize, len)) != expect[p];
    }
  });
  ByteRanges out;
  for (std::size_t p = 0; p < pages; ++p) {
    if (!differs[p]) continue;
    std::uint64_t lo = p * kPageSize, hi = std::min<std::uint64_t>(lo + kPageSize, size);
    if (!out.empty() && out.back().second == lo)
      out.back().second = hi;
    else
      out.emplace_back(lo, hi);
  }
  return out;
}

// ---- WriteBatch ---------------------------------------------------------------

WriteBatch::WriteBatch(StoreImpl& store) : store_(store), guard_(store.mu), lock_(store, true, StoreImpl::Lock::Kind::writers), space_(store) {
  store_.packs->refresh_mappings();
  store_.refresh_index();
  store_.release_retired();
  store_.packs->map_all();
}

WriteBatch::~WriteBatch() = default;

std::vector<SnapshotInfo> WriteBatch::publish(const std::vector<SnapshotWriter*>& writers, std::exception_ptr* after_commit_out) {
  for (SnapshotWriter* w : writers)
    w->assemble();
  // The data, durable before any manifest names it (on disk, the writers only
  // started its writeback).
  store_.packs->persist();
  std::vector<const Manifest*> done;
  std::exception_ptr after_commit;
  // The commit order: under the writers' lock, after every manifest published
  // so far (refresh_index() read them when the batch began).
  std::uint64_t seq = store_.next_seq();
  for (SnapshotWriter* w : writers) {
    Manifest& m = w->m_;
    const std::string ref = StoreImpl::ref(m.session, m.name);
    m.seq = seq++;
    try {
      store_.publish_manifest(m);  // the commit point
      done.push_back(&m);
    } catch (const Error& e) {
      // Only syncing the directory may have failed after the rename: then the
      // snapshot exists, and its space must not be given back.
      if (store_.manifest_unchanged(m)) {
        done.push_back(&m);
        if (!after_commit)
          after_commit = std::make_exception_ptr(
              Error(e.code(), "snapshot '" + ref + "' was taken, but " + e.what() + "; it may not survive a crash of the machine"));
        continue;
      }
      // All or nothing: take back the ones published before this one, once
      // no reader uses them (their space is given back when the batch ends).
      StoreImpl::Lock readers_gone(store_, true);
      for (auto it = done.rbegin(); it != done.rend(); ++it) {
        env().unlink(store_.manifest_path((*it)->session, (*it)->name).c_str());
        try {
          store_.count_change(true);  // never indexed here: own
          fsync_dir(store_.session_dir((*it)->session));
        } catch (const Error&) {
        }
      }
      throw;
    }
  }
  space_.commit();
  std::vector<SnapshotInfo> out;
  for (const Manifest* m : done) {
    store_.index_published(store_.manifest_path(m->session, m->name), *m);
    out.push_back(info_from_manifest(*m));
  }
  if (after_commit) {
    if (!after_commit_out) std::rethrow_exception(after_commit);
    *after_commit_out = after_commit;
  }
  return out;
}

// ---- SnapshotWriter -----------------------------------------------------------

void check_new_snapshot(StoreImpl& store, const std::string& session, const std::string& name, bool replace) {
  check_name("session", session);
  check_name("snapshot", name);
  const std::string ref = StoreImpl::ref(session, name);
  if (!replace && path_exists(store.manifest_path(session, name)))
    throw Error(Errc::already_exists, "snapshot '" + ref + "' exists already; pick another name, pass replace, or `" + dvr_for(store.path) + " rm " + shell_word(ref) + "` first");
}

SnapshotWriter::SnapshotWriter(WriteBatch& batch, const std::string& session, const std::string& name, const WriterOptions& options, Manifest* reuse)
    : batch_(batch), own_buffers_(options.own_buffers) {
  StoreImpl& store = batch_.store();
  check_new_snapshot(store, session, name, options.replace);
  if (reuse) m_ = std::move(*reuse);
  m_.regions.clear();
  m_.chunks.clear();
  m_.page_hashes.clear();
  m_.overlays.clear();
  m_.untrusted.clear();
  m_.paged = true;
  m_.session = session;
  m_.name = name;
  m_.parent = options.parent;
  m_.label = options.label;
  m_.origin_time_ns = options.origin_time_ns;
  m_.seq = 0;
  m_.chunk_size = store.chunk_size;
  m_.flags = 0;
  m_.chunks_read = 0;
  m_.checksum = 0;
  if (name == m_.parent) {
    // Replacing the head: the new version takes the old one's place in the
    // timeline instead of becoming its own parent.
    try {
      m_.parent = store.load_manifest(session, name, nullptr, false).parent;
    } catch (const Error&) {
      m_.parent.clear();
    }
  }
}

void SnapshotWriter::add_region(const std::string& name, std::uint64_t size, bool sdk_owned) {
  const std::uint64_t count = (size + m_.chunk_size - 1) / m_.chunk_size;
  const std::size_t first = m_.chunks.size();
  m_.regions.push_back({name, size, sdk_owned, first, count});
  for (std::uint64_t i = 0; i < count; ++i) {
    ChunkRef c;
    c.length = static_cast<std::uint32_t>(std::min<std::uint64_t>(m_.chunk_size, size - i * m_.chunk_size));
    m_.chunks.push_back(c);
  }
  if (!sealed_) return;
  // Appended to a sealed table (a producer that learns its regions as the
  // data comes): the chunk tables grow; nothing of the chunks before moves.
  const std::size_t n = m_.chunks.size();
  m_.first_page.resize(n + 1);
  m_.first_overlay.resize(n + 1, 0);
  for (std::size_t i = first; i < n; ++i)
    m_.first_page[i + 1] = m_.first_page[i] + pages_in(m_.chunks[i].length);
  m_.page_hashes.resize(m_.first_page.back());
  from_.resize(n, From::none);
  base_chunk_.resize(n, 0);
  ov_from_.resize(n, 0);
  ov_count_.resize(n, 0);
}

void SnapshotWriter::seal() {
  sealed_ = true;
  m_.index();
  // Every chunk's page hashes are written when the chunk is given: new
  // memory is left untouched until then (PageHashes).
  m_.page_hashes.clear();
  m_.page_hashes.resize(m_.first_page.back());
  const std::size_t n = m_.chunks.size();
  from_.assign(n, From::none);
  base_chunk_.assign(n, 0);
  ov_from_.assign(n, 0);
  ov_count_.assign(n, 0);
  patched_.clear();
}

bool SnapshotWriter::use_base(const Manifest* base) {
  base_ = nullptr;
  if (base && base->paged && base->chunk_size == m_.chunk_size && base->hydrated() &&
      batch_.store().manifest_indexed(base->session, base->name, base->checksum))
    base_ = base;
  return base_ != nullptr;
}

void SnapshotWriter::inherit(std::size_t chunk, std::size_t base_chunk) {
  m_.chunks[chunk] = base_->chunks[base_chunk];
  std::copy_n(base_->hashes_of(base_chunk), m_.pages_of(chunk), m_.page_hashes.begin() + static_cast<std::ptrdiff_t>(m_.first_page[chunk]));
  from_[chunk] = From::inherit;
  base_chunk_[chunk] = base_chunk;
}

void SnapshotWriter::zero(std::size_t chunk) {
  ChunkRef& c = m_.chunks[chunk];
  std::uint64_t* hashes = m_.page_hashes.data() + m_.first_page[chunk];
  for (std::uint32_t p = 0; p < m_.pages_of(chunk); ++p)
    hashes[p] = zero_page_hash(std::min<std::uint64_t>(kPageSize, c.length - std::uint64_t{p} * kPageSize));
  c.hash = tree_hash(hashes, m_.pages_of(chunk));
  c.pack = 0;
  c.offset = 0;
  from_[chunk] = From::zero;
}

void SnapshotWriter::unchanged(std::size_t chunk, const ChunkRef& ref) {
  m_.chunks[chunk] = ref;
  from_[chunk] = From::unchanged;
  without_hashes_ = true;
}

void SnapshotWriter::in_place(std::size_t chunk, std::uint32_t pack, std::uint64_t offset, const std::uint64_t* page_hashes) {
  ChunkRef& c = m_.chunks[chunk];
  const std::uint32_t pages = m_.pages_of(chunk);
  std::copy_n(page_hashes, pages, m_.page_hashes.begin() + static_cast<std::ptrdiff_t>(m_.first_page[chunk]));
  c.hash = tree_hash(page_hashes, pages);
  c.pack = pack;
  c.offset = offset;
  from_[chunk] = From::whole;
  stored_ += c.length;
  if (offset % kPageSize == 0) batch_.store().packs->add_hashes(pack, offset / kPageSize, std::vector<std::uint64_t>(page_hashes, page_hashes + pages));
}

void SnapshotWriter::plan_patch(std::size_t chunk, std::size_t base_chunk, std::uint32_t changed) {
  from_[chunk] = From::patch;
  base_chunk_[chunk] = base_chunk;
  ov_from_[chunk] = patched_.size();
  // Room for the base's overlays and one per changed page.
  patched_.resize(patched_.size() + (base_->first_overlay[base_chunk + 1] - base_->first_overlay[base_chunk]) + changed);
}

void SnapshotWriter::plan_sparse(std::size_t chunk, std::uint32_t present) {
  from_[chunk] = From::patch;  // overlays of its own, on the zero chunk
  ov_from_[chunk] = patched_.size();
  patched_.resize(patched_.size() + present);
}

void SnapshotWriter::set_provenance(bool tracked_writes, std::uint64_t chunks_read) {
  m_.flags = tracked_writes ? kManifestTrackedWrites : 0;
  m_.chunks_read = chunks_read;
}

void SnapshotWriter::assemble() {
  m_.overlays.clear();
  for (std::size_t i = 0; i < m_.chunks.size(); ++i) {
    switch (from_[i]) {
      case From::none:
        throw Error(Errc::io, "internal error: chunk " + std::to_string(i) + " of snapshot '" + StoreImpl::ref(m_.session, m_.name) +
                                  "' was never written; nothing was published");
      case From::inherit:
        for (std::uint32_t k = base_->first_overlay[base_chunk_[i]]; k < base_->first_overlay[base_chunk_[i] + 1]; ++k) {
          m_.overlays.push_back(base_->overlays[k]);
          m_.overlays.back().chunk = i;
        }
        break;
      case From::patch:
        m_.overlays.insert(m_.overlays.end(), patched_.begin() + static_cast<std::ptrdiff_t>(ov_from_[i]),
                           patched_.begin() + static_cast<std::ptrdiff_t>(ov_from_[i] + ov_count_[i]));
        break;
      default:
        break;
    }
  }
  m_.index();
  if (without_hashes_) m_.page_hashes.clear();  // not hydrated: whoever needs them reads the page hash files
  m_.stored_bytes = stored_.load();
  m_.time_ns = now_ns();
  if (m_.origin_time_ns == 0) m_.origin_time_ns = m_.time_ns;
}

// ---- Lane ---------------------------------------------------------------------

SnapshotWriter::Lane::Lane(SnapshotWriter& writer, std::uint64_t expected, bool stable_sources, bool keep_mapped)
    : w_(writer),
      index_(writer.lanes_++),
      stable_(stable_sources),
      keep_mapped_(keep_mapped),
      left_(expected),
      block_size_(round_up_page(std::clamp(expected / 8, kMinBlock, kMaxBlock))),
      step_(kMinReserveStep) {}

SnapshotWriter::Lane::~Lane() {
  if (!block_.writer) return;
  run_.len = 0;
  try {
    block_.writer->finish();  // drains this thread's non-temporal stores
  } catch (const Error&) {
  }
}

void SnapshotWriter::Lane::flush() {
  if (run_.len) block_.writer->copy(run_.dst, run_.pieces, run_.len, !w_.own_buffers_);
  run_.len = 0;
  run_.pieces.clear();
}

void SnapshotWriter::Lane::close_block() {
  if (!block_.writer) return;
  flush();
  // Space reserved but not used stays allocated: it is free space the next
  // snapshot fills without faulting its pages in again (gc punches it).
  block_.writer->finish();  // on this thread: drains its own non-temporal stores
  // A stream writes each block once: its pages need not stay mapped here.
  if ((!stable_ && !keep_mapped_) || w_.release_written_) block_.writer->release();
  block_.writer.reset();
}

PageLoc SnapshotWriter::Lane::place(const char* from, std::uint64_t len, const std::uint64_t* hashes) {
  const std::uint64_t need = round_up_page(len);
  if (!block_.writer || block_.used + need > block_.length) {
    close_block();
    std::uint64_t size = std::max(need, std::min(block_size_, std::max(left_, need)));
    block_size_ = std::min(block_size_ * 2, kMaxBlock);
    auto placed = w_.batch_.space().take(size, index_);
    block_.at = placed.first;
    block_.length = size;
    block_.used = block_.reserved = 0;
    block_.writer.emplace(std::move(placed.second));
  }
  if (block_.used + need > block_.reserved) {
    // Reserve in growing steps: few calls for big snapshots, little
    // over-reservation for small ones.
    std::uint64_t take = std::min(std::max(step_, block_.used + need - block_.reserved), block_.length - block_.reserved);
    block_.writer->reserve(block_.reserved, take);
    block_.reserved += take;
    step_ = std::min(step_ * 2, kMaxReserveStep);
  }
  if (!stable_) {
    block_.writer->copy(block_.used, from, len, !w_.own_buffers_);
  } else if (run_.len && run_.dst + run_.len == block_.used && run_.len < kMaxRun) {
    // Right after the run in the pack: part of the same copy, one more piece
    // unless the source continues the last one too.
    iovec& last = run_.pieces.back();
    if (static_cast<const char*>(last.iov_base) + last.iov_len == from)
      last.iov_len += len;
    else
      run_.pieces.push_back({const_cast<char*>(from), len});
    run_.len += len;
  } else {
    flush();
    run_.dst = block_.used;
    run_.len = len;
    run_.pieces.push_back({const_cast<char*>(from), len});
  }
  PageLoc at{block_.at.pack, block_.at.offset + block_.used};
  block_.writer->set_hashes(block_.used, hashes, pages_in(len));
  block_.used += need;
  stored_ += need;
  return at;
}

void SnapshotWriter::Lane::put_whole(std::size_t chunk, const char* data) {
  Manifest& m = w_.m_;
  // Stored again (a background snapshot's chunk read torn): this lane's
  // record of the first attempt no longer describes the chunk.
  if (w_.from_[chunk] == From::whole) std::erase_if(mine_, [chunk](const auto& kv) { return kv.second.first == chunk; });
  ChunkRef& c = m.chunks[chunk];
  std::uint64_t* hashes = m.page_hashes.data() + m.first_page[chunk];
  left_ -= std::min(left_, round_up_page(c.length));
  hash_pages(data, c.length, hashes);
  c.hash = tree_hash(hashes, m.pages_of(chunk));
  w_.from_[chunk] = From::whole;
  if (is_zero_tree(c.hash, c.length) && all_zero(data, c.length)) {
    c.pack = 0;
    c.offset = 0;
    w_.from_[chunk] = From::zero;
    return;
  }
  // Reuse a stored copy, or one written by this lane, only if it holds
  // exactly these bytes.
  const ChunkRef* known = w_.store().find_chunk(c.hash, data, c.length);
  if (!known) {
    auto it = mine_.find(c.hash);
    if (it != mine_.end() && std::memcmp(it->second.second, data, c.length) == 0) known = &m.chunks[it->second.first];
  }
  if (known) {
    c.pack = known->pack;
    c.offset = known->offset;
    return;
  }
  PageLoc at = place(data, c.length, hashes);
  c.pack = at.pack;
  c.offset = at.offset;
  // Later duplicates are compared with the source while it stays valid, else
  // with the copy just written.
  const char* kept = stable_ ? data : block_.writer->written(block_.used - round_up_page(c.length));
  mine_.emplace(c.hash, std::make_pair(chunk, kept));
}

void SnapshotWriter::Lane::put_sparse(std::size_t chunk, const std::uint32_t* pages, std::size_t count, const char* data) {
  left_ -= std::min<std::uint64_t>(left_, count * kPageSize);
  Manifest& m = w_.m_;
  ChunkRef& c = m.chunks[chunk];
  const std::uint32_t n = m.pages_of(chunk);
  std::uint64_t* hashes = m.page_hashes.data() + m.first_page[chunk];
  auto length_of = [&](std::uint32_t p) { return static_cast<std::uint32_t>(std::min<std::uint64_t>(kPageSize, c.length - std::uint64_t{p} * kPageSize)); };
  for (std::uint32_t p = 0; p < n; ++p)
    hashes[p] = zero_page_hash(length_of(p));
  Overlay* ov = w_.patched_.data() + w_.ov_from_[chunk];
  std::uint32_t n_ov = 0;
  for (std::size_t x = 0; x < count; ++x) {
    const std::uint32_t p = pages[x], len = length_of(p);
    const char* now = data + std::uint64_t{p} * kPageSize;
    const std::uint64_t h = page_hash(now, len);
    if (h == hashes[p] && all_zero(now, len)) continue;
    hashes[p] = h;
    PageLoc at = place(now, len, &hashes[p]);
    ov[n_ov++] = Overlay{chunk, p, at.pack, at.offset};
  }
  c.pack = 0;
  c.offset = 0;
  c.hash = tree_hash(hashes, n);
  w_.ov_count_[chunk] = n_ov;
  if (n_ov == 0) w_.from_[chunk] = SnapshotWriter::From::zero;
}

bool SnapshotWriter::Lane::changed_page(std::size_t chunk, std::uint32_t p, const char* now, std::uint64_t* hashes) {
  ChunkView was = view_of(*w_.base_, w_.base_chunk_[chunk]);
  const std::uint32_t len = was.page_length(p);
  const std::uint64_t h = page_hash(now, len);
  if (h == was.pages[p]) {
    // Written but perhaps unchanged: compare with the stored page.
    PageLoc at = was.location(p);
    const char* old = at.pack ? w_.store().packs->mapped(at.pack, at.offset, len) : nullptr;
    // A stored page that cannot be read (SIGBUS) counts as changed: stored anew.
    bool same = false;
    if (at.pack && old && !guarded(old, len, [&] { same = std::memcmp(old, now, len) == 0; })) same = false;
    if (at.pack ? same : all_zero(now, len)) return false;
  }
  hashes[p] = h;
  return true;
}

void SnapshotWriter::Lane::apply_patch(std::size_t chunk, const std::vector<std::uint32_t>& changed, const char* const* now) {
  ChunkView was = view_of(*w_.base_, w_.base_chunk_[chunk]);
  std::uint64_t* hashes = w_.m_.page_hashes.data() + w_.m_.first_page[chunk];
  Overlay* ov = w_.patched_.data() + w_.ov_from_[chunk];
  auto n_ov = static_cast<std::uint32_t>(was.overlay_count);
  std::copy_n(was.overlays, n_ov, ov);
  for (std::size_t x = 0; x < changed.size(); ++x) {
    const std::uint32_t p = changed[x];
    const std::uint32_t len = was.page_length(p);
    Overlay o{chunk, p, 0, 0};
    if (!(hashes[p] == zero_page_hash(len) && all_zero(now[x], len))) {
      PageLoc at = place(now[x], len, &hashes[p]);
      o.pack = at.pack;
      o.offset = at.offset;
    }
    std::uint32_t pos = 0;
    while (pos < n_ov && ov[pos].page < p)
      ++pos;
    if (pos == n_ov || ov[pos].page != p) {
      std::copy_backward(ov + pos, ov + n_ov, ov + n_ov + 1);
      ++n_ov;
    }
    ov[pos] = o;
  }
  for (std::uint32_t x = 0; x < n_ov; ++x)
    ov[x].chunk = chunk;
  w_.ov_count_[chunk] = n_ov;
}

void SnapshotWriter::Lane::finish() {
  close_block();
  w_.stored_ += stored_;
  stored_ = 0;
}

// ---- write_snapshot -------------------------------------------------------------

namespace {

enum class Plan : std::uint8_t { inherit, patch, whole, zero, sparse };

// Which chunks to inherit, patch or store whole, and for patched chunks the
// written pages.
struct ChunkPlan {
  std::vector<Plan> plan;
  std::vector<std::size_t> base_chunk;
  std::vector<const char*> src;  // each chunk's live bytes
  // Patched chunk i: its written pages are pages[page_from[i] .. page_from[i+1]).
  std::vector<std::uint32_t> pages;
  std::vector<std::uint32_t> page_from;
  std::uint32_t patch_count(std::size_t i) const { return page_from[i + 1] - page_from[i]; }
  // Sparse chunk i: the pages that may be other than zero.
  std::unordered_map<std::size_t, std::vector<std::uint32_t>> sparse;
};

// Plans the chunks of `regions`, which are m.regions[first_region...].
ChunkPlan plan_chunks(const Manifest& m, std::size_t first_region, const std::vector<RegionSource>& regions, const Manifest* base) {
  ChunkPlan cp;
  const std::size_t n = m.chunks.size();
  cp.plan.assign(n, Plan::whole);
  cp.base_chunk.assign(n, 0);
  cp.page_from.assign(n + 1, 0);
  cp.src.resize(n);
  const std::uint32_t pages_per_chunk = pages_in(m.chunk_size);
  for (std::size_t ri = 0; ri < regions.size(); ++ri) {
    const ManifestRegion& mr = m.regions[first_region + ri];
    for (std::uint64_t j = 0; j < mr.chunk_count; ++j) {
      cp.src[mr.first_chunk + j] = regions[ri].data + j * m.chunk_size;
      const std::uint64_t lo = j * m.chunk_size, hi = lo + m.chunks[mr.first_chunk + j].length;
      if (!regions[ri].zero.empty() && inside(regions[ri].zero, lo, hi)) cp.plan[mr.first_chunk + j] = Plan::zero;
    }
    const ManifestRegion* br = nullptr;
    for (std::size_t k = 0; base && k < base->regions.size() && !br; ++k)
      if (base->regions[k].name == mr.name && base->regions[k].size == mr.size) br = &base->regions[k];
    if (!br || !regions[ri].written) continue;
    WrittenPages written(*regions[ri].written, mr.size, m.chunk_size);
    for (std::uint64_t j = 0; j < mr.chunk_count; ++j) {
      const std::size_t i = mr.first_chunk + j, bi = br->first_chunk + j;
      cp.base_chunk[i] = bi;
      cp.page_from[i] = cp.page_from[i + 1] = static_cast<std::uint32_t>(cp.pages.size());
      if (cp.plan[i] == Plan::zero || !base->trusted(bi)) continue;  // known zero; or its stored copy is damaged: read again
      if (!written.chunk[j]) {
        cp.plan[i] = Plan::inherit;
        continue;
      }
      for (std::uint32_t p = 0; p < m.pages_of(i); ++p)
        if (written.page[j * pages_per_chunk + p]) cp.pages.push_back(p);
      const std::size_t first = cp.page_from[i];
      if (store_pages_apart(*base, bi, cp.pages.data() + first, cp.pages.size() - first, m.pages_of(i)))
        cp.plan[i] = Plan::patch;
      else
        cp.pages.resize(first);
      cp.page_from[i + 1] = static_cast<std::uint32_t>(cp.pages.size());
    }
  }
  // Chunks still to be stored whole of which at most a quarter of the pages
  // can be other than zero (the rest lies in a region's `zero` ranges: pages
  // a CRIU window does not hold): the zero chunk with those pages apart.
  for (std::size_t ri = 0; ri < regions.size(); ++ri) {
    if (regions[ri].zero.empty()) continue;
    const ManifestRegion& mr = m.regions[first_region + ri];
    for (std::uint64_t j = 0; j < mr.chunk_count; ++j) {
      const std::size_t i = mr.first_chunk + j;
      if (cp.plan[i] != Plan::whole) continue;
      std::vector<std::uint32_t> present;
      for (std::uint32_t p = 0; p < m.pages_of(i) && present.size() * 4 <= m.pages_of(i); ++p) {
        const std::uint64_t lo = j * m.chunk_size + std::uint64_t{p} * kPageSize;
        const std::uint64_t hi = std::min<std::uint64_t>(lo + kPageSize, j * m.chunk_size + m.chunks[i].length);
        if (!inside(regions[ri].zero, lo, hi)) present.push_back(p);
      }
      if (present.size() * 4 > m.pages_of(i)) continue;
      cp.plan[i] = Plan::sparse;
      cp.sparse.emplace(i, std::move(present));
    }
  }
  return cp;
}

}  // namespace

void write_snapshot(SnapshotWriter& w, const std::vector<RegionSource>& regions, const Manifest* base, bool tracked, ChunkGuard* guard,
                    ProgressMeter* progress) {
  w.seal();
  if (!w.use_base(base)) base = nullptr;
  w.set_provenance(tracked, write_regions(w, regions, base, guard, progress));
}

std::uint64_t write_regions(SnapshotWriter& w, const std::vector<RegionSource>& regions, const Manifest* base, ChunkGuard* guard,
                            ProgressMeter* progress) {
  const std::size_t first_region = w.manifest().regions.size(), first_chunk = w.manifest().chunks.size();
  for (auto& r : regions)
    w.add_region(r.name, r.size, r.sdk_owned);
  if (base != w.base()) base = nullptr;
  const Manifest& m = w.manifest();
  const ChunkPlan cp = plan_chunks(m, first_region, regions, base);

  // Chunks with no page written since the base are taken from its manifest;
  // the others are read on every core.
  std::vector<std::size_t> todo;
  std::vector<std::uint64_t> slot{0};  // slot[k]: bytes todo[0..k) could need at most
  std::uint64_t total = 0;
  // Chunk i is chunk i - first_of[region_of[i]] of its region (for the guard).
  std::vector<std::uint32_t> region_of;
  if (guard)
    for (std::size_t ri = 0; ri < regions.size(); ++ri)
      region_of.insert(region_of.end(), m.regions[first_region + ri].chunk_count, static_cast<std::uint32_t>(ri));
  auto where = [&](std::size_t i) {
    const std::uint32_t ri = region_of[i - first_chunk];
    return std::make_pair(std::size_t{ri}, std::uint64_t{i - m.regions[first_region + ri].first_chunk});
  };
  for (std::size_t i = first_chunk; i < m.chunks.size(); ++i) {
    if (cp.plan[i] == Plan::inherit || cp.plan[i] == Plan::zero) {
      if (cp.plan[i] == Plan::inherit)
        w.inherit(i, cp.base_chunk[i]);
      else
        w.zero(i);
      if (guard) {
        auto [ri, j] = where(i);
        guard->skip(ri, j);
      }
      continue;
    }
    std::uint64_t need = round_up_page(m.chunks[i].length);
    if (cp.plan[i] == Plan::patch) {
      w.plan_patch(i, cp.base_chunk[i], cp.patch_count(i));
      need = cp.patch_count(i) * kPageSize;
    } else if (cp.plan[i] == Plan::sparse) {
      const auto present = static_cast<std::uint32_t>(cp.sparse.at(i).size());
      w.plan_sparse(i, present);
      need = std::uint64_t{present} * kPageSize;
    }
    todo.push_back(i);
    slot.push_back(slot.back() + need);
    total += cp.plan[i] == Plan::whole ? need : need / kPageSize * kPageWork;
  }

  // One pass per chunk: hash it, and if the store lacks it, copy it into a
  // block of free pack space while it is still in cache. The index is only
  // read here.
  if (progress && *progress) {
    std::uint64_t to_read = 0;  // region bytes read: whole chunks, or the written pages of patched ones
    for (std::size_t i : todo)
      to_read += cp.plan[i] == Plan::patch ? std::uint64_t{cp.patch_count(i)} * kPageSize : m.chunks[i].length;
    progress->grow_total(to_read);
  } else {
    progress = nullptr;
  }
  parallel_for(w.store().threads, todo.size(), total, [&](std::size_t b, std::size_t e) {
    // Guarded memory may change after a chunk is read: each copy is made
    // before the next chunk is read (sources not stable).
    FileSizeSignalGuard file_size_guard;  // one for all this slice's pack writes
    SnapshotWriter::Lane lane(w, slot[e] - slot[b], guard == nullptr, true);
    std::optional<RacyReads> racy;  // guarded memory is written by the program meanwhile
    if (guard) racy.emplace();
    auto put = [&](std::size_t i, const char* data) {
      auto page_at = [data](std::uint32_t p) { return data + std::uint64_t{p} * kPageSize; };
      if (cp.plan[i] == Plan::patch) {
        lane.put_patch(i, cp.pages.data() + cp.page_from[i], cp.patch_count(i), page_at, data);
      } else if (cp.plan[i] == Plan::sparse) {
        const auto& present = cp.sparse.at(i);
        lane.put_sparse(i, present.data(), present.size(), data);
      } else {
        lane.put_whole(i, data);
      }
    };
    for (std::size_t k = b; k < e; ++k) {
      const std::size_t i = todo[k];
      if (progress) {
        if (progress->stopped()) return;  // the caller throws the callback's exception; nothing is published
        progress->add(cp.plan[i] == Plan::patch ? std::uint64_t{cp.patch_count(i)} * kPageSize : m.chunks[i].length);
      }
      if (k + 1 < e && cp.plan[todo[k + 1]] == Plan::patch) {
        // Written pages are scattered: start loading the next chunk's while
        // this one is hashed, instead of stalling on each in turn.
        const std::size_t next = todo[k + 1];
        for (std::uint32_t x = cp.page_from[next]; x < cp.page_from[next + 1]; ++x)
          for (std::uint64_t line = 0; line < 512; line += 64)
            __builtin_prefetch(cp.src[next] + cp.pages[x] * kPageSize + line);
      }
      if (!guard) {
        put(i, cp.src[i]);
        continue;
      }
      auto [ri, j] = where(i);
      put(i, guard->begin(ri, j, cp.src[i]));
      if (const char* as_was = guard->again(ri, j)) put(i, as_was);
      guard->done(ri, j, cp.plan[i] == Plan::patch ? std::uint64_t{cp.patch_count(i)} * kPageSize : m.chunks[i].length);
    }
    lane.finish();
  }, progress);
  return todo.size();
}

// ---- in place -------------------------------------------------------------------

std::uint64_t write_in_place(SnapshotWriter& writer, std::size_t region, std::uint32_t pack, int fd, const ByteRanges& holes) {
  const Manifest& m = writer.manifest();
  const ManifestRegion& reg = m.regions.at(region);
  const std::uint64_t cs = m.chunk_size;
  // The base's region of the same name and size, when its chunks lie in this pack.
  const Manifest* base = writer.base();
  const ManifestRegion* br = nullptr;
  if (base)
    for (auto& r : base->regions)
      if (r.name == reg.name && r.size == reg.size) br = &r;
  std::vector<std::uint64_t> read;
  std::uint64_t bytes = 0;
  for (std::uint64_t j = 0; j < reg.chunk_count; ++j) {
    const std::size_t i = reg.first_chunk + j;
    const std::uint64_t off = j * cs, len = m.chunks[i].length;
    if (inside(holes, off, off + len)) {
      writer.zero(i);
      continue;
    }
    if (br) {
      const std::size_t bi = br->first_chunk + j;
      const ChunkRef& b = base->chunks[bi];
      if (b.pack == pack && b.offset == off && b.length == len && !base->has_overlays(bi)) {
        writer.inherit(i, bi);
        continue;
      }
    }
    read.push_back(j);
    bytes += len;
  }
  StoreImpl& store = writer.store();
  std::atomic<bool> unreadable{false};
  std::atomic<std::uint64_t> at{0};
  std::atomic<int> err{0};
  parallel_for(store.threads, read.size(), bytes, [&](std::size_t b, std::size_t e) {
    std::vector<std::uint64_t> hashes(cs / kPageSize + 1);
    // Each chunk is read into a buffer of this thread's with pread, not
    // through a mapping of the heap: on a VM with shadow page tables the
    // first touch of a page through a new mapping costs more than copying
    // it (docs/performance.md, "Reading packs"). Holes read zero and
    // allocate nothing.
    std::unique_ptr<char[]> chunk(new char[cs]);
    for (std::size_t k = b; k < e && !unreadable; ++k) {
      const std::uint64_t j = read[k];
      const std::size_t i = reg.first_chunk + j;
      const std::uint64_t off = j * cs, len = m.chunks[i].length;
      const std::uint32_t pages = m.pages_of(i);
      int failed = 0;
      if (const std::uint64_t got = read_at_most(fd, chunk.get(), len, off, failed); got < len) {
        // An error, or the file ends early (truncated meanwhile).
        err = failed;
        at = off + got;
        unreadable = true;
        return;
      }
      hash_pages(chunk.get(), len, hashes.data());
      if (is_zero_tree(tree_hash(hashes.data(), pages), len) && all_zero(chunk.get(), len))
        writer.zero(i);
      else
        writer.in_place(i, pack, off, hashes.data());
    }
  });
  if (unreadable) throw store.packs->pread_failed(pack, fd, at.load(), err.load());
  return read.size();
}

}  // namespace dvr::detail
