// The stream format's internals shared by send, receive and the negotiation
// (docs/format.md, "Stream format"): constants, record framing over a file
// descriptor, what a reference stands for, and a snapshot's fingerprint.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/codec.hpp"
#include "base/hash.hpp"
#include "dvr/store.hpp"
#include "dvr/transfer.hpp"
#include "format/manifest.hpp"

namespace dvr::transfer::internal {

using detail::Hash128;
using detail::Manifest;

inline constexpr char kMagic[8] = {'D', 'V', 'R', 'S', 'T', 'R', 'M', '\0'};
inline constexpr std::uint32_t kVersion = 1;
inline constexpr char kNegotiateMagic[8] = {'D', 'V', 'R', 'N', 'E', 'G', '1', '\n'};
inline constexpr std::uint32_t kMaxRecord = 64u << 20;  // a chunk is at most 16 MiB, plus headers

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

/// Throws corrupt: "the stream is damaged: WHY; nothing was stored (send it again)".
[[noreturn]] void bad_stream(const std::string& why);

/// A reader over one record's payload whose errors say the stream is damaged.
inline detail::Reader parse(const std::string& payload) {
  return detail::Reader(payload, "the stream", "nothing was stored (send it again)", "a record is shorter than its fields");
}

/// Writes all n bytes (EINTR retried; EPIPE: the receiving end is gone).
void write_fd(int fd, const char* p, std::size_t n);
/// Reads exactly n bytes; false at a clean end of input before the first
/// byte when eof_ok, else a truncation is corrupt.
bool read_fd(int fd, char* p, std::size_t n, bool eof_ok = false);

/// Records out: [u32 kind][u32 length][payload][u64 XXH3-64 of the three before].
struct RecordWriter {
  int fd;
  std::uint64_t bytes = 0;
  void raw(const char* p, std::size_t n) {
    write_fd(fd, p, n);
    bytes += n;
  }
  void record(Kind kind, const std::string& payload);
};

/// Records in, each checked against its XXH3-64; at most kMaxRecord bytes.
struct RecordReader {
  int fd;
  std::uint64_t bytes = 0;
  std::string scratch;
  void raw(char* p, std::size_t n) {
    read_fd(fd, p, n);
    bytes += n;
  }
  Kind record(std::string& payload);
};

/// One snapshot a reference stands for, in the store that holds it.
struct Item {
  Store store;
  std::string session, name;
  std::string ref() const { return session + "/" + name; }
};

bool has_snapshot(const Store& s, const std::string& session, const std::string& name);
/// The snapshots REF stands for, heaps before the process images, so that a
/// receiver publishing them in order shows proc/NAME only once all is there.
std::vector<Item> items_of(const Store& store, const std::string& ref);
/// Content identity of a snapshot, independent of where its bytes are stored.
Hash128 fingerprint(const Manifest& m);
/// A manifest, read under the store's shared lock.
Manifest load(const Store& s, const std::string& session, const std::string& name);

// send.cpp / receive.cpp, for the negotiation.
Stats send_with(const Store& store, const std::string& ref, int fd, const Options& opt, const std::vector<std::string>& bases);
std::vector<std::string> bases_for(const std::vector<Item>& items, const std::string& ref, const std::string& base);
Stats receive_stream(Store& store, RecordReader& rd, const ReceiveOptions& options = {});

}  // namespace dvr::transfer::internal
