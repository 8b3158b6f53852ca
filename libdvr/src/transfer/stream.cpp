// The stream's framing and what a reference stands for (transfer/stream.hpp).
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/os.hpp"
#include "store/store_impl.hpp"
#include "store/reader.hpp"
#include "transfer/stream.hpp"

#include "dvr/proc.hpp"

namespace dvr::transfer::internal {

using detail::StoreImpl;

[[noreturn]] void bad_stream(const std::string& why) {
  throw Error(Errc::corrupt, "the stream is damaged: " + why + "; nothing was stored (send it again)");
}

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

bool read_fd(int fd, char* p, std::size_t n, bool eof_ok) {
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

void RecordWriter::record(Kind kind, const std::string& payload) {
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

Kind RecordReader::record(std::string& payload) {
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

bool has_snapshot(const Store& s, const std::string& session, const std::string& name) {
  for (auto& i : s.list(session))
    if (i.name == name) return true;
  return false;
}

std::vector<Item> items_of(const Store& store, const std::string& ref) {
  auto [session, name] = split_ref(ref);
  std::vector<Item> out;
  if (session == proc::kImageSession) {
    proc::ProcInfo p = proc::info(store, name);
    for (auto& h : p.heaps) {
      std::string snap = proc::kHeapPrefix + name;
      if (std::any_of(out.begin(), out.end(), [&](const Item& i) { return i.session == h.session; })) continue;
      // The heap snapshot is in this store when it came here by a transfer,
      // else in the heap's own store, whose locks are waited for as long as
      // this store's are (StoreOptions::lock_timeout of `store`).
      if (has_snapshot(store, h.session, snap))
        out.push_back({store, h.session, snap});
      else
        out.push_back({Store::open(h.store, {.create = false, .lock_timeout = detail::impl_of(store).lock_timeout}), h.session, snap});
    }
  }
  if (!has_snapshot(store, session, name) && session != proc::kImageSession) store.info(session, name);  // not_found
  out.push_back({store, session, name});
  return out;
}

Hash128 fingerprint(const Manifest& m) {
  detail::Writer b;
  b.u32(m.chunk_size);
  b.u8(m.paged ? 1 : 0);
  for (auto& r : m.regions) {
    b.str(r.name);
    b.u64(r.size);
  }
  for (auto& c : m.chunks)
    b.hash(c.hash);
  return detail::hash128(b.out.data(), b.out.size());
}

Manifest load(const Store& s, const std::string& session, const std::string& name) {
  StoreImpl& si = detail::impl_of(s);
  return detail::SnapshotReader(si).load(session, name);
}

}  // namespace dvr::transfer::internal
