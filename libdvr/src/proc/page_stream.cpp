// A dump's pages received from CRIU straight into the store (page_stream.hpp).
#include "base/progress.hpp"
#include "proc/page_stream.hpp"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include "base/hash.hpp"
#include "dvr/proc.hpp"
#include "store/store_impl.hpp"

namespace dvr::proc::impl {

namespace {

using detail::kPageSize;
namespace procpages = detail::procpages;

constexpr std::uint32_t kOpen = 3, kOpen2 = 4, kParent = 5, kAddF = 6, kAdd = 1, kHole = 2, kClose = 0x1023, kForceClose = 0x1024;
constexpr std::uint32_t kTypePid = 1, kTypeShmem = 2;
// Bounds on what one message may claim (a malformed stream is refused, not allocated for).
constexpr std::uint64_t kMaxAddress = 1ull << 57;

}  // namespace

struct PageStream::Header {
  std::uint32_t cmd;
  std::uint64_t nr_pages;
  std::uint64_t vaddr;
  std::uint64_t dst_id;
};

PageStream::PageStream(Store& store, std::string name, std::string parent, std::string label)
    : store_(detail::impl_of(store)), name_(std::move(name)), parent_(std::move(parent)), label_(std::move(label)) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) detail::throw_errno(errno, "cannot create a socket pair for CRIU's pages");
  ours_ = detail::Fd(sv[0]);
  criu_ = detail::Fd(sv[1]);
  // Large socket buffers: CRIU splices up to a pipe's worth at a time.
  int size = 4 << 20;
  ::setsockopt(sv[0], SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
  ::setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
}

PageStream::~PageStream() { stop_writer(); }

void PageStream::read_exact(void* to, std::size_t n) {
  auto* p = static_cast<char*>(to);
  while (n > 0) {
    ssize_t got = ::recv(ours_.get(), p, n, MSG_WAITALL);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) detail::throw_errno(errno, "cannot read CRIU's page stream");
    if (got == 0) throw Error(Errc::io, "CRIU's page stream ended in the middle of a message (did CRIU fail? see its log)");
    p += got;
    n -= static_cast<std::size_t>(got);
  }
}

void PageStream::write_exact(const void* from, std::size_t n) {
  auto* p = static_cast<const char*>(from);
  while (n > 0) {
    ssize_t put = ::send(ours_.get(), p, n, MSG_NOSIGNAL);
    if (put < 0 && errno == EINTR) continue;
    if (put < 0) detail::throw_errno(errno, "cannot answer CRIU's page stream");
    p += put;
    n -= static_cast<std::size_t>(put);
  }
}

void PageStream::drop(std::uint64_t bytes) {
  static thread_local char sink[1 << 16];
  while (bytes > 0) {
    std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(bytes, sizeof sink));
    read_exact(sink, n);
    bytes -= n;
  }
}

void PageStream::begin() {
  if (batch_) return;
  // Only now: CRIU's plugin has snapshotted the DVR heaps (they may live in
  // this store) before the first page is sent.
  batch_.emplace(store_);
  writer_.emplace(*batch_, kImageSession, name_, detail::WriterOptions{.label = label_, .parent = parent_, .own_buffers = true});
  writer_->seal();
  writer_->release_written(true);  // what is stored need not stay mapped here
  if (!parent_.empty()) {
    try {
      base_ = store_.load_manifest(kImageSession, parent_);
      if (!writer_->use_base(&*base_)) base_.reset();
    } catch (const Error&) {
      base_.reset();  // damaged or gone: everything is stored anew
    }
  }
  buffers_.reserve(2 * kBatchWindows);
  writer_thread_ = std::thread([this] { write_batches(); });
}

// The writer's thread: stores each batch handed over while the next one is
// received (two batches of windows in memory at most).
void PageStream::write_batches() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !queued_.empty(); });
    if (queued_.empty()) return;
    std::vector<detail::RegionSource> sources = std::move(queued_);
    queued_.clear();
    writing_ = true;
    const bool failed = static_cast<bool>(write_error_);
    lk.unlock();
    if (!failed) try {
        for (auto& r : sources) {
          if (!base_) break;
          for (auto& br : base_->regions)
            if (br.name == r.name && br.size == r.size) {
              r.written = detail::pages_differing(store_.threads, *base_, br, r.data, r.size, r.zero);
              break;
            }
        }
        chunks_read_ += detail::write_regions(*writer_, sources, base_ ? &*base_ : nullptr);
        store_.packs->drop_resident();  // stored chunks compared with these need not stay mapped either
      } catch (...) {
        std::lock_guard<std::mutex> g(mu_);
        write_error_ = std::current_exception();
      }
    lk.lock();
    for (auto& r : sources)
      free_.push_back(const_cast<char*>(r.data));
    writing_ = false;
    cv_.notify_all();
  }
}

void PageStream::wait_written() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return queued_.empty() && !writing_; });
  if (write_error_) std::rethrow_exception(write_error_);
}

