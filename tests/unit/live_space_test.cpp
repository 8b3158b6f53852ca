// LiveSpace (store/live_space.hpp): the extents in use and the size index of
// the gaps between them, checked against a page bitmap after every change of
// a random sequence; then the allocator built on it, in a store holding many
// snapshots: removed snapshots' space is reused, and every snapshot left
// restores bit-exact.
#include <catch2/catch.hpp>
#include <algorithm>
#include <optional>
#include <string>
#include <cstdint>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "store/live_space.hpp"
#include "test_support.hpp"

using dvr::detail::LiveSpace;

namespace {

constexpr std::uint64_t kPage = 4096, kBase = kPage;

// The gaps a bitmap of used pages implies: between extents of one pack (and
// from kBase to a pack's first extent), not after the last.
std::vector<std::tuple<std::uint32_t, std::uint64_t, std::uint64_t>> model_gaps(
    const std::map<std::pair<std::uint32_t, std::uint64_t>, std::uint64_t>& ext) {
  std::vector<std::tuple<std::uint32_t, std::uint64_t, std::uint64_t>> out;
  std::uint32_t pack = 0;
  std::uint64_t end = 0;
  for (auto& [k, len] : ext) {
    if (k.first != pack) {
      pack = k.first;
      end = kBase;
    }
    if (k.second > end) out.emplace_back(pack, end, k.second);
    end = std::max(end, k.second + len);
  }
  return out;
}

}  // namespace

TEST_CASE("live space: gaps, overlaps and pack ends match a model through random sets and erases", "[store][space]") {
  std::mt19937_64 rng(7);
  LiveSpace live(kBase);
  std::map<std::pair<std::uint32_t, std::uint64_t>, std::uint64_t> model;
  for (int step = 0; step < 4000; ++step) {
    const std::uint32_t pack = 1 + static_cast<std::uint32_t>(rng() % 3);
    if (model.empty() || rng() % 3 != 0) {
      // A new extent in free space (extents never overlap), or an existing one grown in place up to its neighbour.
      std::uint64_t off = kBase + (rng() % 512) * kPage, len = (1 + rng() % 8) * kPage;
      auto next = model.lower_bound({pack, off});
      bool same = next != model.end() && next->first == std::make_pair(pack, off);
      if (same) ++next;
      if (next != model.end() && next->first.first == pack) len = std::min(len, next->first.second - off);
      auto prev = model.lower_bound({pack, off});
      if (prev != model.begin() && std::prev(prev)->first.first == pack && std::prev(prev)->first.second + std::prev(prev)->second > off)
        continue;  // inside another extent
      if (same) len = std::max(len, model[{pack, off}]);
      model[{pack, off}] = len;
      live.set(pack, off, len);
    } else {
      auto it = std::next(model.begin(), static_cast<long>(rng() % model.size()));
      live.erase(it->first.first, it->first.second);
      model.erase(it);
    }
    if (step % 50 != 0 && step != 3999) continue;
    REQUIRE(live.size() == model.size());
    // Every gap, by size then address, through for_gaps_from(1).
    auto want = model_gaps(model);
    std::sort(want.begin(), want.end(), [](auto& a, auto& b) {
      return std::make_tuple(std::get<2>(a) - std::get<1>(a), std::get<0>(a), std::get<2>(a)) <
             std::make_tuple(std::get<2>(b) - std::get<1>(b), std::get<0>(b), std::get<2>(b));
    });
    std::vector<std::tuple<std::uint32_t, std::uint64_t, std::uint64_t>> got;
    live.for_gaps_from(1, [&](const LiveSpace::Gap& g) {
      got.emplace_back(g.pack, g.begin, g.end);
      return false;
    });
    REQUIRE(got == want);
    // for_gaps_from(n) starts at the smallest gap of at least n bytes, and stops when told.
    const std::uint64_t n = 3 * kPage;
    std::optional<LiveSpace::Gap> firstfit;
    live.for_gaps_from(n, [&](const LiveSpace::Gap& g) {
      firstfit = g;
      return true;
    });
    auto smallest = std::find_if(want.begin(), want.end(), [&](auto& g) { return std::get<2>(g) - std::get<1>(g) >= n; });
    REQUIRE(firstfit.has_value() == (smallest != want.end()));
    if (firstfit) CHECK(std::make_tuple(firstfit->pack, firstfit->begin, firstfit->end) == *smallest);
    for (std::uint32_t p = 1; p <= 4; ++p) {
      std::uint64_t end = kBase;
      for (auto& [k, len] : model)
        if (k.first == p) end = std::max(end, k.second + len);
      CHECK(live.end_of(p, kBase) == end);
      for (int probe = 0; probe < 20; ++probe) {
        std::uint64_t off = (rng() % 520) * kPage, len = (1 + rng() % 4) * kPage;
        bool used = false;
        for (auto& [k, l] : model)
          used = used || (k.first == p && k.second < off + len && off < k.second + l);
        CHECK(live.overlaps(p, off, len) == used);
      }
    }
  }
  live.clear();
  CHECK(live.size() == 0);
  CHECK(live.end_of(1, kBase) == kBase);
}

TEST_CASE("live space: new snapshots fill the space of removed ones, and every snapshot kept restores bit-exact", "[store][space][reuse]") {
  dvrtest::TempDir dir;
  dvr::Store store = dvr::Store::open(dir.store());
  dvr::Session s(store, "many");
  const std::size_t n = 4 << 20;
  std::vector<unsigned char> data = dvrtest::random_bytes(n, 1);
  s.track("d", data.data(), n);
  s.snapshot("base");
  std::map<std::string, std::vector<unsigned char>> want;
  std::mt19937_64 rng(11);
  int taken = 0;
  // Each snapshot writes 1% of the pages, scattered.
  auto take = [&] {
    for (std::size_t p = static_cast<std::size_t>(rng() % 100); p < n / kPage; p += 100) {
      // Two statements: the order of two rng() calls in one expression is
      // unspecified, and builds that differed wrote other data.
      const std::size_t at = p * kPage + rng() % kPage;
      data[at] ^= static_cast<unsigned char>(1 + rng() % 255);
    }
    std::string name = "s" + std::to_string(taken++);
    s.snapshot(name);
    want[name] = data;
  };
  // 90 snapshots, every third removing a random earlier one: holes of all
  // sizes among data in use. Every tenth, another session stores 1 MiB that
  // nothing else shares.
  dvr::Session big(store, "big");
  std::vector<unsigned char> other(1 << 20);
  big.track("o", other.data(), other.size());
  for (int i = 0; i < 90; ++i) {
    take();
    if (i % 3 == 2) {
      auto victim = std::next(want.begin(), static_cast<long>(rng() % want.size()));
      store.remove("many", victim->first);
      want.erase(victim);
    }
    if (i % 10 == 5) {
      dvrtest::fill_random(other.data(), other.size(), 100 + static_cast<std::uint64_t>(i));
      big.snapshot("b" + std::to_string(i));
    }
  }
  // Those go: new snapshots fill the space they held instead of growing the packs.
  for (auto& info : big.list())
    store.remove("big", info.name);
  const std::uint64_t before = dvrtest::pack_allocated(store);
  for (int i = 0; i < 20; ++i)
    take();
  CHECK(dvrtest::pack_allocated(store) <= before);
  for (auto& [name, bytes] : want) {
    INFO(name);
    s.restore(name);
    REQUIRE(data == bytes);
  }
  CHECK(store.verify().ok());
}
