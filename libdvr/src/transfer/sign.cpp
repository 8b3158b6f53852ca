// Ed25519 keys and signed streams (transfer/sign.hpp, dvr/transfer.hpp),
// through libsodium.
#include <fcntl.h>
#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/codec.hpp"
#include "base/hash.hpp"
#include "base/os.hpp"
#include "transfer/sign.hpp"

namespace dvr::transfer {

using namespace internal;

namespace {

constexpr char kPublicHeader[] = "dvr ed25519 public key v1";
constexpr char kSecretHeader[] = "dvr ed25519 secret key v1";
constexpr std::size_t kMaxKeyFile = 64 << 10;

void need_sodium() {
  static const int ok = ::sodium_init();
  if (ok < 0) throw Error(Errc::unsupported, "libsodium cannot start (sodium_init failed): signed streams are not available");
}

std::string base64(const std::uint8_t* p, std::size_t n) {
  std::string out(sodium_base64_ENCODED_LEN(n, sodium_base64_VARIANT_ORIGINAL), '\0');
  ::sodium_bin2base64(out.data(), out.size(), p, n, sodium_base64_VARIANT_ORIGINAL);
  out.resize(std::strlen(out.c_str()));
  return out;
}

// The one data line of a key file's text, after its header line `header`,
// decoded into exactly n bytes. `other` is the header of the other kind of
// key file, named in the error when the text is that one.
void parse_key_text(const std::string& text, const char* header, const char* other, const char* other_hint, std::uint8_t* out, std::size_t n,
                    const std::string& what) {
  std::vector<std::string> lines;
  std::size_t at = 0;
  while (at <= text.size()) {
    std::size_t nl = text.find('\n', at);
    std::string line = text.substr(at, nl == std::string::npos ? std::string::npos : nl - at);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    if (nl == std::string::npos) break;
    at = nl + 1;
  }
  if (lines.empty() || lines[0] != header) {
    if (!lines.empty() && lines[0] == other)
      throw Error(Errc::invalid_argument, what + " is a " + std::string(other).substr(12, 6) + " key file, not a " +
                                              std::string(header).substr(12, 6) + " key file (" + other_hint + ")");
    throw Error(Errc::corrupt, what + " is not a Memory DVR key file: its first line is not '" + header + "' (make one with `dvr keygen --out PREFIX`)");
  }
  std::string data;
  for (std::size_t k = 1; k < lines.size(); ++k) {
    const std::string& l = lines[k];
    if (l.empty() || l[0] == '#') continue;
    if (!data.empty()) throw Error(Errc::corrupt, what + " has more than one key line (line " + std::to_string(k + 1) + ")");
    data = l;
  }
  if (data.empty()) throw Error(Errc::corrupt, what + " holds no key (its second line should be the key in base64)");
  std::size_t got = 0;
  const char* end = nullptr;
  if (::sodium_base642bin(out, n, data.data(), data.size(), nullptr, &got, &end, sodium_base64_VARIANT_ORIGINAL) != 0 || got != n ||
      end != data.data() + data.size())
    throw Error(Errc::corrupt, what + " has a damaged key line (expected " + std::to_string(n) + " bytes in base64)");
}

// A key file's text; `secret`: refused unless only its owner can read it.
std::string read_key_file(const std::string& path, bool secret) {
  detail::Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd) detail::throw_errno(errno, "cannot open key file " + path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) detail::throw_errno(errno, "cannot stat key file " + path);
  if (!S_ISREG(st.st_mode)) throw Error(Errc::invalid_argument, "key file " + path + " is not a regular file");
  if (static_cast<std::uint64_t>(st.st_size) > kMaxKeyFile)
    throw Error(Errc::corrupt, "key file " + path + " is " + std::to_string(st.st_size) + " bytes, too large for a key file");
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    ssize_t r = ::read(fd.get(), text.data() + got, text.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) detail::throw_errno(errno, "cannot read key file " + path);
    if (r == 0) break;
    got += static_cast<std::size_t>(r);
  }
  text.resize(got);
  // (A public key file given for a secret one is named as such by the
  // caller's parse, not met with advice to make it private.)
  if (secret && text.rfind(kPublicHeader, 0) != 0 && ((st.st_mode & 077) || (st.st_uid != ::geteuid() && st.st_uid != 0))) {
    ::sodium_memzero(text.data(), text.size());  // not kept, not used
    if (st.st_mode & 077) {
      char mode[16];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
      throw Error(Errc::permission, "secret key file " + path + " is accessible by other users (mode " + mode +
                                        "); a secret key must be private: run `chmod 600 " + path + "` (and make a new key if others may have read it)");
    }
    if (st.st_uid != ::geteuid() && st.st_uid != 0)
      throw Error(Errc::permission, "secret key file " + path + " is owned by another user (uid " + std::to_string(st.st_uid) + "); use a key of your own");
  }
  return text;
}

