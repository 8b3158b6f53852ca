#include "format/pack.hpp"

#include <fcntl.h>
#include <libpmem2.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <cstring>

#include "base/memops.hpp"
#include "base/os.hpp"
#include "base/env.hpp"
#include "base/log.hpp"
#include "base/sigbus.hpp"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack it
#endif
#ifndef RAMFS_MAGIC
#define RAMFS_MAGIC 0x858458f6
#endif

namespace dvr::detail {
namespace {

constexpr char kPackMagic[8] = {'D', 'V', 'R', 'P', 'A', 'C', 'K', '1'};

std::string pmem2_error(const std::string& what) { return what + ": libpmem2: " + pmem2_errormsg(); }

// One libpmem2 mapping of a file range, released on scope exit.
class Pmem2Map {
 public:
  Pmem2Map(int fd, std::uint64_t offset, std::uint64_t length, const std::string& path) {
    int rc = 0;
    bool ok = pmem2_config_new(&cfg_) == 0 && pmem2_source_from_fd(&src_, fd) == 0 &&
              pmem2_config_set_required_store_granularity(cfg_, PMEM2_GRANULARITY_PAGE) == 0 && pmem2_config_set_offset(cfg_, offset) == 0 &&
              pmem2_config_set_length(cfg_, length) == 0 && (rc = pmem2_map_new(&map_, cfg_, src_)) == 0;
    if (!ok) {
      const int err = errno;
      std::string msg = pmem2_error("cannot map " + path);
      release();
      if (rc == -ENOMEM || (rc != 0 && err == ENOMEM)) throw OutOfAddressSpace("cannot map " + path);
      throw Error(Errc::io, msg);
    }
  }
  ~Pmem2Map() { release(); }
  Pmem2Map(const Pmem2Map&) = delete;
  Pmem2Map& operator=(const Pmem2Map&) = delete;
  char* address() const { return static_cast<char*>(pmem2_map_get_address(map_)); }
  pmem2_map* get() const { return map_; }

 private:
  void release() {
    if (map_) pmem2_map_delete(&map_);
    if (src_) pmem2_source_delete(&src_);
    if (cfg_) pmem2_config_delete(&cfg_);
  }
  pmem2_config* cfg_ = nullptr;
  pmem2_source* src_ = nullptr;
  pmem2_map* map_ = nullptr;
};

}  // namespace

struct Packs::WriteMap {
  Fd fd;
  std::string path;
  std::uint64_t size = 0;
  std::uint64_t ino = 0;
  std::unique_ptr<Pmem2Map> map;
  // New space is written with pwrite rather than through this mapping, on
  // page-granularity media (tmpfs, a disk file system): the file system then
  // allocates the pages as it copies into them, with no page fault per page,
  // and reports a full disk as an error rather than a SIGBUS. On tmpfs, space
  // reused later is mapped once (populated) and copied into non-temporally,
  // which is faster from the second use on; on a disk file system every copy
  // is a pwrite, persisted with one fdatasync per block instead of an msync
  // per copy. Byte-persistent media (PMem) keep libpmem2's copies
  // throughout. (docs/format.md, "Writing pack space".)
  bool write_new_by_fd = false;
  bool write_all_by_fd = false;
  // Per page, one bit each: this mapping has populated its page-table entry
  // (a snapshot that reuses free space skips the populate call), and this
  // process wrote it with pwrite (it exists in the file: populating it
  // allocates nothing).
  std::vector<std::uint64_t> populated, in_file;
  std::mutex mu;
  std::uint64_t last_use = 0;
  // On a disk file system: data written with pwrite that is not durable yet.
  // Writers only start its writeback; Packs::persist() waits for it, once per
  // pack, before the manifests that use it are published.
  std::atomic<bool> unsynced{false};

