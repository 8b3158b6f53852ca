// Serving a process snapshot's images to CRIU (image_server.hpp).
#include "proc/image_server.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "base/log.hpp"
#include "dvr/proc.hpp"
#include "format/chunks.hpp"
#include "proc/proc_heaps.hpp"
#include "store/reader.hpp"
#include "store/store_impl.hpp"

namespace dvr::proc::impl {

namespace {

using detail::kPageSize;
namespace procpages = detail::procpages;

constexpr const char* kSocketName = "streamer-serve.sock";
constexpr const char* kFillSocketName = "page-fill.sock";
constexpr std::size_t kZeroRun = 256u << 10;
alignas(4096) char g_zeros[kZeroRun];  // never written: served for pages that are all zero
constexpr std::size_t kMaxRun = 8u << 20;

// Merges the pieces a region is read in into runs of consecutive bytes (and
// runs of zeros), so that a sink makes one call per run.
template <class Sink>
class Runs {
 public:
  explicit Runs(Sink& sink) : sink_(sink) {}
  void add(const char* p, std::size_t n, bool zero) {
    if (len_ && zero == zero_ && (zero ? len_ + n <= kZeroRun : at_ + len_ == p && len_ + n <= kMaxRun)) {
      len_ += n;
      return;
    }
    flush();
    at_ = zero ? g_zeros : p;
    len_ = n;
    zero_ = zero;
  }
  void flush() {
    if (len_) sink_(at_, len_);
    len_ = 0;
  }

