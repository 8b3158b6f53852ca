// Memory DVR — moving snapshots between stores (docs/migration.md).
//
// A snapshot travels as a stream (format: docs/format.md, "Stream format"):
// its metadata, then its chunks, each zstd-compressed where that pays
// (Options::compress) and carrying the XXH3-128 of its content. Sender and
// receiver each run two threads: one reads, checks and (de)compresses
// chunks, the other moves bytes through the file descriptor (or a Channel
// between threads of one process). The receiver checks every chunk against that hash
// as it arrives, and commits the snapshot atomically once the whole stream is
// in: a broken, truncated or tampered stream leaves its store as it was.
// Against a base (a snapshot both sides hold with the same content), only
// chunks that differ travel, and of those only the pages that differ.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dvr/store.hpp"

namespace dvr {
class Region;
}

namespace dvr::transfer {

/// An Ed25519 public key: the key a receiver requires streams to be signed
/// with (ReceiveOptions::require_signature). Its file (PREFIX.pub, written
/// by SigningKey::save) is text: the line `dvr ed25519 public key v1`, then
/// the 32 key bytes in base64, then optional `#` comment lines.
class DVR_EXPORT VerifyKey {
 public:
  /// Reads a public key file. Throws not_found, io, corrupt (not a public
  /// key file: the message names the file and says what it expected; a
  /// secret key file given here is refused so, naming PREFIX.pub).
  static VerifyKey load(const std::string& path);
  /// Parses a public key file's text; `what` names it in errors. Throws corrupt.
  static VerifyKey parse(const std::string& text, const std::string& what = "the public key");
  /// The key from its 32 raw bytes.
  static VerifyKey from_bytes(const std::array<std::uint8_t, 32>& key) {
    VerifyKey k;
    k.key_ = key;
    return k;
  }
  /// "ed25519:" and 32 hex digits (the first 16 bytes of the BLAKE2b-256 of
  /// the key): how messages and `dvr keygen` name the key.
  std::string fingerprint() const;
  /// The text of its key file.
  std::string to_text() const;
  /// Whether `signature` is this key's Ed25519 signature of the n bytes at `message`.
  bool verify(const void* message, std::size_t n, const std::array<std::uint8_t, 64>& signature) const;
  const std::array<std::uint8_t, 32>& bytes() const { return key_; }
  bool operator==(const VerifyKey& o) const { return key_ == o.key_; }

 private:
  std::array<std::uint8_t, 32> key_{};
};

/// An Ed25519 secret key, to sign streams with (Options::sign_with). Copies
/// share the secret, which is wiped from memory when the last goes. Its file
/// (PREFIX.key, mode 0600) is text: `dvr ed25519 secret key v1`, then the
/// key's 32-byte seed in base64, then `#` comments (the fingerprint).
class DVR_EXPORT SigningKey {
 public:
  /// A new random key (libsodium's crypto_sign_keypair).
  static SigningKey generate();
  /// Reads a secret key file written by save(). Refuses (permission) a file
  /// that users other than its owner may read or write (mode & 077: run
  /// `chmod 600 FILE`), or that is not a regular file; throws not_found, io,
  /// corrupt (not a secret key file: the message says what it expected).
  static SigningKey load(const std::string& path);
  /// Writes PREFIX.key (mode 0600) and PREFIX.pub (0644), each complete or
  /// not at all. Refuses (already_exists) when either exists: nothing is
  /// overwritten. Throws not_found (no such directory), io, no_space.
  void save(const std::string& prefix) const;
  /// Its public key.
  const VerifyKey& public_key() const { return public_; }
  /// public_key().fingerprint().
  std::string fingerprint() const { return public_.fingerprint(); }
  /// The detached Ed25519 signature of the n bytes at `message`.
  std::array<std::uint8_t, 64> sign(const void* message, std::size_t n) const;