// Writes `text` as `path` (mode `mode`), complete or not at all, never over
// an existing file: a temporary file, fsynced, then link()ed to `path`.
void write_new_file(const std::string& path, const std::string& text, mode_t mode) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  detail::Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd) detail::throw_errno(errno, "cannot create " + tmp);
  try {
    if (::fchmod(fd.get(), mode) != 0) detail::throw_errno(errno, "cannot set the mode of " + tmp);
    detail::write_all(fd.get(), text.data(), text.size(), tmp);
    detail::fsync_or_throw(fd.get(), tmp);
    if (::link(tmp.c_str(), path.c_str()) != 0) {
      if (errno == EEXIST) throw Error(Errc::already_exists, path + " exists already; nothing was overwritten (choose another --out PREFIX)");
      detail::throw_errno(errno, "cannot create " + path);
    }
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  ::unlink(tmp.c_str());
}

std::string parent_dir(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

// ---- VerifyKey ---------------------------------------------------------------

VerifyKey VerifyKey::parse(const std::string& text, const std::string& what) {
  need_sodium();
  VerifyKey k;
  parse_key_text(text, kPublicHeader, kSecretHeader, "give the PREFIX.pub file that `dvr keygen` wrote beside it", k.key_.data(), k.key_.size(), what);
  return k;
}

VerifyKey VerifyKey::load(const std::string& path) { return parse(read_key_file(path, false), "key file " + path); }

std::string VerifyKey::fingerprint() const {
  need_sodium();
  std::uint8_t h[32];
  ::crypto_generichash(h, sizeof h, key_.data(), key_.size(), nullptr, 0);
  static const char* digits = "0123456789abcdef";
  std::string out = "ed25519:";
  for (int k = 0; k < 16; ++k) {
    out += digits[h[k] >> 4];
    out += digits[h[k] & 15];
  }
  return out;
}

std::string VerifyKey::to_text() const {
  return std::string(kPublicHeader) + "\n" + base64(key_.data(), key_.size()) + "\n# " + fingerprint() + "\n";
}

bool VerifyKey::verify(const void* message, std::size_t n, const std::array<std::uint8_t, 64>& signature) const {
  need_sodium();
  return ::crypto_sign_verify_detached(signature.data(), static_cast<const unsigned char*>(message), n, key_.data()) == 0;
}

// ---- SigningKey --------------------------------------------------------------

struct SigningKey::Secret {
  std::uint8_t sk[crypto_sign_SECRETKEYBYTES];  // libsodium's: seed, then public key
  Secret() = default;
  Secret(const Secret&) = delete;
  Secret& operator=(const Secret&) = delete;
  ~Secret() { ::sodium_memzero(sk, sizeof sk); }
};

static_assert(crypto_sign_PUBLICKEYBYTES == 32 && crypto_sign_BYTES == 64 && crypto_sign_SEEDBYTES == 32);

SigningKey SigningKey::generate() {
  need_sodium();
  auto s = std::make_shared<Secret>();
  std::array<std::uint8_t, 32> pk{};
  ::crypto_sign_keypair(pk.data(), s->sk);
  SigningKey k;
  k.secret_ = std::move(s);
  k.public_ = VerifyKey::from_bytes(pk);
  return k;
}

SigningKey SigningKey::load(const std::string& path) {
  need_sodium();
  std::string text = read_key_file(path, true);
  std::uint8_t seed[crypto_sign_SEEDBYTES];
  try {
    parse_key_text(text, kSecretHeader, kPublicHeader, "--sign takes the secret PREFIX.key file; the .pub file is for the receiver", seed,
                   sizeof seed, "key file " + path);
  } catch (...) {
    ::sodium_memzero(text.data(), text.size());
    throw;
  }
  ::sodium_memzero(text.data(), text.size());
  auto s = std::make_shared<Secret>();
  std::array<std::uint8_t, 32> pk{};
  ::crypto_sign_seed_keypair(pk.data(), s->sk, seed);
  ::sodium_memzero(seed, sizeof seed);
  SigningKey k;
  k.secret_ = std::move(s);
  k.public_ = VerifyKey::from_bytes(pk);
  return k;
}

void SigningKey::save(const std::string& prefix) const {
  if (prefix.empty()) throw Error(Errc::invalid_argument, "the key file prefix is empty (give --out PREFIX: PREFIX.key and PREFIX.pub are written)");
  const std::string key = prefix + ".key", pub = prefix + ".pub";
  for (const std::string& p : {key, pub}) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) == 0) throw Error(Errc::already_exists, p + " exists already; nothing was written (choose another --out PREFIX)");
  }
  std::string text = std::string(kSecretHeader) + "\n" + base64(secret_->sk, crypto_sign_SEEDBYTES) + "\n# " + fingerprint() +
                     "\n# keep this file secret; its public half is " + pub + "\n";
  try {
    write_new_file(key, text, 0600);
  } catch (...) {
    ::sodium_memzero(text.data(), text.size());
    throw;
  }
  ::sodium_memzero(text.data(), text.size());
  try {
    write_new_file(pub, public_.to_text(), 0644);
  } catch (...) {
    ::unlink(key.c_str());
    throw;
  }
  detail::fsync_dir(parent_dir(key));
}

