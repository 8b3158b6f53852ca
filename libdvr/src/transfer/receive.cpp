// Receiving streams straight into the store (docs/format.md, "Stream format").
#include <zstd.h>

#include <chrono>
#include <memory>
#include <optional>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/os.hpp"
#include "store/store_impl.hpp"
#include "transfer/stream.hpp"
#include "format/chunks.hpp"
#include "store/writer.hpp"
#include "base/progress.hpp"

#include <sys/stat.h>
#include <sys/statvfs.h>

namespace dvr::transfer {

using namespace internal;
using detail::kPageSize;
using detail::StoreImpl;

namespace {

// The smallest record that covers one chunk: a zero record (8 bytes of
// kind and length, 32 of payload, 8 of checksum).
constexpr std::uint64_t kMinChunkRecord = 48;

// Bytes free to this user on the file system of `dir`; 0 when unknown.
std::uint64_t free_bytes(const std::string& dir) {
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) return 0;
  return static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
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
  std::int64_t origin_time_ns = 0;  // the sender's origin time (0: unknown; then its arrival)
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
  bool pending_zero = false;  // every piece of the store chunk being put together so far came as a zero record

  Region& region_at(detail::Reader& p, std::uint64_t& j);
  std::uint32_t chunk_len(const Region& r, std::uint64_t j) const;
  const detail::ManifestRegion* base_region(const std::string& region) const;
  // Chunk j of base region x, of `len` bytes.
  std::size_t base_chunk(std::uint32_t x, std::uint64_t j, std::uint32_t len) const;
};

// A record's data: in the payload when raw, else decompressed into `scratch`.
std::string_view take_data(detail::Reader& p, std::string& scratch, ZSTD_DCtx* dctx) {
  std::uint8_t codec = p.u8();
  std::uint32_t raw = p.u32(), len = p.u32();
  const char* d = p.take(len);
  if (raw > (16u << 20)) bad_stream("a chunk claims " + std::to_string(raw) + " bytes");
  if (codec == kRaw) {
    if (len != raw) bad_stream("an uncompressed chunk's lengths disagree");
    return {d, len};
  }
  if (codec != kZstd) bad_stream("unknown compression " + std::to_string(codec));
  scratch.resize(raw);
  std::size_t n = ZSTD_decompressDCtx(dctx, scratch.data(), raw, d, len);
  if (ZSTD_isError(n) || n != raw) bad_stream("a chunk does not decompress");
  return {scratch.data(), raw};
}

Hash128 content_hash(const char* data, std::size_t n, bool paged) {
  if (!paged) return detail::hash128(data, n);
  std::vector<std::uint64_t> ph(detail::pages_in(n));
  detail::hash_pages(data, n, ph.data());
  return detail::tree_hash(ph.data(), ph.size());
}

// Stores the checked bytes of stream chunk j of region r (`len` bytes);
// data == nullptr: they are all zero (a zero record for a piece of a larger
// store chunk).
void put_data(Incoming& in, const Incoming::Region& r, std::uint64_t j, const char* data, std::uint32_t len) {
  const std::uint32_t store_chunk = in.writer->chunk_size();
  const std::uint64_t at = j * in.chunk_size;  // region offset
  if (in.chunk_size == store_chunk) {
    in.lane->put_whole(r.first + j, data);
    return;
  }
  if (in.chunk_size > store_chunk) {  // cut into the store's chunks
    for (std::uint64_t off = 0; off < len; off += store_chunk)
      in.lane->put_whole(r.first + (at + off) / store_chunk, data + off);
    return;
  }
  // Smaller: the pieces of one store chunk arrive one after the other.
  const std::size_t chunk = r.first + at / store_chunk;
  const std::uint64_t off = at % store_chunk;
  if (in.pending_chunk == SIZE_MAX) {
    in.pending_chunk = chunk;
    in.pending_have = 0;
    in.pending_zero = true;
    in.pending.resize(store_chunk);
  }
  if (in.pending_chunk != chunk || in.pending_have != off)
    bad_stream("chunks of region '" + r.name + "' arrive out of order, which a store with another chunk size cannot take");
  if (data)
    std::memcpy(in.pending.data() + off, data, len);
  else
    std::memset(in.pending.data() + off, 0, len);
  in.pending_zero = in.pending_zero && !data;
  in.pending_have += len;
  if (in.pending_have == in.writer->manifest().chunks[chunk].length) {
    // Every piece a zero record: zero, by constants rather than by hashing
    // zero memory.
    if (in.pending_zero)
      in.writer->zero(chunk);
    else
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

// Chunk j of region r, the next one of that region (they arrive in order).
Incoming::Region& Incoming::region_at(detail::Reader& p, std::uint64_t& j) {
  std::uint32_t r = p.u32();
  j = p.u64();
  if (r >= regions.size()) bad_stream("a chunk names region " + std::to_string(r) + " of " + std::to_string(regions.size()));
  auto& reg = regions[r];
  if (j >= reg.chunks) bad_stream("a chunk lies past the end of region '" + reg.name + "'");
  if (j < reg.hashes.size()) bad_stream("chunk " + std::to_string(j) + " of region '" + reg.name + "' arrives twice");
  if (j != reg.hashes.size())
    bad_stream("chunk " + std::to_string(j) + " of region '" + reg.name + "' arrives before chunk " + std::to_string(reg.hashes.size()));
  return reg;
}

std::uint32_t Incoming::chunk_len(const Region& r, std::uint64_t j) const {
  return static_cast<std::uint32_t>(std::min<std::uint64_t>(chunk_size, r.size - j * chunk_size));
}

const detail::ManifestRegion* Incoming::base_region(const std::string& region) const {
  if (!b) return nullptr;
  for (auto& x : b->regions)
    if (x.name == region) return &x;
  return nullptr;
}

std::size_t Incoming::base_chunk(std::uint32_t x, std::uint64_t j, std::uint32_t len) const {
  if (!b || x >= b->regions.size() || j >= b->regions[x].chunk_count) bad_stream("a chunk refers to a base chunk that does not exist");
  std::size_t i = b->regions[x].first_chunk + j;
  if (b->chunks[i].length != len) bad_stream("a chunk refers to a base chunk of another size");
  return i;
}

// What one snapshot's records need besides the snapshot itself.
struct RecordContext {
  StoreImpl& si;
  Stats& st;
  std::unique_ptr<ZSTD_DCtx, decltype(&ZSTD_freeDCtx)> dctx{ZSTD_createDCtx(), ZSTD_freeDCtx};
  std::string scratch;
  std::vector<char> buf;
};

// kChunk: a whole chunk's bytes.
void receive_chunk(Incoming& in, RecordContext& cx, detail::Reader& p) {
  auto& st = cx.st;
  auto& scratch = cx.scratch;
  auto dctx = cx.dctx.get();
  std::uint64_t j = 0;
  auto& r = in.region_at(p, j);
  Hash128 h = p.hash();
  std::string_view d = take_data(p, scratch, dctx);
  if (d.size() != in.chunk_len(r, j)) bad_stream("chunk " + std::to_string(j) + " of region '" + r.name + "' has the wrong length");
  // Chunked as the store chunks it: storing the chunk computes its hash, which
  // is checked right after (a mismatch fails the receive, and nothing stored
  // is published). Otherwise it is checked first.
  const bool hashed_by_store = in.paged && in.chunk_size == in.writer->chunk_size();
  if (!hashed_by_store && content_hash(d.data(), d.size(), in.paged) != h)
    bad_stream("chunk " + std::to_string(j) + " of region '" + r.name + "' fails its XXH3-128 checksum");
  put_data(in, r, j, d.data(), static_cast<std::uint32_t>(d.size()));
  if (hashed_by_store && in.writer->manifest().chunks[r.first + j].hash != h)
    bad_stream("chunk " + std::to_string(j) + " of region '" + r.name + "' fails its XXH3-128 checksum");
  r.hashes.push_back(h);
  st.data_bytes += d.size();
}

// kPages: a base chunk with some pages replaced.
void receive_pages(Incoming& in, RecordContext& cx, detail::Reader& p) {
  auto& st = cx.st;
  auto& si = cx.si;
  auto& buf = cx.buf;
  std::uint64_t j = 0;
  auto& r = in.region_at(p, j);
  Hash128 h = p.hash();
  std::uint32_t n = p.u32();
  const std::uint32_t len = in.chunk_len(r, j), pages = detail::pages_in(len);
  if (n > pages) bad_stream("a page list is longer than its chunk");
  std::vector<std::uint32_t> list(n);
  for (std::uint32_t x = 0; x < n; ++x) {
    list[x] = p.u32();
    if (list[x] >= pages)
      bad_stream("a page list names page " + std::to_string(list[x]) + " of a chunk of " + std::to_string(pages) + " pages");
    if (x > 0 && list[x] <= list[x - 1]) bad_stream("a page list is out of order");
  }
  std::string_view d = take_data(p, cx.scratch, cx.dctx.get());
  const detail::ManifestRegion* br = in.base_region(r.name);
  if (!br || !in.paged || !in.b->paged || br->size != r.size || in.b->chunk_size != in.chunk_size)
    bad_stream("pages arrive for a chunk with no base to patch");
  const std::size_t bi = in.base_chunk(static_cast<std::uint32_t>(br - in.b->regions.data()), j, len);
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
    in.lane->put_patch(
        i, list.data(), list.size(), [&](std::uint32_t x) { return page_at[x]; }, nullptr);
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
}

// kZero: an all-zero chunk.
void receive_zero(Incoming& in, RecordContext& cx, detail::Reader& p) {
  (void)cx;
  std::uint64_t j = 0;
  auto& r = in.region_at(p, j);
  Hash128 h = p.hash();
  std::uint32_t len = p.u32();
  if (len != in.chunk_len(r, j) || !(in.paged ? detail::is_zero_tree(h, len) : detail::is_zero_chunk(h, len)))
    bad_stream("an all-zero chunk has the wrong checksum or length");
  // Never by hashing zero memory (a record of 48 bytes may claim 16 MiB):
  // the store's chunks it covers are marked zero, whose hashes are constants.
  const std::uint32_t store_chunk = in.writer->chunk_size();
  const std::uint64_t at = j * in.chunk_size;  // region offset
  if (in.chunk_size >= store_chunk) {
    for (std::uint64_t off = 0; off < len; off += store_chunk)
      in.writer->zero(r.first + (at + off) / store_chunk);
  } else {
    put_data(in, r, j, nullptr, len);  // a piece of a store chunk: zero when every piece of it is
  }
  r.hashes.push_back(h);
}

// kCopy: the same bytes as a chunk of the base elsewhere.
void receive_copy(Incoming& in, RecordContext& cx, detail::Reader& p) {
  auto& st = cx.st;
  std::uint64_t j = 0;
  auto& r = in.region_at(p, j);
  std::uint32_t brx = p.u32();
  std::uint64_t bj = p.u64();
  Hash128 h = p.hash();
  if (!in.b || in.b->chunk_size != in.chunk_size || in.b->paged != in.paged) bad_stream("a chunk is copied from a base of another kind");
  const std::size_t bi = in.base_chunk(brx, bj, in.chunk_len(r, j));
  if (in.b->chunks[bi].hash != h) bad_stream("a chunk copied from the base has another checksum");
  take_from_base(in, cx.si, r, j, bi, cx.buf);
  r.hashes.push_back(h);
  ++st.chunks_skipped;
}

// kInherit: a run of chunks the same as the base's at the same place.
void receive_inherit(Incoming& in, RecordContext& cx, detail::Reader& p) {
  std::uint32_t rx = p.u32();
  std::uint64_t first = p.u64(), count = p.u64();
  if (rx >= in.regions.size()) bad_stream("a run names a region that does not exist");
  auto& r = in.regions[rx];
  const detail::ManifestRegion* br = in.base_region(r.name);
  if (!br || br->size != r.size || in.b->chunk_size != in.chunk_size || in.b->paged != in.paged)
    bad_stream("chunks are taken from a base region '" + r.name + "' that does not match");
  if (first > r.chunks || count > r.chunks - first) bad_stream("a run lies past the end of its region");
  if (first != r.hashes.size()) bad_stream("a run of region '" + r.name + "' arrives out of order");
  for (std::uint64_t x = first; x < first + count; ++x) {
    r.hashes.push_back(in.b->chunks[br->first_chunk + x].hash);
    if (!in.b->trusted(br->first_chunk + x))
      throw Error(Errc::corrupt, "base snapshot '" + in.session + "/" + in.base + "' is damaged here; run `dvr verify`, then send without a base");
    take_from_base(in, cx.si, r, x, br->first_chunk + x, cx.buf);
  }
  cx.st.chunks_skipped += count;
}

// kSnapshotEnd: every chunk arrived, and the whole matches its fingerprint.
void end_item(Incoming& in, detail::Reader& p) {
  Hash128 fp = p.hash();
  std::uint64_t count = p.u64();
  Manifest shape;  // the declared content, for its fingerprint
  shape.chunk_size = in.chunk_size;
  shape.paged = in.paged;
  std::uint64_t total = 0;
  for (auto& r : in.regions) {
    shape.regions.push_back({r.name, r.size, false, 0, 0});
    if (r.hashes.size() != r.chunks) bad_stream("chunk " + std::to_string(r.hashes.size()) + " of region '" + r.name + "' is missing");
    for (auto& h : r.hashes)
      shape.chunks.push_back({h, 0, 0, 0});
    total += r.chunks;
  }
  if (count != total || fingerprint(shape) != fp) bad_stream("the snapshot's content does not match its fingerprint");
  in.fingerprint = fp;
  in.lane->finish();
  // What is stored must be what was sent (same chunking: compare).
  if (in.chunk_size == in.writer->chunk_size() && in.paged && fingerprint(in.writer->manifest()) != fp)
    throw Error(Errc::io, "snapshot '" + in.session + "/" + in.name +
                              "' would be stored with other content than sent; "
                              "send it again — nothing was stored");
}

// Reads one snapshot's records after its kSnapshot record; checks everything.
void read_item(Incoming& in, RecordReader& rd, StoreImpl& si, Stats& st, detail::ProgressMeter& meter) {
  RecordContext cx{si, st};
  std::string payload;
  std::uint64_t seen = rd.bytes();
  // One for all the pack writes below (pages stored apart are one pwrite each).
  detail::FileSizeSignalGuard file_size_guard;
  for (;;) {
    if (rd.bytes() - seen >= (64u << 20)) {
      si.packs->drop_resident();  // base chunks read need not stay mapped here
      seen = rd.bytes();
    }
    Kind k = rd.record(payload);
    if (meter) {
      meter.advance_to(rd.bytes());
      meter.poll();  // a callback that throws abandons the stream: nothing is published
    }
    detail::Reader p = parse(payload);
    switch (k) {
      case kSnapshotEnd:
        end_item(in, p);
        return;
      case kChunk:
        receive_chunk(in, cx, p);
        break;
      case kPages:
        receive_pages(in, cx, p);
        break;
      case kZero:
        receive_zero(in, cx, p);
        break;
      case kCopy:
        receive_copy(in, cx, p);
        break;
      case kInherit:
        receive_inherit(in, cx, p);
        break;
      default:
        bad_stream("unexpected record kind " + std::to_string(k));
    }
  }
}

// Reads the kSnapshot record's fields and starts the snapshot's writer.
// `stream_left`: bytes of the stream after this record when known (a file), else 0.
void begin_item(Incoming& in, const std::string& payload, detail::WriteBatch& batch, const std::string& session_override,
                std::uint64_t max_logical, std::uint64_t stream_left) {
  StoreImpl& si = batch.store();
  detail::Reader p = parse(payload);
  in.session = p.str();
  if (!session_override.empty()) in.session = session_override;
  in.name = p.str();
  in.label = p.str();
  (void)p.str();  // the parent there; here the base becomes the parent
  in.origin_time_ns = static_cast<std::int64_t>(p.u64());  // when it was made there (its origin time); ordered here by arrival
  in.chunk_size = p.u32();
  in.paged = p.u8() != 0;
  std::uint32_t n = p.u32();
  // Names the stream carries are the sender's: one that is not valid is
  // damage (or a forgery), not a usage error of this side.
  auto stream_name = [](const char* kind, const std::string& name) {
    try {
      detail::check_name(kind, name);
    } catch (const Error& e) {
      bad_stream(e.what());
    }
  };
  if (session_override.empty())
    stream_name("session", in.session);
  else
    detail::check_name("session", in.session);  // the caller's --session: a usage error
  stream_name("snapshot", in.name);
  if (in.chunk_size < 4096 || in.chunk_size > (16u << 20) || (in.chunk_size & (in.chunk_size - 1))) bad_stream("bad chunk size");
  if (n == 0 || n > 65536) bad_stream("bad region count");
  for (std::uint32_t k = 0; k < n; ++k) {
    Incoming::Region r;
    r.name = p.str();
    r.size = p.u64();
    r.sdk_owned = p.u8() != 0;
    stream_name("region", r.name);
    if (r.size == 0 || r.size > (1ull << 46)) bad_stream("region '" + r.name + "' has an impossible size");
    for (auto& other : in.regions)
      if (other.name == r.name) bad_stream("region '" + r.name + "' is declared twice");
    r.chunks = (r.size + in.chunk_size - 1) / in.chunk_size;
    in.logical += r.size;
    in.regions.push_back(std::move(r));
  }
  in.base = p.str();
  Hash128 bfp = p.hash();
  if (!in.base.empty()) stream_name("base snapshot", in.base);
  // What the stream may make this side allocate and hash, bounded before
  // anything is (docs/migration.md, "Security model"): the logical size the
  // caller allows; the snapshot's tables (about 64 bytes a chunk of this
  // store and 8 a page, in memory; about 40 bytes a chunk in its manifest)
  // in a quarter of this machine's memory and in the store's free space;
  // and, for a stream whose length is known (a file), at least one record
  // (48 bytes or more) for every chunk its base cannot supply. Zero chunks
  // cost no hashing of zero memory (receive_zero).
  const std::string what = "the stream's snapshot '" + in.session + "/" + in.name + "' declares " + std::to_string(in.logical) + " bytes";
  if (max_logical && in.logical > max_logical)
    throw Error(Errc::invalid_argument, what + ", more than the " + std::to_string(max_logical) +
                                            " this receive allows (ReceiveOptions::max_logical_bytes); nothing was stored");
  std::uint64_t store_chunks = 0, stream_chunks = 0;
  for (auto& r : in.regions) {
    store_chunks += (r.size + si.chunk_size - 1) / si.chunk_size;
    stream_chunks += r.chunks;
  }
  if (detail::path_exists(si.manifest_path(in.session, in.name)))
    throw Error(Errc::already_exists, "snapshot '" + in.session + "/" + in.name + "' exists already in store " + si.path +
                                          "; remove it first (`" + detail::dvr_for(si.path) + " rm " + shell_word(in.session + "/" + in.name) + "`) to receive it again — nothing was stored");
  if (!in.base.empty()) {
    if (!detail::path_exists(si.manifest_path(in.session, in.base)))
      throw Error(Errc::not_found, "the stream is relative to snapshot '" + in.session + "/" + in.base + "', which store " + si.path +
                                       " does not hold; send it without --base (or with a base both sides hold) — nothing was stored");
    in.b = si.load_manifest(in.session, in.base);
    if (fingerprint(*in.b) != bfp)
      throw Error(Errc::not_found, "snapshot '" + in.session + "/" + in.base + "' in store " + si.path +
                                       " differs from the sender's base of that name; send without --base — nothing was stored");
  }
  if (stream_left) {
    std::uint64_t from_base = 0;  // chunks the base can supply, many with one record (kind 6)
    for (auto& r : in.regions)
      if (const detail::ManifestRegion* br = in.base_region(r.name); br && br->size == r.size && in.b->chunk_size == in.chunk_size)
        from_base += r.chunks;
    const std::uint64_t need = stream_chunks - from_base;
    if (need > stream_left / kMinChunkRecord)
      bad_stream("snapshot '" + in.session + "/" + in.name + "' declares " + std::to_string(stream_chunks) + " chunks (" + std::to_string(in.logical) +
                 " bytes), but only " + std::to_string(stream_left) + " bytes of the stream follow, and each chunk takes a record of at least " +
                 std::to_string(kMinChunkRecord));
  }
  static const std::uint64_t ram = static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  const std::uint64_t tables = store_chunks * 64 + (in.logical / kPageSize + store_chunks) * 8 + in.regions.size() * 256;
  if (const std::uint64_t free = free_bytes(si.path); free && store_chunks * 40 > free)
    throw Error(Errc::no_space, what + ", whose manifest alone would need " + std::to_string((store_chunks * 40) >> 20) + " MiB, more than the " +
                                    std::to_string(free >> 20) + " MiB free in store " + si.path + "; nothing was stored");
  if (tables > ram / 4)
    throw Error(Errc::no_space, "the stream's snapshot '" + in.session + "/" + in.name + "' declares " + std::to_string(in.logical >> 20) +
                                    " MiB, whose tables alone would need " + std::to_string(tables >> 20) + " MiB of this machine's " +
                                    std::to_string(ram >> 20) + " MiB of memory; nothing was stored");
  in.writer = std::make_unique<detail::SnapshotWriter>(batch, in.session, in.name, detail::WriterOptions{.label = in.label, .parent = in.base, .origin_time_ns = in.origin_time_ns, .own_buffers = true});
  for (auto& r : in.regions) {
    r.first = in.writer->manifest().chunks.size();
    in.writer->add_region(r.name, r.size, r.sdk_owned);
  }
  in.writer->seal();
  in.writer->use_base(in.b ? &*in.b : nullptr);
  // What the lane may store at most: every chunk takes whole pages of pack
  // space. The bytes themselves (in.logical) are not that when a region ends
  // inside a page, and pack blocks sized by them would start the next block
  // off a page boundary: every chunk placed there would be refused as
  // "impossible" by the manifest it was published in.
  std::uint64_t expected = 0;
  const std::uint64_t chunk = in.writer->chunk_size();  // a power of two, whole pages
  for (auto& r : in.regions)
    expected += r.size / chunk * chunk + detail::round_up_page(r.size % chunk);
  in.lane = std::make_unique<detail::SnapshotWriter::Lane>(*in.writer, expected, false);
}

}  // namespace

namespace internal {

std::uint64_t bytes_left(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return 0;
  const off_t at = ::lseek(fd, 0, SEEK_CUR);
  return at < 0 || at > st.st_size ? 0 : static_cast<std::uint64_t>(st.st_size - at);
}

Stats receive_stream(Store& store, RecordReader& rd, const ReceiveOptions& options, std::uint64_t stream_size) {
  auto t0 = std::chrono::steady_clock::now();
  char head[16];
  rd.raw(head, 8);
  if (std::memcmp(head, kMagic, 8) != 0) throw Error(Errc::corrupt, "this is not a Memory DVR stream (bad magic); nothing was stored");
  rd.raw(head + 8, 8);
  std::uint32_t v;
  std::memcpy(&v, head + 8, 4);
  if (v != kVersion)
    throw Error(v > kVersion ? Errc::unsupported : Errc::corrupt, "the stream has format version " + std::to_string(v) + "; this dvr reads version " +
                                                                      std::to_string(kVersion) + (v > kVersion ? " (upgrade dvr on this side)" : "") +
                                                                      "; nothing was stored");
  std::uint32_t flags;
  std::memcpy(&flags, head + 12, 4);
  const bool is_signed = (flags & kFlagSigned) != 0;
  if (!is_signed && !options.require_signature.empty())
    throw Error(Errc::permission, "the stream is not signed, and a signature by " + fingerprints(options.require_signature) +
                                      " is required (--require-signature); nothing was stored (the sender signs with `dvr export --sign KEY`)");
  if (is_signed) rd.expect_signature();  // the header's 16 bytes are in the hash already
  rd.start();  // records are read and checked ahead on the reader's thread from here
  Stats st;
  // Progress: bytes of the stream read, out of its size when known (a file);
  // else the total is 0 until the end. Reported between records, here.
  detail::ProgressMeter meter(options.progress, stream_size);
  detail::WriteBatch batch(detail::impl_of(store));
  std::vector<std::unique_ptr<Incoming>> items;
  std::string payload;
  for (;;) {
    Kind k = rd.record(payload);
    if (k == kStreamEnd) {
      detail::Reader p = parse(payload);
      if (p.u32() != items.size()) bad_stream("the stream's snapshot count does not match");
      break;
    }
    if (k != kSnapshot) bad_stream("a record arrives outside a snapshot");
    if (!options.session.empty() && !items.empty()) bad_stream("it holds several snapshots, but one session was asked for");
    auto in = std::make_unique<Incoming>();
    detail::Reader peek = parse(payload);
    std::string session = peek.str(), name = peek.str();
    if (!options.session.empty()) session = options.session;
    for (auto& q : items)
      if (q->session == session && q->name == name) bad_stream("a snapshot arrives twice");
    begin_item(*in, payload, batch, options.session, options.max_logical_bytes, stream_size > rd.bytes() ? stream_size - rd.bytes() : 0);
    items.push_back(std::move(in));
    read_item(*items.back(), rd, batch.store(), st, meter);
  }
  if (items.empty()) bad_stream("it holds no snapshot");
  // A signed stream: its signature, over every byte before it, before
  // anything is published (what was read lies in space given back on failure).
  if (is_signed) st.signed_by = check_signature(rd.signature(), rd.digest(), options.require_signature, "the stream").fingerprint();
  meter.advance_to(rd.bytes());
  meter.finish();  // before the commit: a callback that throws here still stores nothing
  // Everything checked: publish, heaps first, the process images last; all
  // or nothing.
  std::vector<detail::SnapshotWriter*> writers;
  for (auto& in : items)
    writers.push_back(in->writer.get());
  for (const SnapshotInfo& info : batch.publish(writers)) {
    st.stored_bytes += info.stored_bytes;
    st.refs.push_back(info.session + "/" + info.name);
  }
  for (auto& in : items) {
    st.logical_bytes += in->logical;
    for (auto& r : in->regions)
      st.chunks += r.chunks;
  }
  st.base = items.back()->base;
  st.wire_bytes = rd.bytes();
  st.compression_ratio = static_cast<double>(st.data_bytes) / static_cast<double>(std::max<std::uint64_t>(1, st.wire_bytes));
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace internal

Stats receive(Store& store, int fd, const ReceiveOptions& options) {
  const std::uint64_t size = bytes_left(fd);  // also bounds what the stream may declare (begin_item)
  RecordReader rd(fd);
  return receive_stream(store, rd, options, size);
}

Stats receive(Store& store, Channel& in, const ReceiveOptions& options) {
  try {
    RecordReader rd(in);
    return receive_stream(store, rd, options, 0);
  } catch (...) {
    in.abandon();  // the putter's next put() fails instead of waiting for a reader that is gone
    throw;
  }
}

}  // namespace dvr::transfer