 private:
  struct Secret;
  std::shared_ptr<const Secret> secret_;
  VerifyKey public_;
};

/// How chunks are compressed on the wire (`dvr send --compress=`).
enum class Compress {
  /// zstd for each chunk whose first bytes compress well (a sample of them
  /// is compressed first: one that shrinks by less than 1/8 is sent raw, so
  /// noise-like data costs no compression time); the default.
  automatic,
  /// zstd for every chunk (each still travels raw when zstd does not shrink it).
  zstd,
  /// No compression: every chunk travels raw.
  none,
};

/// "auto", "zstd", "none".
DVR_EXPORT const char* to_string(Compress c);
/// Parses "auto" / "zstd" / "none"; throws invalid_argument naming `option`
/// and the allowed values.
DVR_EXPORT Compress parse_compress(const std::string& text, const std::string& option = "--compress");

/// Removes the part files `FILE.part-PID` that exports to `file` killed
/// with SIGKILL (or a crash) left beside it: those whose process is gone.
/// An export to FILE (`dvr export`, memdvr's Store.export) calls it before
/// it starts its own; returns how many it removed. Never throws.
DVR_EXPORT std::size_t remove_stale_export_parts(const std::string& file) noexcept;

struct Options {
  /// Send only what differs from this snapshot of the same session, which the
  /// receiver must hold with the same content ("" = everything): its NAME or
  /// SESSION/NAME (a snapshot of another session is invalid_argument). For a
  /// process snapshot, a process snapshot name (or proc/NAME).
  std::string base;
  /// Which chunks are compressed (default: those that pay).
  Compress compress = Compress::automatic;
  /// zstd level (1–19) of the chunks compressed; 0 sends every chunk
  /// uncompressed, whatever `compress` says (the same as Compress::none).
  /// Any other value is invalid_argument, before anything is sent.
  int level = 1;
  /// Logical bytes of the snapshots sent so far, out of their total (chunks
  /// the receiver holds count as sent); see dvr::Progress for the contract.
  /// Called by send (and so export), send_live and send_negotiated (push).
  /// When it throws, the stream is left unfinished (the receiver stores
  /// nothing) and the exception propagates.
  Progress progress;
  /// Sign the stream with this key (`dvr export --sign KEY`): a signature
  /// record after the stream's end covers every byte before it. Receivers
  /// that do not require a signature (and dvr versions before signatures,
  /// which stop reading at the stream's end) accept it all the same.
  /// Used by send (export), send_live and send_negotiated (push).
  std::optional<SigningKey> sign_with;
};

struct Stats {
  std::vector<std::string> refs;     // "session/name" of every snapshot moved
  std::string base;                  // base used for the main snapshot ("" = none)
  std::uint64_t logical_bytes = 0;   // sum of the snapshots' sizes
  std::uint64_t wire_bytes = 0;      // bytes of the stream
  std::uint64_t data_bytes = 0;      // uncompressed bytes of the chunk data in it
  std::uint64_t chunks = 0;          // chunks of the snapshots
  std::uint64_t chunks_skipped = 0;  // not sent: the receiver has them (base)
  std::uint64_t chunks_compressed = 0;  // send: chunk records sent zstd-compressed
  std::uint64_t chunks_raw = 0;      // send: chunk records sent raw (compression skipped or did not pay)
  std::uint64_t read_bytes = 0;      // send: bytes of stored data read from the store (only what differs from the base)
  std::uint64_t stored_bytes = 0;    // receive: bytes added to the store
  double seconds = 0;
  /// data_bytes / wire_bytes of chunk data (1 when nothing was compressed).
  double compression_ratio = 1;
  /// send_live: the content fingerprint of what was sent (as fingerprint()).
  std::string fingerprint;
  /// The fingerprint of the key that signed the stream (VerifyKey::fingerprint),
  /// "" when it was not signed.
  std::string signed_by;
};

/// A stream's bytes handed from one thread of a process to another in place
/// of a pipe: buffers are moved, not copied through the kernel. send() and
/// send_live() into a Channel put the stream's records into it (small ones
/// gathered into buffers of up to 256 KiB); another thread takes them, moves
/// them on (dvr::mpi: as MPI messages to another rank) and gives each buffer
/// back once done with it, for the next records. The other way round, a
/// thread puts the bytes that arrive (in buffers of any size) and receive()
/// from the Channel reads them. One thread puts, one takes.
///
/// Flow control: put() waits while `limit` bytes or more are put and not yet
/// taken. Buffers go in whole, so up to `limit` - 1 bytes plus the largest
/// buffer put can be queued (the records of send() are at most a chunk and
/// its head); a taker that moves them on more slowly bounds the memory in
/// between, and what the taker holds is its own to bound. End of stream: close(), by
/// the putting side (after an error too: a stream that ends early is
/// truncated, and receive() refuses it). A taker that stops early calls
/// abandon(): put() then throws io, as a write into a pipe whose reader is
/// gone fails.
class DVR_EXPORT Channel {
 public:
  explicit Channel(std::size_t limit = std::size_t{16} << 20);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // The putting side.
  /// Hands `bytes` to the taker (an empty buffer is dropped). Waits while
  /// the limit is reached; throws io once the taker abandoned the channel
  /// (an empty buffer too).
  void put(std::string&& bytes);
  /// Whether put() would wait now (for a putter that must not block).
  bool full() const;
  /// No more bytes: the taker gets the end after the last buffer.
  void close();
  /// A buffer given back by the taker (contents stale), or an empty one.
  std::string reuse();