void PageStream::stop_writer() {
  if (!writer_thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  writer_thread_.join();
}

void PageStream::open_pagemap(std::uint64_t dst_id) {
  close_pagemap();
  const std::uint32_t type = static_cast<std::uint32_t>(dst_id & 0xff);
  const std::uint64_t id = dst_id >> 8;
  if (type == kTypePid)
    image_name_ = "pagemap-" + std::to_string(id) + ".img";
  else if (type == kTypeShmem)
    image_name_ = "pagemap-shmem-" + std::to_string(id) + ".img";
  else
    throw Error(Errc::corrupt, "CRIU's page stream opened a pagemap of unknown type " + std::to_string(type));
  pm_ = procpages::Pagemap{};
  pm_.pages_id = next_pages_id_++;
  open_ = true;
}

void PageStream::close_pagemap() {
  if (!open_) return;
  flush();
  open_ = false;
  const std::uint64_t bytes = pm_.present_bytes();
  pagemaps_.push_back(procpages::encode_pagemap(pm_));
  images_.push_back({"pages-" + std::to_string(pm_.pages_id) + ".img", image_name_, bytes});
}

PageStream::Window& PageStream::window_for(std::uint64_t start) {
  if (!pending_.empty() && pending_.back().start == start) return pending_.back();
  if (!pending_.empty()) {
    Window& last = pending_.back();
    absent(last, last.filled, procpages::kWindow);
    last.filled = procpages::kWindow;
  }
  if (pending_.size() == kBatchWindows) flush();
  char* data = nullptr;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (free_.empty() && buffers_.size() == 2 * kBatchWindows) cv_.wait(lk, [&] { return !free_.empty(); });
    if (!free_.empty()) {
      data = free_.back();
      free_.pop_back();
    }
  }
  if (!data) {
    // In a dump that has brought 16 MiB already, the buffers will be written
    // over and over (pages scattered over many windows land at scattered
    // places of each): populating a new one at once costs a fraction of a
    // page fault per page, which on a VM with shadow page tables costs
    // 5-10 us (docs/performance.md, "Unmodified programs").
    const int populate = page_bytes_ >= kPopulateAfter ? MAP_POPULATE : 0;
    buffers_.push_back(detail::Mapping::anonymous(procpages::kWindow, "for a window of CRIU's pages", PROT_READ | PROT_WRITE, populate));
    data = static_cast<char*>(buffers_.back().data());
  }
  pending_.push_back({start, 0, data, {}});
  return pending_.back();
}

void PageStream::absent(Window& w, std::uint64_t from, std::uint64_t to) {
  if (from >= to) return;
  // Only what an earlier window left in this buffer is zeroed: a buffer's
  // pages never written read zero already, and touching them would cost a
  // page fault each (most of a window is absent in a dump of few pages).
  auto& dirty = dirty_[w.data];
  dirty.resize(procpages::kWindow / kPageSize, 0);
  for (std::uint64_t p = from / kPageSize; p * kPageSize < to; ++p)
    if (dirty[p]) {
      std::memset(w.data + p * kPageSize, 0, kPageSize);
      dirty[p] = 0;
    }
  if (!w.zero.empty() && w.zero.back().second == from)
    w.zero.back().second = to;
  else
    w.zero.emplace_back(from, to);
}

void PageStream::receive_pages(std::uint64_t vaddr, std::uint64_t bytes) {
  while (bytes > 0) {
    const std::uint64_t start = vaddr / procpages::kWindow * procpages::kWindow, in = vaddr - start;
    const std::uint64_t len = std::min(bytes, procpages::kWindow - in);
    Window& w = window_for(start);
    if (in < w.filled) throw Error(Errc::corrupt, "CRIU's page stream sent a page twice or out of order");
    absent(w, w.filled, in);
    read_exact(w.data + in, len);
    auto& dirty = dirty_[w.data];
    dirty.resize(procpages::kWindow / kPageSize, 0);
    std::fill(dirty.begin() + static_cast<std::ptrdiff_t>(in / kPageSize), dirty.begin() + static_cast<std::ptrdiff_t>((in + len) / kPageSize), 1);
    left_ -= len;
    w.filled = in + len;
    page_bytes_ += len;
    if (progress_) progress_->add(len);  // throws what the callback throws: storing fails
    vaddr += len;
    bytes -= len;
  }
}

void PageStream::add(std::uint64_t vaddr, std::uint64_t pages, std::uint32_t flags) {
  if (!open_) throw Error(Errc::corrupt, "CRIU's page stream sent pages before opening a pagemap");
  if (vaddr % kPageSize || pages == 0 || pages > kMaxAddress / kPageSize || vaddr > kMaxAddress - pages * kPageSize)
    throw Error(Errc::corrupt, "CRIU's page stream sent a malformed pagemap entry");
  if (!pm_.entries.empty() && vaddr < pm_.entries.back().vaddr + pm_.entries.back().pages * kPageSize)
    throw Error(Errc::corrupt, "CRIU's page stream sent pagemap entries out of order");
  if (flags & procpages::kPeParent)
    throw Error(Errc::unsupported, "CRIU's page stream sent pages kept in a parent dump, which dvr never offers");
  procpages::Entry e;
  e.vaddr = vaddr;
  e.pages = pages;
  e.flags = flags;
  e.present = (flags & procpages::kPePresent) != 0;
  pm_.entries.push_back(e);
}