 private:
  Sink& sink_;
  const char* at_ = nullptr;
  std::size_t len_ = 0;
  bool zero_ = false;
};

void put_u32(std::string& out, std::uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }

bool read_all(int fd, void* to, std::size_t n) {
  auto* p = static_cast<char*>(to);
  while (n) {
    ssize_t k = ::recv(fd, p, n, MSG_WAITALL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

bool send_all(int fd, const std::string& s) {
  std::size_t off = 0;
  while (off < s.size()) {
    ssize_t k = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    off += static_cast<std::size_t>(k);
  }
  return true;
}

// Receives one file descriptor (SCM_RIGHTS, with a byte of data); -1 on failure.
int recv_fd(int sk) {
  char byte;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t k;
  do {
    k = ::recvmsg(sk, &msg, MSG_CMSG_CLOEXEC);
  } while (k < 0 && errno == EINTR);
  if (k <= 0) return -1;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (!c || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(sizeof(int))) return -1;
  int fd;
  std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

// The filename of an ImgStreamerRequestEntry (field 1, a string); "" if malformed.
std::string request_filename(const std::string& msg) {
  if (msg.size() < 2 || msg[0] != 0x0a) return "";
  std::size_t at = 1;
  std::uint64_t len = 0;
  for (int shift = 0; at < msg.size() && shift < 35; shift += 7) {
    auto b = static_cast<unsigned char>(msg[at++]);
    len |= std::uint64_t{b & 0x7fu} << shift;
    if (!(b & 0x80)) break;
  }
  if (len == 0 || len > 255 || at + len != msg.size()) return "";
  return msg.substr(at, len);
}

// Writes all of [p, p+n) into a pipe by reference: the pages are the pack
// files', which nothing changes while the server holds its lock.
void vmsplice_all(int pipe_fd, const char* p, std::size_t n) {
  while (n) {
    iovec iov{const_cast<char*>(p), n};
    ssize_t k = ::vmsplice(pipe_fd, &iov, 1, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) detail::throw_errno(errno, "cannot pass pages to CRIU");
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

}  // namespace

ImageServer::ImageServer(Store& store, const std::string& name, const std::string& dir, bool fill) : name_(name), dir_(dir) {
  reader_ = std::make_unique<detail::SnapshotReader>(detail::impl_of(store));
  manifest_ = reader_->load(kImageSession, name);
  reader_->packs().map_all();  // from here on the packs are read on any thread
  for (std::size_t k = 0; k < manifest_.regions.size(); ++k)
    region_at_[manifest_.regions[k].name] = k;
  if (!region_at_.count(kMetaRegion)) throw Error(Errc::corrupt, "process snapshot '" + name + "' has no metadata (" + kMetaRegion + ")");
  std::string text;
  {
    std::size_t checked = SIZE_MAX;
    const auto& mr = manifest_.regions[region_at_[kMetaRegion]];
    auto sink = [&](const char* p, std::size_t n) { text.append(p, n); };
    Runs<decltype(sink)> runs(sink);
    for_each_piece(kMetaRegion, 0, mr.size, checked, [&](const char* p, std::size_t n, bool zero) { runs.add(p, n, zero); });
    runs.flush();
  }
  meta_ = decode_meta(text, name);

  for (auto& g : meta_.paged_images) {
    detail::check_name("image", g.pages);
    auto it = region_at_.find(g.pagemap);
    if (it == region_at_.end()) throw Error(Errc::corrupt, "process snapshot '" + name + "' lacks " + g.pagemap + ", which lays out " + g.pages);
    std::string pm_text;
    auto sink = [&](const char* p, std::size_t n) { pm_text.append(p, n); };
    Runs<decltype(sink)> runs(sink);
    std::size_t checked = SIZE_MAX;
    for_each_piece(g.pagemap, 0, manifest_.regions[it->second].size, checked, [&](const char* p, std::size_t n, bool zero) { runs.add(p, n, zero); });
    runs.flush();
    PagedFile f;
    f.image = g;
    if (!procpages::parse_pagemap(pm_text.data(), pm_text.size(), f.pagemap) || f.pagemap.present_bytes() != g.size)
      throw Error(Errc::corrupt, "process snapshot '" + name + "': " + g.pages + " cannot be rebuilt (its pagemap " + g.pagemap +
                                     " does not account for its " + std::to_string(g.size) + " bytes)");
    for (auto& e : f.pagemap.entries) {
      if (!e.present) continue;
      for (std::uint64_t a = e.vaddr / procpages::kWindow * procpages::kWindow; a < e.vaddr + e.pages * kPageSize; a += procpages::kWindow) {
        auto w = region_at_.find(procpages::window_region(f.pagemap.pages_id, a));
        if (w == region_at_.end() || manifest_.regions[w->second].size != procpages::kWindow)
          throw Error(Errc::corrupt, "process snapshot '" + name + "' lacks page window " + procpages::window_region(f.pagemap.pages_id, a) +
                                         " (or it has a wrong size), which " + g.pages + " needs");
      }
    }
    f.served = f.pagemap;
    paged_[g.pages] = std::move(f);
  }
  if (fill) choose_fills();
  // Every other region is an image file of its own; a filled process's
  // pagemap without its present entries (CRIU maps the memory, dvr fills it).
  for (auto& r : manifest_.regions) {
    if (r.name == kMetaRegion || r.name.rfind("mem-", 0) == 0) continue;
    detail::check_name("image", r.name);
    const PagedFile* filled = nullptr;
    for (auto& [file, f] : paged_)
      if (f.fill && f.image.pagemap == r.name) filled = &f;
    if (!filled) {
      write_region_file(r.name, dir_ + "/" + r.name);
      continue;
    }
    procpages::Pagemap rest = filled->served;
    for (auto& e : filled->pagemap.entries)
      if (!e.present) rest.entries.push_back(e);
    std::sort(rest.entries.begin(), rest.entries.end(), [](const procpages::Entry& a, const procpages::Entry& b) { return a.vaddr < b.vaddr; });
    const std::string path = dir_ + "/" + r.name, bytes = procpages::encode_pagemap(rest);
    detail::Fd fd = detail::open_or_throw(path, O_WRONLY | O_CREAT | O_EXCL);
    detail::write_all(fd.get(), bytes.data(), bytes.size(), path);
  }
  for (auto& e : meta_.empty_images) {
    detail::check_name("image", e);
    detail::open_or_throw(dir_ + "/" + e, O_WRONLY | O_CREAT | O_EXCL);
  }
}

ImageServer::~ImageServer() { (void)stop(); }

template <class Emit>
void ImageServer::for_each_piece(const std::string& region, std::uint64_t offset, std::uint64_t len, std::size_t& checked, Emit&& emit) {
  const detail::ManifestRegion& r = manifest_.regions.at(region_at_.at(region));
  if (offset > r.size || len > r.size - offset) throw Error(Errc::corrupt, "process snapshot '" + name_ + "': region " + region + " is too short");
  detail::Packs& packs = reader_->packs();
  const std::uint32_t cs = manifest_.chunk_size;
  while (len) {
    const std::size_t ci = r.first_chunk + offset / cs;
    const detail::ChunkView v = detail::view_of(manifest_, ci);
    if (checked != ci) {
      if (std::string why = detail::check_chunk(packs, v); !why.empty())
        throw Error(Errc::corrupt, "process snapshot '" + name_ + "', region " + region + " is damaged: " + why + "; run `dvr verify`");
      checked = ci;
    }
    std::uint64_t in = offset % cs;
    while (len && in < v.ref->length) {
      const auto p = static_cast<std::uint32_t>(in / kPageSize);
      const std::uint64_t in_page = in % kPageSize;
      const std::uint64_t n = std::min<std::uint64_t>(len, v.page_length(p) - in_page);
      const detail::PageLoc at = v.location(p);
      if (at.pack == 0)
        emit(static_cast<const char*>(nullptr), n, true);
      else
        emit(packs.mapped(at.pack, at.offset + in_page, n), n, false);
      in += n;
      offset += n;
      len -= n;
    }
  }
}

template <class Emit>
void ImageServer::for_each_page_image_piece(const procpages::Pagemap& pm, Emit&& emit) {
  std::size_t checked = SIZE_MAX;  // the chunk last checked: each is checked once, however many pieces come from it
  for (auto& e : pm.entries) {
    if (!e.present) continue;
    std::uint64_t a = e.vaddr, left = e.pages * kPageSize;
    while (left) {
      const std::uint64_t start = a / procpages::kWindow * procpages::kWindow, in = a - start;
      const std::uint64_t n = std::min(left, procpages::kWindow - in);
      for_each_piece(procpages::window_region(pm.pages_id, start), in, n, checked, emit);
      a += n;
      left -= n;
    }
  }
}

void ImageServer::write_region_file(const std::string& region, const std::string& path) {
  detail::Fd fd = detail::open_or_throw(path, O_WRONLY | O_CREAT | O_EXCL);
  auto sink = [&](const char* p, std::size_t n) { detail::write_all(fd.get(), p, n, path); };
  Runs<decltype(sink)> runs(sink);
  const auto& r = manifest_.regions[region_at_.at(region)];
  std::size_t checked = SIZE_MAX;
  for_each_piece(region, 0, r.size, checked, [&](const char* p, std::size_t n, bool zero) { runs.add(p, n, zero); });
  runs.flush();
}

void ImageServer::write_page_images() {
  for (auto& [file, f] : paged_) {
    const std::string path = dir_ + "/" + file;
    detail::Fd fd = detail::open_or_throw(path, O_WRONLY | O_CREAT | O_EXCL);
    auto sink = [&](const char* p, std::size_t n) {
      detail::write_all(fd.get(), p, n, path);
      page_bytes_done_.fetch_add(n, std::memory_order_relaxed);
    };
    Runs<decltype(sink)> runs(sink);
    for_each_page_image_piece(f.pagemap, [&](const char* p, std::size_t n, bool zero) { runs.add(p, n, zero); });
    runs.flush();
  }
}

std::uint64_t ImageServer::page_image_bytes() const {
  std::uint64_t total = 0;
  for (auto& [file, f] : paged_)
    total += f.image.size;
  return total;
}

namespace {

// A Unix socket listening at `path` (for CRIU or its plugin: owner only).
detail::Fd listen_at(const std::string& path, const char* what) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path)
    throw Error(Errc::invalid_argument, "the store's path is too long for " + std::string(what) + " " + path + "; use a store with a shorter path");
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  detail::Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) detail::throw_errno(errno, "cannot create " + std::string(what));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd.get(), 1) != 0)
    detail::throw_errno(errno, "cannot listen on " + std::string(what) + " " + path);
  ::chmod(path.c_str(), 0600);
  return fd;
}

}  // namespace

std::string ImageServer::start() {
  const std::string path = dir_ + "/" + kSocketName;
  listener_ = listen_at(path, "CRIU's image socket");
  if (fills()) {
    fill_path_ = dir_ + "/" + kFillSocketName;
    fill_listener_ = listen_at(fill_path_, "the plugin's page-fill socket");
    filler_ = std::thread([this] { fill_loop(); });
  }
  acceptor_ = std::thread([this] { accept_loop(); });
  return path;
}

void ImageServer::accept_loop() {
  sigset_t pipe_signal;
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);  // a CRIU gone makes writes fail, not kill us
  int sk;
  do {
    sk = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
  } while (sk < 0 && errno == EINTR);
  if (sk < 0) return;  // stopped before CRIU connected
  connection_ = sk;
  for (;;) {
    std::uint32_t len = 0;
    if (!read_all(sk, &len, 4) || len == 0 || len > 4096) break;
    std::string msg(len, '\0');
    if (!read_all(sk, msg.data(), len)) break;
    std::string file = request_filename(msg);
    bool exists = !file.empty() && file.find('/') == std::string::npos && file != "." && file != ".." &&
                  (paged_.count(file) || (file != kSocketName && detail::path_exists(dir_ + "/" + file)));
    std::string reply;
    put_u32(reply, 2);
    reply += std::string("\x08", 1) + (exists ? '\x01' : '\x00');
    if (!send_all(sk, reply)) break;
    if (!exists) continue;
    int pipe_fd = recv_fd(sk);
    if (pipe_fd < 0) break;
    std::lock_guard<std::mutex> g(mu_);
    servers_.emplace_back([this, file, pipe_fd] {
      sigset_t s;
      sigemptyset(&s);
      sigaddset(&s, SIGPIPE);
      pthread_sigmask(SIG_BLOCK, &s, nullptr);
      serve_file(file, pipe_fd);
      ::close(pipe_fd);
    });
  }
}

void ImageServer::serve_file(const std::string& file, int pipe_fd) {
  try {
    ::fcntl(pipe_fd, F_SETPIPE_SZ, 1 << 20);  // fewer, larger transfers (the system may allow less)
    if (auto it = paged_.find(file); it != paged_.end()) {
      std::uint64_t since_drop = 0;
      auto sink = [&](const char* p, std::size_t n) {
        vmsplice_all(pipe_fd, p, n);
        page_bytes_done_.fetch_add(n, std::memory_order_relaxed);
        if ((since_drop += n) >= (64u << 20)) {
          // What CRIU has been handed need not stay mapped here (the pipe
          // holds its pages): resident memory stays bounded.
          reader_->packs().drop_resident();
          since_drop = 0;
        }
      };
      Runs<decltype(sink)> runs(sink);
      for_each_page_image_piece(it->second.served, [&](const char* p, std::size_t n, bool zero) { runs.add(p, n, zero); });
      runs.flush();
      return;
    }
    const std::string path = dir_ + "/" + file;
    detail::Fd fd = detail::open_or_throw(path, O_RDONLY);
    for (;;) {
      ssize_t k = ::splice(fd.get(), nullptr, pipe_fd, nullptr, 1 << 20, 0);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0) detail::throw_errno(errno, "cannot pass " + path + " to CRIU");
      if (k == 0) break;
    }
  } catch (const Error& e) {
    // A damaged page is what to report; a pipe CRIU closed is only its consequence.
    std::lock_guard<std::mutex> g(mu_);
    if (!error_ || e.code() == Errc::corrupt) error_ = std::current_exception();
  }
}

