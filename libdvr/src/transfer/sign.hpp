// Signed streams (docs/format.md, "Stream format": flags bit 0 and the
// signature record): the running BLAKE2b-512 of a stream's bytes, and the
// signature record that closes a signed stream.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dvr/transfer.hpp"

namespace dvr::transfer::internal {

/// Header flags bit 0: a signature record follows the stream-end record.
inline constexpr std::uint32_t kFlagSigned = 1;
/// The signature record's algorithm: Ed25519 over kSignContext and the
/// BLAKE2b-512 of the stream's bytes before the signature record.
inline constexpr std::uint32_t kSigEd25519Blake2b = 1;
/// What is signed: this context (with its terminating NUL), then the digest.
inline constexpr char kSignContext[] = "Memory DVR stream signature v1";
/// The signature record's payload: u32 algorithm, 32-byte public key, 64-byte signature.
inline constexpr std::size_t kSignatureRecord = 4 + 32 + 64;

using Digest = std::array<std::uint8_t, 64>;

/// BLAKE2b-512 (libsodium's crypto_generichash), fed in stream order.
class StreamHash {
 public:
  StreamHash();
  ~StreamHash();
  StreamHash(const StreamHash&) = delete;
  StreamHash& operator=(const StreamHash&) = delete;
  void update(const void* p, std::size_t n);
  Digest final();

 private:
  struct State;
  std::unique_ptr<State> st_;
};

/// The signature record's payload for a stream whose bytes hash to `digest`.
std::string signature_record(const SigningKey& key, const Digest& digest);

/// Checks the signature record `payload` of a stream whose bytes before it
/// hash to `digest`; returns the key that signed it. Throws corrupt (a
/// malformed record, or a signature that does not verify: the stream was
/// altered after it was signed), permission (a valid signature by a key not
/// in `required`, when that is not empty). `what` names the stream.
VerifyKey check_signature(const std::string& payload, const Digest& digest, const std::vector<VerifyKey>& required, const std::string& what);

/// "ed25519:A, ed25519:B": the fingerprints of `keys`.
std::string fingerprints(const std::vector<VerifyKey>& keys);

}  // namespace dvr::transfer::internal