void PageStream::flush() {
  if (pending_.empty()) return;
  Window& last = pending_.back();
  absent(last, last.filled, procpages::kWindow);
  last.filled = procpages::kWindow;
  std::vector<detail::RegionSource> sources;
  sources.reserve(pending_.size());
  for (auto& w : pending_) {
    detail::RegionSource r;
    r.name = procpages::window_region(pm_.pages_id, w.start);
    r.data = w.data;
    r.size = procpages::kWindow;
    r.zero = std::move(w.zero);
    sources.push_back(std::move(r));
  }
  pending_.clear();
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return queued_.empty(); });  // the writer took the previous batch
  if (write_error_) {
    for (auto& r : sources)
      free_.push_back(const_cast<char*>(r.data));
    std::rethrow_exception(write_error_);
  }
  queued_ = std::move(sources);
  cv_.notify_all();
}

void PageStream::serve() {
  static_assert(sizeof(Header) == 32, "CRIU's struct page_server_iov on 64-bit Linux");
  Header h{};
  for (;;) {
    ssize_t got = ::recv(ours_.get(), &h, sizeof h, MSG_WAITALL);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) detail::throw_errno(errno, "cannot read CRIU's page stream");
    if (got == 0) return;  // CRIU is gone (complete() tells whether it said so)
    if (static_cast<std::size_t>(got) != sizeof h) throw Error(Errc::io, "CRIU's page stream ended in the middle of a message");
    const std::uint32_t cmd = h.cmd & 0xffff, flags = h.cmd >> 16;
    const bool has_pages = (cmd == kAddF && (flags & procpages::kPePresent)) || cmd == kAdd;
    if (has_pages && h.nr_pages > kMaxAddress / kPageSize) throw Error(Errc::io, "CRIU's page stream is malformed (a message claims " + std::to_string(h.nr_pages) + " pages)");
    switch (cmd) {
      case kOpen:
      case kOpen2:
        if (!error_) try {
            begin();
            open_pagemap(h.dst_id);
          } catch (...) {
            error_ = std::current_exception();
          }
        if (cmd == kOpen2) {
          const char has_parent = 0;
          write_exact(&has_parent, 1);
        }
        break;
      case kParent: {
        const int has_parent = 0;
        write_exact(&has_parent, sizeof has_parent);
        break;
      }
      case kAddF:
      case kAdd:
      case kHole:
        left_ = has_pages ? h.nr_pages * kPageSize : 0;
        if (!error_) try {
            add(h.vaddr, h.nr_pages, cmd == kAddF ? flags : cmd == kAdd ? procpages::kPePresent : procpages::kPeParent);
            if (has_pages) receive_pages(h.vaddr, left_);
          } catch (...) {
            error_ = std::current_exception();
          }
        drop(left_);  // what was not received (after an error: the rest of the stream is read and dropped)
        break;
      case kClose:
      case kForceClose: {
        if (!error_) try {
            close_pagemap();
          } catch (...) {
            error_ = std::current_exception();
          }
        const std::int32_t status = 0;
        write_exact(&status, sizeof status);
        closed_ = true;
        return;
      }
      default:
        // Nothing more can be understood of the stream: end it (CRIU fails).
        error_ = std::make_exception_ptr(Error(Errc::unsupported, "CRIU's page stream sent command " + std::to_string(cmd) + ", which dvr does not know"));
        ours_ = detail::Fd();
        return;
    }
  }
}

SnapshotInfo PageStream::finish(const std::vector<detail::RegionSource>& files) {
  if (error_) std::rethrow_exception(error_);
  if (!closed_) throw Error(Errc::io, "CRIU's page stream ended before CRIU said it was complete");
  begin();
  wait_written();
  stop_writer();
  std::vector<detail::RegionSource> rest = files;
  for (std::size_t k = 0; k < images_.size(); ++k) {
    detail::RegionSource r;
    r.name = images_[k].pagemap;
    r.data = pagemaps_[k].data();
    r.size = pagemaps_[k].size();
    rest.push_back(std::move(r));
  }
  chunks_read_ += detail::write_regions(*writer_, rest, base_ ? &*base_ : nullptr);
  writer_->set_provenance(false, chunks_read_);
  SnapshotInfo si = batch_->publish({&*writer_}).front();
  // The store is given back at once: the caller reads it next.
  writer_.reset();
  base_.reset();
  batch_.reset();
  buffers_.clear();
  dirty_.clear();
  return si;
}

}  // namespace dvr::proc::impl