std::exception_ptr ImageServer::stop() {
  // A listener and the thread serving its one connection: both woken, joined.
  auto end = [](detail::Fd& listener, std::atomic<int>& connection, std::thread& thread) {
    if (listener) ::shutdown(listener.get(), SHUT_RDWR);
    if (int sk = connection.exchange(-1); sk >= 0) {
      ::shutdown(sk, SHUT_RDWR);
      if (thread.joinable()) thread.join();
      ::close(sk);
    }
    if (thread.joinable()) thread.join();
  };
  end(listener_, connection_, acceptor_);
  end(fill_listener_, fill_connection_, filler_);
  fill_listener_ = detail::Fd();
  std::vector<std::thread> servers;
  {
    std::lock_guard<std::mutex> g(mu_);
    servers.swap(servers_);
  }
  for (auto& t : servers)
    t.join();
  listener_ = detail::Fd();
  std::lock_guard<std::mutex> g(mu_);
  return error_;
}

// ---- filling restored processes -------------------------------------------

void ImageServer::choose_fills() {
  // Each process's present ranges; a process shares none with another.
  struct Range {
    std::uint64_t start, end;
    PagedFile* owner;
  };
  std::vector<Range> ranges;
  for (auto& [file, f] : paged_) {
    const std::string& pm = f.image.pagemap;
    if (pm.rfind("pagemap-", 0) != 0 || pm.rfind("pagemap-shmem-", 0) == 0) continue;  // shared memory: CRIU's
    split_for_fill(f, "mm-" + pm.substr(8));
    for (auto& e : f.pagemap.entries)
      if (e.present) ranges.push_back({e.vaddr, e.vaddr + e.pages * kPageSize, &f});
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.start < b.start; });
  // Sweep: the range reaching furthest so far, and the furthest of another owner.
  Range far{0, 0, nullptr}, other{0, 0, nullptr};
  for (const Range& r : ranges) {
    const Range& rival = r.owner != far.owner ? far : other;
    if (rival.owner && rival.end > r.start) rival.owner->fill = r.owner->fill = false;  // CRIU may share these pages copy-on-write
    if (r.end > far.end) {
      if (r.owner != far.owner) other = far;
      far = r;
    } else if (r.owner != far.owner && r.end > other.end) {
      other = r;
    }
  }
  for (auto& [file, f] : paged_)
    if (!f.fill) {
      f.served = f.pagemap;
      f.filling = {};
    }
}

