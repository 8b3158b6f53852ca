// Sending what a snapshot taken now would hold, straight from the regions in
// memory (dvr/transfer.hpp, send_live; docs/format.md, "Stream format"). The
// stream is the one send() writes, so receive() takes it as any other: every
// chunk checked against its XXH3-128, the whole against its fingerprint.
//
// dvr::mpi sends a rank's partner copy this way while the rank's own snapshot
// of the same memory is being stored (docs/mpi.md, "The first checkpoint"):
// the copy does not wait for the local one, and nothing is read back from the
// store. `confirm` ties the two together: it sees the fingerprint of what was
// sent before the stream ends, and a mismatch with the stored snapshot ends
// the stream unfinished, so the receiver stores nothing.
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <unordered_map>

#include "dvr/session.hpp"
#include "store/reader.hpp"
#include "store/store_impl.hpp"
#include "base/progress.hpp"
#include "transfer/stream.hpp"

namespace dvr::transfer {

using namespace internal;
using detail::kPageSize;


namespace {

Stats send_live_to(const Store& store, const std::string& session, const std::vector<Region*>& regions, const std::string& name, Wire wire,
                   const Options& options, const std::function<void(const std::string& fingerprint)>& confirm) {
  const auto t0 = std::chrono::steady_clock::now();
  detail::check_name("session", session);
  detail::check_name("snapshot", name);
  checked_level(options.level);
  if (regions.empty()) throw Error(Errc::invalid_argument, "session '" + session + "' has no regions to send");
  const std::uint32_t cs = detail::impl_of(store).chunk_size;
  // The base, loaded once: only its tables are used (the data is not read).
  std::optional<Manifest> b;
  if (!options.base.empty()) {
    b = detail::SnapshotReader(detail::impl_of(store)).load(session, options.base);
    if (!b->paged || b->chunk_size != cs) b.reset();  // not comparable page by page: everything is sent
  }
  Stats st;
  std::uint64_t total = 0;
  for (Region* r : regions)
    total += r->size();
  detail::ProgressMeter progress(options.progress, total);

  RecordWriter w{wire};
  write_stream_head(w, options.sign_with);
  {
    detail::Writer h;
    h.str(session);
    h.str(name);
    h.str("");  // label
    h.str(b ? options.base : "");
    h.u64(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count()));
    h.u32(cs);
    h.u8(1);  // paged: a chunk's hash is the tree hash of its pages'
    h.u32(static_cast<std::uint32_t>(regions.size()));
    for (Region* r : regions) {
      h.str(r->name());
      h.u64(r->size());
      h.u8(r->sdk_owned() ? 1 : 0);
    }
    h.str(b ? options.base : "");
    h.hash(b ? fingerprint(*b) : Hash128{});
    w.record(kSnapshot, h.out);
  }
  // Chunks the base holds anywhere, by hash.
  std::unordered_map<Hash128, std::pair<std::uint32_t, std::uint64_t>, detail::Hash128Hasher> in_base;
  if (b)
    for (std::uint32_t r = 0; r < b->regions.size(); ++r)
      for (std::uint64_t j = 0; j < b->regions[r].chunk_count; ++j) {
        const std::size_t i = b->regions[r].first_chunk + j;
        if (!b->chunks[i].is_zero() && b->trusted(i)) in_base.emplace(b->chunks[i].hash, std::make_pair(r, j));
      }

