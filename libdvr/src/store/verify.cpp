// Checking stored data: Store::verify, diff and latest.
#include <fcntl.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <optional>
#include <sstream>

#include "dvr/dvr.hpp"
#include "base/memops.hpp"
#include "base/progress.hpp"
#include "format/chunks.hpp"
#include "store/store_impl.hpp"
#include <mutex>

namespace dvr {

using detail::StoreImpl;

VerifyReport Store::verify(const Progress& progress) const {
  using namespace detail;
  std::lock_guard<std::mutex> guard(impl_->mu);
  StoreImpl::Lock lock(*impl_, false);
  impl_->packs->refresh_mappings();
  VerifyReport report;

  // Pass 1: every distinct stored chunk, checked once however many snapshots
  // share it (memory grows with distinct chunks, not with references).
  // A chunk is known by where it is stored and what it should hold (for a
  // chunk with overlays, where those pages are stored too).
  using Key = std::tuple<std::uint32_t, std::uint64_t, std::uint32_t, std::uint64_t, std::uint64_t, std::uint64_t, bool>;
  auto key_of_chunk = [](const ChunkView& v) {
    const ChunkRef& c = *v.ref;
    std::uint64_t where = 0;  // where the overlays are (not which chunk they belong to)
    for (std::size_t k = 0; k < v.overlay_count; ++k)
      where = hash64(&v.overlays[k].offset, 8) ^ (where * 0x9E3779B97F4A7C15ull) ^ (std::uint64_t{v.overlays[k].pack} << 32 | v.overlays[k].page);
    return Key{c.pack, c.offset, c.length, c.hash.lo, c.hash.hi, where, v.paged};
  };
  struct Loc {
    std::optional<OwnedChunk> chunk;
    bool readable = false;
    std::string error;
    bool damage = true;  // false: an I/O or permission problem, not proven damage
    bool newer = false;  // in a pack of a newer format (unsupported): not damage either
  };
  std::map<Key, Loc> locs;
  std::vector<std::pair<std::string, std::string>> readable;
  for (auto& session : impl_->session_names()) {
    for (auto& name : impl_->snapshot_names(session)) {
      Manifest m;
      try {
        m = impl_->load_manifest(session, name);
      } catch (const Error& e) {
        if (e.code() == Errc::not_found) continue;  // removed meanwhile
        ++report.snapshots;
        report.problems.push_back({session, name, e.what()});
        continue;
      }
      ++report.snapshots;
      readable.emplace_back(session, name);
      for (std::size_t i = 0; i < m.chunks.size(); ++i) {
        ChunkView v = view_of(m, i);
        if (v.all_zero() && !v.paged) continue;
        auto& loc = locs[key_of_chunk(v)];
        if (!loc.chunk) loc.chunk.emplace(v);
      }
    }
  }
  std::vector<Loc*> work;
  std::uint64_t total = 0;
  for (auto& [key, loc] : locs) {
    try {
      map_chunk(*impl_->packs, loc.chunk->view());
      loc.readable = true;
      total += loc.chunk->ref.length;
    } catch (const OutOfAddressSpace&) {
      throw;  // this run's limit, not the store's damage: nothing is reported about the snapshots
    } catch (const Error& e) {
      loc.error = e.what();
      loc.damage = e.code() == Errc::corrupt;
      loc.newer = e.code() == Errc::unsupported;
    }
    work.push_back(&loc);
  }
  ProgressMeter meter(progress, total);
  parallel_for(impl_->threads, work.size(), total, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e && !meter.stopped(); ++i) {
      Loc& loc = *work[i];
      if (!loc.readable) continue;
      try {
        loc.error = check_chunk(*impl_->packs, loc.chunk->view());
      } catch (const Error& err) {
        loc.error = err.what();
      }
      meter.add(loc.chunk->ref.length);
    }
  }, &meter);
  meter.finish();
  report.chunks = work.size();
  report.bytes = total;

  // Pass 2, only when something is wrong: name each affected snapshot, with
  // the first few damaged ranges.
  bool any_bad = std::any_of(work.begin(), work.end(), [](const Loc* l) { return !l->error.empty(); });
  for (auto& [session, name] : any_bad ? readable : decltype(readable){}) {
    Manifest m;
    try {
      m = impl_->load_manifest(session, name, nullptr, false);
    } catch (const Error&) {
      continue;  // changed meanwhile; its first pass stands
    }
    std::vector<std::string> items;
    bool damage = false, newer = false;
    for (auto& r : m.regions)
      for (std::uint64_t i = 0; i < r.chunk_count; ++i) {
        auto& c = m.chunks[r.first_chunk + i];
        auto it = locs.find(key_of_chunk(view_of(m, r.first_chunk + i)));
        if (it == locs.end() || it->second.error.empty()) continue;
        damage = damage || it->second.damage;
        newer = newer || it->second.newer;
        items.push_back("region '" + r.name + "' bytes [" + std::to_string(i * m.chunk_size) + ", " + std::to_string(i * m.chunk_size + c.length) +
                        "): " + it->second.error);
      }
    if (items.empty()) continue;
    std::string what = std::to_string(items.size()) + (damage ? " damaged chunk(s): " : " unreadable chunk(s): ") + items[0];
    for (std::size_t i = 1; i < std::min<std::size_t>(items.size(), 3); ++i)
      what += "; " + items[i];
    if (items.size() > 3) what += "; ...";
    what += damage  ? " — this snapshot cannot be restored; remove it with `" + dvr_for(impl_->path) + " rm " + shell_word(session + "/" + name) + "`"
            : newer ? " — upgrade Memory DVR to read it"
                    : " — check the permissions and health of the store's files, then verify again";
    report.problems.push_back({session, name, what});
  }
  report.warnings = impl_->permission_warnings();
  return report;
}