void ImageServer::split_for_fill(PagedFile& f, const std::string& mm) {
  auto it = region_at_.find(mm);
  if (it == region_at_.end()) return;
  std::string text;
  std::size_t checked = SIZE_MAX;
  auto sink = [&](const char* p, std::size_t n) { text.append(p, n); };
  Runs<decltype(sink)> runs(sink);
  for_each_piece(mm, 0, manifest_.regions[it->second].size, checked, [&](const char* p, std::size_t n, bool zero) { runs.add(p, n, zero); });
  runs.flush();
  std::vector<std::pair<std::uint64_t, std::uint64_t>> anon;
  if (!procpages::private_ranges(text.data(), text.size(), anon)) return;  // not understood: CRIU restores it all
  procpages::Pagemap served, filling;
  served.pages_id = filling.pages_id = f.pagemap.pages_id;
  auto part = [](procpages::Pagemap& to, const procpages::Entry& e, std::uint64_t a, std::uint64_t b) {
    if (a >= b) return;
    procpages::Entry x = e;
    x.vaddr = a;
    x.pages = (b - a) / kPageSize;
    to.entries.push_back(x);
  };
  std::size_t k = 0;
  for (auto& e : f.pagemap.entries) {
    if (!e.present) continue;
    std::uint64_t a = e.vaddr;
    const std::uint64_t end = e.vaddr + e.pages * kPageSize;
    while (k < anon.size() && anon[k].second <= a)
      ++k;
    for (std::size_t j = k; a < end && j < anon.size() && anon[j].first < end; ++j) {
      const std::uint64_t s = std::max(a, anon[j].first), t = std::min(end, anon[j].second);
      part(served, e, a, s);
      part(filling, e, s, t);
      a = t;
    }
    part(served, e, a, end);
  }
  f.served = std::move(served);
  f.filling = std::move(filling);
  f.fill = !f.filling.entries.empty();
}

