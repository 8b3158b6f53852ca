// The stream format's internals shared by send, receive and the negotiation
// (docs/format.md, "Stream format"): constants, record framing over a file
// descriptor, what a reference stands for, and a snapshot's fingerprint.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/codec.hpp"
#include "base/hash.hpp"
#include "dvr/store.hpp"
#include "dvr/transfer.hpp"
#include "format/manifest.hpp"
#include "transfer/sign.hpp"

struct ZSTD_CCtx_s;  // zstd.h's ZSTD_CCtx

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
  kSignature = 9,  // after kStreamEnd, in a stream whose header has kFlagSigned
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
/// write_fd of several buffers in order (writev).
void write_fdv(int fd, struct iovec* iov, std::size_t count);
/// Reads exactly n bytes; false at a clean end of input before the first
/// byte when eof_ok, else a truncation is corrupt.
bool read_fd(int fd, char* p, std::size_t n, bool eof_ok = false);
/// read_fd of several buffers in order (readv); a truncation is corrupt.
void read_fdv(int fd, struct iovec* iov, std::size_t count);

/// Records out: [u32 kind][u32 length][payload][u64 XXH3-64 of the three
/// before]. The producer (the sender's thread: reading, checking,
/// compressing) frames records in buffers of its own and queues them; a
/// thread of this writer writes them to the fd meanwhile (into a Channel:
/// hands the buffers over, small records gathered, and takes buffers the
/// channel's taker gave back for the next records). The queue holds at
/// most kQueueBytes (and at least one record), so the sender's memory stays
/// bounded whatever the speed of the wire. A write error (EPIPE: the receiver
/// is gone) is thrown by the next call after it; destroying the writer
/// without finish() drops what is queued and waits for the write under way
/// (a receiver that stopped reading must close its end, as every receiver
/// of ours does when it fails).
/// Where a stream goes to or comes from: a file descriptor, or a Channel
/// between two threads of this process.
struct Wire {
  int fd = -1;
  Channel* channel = nullptr;
  Wire(int f) : fd(f) {}  // NOLINT: an fd is a wire
  Wire(Channel& c) : channel(&c) {}  // NOLINT: so is a channel
};

class RecordWriter {
 public:
  static constexpr std::size_t kQueueBytes = 16u << 20;
  /// Into a Channel, records smaller than kGather travel gathered in
  /// buffers of up to kGatherBytes (one MPI message for many page records).
  static constexpr std::size_t kGather = 64u << 10, kGatherBytes = 256u << 10;
  explicit RecordWriter(Wire to);
  ~RecordWriter();
  RecordWriter(const RecordWriter&) = delete;
  RecordWriter& operator=(const RecordWriter&) = delete;

  /// A buffer for the next record's payload (recycled: no fresh pages per
  /// record), with room reserved for the record's head, `payload` bytes of
  /// payload (a hint: more may be written) and the checksum.
  detail::Writer begin(std::size_t payload = 0);
  /// Frames the payload written into `w` (since begin()) as a record of `kind`, and queues it.
  void end(Kind kind, detail::Writer&& w);
  /// A whole record from a payload.
  void record(Kind kind, const std::string& payload);
  /// Bytes not framed as a record (the stream's header).
  void raw(const char* p, std::size_t n);
  /// Waits until everything queued is written; throws the writer's error.
  void finish();
  /// Bytes queued so far (the stream's length once finish() returns).
  std::uint64_t bytes() const { return bytes_; }
  /// Before anything is queued: the writer's thread hashes every byte it
  /// writes (BLAKE2b-512), and finish() ends the stream with a signature
  /// record of that hash by `key` (docs/format.md). The stream's header must
  /// carry kFlagSigned (write_stream_head).
  void sign_with(const SigningKey& key);

 private:
  void queue(std::string&& framed);
  void run();
  // Writes (or, into a channel, hands over) what one turn of run() took.
  void put(std::vector<std::string>& batch);
  struct Shared;
  Wire to_;
  std::uint64_t bytes_ = 0;
  std::unique_ptr<Shared> sh_;
};

/// Records in, each checked against its XXH3-64; at most kMaxRecord bytes
/// (from a Channel: copied out of its buffers, each given back once read).
/// After start(), a thread of this reader reads and checks the records
/// ahead (at most kQueueBytes of them) while the caller's thread
/// decompresses, hashes and stores the ones before; it stops after the
/// stream-end record, at the first error (truncation, damage: thrown by the
/// record() that would have returned it), or when the reader is destroyed.
/// It never reads past the stream-end record, so what follows the stream on
/// the fd (nothing, or the next message of a negotiation) stays unread.
class RecordReader {
 public:
  static constexpr std::size_t kQueueBytes = 4u << 20;
  explicit RecordReader(Wire from);
  ~RecordReader();
  RecordReader(const RecordReader&) = delete;
  RecordReader& operator=(const RecordReader&) = delete;

