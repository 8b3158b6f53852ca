// Process snapshots as a store holds them (see catalog.hpp).
#include "proc/catalog.hpp"

#include <algorithm>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "dvr/clone.hpp"
#include "proc/heap_seal.hpp"
#include "proc/metadata.hpp"
#include "store/reader.hpp"
#include "store/store_impl.hpp"

namespace dvr::proc {

namespace heaps = detail::heaps;

namespace impl {

namespace {

// The heap snapshots of `p`, each in its heap's own store.
heaps::HeapImage heap_image(const ProcInfo& p) {
  heaps::HeapImage img;
  img.snapshot = kHeapPrefix + p.name;
  for (auto& h : p.heaps)
    img.heaps.push_back({h.store, h.session, "", h.path, h.bytes});
  return img;
}

}  // namespace

heaps::HeapImage heap_image_in(const Store& store, const ProcInfo& p) {
  heaps::HeapImage img = heap_image(p);
  // A snapshot received from elsewhere names stores of the sender's choosing
  // in its metadata: its heap snapshots are looked for (counted, removed
  // with it) in this store only, as its restore reads them from nowhere else
  // (docs/migration.md, "Security model"). One dumped here may have its heap
  // in the store the heap lives in.
  for (auto& h : img.heaps)
    h.store = p.received() ? store.path() : heaps::heap_store(h, img.snapshot, store.path());
  return img;
}

std::uint64_t account_heaps(const Store& store, ProcInfo& p) {
  std::uint64_t n = 0;
  // Each heap snapshot (one per store and session, holding every heap of
  // that session) is read once: its bytes counted, its regions checked.
  struct Loaded {
    std::string store, session;
    Store handle;
    detail::Manifest m;
  };
  std::vector<Loaded> loaded;
  heaps::HeapImage img = heap_image_in(store, p);
  for (std::size_t k = 0; k < img.heaps.size(); ++k) {
    const heaps::HeapFile& h = img.heaps[k];
    try {
      auto it = std::find_if(loaded.begin(), loaded.end(), [&](const Loaded& l) { return l.store == h.store && l.session == h.session; });
      if (it == loaded.end()) {
        Store s = Store::open(h.store, {.create = false});
        detail::Manifest m = detail::impl_of(s).load_manifest(h.session, img.snapshot, nullptr, false);
        n += m.stored_bytes;
        loaded.push_back({h.store, h.session, std::move(s), std::move(m)});
        it = std::prev(loaded.end());
      }
      p.heaps[k].sealed = heaps::in_place_pack(it->m, h.path.substr(h.path.find_last_of('/') + 1), h.bytes, *detail::impl_of(it->handle).packs) != 0;
    } catch (const Error&) {
    }
  }
  return n;
}

namespace {

// The metadata region of proc/NAME, checked, and nothing else of it (opening
// the whole snapshot would map every window of a GiB-sized job).
std::string read_meta(const Store& store, const std::string& name) {
  detail::SnapshotReader rd(detail::impl_of(store));
  const detail::Manifest m = rd.load(kImageSession, name);
  for (auto& r : m.regions) {
    if (r.name != kMetaRegion) continue;
    std::string text(r.chunk_count * m.chunk_size, '\0');
    for (std::uint64_t j = 0; j < r.chunk_count; ++j)
      rd.read(m, r.first_chunk + j, text.data() + j * m.chunk_size, "process snapshot '" + name + "' (" + kMetaRegion + ")");
    text.resize(r.size);
    return text;
  }
  throw Error(Errc::corrupt, "process snapshot '" + name + "' has no metadata (" + kMetaRegion + "); remove it with `dvr proc rm " + name + "`");
}

ProcInfo read_info(const Store& store, const SnapshotInfo& si, bool verify) {
  if (si.damaged) throw Error(Errc::corrupt, "process snapshot '" + si.name + "' is damaged: " + si.damage);
  if (verify) (void)store.open_snapshot(kImageSession, si.name, {.verify = true});  // every byte checked
  ProcInfo p = decode_meta(read_meta(store, si.name), si.name).info;
  p.time_ns = si.time_ns;
  p.seq = si.seq;
  p.origin_time_ns = si.origin_time_ns;
  p.parent = si.parent;
  p.stored_bytes = si.stored_bytes + account_heaps(store, p);
  return p;
}

}  // namespace

}  // namespace impl

std::vector<ProcInfo> list(const Store& store) {
  std::vector<ProcInfo> out;
  for (auto& si : store.list(kImageSession)) {
    try {
      out.push_back(impl::read_info(store, si, false));
    } catch (const Error& e) {
      ProcInfo p;
      p.name = si.name;
      p.time_ns = si.time_ns;
      p.seq = si.seq;
      p.origin_time_ns = si.origin_time_ns;
      p.command = std::string("(damaged: ") + e.what() + ")";
      out.push_back(p);
    }
  }
  return out;
}

ProcInfo info(const Store& store, const std::string& name) {
  detail::check_name("process snapshot", name);
  for (auto& si : store.list(kImageSession))
    if (si.name == name) return impl::read_info(store, si, false);
  throw Error(Errc::not_found, "no process snapshot '" + name + "' in store " + store.path() + "; `" + detail::dvr_for(store.path()) + " proc ls` lists them");
}

void remove(Store& store, const std::string& name) {
  ProcInfo p = info(store, name);  // not_found with the right message
  heaps::HeapImage img = impl::heap_image_in(store, p);
  store.remove(kImageSession, name);
  heaps::remove_heaps(img);
}

std::string heap_owner(const Store& store, const std::string& session, const std::string& name) {
  const std::string prefix = kHeapPrefix;
  if (session == kImageSession || name.rfind(prefix, 0) != 0) return "";
  const std::string owner = name.substr(prefix.size());
  for (auto& si : store.list(kImageSession)) {
    if (si.name != owner) continue;
    try {
      for (auto& h : impl::read_info(store, si, false).heaps)
        if (h.session == session && (h.store.empty() || h.store == store.path())) return owner;
    } catch (const Error&) {
      return owner;  // damaged metadata: it may well use it
    }
  }
  return "";
}

void remove_snapshot(Store& store, const std::string& session, const std::string& name) {
  if (session == kImageSession) {
    bool damaged = false;
    try {
      remove(store, name);
      return;
    } catch (const Error& e) {
      if (e.code() != Errc::corrupt) throw;
      damaged = true;
    }
    if (damaged) store.remove(session, name);  // its heaps cannot be named: the snapshot alone
    return;
  }
  check_removable(store, session, name);
  store.remove(session, name);
}

void check_removable(const Store& store, const std::string& session, const std::string& name) {
  if (std::string owner = heap_owner(store, session, name); !owner.empty())
    throw Error(Errc::invalid_argument, "snapshot '" + session + "/" + name + "' is the heap of process snapshot proc/" + owner +
                                            ", which cannot be restored without it; remove both with `" + detail::dvr_for(store.path()) +
                                            " proc rm " + owner + "`");
}

}  // namespace dvr::proc
