// Sending snapshots as streams (docs/format.md, "Stream format").
#include <zstd.h>

#include <chrono>
#include <optional>
#include <unordered_map>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/os.hpp"
#include "store/store_impl.hpp"
#include "base/progress.hpp"
#include "transfer/stream.hpp"
#include "dvr/proc.hpp"
#include "format/chunks.hpp"
#include "store/reader.hpp"

namespace dvr::transfer {

using namespace internal;
using detail::kPageSize;
using detail::StoreImpl;

namespace {

// ---- sending ---------------------------------------------------------------

// Sends one snapshot, against `base` of the same session if given.
void send_item(const Item& it, const std::string& base, RecordWriter& w, const Options& opt, Stats& st, detail::ProgressMeter& prog) {
  detail::SnapshotReader reader(detail::impl_of(it.store));  // the data cannot be reused while it is read
  Manifest m = reader.load(it.session, it.name);
  std::optional<Manifest> b;
  if (!base.empty()) b = reader.load(it.session, base);
  const bool pageable = b && b->paged && m.paged && b->chunk_size == m.chunk_size;

  detail::Writer h;
  h.str(it.session);
  h.str(it.name);
  h.str(m.label);
  h.str(m.parent);
  h.u64(static_cast<std::uint64_t>(m.origin_time_ns));  // when it was first made: the receiver keeps it
  h.u32(m.chunk_size);
  h.u8(m.paged ? 1 : 0);
  h.u32(static_cast<std::uint32_t>(m.regions.size()));
  for (auto& r : m.regions) {
    h.str(r.name);
    h.u64(r.size);
    h.u8(r.sdk_owned ? 1 : 0);
  }
  h.str(b ? base : "");
  h.hash(b ? fingerprint(*b) : Hash128{});
  w.record(kSnapshot, h.out);

  // Chunks the base holds anywhere, by hash.
  std::unordered_map<Hash128, std::pair<std::uint32_t, std::uint64_t>, detail::Hash128Hasher> in_base;
  if (b && b->chunk_size == m.chunk_size && b->paged == m.paged)
    for (std::uint32_t r = 0; r < b->regions.size(); ++r)
      for (std::uint64_t j = 0; j < b->regions[r].chunk_count; ++j) {
        const auto& c = b->chunks[b->regions[r].first_chunk + j];
        if (!c.is_zero() && b->trusted(b->regions[r].first_chunk + j)) in_base.emplace(c.hash, std::make_pair(r, j));
      }
  Compressor z(opt.compress, opt.level);
  // Chunks are read with pread (read_chunk, read_pages): no page of a pack
  // is mapped into this process, however much is sent.
  auto note_read = [&](std::uint64_t n) { st.read_bytes += n; };
  const std::string what = "snapshot '" + it.ref() + "'";
  std::vector<std::uint32_t> diff;
  for (std::uint32_t r = 0; r < m.regions.size(); ++r) {
    const auto& mr = m.regions[r];
    const detail::ManifestRegion* br = nullptr;
    if (b)
      for (auto& x : b->regions)
        if (x.name == mr.name && x.size == mr.size && b->chunk_size == m.chunk_size && b->paged == m.paged) br = &x;
    std::uint64_t run = 0, run_start = 0;
    auto flush_run = [&] {
      if (!run) return;
      detail::Writer x = w.begin();
      x.u32(r);
      x.u64(run_start);
      x.u64(run);
      w.end(kInherit, std::move(x));
      run = 0;
    };
    for (std::uint64_t j = 0; j < mr.chunk_count; ++j) {
      const std::size_t i = mr.first_chunk + j;
      const auto& c = m.chunks[i];
      ++st.chunks;
      prog.add(c.length);
      if (br && b->chunks[br->first_chunk + j].hash == c.hash && b->trusted(br->first_chunk + j)) {
        if (!run) run_start = j;
        ++run;
        ++st.chunks_skipped;
        continue;
      }
      flush_run();
      detail::Writer x = w.begin();
      x.u32(r);
      x.u64(j);
      if (m.zero_chunk(i)) {
        x.hash(c.hash);
        x.u32(c.length);
        w.end(kZero, std::move(x));
        continue;
      }
      if (auto f = in_base.find(c.hash); f != in_base.end()) {
        x.u32(f->second.first);
        x.u64(f->second.second);
        x.hash(c.hash);
        w.end(kCopy, std::move(x));
        ++st.chunks_skipped;
        continue;
      }
      // Against the base at the same place, the page hashes both manifests
      // hold say which pages differ: only those are read and sent.
      if (pageable && br && m.hydrated() && b->hydrated() && b->chunks[br->first_chunk + j].length == c.length &&
          b->trusted(br->first_chunk + j)) {
        const std::uint64_t *th = m.hashes_of(i), *bh = b->hashes_of(br->first_chunk + j);
        diff.clear();
        for (std::uint32_t p = 0; p < m.pages_of(i); ++p)
          if (th[p] != bh[p]) diff.push_back(p);
        if (diff.size() * 2 <= m.pages_of(i)) {
          x.hash(c.hash);
          x.u32(static_cast<std::uint32_t>(diff.size()));
          std::uint64_t bytes = 0;
          for (auto p : diff) {
            x.u32(p);
            bytes += std::min<std::uint64_t>(kPageSize, c.length - std::uint64_t{p} * kPageSize);
          }
          detail::read_pages(reader.packs(), detail::view_of(m, i), diff.data(), diff.size(), Compressor::reserve(x, bytes), what);
          note_read(bytes);
          z.seal(x, bytes, st);
          w.end(kPages, std::move(x));
          continue;
        }
      }
      x.hash(c.hash);
      reader.read(m, i, Compressor::reserve(x, c.length), what);
      note_read(c.length);
      z.seal(x, c.length, st);
      w.end(kChunk, std::move(x));
    }
    flush_run();
  }
  detail::Writer e;
  e.hash(fingerprint(m));
  e.u64(m.chunks.size());
  w.record(kSnapshotEnd, e.out);
  st.logical_bytes += m.logical_bytes();
  st.refs.push_back(it.ref());
}

}  // namespace

namespace internal {

Stats send_with(const Store& store, const std::string& ref, Wire to, const Options& opt, const std::vector<std::string>& bases) {
  auto t0 = std::chrono::steady_clock::now();
  checked_level(opt.level);
  std::vector<Item> items = items_of(store, ref);
  Stats st;
  // Progress: logical bytes of the snapshots sent (chunks skipped because the
  // receiver holds them count too), on this thread.
  detail::ProgressMeter prog(opt.progress);
  if (opt.progress) {  // a manifest read (and its page hashes) only for whom shows progress
    std::uint64_t total = 0;
    for (auto& it : items)
      total += load(it.store, it.session, it.name).logical_bytes();
    prog.grow_total(total);
  }
  RecordWriter w(to);
  write_stream_head(w, opt.sign_with);
  for (std::size_t k = 0; k < items.size(); ++k)
    send_item(items[k], bases[k], w, opt, st, prog);
  prog.finish();  // before the end record: a callback that throws still leaves the stream unfinished
  detail::Writer end;
  end.u32(static_cast<std::uint32_t>(items.size()));
  w.record(kStreamEnd, end.out);
  w.finish();
  st.base = bases.empty() ? "" : bases.back();
  st.wire_bytes = w.bytes();
  if (opt.sign_with) st.signed_by = opt.sign_with->fingerprint();
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.compression_ratio = st.wire_bytes ? static_cast<double>(st.data_bytes) / static_cast<double>(std::max<std::uint64_t>(1, st.wire_bytes)) : 1;
  return st;
}

std::string base_in(const std::string& ref, const std::string& session, const std::string& base) {
  if (base.empty()) return base;
  const std::string sent = split_ref(ref).first;
  std::string name = base;
  if (base.find('/') != std::string::npos) {
    auto [s, n] = split_ref(base);
    if (s != sent)
      throw Error(Errc::invalid_argument, "base '" + base + "' is not a snapshot of session '" + sent + "', which is sent; give NAME or " + sent +
                                              "/NAME of a snapshot the receiver holds");
    name = n;
  }
  return sent == proc::kImageSession && session != proc::kImageSession ? proc::kHeapPrefix + name : name;
}

// The base names for each item of `ref` given the user's --base.
std::vector<std::string> bases_for(const std::vector<Item>& items, const std::string& ref, const std::string& base) {
  std::vector<std::string> out;
  for (auto& it : items) {
    if (base.empty()) {
      out.emplace_back();
      continue;
    }
    std::string b = base_in(ref, it.session, base);
    if (!has_snapshot(it.store, it.session, b))
      throw Error(Errc::not_found, "base snapshot '" + it.session + "/" + b + "' does not exist here; give a base both sides hold");
    out.push_back(b);
  }
  return out;
}

}  // namespace internal

std::size_t remove_stale_export_parts(const std::string& file) noexcept {
  std::size_t removed = 0;
  try {
    const std::size_t slash = file.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : file.substr(0, slash);
    const std::string prefix = (slash == std::string::npos ? file : file.substr(slash + 1)) + ".part-";
    for (const std::string& name : detail::list_dir(dir)) {
      if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
      const std::string digits = name.substr(prefix.size());
      if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
      const pid_t pid = static_cast<pid_t>(std::stol(digits));
      if (pid <= 0 || ::kill(pid, 0) == 0 || errno != ESRCH) continue;  // its export may still run
      struct stat st {};
      const std::string path = dir + "/" + name;
      if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid() && ::unlink(path.c_str()) == 0) ++removed;
    }
  } catch (...) {  // an unreadable directory: nothing to remove
  }
  return removed;
}

const char* to_string(Compress c) {
  switch (c) {
    case Compress::automatic:
      return "auto";
    case Compress::zstd:
      return "zstd";
    case Compress::none:
      return "none";
  }
  return "?";
}

Compress parse_compress(const std::string& text, const std::string& option) {
  for (Compress c : {Compress::automatic, Compress::zstd, Compress::none})
    if (text == to_string(c)) return c;
  throw Error(Errc::invalid_argument, option + " must be auto, zstd or none, not '" + text + "'");
}

Stats send(const Store& store, const std::string& ref, int fd, const Options& options) {
  std::vector<Item> items = items_of(store, ref);
  return send_with(store, ref, fd, options, bases_for(items, ref, options.base));
}

Stats send(const Store& store, const std::string& ref, Channel& out, const Options& options) {
  std::vector<Item> items = items_of(store, ref);
  return send_with(store, ref, out, options, bases_for(items, ref, options.base));
}

}  // namespace dvr::transfer
