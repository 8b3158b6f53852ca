// Serving a process snapshot's images to `criu restore --stream` (CRIU's image
// streamer protocol, criu/img-streamer.c), so that page images are never
// written out: CRIU reads them from pipes that dvr fills straight from the
// store's pack files with vmsplice, every page checked against its checksum
// as it is served.
//
// The protocol: CRIU connects to WORKDIR/streamer-serve.sock; for every image
// it opens it sends {u32 length, ImgStreamerRequestEntry{filename}} and reads
// {u32 length, ImgStreamerReplyEntry{exists}}; when the file exists it sends
// the write end of a pipe (SCM_RIGHTS) and reads the file from the read end.
//
// Images other than page images (small: cores, mms, files, the plugin's heap
// image, which the plugin reads from the directory itself) are written into
// the work directory first and served from there; page images stored as
// windows (proc_pages.hpp) are assembled as they are read, in their pagemap's
// order. ImageServer::write_page_images() writes them as files instead, for a
// CRIU that does not stream (older than 4.2, or $DVR_PROC_PAGE_IMAGES=1).
#pragma once

#include <atomic>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/os.hpp"
#include "dvr/store.hpp"
#include "format/manifest.hpp"
#include "proc/metadata.hpp"
#include "proc/proc_pages.hpp"

namespace dvr::detail {
class SnapshotReader;
}

namespace dvr::proc::impl {

class ImageServer {
 public:
  /// Reads proc/`name`'s manifest and metadata (checked) and writes its
  /// image files other than page images into `dir`. While it lives, the
  /// snapshot's data cannot be freed (a shared store lock); destroy it
  /// before anything in this process removes snapshots of the store.
  /// Throws corrupt (a damaged snapshot, naming what), io.
  ImageServer(Store& store, const std::string& name, const std::string& dir);
  ~ImageServer();
  ImageServer(const ImageServer&) = delete;
  ImageServer& operator=(const ImageServer&) = delete;

  const Meta& meta() const { return meta_; }

  /// Writes the page images into the directory too (no streaming).
  void write_page_images();

  /// Listens on DIR/streamer-serve.sock and serves CRIU in the background;
  /// returns the socket's path.
  std::string start();
  /// Stops serving (after CRIU exited); returns what went wrong serving (a
  /// damaged page: corrupt), null when nothing did.
  std::exception_ptr stop();

  /// Bytes of the page images (what CRIU's restore reads most of), and how
  /// many of them were handed to CRIU or written so far (any thread).
  std::uint64_t page_image_bytes() const;
  std::uint64_t page_bytes_done() const { return page_bytes_done_.load(std::memory_order_relaxed); }

 private:
  struct PagedFile {
    PagedImage image;
    detail::procpages::Pagemap pagemap;
  };
  // Calls emit(bytes, n, zero) for `len` bytes of region `region` from
  // `offset` (zero: n zero bytes, bytes null), each chunk checked before any
  // of its bytes is emitted unless it is `checked` (updated: the last chunk
  // checked).
  template <class Emit>
  void for_each_piece(const std::string& region, std::uint64_t offset, std::uint64_t len, std::size_t& checked, Emit&& emit);
  template <class Emit>
  void for_each_page_image_piece(const PagedFile& f, Emit&& emit);
  void write_region_file(const std::string& region, const std::string& path);
  void accept_loop();
  void serve_file(const std::string& filename, int pipe_fd);

  std::string name_, dir_;
  std::unique_ptr<detail::SnapshotReader> reader_;
  detail::Manifest manifest_;
  std::map<std::string, std::size_t> region_at_;  // region name -> index in manifest_.regions
  Meta meta_;
  std::map<std::string, PagedFile> paged_;  // pages-ID.img -> how to assemble it

  detail::Fd listener_;
  std::atomic<int> connection_{-1};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<std::thread> servers_;
  std::exception_ptr error_;
  std::atomic<std::uint64_t> page_bytes_done_{0};
};

}  // namespace dvr::proc::impl
