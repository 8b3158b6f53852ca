// The byte codec of the binary formats (manifests, streams: docs/format.md):
// little-endian fixed-width integers, u32-length-prefixed strings and 128-bit
// hashes (low then high u64), in the spirit of LevelDB's util/coding.h.
//
//   Writer w;                         Reader r(bytes, "manifest " + path);
//   w.u32(7);                         std::uint32_t n = r.u32();
//   w.str(name);                      std::string name = r.str();
//   w.hash(h);                        Hash128 h = r.hash();
//
// A Reader never reads past its input: a field that does not fit throws
// Error(corrupt) naming what is being decoded, "WHAT is damaged: WHY; ADVICE".
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "base/hash.hpp"
#include "dvr/error.hpp"

static_assert(std::endian::native == std::endian::little,
              "the store and stream formats are little-endian; add byte swapping to base/codec.hpp for this platform");

namespace dvr::detail {

/// Stores `v` at `at` (which has room for it); returns the byte after it. For
/// tables written into space sized once (Writer::extend).
template <class T>
inline char* encode_fixed(char* at, T v) noexcept {
  static_assert(std::is_trivially_copyable_v<T>);
  std::memcpy(at, &v, sizeof v);
  return at + sizeof v;
}

/// The T stored at `at` (which holds sizeof(T) bytes).
template <class T>
inline T decode_fixed(const char* at) noexcept {
  static_assert(std::is_trivially_copyable_v<T>);
  T v;
  std::memcpy(&v, at, sizeof v);
  return v;
}

/// Appends fields to `out`.
class Writer {
 public:
  Writer() = default;
  /// Writes into `reuse`'s memory (cleared first): a large encoding repeated
  /// does not fault in fresh pages each time.
  explicit Writer(std::string reuse) : out(std::move(reuse)) { out.clear(); }

  template <class T>
  void fixed(T v) {
    char b[sizeof(T)];
    encode_fixed(b, v);
    out.append(b, sizeof b);
  }
  void u8(std::uint8_t v) { out.push_back(static_cast<char>(v)); }
  void u32(std::uint32_t v) { fixed(v); }
  void u64(std::uint64_t v) { fixed(v); }
  void i64(std::int64_t v) { fixed(v); }
  /// u32 length, then the bytes.
  void str(std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    out.append(s);
  }
  /// 16 bytes: the low, then the high 64 bits.
  void hash(const Hash128& h) {
    u64(h.lo);
    u64(h.hi);
  }
  /// Raw bytes, no length.
  void bytes(const void* p, std::size_t n) { out.append(static_cast<const char*>(p), n); }
  /// `n` more bytes at the end (zero), returned to be filled with
  /// encode_fixed; valid until the next append.
  char* extend(std::size_t n) {
    const std::size_t at = out.size();
    out.resize(at + n);
    return out.data() + at;
  }
  std::size_t size() const { return out.size(); }

  std::string out;
};

/// Reads fields from a byte range it does not own, front to back.
class Reader {
 public:
  /// `what` names the thing decoded in errors ("manifest sessions/s/a.snap",
  /// "the stream"); `advice`, if any, says what to do about it; `truncated`
  /// is the reason given when a field does not fit in what is left.
  explicit Reader(std::string_view in, std::string what, std::string advice = {}, std::string truncated = "ends early (truncated)")
      : in_(in), what_(std::move(what)), advice_(std::move(advice)), truncated_(std::move(truncated)) {}

  template <class T>
  T fixed() {
    need(sizeof(T));
    T v = decode_fixed<T>(in_.data() + pos_);
    pos_ += sizeof(T);
    return v;
  }
  std::uint8_t u8() { return fixed<std::uint8_t>(); }
  std::uint32_t u32() { return fixed<std::uint32_t>(); }
  std::uint64_t u64() { return fixed<std::uint64_t>(); }
  std::int64_t i64() { return fixed<std::int64_t>(); }
  /// u32 length, then that many bytes.
  std::string str() {
    const std::uint32_t n = u32();
    return std::string(take(n), n);
  }
  Hash128 hash() {
    Hash128 h;
    h.lo = u64();
    h.hi = u64();
    return h;
  }
  /// The next `n` bytes, in place.
  const char* take(std::size_t n) {
    need(n);
    const char* p = in_.data() + pos_;
    pos_ += n;
    return p;
  }
  void skip(std::size_t n) { take(n); }
  /// Throws unless `n` more bytes are left.
  void need(std::size_t n) const {
    if (in_.size() - pos_ < n) fail(truncated_);
  }
  std::size_t remaining() const { return in_.size() - pos_; }
  std::size_t position() const { return pos_; }
  bool at_end() const { return pos_ == in_.size(); }

  /// Throws Error(corrupt): "WHAT is damaged: WHY; ADVICE".
  [[noreturn]] void fail(const std::string& why) const {
    throw Error(Errc::corrupt, what_ + " is damaged: " + why + (advice_.empty() ? std::string() : "; " + advice_));
  }

 private:
  std::string_view in_;
  std::size_t pos_ = 0;
  std::string what_, advice_, truncated_;
};

}  // namespace dvr::detail