bool ImageServer::fills() const {
  return std::any_of(paged_.begin(), paged_.end(), [](const auto& kv) { return kv.second.fill; });
}

std::vector<std::string> ImageServer::criu_env() const {
  if (fill_path_.empty()) return {};
  return {"DVR_CRIU_FILL=" + fill_path_};
}

bool ImageServer::all_filled() const {
  std::lock_guard<std::mutex> g(mu_);
  return std::all_of(paged_.begin(), paged_.end(), [](const auto& kv) { return !kv.second.fill || kv.second.filled; });
}

namespace {

// The PID `pid` has in its innermost PID namespace (what CRIU's images name).
pid_t innermost_pid(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("NSpid:", 0) == 0) {
      std::istringstream f(line.substr(6));
      pid_t last = -1;
      for (pid_t x; f >> x;)
        last = x;
      return last;
    }
  return -1;
}

// Writes [p, p+n) at `addr` of process `pid`: process_vm_writev, and
// /proc/PID/mem (opened on first need into *mem) where the mapping is not
// writable (CRIU maps it read-only already).
void write_remote(pid_t pid, int* mem, const char* p, std::uint64_t addr, std::size_t n) {
  while (n) {
    iovec local{const_cast<char*>(p), n}, remote{reinterpret_cast<void*>(addr), n};
    ssize_t k = ::process_vm_writev(pid, &local, 1, &remote, 1, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      if (k < 0 && errno != EFAULT) detail::throw_errno(errno, "cannot write the memory of restored process " + std::to_string(pid));
      if (*mem < 0) *mem = ::open(("/proc/" + std::to_string(pid) + "/mem").c_str(), O_RDWR | O_CLOEXEC);
      const std::size_t page = std::min<std::size_t>(n, kPageSize - addr % kPageSize);  // the page that refused
      k = *mem < 0 ? -1 : ::pwrite(*mem, p, page, static_cast<off_t>(addr));
      if (k <= 0) {
        std::ostringstream where;
        where << std::hex << addr;
        throw Error(Errc::io, "cannot write the memory of restored process " + std::to_string(pid) + " at 0x" + where.str() + ": " +
                                  std::strerror(k < 0 ? errno : EFAULT));
      }
    }
    p += k;
    addr += static_cast<std::uint64_t>(k);
    n -= static_cast<std::size_t>(k);
  }
}

}  // namespace

