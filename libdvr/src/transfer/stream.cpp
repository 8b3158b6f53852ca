// The stream's framing and what a reference stands for (transfer/stream.hpp).
#include <limits.h>
#include <zstd.h>
#include <pthread.h>
#include <sys/uio.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <cerrno>
#include <cstring>

#include "base/os.hpp"
#include "store/store_impl.hpp"
#include "store/reader.hpp"
#include "transfer/stream.hpp"

#include "dvr/proc.hpp"

namespace dvr::transfer::internal {

using detail::StoreImpl;

void write_stream_head(RecordWriter& w, const std::optional<SigningKey>& key) {
  if (key) w.sign_with(*key);
  char head[16];
  std::memcpy(head, kMagic, 8);
  std::uint32_t v = kVersion, flags = key ? kFlagSigned : 0;
  std::memcpy(head + 8, &v, 4);
  std::memcpy(head + 12, &flags, 4);
  w.raw(head, 16);
}

// ---- Compressor ------------------------------------------------------------

int checked_level(int level) {
  if (level < 0 || level > 19)
    throw Error(Errc::invalid_argument, "zstd level " + std::to_string(level) + " is out of range: give 1 to 19 (0 sends every chunk uncompressed)");
  return level;
}

Compressor::Compressor(Compress mode, int level)
    : mode_(checked_level(level) == 0 ? Compress::none : mode), level_(level), ctx_(ZSTD_createCCtx()) {
  if (!ctx_) throw Error(Errc::no_space, "cannot allocate a zstd compression context");
}

Compressor::~Compressor() { ZSTD_freeCCtx(ctx_); }

void Compressor::seal(detail::Writer& b, std::size_t n, Stats& st) {
  const std::size_t at = b.size() - n - 9;
  const char* data = b.out.data() + at + 9;
  st.data_bytes += n;
  std::size_t c = 0;
  if (worth_trying(data, n)) {
    if (n <= kSample && sample_size_) {
      c = sample_size_;  // the sample was the whole
    } else {
      out_.resize(ZSTD_compressBound(n));
      c = ZSTD_compressCCtx(ctx_, out_.data(), out_.size(), data, n, level_);
      if (ZSTD_isError(c)) c = 0;
    }
  }
  char* head = b.out.data() + at;
  if (c && c < n) {
    head[0] = static_cast<char>(kZstd);
    detail::encode_fixed(head + 1, static_cast<std::uint32_t>(n));
    detail::encode_fixed(head + 5, static_cast<std::uint32_t>(c));
    std::memcpy(b.out.data() + at + 9, out_.data(), c);
    b.out.resize(at + 9 + c);
    ++st.chunks_compressed;
    return;
  }
  head[0] = static_cast<char>(kRaw);
  detail::encode_fixed(head + 1, static_cast<std::uint32_t>(n));
  detail::encode_fixed(head + 5, static_cast<std::uint32_t>(n));
  ++st.chunks_raw;
}

bool Compressor::worth_trying(const char* data, std::size_t n) {
  sample_size_ = 0;
  if (mode_ == Compress::none) return false;
  if (mode_ == Compress::zstd) return true;
  // After two samples in a row that did not shrink, the data that follows
  // travels raw unsampled for a while (64 KiB, doubling with each further
  // failure to 4 MiB): sampling every page of a 1% push of noise cost more
  // than sending it. One odd chunk between compressible ones costs nothing.
  if (skip_ >= n) {
    skip_ -= n;
    return false;
  }
  skip_ = 0;
  ++samples_;
  const std::size_t s = std::min(n, kSample);
  out_.resize(ZSTD_compressBound(s));
  std::size_t c = ZSTD_compressCCtx(ctx_, out_.data(), out_.size(), data, s, level_);
  if (ZSTD_isError(c) || c * 8 > s * 7) {
    if (++failed_ >= 2) skip_ = std::min<std::size_t>(kFirstBackoff << std::min<unsigned>(failed_ - 2, 16), kMaxBackoff);
    return false;
  }
  failed_ = 0;
  sample_size_ = c;
  return true;
}


[[noreturn]] void bad_stream(const std::string& why) {
  throw Error(Errc::corrupt, "the stream is damaged: " + why + "; nothing was stored (send it again)");
}

namespace {

// A write of the stream failed: where it went (a file, a pipe) named, and a
// full file system there not mistaken for the store's.
[[noreturn]] void write_failed(int fd, int err) {
  if (err == EPIPE) throw Error(Errc::io, "the receiving end closed the connection (see its error message)");
  char link[4096];
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t len = ::readlink(proc.c_str(), link, sizeof link - 1);
  const std::string where = len > 0 ? std::string(link, static_cast<std::size_t>(len)) : "file descriptor " + std::to_string(fd);
  if (err == ENOSPC || err == EDQUOT || err == EFBIG)
    throw Error(Errc::no_space, "cannot write the stream to " + where + ": " + std::strerror(err) +
                                    " — the file system it goes to is full (or a file-size limit was reached); the store is not affected: "
                                    "free space there, or write the stream elsewhere");
  detail::throw_errno(err, "cannot write the stream to " + where);
}

}  // namespace

void write_fd(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      write_failed(fd, errno);
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

namespace {

// Past the first `done` bytes of iov[0..count): whole buffers (and empty
// ones) dropped, the next one trimmed.
void advance(iovec*& iov, std::size_t& count, std::size_t done) {
  while (count > 0 && done >= iov->iov_len) {
    done -= iov->iov_len;
    ++iov;
    --count;
  }
  if (count > 0) {
    iov->iov_base = static_cast<char*>(iov->iov_base) + done;
    iov->iov_len -= done;
  }
}

[[noreturn]] void truncated() {
  throw Error(Errc::corrupt, "the stream is truncated (it ended in the middle of a record); nothing was stored (send it again)");
}

}  // namespace

// write_fd over several buffers: writev, resumed after a partial write.
void write_fdv(int fd, iovec* iov, std::size_t count) {
  while (count > 0) {
    ssize_t w = ::writev(fd, iov, static_cast<int>(std::min<std::size_t>(count, IOV_MAX)));
    if (w < 0) {
      if (errno == EINTR) continue;
      write_failed(fd, errno);
    }
    advance(iov, count, static_cast<std::size_t>(w));
  }
}

// read_fd of several buffers in order: readv, resumed after a short read.
void read_fdv(int fd, iovec* iov, std::size_t count) {
  advance(iov, count, 0);  // leading empty buffers
  while (count > 0) {
    ssize_t r = ::readv(fd, iov, static_cast<int>(std::min<std::size_t>(count, IOV_MAX)));
    if (r < 0) {
      if (errno == EINTR) continue;
      detail::throw_errno(errno, "cannot read the stream");
    }
    if (r == 0) truncated();
    advance(iov, count, static_cast<std::size_t>(r));
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
      truncated();
    }
    got += static_cast<std::size_t>(r);
  }
  return true;
}

// ---- buffers kept for the next records ------------------------------------

// Record buffers handed back, kept for the next records up to `limit` bytes
// of capacity: as many as fill a queue. A buffer freed and allocated again
// per record is fresh memory each time (glibc gives large blocks back), whose
// first touch costs a page fault per page. Used under its owner's mutex.
class BufferPool {
 public:
  static constexpr std::size_t kSmall = 4096;
  explicit BufferPool(std::size_t limit) : limit_(limit) {}
  // A kept buffer (its contents are stale), or an empty one.
  std::string take() {
    std::string buf;
    if (!bufs_.empty()) {
      buf = std::move(bufs_.back());
      bufs_.pop_back();
      bytes_ -= buf.capacity();
    }
    return buf;
  }
  // Keeps `buf` while there is room for it, else lets it go (and small
  // ones: an emptied string still has a little capacity).
  void give(std::string&& buf) {
    if (buf.capacity() < kSmall || bytes_ + buf.capacity() > limit_) return;
    bytes_ += buf.capacity();
    bufs_.push_back(std::move(buf));
  }