  /// Bytes not framed as a record (the stream's header); before start() only.
  void raw(char* p, std::size_t n);
  /// Starts reading records ahead on a thread of the reader.
  void start();
  /// The next record's kind; its payload into `payload` (buffers are swapped, not copied).
  Kind record(std::string& payload);
  /// Bytes the caller has taken so far (header and records).
  std::uint64_t bytes() const { return bytes_; }
  /// Before start(), for a stream whose header has kFlagSigned: the reader
  /// hashes every byte of the stream (the header read by raw() included)
  /// and, after the stream-end record, reads the signature record that must
  /// follow it, before the caller gets the stream-end record.
  void expect_signature() { signed_ = true; }
  /// Once record() has returned kStreamEnd of a signed stream: the
  /// signature record's payload, and the hash of every byte before it.
  const std::string& signature() const { return signature_; }
  const Digest& digest() const { return digest_; }

 private:
  struct Shared;
  void run();
  // Fills the buffers from the wire, exactly (a truncation is corrupt).
  void read(struct iovec* iov, std::size_t count);
  Wire from_;
  std::string cur_;      // from a channel: the buffer being read,
  std::size_t at_ = 0;   // and how far
  std::uint64_t bytes_ = 0;
  bool signed_ = false;
  char next_head_[8];      // the next record's head, read with the one before (thread)
  bool have_next_ = false;
  StreamHash hash_;        // of the bytes read, while signed_
  std::string signature_;  // set by the reader's thread before it queues the stream-end record
  Digest digest_{};
  std::unique_ptr<Shared> sh_;
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
/// fingerprint() of session/name, read without its page hashes (which the
/// fingerprint does not need) and without the store's lock (manifests are
/// replaced whole). Throws not_found, corrupt.
Hash128 fingerprint_of(const Store& s, const std::string& session, const std::string& name);

// send.cpp / receive.cpp, for the negotiation.
/// The stream's first 16 bytes: magic, version, flags (docs/format.md);
/// with `key`, the flag kFlagSigned, and the writer signs the stream.
void write_stream_head(RecordWriter& w, const std::optional<SigningKey>& key = std::nullopt);

/// Per-chunk compression of the data in records (send, send_live): the data
/// is written raw into the record (reserve(), then filled in by the caller,
/// e.g. read straight from the store), then compressed in place when that
/// pays (seal()). Compress::automatic first compresses a sample of the first
/// kSample bytes: data that does not shrink by 1/8 there (noise, floats, data
/// compressed already) travels raw and costs no compression time, which on a
/// wire slower than memory but faster than zstd (ssh: ~0.6 GB/s here, zstd -1
/// on float data ~0.7 GB/s) is what makes a push at wire speed. After two
/// such samples in a row the next kFirstBackoff bytes travel raw unsampled
/// (doubling with each further failure up to kMaxBackoff; a sample that
/// shrinks ends it): sampling each page of a push of scattered pages cost
/// more than sending them. Level 0 means none (checked_level). Throws no_space when zstd
/// cannot allocate its context.
/// `level` when it is a zstd level dvr sends with (0 = none, 1–19); throws
/// invalid_argument naming it otherwise. Senders check it before anything is
/// written.
int checked_level(int level);

class Compressor {
 public:
  static constexpr std::size_t kSample = 8192;
  static constexpr std::size_t kFirstBackoff = 64 << 10, kMaxBackoff = 4 << 20;
  Compressor(Compress mode, int level);
  ~Compressor();
  Compressor(const Compressor&) = delete;
  Compressor& operator=(const Compressor&) = delete;

  /// Room for `n` bytes of data in `b` (codec, lengths, then the bytes to fill in).
  static char* reserve(detail::Writer& b, std::size_t n) { return b.extend(9 + n) + 9; }
  /// The `n` bytes reserved last in `b` (they end it): codec and lengths
  /// filled in, compressed when that pays; counted in st (data_bytes,
  /// chunks_compressed or chunks_raw).
  void seal(detail::Writer& b, std::size_t n, Stats& st);
  /// Samples compressed so far (Compress::automatic).
  std::size_t samples() const { return samples_; }

 private:
  // Compress::automatic: whether the first kSample bytes shrink by at least
  // 1/8 (their compressed form kept in out_ when they are all the data).
  bool worth_trying(const char* data, std::size_t n);

  Compress mode_;
  int level_;
  ::ZSTD_CCtx_s* ctx_;
  std::string out_;
  std::size_t sample_size_ = 0;
  unsigned failed_ = 0;      // samples in a row that did not shrink
  std::size_t skip_ = 0;     // bytes still to send raw unsampled
  std::size_t samples_ = 0;
};

Stats send_with(const Store& store, const std::string& ref, Wire to, const Options& opt, const std::vector<std::string>& bases);
/// The snapshot of `session` (one item of `ref`) that a base given as
/// Options::base names: NAME, or SESSION/NAME of the session sent (another
/// session is invalid_argument); in a process snapshot's heap sessions, its
/// heap part. "" stays "".
std::string base_in(const std::string& ref, const std::string& session, const std::string& base);
std::vector<std::string> bases_for(const std::vector<Item>& items, const std::string& ref, const std::string& base);
/// `stream_size`: the stream's length when known (a regular file), else 0;
/// the total that options.progress reports.
Stats receive_stream(Store& store, RecordReader& rd, const ReceiveOptions& options = {}, std::uint64_t stream_size = 0);
/// The bytes left to read from `fd` when it is a regular file, else 0.
std::uint64_t bytes_left(int fd);

}  // namespace dvr::transfer::internal