  Manifest shape;  // what was sent, for its fingerprint
  shape.chunk_size = cs;
  shape.paged = true;
  Compressor z(options.compress, options.level);  // the sender's own per-chunk decision
  std::vector<std::uint64_t> ph(detail::pages_in(cs));
  std::vector<std::uint32_t> diff;
  detail::Writer x;
  for (std::uint32_t r = 0; r < regions.size(); ++r) {
    const char* data = static_cast<const char*>(regions[r]->data());
    const std::uint64_t size = regions[r]->size();
    shape.regions.push_back({regions[r]->name(), size, false, 0, 0});
    const detail::ManifestRegion* br = nullptr;
    if (b)
      for (auto& y : b->regions)
        if (y.name == regions[r]->name() && y.size == size) br = &y;
    std::uint64_t run = 0, run_start = 0;
    auto flush_run = [&] {
      if (!run) return;
      x.out.clear();
      x.u32(r);
      x.u64(run_start);
      x.u64(run);
      w.record(kInherit, x.out);
      run = 0;
    };
    const std::uint64_t chunks = (size + cs - 1) / cs;
    for (std::uint64_t j = 0; j < chunks; ++j) {
      const char* c = data + j * cs;
      const auto len = static_cast<std::uint32_t>(std::min<std::uint64_t>(cs, size - j * cs));
      const std::uint32_t np = detail::pages_in(len);
      detail::hash_pages(c, len, ph.data());
      const Hash128 h = detail::tree_hash(ph.data(), np);
      shape.chunks.push_back({h, 0, 0, 0});
      ++st.chunks;
      progress.add(len);
      const std::size_t bi = br ? br->first_chunk + j : 0;
      if (br && b->chunks[bi].hash == h && b->trusted(bi)) {
        if (!run) run_start = j;
        ++run;
        ++st.chunks_skipped;
        continue;
      }
      flush_run();
      x.out.clear();
      x.u32(r);
      x.u64(j);
      if (detail::is_zero_tree(h, len)) {
        x.hash(h);
        x.u32(len);
        w.record(kZero, x.out);
        continue;
      }
      if (auto f = in_base.find(h); f != in_base.end()) {
        x.u32(f->second.first);
        x.u64(f->second.second);
        x.hash(h);
        w.record(kCopy, x.out);
        ++st.chunks_skipped;
        continue;
      }
      if (br && b->chunks[bi].length == len && b->trusted(bi)) {
        const std::uint64_t* bh = b->hashes_of(bi);
        diff.clear();
        for (std::uint32_t p = 0; p < np; ++p)
          if (ph[p] != bh[p]) diff.push_back(p);
        if (diff.size() * 2 <= np) {
          x.hash(h);
          x.u32(static_cast<std::uint32_t>(diff.size()));
          std::size_t n = 0;
          for (auto p : diff) {
            x.u32(p);
            n += std::min<std::uint64_t>(kPageSize, len - std::uint64_t{p} * kPageSize);
          }
          char* to = Compressor::reserve(x, n);
          for (auto p : diff) {
            const std::uint64_t off = std::uint64_t{p} * kPageSize;
            const std::size_t k = std::min<std::uint64_t>(kPageSize, len - off);
            std::memcpy(to, c + off, k);
            to += k;
          }
          z.seal(x, n, st);
          w.record(kPages, x.out);
          continue;
        }
      }
      x.hash(h);
      std::memcpy(Compressor::reserve(x, len), c, len);
      z.seal(x, len, st);
      w.record(kChunk, x.out);
    }
    flush_run();
  }
  progress.finish();  // before the end records: a callback that throws leaves the stream unfinished
  const Hash128 fp = fingerprint(shape);
  st.fingerprint = detail::to_hex(fp);
  if (confirm) confirm(st.fingerprint);  // throws: the stream stays unfinished
  detail::Writer e;
  e.hash(fp);
  e.u64(shape.chunks.size());
  w.record(kSnapshotEnd, e.out);
  detail::Writer end;
  end.u32(1);
  w.record(kStreamEnd, end.out);
  w.finish();  // everything queued is written (the writer's thread), or its error thrown
  st.refs.push_back(session + "/" + name);
  st.base = b ? options.base : "";
  st.logical_bytes = total;
  st.wire_bytes = w.bytes();
  if (options.sign_with) st.signed_by = options.sign_with->fingerprint();
  st.compression_ratio = static_cast<double>(st.data_bytes) / static_cast<double>(std::max<std::uint64_t>(1, st.wire_bytes));
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace

Stats send_live(const Store& store, const std::string& session, const std::vector<Region*>& regions, const std::string& name, int fd,
                const Options& options, const std::function<void(const std::string& fingerprint)>& confirm) {
  return send_live_to(store, session, regions, name, fd, options, confirm);
}

Stats send_live(const Store& store, const std::string& session, const std::vector<Region*>& regions, const std::string& name, Channel& out,
                const Options& options, const std::function<void(const std::string& fingerprint)>& confirm) {
  return send_live_to(store, session, regions, name, out, options, confirm);
}

std::string fingerprint(const Store& store, const std::string& ref) {
  auto [session, name] = split_ref(ref);
  return detail::to_hex(internal::fingerprint(load(store, session, name)));
}

}  // namespace dvr::transfer