 private:
  std::size_t limit_;
  std::vector<std::string> bufs_;
  std::size_t bytes_ = 0;  // their capacity
};

}  // namespace dvr::transfer::internal

// ---- Channel ---------------------------------------------------------------

namespace dvr::transfer {

struct Channel::State {
  // Buffers given back are kept up to the limit, and at least 4 MiB of them
  // (a small limit still has large records going through).
  explicit State(std::size_t l) : limit(l), returned(std::max<std::size_t>(l, 4u << 20)) {}
  std::size_t limit;
  mutable std::mutex mu;
  std::condition_variable can_put, can_take;
  std::deque<std::string> queue;
  std::size_t queued = 0;  // bytes in `queue`
  internal::BufferPool returned;  // buffers given back, for reuse()
  bool closed = false, abandoned = false;
};

Channel::Channel(std::size_t limit) : s_(std::make_unique<State>(std::max<std::size_t>(limit, 1))) {}
Channel::~Channel() = default;

void Channel::put(std::string&& bytes) {
  std::unique_lock<std::mutex> lk(s_->mu);
  s_->can_put.wait(lk, [&] { return s_->abandoned || bytes.empty() || s_->queued < s_->limit; });
  if (s_->abandoned) throw Error(Errc::io, "the receiving end stopped reading the stream (see its error message)");
  if (bytes.empty()) return;
  const std::size_t n = bytes.size();
  s_->queue.push_back(std::move(bytes));  // first: if it throws, nothing was counted
  s_->queued += n;
  lk.unlock();
  s_->can_take.notify_one();
}

bool Channel::full() const {
  std::lock_guard<std::mutex> g(s_->mu);
  return !s_->abandoned && s_->queued >= s_->limit;
}

void Channel::close() {
  {
    std::lock_guard<std::mutex> g(s_->mu);
    s_->closed = true;
  }
  s_->can_take.notify_all();
}

std::string Channel::reuse() {
  std::lock_guard<std::mutex> g(s_->mu);
  return s_->returned.take();
}

bool Channel::take(std::string& out, bool wait) {
  std::unique_lock<std::mutex> lk(s_->mu);
  s_->returned.give(std::move(out));
  out = std::string();
  if (wait) s_->can_take.wait(lk, [&] { return !s_->queue.empty() || s_->closed || s_->abandoned; });
  if (s_->queue.empty()) return false;
  out = std::move(s_->queue.front());
  s_->queue.pop_front();
  s_->queued -= out.size();
  lk.unlock();
  s_->can_put.notify_one();
  return true;
}

bool Channel::ended() const {
  std::lock_guard<std::mutex> g(s_->mu);
  return s_->closed && s_->queue.empty();
}

void Channel::give_back(std::string&& buf) {
  std::lock_guard<std::mutex> g(s_->mu);
  s_->returned.give(std::move(buf));
}

void Channel::abandon() {
  {
    std::lock_guard<std::mutex> g(s_->mu);
    s_->abandoned = true;
    s_->queue.clear();
    s_->queued = 0;
  }
  s_->can_put.notify_all();
}

bool Channel::abandoned() const {
  std::lock_guard<std::mutex> g(s_->mu);
  return s_->abandoned;
}

}  // namespace dvr::transfer