std::array<std::uint8_t, 64> SigningKey::sign(const void* message, std::size_t n) const {
  std::array<std::uint8_t, 64> sig{};
  ::crypto_sign_detached(sig.data(), nullptr, static_cast<const unsigned char*>(message), n, secret_->sk);
  return sig;
}

// ---- the stream's hash and signature record --------------------------------------

namespace internal {

struct StreamHash::State {
  crypto_generichash_state s;
};

StreamHash::StreamHash() : st_(std::make_unique<State>()) {
  need_sodium();
  ::crypto_generichash_init(&st_->s, nullptr, 0, 64);
}

StreamHash::~StreamHash() = default;

void StreamHash::update(const void* p, std::size_t n) { ::crypto_generichash_update(&st_->s, static_cast<const unsigned char*>(p), n); }

Digest StreamHash::final() {
  Digest d{};
  ::crypto_generichash_final(&st_->s, d.data(), d.size());
  return d;
}

namespace {
std::string signed_message(const Digest& digest) {
  std::string m(kSignContext, sizeof kSignContext);
  m.append(reinterpret_cast<const char*>(digest.data()), digest.size());
  return m;
}
}  // namespace

std::string signature_record(const SigningKey& key, const Digest& digest) {
  const std::string m = signed_message(digest);
  const auto sig = key.sign(m.data(), m.size());
  detail::Writer w;
  w.u32(kSigEd25519Blake2b);
  w.bytes(reinterpret_cast<const char*>(key.public_key().bytes().data()), 32);
  w.bytes(reinterpret_cast<const char*>(sig.data()), sig.size());
  return w.out;
}

std::string fingerprints(const std::vector<VerifyKey>& keys) {
  std::string out;
  for (auto& k : keys)
    out += (out.empty() ? "" : ", ") + k.fingerprint();
  return out;
}

VerifyKey check_signature(const std::string& payload, const Digest& digest, const std::vector<VerifyKey>& required, const std::string& what) {
  if (payload.size() != kSignatureRecord)
    throw Error(Errc::corrupt, what + " has a malformed signature record (" + std::to_string(payload.size()) + " bytes, not " +
                                   std::to_string(kSignatureRecord) + "); nothing was stored");
  const auto alg = detail::decode_fixed<std::uint32_t>(payload.data());
  if (alg != kSigEd25519Blake2b)
    throw Error(Errc::unsupported, what + " is signed with algorithm " + std::to_string(alg) + ", which this dvr does not know (upgrade dvr); nothing was stored");
  std::array<std::uint8_t, 32> pk{};
  std::array<std::uint8_t, 64> sig{};
  std::memcpy(pk.data(), payload.data() + 4, 32);
  std::memcpy(sig.data(), payload.data() + 36, 64);
  const VerifyKey signer = VerifyKey::from_bytes(pk);
  const std::string m = signed_message(digest);
  if (!signer.verify(m.data(), m.size(), sig))
    throw Error(Errc::corrupt, what + " fails its signature by key " + signer.fingerprint() +
                                   ": it was altered after it was signed (or damaged); nothing was stored");
  if (!required.empty()) {
    bool known = false;
    for (auto& k : required)
      known = known || k == signer;
    if (!known)
      throw Error(Errc::permission, what + " is signed by key " + signer.fingerprint() + ", not by the required key" +
                                        (required.size() > 1 ? "s " : " ") + fingerprints(required) + "; nothing was stored");
  }
  return signer;
}

}  // namespace internal

}  // namespace dvr::transfer