void ImageServer::fill_process(PagedFile& f, pid_t pid) {
  // Work items: each window's part of an entry, at its address.
  struct Item {
    std::uint64_t addr, in, n;
    std::string region;
  };
  std::vector<Item> items;
  for (auto& e : f.filling.entries) {
    if (!e.present) continue;
    std::uint64_t a = e.vaddr, left = e.pages * kPageSize;
    while (left) {
      const std::uint64_t start = a / procpages::kWindow * procpages::kWindow, in = a - start;
      const std::uint64_t n = std::min(left, procpages::kWindow - in);
      items.push_back({a, in, n, procpages::window_region(f.pagemap.pages_id, start)});
      a += n;
      left -= n;
    }
  }
  std::atomic<std::size_t> next{0};
  std::mutex err_mu;
  std::exception_ptr err;
  auto work = [&] {
    int mem = -1;
    try {
      for (std::size_t k; (k = next.fetch_add(1)) < items.size();) {
        const Item& it = items[k];
        std::uint64_t at = it.addr;
        auto sink = [&](const char* p, std::size_t n) {
          write_remote(pid, &mem, p, at, n);
          at += n;
          page_bytes_done_.fetch_add(n, std::memory_order_relaxed);
          if (since_drop_.fetch_add(n) + n >= (64u << 20)) {
            since_drop_ = 0;
            reader_->packs().drop_resident();  // what was copied need not stay mapped here
          }
        };
        Runs<decltype(sink)> runs(sink);
        std::size_t checked = SIZE_MAX;  // every chunk checked before any of its bytes is written
        for_each_piece(it.region, it.in, it.n, checked, [&](const char* p, std::size_t n, bool zero) { runs.add(p, n, zero); });
        runs.flush();
      }
    } catch (...) {
      next = items.size();  // the others stop too
      std::lock_guard<std::mutex> g(err_mu);
      if (!err) err = std::current_exception();
    }
    if (mem >= 0) ::close(mem);
  };
  const unsigned cpus = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
  std::vector<std::thread> helpers;
  for (unsigned k = 1; k < cpus && k < items.size(); ++k)
    helpers.emplace_back(work);
  work();
  for (auto& t : helpers)
    t.join();
  if (err) std::rethrow_exception(err);
}