  // The taking side.
  /// The next buffer into `out` (what `out` held is given back). With
  /// `wait`, waits for one; false when there is none now (without `wait`),
  /// at the end (ended()), or after this side's abandon().
  bool take(std::string& out, bool wait = true);
  /// Whether the putter closed the channel and everything put was taken.
  bool ended() const;
  /// A buffer taken, once its bytes are used, for the putter to reuse:
  /// send() and send_live() write their next records into them. Buffers
  /// given back are kept up to the limit (at least 4 MiB of them); ones
  /// under 4 KiB of capacity are dropped.
  void give_back(std::string&& buf);
  /// The taker stops: puts wait no more, and throw io.
  void abandon();
  /// Whether abandon() was called.
  bool abandoned() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

/// Writes REF ("session/name", or "proc/NAME" for a process snapshot with its
/// DVR heap snapshots) as a stream to `fd`. Throws not_found, corrupt (the
/// store's data fails its checksum: nothing is sent for it), io.
DVR_EXPORT Stats send(const Store& store, const std::string& ref, int fd, const Options& options = {});
/// send() into a Channel (closed by the caller, not by send).
DVR_EXPORT Stats send(const Store& store, const std::string& ref, Channel& out, const Options& options = {});

/// Writes `regions` (Session::regions() of session SESSION) as they are in
/// memory now, as a stream of snapshot SESSION/NAME: what send() of a
/// snapshot taken now would
/// write (against options.base, a snapshot of the session in `store` that the
/// receiver holds, only what differs), without reading any data from the
/// store. For a copy sent while the same memory is being snapshotted on
/// another thread (dvr::mpi's partner copies): `store` is a handle of the
/// session's store other than Session::store() (only the base's tables are
/// read from it). The regions must stay as they are (no writes, none added
/// or removed) until this returns.
/// `confirm`, when given, is called with the fingerprint of what was sent
/// before the stream's last records; if it throws, the stream ends unfinished
/// (the receiver stores nothing) and the exception propagates. Options::level
/// compresses chunks that shrink by at least an eighth; after one that does
/// not, the next 31 are sent as they are. Throws invalid_argument (no
/// regions, bad name), not_found (base), io (the fd).
DVR_EXPORT Stats send_live(const Store& store, const std::string& session, const std::vector<Region*>& regions, const std::string& name, int fd,
                           const Options& options = {},
                           const std::function<void(const std::string& fingerprint)>& confirm = {});
/// send_live() into a Channel (closed by the caller, not by send_live).
DVR_EXPORT Stats send_live(const Store& store, const std::string& session, const std::vector<Region*>& regions, const std::string& name,
                           Channel& out, const Options& options = {},
                           const std::function<void(const std::string& fingerprint)>& confirm = {});

/// The content fingerprint of snapshot REF ("session/name") as streams carry
/// it, in hex: the same for snapshots with the same regions and bytes, in
/// whatever store and place. Throws not_found, corrupt.
DVR_EXPORT std::string fingerprint(const Store& store, const std::string& ref);

struct ReceiveOptions {
  /// Store the snapshots in this session instead of the one the stream names
  /// (a partner's copy of another rank's part, say). "" keeps the stream's.
  std::string session;
  /// Bytes of the stream read so far, out of its length when `fd` is a
  /// regular file (an import: the bytes from the file's offset to its end);
  /// otherwise (a pipe, a socket) total is 0 until the stream has ended,
  /// then the final call has done == total == bytes read. See dvr::Progress
  /// for the contract. When it throws, the stream is abandoned, nothing is
  /// stored, and the exception propagates.
  Progress progress;
  /// Refuse (invalid_argument, nothing stored) a snapshot that declares more
  /// logical bytes than this; 0: no limit besides the ones every receive
  /// has (its tables must fit in a quarter of this machine's memory and its
  /// manifest in the store's free space, else no_space; a stream read from a
  /// regular file must be long enough to carry every chunk it declares, else
  /// corrupt). A stream of zero chunks costs no hashing of zero memory.
  std::uint64_t max_logical_bytes = 0;
  /// Accept only streams signed by one of these keys (`dvr import
  /// --require-signature PUBKEY`); empty: any stream, signed or not. An
  /// unsigned stream is refused at its header, before anything is read into
  /// the store; a signature is checked after the stream's end and before
  /// anything is published (the chunks read meanwhile lie in free space,
  /// given back). A signed stream's signature is checked even when this is
  /// empty (it then proves only that the stream was not altered).
  std::vector<VerifyKey> require_signature;
};

/// Reads one stream from `fd` into `store`. Everything is checked before the
/// first snapshot is published. Throws corrupt (checksum, truncation,
/// malformed, a signature that does not verify), permission (an unsigned
/// stream, or one signed by another key, while options.require_signature
/// names keys), unsupported (newer stream format), already_exists, not_found
/// (the stream needs a base this store lacks), no_space.
DVR_EXPORT Stats receive(Store& store, int fd, const ReceiveOptions& options = {});
/// receive() from a Channel (the stream's length is not known: progress as
/// for a pipe). Buffers are given back as they are read. When it throws, it
/// has abandoned the channel first, so the putter's next put() throws io
/// instead of waiting (as a write into a pipe whose reader closed it fails).
DVR_EXPORT Stats receive(Store& store, Channel& in, const ReceiveOptions& options = {});

/// The two ends of a negotiated transfer (dvr push / pull over ssh): the
/// receiver first says which snapshots it already holds, so that only what it
/// lacks is sent. `in`/`out` are the connection to the other end.
DVR_EXPORT Stats send_negotiated(const Store& store, const std::string& ref, int in, int out, const Options& options = {});
/// receive_negotiated's options: `session` must be "" (a negotiated transfer
/// keeps the sender's names); `progress` as for receive() (total 0: the
/// stream's length is not known).
DVR_EXPORT Stats receive_negotiated(Store& store, int in, int out, const ReceiveOptions& options = {});

}  // namespace dvr::transfer
