// A dump's memory pages received straight into the store: dvr is the page
// server of `criu dump --page-server --ps-socket FD` (CRIU >= 4.2).
//
// CRIU then writes no pagemap or pages images: it sends every pagemap entry
// (vaddr, page count, flags) followed by its pages over the socket, one
// pagemap after the other. PageStream lays the pages out as windows of the
// address space (proc_pages.hpp) as they arrive, a few windows in memory at a
// time, and writes each batch into snapshot proc/NAME with a SnapshotWriter,
// comparing it page by page with the same window of the previous dump. What it
// stores is what track_page_images() stores from image files: the windows, and
// each pagemap as the image CRIU would have written (encode_pagemap), so that
// restore does not tell the two apart. Memory use is bounded by the batch
// (two batches of kBatchWindows windows), whatever the size of the job.
//
// The protocol (CRIU's criu/page-xfer.c): a 32-byte header {u32 cmd (flags in
// the high 16 bits), u64 nr_pages, u64 vaddr, u64 dst_id (id << 8 | type)}
// per message; OPEN2 (answered with one byte: has a parent), ADD_F (followed
// by the pages when PE_PRESENT), PARENT (answered with an int), CLOSE and
// FORCE_CLOSE (answered with an int32 status, 0). Anything else is an error.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <thread>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/mapping.hpp"
#include "base/os.hpp"
#include "dvr/store.hpp"
#include "proc/metadata.hpp"
#include "proc/proc_pages.hpp"
#include "store/writer.hpp"

namespace dvr::detail {
class ProgressMeter;
}

namespace dvr::proc::impl {

class PageStream {
 public:
  /// Windows in one batch (64 MiB): one batch is written on a thread of its
  /// own while the next is received.
  static constexpr std::size_t kBatchWindows = 16;
  /// Window buffers made after this many bytes of pages are populated at once.
  static constexpr std::uint64_t kPopulateAfter = 16u << 20;

  /// Snapshot proc/`name` of `store` with `label`, compared with
  /// proc/`parent` ("" none). Makes the socket pair; nothing is locked until
  /// the first message.
  PageStream(Store& store, std::string name, std::string parent, std::string label);
  ~PageStream();
  PageStream(const PageStream&) = delete;
  PageStream& operator=(const PageStream&) = delete;

  /// The socket CRIU is given (--ps-socket): inherited by its process.
  int criu_socket() const { return criu_.get(); }
  /// Our copy of CRIU's socket closed (once CRIU has it or is gone): then
  /// serve() sees the end of the stream when CRIU exits.
  void close_criu_socket() { criu_ = detail::Fd(); }

  /// Serves CRIU until it closes the stream. When storing fails (a full
  /// store, a malformed message), the rest of the stream is read and dropped
  /// so that CRIU completes, and error() tells why; serve() itself throws
  /// only when the socket fails.
  void serve();
  /// Pages received count into `meter` (on the thread that serves); when its
  /// callback throws, storing fails as any other error does (error()).
  void set_progress(detail::ProgressMeter* meter) { progress_ = meter; }
  /// What went wrong while serving (null: nothing).
  std::exception_ptr error() const { return error_; }
  /// Whether CRIU said it was done (CLOSE): the stream is complete.
  bool complete() const { return closed_; }

  /// The page images received, for the metadata (pages-ID.img, the pagemap
  /// region, the pages' bytes).
  const std::vector<PagedImage>& paged_images() const { return images_; }
  std::uint64_t page_bytes() const { return page_bytes_; }

  /// After CRIU succeeded: adds `files` (the other images, and the
  /// metadata, as regions) and publishes the snapshot, and gives the store
  /// back (the stream holds its writers' lock from the first message). Throws
  /// what serving met, or what storing these meets; nothing is published then.
  SnapshotInfo finish(const std::vector<detail::RegionSource>& files);

 private:
  struct Window {
    std::uint64_t start = 0;  // in the dumped address space
    std::uint64_t filled = 0; // bytes from the start that hold their final content
    char* data = nullptr;
    detail::ByteRanges zero;  // pages CRIU sent none of: they read zero, and the writer need not read them
  };
  struct Header;

  void begin();  // the batch and writer, on the first message
  void open_pagemap(std::uint64_t dst_id);
  void close_pagemap();
  void add(std::uint64_t vaddr, std::uint64_t pages, std::uint32_t flags);
  void receive_pages(std::uint64_t vaddr, std::uint64_t bytes);
  Window& window_for(std::uint64_t start);
  // Pages [from, to) of `w` hold no page of the process: they must read zero.
  void absent(Window& w, std::uint64_t from, std::uint64_t to);
  void flush();  // hands the pending windows to the writer's thread
  void write_batches();  // the writer's thread
  void wait_written();   // until every batch handed over is stored; rethrows what storing met
  void stop_writer();
  void read_exact(void* to, std::size_t n);
  void write_exact(const void* from, std::size_t n);
  void drop(std::uint64_t bytes);

  detail::StoreImpl& store_;
  std::string name_, parent_, label_;
  detail::Fd ours_, criu_;
  std::optional<detail::WriteBatch> batch_;
  std::optional<detail::SnapshotWriter> writer_;
  std::optional<detail::Manifest> base_;
  std::vector<detail::Mapping> buffers_;  // 2 * kBatchWindows windows at most, reused
  // The writer's thread and what it shares with the receiving one (mu_).
  std::thread writer_thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<detail::RegionSource> queued_;  // the batch handed over, not yet taken
  std::vector<char*> free_;                  // window buffers to fill
  // Per window buffer, its pages written since it was mapped (the others
  // read zero without being touched); only the receiving thread uses it.
  std::map<const char*, std::vector<std::uint8_t>> dirty_;
  bool writing_ = false, stop_ = false;
  std::exception_ptr write_error_;
  std::vector<Window> pending_;
  bool open_ = false, closed_ = false;
  std::string image_name_;  // of the pagemap open
  detail::procpages::Pagemap pm_;
  std::uint32_t next_pages_id_ = 1;
  std::vector<PagedImage> images_;
  std::vector<std::string> pagemaps_;  // encoded, stored with finish()
  std::uint64_t page_bytes_ = 0, chunks_read_ = 0;
  detail::ProgressMeter* progress_ = nullptr;
  std::uint64_t left_ = 0;  // bytes of the current message's pages not read yet
  std::exception_ptr error_;
};

}  // namespace dvr::proc::impl
