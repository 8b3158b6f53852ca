// DVR persistent heaps in whole-process snapshots (see proc_heaps.hpp).
#include "proc/proc_heaps.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <optional>
#include <cstdio>
#include <fstream>
#include <atomic>
#include <cerrno>
#include <memory>
#include <random>
#include <set>
#include <sstream>

#include "base/hash.hpp"
#include "base/mapping.hpp"
#include "base/memops.hpp"
#include "track/dirty.hpp"
#include "track/heap_note.hpp"
#include "dvr/session.hpp"
#include "base/os.hpp"
#include "store/store_impl.hpp"
#include "store/reader.hpp"
#include "store/writer.hpp"
#include "proc/heap_seal.hpp"

#include <linux/falloc.h>

namespace dvr::detail::heaps {

namespace {

std::string parent_dir(const std::string& p) {
  auto k = p.find_last_of('/');
  return k == std::string::npos || k == 0 ? std::string("/") : p.substr(0, k);
}

// Paths in /proc/PID/maps: everything after the inode column.
std::string maps_path(const std::string& line) {
  std::istringstream in(line);
  std::string range, perms, offset, dev, inode;
  in >> range >> perms >> offset >> dev >> inode;
  std::string rest;
  std::getline(in, rest);
  auto b = rest.find_first_not_of(' ');
  return b == std::string::npos ? std::string() : rest.substr(b);
}

}  // namespace

std::string store_of_heap(const std::string& path) {
  // STORE/heaps/SESSION/REGION
  std::string session_dir = parent_dir(path), heaps_dir = parent_dir(session_dir), store = parent_dir(heaps_dir);
  if (heaps_dir.size() < 6 || heaps_dir.compare(heaps_dir.size() - 6, 6, "/heaps") != 0) return "";
  struct stat st {};
  if (::stat((store + "/" + kSuperblockName).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return "";
  return store;
}

std::vector<std::string> mapped_heaps(pid_t pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  if (!maps) throw Error(Errc::not_found, "cannot read /proc/" + std::to_string(pid) + "/maps: no such process");
  std::set<std::string> found;
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream in(line);
    std::string range, perms;
    in >> range >> perms;
    // Shared mappings, and private ones of a heap file: the heap of
    // `dvr run --heap` is private while a forked child maps it (the file is
    // then the memory of the fork, which the dump must keep too).
    if (perms.size() < 4 || (perms[3] != 's' && perms[3] != 'p')) continue;
    std::string path = maps_path(line);
    if (path.empty() || path[0] != '/' || path.find(" (deleted)") != std::string::npos) continue;
    if (!store_of_heap(path).empty()) found.insert(path);
  }
  return {found.begin(), found.end()};
}

std::vector<std::string> processes_mapping(const std::string& path, pid_t except) {
  std::vector<std::string> out;
  // By device and inode: a clone maps a private copy at the same path (in a
  // mount namespace of its own), which is not this file.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return out;
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (!end || *end || pid <= 0 || pid == except) continue;
    std::ifstream maps(std::string("/proc/") + e->d_name + "/maps");
    std::string line;
    bool uses = false;
    while (!uses && std::getline(maps, line)) {
      std::istringstream in(line);
      std::string range, perms, offset, dev;
      unsigned long long inode = 0;
      in >> range >> perms >> offset >> dev >> inode;
      unsigned major = 0, minor = 0;
      if (inode != st.st_ino || std::sscanf(dev.c_str(), "%x:%x", &major, &minor) != 2) continue;
      uses = makedev(major, minor) == st.st_dev;
    }
    if (!uses) continue;
    std::ifstream comm(std::string("/proc/") + e->d_name + "/comm");
    std::string name;
    std::getline(comm, name);
    out.push_back(std::string(e->d_name) + " (" + name + ")");
  }
  ::closedir(d);
  return out;
}

bool mapped_writable(const struct stat& st, pid_t except, bool shared_only) {
  DIR* d = ::opendir("/proc");
  if (!d) return true;
  bool found = false;
  for (dirent* e = ::readdir(d); e && !found; e = ::readdir(d)) {
    char* end = nullptr;
    long p = std::strtol(e->d_name, &end, 10);
    if (!end || *end || p <= 0 || p == except) continue;
    std::ifstream maps(std::string("/proc/") + e->d_name + "/maps");
    std::string line;
    while (!found && std::getline(maps, line)) {
      unsigned long long lo = 0, hi = 0, offset = 0, inode = 0;
      unsigned major = 0, minor = 0;
      char perms[8] = {};
      if (std::sscanf(line.c_str(), "%llx-%llx %7s %llx %x:%x %llu", &lo, &hi, perms, &offset, &major, &minor, &inode) != 7) continue;
      found = inode == st.st_ino && makedev(major, minor) == st.st_dev && perms[1] == 'w' && (!shared_only || perms[3] == 's');
    }
  }
  ::closedir(d);
  return found;
}

namespace {

// The region-relative byte ranges of a heap that process `pid` may have
// written since the note's snapshot, or false when the note does not hold
// for this process now.
bool written_by_note(pid_t pid, const HeapFile& h, const TrackNote& n, std::vector<std::pair<std::uint64_t, std::uint64_t>>& out) {
  if (pid <= 0 || n.size != h.bytes || identity(pid) != std::make_pair(n.start_time, n.pid_ns)) return false;
  // The region must still be this file, mapped whole at the noted address.
  struct stat st {};
  if (::stat(h.path.c_str(), &st) != 0) return false;
  // ... and mapped nowhere else: writes through another mapping (a second
  // mapping here, a forked child, another process) are not in this one's
  // write marks. (write(2) to the file is not covered either; a heap is
  // written through its mapping.)
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  int mapped = 0, elsewhere = 0;
  while (std::getline(maps, line)) {
    unsigned long long lo = 0, hi = 0, offset = 0, inode = 0;
    unsigned major = 0, minor = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%llx-%llx %7s %llx %x:%x %llu", &lo, &hi, perms, &offset, &major, &minor, &inode) != 7) continue;
    if (inode != st.st_ino || makedev(major, minor) != st.st_dev) continue;
    if (lo == n.data && offset == 0 && hi >= n.end && perms[3] == 's')
      ++mapped;
    else if (perms[1] == 'w')
      ++elsewhere;  // read-only mappings cannot write
  }
  if (mapped != 1 || elsewhere != 0 || mapped_writable(st, pid, false)) return false;
  std::vector<AddrRange> pages;
  if (!written_pages_of(pid, {n.start, n.end}, pages)) return false;  // no longer registered there
  // Whole pages outside the tracked range (an unaligned tail) count as written.
  if (n.data < n.start) pages.emplace_back(n.data, n.start);
  if (n.end < n.data + n.size) pages.emplace_back(n.end, n.data + n.size);
  std::sort(pages.begin(), pages.end());
  for (auto& [b, e] : pages) {
    std::uint64_t lo = b - n.data, hi = std::min<std::uint64_t>(e - n.data, n.size);
    if (lo >= hi) continue;
    if (!out.empty() && out.back().second >= lo)
      out.back().second = std::max(out.back().second, hi);
    else
      out.emplace_back(lo, hi);
  }
  return true;
}

}  // namespace

std::vector<std::pair<std::uint64_t, std::uint64_t>> holes_of(int fd, std::uint64_t bytes) {
  ByteRanges out;
  off_t at = 0;
  while (static_cast<std::uint64_t>(at) < bytes) {
    off_t hole = ::lseek(fd, at, SEEK_HOLE);
    if (hole < 0 || static_cast<std::uint64_t>(hole) >= bytes) break;
    off_t data = ::lseek(fd, hole, SEEK_DATA);
    std::uint64_t end = data < 0 ? bytes : std::min<std::uint64_t>(static_cast<std::uint64_t>(data), bytes);
    if (end > static_cast<std::uint64_t>(hole)) out.emplace_back(static_cast<std::uint64_t>(hole), end);
    if (data < 0) break;
    at = data;
  }
  return out;
}

namespace {

// A heap file is its region's bytes rounded up to whole pages.
std::uint64_t file_bytes(const HeapFile& h) { return (h.bytes + kPageSize - 1) & ~(kPageSize - 1); }

bool bad_field(const std::string& s) { return s.find_first_of("\t\n") != std::string::npos; }

}  // namespace

namespace {

// The snapshot of one (store, session) group of heap files, written from their
// mappings through the store's writer. Base: the snapshot the application's
// tracking notes refer to, when it is stored exactly so (then only the pages
// the notes say were written are read), else the session's newest (compared
// page by page by hash).
SnapshotInfo snapshot_group(Store& store, const std::string& session, const std::vector<HeapFile*>& members, std::vector<RegionSource>& sources,
                            pid_t pid, const std::string& snapshot, bool replace, HeapStats* stats) {
  StoreImpl& si = impl_of(store);
  WriteBatch batch(si);
  std::optional<Manifest> base;
  bool by_note = false;
  TrackNote note;
  for (HeapFile* h : members)
    if (read_note(h->path, note)) {
      try {
        Manifest m = si.load_manifest(session, note.snapshot);
        if (m.checksum == note.checksum) {
          base = std::move(m);
          by_note = true;
        }
      } catch (const Error&) {  // removed or damaged since: compare by hash instead
      }
      break;
    }
  bool tracked = false;
  if (by_note) {
    for (std::size_t k = 0; k < members.size(); ++k) {
      TrackNote n;
      ByteRanges written;
      if (read_note(members[k]->path, n) && n.snapshot == note.snapshot && n.checksum == note.checksum &&
          written_by_note(pid, *members[k], n, written)) {
        sources[k].written = std::move(written);
        tracked = true;
        if (stats) ++stats->heaps_by_note;
      }
    }
  } else {
    std::string name;
    for (auto& info : store.list(session))  // oldest first (commit order): the last one found is the newest
      if (!info.damaged && info.name != snapshot) name = info.name;
    if (!name.empty()) {
      try {
        base = si.load_manifest(session, name);
      } catch (const Error&) {  // damaged meanwhile: no base, everything is hashed
      }
    }
  }
  // Heaps the notes do not cover: the pages whose hashes differ from the base's.
  for (auto& src : sources)
    if (!src.written && base && base->paged)
      for (auto& br : base->regions)
        if (br.name == src.name && br.size == src.size) src.written = pages_differing(si.threads, *base, br, src.data, src.size, src.zero);
  SnapshotWriter writer(batch, session, snapshot,
                        {.label = "heaps of process snapshot " + snapshot, .parent = base ? base->name : "", .replace = replace});
  write_snapshot(writer, sources, base ? &*base : nullptr, tracked);
  return batch.publish({&writer}).front();
}

}  // namespace

HeapFile heap_file_of(const std::string& f) {
  HeapFile h;
  h.path = f;
  h.store = store_of_heap(f);
  if (h.store.empty()) throw Error(Errc::invalid_argument, f + " is not a DVR heap file (STORE/heaps/SESSION/REGION)");
  std::string dir = f.substr(0, f.find_last_of('/'));
  h.session = dir.substr(dir.find_last_of('/') + 1);
  h.region = f.substr(f.find_last_of('/') + 1);
  if (bad_field(h.store) || bad_field(h.path))
    throw Error(Errc::invalid_argument, "heap file " + f + " has a tab or newline in its path; move the store");
  return h;
}

HeapImage snapshot_heaps(const std::vector<std::string>& files, pid_t pid, const std::string& snapshot, bool replace, HeapStats* stats,
                         std::chrono::milliseconds lock_timeout) {
  HeapImage image;
  image.snapshot = snapshot;
  for (auto& f : files)
    image.heaps.push_back(heap_file_of(f));
  // One snapshot per (store, session): the heap's own session, so its data is
  // shared with the application's snapshots of it.
  std::vector<std::pair<std::string, std::string>> groups;
  for (auto& h : image.heaps)
    if (std::find(groups.begin(), groups.end(), std::make_pair(h.store, h.session)) == groups.end()) groups.emplace_back(h.store, h.session);
  // On any failure, the groups already committed are removed again: a heap
  // snapshot nobody refers to would only block the next dump of that name.
  std::vector<std::pair<std::string, std::string>> committed;
  try {
    for (auto& [store_path, session] : groups) {
      Store store = Store::open(store_path, {.create = false, .lock_timeout = lock_timeout});
      std::vector<Mapping> maps;
      std::vector<HeapFile*> members;
      std::vector<RegionSource> sources;
      for (auto& h : image.heaps) {
        if (h.store != store_path || h.session != session) continue;
        Fd fd = open_or_throw(h.path, O_RDONLY);
        const std::uint64_t file = file_size(fd.get(), h.path);
        if (file == 0) throw Error(Errc::invalid_argument, "heap file " + h.path + " is empty");
        // The region's own size (the file is page-rounded), when this
        // process's note says it: the snapshot then matches the
        // application's snapshots of the region.
        TrackNote n;
        h.bytes = file;
        if (pid > 0 && read_note(h.path, n) && identity(pid) == std::make_pair(n.start_time, n.pid_ns) &&
            ((n.size + kPageSize - 1) & ~(kPageSize - 1)) == file)
          h.bytes = n.size;
        maps.push_back(Mapping::file(fd.get(), file, PROT_READ, MAP_SHARED, "heap file " + h.path));
        sources.push_back({h.region, static_cast<const char*>(maps.back().data()), h.bytes, false, std::nullopt, holes_of(fd.get(), h.bytes)});
        members.push_back(&h);
      }
      SnapshotInfo info = snapshot_group(store, session, members, sources, pid, snapshot, replace, stats);
      committed.emplace_back(store_path, session);
      if (stats) stats->stored_bytes += info.stored_bytes;
    }
  } catch (...) {
    for (auto& [store_path, session] : committed) {
      try {
        Store::open(store_path, {.create = false, .lock_timeout = lock_timeout}).remove(session, snapshot);
      } catch (const Error&) {
      }
    }
    throw;
  }
  return image;
}

std::string shim_path(const std::string& heap) {
  auto k = heap.find_last_of('/');
  return heap.substr(0, k + 1) + "." + heap.substr(k + 1) + ".shim";
}

bool read_shim(const std::string& heap, ShimFile& f) {
  f = ShimFile{};
  std::ifstream in(shim_path(heap));
  std::string magic, key;
  if (!std::getline(in, magic) || (magic != "dvr-heap-shim 1" && magic != "dvr-heap-shim 2")) return false;
  int seen = 0;
  while (in >> key) {
    if (key == "process" && (in >> f.start_time >> f.pid_ns))
      seen |= 1;
    else if (key == "range" && (in >> f.base >> f.size))
      seen |= 2;
    else if (key == "control" && (in >> f.request_fd >> f.answer_fd >> f.pipe_ino >> f.wake_fd))
      seen |= 4;
    else if (key == "sealed" && (in >> f.sealed_ino))
      seen |= 8;
    else
      return false;
  }
  if (!(seen & 4)) f.request_fd = f.answer_fd = -1;
  return (seen & 3) == 3 && f.size > 0 && f.base % kPageSize == 0 && f.size % kPageSize == 0;
}

std::size_t renew_shim_notes(const HeapImage& image, pid_t pid) {
  std::size_t renewed = 0;
  for (auto& h : image.heaps) {
    ShimFile f;
    // By PID namespace (every `dvr run` job has its own): the start time a
    // process reads of itself depends on its time namespace, which CRIU
    // gives a restored job, so the shim's own start time is not comparable.
    const auto who = identity(pid);
    if (pid <= 0 || !read_shim(h.path, f) || who.second != f.pid_ns || f.size != file_bytes(h)) continue;
    ::unlink(note_path(h.path).c_str());  // the old note holds no more once the marks are reset
    // The task is frozen: nothing is written between the snapshot and this.
    if (!reprotect_pages_of(pid, {f.base, f.base + f.size})) continue;  // private (a child maps it) or not tracked
    try {
      Store store = Store::open(h.store, {.create = false, .lock_timeout = std::chrono::milliseconds(5000)});
      TrackNote n;
      n.start_time = who.first;
      n.pid_ns = who.second;
      n.start = f.base;
      n.end = f.base + f.size;
      n.data = f.base;
      n.size = h.bytes;
      n.snapshot = image.snapshot;
      n.checksum = impl_of(store).load_manifest(h.session, image.snapshot).checksum;
      write_note(h.path, n);
      ++renewed;
    } catch (const Error&) {  // no note: the next dump compares by hash
    }
  }
  return renewed;
}

void remove_heaps(const HeapImage& image) {
  std::vector<std::pair<std::string, std::string>> done;
  for (auto& h : image.heaps) {
    if (std::find(done.begin(), done.end(), std::make_pair(h.store, h.session)) != done.end()) continue;
    done.emplace_back(h.store, h.session);
    try {
      Store store = Store::open(h.store, {.create = false});
      store.remove(h.session, image.snapshot);
    } catch (const Error& e) {
      if (e.code() != Errc::not_found) throw;
    }
  }
}

std::string format_image(const HeapImage& image) {
  std::string out = "dvr-criu-heaps 1\nsnapshot " + image.snapshot + "\n";
  for (auto& h : image.heaps)
    out += "heap " + h.store + "\t" + h.session + "\t" + h.region + "\t" + std::to_string(h.bytes) + "\t" + h.path + "\n";
  out += "end " + std::to_string(image.heaps.size()) + "\n";
  return out;
}

HeapImage parse_image(const std::string& text) {
  auto bad = [](const std::string& why) -> HeapImage {
    throw Error(Errc::corrupt, std::string(kImageName) + " is damaged (" + why + "); the process snapshot cannot be restored");
  };
  std::istringstream in(text);
  std::string line;
  if (!std::getline(in, line) || line.rfind("dvr-criu-heaps ", 0) != 0) return bad("no header");
  if (line != "dvr-criu-heaps 1")
    throw Error(Errc::unsupported,
                std::string(kImageName) + " has format '" + line.substr(15) + "', newer than this dvr understands (1); restore with a newer dvr");
  HeapImage image;
  bool ended = false;
  while (std::getline(in, line)) {
    if (line.rfind("snapshot ", 0) == 0) {
      image.snapshot = line.substr(9);
    } else if (line.rfind("heap ", 0) == 0) {
      std::vector<std::string> f;
      std::size_t at = 5;
      for (int k = 0; k < 4; ++k) {
        auto t = line.find('\t', at);
        if (t == std::string::npos) return bad("bad heap line");
        f.push_back(line.substr(at, t - at));
        at = t + 1;
      }
      HeapFile h;
      h.store = f[0];
      h.session = f[1];
      h.region = f[2];
      h.path = line.substr(at);
      try {
        h.bytes = std::stoull(f[3]);
      } catch (...) {
        return bad("bad heap size");
      }
      if (h.path.empty() || h.path[0] != '/' || h.store.empty() || h.store[0] != '/') return bad("heap path is not absolute");
      image.heaps.push_back(h);
    } else if (line.rfind("end ", 0) == 0) {
      if (line.substr(4) != std::to_string(image.heaps.size())) return bad("heap count does not match");
      ended = true;
      break;
    } else {
      return bad("unknown line");
    }
  }
  if (!ended) return bad("truncated");
  if (image.snapshot.empty()) return bad("no snapshot name");
  return image;
}

std::string heap_store(const HeapFile& h, const std::string& snapshot, const std::string& preferred, std::chrono::milliseconds lock_timeout) {
  if (!preferred.empty() && preferred != h.store) {
    try {
      Store s = Store::open(preferred, {.create = false, .lock_timeout = lock_timeout});
      for (auto& i : s.list(h.session))
        if (i.name == snapshot) return preferred;
    } catch (const Error&) {
    }
  }
  return h.store;
}

namespace {

// What putting one heap file back to a snapshot's content takes: compared
// page by page with the snapshot's page hashes through pread (holes read
// zero without being allocated, as a mapping would), so an intact heap file
// (a restore after kill -9) is only read, never written.
struct HeapPlan {
  std::string path;
  Fd fd;
  bool writable = false;  // fd opened for writing (else read-only: a heap pack needs no write)
  bool created = false;   // there was no file: the restore made it
  ByteRanges holes;  // of the file before the restore
  const ManifestRegion* region = nullptr;
  std::vector<std::size_t> fetch;                               // chunks with pages that differ
  std::vector<std::pair<std::uint64_t, std::uint64_t>> punch;  // file ranges that must read zero
};

HeapPlan plan_heap_file(unsigned threads, const Manifest& m, const ManifestRegion& mr, const HeapFile& h) {
  HeapPlan p;
  p.path = h.path;
  p.region = &mr;
  ::unlink(note_path(h.path).c_str());  // whatever it said no longer holds
  // Read-only while it may need nothing (a sealed heap, which is a heap pack:
  // only read here); opened for writing when it must change.
  p.fd = Fd(::open(h.path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!p.fd || file_size(p.fd.get(), h.path) != file_bytes(h)) {
    p.created = !p.fd && errno == ENOENT;
    p.fd = open_or_throw(h.path, O_RDWR | O_CREAT | (p.created ? O_EXCL : 0));
    p.writable = true;
    if (::ftruncate(p.fd.get(), static_cast<off_t>(file_bytes(h))) != 0) throw_errno(errno, "cannot size heap file " + h.path);
  }
  p.holes = holes_of(p.fd.get(), h.bytes);
  // Chunks that lie in holes are decided without reading; the others (zero
  // chunks the file holds allocated too) are compared page by page, on
  // every core, each read with pread into a buffer of the thread's: on a VM
  // with shadow page tables the first touch of a page through a new mapping
  // costs more than copying it (docs/performance.md, "Reading packs").
  std::vector<char> differs(mr.chunk_count, 0);
  std::vector<std::uint64_t> compare;
  for (std::uint64_t j = 0; j < mr.chunk_count; ++j) {
    const std::size_t i = mr.first_chunk + j;
    const std::uint64_t off = j * m.chunk_size, len = m.chunks[i].length;
    if (inside(p.holes, off, off + len))
      differs[j] = !m.zero_chunk(i);
    else
      compare.push_back(j);  // (a zero chunk the file holds allocated: punched only if not all zero)
  }
  const bool by_page = m.paged && m.hydrated();
  // (An old manifest without page hashes: every chunk is fetched.)
  std::atomic<int> failed{0};
  parallel_for(threads, compare.size(), compare.size() * m.chunk_size, [&](std::size_t b, std::size_t e) {
    std::unique_ptr<char[]> data(new char[m.chunk_size]);
    for (std::size_t k = b; k < e && !failed; ++k) {
      const std::uint64_t j = compare[k];
      const std::size_t i = mr.first_chunk + j;
      const std::uint64_t len = m.chunks[i].length, off = j * m.chunk_size;
      bool same = by_page;
      if (same) {
        // A file that ends early (cut meanwhile): what is missing differs, and is fetched.
        int err = 0;
        same = read_at_most(p.fd.get(), data.get(), len, off, err) == len;
        if (err != 0) failed = err;
      }
      for (std::uint32_t pg = 0; same && pg < m.pages_of(i); ++pg) {
        const std::uint64_t plen = std::min<std::uint64_t>(kPageSize, len - pg * kPageSize);
        same = page_hash(data.get() + pg * kPageSize, plen) == m.hashes_of(i)[pg];
      }
      differs[j] = !same;
    }
  });
  if (failed) throw_errno(failed, "cannot read heap file " + h.path + " to check it against the snapshot");
  for (std::uint64_t j = 0; j < mr.chunk_count; ++j) {
    if (!differs[j]) continue;
    if (m.zero_chunk(mr.first_chunk + j))
      p.punch.emplace_back(j * m.chunk_size, m.chunks[mr.first_chunk + j].length);
    else
      p.fetch.push_back(mr.first_chunk + j);
  }
  return p;
}

void apply_heap_plan(SnapshotReader& reader, const Manifest& m, HeapPlan& p, std::vector<char>& buf, HeapUndo* undo) {
  if (p.created && undo) {
    // Nothing to keep of it: undone, it goes again.
    std::uint64_t bytes = 0;
    for (std::size_t i : p.fetch)
      bytes += m.chunks[i].length;
    undo->created(p.path, bytes);
    undo = nullptr;
  }
  if (p.fetch.empty() && p.punch.empty()) return;  // intact: only read
  if (!p.writable) {
    p.fd = open_or_throw(p.path, O_RDWR);
    p.writable = true;
  }
  for (auto& [off, len] : p.punch)
    if (undo) undo->save(p.fd.get(), p.path, off, len, inside(p.holes, off, off + len));
  for (std::size_t i : p.fetch) {
    const std::uint64_t off = (i - p.region->first_chunk) * m.chunk_size, len = m.chunks[i].length;
    if (undo) undo->save(p.fd.get(), p.path, off, len, inside(p.holes, off, off + len));
  }
  for (auto& [off, len] : p.punch)
    if (::fallocate(p.fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(off), static_cast<off_t>(len)) != 0) {
      // No hole punching here: write the zeros.
      std::vector<char> zeros(len, 0);
      write_all_at(p.fd.get(), zeros.data(), len, off, "heap file " + p.path);
    }
  for (std::size_t i : p.fetch) {
    reader.read(m, i, buf.data(), "heap snapshot " + m.session + "/" + m.name);
    const std::uint64_t off = (i - p.region->first_chunk) * m.chunk_size;
    write_all_at(p.fd.get(), buf.data(), m.chunks[i].length, off, "heap file " + p.path);
  }
  if (::fdatasync(p.fd.get()) != 0) throw_errno(errno, "cannot sync restored heap file " + p.path);
}

// Makes `h.path` the file to put back: the heap pack itself when the
// snapshot lies in place in one (a sealed heap: linked there, nothing
// copied, and only read below to check it), and never a file that is linked
// elsewhere when it must be written (a heap pack other snapshots hold): that
// one is moved aside, and a new file is filled.
void place_heap_file(StoreImpl& si, const Manifest& m, const ManifestRegion& mr, const HeapFile& h, HeapUndo* undo) {
  struct stat st {};
  const bool exists = ::lstat(h.path.c_str(), &st) == 0;
  auto set_aside = [&] {
    if (undo)
      undo->set_aside(h.path);
    else if (::unlink(h.path.c_str()) != 0)
      throw_errno(errno, "cannot replace heap file " + h.path);
  };
  if (const std::uint32_t pack = in_place_pack(m, mr.name, mr.size, *si.packs)) {
    const std::string from = si.packs->heap_path_of(pack);
    struct stat ps {};
    if (::lstat(from.c_str(), &ps) != 0)
      throw Error(Errc::corrupt, "heap pack " + from + " of heap snapshot " + m.session + "/" + m.name + " is missing; run `dvr verify`");
    if (exists && st.st_ino == ps.st_ino && st.st_dev == ps.st_dev) return;
    const std::string tmp = h.path + ".dvr-" + random_hex().substr(0, 12);
    if (::link(from.c_str(), tmp.c_str()) == 0) {
      try {
        if (exists) set_aside();
        if (::rename(tmp.c_str(), h.path.c_str()) != 0) throw_errno(errno, "cannot put heap pack " + from + " at " + h.path);
      } catch (...) {
        ::unlink(tmp.c_str());
        throw;
      }
      fsync_dir(parent_dir(h.path));
      return;
    }
    if (errno != EXDEV) throw_errno(errno, "cannot link heap pack " + from + " to " + h.path);
    // Another file system (a clone's private view without it): filled below.
  }
  if (exists && st.st_nlink > 1) set_aside();
}

}  // namespace

HeapUndo::HeapUndo(std::string file) : file_(std::move(file)) {}

HeapUndo::~HeapUndo() {
  if (fd_ >= 0) ::close(fd_);
  if (!file_.empty()) ::unlink(file_.c_str());
  for (auto& [path, aside] : aside_)
    ::unlink(aside.c_str());  // kept (revert() renamed it back) or no longer needed
}

void HeapUndo::set_aside(const std::string& path) {
  const std::string to = file_ + ".file" + std::to_string(aside_.size());
  if (::rename(path.c_str(), to.c_str()) != 0) throw_errno(errno, "cannot move heap file " + path + " aside (to " + to + ")");
  aside_.emplace_back(path, to);
}

void HeapUndo::save(int fd, const std::string& path, std::uint64_t offset, std::uint64_t len, bool hole) {
  if (hole) {
    pieces_.push_back({path, offset, len, ~std::uint64_t(0)});
    return;
  }
  if (fd_ < 0) {
    fd_ = ::open(file_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd_ < 0) throw_errno(errno, "cannot create " + file_ + " (the heaps' present content, kept while CRIU restores)");
  }
  std::vector<char> old(len);
  read_exact_at(fd, old.data(), len, offset, "heap file " + path);
  write_all_at(fd_, old.data(), len, used_, file_);
  pieces_.push_back({path, offset, len, used_});
  used_ += len;
}

void HeapUndo::created(const std::string& path, std::uint64_t bytes) { created_.emplace_back(path, bytes); }

std::vector<std::pair<std::string, std::uint64_t>> HeapUndo::rewritten() const {
  std::vector<std::pair<std::string, std::uint64_t>> out;
  for (auto& p : pieces_) {
    auto it = std::find_if(out.begin(), out.end(), [&](auto& x) { return x.first == p.path; });
    if (it == out.end())
      out.emplace_back(p.path, p.len);
    else
      it->second += p.len;
  }
  return out;
}

void HeapUndo::revert() noexcept {
  revert_pieces();
  for (auto it = created_.rbegin(); it != created_.rend(); ++it)
    (void)::unlink(it->first.c_str());
  for (auto it = aside_.rbegin(); it != aside_.rend(); ++it)
    (void)::rename(it->second.c_str(), it->first.c_str());
}

void HeapUndo::revert_pieces() noexcept {
  std::vector<char> buf;
  for (auto it = pieces_.rbegin(); it != pieces_.rend(); ++it) {
    int fd = ::open(it->path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    if (it->at == ~std::uint64_t(0)) {
      (void)::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(it->offset), static_cast<off_t>(it->len));
    } else {
      buf.resize(it->len);
      if (::pread(fd_, buf.data(), it->len, static_cast<off_t>(it->at)) == static_cast<ssize_t>(it->len))
        (void)!::pwrite(fd, buf.data(), it->len, static_cast<off_t>(it->offset));
    }
    ::close(fd);
  }
}

namespace {

// `p` split at '/', or nullopt unless it is a plain absolute path (no empty,
// "." or ".." component).
std::optional<std::vector<std::string>> plain_components(const std::string& p) {
  if (p.empty() || p[0] != '/') return std::nullopt;
  std::vector<std::string> out;
  std::size_t at = 1;
  while (at <= p.size()) {
    std::size_t slash = p.find('/', at);
    if (slash == std::string::npos) slash = p.size();
    std::string c = p.substr(at, slash - at);
    if (c.empty() || c == "." || c == "..") return std::nullopt;
    out.push_back(std::move(c));
    at = slash + 1;
  }
  return out;
}

// A root directory as given and, when it exists, as the kernel resolves it.
std::vector<std::string> root_spellings(const std::string& dir) {
  std::vector<std::string> out;
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/')
    d.pop_back();
  out.push_back(d);
  char real[PATH_MAX];
  if (::realpath(d.c_str(), real) && out[0] != real) out.push_back(real);
  return out;
}

}  // namespace

void check_heap_path(const std::string& path, const std::string& session, const std::string& region, const std::string& source_store,
                     const HeapPolicy& policy, const std::string& what) {
  const std::string own = policy.store.empty() ? std::string() : policy.store + "/heaps";
  std::string allowed = own.empty() ? std::string() : own;
  for (auto& d : policy.dirs)
    allowed += (allowed.empty() ? "" : ", ") + d;
  auto refuse = [&](const std::string& why) {
    throw Error(Errc::permission, what + " would write heap file " + path + ", which " + why + "; heap files are written only as DIR/SESSION/REGION in " +
                                      (allowed.empty() ? std::string("the heap area of the store restored from") : allowed) +
                                      ". Nothing was changed. If you trust this snapshot and want its heap there, name that heap directory: "
                                      "`dvr proc restore|clone NAME --heap-dir DIR` (RestoreOptions::heap_dirs)");
  };
  const auto parts = plain_components(path);
  if (!parts || parts->size() < 3) refuse("is not a plain absolute path (a '.' or '..' component, '//', or too short)");
  if (!valid_name(session) || (*parts)[parts->size() - 2] != session) refuse("is not in a directory named after its heap session '" + session + "'");
  if (!valid_name(parts->back()) || (!region.empty() && parts->back() != region)) refuse("is not named after its heap region");
  const std::string dir = parent_dir(parent_dir(path));  // ROOT of ROOT/SESSION/REGION
  bool operator_named = false, in_own = false;
  for (auto& d : policy.dirs)
    for (auto& spelling : root_spellings(d))
      operator_named = operator_named || spelling == dir;
  if (!own.empty())
    for (auto& spelling : root_spellings(own))
      in_own = in_own || spelling == dir;
  if (!operator_named && !in_own) refuse("lies outside the allowed heap directories");
  // Nothing on the way may lead elsewhere: the root a real directory (for
  // the store's own area; one the operator named is taken as it resolves),
  // SESSION a real directory and no store, REGION a regular file.
  struct stat st {};
  if (!operator_named && ::lstat(dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) refuse("lies below " + dir + ", which is not a real directory (a symbolic link?)");
  const std::string session_dir = parent_dir(path);
  if (::lstat(session_dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) refuse("lies below " + session_dir + ", which is not a real directory (a symbolic link?)");
    if (::lstat((session_dir + "/" + kSuperblockName).c_str(), &st) == 0) refuse("lies inside another store (" + session_dir + ")");
  }
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) refuse("exists and is not a regular file (a symbolic link, a device, a directory?)");
  if (!operator_named && !source_store.empty() && !policy.store.empty()) {
    bool same = false;
    for (auto& a : root_spellings(source_store))
      for (auto& b : root_spellings(policy.store))
        same = same || a == b;
    if (!same) refuse("would be filled from store " + source_store + ", not from the store restored from");
  }
}

void restore_heaps(const HeapImage& original, const HeapPolicy& policy, std::chrono::milliseconds lock_timeout, HeapUndo* undo) {
  HeapImage image = original;
  const std::string what = "heap snapshot '" + image.snapshot + "'";
  // Where each file would go and where its data would come from: checked
  // before any store but the one restored from is opened.
  for (auto& h : image.heaps) {
    check_heap_path(h.path, h.session, h.region, "", policy, what);
    h.store = heap_store(h, image.snapshot, policy.store, lock_timeout);
    check_heap_path(h.path, h.session, h.region, h.store, policy, what);
  }
  // Check everything before any file changes.
  for (auto& h : image.heaps) {
    Store store = Store::open(h.store, {.create = false, .lock_timeout = lock_timeout});
    SnapshotInfo info = store.info(h.session, image.snapshot);
    bool recorded =
        std::any_of(info.regions.begin(), info.regions.end(), [&](const RegionInfo& r) { return r.name == h.region && r.size == h.bytes; });
    if (!recorded)
      throw Error(Errc::corrupt, "heap snapshot " + h.session + "/" + image.snapshot + " in store " + h.store + " does not hold heap " + h.path +
                                     " (" + std::to_string(h.bytes) + " bytes) that the process snapshot refers to");
    struct stat st {};
    if (::stat(h.path.c_str(), &st) == 0 && static_cast<std::uint64_t>(st.st_size) != file_bytes(h))
      throw Error(Errc::invalid_argument, "heap file " + h.path + " is " + std::to_string(st.st_size) + " bytes now but was " +
                                              std::to_string(file_bytes(h)) +
                                              " bytes at the dump: it was changed behind dvr's back; "
                                              "move it away (or delete it) and restore again — nothing was changed");
  }
  std::vector<std::pair<std::string, std::string>> groups;
  for (auto& h : image.heaps)
    if (std::find(groups.begin(), groups.end(), std::make_pair(h.store, h.session)) == groups.end()) groups.emplace_back(h.store, h.session);
  for (auto& [store_path, session] : groups) {
    Store store = Store::open(store_path, {.create = false, .lock_timeout = lock_timeout});
    SnapshotReader reader(impl_of(store));
    const Manifest m = reader.load(session, image.snapshot);
    std::vector<HeapPlan> plans;
    for (auto& h : image.heaps) {
      if (h.store != store_path || h.session != session) continue;
      make_private_dir(parent_dir(parent_dir(h.path)));
      make_private_dir(parent_dir(h.path));
      const ManifestRegion* mr = nullptr;
      for (auto& r : m.regions)
        if (r.name == h.region && r.size == h.bytes) mr = &r;
      if (!mr) throw Error(Errc::corrupt, "heap snapshot " + session + "/" + image.snapshot + " lost region " + h.region);
      place_heap_file(impl_of(store), m, *mr, h, undo);
      plans.push_back(plan_heap_file(impl_of(store).threads, m, *mr, h));
    }
    // Every chunk to be written is read and checked before any file changes.
    std::vector<char> buf(m.chunk_size);
    for (auto& p : plans)
      for (std::size_t i : p.fetch)
        reader.read(m, i, buf.data(), "heap snapshot " + session + "/" + image.snapshot);
    for (auto& p : plans)
      apply_heap_plan(reader, m, p, buf, undo);
  }
}

}  // namespace dvr::detail::heaps
