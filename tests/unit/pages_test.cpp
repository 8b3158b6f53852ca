// Page-granular incremental snapshots (manifest v3): what a snapshot stores
// when a few pages change (overlays on the base's stored chunk), when a chunk
// is stored whole again, all-zero and unchanged pages, the page hash files
// being only a cache, clones of snapshots with overlays, regions that are not
// page-aligned, and restores across branches. Every restore is checked
// against plain copies kept by the test, in both tracking modes where the
// mode matters (write-protect parts are skipped with a warning where the
// kernel does not offer it).
#include <sys/mman.h>

#include <catch2/catch.hpp>
#include <map>
#include <optional>
#include <set>

#include "format/chunks.hpp"
#include "format/manifest.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::TempDir;

namespace {

using Bytes = std::vector<unsigned char>;
constexpr std::size_t kPage = 4096;

Bytes copy_of(const void* p, std::size_t n) {
  auto* b = static_cast<const unsigned char*>(p);
  return Bytes(b, b + n);
}
Bytes copy_of(const Region& r) { return copy_of(r.data(), r.size()); }
unsigned char* bytes_of(const Region& r) { return static_cast<unsigned char*>(r.data()); }

std::string diff_region(const Region& r, const Bytes& expect) {
  if (r.size() != expect.size()) return "sizes differ";
  return dvrtest::diff(r.data(), expect.data(), expect.size());
}

bool all_zero(const unsigned char* p, std::size_t n) {
  return std::all_of(p, p + n, [](unsigned char c) { return c == 0; });
}

// Region-relative 4 KiB pages in which `before` and `after` differ.
std::uint64_t changed_pages(const Bytes& before, const Bytes& after) {
  REQUIRE(before.size() == after.size());
  std::uint64_t n = 0;
  for (std::size_t off = 0; off < before.size(); off += kPage) {
    std::size_t len = std::min(kPage, before.size() - off);
    n += std::memcmp(before.data() + off, after.data() + off, len) != 0;
  }
  return n;
}

// ... of those, the ones that are not all zero now: what a snapshot must store
// (when the chunks they are in get overlays rather than being stored whole).
std::uint64_t stored_pages(const Bytes& before, const Bytes& after) {
  std::uint64_t n = 0;
  for (std::size_t off = 0; off < before.size(); off += kPage) {
    std::size_t len = std::min(kPage, before.size() - off);
    n += std::memcmp(before.data() + off, after.data() + off, len) != 0 && !all_zero(after.data() + off, len);
  }
  return n;
}

// Chunks (of `chunk_size`) in which the two differ.
std::uint64_t changed_chunks(const Bytes& before, const Bytes& after, std::size_t chunk_size) {
  std::uint64_t n = 0;
  for (std::size_t off = 0; off < before.size(); off += chunk_size) {
    std::size_t len = std::min(chunk_size, before.size() - off);
    n += std::memcmp(before.data() + off, after.data() + off, len) != 0;
  }
  return n;
}

detail::Manifest manifest_of(const Store& store, const std::string& session, const std::string& snap) {
  return detail::decode_manifest(dvrtest::read_file(dvrtest::manifest_path(store, session, snap)), session + "/" + snap);
}

std::vector<detail::Overlay> overlays_of(const detail::Manifest& m, std::size_t chunk) {
  return {m.overlays.begin() + m.first_overlay[chunk], m.overlays.begin() + m.first_overlay[chunk + 1]};
}

const char* mode_name(Tracking t) { return t == Tracking::hash ? "hash" : "write_protect"; }

// True when write-protect tracking is really in use for `region`; warns when
// it was asked for but is unavailable (the write-protect checks are skipped).
bool write_protected(Session& s, const std::string& region, Tracking asked) {
  if (asked == Tracking::hash) {
    CHECK(s.tracking(region) == Tracking::hash);
    return false;
  }
  if (s.tracking(region) != Tracking::write_protect) {
    WARN("write-protect tracking unavailable here, checking hash mode only: " << s.tracking_note());
    return false;
  }
  return true;
}

std::vector<std::string> files_with_extension(const std::string& dir, const std::string& ext) {
  std::vector<std::string> out;
  for (auto& e : dvrtest::fs::directory_iterator(dir))
    if (e.path().extension() == ext) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Overwrites `len` bytes at `offset` of an existing file in place (its size is kept).
void scribble(const std::string& path, std::uint64_t offset, std::size_t len, std::uint64_t seed) {
  int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  auto junk = dvrtest::random_bytes(len, seed);
  bool ok = ::pwrite(fd, junk.data(), len, static_cast<off_t>(offset)) == static_cast<ssize_t>(len);
  ::close(fd);
  REQUIRE(ok);
}

}  // namespace

// A few scattered bytes in different chunks (one write straddling two pages)
// make the next snapshot store exactly one page per changed page and hash only
// the chunks holding them, in both tracking modes; every snapshot of the
// history restores bit-exact, in the same session, in reverse, and in a fresh one.
TEST_CASE("pages: scattered writes store one page per changed page, every snapshot restores exactly", "[pages]") {
  for (Tracking mode : {Tracking::write_protect, Tracking::hash}) {
    INFO("tracking " << mode_name(mode));
    TempDir dir;
    Store store = Store::open(dir.store());
    const std::size_t cs = store.chunk_size();
    REQUIRE(cs == 256 * 1024);
    Session s(store, "scatter", {.tracking = mode});
    auto& owned = s.alloc("owned", 16 * cs);  // 16 chunks, page-aligned
    // Caller memory, 4 chunks, the last one 40 pages and a partial page.
    Bytes heap = dvrtest::random_bytes(3 * cs + 40 * kPage + 345, 1);
    s.track("heap", heap.data(), heap.size());
    dvrtest::fill_random(owned.data(), owned.size(), 2);
    const bool wp = write_protected(s, "owned", mode);
    auto* p = bytes_of(owned);

    auto first = s.snapshot("s0");
    CHECK(first.stored_bytes == owned.size() + (heap.size() + kPage - 1) / kPage * kPage);
    std::map<std::string, std::pair<Bytes, Bytes>> expect{{"s0", {copy_of(owned), heap}}};
    std::vector<std::string> names{"s0"};

    // Each round changes a handful of bytes in a few chunks of each region.
    const std::vector<std::vector<std::size_t>> owned_writes = {
        {5, 2 * cs + 3, 7 * cs + 40 * kPage + 1, 15 * cs + cs - 1},
        {cs + kPage - 1, 5 * cs, 5 * cs + 63 * kPage, 9 * cs + 17 * kPage + 99},
        {5, 11 * cs + 2 * kPage, 12 * cs + 2 * kPage, 13 * cs + 2 * kPage},
        {3 * cs + 1000},
    };
    const std::vector<std::vector<std::size_t>> heap_writes = {
        {0, heap.size() - 1},
        {cs + 77},
        {},
        {2 * cs + 5 * kPage, 2 * cs + 9 * kPage, heap.size() - 20000},
    };
    for (std::size_t round = 0; round < owned_writes.size(); ++round) {
      INFO("round " << round);
      Bytes owned_before = copy_of(owned), heap_before = heap;
      for (std::size_t at : owned_writes[round])
        p[at] ^= static_cast<unsigned char>(0x11 + round);
      for (std::size_t at : heap_writes[round])
        heap[at] ^= static_cast<unsigned char>(0x21 + round);
      if (round == 1) std::memset(p + 4 * cs - 2, 0xAB, 4);  // straddles pages (and chunks 3 and 4)
      Bytes owned_now = copy_of(owned);
      std::uint64_t pages = changed_pages(owned_before, owned_now) + changed_pages(heap_before, heap);
      std::uint64_t chunks = changed_chunks(owned_before, owned_now, cs) + changed_chunks(heap_before, heap, cs);
      std::string name = "s" + std::to_string(round + 1);
      auto info = s.snapshot(name);
      CHECK(info.stored_bytes == pages * kPage);
      CHECK(store.info("scatter", name).stored_bytes == pages * kPage);
      if (wp) {
        CHECK(info.tracking == "write_protect");
        // The heap buffer is not page-aligned: its partial end pages always count as written.
        CHECK(info.chunks_read >= chunks);
        CHECK(info.chunks_read <= chunks + 2);
      } else {
        CHECK(info.chunks_read == chunks);
      }
      // The changed pages are stored apart (with those of earlier rounds).
      auto m = manifest_of(store, "scatter", name);
      CHECK(m.overlays.size() >= pages);
      expect[name] = {owned_now, heap};
      names.push_back(name);
    }

    auto check_all = [&](Session& t, const Region& o, const Bytes& h, const std::vector<std::string>& order) {
      for (auto& name : order) {
        INFO("restore " << name);
        t.restore(name);
        CHECK(diff_region(o, expect[name].first) == "");
        CHECK(dvrtest::diff(h, expect[name].second) == "");
      }
    };
    check_all(s, owned, heap, names);
    check_all(s, owned, heap, {names.rbegin(), names.rend()});
    check_all(s, owned, heap, {"s2", "s4", "s1", "s3", "s0", "s4"});
    {
      Session fresh(store, "scatter", {.tracking = Tracking::hash});
      auto& o2 = fresh.alloc("owned", owned.size());
      Bytes h2(heap.size());
      fresh.track("heap", h2.data(), h2.size());
      check_all(fresh, o2, h2, {names.rbegin(), names.rend()});
    }
    CHECK(store.verify().ok());
  }
}

// Overlays accumulate on a chunk one page per snapshot until one more would
// exceed a quarter of its pages; then the chunk is stored whole (and its
// overlays dropped), after which they accumulate again. Several pages written
// at once follow the same rule. Every snapshot restores exactly.
TEST_CASE("pages: overlays accumulate up to a quarter of a chunk, then it is stored whole", "[pages]") {
  for (Tracking mode : {Tracking::write_protect, Tracking::hash}) {
    INFO("tracking " << mode_name(mode));
    TempDir dir;
    Store store = Store::open(dir.store());
    const std::size_t cs = store.chunk_size();
    const std::uint32_t ppc = static_cast<std::uint32_t>(cs / kPage);  // 64
    Session s(store, "acc", {.tracking = mode});
    auto& r = s.alloc("data", 6 * cs);
    auto* p = bytes_of(r);
    dvrtest::fill_random(p, r.size(), 3);
    write_protected(s, "data", mode);
    s.snapshot("p0");
    std::map<std::string, Bytes> expect{{"p0", copy_of(r)}};
    std::vector<std::string> names{"p0"};

    const std::size_t chunk = 1;
    std::set<std::uint32_t> model;  // pages of `chunk` stored apart, as the quarter rule predicts
    bool converted = false;
    detail::ChunkRef prev_ref = manifest_of(store, "acc", "p0").chunks[chunk];
    for (std::uint32_t k = 1; k <= 22; ++k) {
      const std::uint32_t page = (k * 7) % ppc;  // a different page each time
      INFO("snapshot " << k << ", page " << page);
      dvrtest::fill_random(p + chunk * cs + page * kPage + 100, 300, 100 + k);
      const bool whole = (model.size() + 1) * 4 > ppc;
      if (whole)
        model.clear();
      else
        model.insert(page);
      std::string name = "p" + std::to_string(k);
      auto info = s.snapshot(name);
      CHECK(info.chunks_read == 1);
      CHECK(info.stored_bytes == (whole ? cs : kPage));
      auto m = manifest_of(store, "acc", name);
      auto ov = overlays_of(m, chunk);
      CHECK(ov.size() <= ppc / 4);
      std::set<std::uint32_t> got;
      for (auto& o : ov) {
        got.insert(o.page);
        CHECK(o.chunk == chunk);
        CHECK(o.pack != 0);
      }
      CHECK(got == model);
      CHECK(m.overlays.size() == ov.size());  // no other chunk has any
      // A patched chunk keeps the base's stored bytes; a chunk stored whole moves.
      if (whole) {
        converted = true;
        CHECK_FALSE((m.chunks[chunk].pack == prev_ref.pack && m.chunks[chunk].offset == prev_ref.offset));
        auto v = detail::view_of(m, chunk);
        for (std::uint32_t q = 0; q < ppc; ++q) {
          auto at = v.location(q);
          CHECK(at.pack == m.chunks[chunk].pack);
          CHECK(at.offset == m.chunks[chunk].offset + q * kPage);
        }
      } else {
        CHECK(m.chunks[chunk].pack == prev_ref.pack);
        CHECK(m.chunks[chunk].offset == prev_ref.offset);
        auto v = detail::view_of(m, chunk);
        auto at = v.location(page);
        CHECK_FALSE((at.pack == prev_ref.pack && at.offset == prev_ref.offset + page * kPage));
      }
      prev_ref = m.chunks[chunk];
      expect[name] = copy_of(r);
      names.push_back(name);
    }
    CHECK(converted);

    // Several pages of one snapshot: 16 pages of chunk 3 stay overlays, 17 of
    // chunk 4 make it whole (stored_bytes: 16 pages + one whole chunk).
    for (std::uint32_t q = 0; q < ppc / 4; ++q)
      p[3 * cs + q * 4 * kPage + 9] ^= 0x5A;
    for (std::uint32_t q = 0; q <= ppc / 4; ++q)
      p[4 * cs + q * 3 * kPage + 9] ^= 0x5A;
    auto many = s.snapshot("many");
    CHECK(many.stored_bytes == (ppc / 4) * kPage + cs);
    CHECK(many.chunks_read == 2);
    auto mm = manifest_of(store, "acc", "many");
    CHECK(overlays_of(mm, 3).size() == ppc / 4);
    CHECK(overlays_of(mm, 4).empty());
    CHECK(overlays_of(mm, chunk).size() == model.size());  // inherited untouched
    expect["many"] = copy_of(r);
    names.push_back("many");

    for (auto it = names.rbegin(); it != names.rend(); ++it) {
      INFO("restore " << *it);
      s.restore(*it);
      CHECK(diff_region(r, expect[*it]) == "");
    }
    Session fresh(store, "acc", {.tracking = Tracking::hash});
    auto& r2 = fresh.alloc("data", r.size());
    for (auto& name : names) {
      INFO("fresh restore " << name);
      fresh.restore(name);
      CHECK(diff_region(r2, expect[name]) == "");
    }
    CHECK(store.verify().ok());
  }
}

// A page zeroed by memset or dropped with MADV_DONTNEED (read afterwards or
// not) costs no stored bytes: an overlay with pack 0. Written again, it is
// stored. A page written with the bytes it already had (plain, overlaid or
// zero) stores nothing. A never-written (zero) chunk takes overlays too.
// Every snapshot restores exactly.
TEST_CASE("pages: zeroed and dropped pages store nothing, identical rewrites store nothing", "[pages]") {
  for (Tracking mode : {Tracking::write_protect, Tracking::hash}) {
    INFO("tracking " << mode_name(mode));
    TempDir dir;
    Store store = Store::open(dir.store());
    const std::size_t cs = store.chunk_size();
    const std::size_t ppc = cs / kPage;
    Session s(store, "zero", {.tracking = mode});
    auto& r = s.alloc("data", 5 * cs);
    auto* p = bytes_of(r);
    dvrtest::fill_random(p, 4 * cs, 4);  // chunk 4 stays zero
    const bool wp = write_protected(s, "data", mode);
    std::map<std::string, Bytes> expect;
    std::vector<std::string> names;
    auto snap = [&](const std::string& name) {
      auto info = s.snapshot(name);
      expect[name] = copy_of(r);
      names.push_back(name);
      return std::make_pair(info, manifest_of(store, "zero", name));
    };
    auto overlay_at = [](const detail::Manifest& m, std::size_t chunk, std::uint32_t page) -> std::optional<detail::Overlay> {
      for (auto& o : overlays_of(m, chunk))
        if (o.page == page) return o;
      return std::nullopt;
    };

    auto [a, ma] = snap("a");
    CHECK(a.zero_chunks == 1);
    CHECK(a.stored_bytes == 4 * cs);

    std::memset(p + 5 * kPage, 0, kPage);  // chunk 0, page 5
    auto [zeroed, mz] = snap("zeroed");
    CHECK(zeroed.stored_bytes == 0);
    CHECK(zeroed.chunks_read == 1);
    auto o = overlay_at(mz, 0, 5);
    REQUIRE(o);
    CHECK(o->pack == 0);
    CHECK(o->offset == 0);
    CHECK(detail::view_of(mz, 0).location(5).pack == 0);

    // Chunk 1, page 6: dropped, then read (a read is not a write).
    const std::size_t dropped = cs + 6 * kPage;
    REQUIRE(::madvise(p + dropped, kPage, MADV_DONTNEED) == 0);
    CHECK(all_zero(p + dropped, kPage));
    auto [drop, md] = snap("dropped");
    CHECK(drop.stored_bytes == 0);
    o = overlay_at(md, 1, 6);
    REQUIRE(o);
    CHECK(o->pack == 0);
    REQUIRE(overlay_at(md, 0, 5));  // the earlier zero page is inherited
    CHECK(overlay_at(md, 0, 5)->pack == 0);

    // Chunk 2, page 9: dropped and never touched again.
    REQUIRE(::madvise(p + 2 * cs + 9 * kPage, kPage, MADV_DONTNEED) == 0);
    auto [untouched, mu] = snap("untouched");
    CHECK(untouched.stored_bytes == 0);
    REQUIRE(overlay_at(mu, 2, 9));
    CHECK(overlay_at(mu, 2, 9)->pack == 0);

    auto [idle, mi] = snap("idle");  // nothing at all
    CHECK(idle.stored_bytes == 0);
    CHECK(idle.chunks_read == 0);
    CHECK(mi.overlays.size() == mu.overlays.size());

    dvrtest::fill_random(p + dropped, kPage, 5);  // written again
    auto [again, mg] = snap("written-again");
    CHECK(again.stored_bytes == kPage);
    REQUIRE(overlay_at(mg, 1, 6));
    CHECK(overlay_at(mg, 1, 6)->pack != 0);

    // Dropped then one byte written: not zero, stored.
    REQUIRE(::madvise(p + 2 * cs + 9 * kPage, kPage, MADV_DONTNEED) == 0);
    p[2 * cs + 9 * kPage + 77] = 1;
    auto [one, m1] = snap("one-byte");
    CHECK(one.stored_bytes == kPage);
    REQUIRE(overlay_at(m1, 2, 9));
    CHECK(overlay_at(m1, 2, 9)->pack != 0);

    // The same bytes written back: a plain page (chunk 3), an overlaid page
    // (chunk 1 page 6), a zero overlay (chunk 0 page 5). Nothing is stored; with
    // write-protect tracking the three chunks are read to find that out.
    Bytes same(p + 3 * cs + 2 * kPage, p + 3 * cs + 3 * kPage);
    std::memcpy(p + 3 * cs + 2 * kPage, same.data(), kPage);
    Bytes overlaid(p + dropped, p + dropped + kPage);
    std::memcpy(p + dropped, overlaid.data(), kPage);
    std::memset(p + 5 * kPage, 0, kPage);
    auto [rewrite, mr] = snap("rewrite");
    CHECK(rewrite.stored_bytes == 0);
    if (wp) CHECK(rewrite.chunks_read == 3);
    if (mode == Tracking::hash) CHECK(rewrite.chunks_read == 0);
    CHECK(mr.overlays.size() == m1.overlays.size());
    for (std::size_t c = 0; c < mr.chunks.size(); ++c)
      CHECK(mr.chunks[c].hash == m1.chunks[c].hash);

    // The all-zero chunk 4: a page written becomes an overlay on the zero
    // chunk; dropped again, it is a zero overlay.
    dvrtest::fill_random(p + 4 * cs + 3 * kPage, kPage, 6);
    auto [onzero, mo] = snap("on-zero-chunk");
    CHECK(onzero.stored_bytes == kPage);
    CHECK(mo.chunks[4].pack == 0);
    REQUIRE(overlay_at(mo, 4, 3));
    CHECK(overlay_at(mo, 4, 3)->pack != 0);
    REQUIRE(::madvise(p + 4 * cs, cs, MADV_DONTNEED) == 0);
    auto [backzero, mb] = snap("zero-again");
    CHECK(backzero.stored_bytes == 0);
    for (std::uint32_t q = 0; q < ppc; ++q)
      CHECK(detail::view_of(mb, 4).location(q).pack == 0);

    for (auto it = names.rbegin(); it != names.rend(); ++it) {
      INFO("restore " << *it);
      s.restore(*it);
      CHECK(diff_region(r, expect[*it]) == "");
    }
    Session fresh(store, "zero", {.tracking = Tracking::hash});
    auto& r2 = fresh.alloc("data", r.size());
    dvrtest::fill_random(r2.data(), r2.size(), 7);  // nothing of this may survive a restore
    for (auto& name : names) {
      INFO("fresh restore " << name);
      fresh.restore(name);
      CHECK(diff_region(r2, expect[name]) == "");
    }
    CHECK(store.verify().ok());
  }
}

// The page hash files are only a cache: with their contents overwritten by
// garbage, cut short, or deleted, a new Store object and Session still restore
// every snapshot exactly, verify() reports no problem, diff() gives the right
// counts, and new snapshots can be taken. A damaged overlay page is then
// caught, whether its page hash comes from a hash file or is recomputed:
// restoring its snapshot throws corrupt naming it and changes no live byte;
// diff and clone refuse it; verify() names exactly the snapshots that use the
// page.
TEST_CASE("pages: page hash files are only a cache, and a damaged overlay page is caught", "[pages]") {
  TempDir dir;
  const std::string sess = "cache";
  std::map<std::string, std::pair<Bytes, Bytes>> expect;  // region "a", region "b"
  std::vector<std::string> names;
  std::size_t cs = 0, size_a = 0;
  Bytes b(200000 + 3);  // caller memory: region "b" is b.data() + 3
  const std::size_t size_b = 200000;
  {
    Store store = Store::open(dir.store());
    cs = store.chunk_size();
    size_a = 4 * cs + 5000;
    Session s(store, sess);
    auto& a = s.alloc("a", size_a);
    auto* p = bytes_of(a);
    unsigned char* q = b.data() + 3;
    s.track("b", q, size_b);
    dvrtest::fill_random(p, size_a, 10);
    dvrtest::fill_random(q, size_b, 11);
    auto keep = [&](const std::string& name) {
      s.snapshot(name);
      expect[name] = {copy_of(a), copy_of(q, size_b)};
      names.push_back(name);
    };
    keep("s0");
    p[3 * kPage + 1] ^= 1;
    p[cs + 20 * kPage] ^= 2;
    q[5000] ^= 3;
    keep("s1");
    std::memset(p + 2 * cs + 7 * kPage, 0, kPage);  // a zero overlay
    dvrtest::fill_random(p + 2 * cs + 8 * kPage, 2 * kPage, 12);
    dvrtest::fill_random(p + size_a - 10, 10, 13);  // last, partial page
    keep("s2");
    p[3 * kPage + 2] ^= 4;  // an overlaid page again
    q[size_b - 1] ^= 5;
    keep("s3");
    REQUIRE(manifest_of(store, sess, "s3").overlays.size() >= 5);
    REQUIRE(store.verify().ok());
  }
  const std::string packs = dir.store() + "/packs";
  REQUIRE_FALSE(files_with_extension(packs, ".hash").empty());

  // A new Store and Session (what another process would do): restore each
  // snapshot, compare, check verify and diff, and optionally take one more.
  auto check_store = [&](const std::string& phase, bool snapshot_more) {
    INFO("phase: " << phase);
    Store store = Store::open(dir.store());
    Session s(store, sess);
    auto& a = s.alloc("a", size_a);
    Bytes b2(size_b);
    s.track("b", b2.data(), b2.size());
    for (auto& name : names) {
      INFO("restore " << name);
      bool restored = false;
      CHECK_NOTHROW((s.restore(name), restored = true));
      if (!restored) continue;
      CHECK(diff_region(a, expect[name].first) == "");
      CHECK(dvrtest::diff(b2, expect[name].second) == "");
    }
    auto report = store.verify();
    CHECK(report.ok());
    for (auto& pr : report.problems)
      WARN(pr.session << "/" << pr.snapshot << ": " << pr.what);
    std::vector<RegionDiff> d;
    CHECK_NOTHROW(d = store.diff(sess, "s1", sess, "s2"));
    if (d.size() == 2) {
      CHECK(d[0].name == "a");
      CHECK(d[0].pages_differ == changed_pages(expect["s1"].first, expect["s2"].first));
      CHECK(d[1].name == "b");
      CHECK(d[1].pages_differ == 0);
    }
    d.clear();
    CHECK_NOTHROW(d = store.diff(sess, "s0", sess, "s3"));
    if (d.size() == 2) {
      CHECK(d[0].pages_differ == changed_pages(expect["s0"].first, expect["s3"].first));
      CHECK(d[1].pages_differ == changed_pages(expect["s0"].second, expect["s3"].second));
      CHECK(d[1].bytes_differ == 2);
    }
    if (snapshot_more) {
      // Live memory is the last snapshot restored: a new incremental snapshot on top.
      auto* p = bytes_of(a);
      p[cs + 3 * kPage] ^= 0x77;
      b2[100] ^= 0x77;
      std::string name = "after-" + phase;
      auto info = s.snapshot(name);
      CHECK(info.stored_bytes == 2 * kPage);
      expect[name] = {copy_of(a), b2};
      names.push_back(name);
      std::memset(a.data(), 0, size_a);
      s.restore(name);
      CHECK(diff_region(a, expect[name].first) == "");
    }
  };

  check_store("intact", false);
  // Garbage over the used part of every hash file, its size kept.
  for (auto& f : files_with_extension(packs, ".hash"))
    scribble(f, 0, 1u << 20, 20);
  check_store("garbage", true);
  // One hash file cut short (just garbage).
  dvrtest::write_file(files_with_extension(packs, ".hash").front(), std::string(1000, 'x'));
  check_store("short", true);
  // None at all.
  for (auto& f : files_with_extension(packs, ".hash"))
    dvrtest::fs::remove(f);
  check_store("deleted", true);
  check_store("recreated", false);  // the last snapshot wrote some hash files anew

  // Damage a page stored apart by the snapshot taken after the hash files were
  // deleted (so its page hash is in a hash file written anew): one it added
  // on top of its parent, which differs from s0.
  const std::string victim_snap = "after-deleted";
  const std::string victim_ref = sess + "/" + victim_snap;
  Store store = Store::open(dir.store());
  auto mv = manifest_of(store, sess, victim_snap);
  auto mp = manifest_of(store, sess, mv.parent);
  std::optional<detail::Overlay> victim;
  for (auto& o : mv.overlays) {
    bool inherited =
        std::any_of(mp.overlays.begin(), mp.overlays.end(), [&](const detail::Overlay& x) { return x.pack == o.pack && x.offset == o.offset; });
    if (o.pack != 0 && !inherited && !victim) victim = o;
  }
  REQUIRE(victim);
  auto at = detail::view_of(mv, victim->chunk).location(victim->page);
  REQUIRE(at.pack == victim->pack);
  REQUIRE(at.offset == victim->offset);
  char hash_name[32];
  std::snprintf(hash_name, sizeof hash_name, "/%08u.hash", at.pack);
  REQUIRE(dvrtest::fs::exists(packs + hash_name));
  dvrtest::flip_byte(dvrtest::pack_path(store, at.pack), at.offset + 123);
  // Every snapshot that reads that stored page is damaged; no other.
  std::vector<std::string> expect_damaged;
  for (auto& name : names) {
    auto m = manifest_of(store, sess, name);
    bool uses = false;
    for (std::size_t c = 0; c < m.chunks.size(); ++c) {
      auto v = detail::view_of(m, c);
      for (std::uint32_t pg = 0; pg < v.page_count(); ++pg) {
        auto l = v.location(pg);
        uses = uses || (l.pack == at.pack && l.offset == at.offset);
      }
    }
    if (uses) expect_damaged.push_back(sess + "/" + name);
  }
  std::sort(expect_damaged.begin(), expect_damaged.end());
  REQUIRE(std::find(expect_damaged.begin(), expect_damaged.end(), victim_ref) != expect_damaged.end());
  REQUIRE(std::find(expect_damaged.begin(), expect_damaged.end(), sess + "/s0") == expect_damaged.end());

  auto check_damage = [&](const std::string& phase) {
    INFO("phase: " << phase);
    Store st = Store::open(dir.store());
    Session s(st, sess);
    auto& a = s.alloc("a", size_a);
    Bytes b2(size_b);
    s.track("b", b2.data(), b2.size());
    s.restore("s0");  // does not use the damaged page
    CHECK(diff_region(a, expect["s0"].first) == "");
    Bytes before_a = copy_of(a), before_b = b2;
    auto err = dvrtest::catch_error([&] { s.restore(victim_snap); });
    CHECK(err.code == Errc::corrupt);
    CHECK_THAT(err.what, Catch::Contains("'" + victim_ref + "'"));
    CHECK(diff_region(a, before_a) == "");
    CHECK(dvrtest::diff(b2, before_b) == "");
    auto report = st.verify();
    CHECK_FALSE(report.ok());
    CHECK(report.damaged_snapshots() == expect_damaged);
    CHECK(dvrtest::catch_error([&] { st.diff(sess, "s0", sess, victim_snap); }).code == Errc::corrupt);
    CHECK(dvrtest::catch_error([&] { st.open_snapshot(sess, victim_snap); }).code == Errc::corrupt);
    // The session still works: after a write, an intact snapshot restores exactly.
    bytes_of(a)[1] ^= 1;
    b2[1] ^= 1;
    s.restore("s0");
    CHECK(diff_region(a, expect["s0"].first) == "");
    CHECK(dvrtest::diff(b2, expect["s0"].second) == "");
  };
  check_damage("hash files present");
  for (auto& f : files_with_extension(packs, ".hash"))
    dvrtest::fs::remove(f);
  check_damage("hash files deleted");
}

// Clones of snapshots with overlays (stored, zero, dropped, and in a partial
// last page) show exactly the snapshot; writes to a clone change neither the
// snapshot (restored afterwards) nor another clone of it, nor a clone of its
// base; a clone keeps its data after the snapshot is removed and gc runs.
TEST_CASE("pages: clones of snapshots with overlays are exact and private", "[pages]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t cs = store.chunk_size();
  Session s(store, "cl");
  auto& r = s.alloc("data", 3 * cs);
  auto* p = bytes_of(r);
  Bytes odd_buf(2 * cs + 8 * kPage + 700 + 1);
  unsigned char* q = odd_buf.data() + 1;
  const std::size_t odd_size = 2 * cs + 8 * kPage + 700;  // last chunk: 8 pages and a partial one
  s.track("odd", q, odd_size);
  dvrtest::fill_random(p, r.size(), 30);
  dvrtest::fill_random(q, odd_size, 31);
  s.snapshot("base");
  Bytes base_r = copy_of(r), base_q = copy_of(q, odd_size);
  dvrtest::fill_random(p + 10 * kPage + 5, 50, 32);                        // stored overlay
  std::memset(p + cs + 3 * kPage, 0, kPage);                               // zero overlay
  REQUIRE(::madvise(p + 2 * cs + 60 * kPage, kPage, MADV_DONTNEED) == 0);  // dropped
  q[odd_size - 1] ^= 0x40;                                                 // partial last page of "odd"
  q[cs + 2 * kPage] ^= 0x40;
  auto info = s.snapshot("ov");
  CHECK(info.stored_bytes == 3 * kPage);
  auto m = manifest_of(store, "cl", "ov");
  CHECK(m.overlays.size() == 5);  // the zero and dropped pages are overlays too
  Bytes ov_r = copy_of(r), ov_q = copy_of(q, odd_size);

  {
    Clone x = s.clone("ov");
    Clone y = store.open_snapshot("cl", "ov");
    Clone z = s.clone("base");
    for (Clone* c : {&x, &y}) {
      CHECK(diff_region(c->region("data"), ov_r) == "");
      CHECK(diff_region(c->region("odd"), ov_q) == "");
    }
    CHECK(diff_region(z.region("data"), base_r) == "");
    CHECK(diff_region(z.region("odd"), base_q) == "");

    // Write to x: an overlay page, a zero-overlay page, a dropped page, a page
    // of the base chunk and the partial last page.
    auto* xp = bytes_of(x.region("data"));
    auto* xq = bytes_of(x.region("odd"));
    std::memset(xp + 10 * kPage, 0xEE, kPage);
    std::memset(xp + cs + 3 * kPage, 0xEE, 100);
    std::memset(xp + 2 * cs + 60 * kPage, 0xEE, kPage);
    std::memset(xp, 0xEE, 2 * kPage);
    xq[odd_size - 1] = 0xEE;
    std::memset(xq + cs, 0xEE, 3 * kPage);
    CHECK(diff_region(y.region("data"), ov_r) == "");
    CHECK(diff_region(y.region("odd"), ov_q) == "");
    CHECK(diff_region(z.region("data"), base_r) == "");
    CHECK(diff_region(z.region("odd"), base_q) == "");

    // Live memory moves on; restoring "ov" gives the snapshot, untouched by the clone writes.
    dvrtest::fill_random(p, r.size(), 33);
    dvrtest::fill_random(q, odd_size, 34);
    s.restore("ov");
    CHECK(diff_region(r, ov_r) == "");
    CHECK(dvrtest::diff(q, ov_q.data(), odd_size) == "");
    s.restore("base");
    CHECK(diff_region(r, base_r) == "");

    // More snapshots (new pack data), "ov" removed, gc: y still shows it.
    p[7] ^= 1;
    s.snapshot("later");
    store.remove("cl", "ov");
    store.gc();
    std::memset(p, 0x33, r.size());
    s.snapshot("later2");
    CHECK(diff_region(y.region("data"), ov_r) == "");
    CHECK(diff_region(y.region("odd"), ov_q) == "");
    CHECK(diff_region(z.region("data"), base_r) == "");
  }
  CHECK(store.verify().ok());
  CHECK(dvrtest::tree(dir.store() + "/pins").empty());
}

// Caller memory at an odd address and an SDK region whose size is not a
// multiple of 4096: changes in the first and last partial pages (and across
// page boundaries) are stored page by page, in both tracking modes; restores
// are exact, into the same and into differently aligned memory, and never
// touch the bytes just outside the region.
TEST_CASE("pages: unaligned caller memory and partial last pages", "[pages]") {
  for (Tracking mode : {Tracking::write_protect, Tracking::hash}) {
    INFO("tracking " << mode_name(mode));
    TempDir dir;
    Store store = Store::open(dir.store());
    const std::size_t cs = store.chunk_size();
    // Last chunk: 20 whole pages and 100 bytes, so a few written pages stay overlays.
    const std::size_t odd_size = 2 * cs + 20 * kPage + 100;
    Bytes buf(odd_size + 2 + kPage);
    dvrtest::fill_random(buf.data(), buf.size(), 40);
    unsigned char* q = buf.data() + 1;
    const unsigned char before_byte = buf[0];
    Session s(store, "odd", {.tracking = mode});
    s.track("odd", q, odd_size);
    auto& tail = s.alloc("tail", 30 * kPage + 123);  // one chunk of 31 pages, the last partial
    auto* t = bytes_of(tail);
    dvrtest::fill_random(t, tail.size(), 41);
    write_protected(s, "tail", mode);

    std::map<std::string, std::pair<Bytes, Bytes>> expect;
    std::vector<std::string> names;
    auto snap = [&](const std::string& name, const Bytes& q_before, const Bytes& t_before) {
      Bytes q_now = copy_of(q, odd_size), t_now = copy_of(tail);
      auto info = s.snapshot(name);
      if (!q_before.empty()) {
        CHECK(info.stored_bytes == (stored_pages(q_before, q_now) + stored_pages(t_before, t_now)) * kPage);
      }
      expect[name] = {q_now, t_now};
      names.push_back(name);
      return info;
    };
    snap("s0", {}, {});

    auto q0 = copy_of(q, odd_size), t0 = copy_of(tail);
    q[0] ^= 1;                // first (partial) page
    q[odd_size - 1] ^= 1;     // last (partial) page
    t[tail.size() - 1] ^= 1;  // last partial page of the SDK region
    buf[0] ^= 0x80;           // outside the region, same memory page as q[0]
    q[odd_size + 5] ^= 0x80;  // outside the region, after its end
    snap("s1", q0, t0);

    q0 = copy_of(q, odd_size), t0 = copy_of(tail);
    std::memset(q + kPage - 2, 0x99, 4);  // across region pages 0 and 1
    q[cs + 5000] ^= 2;
    q[2 * cs] ^= 2;  // first byte of the last chunk
    t[0] ^= 2;
    snap("s2", q0, t0);

    q0 = copy_of(q, odd_size), t0 = copy_of(tail);
    std::memset(q + odd_size - 100, 0, 100);  // the partial last page becomes zero
    std::memset(t + 30 * kPage, 0, 123);      // ... of both regions
    q[2 * cs - 1] ^= 4;                       // last byte of a whole chunk
    snap("s3", q0, t0);

    q0 = copy_of(q, odd_size), t0 = copy_of(tail);
    auto idle = snap("s4", q0, t0);  // nothing changed
    CHECK(idle.stored_bytes == 0);

    const unsigned char outside_before = buf[0];
    const Bytes outside_after(q + odd_size, buf.data() + buf.size());
    CHECK(outside_before == static_cast<unsigned char>(before_byte ^ 0x80));
    auto check_restores = [&](Session& sess, unsigned char* mem, const Region& tr, const std::vector<std::string>& order) {
      for (auto& name : order) {
        INFO("restore " << name);
        sess.restore(name);
        CHECK(dvrtest::diff(mem, expect[name].first.data(), odd_size) == "");
        CHECK(diff_region(tr, expect[name].second) == "");
      }
    };
    check_restores(s, q, tail, {"s0", "s3", "s1", "s4", "s2", "s0"});
    // Bytes next to the region were never written by a restore.
    CHECK(buf[0] == outside_before);
    CHECK(dvrtest::diff(Bytes(q + odd_size, buf.data() + buf.size()), outside_after) == "");

    // Into memory aligned differently (7 bytes past a fresh buffer's start).
    Session fresh(store, "odd", {.tracking = mode});
    Bytes other(odd_size + 7 + 64, 0xC3);
    fresh.track("odd", other.data() + 7, odd_size);
    auto& tail2 = fresh.alloc("tail", tail.size());
    check_restores(fresh, other.data() + 7, tail2, {names.rbegin(), names.rend()});
    CHECK(std::all_of(other.begin(), other.begin() + 7, [](unsigned char c) { return c == 0xC3; }));
    CHECK(std::all_of(other.begin() + 7 + static_cast<std::ptrdiff_t>(odd_size), other.end(), [](unsigned char c) { return c == 0xC3; }));
    CHECK(store.verify().ok());
  }
}

// Time travel: a, change pages, b, restore a, change other pages, c (a branch
// whose base is a, storing only its own pages); then b, c and a restore
// exactly in turn, also with writes made between restores, and in a fresh
// session; diff(b, c) counts the pages in which they differ.
TEST_CASE("pages: restoring across a branch is exact", "[pages]") {
  for (Tracking mode : {Tracking::write_protect, Tracking::hash}) {
    INFO("tracking " << mode_name(mode));
    TempDir dir;
    Store store = Store::open(dir.store());
    const std::size_t cs = store.chunk_size();
    Session s(store, "tt", {.tracking = mode});
    auto& r = s.alloc("data", 4 * cs);
    auto* p = bytes_of(r);
    Bytes v = dvrtest::random_bytes(cs + 3000, 50);
    s.track("vec", v.data(), v.size());
    dvrtest::fill_random(p, r.size(), 51);
    write_protected(s, "data", mode);
    std::map<std::string, std::pair<Bytes, Bytes>> expect;
    auto keep = [&](const std::string& name) {
      auto info = s.snapshot(name);
      expect[name] = {copy_of(r), v};
      return info;
    };
    auto check = [&](const std::string& name) {
      INFO("at " << name);
      CHECK(diff_region(r, expect[name].first) == "");
      CHECK(dvrtest::diff(v, expect[name].second) == "");
    };
    keep("a");
    // Branch 1: pages in chunks 0 and 2, and in the vector.
    p[3 * kPage + 7] ^= 1;
    dvrtest::fill_random(p + 2 * cs + 10 * kPage, 2 * kPage, 52);
    v[100] ^= 1;
    auto b = keep("b");
    CHECK(b.stored_bytes == 4 * kPage);
    s.restore("a");
    check("a");
    // Branch 2: other pages of chunk 2, chunks 1 and 3, a zero page, the vector's end.
    dvrtest::fill_random(p + 2 * cs + 40 * kPage, kPage, 53);
    p[cs + 1] ^= 2;
    std::memset(p + 3 * cs + 63 * kPage, 0, kPage);
    v[v.size() - 1] ^= 2;
    auto c = keep("c");
    CHECK(c.parent == "a");
    CHECK(b.parent == "a");
    CHECK(c.stored_bytes == 3 * kPage);  // the zero page costs nothing
    check("c");

    s.restore("b");
    check("b");
    s.restore("c");
    check("c");
    s.restore("a");
    check("a");
    // Writes between restores are undone too.
    p[5 * kPage] ^= 9;
    p[2 * cs + 40 * kPage + 1] ^= 9;
    s.restore("b");
    check("b");
    p[2 * cs + 10 * kPage] ^= 9;
    v[0] ^= 9;
    s.restore("c");
    check("c");
    s.restore("b");
    check("b");
    // A snapshot on top of b after coming back to it: only its own page.
    p[cs + 30 * kPage] ^= 3;
    auto d = keep("d");
    CHECK(d.parent == "b");
    CHECK(d.stored_bytes == kPage);
    for (const char* name : {"a", "d", "c", "b", "a", "c"}) {
      s.restore(name);
      check(name);
    }

    auto dd = store.diff("tt", "b", "tt", "c");
    REQUIRE(dd.size() == 2);
    CHECK(dd[0].pages_differ == changed_pages(expect["b"].first, expect["c"].first));
    CHECK(dd[1].pages_differ == changed_pages(expect["b"].second, expect["c"].second));

    Session fresh(store, "tt", {.tracking = Tracking::hash});
    auto& r2 = fresh.alloc("data", r.size());
    Bytes v2(v.size());
    fresh.track("vec", v2.data(), v2.size());
    for (const char* name : {"c", "b", "d", "a"}) {
      INFO("fresh restore " << name);
      fresh.restore(name);
      CHECK(diff_region(r2, expect[name].first) == "");
      CHECK(dvrtest::diff(v2, expect[name].second) == "");
    }
    CHECK(store.verify().ok());
  }
}

// Pages stored apart depend on their base's stored chunk: removing the base
// snapshots (and every intermediate one) and collecting garbage, then filling
// the freed space with other data, must leave every remaining snapshot exact.
// Replacing the head snapshot again and again (as autosave does) too.
TEST_CASE("pages: overlaid snapshots survive removal of their bases, gc, space reuse and replace", "[pages]") {
  for (Tracking mode : {Tracking::write_protect, Tracking::hash}) {
    INFO("tracking " << mode_name(mode));
    TempDir dir;
    Store store = Store::open(dir.store());
    const std::size_t cs = store.chunk_size();
    Session s(store, "keep", {.tracking = mode});
    auto& r = s.alloc("data", 4 * cs);
    auto* p = bytes_of(r);
    dvrtest::fill_random(p, r.size(), 60);
    write_protected(s, "data", mode);
    std::map<std::string, Bytes> expect;
    s.snapshot("base");
    for (int k = 1; k <= 6; ++k) {
      dvrtest::fill_random(p + (k % 4) * cs + k * 5 * kPage, 64, 60 + k);
      auto info = s.snapshot("k" + std::to_string(k));
      CHECK(info.stored_bytes == kPage);
      expect["k" + std::to_string(k)] = copy_of(r);
    }
    REQUIRE(manifest_of(store, "keep", "k6").overlays.size() == 6);
    for (const char* gone : {"base", "k1", "k2", "k3", "k4"})
      store.remove("keep", gone);
    store.gc();
    CHECK(store.verify().ok());
    // Other data takes whatever space was freed.
    {
      Session other(store, "other");
      auto& o = other.alloc("o", 6 * cs);
      for (int k = 0; k < 3; ++k) {
        dvrtest::fill_random(o.data(), o.size(), 70 + k);
        other.snapshot("o" + std::to_string(k));
      }
    }
    Session fresh(store, "keep", {.tracking = Tracking::hash});
    auto& r2 = fresh.alloc("data", r.size());
    for (const char* name : {"k5", "k6", "k5"}) {
      INFO("restore " << name);
      s.restore(name);
      CHECK(diff_region(r, expect[name]) == "");
      fresh.restore(name);
      CHECK(diff_region(r2, expect[name]) == "");
    }

    // The head replaced in place, each version an overlay on the previous one.
    for (int k = 0; k < 5; ++k) {
      p[2 * cs + k * kPage + 11] ^= 0x3C;
      auto info = s.snapshot("head", {.replace = true});
      CHECK(info.stored_bytes == kPage);
      expect["head"] = copy_of(r);
      CHECK(info.parent == "k5");  // a replaced head keeps its parent
    }
    store.gc();
    std::memset(p, 0, r.size());
    s.restore("head");
    CHECK(diff_region(r, expect["head"]) == "");
    fresh.restore("head");
    CHECK(diff_region(r2, expect["head"]) == "");
    CHECK(store.verify().ok());
  }
}