namespace dvr::transfer::internal {

// ---- RecordWriter ----------------------------------------------------------

struct RecordWriter::Shared {
  std::mutex mu;
  std::condition_variable can_put, can_take;
  std::deque<std::string> queue;
  std::size_t queued = 0;         // bytes in `queue`
  BufferPool pool{kQueueBytes};   // written buffers, for the next records
  bool closing = false;           // finish(): write what is queued, then stop
  bool cancel = false;            // destroyed early: drop what is queued
  std::exception_ptr error;       // the write that failed
  std::thread thread;
  std::optional<SigningKey> key;  // sign_with(): the writer's thread hashes what it writes
  std::unique_ptr<StreamHash> hash;
};

// A record framed as the stream frames them (stream.hpp).
static std::string frame(Kind kind, const std::string& payload) {
  std::string out(8, '\0');
  std::uint32_t k = kind, n = static_cast<std::uint32_t>(payload.size());
  std::memcpy(out.data(), &k, 4);
  std::memcpy(out.data() + 4, &n, 4);
  out += payload;
  const std::uint64_t h = detail::hash64(out.data(), out.size());
  out.append(reinterpret_cast<const char*>(&h), 8);
  return out;
}

void RecordWriter::sign_with(const SigningKey& key) {
  if (bytes_ != 0) throw Error(Errc::invalid_argument, "RecordWriter::sign_with after the stream began");
  std::lock_guard<std::mutex> g(sh_->mu);
  sh_->key = key;
  sh_->hash = std::make_unique<StreamHash>();
}

RecordWriter::RecordWriter(Wire to) : to_(to), sh_(std::make_unique<Shared>()) {
  sh_->thread = std::thread([this] { run(); });
}

RecordWriter::~RecordWriter() {
  {
    std::lock_guard<std::mutex> g(sh_->mu);
    sh_->cancel = true;
    sh_->queue.clear();
  }
  sh_->can_take.notify_all();
  if (sh_->thread.joinable()) sh_->thread.join();
}

void RecordWriter::run() {
  sigset_t pipe_signal;  // a receiver gone makes the write fail (EPIPE), never kills the process
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
  std::vector<std::string> batch;
  for (;;) {
    {
      // Everything queued at once (up to 64 records): the small records of
      // a push against a base (runs, pages) go out in one system call.
      std::unique_lock<std::mutex> lk(sh_->mu);
      sh_->can_take.wait(lk, [&] { return !sh_->queue.empty() || sh_->closing || sh_->cancel; });
      if (sh_->cancel) return;
      if (sh_->queue.empty()) {
        // finish(): everything is written; a signed stream ends with the
        // signature of all of it.
        if (!sh_->key) return;
        std::string sig = frame(kSignature, signature_record(*sh_->key, sh_->hash->final()));
        sh_->key.reset();
        lk.unlock();
        try {
          std::vector<std::string> last;
          last.push_back(std::move(sig));
          put(last);
        } catch (...) {
          std::lock_guard<std::mutex> g(sh_->mu);
          sh_->error = std::current_exception();
        }
        return;
      }
      while (!sh_->queue.empty() && batch.size() < 64) {
        sh_->queued -= sh_->queue.front().size();
        batch.push_back(std::move(sh_->queue.front()));
        sh_->queue.pop_front();
      }
    }
    sh_->can_put.notify_one();
    try {
      for (auto& r : batch)
        if (sh_->hash) sh_->hash->update(r.data(), r.size());  // only this thread, once sign_with() returned
      put(batch);
    } catch (...) {
      {
        std::lock_guard<std::mutex> g(sh_->mu);
        sh_->error = std::current_exception();
      }
      sh_->can_put.notify_all();
      return;  // a SIGPIPE left pending for this thread goes with it
    }
    std::lock_guard<std::mutex> g(sh_->mu);
    for (auto& r : batch)
      sh_->pool.give(std::move(r));
    batch.clear();
  }
}

void RecordWriter::put(std::vector<std::string>& batch) {
  if (!to_.channel) {
    std::vector<iovec> iov;
    iov.reserve(batch.size());
    for (auto& r : batch)
      iov.push_back({r.data(), r.size()});
    write_fdv(to_.fd, iov.data(), iov.size());
    return;
  }
  // Into a channel: large records as they are (their buffers go with them
  // and come back through Channel::reuse()), small ones copied together.
  Channel& ch = *to_.channel;
  std::string gather;
  auto hand_over = [&] {
    if (!gather.empty()) ch.put(std::move(gather));
    gather.clear();
  };
  for (auto& r : batch) {
    if (r.size() >= kGather) {
      hand_over();
      ch.put(std::move(r));
      continue;
    }
    if (!gather.empty() && gather.size() + r.size() > kGatherBytes) hand_over();
    if (gather.capacity() < BufferPool::kSmall) {  // new, or handed over (a moved-from string keeps a little capacity)
      gather = ch.reuse();
      gather.clear();
      gather.reserve(kGatherBytes);
    }
    gather += r;
  }
  hand_over();
}

void RecordWriter::queue(std::string&& framed) {
  std::unique_lock<std::mutex> lk(sh_->mu);
  sh_->can_put.wait(lk, [&] { return sh_->error || sh_->queued == 0 || sh_->queued + framed.size() <= kQueueBytes; });
  if (sh_->error) std::rethrow_exception(sh_->error);
  bytes_ += framed.size();
  sh_->queued += framed.size();
  sh_->queue.push_back(std::move(framed));
  lk.unlock();
  sh_->can_take.notify_one();
}

detail::Writer RecordWriter::begin(std::size_t payload) {
  std::string buf;
  {
    std::lock_guard<std::mutex> g(sh_->mu);
    buf = sh_->pool.take();
  }
  // A buffer that went through the channel (the writer's own pool is empty
  // when its records are moved into a channel; an empty string still has a
  // little capacity).
  if (buf.capacity() < BufferPool::kSmall && to_.channel) buf = to_.channel->reuse();
  buf.clear();
  // Room for the head, the payload and the checksum: end() appending the
  // checksum to a buffer filled to its capacity would copy the whole record
  // into a new one twice its size.
  buf.reserve(payload + 16);
  detail::Writer w(std::move(buf));
  w.extend(8);
  return w;
}

void RecordWriter::end(Kind kind, detail::Writer&& w) {
  if (w.size() < 8 || w.size() - 8 > kMaxRecord) throw Error(Errc::invalid_argument, "a stream record of " + std::to_string(w.size()) + " bytes");
  std::uint32_t k = kind, n = static_cast<std::uint32_t>(w.size() - 8);
  std::memcpy(w.out.data(), &k, 4);
  std::memcpy(w.out.data() + 4, &n, 4);
  w.u64(detail::hash64(w.out.data(), w.out.size()));
  queue(std::move(w.out));
}

void RecordWriter::record(Kind kind, const std::string& payload) {
  detail::Writer w = begin(payload.size());
  w.bytes(payload.data(), payload.size());
  end(kind, std::move(w));
}

void RecordWriter::raw(const char* p, std::size_t n) { queue(std::string(p, n)); }

void RecordWriter::finish() {
  {
    std::lock_guard<std::mutex> g(sh_->mu);
    sh_->closing = true;
  }
  sh_->can_take.notify_all();
  sh_->thread.join();
  if (sh_->error) std::rethrow_exception(sh_->error);
  if (sh_->hash) bytes_ += 16 + kSignatureRecord;  // the signature record
}

// ---- RecordReader ----------------------------------------------------------

struct RecordReader::Shared {
  struct Record {
    Kind kind;
    std::string payload;
  };
  std::mutex mu;
  std::condition_variable can_put, can_take;
  std::deque<Record> queue;
  std::size_t queued = 0;  // payload bytes in `queue`
  BufferPool pool{kQueueBytes};   // payloads handed back, for the next records
  bool stop = false;  // the reader is being destroyed
  bool done = false;  // the thread read its last record (stream end or error)
  std::exception_ptr error;
  std::thread thread;
};

RecordReader::RecordReader(Wire from) : from_(from), sh_(std::make_unique<Shared>()) {}

RecordReader::~RecordReader() {
  {
    std::lock_guard<std::mutex> g(sh_->mu);
    sh_->stop = true;
  }
  sh_->can_put.notify_all();
  if (sh_->thread.joinable()) sh_->thread.join();
}

void RecordReader::read(iovec* iov, std::size_t count) {
  if (!from_.channel) return read_fdv(from_.fd, iov, count);
  for (std::size_t i = 0; i < count; ++i) {
    char* p = static_cast<char*>(iov[i].iov_base);
    std::size_t n = iov[i].iov_len;
    while (n > 0) {
      if (at_ == cur_.size()) {
        at_ = 0;
        if (!from_.channel->take(cur_)) truncated();  // gives the one read back
        continue;
      }
      const std::size_t k = std::min(n, cur_.size() - at_);
      std::memcpy(p, cur_.data() + at_, k);
      at_ += k;
      p += k;
      n -= k;
    }
  }
}

void RecordReader::raw(char* p, std::size_t n) {
  if (sh_->thread.joinable()) throw Error(Errc::invalid_argument, "RecordReader::raw after start");
  iovec v{p, n};
  read(&v, 1);
  hash_.update(p, n);
  bytes_ += n;
}

void RecordReader::start() { sh_->thread = std::thread([this] { run(); }); }

void RecordReader::run() {
  try {
    for (;;) {
      std::string buf;
      {
        std::unique_lock<std::mutex> lk(sh_->mu);
        sh_->can_put.wait(lk, [&] { return sh_->stop || sh_->queued < kQueueBytes; });
        if (sh_->stop) break;
        buf = sh_->pool.take();
      }
      char head[8], tail[8];
      std::uint32_t k, n;
      auto read_record = [&](std::string& into, std::uint32_t limit) {
        if (have_next_) {
          std::memcpy(head, next_head_, 8);
          have_next_ = false;
        } else {
          iovec v{head, 8};
          read(&v, 1);
        }
        std::memcpy(&k, head, 4);
        std::memcpy(&n, head + 4, 4);
        if (n > limit) bad_stream("a record claims " + std::to_string(n) + " bytes");
        into.resize(n);
        // One read for the payload, the checksum and the next record's head,
        // which a record other than the last (the stream's end; the
        // signature after it when signed) always has: nothing past the
        // stream is read.
        const bool last = k == kSignature || (k == kStreamEnd && !signed_);
        iovec v[3] = {{into.data(), n}, {tail, 8}, {next_head_, 8}};
        read(v, last ? 2 : 3);
        have_next_ = !last;
        std::uint64_t want;
        std::memcpy(&want, tail, 8);
        if (detail::hash64_of_two(head, 8, into.data(), n) != want) bad_stream("a record fails its checksum (a flipped or missing byte)");
      };
      read_record(buf, kMaxRecord);
      if (signed_) {
        hash_.update(head, 8);
        hash_.update(buf.data(), n);
        hash_.update(tail, 8);
      }
      if (k == kStreamEnd && signed_) {
        // The signature record, before the stream-end record is handed on:
        // whoever gets that one can check the signature at once.
        digest_ = hash_.final();
        std::string sig;
        const std::uint32_t end_n = n;
        read_record(sig, 4096);
        if (k != kSignature) bad_stream("its header says it is signed, but no signature record follows its end");
        signature_ = std::move(sig);
        k = kStreamEnd;
        n = end_n;
      }
      {
        std::lock_guard<std::mutex> g(sh_->mu);
        sh_->queued += n;
        sh_->queue.push_back({static_cast<Kind>(k), std::move(buf)});
      }
      sh_->can_take.notify_one();
      if (k == kStreamEnd) break;  // what follows on the fd is not the stream's
    }
  } catch (...) {
    std::lock_guard<std::mutex> g(sh_->mu);
    sh_->error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> g(sh_->mu);
    sh_->done = true;
  }
  sh_->can_take.notify_all();
}

Kind RecordReader::record(std::string& payload) {
  if (!sh_->thread.joinable()) start();
  std::unique_lock<std::mutex> lk(sh_->mu);
  sh_->can_take.wait(lk, [&] { return !sh_->queue.empty() || sh_->done; });
  if (sh_->queue.empty()) {
    if (sh_->error) std::rethrow_exception(sh_->error);
    bad_stream("a record follows the stream's end");
  }
  Shared::Record r = std::move(sh_->queue.front());
  sh_->queue.pop_front();
  sh_->queued -= r.payload.size();
  payload.swap(r.payload);
  sh_->pool.give(std::move(r.payload));
  lk.unlock();
  sh_->can_put.notify_one();
  bytes_ += 16 + payload.size();
  if (r.kind == kStreamEnd && signed_) bytes_ += 16 + signature_.size();
  return r.kind;
}

bool has_snapshot(const Store& s, const std::string& session, const std::string& name) {
  return detail::impl_of(s).has_manifest(session, name);
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

Hash128 fingerprint_of(const Store& s, const std::string& session, const std::string& name) {
  return fingerprint(detail::impl_of(s).load_manifest(session, name, nullptr, false));
}

}  // namespace dvr::transfer::internal
