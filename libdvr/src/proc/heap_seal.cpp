// Sealing the heaps of `dvr run --heap` programs at a dump (see heap_seal.hpp).
#include "proc/heap_seal.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include "base/mapping.hpp"
#include "base/os.hpp"
#include "dvr/store.hpp"
#include "store/store_impl.hpp"
#include "store/writer.hpp"

namespace dvr::detail::heaps {

namespace {

constexpr std::chrono::seconds kAnswerWithin{5};

std::string proc_fd(pid_t pid, int fd) { return "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd); }

// Asks the libdvr_heap.so that wrote `shim` to seal its heap, through its
// control pipe, as held by one of the processes of `tree` (a forked child
// holds the same pipe). True once it answered that the heap is sealed.
bool ask_to_seal(const std::vector<pid_t>& tree, const ShimFile& shim, std::string& why) {
  if (shim.request_fd < 0 || shim.answer_fd < 0) {
    why = "its libdvr_heap.so has no control pipe (an older one: restart the program under this dvr run --heap)";
    return false;
  }
  for (pid_t pid : tree) {
    struct stat st {};
    const std::string request = proc_fd(pid, shim.request_fd);
    if (::stat(request.c_str(), &st) != 0 || !S_ISFIFO(st.st_mode) || static_cast<std::uint64_t>(st.st_ino) != shim.pipe_ino) continue;
    Fd out(::open(request.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
    Fd in(::open(proc_fd(pid, shim.answer_fd).c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
    if (!out || !in) {
      why = std::string("cannot open its control pipe through /proc/") + std::to_string(pid) + "/fd: " + std::strerror(errno);
      return false;
    }
    char junk[256];
    while (::read(in.get(), junk, sizeof junk) > 0) {
    }  // answers nobody waited for
    const char seq = static_cast<char>(std::random_device{}() & 0xff);
    const char request_bytes[2] = {'S', seq};
    if (::write(out.get(), request_bytes, 2) != 2) {
      why = std::string("cannot write to its control pipe: ") + std::strerror(errno);
      return false;
    }
    const auto deadline = std::chrono::steady_clock::now() + kAnswerWithin;
    char answer[2];
    std::size_t have = 0;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) break;
      pollfd p{in.get(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      ssize_t n = ::read(in.get(), answer + have, 2 - have);
      if (n <= 0) {
        if (n == 0) break;  // nobody holds the other end any more: the program is gone
        continue;
      }
      have += static_cast<std::size_t>(n);
      if (have < 2) continue;
      have = 0;
      if (answer[1] != seq) continue;  // an answer to an earlier request
      if (answer[0] == 'K') return true;
      why = "it could not map its heap copy-on-write (see the program's output)";
      return false;
    }
    why = "it did not answer within " + std::to_string(kAnswerWithin.count()) + " s (is the process stopped?)";
    return false;
  }
  why = "no process of the tree holds its control pipe";
  return false;
}

// The heap pack of `packs` that is the file `st`, or 0.
std::uint32_t heap_pack_of(Packs& packs, const struct stat& st) {
  for (auto id : packs.ids()) {
    struct stat ps {};
    if (packs.is_heap(id) && ::lstat(packs.heap_path_of(id).c_str(), &ps) == 0 && ps.st_ino == st.st_ino && ps.st_dev == st.st_dev) return id;
  }
  return 0;
}

// Links sealed heap file `path` (`st`) into the store as a heap pack, unless
// it is one already. Under the writers' lock (no other pack is created meanwhile).
std::uint32_t link_heap_pack(StoreImpl& si, const std::string& path, const struct stat& st) {
  if (std::uint32_t id = heap_pack_of(*si.packs, st)) return id;
  auto ids = si.packs->ids();
  std::uint32_t id = ids.empty() ? 1 : ids.back() + 1;
  std::string to;
  for (;; ++id) {
    to = si.packs->heap_path_of(id);
    if (::link(path.c_str(), to.c_str()) == 0) break;
    if (errno != EEXIST) throw_errno(errno, "cannot link sealed heap file " + path + " into the store as " + to);
  }
  struct stat now {};
  if (::lstat(to.c_str(), &now) != 0 || now.st_ino != st.st_ino || now.st_dev != st.st_dev) {
    ::unlink(to.c_str());
    throw Error(Errc::io, "heap file " + path + " was replaced while it was sealed; nothing was linked");
  }
  fsync_dir(si.path + "/packs");
  si.packs->ids();  // knows it as a heap pack now
  return id;
}

// Publishes snapshot `snapshot` of heap `h` (sealed file `st`) in place, in
// `store` when that is the heap's store (its index is current already), else
// in the heap's own. `base`: the heap snapshot of the previous dump; when it
// lies in place in this very file, the new one is a copy of its chunk table
// (the file has not changed since: nothing writes a sealed heap).
void snapshot_in_place(Store& store, HeapFile& h, const struct stat& st, const std::string& snapshot, const std::string& base_name) {
  std::optional<Store> own;
  if (store.path() != h.store) own.emplace(Store::open(h.store, {.create = false}));
  Store& target = own ? *own : store;
  StoreImpl& si = impl_of(target);
  h.bytes = static_cast<std::uint64_t>(st.st_size);
  // The base without its page hashes: its chunk table is all a copy needs.
  std::optional<Manifest> base;
  if (const std::uint32_t known = heap_pack_of(*si.packs, st); known && !base_name.empty()) {
    try {
      base = si.load_manifest(h.session, base_name, nullptr, false);
      if (in_place_pack(*base, h.region, h.bytes, *si.packs) != known) base.reset();
    } catch (const Error&) {  // removed or damaged: hashed anew
    }
  }
  WriteBatch batch(si);
  // Still published exactly so (no gc can have freed its pack since: the
  // batch holds the writers' lock from here on).
  if (base && !si.manifest_indexed(base->session, base->name, base->checksum)) base.reset();
  const std::uint32_t pack = link_heap_pack(si, h.path, st);
  SnapshotWriter writer(batch, h.session, snapshot, {.label = "heaps of process snapshot " + snapshot, .parent = base ? base->name : ""});
  writer.add_region(h.region, h.bytes, false);
  writer.seal();
  std::uint64_t read = 0;
  if (base) {
    const ManifestRegion* br = nullptr;
    for (auto& r : base->regions)
      if (r.name == h.region && r.size == h.bytes) br = &r;
    for (std::uint64_t j = 0; j < br->chunk_count; ++j)
      if (base->chunks[br->first_chunk + j].is_zero())
        writer.zero(j);
      else
        writer.unchanged(j, base->chunks[br->first_chunk + j]);
  } else {
    const std::string file = si.packs->heap_path_of(pack);
    Fd fd = open_or_throw(file, O_RDONLY);
    read = write_in_place(writer, 0, pack, fd.get(), holes_of(fd.get(), h.bytes));
  }
  writer.set_provenance(false, read);
  batch.publish({&writer});
}

}  // namespace

bool sealing_enabled() {
  const char* v = std::getenv("DVR_PROC_HEAP_SEAL");
  return !v || std::strcmp(v, "0") != 0;
}

std::uint32_t in_place_pack(const Manifest& m, const std::string& region, std::uint64_t bytes, Packs& packs) {
  for (auto& r : m.regions) {
    if (r.name != region || r.size != bytes) continue;
    std::uint32_t pack = 0;
    for (std::uint64_t j = 0; j < r.chunk_count; ++j) {
      const std::size_t i = r.first_chunk + j;
      if (m.has_overlays(i)) return 0;
      const ChunkRef& c = m.chunks[i];
      if (c.is_zero()) continue;
      if (c.offset != j * m.chunk_size || (pack && c.pack != pack)) return 0;
      pack = c.pack;
    }
    if (pack && !packs.is_heap(pack)) packs.ids();
    return pack && packs.is_heap(pack) ? pack : 0;
  }
  return 0;
}

std::vector<HeapFile> seal_heaps(Store& store, const std::vector<pid_t>& tree, const std::string& snapshot, const std::string& base,
                                 std::vector<std::string>* skipped) {
  std::vector<HeapFile> out;
  if (!sealing_enabled()) return out;
  std::set<std::string> seen;
  for (pid_t pid : tree) {
    std::vector<std::string> files;
    try {
      files = mapped_heaps(pid);
    } catch (const Error&) {
      continue;  // gone meanwhile: CRIU will say so
    }
    for (auto& path : files) {
      if (!seen.insert(path).second) continue;
      ShimFile shim;
      if (!read_shim(path, shim)) continue;  // an SDK heap: its session tracks it; the plugin snapshots it
      std::string why;
      try {
        HeapFile h = heap_file_of(path);
        if (!ask_to_seal(tree, shim, why)) throw Error(Errc::unsupported, why);
        // The shim says what it sealed (written before it answered).
        struct stat st {};
        if (!read_shim(path, shim) || shim.sealed_ino == 0 || ::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) ||
            static_cast<std::uint64_t>(st.st_ino) != shim.sealed_ino)
          throw Error(Errc::io, "the heap file is not the file the program sealed (replaced meanwhile?)");
        // Mapped shared and writable anywhere, it can still change: no snapshot.
        if (mapped_writable(st, 0, true)) throw Error(Errc::io, "a process still maps the heap file shared and writable");
        snapshot_in_place(store, h, st, snapshot, base);
        out.push_back(h);
      } catch (const Error& e) {
        if (e.code() == Errc::already_exists) throw;
        if (skipped) skipped->push_back("heap " + path + " not sealed (it is copied instead): " + e.what());
      }
    }
  }
  return out;
}

void wake_shims(const std::vector<std::string>& heaps, const std::vector<pid_t>& tree) {
  for (auto& path : heaps) {
    ShimFile shim;
    if (!read_shim(path, shim) || shim.request_fd < 0) continue;
    for (pid_t pid : tree) {
      // Its request pipe, both of whose ends the shim holds (a restore gives
      // the pipe a new inode, but keeps the descriptors): never another pipe.
      struct stat st {}, other {};
      const std::string fd = proc_fd(pid, shim.request_fd);
      if (shim.wake_fd < 0 || ::stat(fd.c_str(), &st) != 0 || !S_ISFIFO(st.st_mode) ||
          ::stat(proc_fd(pid, shim.wake_fd).c_str(), &other) != 0 || other.st_ino != st.st_ino || other.st_dev != st.st_dev)
        continue;
      Fd out(::open(fd.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
      if (out && ::write(out.get(), "f", 1) == 1) break;
    }
  }
}

std::string format_sealed(const std::vector<HeapFile>& heaps) {
  std::string out;
  for (auto& h : heaps)
    out += std::to_string(h.bytes) + "\t" + h.path + "\n";
  return out;
}

std::vector<HeapFile> parse_sealed(const std::string& text) {
  std::vector<HeapFile> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    auto tab = line.find('\t');
    if (tab == std::string::npos) continue;
    HeapFile h = heap_file_of(line.substr(tab + 1));
    h.bytes = std::strtoull(line.substr(0, tab).c_str(), nullptr, 10);
    out.push_back(h);
  }
  return out;
}

}  // namespace dvr::detail::heaps
