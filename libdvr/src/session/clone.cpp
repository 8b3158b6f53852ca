// Thin clones: a snapshot's regions mapped MAP_PRIVATE from the pack files.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>

#include "dvr/clone.hpp"
#include "dvr/dvr.hpp"
#include "format/chunks.hpp"
#include "base/mapping.hpp"
#include "base/memops.hpp"
#include "base/env.hpp"
#include "store/reader.hpp"
#include "store/store_impl.hpp"

namespace dvr {

using detail::ChunkRef;
using detail::Manifest;
using detail::StoreImpl;

struct Clone::State {
  std::string session, snapshot;
  std::vector<std::unique_ptr<Region>> regions;
  std::vector<detail::Mapping> maps;  // one reservation per region
  detail::Fd pin_lock;                // flock()ed while the clone lives
  std::string pin_path, lock_path;
  std::string store_path;  // set once the pin is counted (StoreImpl::count_change)

  ~State() {
    regions.clear();
    maps.clear();
    if (!pin_path.empty()) detail::env().unlink(pin_path.c_str());
    if (!lock_path.empty()) detail::env().unlink(lock_path.c_str());
    // The pinned space may be reused: tell the other processes' indexes.
    if (!pin_path.empty() && !store_path.empty()) detail::change_counter(store_path, true);
  }
};

Clone::Clone(std::unique_ptr<State> state) : state_(std::move(state)) {}
Clone::~Clone() = default;
Clone::Clone(Clone&&) noexcept = default;
Clone& Clone::operator=(Clone&&) noexcept = default;
const std::string& Clone::session() const { return state_->session; }
const std::string& Clone::snapshot() const { return state_->snapshot; }

Region& Clone::region(const std::string& name) {
  for (auto& r : state_->regions)
    if (r->name() == name) return *r;
  throw Error(Errc::not_found, "clone of '" + state_->session + "/" + state_->snapshot + "' has no region '" + name + "'");
}

std::vector<Region*> Clone::regions() const {
  std::vector<Region*> out;
  for (auto& r : state_->regions)
    out.push_back(r.get());
  return out;
}

Clone Store::open_snapshot(const std::string& session, const std::string& snapshot) const { return open_snapshot(session, snapshot, CloneOptions{}); }

Clone Store::open_snapshot(const std::string& session, const std::string& snapshot, const CloneOptions& options) const {
  using namespace detail;
  const std::string ref = StoreImpl::ref(session, snapshot);
  // The shared lock keeps removal and gc away until the pin is in place.
  SnapshotReader reader(*impl_);
  std::string bytes;
  Manifest m = reader.load(session, snapshot, &bytes);

  if (options.verify) {
    std::vector<std::size_t> all(m.chunks.size());
    for (std::size_t i = 0; i < all.size(); ++i)
      all[i] = i;
    std::string why;
    if (first_damaged(impl_->threads, *impl_->packs, m, all, &why) != SIZE_MAX)
      throw Error(Errc::corrupt, "cannot clone '" + ref + "': it is damaged (" + why + "); run `dvr verify`");
  }

  auto state = std::make_unique<Clone::State>();
  state->session = session;
  state->snapshot = snapshot;
  // Pin the data: the manifest in pins/ (PIN.snap), with a lock file of its
  // own (PIN.lock) flocked for the clone's life; gc deletes a pin whose lock
  // nobody holds. The lock is in place before the pin appears, so gc never
  // sees a live pin unlocked. The pin is a hard link to the snapshot's
  // manifest file (a copy where the file system has no hard links, or where
  // a writer replaced the snapshot since it was read: writers do not wait
  // for readers, so the linked file is compared with the version loaded).
  const std::string pin_name = impl_->pins_dir() + "/" + random_hex();
  {
    std::string tmp_lock = impl_->tmp_dir() + "/" + random_hex() + ".lock";
    Fd pin_lock = open_or_throw(tmp_lock, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (::flock(pin_lock.get(), LOCK_SH) != 0 || env().rename(tmp_lock.c_str(), (pin_name + ".lock").c_str()) != 0) {
      int err = errno;
      env().unlink(tmp_lock.c_str());
      throw_errno(err, "cannot lock a pin for a clone of '" + ref + "' in " + impl_->pins_dir());
    }
    state->pin_lock = std::move(pin_lock);
    state->lock_path = pin_name + ".lock";
  }
  {
    std::string tmp = impl_->tmp_dir() + "/" + random_hex() + ".pin";
    bool linked = env().link(impl_->manifest_path(session, snapshot).c_str(), tmp.c_str()) == 0;
    if (linked && read_file(tmp) != bytes) {
      env().unlink(tmp.c_str());  // replaced since it was read: pin the version loaded
      linked = false;
    }
    if (!linked) {
      Fd fd = open_or_throw(tmp, O_RDWR | O_CREAT | O_EXCL, 0600);
      try {
        write_all(fd.get(), bytes.data(), bytes.size(), tmp);
      } catch (...) {
        env().unlink(tmp.c_str());
        throw;
      }
    }
    std::string pin = pin_name + kManifestSuffix;
    if (env().rename(tmp.c_str(), pin.c_str()) != 0) {
      int err = errno;
      env().unlink(tmp.c_str());
      throw_errno(err, "cannot pin the data of '" + ref + "' in " + pin);
    }
    state->pin_path = pin;
    // Counted after the rename, so every writer's next refresh reads the pin
    // (not own: this handle's index does not hold it). A pin that cannot be
    // counted is not kept (~State removes it): writers might not see it.
    impl_->count_change(false);
    state->store_path = impl_->path;
  }

  std::map<std::uint32_t, Fd> pack_fds;
  auto map_from_pack = [&](void* at, std::uint64_t len, std::uint32_t pack, std::uint64_t offset) {
    auto& fd = pack_fds[pack];
    if (!fd) fd = impl_->packs->open_read(pack);
    void* got = ::mmap(at, round_up_page(len), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd.get(), static_cast<off_t>(offset));
    if (got == MAP_FAILED) throw_errno(errno, "cannot map the data of '" + ref + "' from " + impl_->packs->path_of(pack));
  };
  for (auto& mr : m.regions) {
    std::size_t span = round_up_page(mr.size);
    state->maps.push_back(detail::Mapping::anonymous(span, "of address space for region '" + mr.name + "' of a clone"));
    void* base = state->maps.back().data();
    // Runs of chunks stored back to back in one pack become one mapping;
    // all-zero chunks stay anonymous (zero) memory.
    for (std::uint64_t i = 0; i < mr.chunk_count;) {
      const ChunkRef& first = m.chunks[mr.first_chunk + i];
      if (first.is_zero()) {
        ++i;
        continue;
      }
      std::uint64_t j = i + 1, bytes_in_run = first.length;
      while (j < mr.chunk_count) {
        const ChunkRef& prev = m.chunks[mr.first_chunk + j - 1];
        const ChunkRef& next = m.chunks[mr.first_chunk + j];
        if (next.is_zero() || next.pack != first.pack || next.offset != prev.offset + m.chunk_size || prev.length != m.chunk_size) break;
        bytes_in_run += next.length;
        ++j;
      }
      map_from_pack(static_cast<char*>(base) + i * m.chunk_size, bytes_in_run, first.pack, first.offset);
      i = j;
    }
    // Pages stored apart go on top, one mapping each (all-zero ones as fresh
    // anonymous memory).
    for (std::uint32_t k = m.first_overlay[mr.first_chunk]; k < m.first_overlay[mr.first_chunk + mr.chunk_count]; ++k) {
      const Overlay& o = m.overlays[k];
      char* at = static_cast<char*>(base) + (o.chunk - mr.first_chunk) * m.chunk_size + o.page * kPageSize;
      if (o.pack) {
        map_from_pack(at, kPageSize, o.pack, o.offset);
      } else if (::mmap(at, kPageSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED) {
        throw_errno(errno, "cannot map a zero page of '" + ref + "'");
      }
    }
    state->regions.push_back(std::make_unique<Region>(mr.name, base, mr.size, false));
  }
  return Clone(std::move(state));
}

Clone Session::clone(const std::string& snapshot) { return store().open_snapshot(name(), snapshot); }
Clone Session::clone(const std::string& snapshot, const CloneOptions& options) { return store().open_snapshot(name(), snapshot, options); }

}  // namespace dvr
