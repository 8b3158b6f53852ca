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
//
// Filling (`fill`): CRIU reading pages from a pipe is slower than from files
// (it premaps every private mapping and copies on one CPU), so a process's
// page image can instead be left out of what CRIU gets (its pagemap served
// without present entries, its pages image empty) and written by dvr straight
// into the restored process once CRIU has laid out its memory: the plugin's
// RESUME_DEVICES_LATE hook, run while every task is stopped before it
// resumes, sends the task's PID over WORKDIR/page-fill.sock ({i32 pid}) and
// waits for {i32 status, 0: filled}; dvr checks every chunk, then writes the
// pages with process_vm_writev on as many threads as there are CPUs (and
// through /proc/PID/mem where the mapping is not writable). On a failure the
// plugin kills the task before it runs. Only processes whose pages no other
// process of the tree has at the same addresses are filled (CRIU shares those
// copy-on-write between parent and child); the others go through CRIU.
#pragma once

#include <sys/types.h>

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
  /// With `fill`, the page images of the processes that can be are filled
  /// into the restored processes instead of served (see above; start() then
  /// listens for the plugin too). Throws corrupt (a damaged snapshot, naming
  /// what), io.
  ImageServer(Store& store, const std::string& name, const std::string& dir, bool fill = false);
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

  /// Whether some page image is filled rather than served; what CRIU's
  /// environment needs then (DVR_CRIU_FILL=socket, for the plugin), set once
  /// start() ran.
  bool fills() const;
  std::vector<std::string> criu_env() const;
  /// Whether every page image to be filled was (once CRIU is done).
  bool all_filled() const;
  /// Whether this host lets dvr write a stopped process's memory the way
  /// filling does (process_vm_writev, and /proc/PID/mem into a read-only
  /// private mapping); `why` tells what failed. Probed once per process.
  static bool fill_supported(std::string* why = nullptr);

  /// Bytes of the page images (what CRIU's restore reads most of), and how
  /// many of them were handed to CRIU or written so far (any thread).
  std::uint64_t page_image_bytes() const;
  std::uint64_t page_bytes_done() const { return page_bytes_done_.load(std::memory_order_relaxed); }

 private:
  struct PagedFile {
    PagedImage image;
    detail::procpages::Pagemap pagemap;
    // With filling: the present entries CRIU gets (served) and those dvr
    // writes into the process (filling), split where its mappings end.
    detail::procpages::Pagemap served, filling;
    bool fill = false;    // some of it is written into the process, not served
    bool filled = false;  // and it was
  };
  // Calls emit(bytes, n, zero) for `len` bytes of region `region` from
  // `offset` (zero: n zero bytes, bytes null), each chunk checked before any
  // of its bytes is emitted unless it is `checked` (updated: the last chunk
  // checked).
  template <class Emit>
  void for_each_piece(const std::string& region, std::uint64_t offset, std::uint64_t len, std::size_t& checked, Emit&& emit);
  template <class Emit>
  void for_each_page_image_piece(const detail::procpages::Pagemap& pm, Emit&& emit);
  void write_region_file(const std::string& region, const std::string& path);
  void choose_fills();
  void split_for_fill(PagedFile& f, const std::string& mm);
  void accept_loop();
  void serve_file(const std::string& filename, int pipe_fd);
  void fill_loop();
  void fill_process(PagedFile& f, pid_t pid);

  std::string name_, dir_;
  std::unique_ptr<detail::SnapshotReader> reader_;
  detail::Manifest manifest_;
  std::map<std::string, std::size_t> region_at_;  // region name -> index in manifest_.regions
  Meta meta_;
  std::map<std::string, PagedFile> paged_;  // pages-ID.img -> how to assemble it

  detail::Fd listener_;
  std::atomic<int> connection_{-1};
  std::thread acceptor_;
  mutable std::mutex mu_;
  std::vector<std::thread> servers_;
  std::exception_ptr error_;
  std::atomic<std::uint64_t> page_bytes_done_{0};
  std::atomic<std::uint64_t> since_drop_{0};
  std::string fill_path_;
  detail::Fd fill_listener_;
  std::atomic<int> fill_connection_{-1};
  std::thread filler_;
};

}  // namespace dvr::proc::impl
