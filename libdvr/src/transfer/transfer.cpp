// Moving snapshots between stores: the stream format (docs/format.md,
// "Stream format"), send, receive and their negotiated forms.
#include "dvr/transfer.hpp"

#include <sys/mman.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <unordered_map>

#include "format/chunks.hpp"
#include "dvr/proc.hpp"
#include "dvr/session.hpp"
#include "base/hash.hpp"
#include "format/manifest.hpp"
#include "base/os.hpp"
#include "store/store_impl.hpp"
#include "store/writer.hpp"

namespace dvr::transfer {

namespace {

using detail::Hash128;
using detail::kPageSize;
using detail::Manifest;
using detail::StoreAccess;
using detail::StoreImpl;

constexpr char kMagic[8] = {'D', 'V', 'R', 'S', 'T', 'R', 'M', '\0'};
constexpr std::uint32_t kVersion = 1;
constexpr char kNegotiateMagic[8] = {'D', 'V', 'R', 'N', 'E', 'G', '1', '\n'};
constexpr std::uint32_t kMaxRecord = 64u << 20;  // a chunk is at most 16 MiB, plus headers

enum Kind : std::uint32_t {
  kSnapshot = 1,
  kChunk = 2,
  kPages = 3,
  kZero = 4,
  kCopy = 5,
  kInherit = 6,
  kSnapshotEnd = 7,
  kStreamEnd = 8,
};
enum Codec : std::uint8_t { kRaw = 0, kZstd = 1 };

[[noreturn]] void bad_stream(const std::string& why) {
  throw Error(Errc::corrupt, "the stream is damaged: " + why + "; nothing was stored (send it again)");
}

// ---- wire encoding -------------------------------------------------------

struct Buf {
  std::string b;
  void u8(std::uint8_t v) { b.push_back(static_cast<char>(v)); }
  void u32(std::uint32_t v) { b.append(reinterpret_cast<const char*>(&v), 4); }
  void u64(std::uint64_t v) { b.append(reinterpret_cast<const char*>(&v), 8); }
  void str(const std::string& s) {
    u32(static_cast<std::uint32_t>(s.size()));
    b += s;
  }
  void hash(const Hash128& h) {
    u64(h.lo);
    u64(h.hi);
  }
  void bytes(const char* p, std::size_t n) { b.append(p, n); }
};

struct Parse {
  const char* p;
  const char* end;
  explicit Parse(const std::string& s) : p(s.data()), end(s.data() + s.size()) {}
  void need(std::size_t n) const {
    if (static_cast<std::size_t>(end - p) < n) bad_stream("a record is shorter than its fields");
  }
  std::uint8_t u8() {
    need(1);
    return static_cast<std::uint8_t>(*p++);
  }
  std::uint32_t u32() {
    need(4);
    std::uint32_t v;
    std::memcpy(&v, p, 4);
    p += 4;
    return v;
  }
  std::uint64_t u64() {
    need(8);
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    p += 8;
    return v;
  }
  std::string str() {
    std::uint32_t n = u32();
    need(n);
    std::string s(p, n);
    p += n;
    return s;
  }
  Hash128 hash() {
    Hash128 h;
    h.lo = u64();
    h.hi = u64();
    return h;
  }
  const char* take(std::size_t n) {
    need(n);
    const char* q = p;
    p += n;
    return q;
  }
};

void write_fd(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EPIPE) throw Error(Errc::io, "the receiving end closed the connection (see its error message)");
      detail::throw_errno(errno, "cannot write the stream");
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

// Reads exactly n bytes; false at a clean end of input before the first byte.
bool read_fd(int fd, char* p, std::size_t n, bool eof_ok = false) {
  std::size_t got = 0;
  while (got < n) {
    ssize_t r = ::read(fd, p + got, n - got);
    if (r < 0) {
      if (errno == EINTR) continue;
      detail::throw_errno(errno, "cannot read the stream");
    }
    if (r == 0) {
      if (got == 0 && eof_ok) return false;
      throw Error(Errc::corrupt, "the stream is truncated (it ended in the middle of a record); nothing was stored (send it again)");
    }
    got += static_cast<std::size_t>(r);
  }
  return true;
}

struct Writer {
  int fd;
  std::uint64_t bytes = 0;
  void raw(const char* p, std::size_t n) {
    write_fd(fd, p, n);
    bytes += n;
  }
  // [u32 kind][u32 length][payload][u64 XXH3-64 of the three before]
  void record(Kind kind, const std::string& payload) {
    std::string r;
    r.reserve(payload.size() + 16);
    std::uint32_t k = kind, n = static_cast<std::uint32_t>(payload.size());
    r.append(reinterpret_cast<const char*>(&k), 4);
    r.append(reinterpret_cast<const char*>(&n), 4);
    r += payload;
    std::uint64_t h = detail::hash64(r.data(), r.size());
    r.append(reinterpret_cast<const char*>(&h), 8);
    raw(r.data(), r.size());
  }
};

struct Reader {
  int fd;
  std::uint64_t bytes = 0;
  std::string scratch;
  void raw(char* p, std::size_t n) {
    read_fd(fd, p, n);
    bytes += n;
  }
  Kind record(std::string& payload) {
    char head[8];
    raw(head, 8);
    std::uint32_t k, n;
    std::memcpy(&k, head, 4);
    std::memcpy(&n, head + 4, 4);
    if (n > kMaxRecord) bad_stream("a record claims " + std::to_string(n) + " bytes");
    scratch.assign(head, 8);
    scratch.resize(8 + n);
    raw(scratch.data() + 8, n);
    std::uint64_t want;
    char tail[8];
    raw(tail, 8);
    std::memcpy(&want, tail, 8);
    if (detail::hash64(scratch.data(), scratch.size()) != want) bad_stream("a record fails its checksum (a flipped or missing byte)");
    payload.assign(scratch, 8, std::string::npos);
    return static_cast<Kind>(k);
  }
};

// ---- what a ref stands for ----------------------------------------------

struct Item {
  Store store;
  std::string session, name;
  std::string ref() const { return session + "/" + name; }
};

std::pair<std::string, std::string> split_ref(const std::string& ref) {
  auto slash = ref.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == ref.size() || ref.find('/', slash + 1) != std::string::npos)
    throw Error(Errc::invalid_argument, "'" + ref + "' is not a snapshot reference; write SESSION/NAME or proc/NAME");
  return {ref.substr(0, slash), ref.substr(slash + 1)};
}

bool has_snapshot(const Store& s, const std::string& session, const std::string& name) {
  for (auto& i : s.list(session))
    if (i.name == name) return true;
  return false;
}

// The snapshots REF stands for, heaps before the process images, so that a
// receiver publishing them in order shows proc/NAME only once all is there.
std::vector<Item> items_of(const Store& store, const std::string& ref) {
  auto [session, name] = split_ref(ref);
  std::vector<Item> out;
  if (session == proc::kImageSession) {
    proc::ProcInfo p = proc::info(store, name);
    for (auto& h : p.heaps) {
      std::string snap = proc::kHeapPrefix + name;
      if (std::any_of(out.begin(), out.end(), [&](const Item& i) { return i.session == h.session; })) continue;
      // The heap snapshot is in this store when it came here by a transfer,
      // else in the heap's own store.
      if (has_snapshot(store, h.session, snap)) out.push_back({store, h.session, snap});
      else out.push_back({Store::open(h.store, {.create = false}), h.session, snap});
    }
  }
  if (!has_snapshot(store, session, name) && session != proc::kImageSession) store.info(session, name);  // not_found
  out.push_back({store, session, name});
  return out;
}

// Content identity of a snapshot, independent of where its bytes are stored.
Hash128 fingerprint(const Manifest& m) {
  Buf b;
  b.u32(m.chunk_size);
  b.u8(m.paged ? 1 : 0);
  for (auto& r : m.regions) {
    b.str(r.name);
    b.u64(r.size);
  }
  for (auto& c : m.chunks) b.hash(c.hash);
  return detail::hash128(b.b.data(), b.b.size());
}

Manifest load(const Store& s, const std::string& session, const std::string& name) {
  StoreImpl& si = StoreAccess::impl(s);
  std::lock_guard<std::mutex> guard(si.mu);
  StoreImpl::Lock lock(si, false);
  si.packs->refresh_mappings();
  return si.load_manifest(session, name);
}

// ---- sending ---------------------------------------------------------------

struct Compressor {
  ZSTD_CCtx* ctx = nullptr;
  std::string out;
  Compressor() : ctx(ZSTD_createCCtx()) {}
  ~Compressor() { ZSTD_freeCCtx(ctx); }
  // Appends codec, raw length and data to `b`: zstd when it saves space.
  void put(Buf& b, const char* data, std::size_t n, int level, Stats& st) {
    st.data_bytes += n;
    if (level > 0) {
      out.resize(ZSTD_compressBound(n));
      std::size_t c = ZSTD_compressCCtx(ctx, out.data(), out.size(), data, n, level);
      if (!ZSTD_isError(c) && c < n) {
        b.u8(kZstd);
        b.u32(static_cast<std::uint32_t>(n));
        b.u32(static_cast<std::uint32_t>(c));
        b.bytes(out.data(), c);
        return;
      }
    }
    b.u8(kRaw);
    b.u32(static_cast<std::uint32_t>(n));
    b.u32(static_cast<std::uint32_t>(n));
    b.bytes(data, n);
  }
};

struct Progressor {
  const Progress& fn;
  std::uint64_t done = 0, total = 0;
  void add(std::uint64_t n) {
    done += n;
    if (fn) fn(done, total);
  }
};

// Sends one snapshot, against `base` of the same session if given.
void send_item(const Item& it, const std::string& base, Writer& w, const Options& opt, Stats& st, Progressor& prog) {
  StoreImpl& si = StoreAccess::impl(it.store);
  std::lock_guard<std::mutex> guard(si.mu);
  StoreImpl::Lock lock(si, false);  // the data cannot be reused while it is read
  si.packs->refresh_mappings();
  Manifest m = si.load_manifest(it.session, it.name);
  std::optional<Manifest> b;
  if (!base.empty()) b = si.load_manifest(it.session, base);
  const bool pageable = b && b->paged && m.paged && b->chunk_size == m.chunk_size;

  Buf h;
  h.str(it.session);
  h.str(it.name);
  h.str(m.label);
  h.str(m.parent);
  h.u64(static_cast<std::uint64_t>(m.time_ns));
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
  w.record(kSnapshot, h.b);

  // Chunks the base holds anywhere, by hash.
  std::unordered_map<Hash128, std::pair<std::uint32_t, std::uint64_t>, detail::Hash128Hasher> in_base;
  if (b && b->chunk_size == m.chunk_size && b->paged == m.paged)
    for (std::uint32_t r = 0; r < b->regions.size(); ++r)
      for (std::uint64_t j = 0; j < b->regions[r].chunk_count; ++j) {
        const auto& c = b->chunks[b->regions[r].first_chunk + j];
        if (!c.is_zero() && b->trusted(b->regions[r].first_chunk + j)) in_base.emplace(c.hash, std::make_pair(r, j));
      }
  Compressor z;
  std::vector<char> data(m.chunk_size);
  for (std::uint32_t r = 0; r < m.regions.size(); ++r) {
    const auto& mr = m.regions[r];
    const detail::ManifestRegion* br = nullptr;
    if (b)
      for (auto& x : b->regions)
        if (x.name == mr.name && x.size == mr.size && b->chunk_size == m.chunk_size && b->paged == m.paged) br = &x;
    std::uint64_t run = 0, run_start = 0;
    auto flush_run = [&] {
      if (!run) return;
      Buf x;
      x.u32(r);
      x.u64(run_start);
      x.u64(run);
      w.record(kInherit, x.b);
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
      Buf x;
      x.u32(r);
      x.u64(j);
      if (m.zero_chunk(i)) {
        x.hash(c.hash);
        x.u32(c.length);
        w.record(kZero, x.b);
        continue;
      }
      if (auto f = in_base.find(c.hash); f != in_base.end()) {
        x.u32(f->second.first);
        x.u64(f->second.second);
        x.hash(c.hash);
        w.record(kCopy, x.b);
        ++st.chunks_skipped;
        continue;
      }
      detail::read_chunk(*si.packs, detail::view_of(m, i), data.data(), "snapshot '" + it.ref() + "'");
      if (pageable && br && b->chunks[br->first_chunk + j].length == c.length && b->trusted(br->first_chunk + j)) {
        const std::uint64_t *th = m.hashes_of(i), *bh = b->hashes_of(br->first_chunk + j);
        std::vector<std::uint32_t> diff;
        for (std::uint32_t p = 0; p < m.pages_of(i); ++p)
          if (th[p] != bh[p]) diff.push_back(p);
        if (diff.size() * 2 <= m.pages_of(i)) {
          x.hash(c.hash);
          x.u32(static_cast<std::uint32_t>(diff.size()));
          std::string pages;
          for (auto p : diff) {
            x.u32(p);
            std::uint64_t off = std::uint64_t{p} * kPageSize;
            pages.append(data.data() + off, std::min<std::uint64_t>(kPageSize, c.length - off));
          }
          z.put(x, pages.data(), pages.size(), opt.level, st);
          w.record(kPages, x.b);
          continue;
        }
      }
      x.hash(c.hash);
      z.put(x, data.data(), c.length, opt.level, st);
      w.record(kChunk, x.b);
    }
    flush_run();
  }
  Buf e;
  e.hash(fingerprint(m));
  e.u64(m.chunks.size());
  w.record(kSnapshotEnd, e.b);
  st.logical_bytes += m.logical_bytes();
  st.refs.push_back(it.ref());
}

Stats send_with(const Store& store, const std::string& ref, int fd, const Options& opt, const std::vector<std::string>& bases) {
  auto t0 = std::chrono::steady_clock::now();
  std::vector<Item> items = items_of(store, ref);
  Stats st;
  Progressor prog{opt.progress};
  for (auto& it : items) prog.total += load(it.store, it.session, it.name).logical_bytes();
  Writer w{fd};
  char head[16];
  std::memcpy(head, kMagic, 8);
  std::uint32_t v = kVersion, flags = 0;
  std::memcpy(head + 8, &v, 4);
  std::memcpy(head + 12, &flags, 4);
  w.raw(head, 16);
  for (std::size_t k = 0; k < items.size(); ++k) send_item(items[k], bases[k], w, opt, st, prog);
  Buf end;
  end.u32(static_cast<std::uint32_t>(items.size()));
  w.record(kStreamEnd, end.b);
  st.base = bases.empty() ? "" : bases.back();
  st.wire_bytes = w.bytes;
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.compression_ratio = st.wire_bytes ? static_cast<double>(st.data_bytes) / static_cast<double>(std::max<std::uint64_t>(1, st.wire_bytes)) : 1;
  return st;
}

// The base names for each item of `ref` given the user's --base.
std::vector<std::string> bases_for(const std::vector<Item>& items, const std::string& ref, const std::string& base) {
  std::vector<std::string> out;
  const bool is_proc = split_ref(ref).first == proc::kImageSession;
  for (auto& it : items) {
    if (base.empty()) {
      out.emplace_back();
      continue;
    }
    std::string b = is_proc && it.session != proc::kImageSession ? proc::kHeapPrefix + base : base;
    if (!has_snapshot(it.store, it.session, b))
      throw Error(Errc::not_found, "base snapshot '" + it.session + "/" + b + "' does not exist here; give a base both sides hold");
    out.push_back(b);
  }
  return out;
}

// ---- receiving -------------------------------------------------------------
//
// Every chunk is checked against its XXH3-128 as it arrives and goes straight
// into the store through a SnapshotWriter, so a receive needs memory for one
// chunk, not for the snapshot. The WriteBatch holds the writers' lock from the
// stream's header to its end; nothing is published before the whole stream
// has arrived and been checked, so a stream cut off or damaged leaves the
// store as it was (the space it used is given back).

struct Incoming {
  std::string session, name, label, base;
  std::uint32_t chunk_size = 0;  // the stream's (the store's may differ)
  bool paged = true;
  struct Region {
    std::string name;
    std::uint64_t size = 0;
    bool sdk_owned = false;
    std::uint64_t chunks = 0;     // stream chunks declared
    std::vector<Hash128> hashes;  // of the stream chunks arrived so far (they arrive in order)
    std::size_t first = 0;        // its first chunk in the writer's manifest
  };
  std::vector<Region> regions;
  std::optional<Manifest> b;  // the base, here
  std::uint64_t logical = 0;
  Hash128 fingerprint;  // as the stream declared it (checked against what arrived)
  std::unique_ptr<detail::SnapshotWriter> writer;
  std::unique_ptr<detail::SnapshotWriter::Lane> lane;
  // Stream chunks smaller than the store's: the store chunk being put together.
  std::vector<char> pending;
  std::size_t pending_chunk = SIZE_MAX;
  std::uint64_t pending_have = 0;
};

std::string take_data(Parse& p, std::string& scratch, ZSTD_DCtx* dctx) {
  std::uint8_t codec = p.u8();
  std::uint32_t raw = p.u32(), len = p.u32();
  const char* d = p.take(len);
  if (raw > (16u << 20)) bad_stream("a chunk claims " + std::to_string(raw) + " bytes");
  if (codec == kRaw) {
    if (len != raw) bad_stream("an uncompressed chunk's lengths disagree");
    return std::string(d, len);
  }
  if (codec != kZstd) bad_stream("unknown compression " + std::to_string(codec));
  scratch.resize(raw);
  std::size_t n = ZSTD_decompressDCtx(dctx, scratch.data(), raw, d, len);
  if (ZSTD_isError(n) || n != raw) bad_stream("a chunk does not decompress");
  return scratch;
}

Hash128 content_hash(const char* data, std::size_t n, bool paged) {
  if (!paged) return detail::hash128(data, n);
  std::vector<std::uint64_t> ph(detail::pages_in(n));
  detail::hash_pages(data, n, ph.data());
  return detail::tree_hash(ph.data(), ph.size());
}

// Stores the checked bytes of stream chunk j of region r (`len` bytes).
void put_data(Incoming& in, const Incoming::Region& r, std::uint64_t j, const char* data, std::uint32_t len) {
  const std::uint32_t store_chunk = in.writer->chunk_size();
  const std::uint64_t at = j * in.chunk_size;  // region offset
  if (in.chunk_size == store_chunk) {
    in.lane->put_whole(r.first + j, data);
    return;
  }
  if (in.chunk_size > store_chunk) {  // cut into the store's chunks
    for (std::uint64_t off = 0; off < len; off += store_chunk) in.lane->put_whole(r.first + (at + off) / store_chunk, data + off);
    return;
  }
  // Smaller: the pieces of one store chunk arrive one after the other.
  const std::size_t chunk = r.first + at / store_chunk;
  const std::uint64_t off = at % store_chunk;
  if (in.pending_chunk == SIZE_MAX) {
    in.pending_chunk = chunk;
    in.pending_have = 0;
    in.pending.resize(store_chunk);
  }
  if (in.pending_chunk != chunk || in.pending_have != off)
    bad_stream("chunks of region '" + r.name + "' arrive out of order, which a store with another chunk size cannot take");
  std::memcpy(in.pending.data() + off, data, len);
  in.pending_have += len;
  if (in.pending_have == in.writer->manifest().chunks[chunk].length) {
    in.lane->put_whole(chunk, in.pending.data());
    in.pending_chunk = SIZE_MAX;
  }
}

// The base chunk `bi` of the base, checked, into `to`.
Hash128 read_base(Incoming& in, StoreImpl& si, std::size_t bi, char* to) {
  detail::read_chunk(*si.packs, detail::view_of(*in.b, bi), to, "base snapshot '" + in.session + "/" + in.base + "'");
  return in.b->chunks[bi].hash;
}

// Chunk j of region r is base chunk bi: referenced when the writer took the
// base, else read and stored again.
void take_from_base(Incoming& in, StoreImpl& si, const Incoming::Region& r, std::uint64_t j, std::size_t bi, std::vector<char>& buf) {
  if (in.writer->base() && in.b->trusted(bi)) {
    in.writer->inherit(r.first + j, bi);
    return;
  }
  buf.resize(in.b->chunks[bi].length);
  read_base(in, si, bi, buf.data());
  put_data(in, r, j, buf.data(), in.b->chunks[bi].length);
}

// Reads one snapshot's records after its kSnapshot record; checks everything.
void read_item(Incoming& in, Reader& rd, StoreImpl& si, Stats& st) {
  std::unique_ptr<ZSTD_DCtx, decltype(&ZSTD_freeDCtx)> dctx(ZSTD_createDCtx(), ZSTD_freeDCtx);
  std::string payload, scratch;
  std::vector<char> buf;
  auto region_at = [&](Parse& p, std::uint64_t& j) -> Incoming::Region& {
    std::uint32_t r = p.u32();
    j = p.u64();
    if (r >= in.regions.size()) bad_stream("a chunk names region " + std::to_string(r) + " of " + std::to_string(in.regions.size()));
    auto& reg = in.regions[r];
    if (j >= reg.chunks) bad_stream("a chunk lies past the end of region '" + reg.name + "'");
    if (j < reg.hashes.size()) bad_stream("chunk " + std::to_string(j) + " of region '" + reg.name + "' arrives twice");
    if (j != reg.hashes.size())
      bad_stream("chunk " + std::to_string(j) + " of region '" + reg.name + "' arrives before chunk " + std::to_string(reg.hashes.size()));
    return reg;
  };
  auto chunk_len = [&](const Incoming::Region& r, std::uint64_t j) {
    return static_cast<std::uint32_t>(std::min<std::uint64_t>(in.chunk_size, r.size - j * in.chunk_size));
  };
  auto base_region = [&](const std::string& name) -> const detail::ManifestRegion* {
    if (!in.b) return nullptr;
    for (auto& x : in.b->regions)
      if (x.name == name) return &x;
    return nullptr;
  };
  // Chunk j of base region x, of `len` bytes.
  auto base_chunk = [&](std::uint32_t x, std::uint64_t j, std::uint32_t len) -> std::size_t {
    if (!in.b || x >= in.b->regions.size() || j >= in.b->regions[x].chunk_count) bad_stream("a chunk refers to a base chunk that does not exist");
    std::size_t i = in.b->regions[x].first_chunk + j;
    if (in.b->chunks[i].length != len) bad_stream("a chunk refers to a base chunk of another size");
    return i;
  };
  for (;;) {
    Kind k = rd.record(payload);
    Parse p(payload);
    if (k == kSnapshotEnd) {
      Hash128 fp = p.hash();
      std::uint64_t count = p.u64();
      Manifest shape;  // the declared content, for its fingerprint
      shape.chunk_size = in.chunk_size;
      shape.paged = in.paged;
      std::uint64_t total = 0;
      for (auto& r : in.regions) {
        shape.regions.push_back({r.name, r.size, false, 0, 0});
        if (r.hashes.size() != r.chunks) bad_stream("chunk " + std::to_string(r.hashes.size()) + " of region '" + r.name + "' is missing");
        for (auto& h : r.hashes) shape.chunks.push_back({h, 0, 0, 0});
        total += r.chunks;
      }
      if (count != total || fingerprint(shape) != fp) bad_stream("the snapshot's content does not match its fingerprint");
      in.fingerprint = fp;
      in.lane->finish();
      // What is stored must be what was sent (same chunking: compare).
      if (in.chunk_size == in.writer->chunk_size() && in.paged && fingerprint(in.writer->manifest()) != fp)
        throw Error(Errc::io, "snapshot '" + in.session + "/" + in.name + "' would be stored with other content than sent; "
                              "send it again — nothing was stored");
      return;
    }
    std::uint64_t j = 0;
    switch (k) {
      case kChunk: {
        auto& r = region_at(p, j);
        Hash128 h = p.hash();
        std::string d = take_data(p, scratch, dctx.get());
        if (d.size() != chunk_len(r, j)) bad_stream("chunk " + std::to_string(j) + " of region '" + r.name + "' has the wrong length");
        if (content_hash(d.data(), d.size(), in.paged) != h)
          bad_stream("chunk " + std::to_string(j) + " of region '" + r.name + "' fails its XXH3-128 checksum");
        put_data(in, r, j, d.data(), static_cast<std::uint32_t>(d.size()));
        r.hashes.push_back(h);
        st.data_bytes += d.size();
        break;
      }
      case kPages: {
        auto& r = region_at(p, j);
        Hash128 h = p.hash();
        std::uint32_t n = p.u32();
        const std::uint32_t len = chunk_len(r, j), pages = detail::pages_in(len);
        if (n > pages) bad_stream("a page list is longer than its chunk");
        std::vector<std::uint32_t> list(n);
        for (std::uint32_t x = 0; x < n; ++x) {
          list[x] = p.u32();
          if (list[x] >= pages || (x > 0 && list[x] <= list[x - 1])) bad_stream("a page list is out of order");
        }
        std::string d = take_data(p, scratch, dctx.get());
        const detail::ManifestRegion* br = base_region(r.name);
        if (!br || !in.paged || !in.b->paged || br->size != r.size || in.b->chunk_size != in.chunk_size)
          bad_stream("pages arrive for a chunk with no base to patch");
        const std::size_t bi = base_chunk(static_cast<std::uint32_t>(br - in.b->regions.data()), j, len);
        // Where each page's bytes are in the record.
        std::vector<const char*> page_at(pages, nullptr);
        std::uint64_t off = 0;
        for (auto x : list) {
          std::uint64_t pl = std::min<std::uint64_t>(kPageSize, len - std::uint64_t{x} * kPageSize);
          if (off + pl > d.size()) bad_stream("a page list carries too few bytes");
          page_at[x] = d.data() + off;
          off += pl;
        }
        if (off != d.size()) bad_stream("a page list carries too many bytes");
        const std::size_t i = r.first + j;
        if (in.writer->base() && in.b->trusted(bi) && detail::store_pages_apart(*in.b, bi, list.data(), list.size(), pages)) {
          // Stored as the base's chunk with these pages apart: only the pages
          // are read, and the chunk's hash comes from the page hashes.
          in.writer->plan_patch(i, bi, n);
          in.lane->put_patch(i, list.data(), list.size(), [&](std::uint32_t x) { return page_at[x]; }, nullptr);
          if (in.writer->manifest().chunks[i].hash != h)
            bad_stream("chunk " + std::to_string(j) + " of region '" + r.name + "' fails its XXH3-128 checksum");
        } else {
          // Put together whole: the base's bytes, then the pages.
          buf.resize(len);
          read_base(in, si, bi, buf.data());
          for (auto x : list)
            std::memcpy(buf.data() + std::uint64_t{x} * kPageSize, page_at[x], std::min<std::uint64_t>(kPageSize, len - std::uint64_t{x} * kPageSize));
          if (content_hash(buf.data(), len, true) != h)
            bad_stream("chunk " + std::to_string(j) + " of region '" + r.name + "' fails its XXH3-128 checksum");
          put_data(in, r, j, buf.data(), len);
        }
        r.hashes.push_back(h);
        st.data_bytes += d.size();
        break;
      }
      case kZero: {
        auto& r = region_at(p, j);
        Hash128 h = p.hash();
        std::uint32_t len = p.u32();
        if (len != chunk_len(r, j) || !(in.paged ? detail::is_zero_tree(h, len) : detail::is_zero_chunk(h, len)))
          bad_stream("an all-zero chunk has the wrong checksum or length");
        if (in.chunk_size == in.writer->chunk_size()) {
          in.writer->zero(r.first + j);
        } else {
          buf.assign(len, 0);
          put_data(in, r, j, buf.data(), len);
        }
        r.hashes.push_back(h);
        break;
      }
      case kCopy: {
        auto& r = region_at(p, j);
        std::uint32_t brx = p.u32();
        std::uint64_t bj = p.u64();
        Hash128 h = p.hash();
        if (!in.b || in.b->chunk_size != in.chunk_size || in.b->paged != in.paged) bad_stream("a chunk is copied from a base of another kind");
        const std::size_t bi = base_chunk(brx, bj, chunk_len(r, j));
        if (in.b->chunks[bi].hash != h) bad_stream("a chunk copied from the base has another checksum");
        take_from_base(in, si, r, j, bi, buf);
        r.hashes.push_back(h);
        ++st.chunks_skipped;
        break;
      }
      case kInherit: {
        std::uint32_t rx = p.u32();
        std::uint64_t first = p.u64(), count = p.u64();
        if (rx >= in.regions.size()) bad_stream("a run names a region that does not exist");
        auto& r = in.regions[rx];
        const detail::ManifestRegion* br = base_region(r.name);
        if (!br || br->size != r.size || in.b->chunk_size != in.chunk_size || in.b->paged != in.paged)
          bad_stream("chunks are taken from a base region '" + r.name + "' that does not match");
        if (first > r.chunks || count > r.chunks - first) bad_stream("a run lies past the end of its region");
        if (first != r.hashes.size()) bad_stream("a run of region '" + r.name + "' arrives out of order");
        for (std::uint64_t x = first; x < first + count; ++x) {
          r.hashes.push_back(in.b->chunks[br->first_chunk + x].hash);
          if (!in.b->trusted(br->first_chunk + x))
            throw Error(Errc::corrupt, "base snapshot '" + in.session + "/" + in.base + "' is damaged here; run `dvr verify`, then send without a base");
          take_from_base(in, si, r, x, br->first_chunk + x, buf);
        }
        st.chunks_skipped += count;
        break;
      }
      default:
        bad_stream("unexpected record kind " + std::to_string(k));
    }
  }
}

// Reads the kSnapshot record's fields and starts the snapshot's writer.
void begin_item(Incoming& in, const std::string& payload, detail::WriteBatch& batch, const std::string& session_override) {
  StoreImpl& si = batch.store();
  Parse p(payload);
  in.session = p.str();
  if (!session_override.empty()) in.session = session_override;
  in.name = p.str();
  in.label = p.str();
  (void)p.str();  // the parent there; here the base becomes the parent
  (void)p.u64();  // time there
  in.chunk_size = p.u32();
  in.paged = p.u8() != 0;
  std::uint32_t n = p.u32();
  detail::check_name("session", in.session);
  detail::check_name("snapshot", in.name);
  if (in.chunk_size < 4096 || in.chunk_size > (16u << 20) || (in.chunk_size & (in.chunk_size - 1))) bad_stream("bad chunk size");
  if (n == 0 || n > 65536) bad_stream("bad region count");
  for (std::uint32_t k = 0; k < n; ++k) {
    Incoming::Region r;
    r.name = p.str();
    r.size = p.u64();
    r.sdk_owned = p.u8() != 0;
    detail::check_name("region", r.name);
    if (r.size == 0 || r.size > (1ull << 46)) bad_stream("region '" + r.name + "' has an impossible size");
    for (auto& other : in.regions)
      if (other.name == r.name) bad_stream("region '" + r.name + "' is declared twice");
    r.chunks = (r.size + in.chunk_size - 1) / in.chunk_size;
    in.logical += r.size;
    in.regions.push_back(std::move(r));
  }
  in.base = p.str();
  Hash128 bfp = p.hash();
  // The snapshot's tables (about 64 bytes a chunk of this store, 8 a page,
  // untouched until its data arrives) must fit in memory.
  static const std::uint64_t ram = static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  const std::uint64_t tables = in.logical / si.chunk_size * 64 + in.regions.size() * 256;
  if (tables > ram / 4)
    throw Error(Errc::no_space, "the stream's snapshot '" + in.session + "/" + in.name + "' declares " + std::to_string(in.logical >> 20) +
                                    " MiB, whose tables alone would need " + std::to_string(tables >> 20) + " MiB of this machine's " +
                                    std::to_string(ram >> 20) + " MiB of memory; nothing was stored");
  if (detail::path_exists(si.manifest_path(in.session, in.name)))
    throw Error(Errc::already_exists, "snapshot '" + in.session + "/" + in.name + "' exists already in store " + si.path +
                                          "; remove it first (`dvr rm`) to receive it again — nothing was stored");
  if (!in.base.empty()) {
    if (!detail::valid_name(in.base) || !detail::path_exists(si.manifest_path(in.session, in.base)))
      throw Error(Errc::not_found, "the stream is relative to snapshot '" + in.session + "/" + in.base + "', which store " + si.path +
                                       " does not hold; send it without --base (or with a base both sides hold) — nothing was stored");
    in.b = si.load_manifest(in.session, in.base);
    if (fingerprint(*in.b) != bfp)
      throw Error(Errc::not_found, "snapshot '" + in.session + "/" + in.base + "' in store " + si.path +
                                              " differs from the sender's base of that name; send without --base — nothing was stored");
  }
  in.writer = std::make_unique<detail::SnapshotWriter>(batch, in.session, in.name, detail::WriterOptions{.label = in.label, .parent = in.base});
  for (auto& r : in.regions) {
    r.first = in.writer->manifest().chunks.size();
    in.writer->add_region(r.name, r.size, r.sdk_owned);
  }
  in.writer->seal();
  in.writer->use_base(in.b ? &*in.b : nullptr);
  in.lane = std::make_unique<detail::SnapshotWriter::Lane>(*in.writer, in.logical, false);
}

Stats receive_stream(Store& store, Reader& rd, const ReceiveOptions& options = {}) {
  auto t0 = std::chrono::steady_clock::now();
  char head[16];
  rd.raw(head, 8);
  if (std::memcmp(head, kMagic, 8) != 0)
    throw Error(Errc::corrupt, "this is not a Memory DVR stream (bad magic); nothing was stored");
  rd.raw(head + 8, 8);
  std::uint32_t v;
  std::memcpy(&v, head + 8, 4);
  if (v != kVersion)
    throw Error(v > kVersion ? Errc::unsupported : Errc::corrupt,
                "the stream has format version " + std::to_string(v) + "; this dvr reads version " + std::to_string(kVersion) +
                    (v > kVersion ? " (upgrade dvr on this side)" : "") + "; nothing was stored");
  Stats st;
  detail::WriteBatch batch(StoreAccess::impl(store));
  std::vector<std::unique_ptr<Incoming>> items;
  std::string payload;
  for (;;) {
    Kind k = rd.record(payload);
    if (k == kStreamEnd) {
      Parse p(payload);
      if (p.u32() != items.size()) bad_stream("the stream's snapshot count does not match");
      break;
    }
    if (k != kSnapshot) bad_stream("a record arrives outside a snapshot");
    if (!options.session.empty() && !items.empty()) bad_stream("it holds several snapshots, but one session was asked for");
    auto in = std::make_unique<Incoming>();
    Parse peek(payload);
    std::string session = peek.str(), name = peek.str();
    if (!options.session.empty()) session = options.session;
    for (auto& q : items)
      if (q->session == session && q->name == name) bad_stream("a snapshot arrives twice");
    begin_item(*in, payload, batch, options.session);
    items.push_back(std::move(in));
    read_item(*items.back(), rd, batch.store(), st);
  }
  if (items.empty()) bad_stream("it holds no snapshot");
  // Everything checked: publish, heaps first, the process images last; all
  // or nothing.
  std::vector<detail::SnapshotWriter*> writers;
  for (auto& in : items) writers.push_back(in->writer.get());
  for (const SnapshotInfo& info : batch.publish(writers)) {
    st.stored_bytes += info.stored_bytes;
    st.refs.push_back(info.session + "/" + info.name);
  }
  for (auto& in : items) {
    st.logical_bytes += in->logical;
    for (auto& r : in->regions) st.chunks += r.chunks;
  }
  st.base = items.back()->base;
  st.wire_bytes = rd.bytes;
  st.compression_ratio = static_cast<double>(st.data_bytes) / static_cast<double>(std::max<std::uint64_t>(1, st.wire_bytes));
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

// ---- negotiation -------------------------------------------------------------
//
// sender -> receiver: kNegotiateMagic, u32 length, text:
//   "item SESSION NAME\n" then "have BASE FINGERPRINT-HEX\n" for candidate bases (newest first)
// receiver -> sender: u32 length, text: one line per item: "base NAME", "none", or
//   "exists" / "error MESSAGE" (the sender stops with that message)
// then the sender sends the stream (with the chosen bases), and the receiver
// answers u32 length + "ok JSON" or "error MESSAGE".

void send_text(int fd, const std::string& s) {
  std::uint32_t n = static_cast<std::uint32_t>(s.size());
  write_fd(fd, reinterpret_cast<const char*>(&n), 4);
  write_fd(fd, s.data(), s.size());
}

std::string recv_text(int fd) {
  char b[4];
  if (!read_fd(fd, b, 4, true)) throw Error(Errc::io, "the other end closed the connection (see its error message)");
  std::uint32_t n;
  std::memcpy(&n, b, 4);
  if (n > (16u << 20)) throw Error(Errc::corrupt, "the other end sent a malformed answer");
  std::string s(n, '\0');
  read_fd(fd, s.data(), n);
  return s;
}

std::string hex(const Hash128& h) { return detail::to_hex(h); }

std::string stats_json(const Stats& st) {
  std::ostringstream o;
  o << "{\"stored_bytes\":" << st.stored_bytes << ",\"chunks\":" << st.chunks << ",\"chunks_skipped\":" << st.chunks_skipped << "}";
  return o.str();
}

}  // namespace

Stats send(const Store& store, const std::string& ref, int fd, const Options& options) {
  std::vector<Item> items = items_of(store, ref);
  return send_with(store, ref, fd, options, bases_for(items, ref, options.base));
}

Stats receive(Store& store, int fd, const ReceiveOptions& options) {
  Reader rd{fd};
  return receive_stream(store, rd, options);
}

Stats send_negotiated(const Store& store, const std::string& ref, int in, int out, const Options& options) {
  std::vector<Item> items = items_of(store, ref);
  std::string hello;
  for (auto& it : items) {
    hello += "item " + it.session + " " + it.name + "\n";
    auto snaps = it.store.list(it.session);
    std::sort(snaps.begin(), snaps.end(), [](const SnapshotInfo& a, const SnapshotInfo& b) { return a.time_ns > b.time_ns; });
    int n = 0;
    for (auto& s : snaps) {
      if (s.damaged || s.name == it.name || n >= 32) continue;
      if (!options.base.empty()) {  // only the base asked for
        std::string want = split_ref(ref).first == proc::kImageSession && it.session != proc::kImageSession ? proc::kHeapPrefix + options.base
                                                                                                            : options.base;
        if (s.name != want) continue;
      }
      try {
        hello += "have " + s.name + " " + hex(fingerprint(load(it.store, it.session, s.name))) + "\n";
        ++n;
      } catch (const Error&) {
      }
    }
  }
  write_fd(out, kNegotiateMagic, 8);
  send_text(out, hello);
  std::istringstream answer(recv_text(in));
  std::vector<std::string> bases;
  std::string line;
  for (auto& it : items) {
    if (!std::getline(answer, line)) throw Error(Errc::io, "the receiver gave no answer for " + it.ref());
    if (line.rfind("error ", 0) == 0) throw Error(Errc::io, "the receiver refused: " + line.substr(6));
    if (line == "exists")
      throw Error(Errc::already_exists, "the receiving store holds snapshot '" + it.ref() + "' already; remove it there first — nothing was sent");
    std::string b = line.rfind("base ", 0) == 0 ? line.substr(5) : "";
    // Only a base that was offered for this item.
    if (!b.empty() && hello.find("item " + it.session + " " + it.name + "\n") != std::string::npos) {
      auto from = hello.find("item " + it.session + " " + it.name + "\n");
      auto to = hello.find("item ", from + 5);
      std::string offered = hello.substr(from, to == std::string::npos ? std::string::npos : to - from);
      if (offered.find("\nhave " + b + " ") == std::string::npos) throw Error(Errc::corrupt, "the receiver chose a base that was not offered");
    }
    bases.push_back(b);
  }
  if (!options.base.empty() && bases.back().empty())
    throw Error(Errc::not_found, "the receiving store does not hold base '" + options.base + "' with the same content; push without --base");
  Stats st = send_with(store, ref, out, options, bases);
  std::string done = recv_text(in);
  if (done.rfind("error ", 0) == 0) throw Error(Errc::io, "the receiver failed: " + done.substr(6));
  // "ok {json}": the receiver's figures.
  auto grab = [&](const char* key) -> std::uint64_t {
    auto k = done.find(std::string("\"") + key + "\":");
    return k == std::string::npos ? 0 : std::strtoull(done.c_str() + k + std::strlen(key) + 3, nullptr, 10);
  };
  st.stored_bytes = grab("stored_bytes");
  return st;
}

Stats receive_negotiated(Store& store, int in, int out) {
  char magic[8];
  if (!read_fd(in, magic, 8, true))
    throw Error(Errc::io, "the sending side ended before the transfer started (its message is above)");
  if (std::memcmp(magic, kNegotiateMagic, 8) != 0)
    throw Error(Errc::corrupt, "the sender does not speak the Memory DVR negotiation (is it `dvr send --negotiate`?)");
  std::istringstream hello(recv_text(in));
  std::string answer, line, session, name;
  bool chosen = false;
  auto close_item = [&] {
    if (!session.empty() && !chosen) answer += "none\n";
  };
  std::string error;
  while (std::getline(hello, line)) {
    std::istringstream f(line);
    std::string word;
    f >> word;
    if (word == "item") {
      close_item();
      f >> session >> name;
      chosen = false;
      try {
        detail::check_name("session", session);
        detail::check_name("snapshot", name);
        if (has_snapshot(store, session, name)) {
          answer += "exists\n";
          chosen = true;
        }
      } catch (const Error& e) {
        answer += std::string("error ") + e.what() + "\n";
        chosen = true;
      }
    } else if (word == "have" && !chosen) {
      std::string b, fp;
      f >> b >> fp;
      try {
        if (has_snapshot(store, session, b) && hex(fingerprint(load(store, session, b))) == fp) {
          answer += "base " + b + "\n";
          chosen = true;
        }
      } catch (const Error&) {
      }
    }
  }
  close_item();
  send_text(out, answer);
  if (answer.find("exists\n") != std::string::npos)
    throw Error(Errc::already_exists, "refused the transfer: " + answer);
  if (answer.find("error ") != std::string::npos) throw Error(Errc::invalid_argument, "refused the transfer: " + answer);
  try {
    Reader rd{in};
    Stats st = receive_stream(store, rd);
    send_text(out, "ok " + stats_json(st));
    return st;
  } catch (const std::exception& e) {
    try {
      send_text(out, std::string("error ") + e.what());
    } catch (...) {
    }
    throw;
  }
}

}  // namespace dvr::transfer