void ImageServer::fill_loop() {
  sigset_t pipe_signal;
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
  int sk;
  do {
    sk = ::accept4(fill_listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
  } while (sk < 0 && errno == EINTR);
  if (sk < 0) return;
  fill_connection_ = sk;
  for (;;) {
    std::int32_t pid = 0;
    if (!read_all(sk, &pid, sizeof pid)) break;
    std::int32_t status = 0;
    try {
      const pid_t vpid = pid > 0 ? innermost_pid(pid) : -1;
      if (vpid <= 0) throw Error(Errc::io, "the plugin asked to fill process " + std::to_string(pid) + ", which is not there");
      for (auto& [file, f] : paged_)
        if (f.fill && f.image.pagemap == "pagemap-" + std::to_string(vpid) + ".img") {
          if (f.filled) throw Error(Errc::io, "the plugin asked to fill process " + std::to_string(pid) + " twice");
          const auto t0 = std::chrono::steady_clock::now();
          fill_process(f, pid);
          std::uint64_t bytes = 0;
          for (auto& e : f.filling.entries)
            bytes += e.pages * kPageSize;
          if (detail::log_enabled(LogLevel::info))
            detail::log_write(LogLevel::info, "filled " + std::to_string(bytes) + " bytes of " + f.image.pages + " into restored process " +
                                                std::to_string(pid) + " in " +
                                                std::to_string(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()) + " s");
          std::lock_guard<std::mutex> g(mu_);
          f.filled = true;
        }
    } catch (const Error& e) {
      status = 1;
      std::lock_guard<std::mutex> g(mu_);
      if (!error_ || e.code() == Errc::corrupt) error_ = std::current_exception();
    } catch (...) {
      status = 1;
      std::lock_guard<std::mutex> g(mu_);
      if (!error_) error_ = std::current_exception();
    }
    if (!send_all(sk, std::string(reinterpret_cast<const char*>(&status), sizeof status))) break;
  }
}

bool ImageServer::fill_supported(std::string* why) {
  static std::once_flag once;
  static std::string failure;
  std::call_once(once, [] {
    if (const char* e = std::getenv("DVR_PROC_PAGE_FILL"); e && std::string(e) == "0") {
      failure = "$DVR_PROC_PAGE_FILL=0";
      return;
    }
    // A child stopped with a writable and a read-only page, as CRIU leaves a restored task.
    void* rw = ::mmap(nullptr, 2 * kPageSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (rw == MAP_FAILED) {
      failure = std::string("cannot map memory for the probe: ") + std::strerror(errno);
      return;
    }
    char* ro = static_cast<char*>(rw) + kPageSize;
    ::mprotect(ro, kPageSize, PROT_READ);
    pid_t child = ::fork();
    if (child == 0) {
      ::raise(SIGSTOP);
      ::_exit(static_cast<char*>(rw)[0] == 'w' && ro[0] == 'r' ? 0 : 1);
    }
    if (child < 0) {
      failure = std::string("cannot fork for the probe: ") + std::strerror(errno);
      ::munmap(rw, 2 * kPageSize);
      return;
    }
    int st = 0;
    ::waitpid(child, &st, WUNTRACED);
    iovec l{const_cast<char*>("w"), 1}, r{rw, 1};
    if (::process_vm_writev(child, &l, 1, &r, 1, 0) != 1) failure = std::string("process_vm_writev failed: ") + std::strerror(errno);
    int mem = ::open(("/proc/" + std::to_string(child) + "/mem").c_str(), O_RDWR | O_CLOEXEC);
    if (failure.empty() && (mem < 0 || ::pwrite(mem, "r", 1, static_cast<off_t>(reinterpret_cast<std::uintptr_t>(ro))) != 1))
      failure = std::string("writing a read-only page through /proc/PID/mem failed (") + std::strerror(errno) +
                "; the kernel's proc_mem.force_override may forbid it)";
    if (mem >= 0) ::close(mem);
    ::kill(child, SIGCONT);
    while (::waitpid(child, &st, 0) < 0 && errno == EINTR) {
    }
    if (failure.empty() && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) failure = "the probe's child did not see what was written";
    ::munmap(rw, 2 * kPageSize);
  });
  if (why) *why = failure;
  return failure.empty();
}

}  // namespace dvr::proc::impl