std::vector<RegionDiff> Store::diff(const std::string& session_a, const std::string& snapshot_a, const std::string& session_b,
                                    const std::string& snapshot_b) const {
  using namespace detail;
  std::lock_guard<std::mutex> guard(impl_->mu);
  StoreImpl::Lock lock(*impl_, false);
  impl_->packs->refresh_mappings();
  Manifest a = impl_->load_manifest(session_a, snapshot_a), b = impl_->load_manifest(session_b, snapshot_b);
  const std::string ra = StoreImpl::ref(session_a, snapshot_a), rb = StoreImpl::ref(session_b, snapshot_b);
  std::vector<RegionDiff> out;
  auto find = [](const Manifest& m, const std::string& n) -> const ManifestRegion* {
    for (auto& r : m.regions)
      if (r.name == n) return &r;
    return nullptr;
  };
  auto pages = [](std::uint64_t bytes) { return (bytes + kPageSize - 1) / kPageSize; };
  std::vector<std::string> names;
  for (auto& r : a.regions)
    names.push_back(r.name);
  for (auto& r : b.regions)
    if (!find(a, r.name)) names.push_back(r.name);
  for (auto& n : names) {
    const ManifestRegion *x = find(a, n), *y = find(b, n);
    RegionDiff d;
    d.name = n;
    d.size_a = x ? x->size : 0;
    d.size_b = y ? y->size : 0;
    d.only_in_a = x && !y;
    d.only_in_b = y && !x;
    if (!x || !y) {
      d.bytes_differ = std::max(d.size_a, d.size_b);
      d.pages_differ = pages(d.bytes_differ);
      out.push_back(d);
      continue;
    }
    std::uint64_t common = std::min(x->size, y->size);
    std::vector<char> ba, bb;
    for (std::uint64_t i = 0; i * a.chunk_size < common; ++i) {
      const ChunkRef& ca = a.chunks[x->first_chunk + i];
      const ChunkRef& cb = b.chunks[y->first_chunk + i];
      std::uint64_t len = std::min<std::uint64_t>(a.chunk_size, common - i * a.chunk_size);
      bool same_kind = a.paged == b.paged && ca.length == cb.length;
      if (same_kind && ca.hash == cb.hash) continue;
      // Both chunks are read (and checked) whole; with page hashes on both
      // sides, pages whose hashes agree are not compared byte by byte.
      ba.resize(ca.length);
      bb.resize(cb.length);
      read_chunk(*impl_->packs, view_of(a, x->first_chunk + i), ba.data(), "snapshot '" + ra + "'");
      read_chunk(*impl_->packs, view_of(b, y->first_chunk + i), bb.data(), "snapshot '" + rb + "'");
      const char *pa = ba.data(), *pb = bb.data();
      const bool by_page = same_kind && a.paged;
      for (std::uint64_t off = 0; off < len; off += kPageSize) {
        std::uint64_t n2 = std::min<std::uint64_t>(kPageSize, len - off), differ = 0;
        if (by_page && a.hashes_of(x->first_chunk + i)[off / kPageSize] == b.hashes_of(y->first_chunk + i)[off / kPageSize]) continue;
        if (std::memcmp(pa + off, pb + off, n2) == 0) continue;
        for (std::uint64_t k = 0; k < n2; ++k)
          differ += pa[off + k] != pb[off + k];
        d.bytes_differ += differ;
        ++d.pages_differ;
      }
    }
    std::uint64_t extra = std::max(x->size, y->size) - common;
    d.bytes_differ += extra;
    if (extra) d.pages_differ += pages(std::max(x->size, y->size)) - common / kPageSize;
    out.push_back(d);
  }
  return out;
}

std::optional<SnapshotInfo> Store::latest(const std::string& session, std::vector<std::string>* skipped) const {
  using namespace detail;
  auto snaps = list(session);
  std::lock_guard<std::mutex> guard(impl_->mu);
  StoreImpl::Lock lock(*impl_, false);
  impl_->packs->refresh_mappings();
  for (auto it = snaps.rbegin(); it != snaps.rend(); ++it) {
    std::string ref = StoreImpl::ref(session, it->name);
    try {
      if (it->damaged) throw Error(Errc::corrupt, it->damage);
      Manifest m = impl_->load_manifest(session, it->name);
      std::vector<std::size_t> all(m.chunks.size());
      for (std::size_t i = 0; i < all.size(); ++i)
        all[i] = i;
      std::string why;
      if (first_damaged(impl_->threads, *impl_->packs, m, all, &why) != SIZE_MAX)
        throw Error(Errc::corrupt, "snapshot '" + ref + "' is damaged: " + why + "; run `dvr verify`");
      return info_from_manifest(m);
    } catch (const OutOfAddressSpace&) {
      throw;  // this run's limit: no snapshot is known to be damaged
    } catch (const Error& e) {
      if (e.code() == Errc::not_found) continue;
      if (skipped) skipped->push_back(ref + ": " + e.what());
    }
  }
  return std::nullopt;
}

}  // namespace dvr