  // The kernel dropped the page-table entries of [offset, offset+length)
  // (holes were punched): populate them again next time.
  void forget(std::uint64_t offset, std::uint64_t length) {
    if (length == 0) return;
    std::uint64_t first = offset / kPageSize, last = (offset + length - 1) / kPageSize;
    std::lock_guard<std::mutex> lock(mu);
    for (std::uint64_t p = first; p <= last && p / 64 < populated.size(); ++p) {
      populated[p / 64] &= ~(1ull << (p % 64));
      in_file[p / 64] &= ~(1ull << (p % 64));
    }
  }
};

namespace {
constexpr std::size_t kMaxWriteMaps = 16;
}

Packs::Packs(std::string dir, std::string store_uuid) : dir_(std::move(dir)), uuid_(std::move(store_uuid)) {
  if (path_exists(dir_)) ids();  // which are heap packs
}

Packs::~Packs() = default;

std::string Packs::hash_path_of(std::uint32_t pack) const {
  char name[32];
  std::snprintf(name, sizeof name, "/%08u.hash", pack);
  return dir_ + name;
}

Packs::HashMap* Packs::hash_map(std::uint32_t pack, bool writable) {
  auto it = hash_maps_.find(pack);
  if (it != hash_maps_.end() && (it->second.writable || !writable)) return &it->second;
  if (it != hash_maps_.end()) hash_maps_.erase(it);
  std::string path = hash_path_of(pack);
  HashMap h;
  try {
    h.fd = open_or_throw(path, writable ? O_RDWR | O_CREAT : O_RDONLY, 0600);
    struct stat st {};
    if (::fstat(h.fd.get(), &st) != 0) return nullptr;
    if (static_cast<std::uint64_t>(st.st_size) != kHashFileSize) {
      // New (or cut short): sparse, so it costs only the pages written.
      FileSizeSignalGuard guard;
      if (!writable || env().ftruncate(h.fd.get(), static_cast<off_t>(kHashFileSize)) != 0) return nullptr;
    }
    h.map = Mapping::file(h.fd.get(), kHashFileSize, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, path);
    h.writable = writable;
    h.ino = static_cast<std::uint64_t>(st.st_ino);
  } catch (const Error& e) {
    // A link, FIFO or device planted in its place is reported like anywhere
    // in the store. Missing (a pack written before page hash files) or not
    // writable: the hashes are recomputed from the data when needed.
    if (e.code() == Errc::corrupt) throw;
    return nullptr;
  }
  return &hash_maps_.emplace(pack, std::move(h)).first->second;
}

bool Packs::stored_hashes(std::uint32_t pack, std::uint64_t offset, std::size_t pages, std::uint64_t* out) {
  if (offset % kPageSize != 0 || offset / kPageSize + pages > kHashFileSize / 8) return false;
  const HashMap* h = hash_map(pack, false);
  if (!h) return false;
  std::memcpy(out, h->addr() + offset / kPageSize, pages * 8);
  return true;
}

std::string Packs::path_of(std::uint32_t pack) const {
  if (is_heap(pack)) return heap_path_of(pack);
  char name[32];
  std::snprintf(name, sizeof name, "/%08u.pack", pack);
  return dir_ + name;
}

std::string Packs::heap_path_of(std::uint32_t pack) const {
  char name[32];
  std::snprintf(name, sizeof name, "/%08u.heap", pack);
  return dir_ + name;
}

std::vector<std::uint32_t> Packs::ids() const {
  std::vector<std::uint32_t> out;
  heap_ids_.clear();
  for (auto& n : list_dir(dir_)) {
    unsigned id = 0;
    char tail[8] = {};
    if (n.size() != 13 || std::sscanf(n.c_str(), "%8u.%4s", &id, tail) != 2 || id == 0) continue;
    if (std::strcmp(tail, "heap") == 0) heap_ids_.insert(id);
    if (std::strcmp(tail, "pack") == 0 || std::strcmp(tail, "heap") == 0) out.push_back(id);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Fd Packs::open_read(std::uint32_t pack, std::string* path) {
  std::string file = path_of(pack);
  if (path) *path = file;
  try {
    return open_or_throw(file, O_RDONLY);
  } catch (const Error& e) {
    if (e.code() != Errc::not_found || is_heap(pack) || !path_exists(heap_path_of(pack))) throw;
  }
  heap_ids_.insert(pack);  // linked in since ids() looked
  if (path) *path = heap_path_of(pack);
  return open_or_throw(heap_path_of(pack), O_RDONLY);
}

void Packs::add_hashes(std::uint32_t pack, std::uint64_t first_page, std::vector<std::uint64_t> values) {
  if (values.empty() || first_page + values.size() > kHashFileSize / 8) return;  // beyond the file: readers recompute them
  std::lock_guard<std::mutex> lock(pending_mu_);
  pending_hashes_.push_back({pack, first_page, std::move(values)});
}

std::uint64_t Packs::size_of(std::uint32_t pack) const {
  struct stat st {};
  if (::stat(path_of(pack).c_str(), &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.st_size);
}

void Packs::create(std::uint32_t id, std::uint64_t size, std::uint64_t min_size) {
  std::string path = path_of(id);
  // Written under a temporary name and renamed, so a pack file either has a
  // complete header or does not exist.
  std::string tmp = path + ".new";
  Fd fd = open_or_throw(tmp, O_RDWR | O_CREAT | O_TRUNC, 0600);
  char header[kPackHeaderSize] = {};
  std::memcpy(header, kPackMagic, 8);
  std::memcpy(header + 8, &kPackVersion, 4);
  std::memcpy(header + 12, &id, 4);
  std::memcpy(header + 16, uuid_.data(), std::min<std::size_t>(uuid_.size(), 32));
  try {
    write_all(fd.get(), header, sizeof header, tmp);
    FileSizeSignalGuard guard;
    if (env().ftruncate(fd.get(), static_cast<off_t>(size)) != 0 && (errno != EFBIG || env().ftruncate(fd.get(), static_cast<off_t>(min_size)) != 0))
      throw_errno(errno, "cannot size new pack " + tmp);
    fsync_or_throw(fd.get(), tmp);
    if (env().rename(tmp.c_str(), path.c_str()) != 0) throw_errno(errno, "cannot publish " + path);
  } catch (...) {
    env().unlink(tmp.c_str());
    throw;
  }
  fsync_dir(dir_);
}

void Packs::grow(std::uint32_t id, std::uint64_t size) {
  std::string path = path_of(id);
  Fd fd = open_or_throw(path, O_RDWR);
  if (file_size(fd.get(), path) >= size) return;
  FileSizeSignalGuard guard;
  if (env().ftruncate(fd.get(), static_cast<off_t>(size)) != 0) throw_errno(errno, "cannot grow " + path);
  fsync_or_throw(fd.get(), path);
}

PackWriter Packs::writer(std::uint32_t pack, std::uint64_t offset, std::uint64_t length) {
  std::string path = path_of(pack);
  auto& slot = writes_[pack];
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw_errno(errno, "cannot open " + path);
  if (!slot || slot->ino != static_cast<std::uint64_t>(st.st_ino) || slot->size != static_cast<std::uint64_t>(st.st_size)) {
    // (Re)map the whole pack once; later snapshots that reuse its free space
    // find their pages already mapped. A replaced mapping may still be in use
    // by another writer of this batch: it is released by end_writes().
    // The same file grown: which pages this process wrote stays true.
    std::vector<std::uint64_t> in_file;
    if (slot && slot->ino == static_cast<std::uint64_t>(st.st_ino)) {
      std::lock_guard<std::mutex> lock(slot->mu);
      in_file = slot->in_file;
    }
    if (slot) retired_.push_back(std::move(slot));
    if (writes_.size() > kMaxWriteMaps) {
      // Keep a bounded number of pack files open for writing.
      auto lru = writes_.end();
      for (auto it = writes_.begin(); it != writes_.end(); ++it)
        if (it->first != pack && it->second && (lru == writes_.end() || it->second->last_use < lru->second->last_use)) lru = it;
      if (lru != writes_.end()) {
        retired_.push_back(std::move(lru->second));
        writes_.erase(lru);
      }
    }
    auto w = std::make_unique<WriteMap>();
    w->fd = open_or_throw(path, O_RDWR);
    w->path = path;
    w->size = file_size(w->fd.get(), path);
    w->ino = static_cast<std::uint64_t>(st.st_ino);
    w->map = std::make_unique<Pmem2Map>(w->fd.get(), 0, w->size, path);
    w->write_new_by_fd = pmem2_map_get_store_granularity(w->map->get()) == PMEM2_GRANULARITY_PAGE;
    struct statfs fs {};
    const bool in_memory = ::fstatfs(w->fd.get(), &fs) == 0 &&
                           (static_cast<unsigned long>(fs.f_type) == TMPFS_MAGIC || static_cast<unsigned long>(fs.f_type) == RAMFS_MAGIC);
    w->write_all_by_fd = w->write_new_by_fd && !in_memory;
    w->populated.assign((w->size / kPageSize + 63) / 64, 0);
    in_file.resize(w->populated.size(), 0);
    w->in_file = std::move(in_file);
    slot = std::move(w);
  }
  slot->last_use = ++write_clock_;
  if (offset < kPackHeaderSize || offset + length > slot->size)
    throw Error(Errc::io, "internal error: write of [" + std::to_string(offset) + ", " + std::to_string(offset + length) + ") outside " + path);
  HashMap* h = hash_map(pack, true);
  return PackWriter(slot.get(), offset, length, h ? h->addr() : nullptr, h ? h->fd.get() : -1, this, pack);
}

void Packs::end_writes() {
  retired_.clear();
  undo_hashes_.clear();
  std::lock_guard<std::mutex> lock(pending_mu_);
  pending_hashes_.clear();
}

void Packs::drop_resident() {
  for (auto& [id, m] : reads_)
    if (m.size()) ::madvise(const_cast<char*>(m.addr()), m.size(), MADV_DONTNEED);
}

void PackWriter::release() {
  if (length_ == 0) return;
  if (::madvise(base_, round_up_page(length_), MADV_DONTNEED) == 0) map_->forget(offset_, length_);
}

void Packs::punch(std::uint32_t pack, std::uint64_t offset, std::uint64_t length) {
  int fd = env().open(path_of(pack).c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
  if (fd < 0) return;
  env().fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset), static_cast<off_t>(length));
  ::close(fd);
  auto it = writes_.find(pack);
  if (it != writes_.end() && it->second) it->second->forget(offset, length);
}

void Packs::forget_populated() {
  for (auto& [id, w] : writes_)
    if (w) {
      std::fill(w->populated.begin(), w->populated.end(), 0);
      std::fill(w->in_file.begin(), w->in_file.end(), 0);
    }
}

PackWriter::PackWriter(Packs::WriteMap* map, std::uint64_t offset, std::uint64_t length, std::uint64_t* hashes, int hash_fd, Packs* packs,
                       std::uint32_t pack)
    : map_(map), offset_(offset), length_(length), hashes_(hashes), hash_fd_(hash_fd), packs_(packs), pack_(pack) {
  base_ = map_->map->address() + offset;
  memcpy_ = reinterpret_cast<void*>(pmem2_get_memcpy_fn(map_->map->get()));
}

void PackWriter::reserve(std::uint64_t rel, std::uint64_t len) {
  if (len == 0) return;
  if (rel + len > length_) throw Error(Errc::io, "internal error: reservation outside the pack extent");
  const std::uint64_t first = (offset_ + rel) / kPageSize, last = (offset_ + rel + len - 1) / kPageSize;
  bool all = true, existing = true, fresh = false;
  {
    std::lock_guard<std::mutex> lock(map_->mu);
    for (std::uint64_t p = first; p <= last && (all || existing); ++p) {
      all = all && ((map_->populated[p / 64] >> (p % 64)) & 1);
      existing = existing && ((map_->in_file[p / 64] >> (p % 64)) & 1);
    }
    fresh = map_->write_all_by_fd || (!all && !existing && map_->write_new_by_fd);
    if (fresh) {
      // Space that may be new (or any space, on disk): copies into it are
      // pwrites, which allocate as they go (a full file system is an error
      // they return). Nothing to reserve on the file system first.
      for (std::uint64_t p = first; p <= last; ++p)
        map_->in_file[p / 64] |= 1ull << (p % 64);
      if (!by_fd_.empty() && by_fd_.back().second == rel)
        by_fd_.back().second = rel + len;
      else
        by_fd_.emplace_back(rel, rel + len);
    }
  }
  if (fresh) {
    reserve_hashes(rel, len);
    return;
  }
  // Reserve on the file system first: a store through a mapping into space the
  // file system cannot provide would kill the process with SIGBUS instead of
  // failing. (Cheap when the range is allocated already, e.g. space of a
  // removed snapshot. SEEK_HOLE is no cheaper test: on tmpfs it scans on past
  // the range to the next hole.)
  {
    FileSizeSignalGuard guard;
    int err = env().posix_fallocate(map_->fd.get(), static_cast<off_t>(offset_ + rel), static_cast<off_t>(len));
    if (err != 0) throw_errno(err, "cannot reserve " + std::to_string(len) + " bytes in " + map_->path);
  }
  reserve_hashes(rel, len);
  if (all) return;
  // Populate the page tables in one call rather than one fault per page.
  if (::madvise(base_ + rel, len, MADV_POPULATE_WRITE) != 0) return;  // pages fault in one by one instead
  std::lock_guard<std::mutex> lock(map_->mu);
  for (std::uint64_t p = first; p <= last; ++p)
    map_->populated[p / 64] |= 1ull << (p % 64);
}

void PackWriter::reserve_hashes(std::uint64_t rel, std::uint64_t len) {
  // The page hashes of the range (8 bytes per page). They are best effort:
  // without room for them, readers hash the data instead.
  if (!hashes_) return;
  FileSizeSignalGuard guard;
  std::uint64_t hb = (offset_ + rel) / kPageSize * 8 / kPageSize * kPageSize;
  std::uint64_t he = round_up_page((offset_ + rel + len + kPageSize - 1) / kPageSize * 8);
  if (env().posix_fallocate(hash_fd_, static_cast<off_t>(hb), static_cast<off_t>(he - hb)) != 0) hashes_ = nullptr;
}

bool PackWriter::by_fd(std::uint64_t rel, std::uint64_t len) const {
  for (auto& [lo, hi] : by_fd_)
    if (lo < rel + len && rel < hi) return true;
  return false;
}

void PackWriter::copy(std::uint64_t rel, const void* src, std::size_t len, bool bounce) {
  // Large copies through libpmem2: non-temporal, flushed as they go (on
  // page-granularity media it copies without PMEM2_F_MEM_NOFLUSH
  // non-temporally and msyncs the range; with it, it falls back to a cached
  // memmove, ~20% slower for a full snapshot). Small ones (pages stored
  // apart): non-temporal too, but flushed all together in finish() — one
  // msync per page would cost more than the copy.
  if (by_fd(rel, len)) {
    // Into new space: pwrites, complete when they return (a reused source
    // buffer may change right after); persisted by finish().
    if (bounce) {
      const struct iovec one{const_cast<void*>(src), len};
      write_bounced(rel, &one, 1, len);
    } else {
      write_all_at(map_->fd.get(), src, len, offset_ + rel, range_name(rel, len));
    }
    wrote_by_fd(rel, len);
    return;
  }
  if (len < kSmallCopy) {
    copy_nt(base_ + rel, src, len);  // streaming stores, like libpmem2's
    unflushed_lo_ = std::min(unflushed_lo_, rel);
    unflushed_hi_ = std::max(unflushed_hi_, rel + len);
    return;
  }
  reinterpret_cast<pmem2_memcpy_fn>(memcpy_)(base_ + rel, src, len, PMEM2_F_MEM_NONTEMPORAL | PMEM2_F_MEM_NODRAIN);
}

void PackWriter::copy(std::uint64_t rel, std::vector<struct iovec>& pieces, std::uint64_t len, bool bounce) {
  if (pieces.size() == 1 || !by_fd(rel, len)) {
    for (auto& p : pieces) {
      copy(rel, p.iov_base, p.iov_len, bounce);
      rel += p.iov_len;
    }
    return;
  }
  if (bounce)
    write_bounced(rel, pieces.data(), pieces.size(), len);
  else
    write_all_at(map_->fd.get(), pieces, offset_ + rel, range_name(rel, len));
  wrote_by_fd(rel, len);
}

namespace {
// The thread's bounce buffer for write_bounced(): made on first use, kept
// until the thread ends (the kernel reads it warm from then on).
constexpr std::size_t kBounce = 256u << 10;
char* bounce_buffer() {
  struct Buffer {
    char* p = static_cast<char*>(std::aligned_alloc(kPageSize, kBounce));
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer b;
  if (!b.p) throw std::bad_alloc();
  return b.p;
}
}  // namespace

void PackWriter::write_bounced(std::uint64_t rel, const struct iovec* pieces, std::size_t count, std::uint64_t len) {
  // The sources are copied into a small buffer of this thread and written
  // from there, kBounce bytes per pwrite, instead of handed to pwrite as
  // they are. The source was just hashed (it is in the CPU's cache), so the
  // copy costs little, while a kernel reading memory of the process that it
  // has never read before can cost far more than the copy: on a VM with
  // shadow page tables (this project's machines) pwrite from freshly written
  // memory ran at 0.5 GB/s, from the buffer at 3 GB/s (docs/performance.md,
  // "Writing new space").
  char* buf = bounce_buffer();
  const std::string what = range_name(rel, len);
  std::uint64_t at = offset_ + rel;
  std::size_t filled = 0;
  for (std::size_t k = 0; k < count; ++k) {
    const char* src = static_cast<const char*>(pieces[k].iov_base);
    std::size_t left = pieces[k].iov_len;
    while (left > 0) {
      const std::size_t n = std::min(left, kBounce - filled);
      std::memcpy(buf + filled, src, n);
      filled += n;
      src += n;
      left -= n;
      if (filled == kBounce) {
        write_all_at(map_->fd.get(), buf, filled, at, what);
        at += filled;
        filled = 0;
      }
    }
  }
  if (filled > 0) write_all_at(map_->fd.get(), buf, filled, at, what);
}

std::string PackWriter::range_name(std::uint64_t rel, std::uint64_t len) const {
  return std::to_string(len) + " bytes at offset " + std::to_string(offset_ + rel) + " of " + map_->path;
}

void PackWriter::wrote_by_fd(std::uint64_t rel, std::uint64_t len) {
  unsynced_ = true;  // persisted by finish()
  if (map_->write_all_by_fd) start_writeback(offset_ + rel, len);
}

void PackWriter::start_writeback(std::uint64_t offset, std::uint64_t len) {
  // The device writes while this thread hashes and copies the next chunks,
  // instead of all at once in the final fdatasync (a page cache that holds
  // the whole snapshot dirty would otherwise start only at its dirty limit).
  // Contiguous writes are gathered into one request of kWriteback bytes.
  if (writeback_hi_ != offset) {
    flush_writeback();
    writeback_lo_ = offset;
  }
  writeback_hi_ = offset + len;
  if (writeback_hi_ - writeback_lo_ >= kWriteback) flush_writeback();
}

void PackWriter::flush_writeback() {
  // SYNC_FILE_RANGE_WRITE only queues the writes; an I/O error shows at the
  // fdatasync of Packs::persist().
  if (writeback_hi_ > writeback_lo_)
    (void)env().sync_file_range(map_->fd.get(), static_cast<off_t>(writeback_lo_), static_cast<off_t>(writeback_hi_ - writeback_lo_),
                            SYNC_FILE_RANGE_WRITE);
  writeback_lo_ = writeback_hi_ = 0;
}

void PackWriter::set_hashes(std::uint64_t rel, const std::uint64_t* hashes, std::size_t count) {
  if (!hashes_ || count == 0) return;  // no hash file: readers recompute them
  std::uint64_t first = (offset_ + rel) / kPageSize;
  if (first + count > kHashFileSize / 8) return;
  // Kept here, not written to the page hash file yet: Packs::persist() writes
  // them once the whole batch's data is written, so that a batch that fails
  // (a full disk) leaves the page hash files exactly as they were.
  if (pending_.empty() || pending_.back().first + pending_.back().values.size() != first) pending_.push_back({pack_, first, {}});
  pending_.back().values.insert(pending_.back().values.end(), hashes, hashes + count);
}

void PackWriter::finish() {
  const bool deferred = map_->write_all_by_fd;  // disk: Packs::persist() syncs once per pack
  if (!pending_.empty()) {
    // The hashes go to the page hash file in Packs::persist(), with the data
    // of the whole batch (before the manifest that uses them is published).
    std::lock_guard<std::mutex> lock(packs_->pending_mu_);
    for (auto& run : pending_)
      packs_->pending_hashes_.push_back(std::move(run));
    pending_.clear();
  }
  if (unflushed_lo_ < unflushed_hi_) pmem2_get_flush_fn(map_->map->get())(base_ + unflushed_lo_, unflushed_hi_ - unflushed_lo_);
  unflushed_lo_ = UINT64_MAX;
  unflushed_hi_ = 0;
  pmem2_get_drain_fn(map_->map->get())();
  if (unsynced_ && deferred) {
    flush_writeback();
    map_->unsynced = true;
    unsynced_ = false;
  } else if (unsynced_) {
    // Data written with pwrite, and the file system's record of the space it
    // allocated (a no-op on tmpfs).
    if (env().fdatasync(map_->fd.get()) != 0) throw_errno(errno, "cannot persist data written to " + map_->path);
    unsynced_ = false;
  }
}

void Packs::persist() {
  // Data first (an error fails the snapshot), then the page hashes (best
  // effort, like their msync elsewhere: a lost hash is recomputed).
  // A pack grown during the batch has several mappings (the replaced ones
  // retired): one fdatasync per file.
  std::vector<std::uint64_t> synced;
  auto sync = [&](WriteMap* w) {
    if (!w || !w->unsynced.exchange(false)) return;
    if (std::find(synced.begin(), synced.end(), w->ino) != synced.end()) return;
    if (env().fdatasync(w->fd.get()) != 0) {
      w->unsynced = true;
      throw_errno(errno, "cannot persist data written to " + w->path);
    }
    synced.push_back(w->ino);
  };
  for (auto& [id, w] : writes_)
    sync(w.get());
  for (auto& w : retired_)
    sync(w.get());
  write_hashes();
  sync_hash_files();
}

void Packs::write_hashes() {
  // The page hashes the writers of this batch set, into the page hash files,
  // with what they overwrite kept (undo_hashes_) until the batch ends: a
  // batch whose publish fails puts it back (discard_writes()). Best effort,
  // like every page hash: one that is lost is recomputed when read.
  std::vector<PendingHash> runs;
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    runs.swap(pending_hashes_);
  }
  for (auto& run : runs) {
    HashMap* h = nullptr;
    try {
      h = hash_map(run.pack, true);
    } catch (const Error&) {
      h = nullptr;  // a file planted in its place: readers report it
    }
    if (!h) continue;
    std::uint64_t* at = h->addr() + run.first;
    undo_hashes_.push_back({run.pack, run.first, std::vector<std::uint64_t>(at, at + run.values.size())});
    std::memcpy(at, run.values.data(), run.values.size() * 8);
    sync_hashes(*h, run);
  }
}

void Packs::sync_hash_files() {
  for (auto& [id, h] : hash_maps_)
    if (h.dirty.exchange(false) && env().fdatasync(h.fd.get()) != 0)
      DVR_LOG(warn, "cannot persist the page hashes of pack " + std::to_string(id) + ": " + std::strerror(errno) +
                        " (a cache, checked at every use: a lost hash is recomputed; check the device)");
}

void Packs::sync_hashes(HashMap& h, const PendingHash& run) {
  // On a disk file system, one fdatasync per page hash file at the end of
  // persist(); elsewhere the written range is flushed now.
  auto w = writes_.find(run.pack);
  if (w != writes_.end() && w->second && w->second->write_all_by_fd) {
    h.dirty = true;
    return;
  }
  std::uint64_t b = run.first * 8 & ~(kPageSize - 1), e = (run.first + run.values.size()) * 8;
  env().msync(reinterpret_cast<char*>(h.addr()) + b, e - b, MS_SYNC);
}

void Packs::discard_writes() {
  std::vector<PendingHash> undo;
  undo.swap(undo_hashes_);
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    pending_hashes_.clear();
  }
  for (auto it = undo.rbegin(); it != undo.rend(); ++it) {
    HashMap* h = nullptr;
    try {
      h = hash_map(it->pack, true);
    } catch (const Error&) {
      h = nullptr;
    }
    if (!h) continue;
    std::memcpy(h->addr() + it->first, it->values.data(), it->values.size() * 8);
    sync_hashes(*h, *it);
  }
  sync_hash_files();
}

void Packs::refresh_mappings() {
  ids();  // heap packs linked in or removed since
  for (auto it = hash_maps_.begin(); it != hash_maps_.end();) {
    struct stat st {};
    if (::stat(hash_path_of(it->first).c_str(), &st) == 0 && static_cast<std::uint64_t>(st.st_ino) == it->second.ino &&
        static_cast<std::uint64_t>(st.st_size) == kHashFileSize) {
      ++it;
    } else {
      it = hash_maps_.erase(it);
    }
  }
  for (auto it = reads_.begin(); it != reads_.end();) {
    struct stat st {};
    bool same = ::stat(path_of(it->first).c_str(), &st) == 0 && static_cast<std::uint64_t>(st.st_ino) == it->second.ino &&
                static_cast<std::uint64_t>(st.st_size) == it->second.size();
    it = same ? std::next(it) : reads_.erase(it);
  }
  // A write mapping of a file that only changed size is kept: writer() maps
  // it again, keeping what it knows of the file's pages.
  for (auto it = writes_.begin(); it != writes_.end();) {
    struct stat st {};
    bool same = it->second && ::stat(path_of(it->first).c_str(), &st) == 0 && static_cast<std::uint64_t>(st.st_ino) == it->second->ino;
    it = same ? std::next(it) : writes_.erase(it);
  }
}

const char* Packs::read(std::uint32_t pack, std::uint64_t offset, std::uint64_t length) {
  auto it = reads_.find(pack);
  if (it == reads_.end()) {
    std::string path;
    Fd owner;
    try {
      owner = open_read(pack, &path);
    } catch (const Error& e) {
      if (e.code() != Errc::not_found) throw;  // permission, I/O, a planted link: not "missing"
      throw Error(Errc::corrupt, "pack file " + path_of(pack) + " is missing; snapshots stored in it cannot be restored — run `dvr verify` to list them");
    }
    const bool heap = is_heap(pack);
    int fd = owner.get();
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw_errno(errno, "cannot stat " + path);
    auto size = static_cast<std::uint64_t>(st.st_size);
    if (!heap) check_header(fd, size, path, pack);
    ReadMap rm{size ? Mapping::file(fd, size, PROT_READ, MAP_SHARED, path) : Mapping(), static_cast<std::uint64_t>(st.st_ino),
               heap ? 0 : kPackHeaderSize, std::move(owner)};
    it = reads_.emplace(pack, std::move(rm)).first;
  }
  if (offset < it->second.start)
    throw Error(Errc::corrupt, "pack file " + path_of(pack) + ": a reference to bytes [" + std::to_string(offset) + ", " +
                                   std::to_string(offset + length) + ") points into its header (chunk data starts at byte " +
                                   std::to_string(it->second.start) + "): the manifest that holds it is bad");
  if (offset > it->second.size() || length > it->second.size() - offset)
    throw Error(Errc::corrupt, "pack file " + path_of(pack) + " is truncated or the reference is bad: it ends at byte " +
                                   std::to_string(it->second.size()) + " but a chunk needs bytes [" + std::to_string(offset) + ", " +
                                   std::to_string(offset + length) + ")");
  return it->second.addr() + offset;
}

namespace {
// The error for a read of pack file `path` at byte `at` that the medium
// failed; `why` follows the offset (": Input/output error", " (SIGBUS: ...)").
Error read_failed(const std::string& path, std::uint64_t at, const std::string& why) {
  return Error(Errc::io, "cannot read pack file " + path + " at byte " + std::to_string(at) + why + "; check the device (dmesg), then run `dvr verify`");
}

// The error for pack file `path` found shorter than a read of it needed:
// `how` the read ("reading byte N"), `now` the file as it is now (nullptr: gone).
Error truncated_in_use(const std::string& path, const std::string& how, const struct stat* now) {
  return Error(Errc::corrupt, "pack file " + path + " was truncated while in use (" + how +
                                  (now ? ", but it now ends at byte " + std::to_string(now->st_size) : std::string(", and it is gone now")) +
                                  "); the snapshots stored there cannot be restored — run `dvr verify` to list them");
}
}  // namespace

void Packs::copy(std::uint32_t pack, std::uint64_t offset, char* out, std::uint64_t length) {
  read(pack, offset, length);  // opened and bounds checked; no page of the mapping is touched
  const int fd = reads_.at(pack).fd.get();
  int err = 0;
  const std::uint64_t done = read_at_most(fd, out, length, offset, err);
  if (done < length) throw pread_failed(pack, fd, offset + done, err);
}

Error Packs::pread_failed(std::uint32_t pack, int fd, std::uint64_t at, int err) const {
  if (err != 0) return read_failed(path_of(pack), at, std::string(": ") + std::strerror(err));
  struct stat st {};
  return truncated_in_use(path_of(pack), "reading byte " + std::to_string(at), ::fstat(fd, &st) == 0 ? &st : nullptr);
}

void Packs::check_header(int fd, std::uint64_t size, const std::string& path, std::uint32_t pack) const {
  auto no_header = [&] { return Error(Errc::corrupt, "pack file " + path + " has no valid header; it is damaged or not a Memory DVR pack"); };
  if (size < kPackHeaderSize) throw no_header();
  char header[48] = {};
  ssize_t got;
  while ((got = ::pread(fd, header, sizeof header, 0)) < 0 && errno == EINTR) {
  }
  if (got < 0) throw read_failed(path, 0, std::string(": ") + std::strerror(errno));
  if (got != sizeof header || std::memcmp(header, kPackMagic, 8) != 0) throw no_header();
  if (uuid_.size() == 32 && std::memcmp(header + 16, uuid_.data(), 32) != 0)
    throw Error(Errc::corrupt, "pack file " + path + " belongs to another store (its store id differs); it was copied in by mistake");
  std::uint32_t version = 0, id = 0;
  std::memcpy(&version, header + 8, 4);
  std::memcpy(&id, header + 12, 4);
  if (version > kPackVersion)
    throw Error(Errc::unsupported, "pack file " + path + " has pack format version " + std::to_string(version) + ", newer than this dvr reads (" +
                                       std::to_string(kPackVersion) + "); upgrade Memory DVR to read the snapshots stored in it");
  if (version == 0)
    throw Error(Errc::corrupt, "pack file " + path + " has no pack format version (0 in its header); it is damaged — run `dvr verify` to list the snapshots stored in it");
  if (id != pack)
    throw Error(Errc::corrupt, "pack file " + path + " says it is pack " + std::to_string(id) + " in its header, not pack " + std::to_string(pack) +
                                   "; it was renamed or copied over another pack — run `dvr verify` to list the snapshots stored in it");
}

Error Packs::unreadable(std::uint32_t pack, std::uint64_t offset) const {
  const std::string path = path_of(pack);
  struct stat st {};
  const bool there = ::stat(path.c_str(), &st) == 0;
  if (!there || static_cast<std::uint64_t>(st.st_size) <= offset)
    return truncated_in_use(path, "SIGBUS reading byte " + std::to_string(offset), there ? &st : nullptr);
  return read_failed(path, offset, " (SIGBUS: the medium reported an error)");
}

Error Packs::unreadable(std::uint32_t pack, std::uint64_t offset, const char* at) const {
  const char* fault = static_cast<const char*>(guarded_fault_address());
  std::uint64_t in = fault && fault >= at ? static_cast<std::uint64_t>(fault - at) : 0;
  return unreadable(pack, (offset + in) & ~(kPageSize - 1));
}

void Packs::map_all() {
  for (auto id : ids()) {
    try {
      read(id, kPackHeaderSize, 0);
    } catch (const Error&) {
      // Damaged or vanished pack: mapped() reports nullptr for it.
    }
  }
}

const char* Packs::mapped(std::uint32_t pack, std::uint64_t offset, std::uint64_t length) const {
  auto it = reads_.find(pack);
  if (it == reads_.end() || offset < it->second.start || offset > it->second.size() || length > it->second.size() - offset) return nullptr;
  return it->second.addr() + offset;
}

void Packs::copy_mapped(std::uint32_t pack, std::uint64_t offset, char* out, std::uint64_t length) const {
  auto it = reads_.find(pack);
  if (it == reads_.end() || offset < it->second.start || offset > it->second.size() || length > it->second.size() - offset)
    throw Error(Errc::corrupt, "pack file " + path_of(pack) + ": bytes " + std::to_string(offset) + "+" + std::to_string(length) +
                                   " are not in its mapping (the file changed while in use); run `dvr verify`");
  const int fd = it->second.fd.get();
  int err = 0;
  const std::uint64_t done = read_at_most(fd, out, length, offset, err);
  if (done < length) throw pread_failed(pack, fd, offset + done, err);
}

bool byte_persistent(int fd, const std::string& file) {
  pmem2_granularity got = PMEM2_GRANULARITY_PAGE;
  try {
    Pmem2Map map(fd, 0, kPageSize, file);
    got = pmem2_map_get_store_granularity(map.get());
  } catch (const Error&) {
    // libpmem2 refused the file: it is certainly not usable as PMem.
  }
  return got == PMEM2_GRANULARITY_BYTE || got == PMEM2_GRANULARITY_CACHE_LINE;
}

}  // namespace dvr::detail
