// dvr-test-worker — a separate process for the system tests (tests/system) to
// start, kill and check: it takes snapshots through <dvr/dvr.hpp> and checks
// restores bit-exact.
//
// The content of every snapshot is a deterministic function of (region index,
// snapshot name), so any process can check any snapshot without shared state:
//
//   * three regions of awkward sizes: r0 = MIB MiB + 4097 bytes (alloc()ed),
//     r1 = 300001 bytes (track()ed, at an odd address), r2 = 5*MIB MiB - 3
//     bytes (alloc()ed), MIB from --mib (default 1);
//   * each region is cut into 64 KiB units (the last one shorter). A unit is
//     "fresh" (random bytes seeded by the snapshot name: new data in the store),
//     "base" (random bytes seeded by region and unit only: dedups against every
//     other snapshot) or all zero (part of the base, never stored);
//   * the fraction of fresh units, 2–52 %, varies with the name, and one unit of
//     r0 is always fresh, so every snapshot writes new data and some chunks dedup;
//   * names starting with "fill-" are fresh throughout (nothing dedups).
//
// The names "autosave-N" and "named-N" (N >= 1, no leading zeros) are states
// of an evolving workload instead (the `autosave` mode): position 0 is the
// content of the name "evolve-base"; each position p >= 1 changes a few bytes
// to pages of position p-1 (scattered single pages, small writes inside a
// page or across a page boundary, now and then a run of pages or a burst of
// pages all over; with random bytes, zeros, or position 0's bytes again).
// "named-N" is position 2N-1 and "autosave-N" position 2N: the autosave
// worker writes half of step N, may take named-N, writes the other half and
// lets the session's autosave take autosave-N.
//
// Identical names give identical content, in any session or store.

#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dvr/dvr.hpp"

namespace {

const char* kUsage = R"(usage: dvr-test-worker MODE ARGS [OPTIONS]

Modes:
  loop STORE SESSION --count N [--prefix P] [--start K] [--churn]
        take snapshots P0001, P0002, ... (P defaults to "keep-"; numbering starts
        at K, default 1) and print each name on stdout, flushed, only after
        snapshot() returned. With --churn also take "tmp-"+NAME after each one,
        remove the previous tmp- snapshot, run gc() every third step, and at
        start remove every "tmp-"+P* snapshot left in the session; the lines
        "> snapshot NAME", "> remove NAME" and "> gc" are printed just before
        those steps, so the last line shows what a kill interrupted.
  snap STORE SESSION NAME... [--content-of OTHER]
        take the named snapshots in order; print each name once committed.
        --content-of gives them OTHER's content instead (a wrong snapshot, to
        show that `check` catches one).
  check STORE SESSION [NAME...]
        restore each named snapshot (default: every snapshot of the session)
        into a fresh session with the same regions and compare byte for byte
        with the content its name implies; print "ok SESSION/NAME" for each.
  describe NAME
        print the content NAME implies, one line per 64 KiB unit:
        "REGION UNIT KIND OFFSET LENGTH HEX" with KIND zero/base/fresh, OFFSET
        and LENGTH in bytes within the region, HEX its first 32 bytes (so a
        test can find where a unit's chunk is stored). Touches no store. Not
        for the evolving names autosave-N and named-N.
  fill STORE SESSION [--start K] [--max N]
        take fresh (non-dedupable) snapshots fill-0001, ... until a dvr::Error;
        print "committed NAME" for each, then the error code and message.
  autosave STORE SESSION --count N [--every-ms M] [--keep K] [--named-every E]
           [--gc-every G]
        an application with autosave(M ms, K) on (defaults 1 ms, 3; both at
        least 1): first restore the session's latest() snapshot, if any, and
        compare it with the content its name implies ("> restore NAME", then
        "recovered NAME"); then N steps, numbered on from the session's
        autosaves as the library numbers them. Step S writes half of its
        changes (position 2S-1), takes "named-S" when S is a multiple of E
        (default 4; 0: never), writes the rest (position 2S) and calls
        checkpoint_point() until it takes "autosave-S" (anything else is a
        failure). Printed, flushed: "> snapshot named-S" / "> checkpoint
        autosave-S" just before, and "committed NAME" just after each
        snapshot; "removed NAME" for each autosave that retention removed
        (seen by listing the session after each checkpoint); "rebuilt
        autosave-S" when live memory had to be written from scratch (no
        latest() of this workload). With G > 0, a gc() every G steps ("> gc",
        then "gc done"). The content of autosave-S and named-S is a function
        of the name as for any other name (`check` verifies it).
  clone STORE SESSION NAME [--hold-ms T]
        open a clone of NAME (Store::open_snapshot, which checks it), compare
        it with NAME's content ("cloned NAME"), write to some pages of every
        region and compare again ("wrote NAME"); then hold it T ms, or without
        --hold-ms until stdin reaches end of file ("holding NAME" first), and
        compare it once more before closing it ("ok clone SESSION/NAME").

Options:
  --mib M          region scale (default 1): r0 = M MiB + 4097, r1 = 300001,
                   r2 = 5*M MiB - 3 bytes
  --chunk-size B   chunk size when this creates the store (default 64 KiB, the
                   content's unit)
  --every-ms M, --keep K, --named-every E, --gc-every G   see `autosave`
  --hold-ms T      see `clone`

Exit status:
  0  everything succeeded
  1  failure: a restored byte differed (stderr: "FAIL snapshot 'S/N' restored
     wrong: region, byte, got, expected"), `check` found nothing to check,
     `fill` ended by an error other than no_space or not at all within --max,
     `autosave` saw the wrong autosave taken or an autosave appear from
     elsewhere, or a clone or a recovered snapshot held the wrong bytes
  2  usage error
  3  a dvr::Error was thrown (stderr: "error ERRC: MESSAGE", e.g. corrupt or
     not_found from `check`); for `fill`, only when the error was no_space
)";

constexpr std::size_t kUnit = 64 * 1024;
constexpr std::size_t kMiB = 1024 * 1024;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A failure of the thing under test that is not a dvr::Error.
struct CheckFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::uint64_t mix(std::uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::uint64_t name_hash(const std::string& name) {
  std::uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a, then mixed
  for (unsigned char c : name)
    h = (h ^ c) * 0x100000001B3ull;
  return mix(h);
}

enum class Kind { zero, base, fresh };
const char* kind_name(Kind k) { return k == Kind::zero ? "zero" : k == Kind::base ? "base" : "fresh"; }

// What the snapshot called `name` holds, unit by unit.
class Content {
 public:
  Content(const std::string& name, const std::vector<std::size_t>& sizes)
      : h_(name_hash(name)), all_fresh_(name.rfind("fill-", 0) == 0), permille_(20 + (h_ >> 32) % 500) {
    units0_ = (sizes[0] + kUnit - 1) / kUnit;
  }

  Kind kind(std::size_t region, std::size_t unit) const {
    if (all_fresh_) return Kind::fresh;
    if (region == 0 && unit == h_ % units0_) return Kind::fresh;
    if (mix(h_ ^ mix(region * 1000003u + unit + 1)) % 1000 < permille_) return Kind::fresh;
    if (mix((static_cast<std::uint64_t>(region) << 32) | unit) % 8 == 0) return Kind::zero;
    return Kind::base;
  }

  // Writes unit `unit` of region `region` (len bytes) to dst.
  void fill(std::size_t region, std::size_t unit, char* dst, std::size_t len) const {
    Kind k = kind(region, unit);
    if (k == Kind::zero) {
      std::memset(dst, 0, len);
      return;
    }
    std::uint64_t where = (static_cast<std::uint64_t>(region) << 40) ^ unit;
    std::uint64_t seed = k == Kind::base ? mix(0xBA5EBA5Eull ^ where) : mix(h_ ^ mix(where ^ 0xF4E5Full));
    std::size_t words = len / 8;
    for (std::size_t i = 0; i < words; ++i) {
      std::uint64_t w = mix(seed + i);
      std::memcpy(dst + i * 8, &w, 8);
    }
    if (len % 8) {
      std::uint64_t w = mix(seed + words);
      std::memcpy(dst + words * 8, &w, len % 8);
    }
  }

  void fill_region(std::size_t region, char* dst, std::size_t size) const {
    for (std::size_t off = 0, u = 0; off < size; off += kUnit, ++u)
      fill(region, u, dst + off, std::min(kUnit, size - off));
  }

 private:
  std::uint64_t h_;
  bool all_fresh_;
  std::uint64_t permille_;
  std::size_t units0_;
};

// --- The evolving workload of the `autosave` mode (see the top of this file).

const char* const kEvolveBase = "evolve-base";

// Digits only, no leading zero, at least 1 (the library's std::to_string).
bool parse_counter(const std::string& digits, std::uint64_t* n) {
  if (digits.empty() || digits.size() > 18 || digits[0] == '0' || digits.find_first_not_of("0123456789") != std::string::npos) return false;
  *n = std::stoull(digits);
  return true;
}

// N of "autosave-N", or 0 for any other name.
std::uint64_t autosave_number(const std::string& name) {
  std::uint64_t n = 0;
  return name.rfind("autosave-", 0) == 0 && parse_counter(name.substr(9), &n) ? n : 0;
}

// The position of an evolving name: autosave-N -> 2N, named-N -> 2N-1.
bool evolving_position(const std::string& name, std::uint64_t* pos) {
  std::uint64_t n = 0;
  if (name.rfind("autosave-", 0) == 0 && parse_counter(name.substr(9), &n)) {
    *pos = 2 * n;
    return true;
  }
  if (name.rfind("named-", 0) == 0 && parse_counter(name.substr(6), &n)) {
    *pos = 2 * n - 1;
    return true;
  }
  return false;
}

std::string autosave_name(std::uint64_t n) { return "autosave-" + std::to_string(n); }
std::string named_name(std::uint64_t n) { return "named-" + std::to_string(n); }

// One write of a step: `len` bytes at `offset` of region `region`.
struct Write {
  enum Kind : std::uint8_t { random, zero, base } kind;
  std::size_t region;
  std::size_t offset, len;
  std::uint64_t seed;
};

const char* write_kind_name(Write::Kind k) { return k == Write::random ? "random bytes" : k == Write::zero ? "zeros" : "position 0's bytes"; }

// The writes that take position pos-1 to pos (pos >= 1).
std::vector<Write> writes_of(std::uint64_t pos, const std::vector<std::size_t>& sizes) {
  constexpr std::size_t kPage = 4096;
  std::uint64_t state = mix(pos * 0x51ED27ull + 0xE70Eull);
  auto next = [&] { return state = mix(state); };
  auto pick_region = [&] {
    std::uint64_t x = next() % 10;
    return x < 3 ? std::size_t{0} : x < 5 ? std::size_t{1} : std::size_t{2};
  };
  auto pick_kind = [&] {
    std::uint64_t x = next() % 20;
    return x < 14 ? Write::random : x < 17 ? Write::zero : Write::base;
  };
  std::vector<Write> out;
  auto add = [&](std::size_t r, std::size_t off, std::size_t len, Write::Kind kind) {
    off = std::min(off, sizes[r] - 1);
    len = std::max<std::size_t>(1, std::min(len, sizes[r] - off));
    out.push_back({kind, r, off, len, mix(pos * 1024 + out.size() + 1)});
  };
  std::uint64_t shape = next() % 10;
  if (shape == 0) {
    // A burst of single pages all over the regions.
    std::uint64_t n = 16 + next() % 33;
    for (std::uint64_t i = 0; i < n; ++i) {
      std::size_t r = pick_region();
      add(r, (next() % ((sizes[r] + kPage - 1) / kPage)) * kPage, kPage, pick_kind());
    }
  } else if (shape == 1) {
    // A run of pages (whole chunks change), not page aligned.
    std::size_t r = pick_region();
    add(r, next() % sizes[r], 16 * 1024 + next() % (320 * 1024), pick_kind());
  } else {
    std::uint64_t n = 1 + next() % 4;
    for (std::uint64_t i = 0; i < n; ++i) {
      std::size_t r = pick_region();
      std::size_t page = next() % ((sizes[r] + kPage - 1) / kPage);
      std::uint64_t how = next() % 4;
      if (how < 2)
        add(r, page * kPage, kPage, pick_kind());  // one whole page
      else if (how == 2)
        add(r, page * kPage + next() % kPage, 1 + next() % 300, pick_kind());  // a few bytes
      else
        add(r, page * kPage + kPage - 1 - next() % 100, 2 + next() % 200, pick_kind());  // across a page boundary
    }
  }
  return out;
}

void apply_write(const Write& w, char* region, const char* base_region) {
  char* dst = region + w.offset;
  if (w.kind == Write::zero) {
    std::memset(dst, 0, w.len);
  } else if (w.kind == Write::base) {
    std::memcpy(dst, base_region + w.offset, w.len);
  } else {
    for (std::size_t i = 0; i < w.len; i += 8) {
      std::uint64_t v = mix(w.seed + i / 8);
      std::memcpy(dst + i, &v, std::min<std::size_t>(8, w.len - i));
    }
  }
}

// The content of evolving positions, computed forward from position 0 (and
// kept, so that ascending positions cost only the steps in between).
class Evolver {
 public:
  explicit Evolver(const std::vector<std::size_t>& sizes) : sizes_(sizes) {
    Content c(kEvolveBase, sizes_);
    for (std::size_t r = 0; r < sizes_.size(); ++r) {
      base_.emplace_back(sizes_[r]);
      c.fill_region(r, base_[r].data(), sizes_[r]);
    }
    now_ = base_;
  }

  const std::vector<std::size_t>& sizes() const { return sizes_; }
  const std::vector<char>& base(std::size_t r) const { return base_[r]; }

  const std::vector<std::vector<char>>& at(std::uint64_t pos) {
    if (pos < pos_) {
      now_ = base_;
      pos_ = 0;
    }
    for (; pos_ < pos; ++pos_)
      for (auto& w : writes_of(pos_ + 1, sizes_))
        apply_write(w, now_[w.region].data(), base_[w.region].data());
    return now_;
  }

  // Which write made byte `offset` of region `r` what it is at `pos`.
  std::string origin(std::uint64_t pos, std::size_t r, std::size_t offset) const {
    for (std::uint64_t p = pos; p >= 1; --p) {
      auto ws = writes_of(p, sizes_);
      for (auto it = ws.rbegin(); it != ws.rend(); ++it)
        if (it->region == r && it->offset <= offset && offset < it->offset + it->len)
          return "written at position " + std::to_string(p) + " (" + write_kind_name(it->kind) + ", bytes [" + std::to_string(it->offset) + ", " +
                 std::to_string(it->offset + it->len) + "))";
    }
    return "unchanged since position 0";
  }

 private:
  std::vector<std::size_t> sizes_;
  std::vector<std::vector<char>> base_, now_;
  std::uint64_t pos_ = 0;
};

// One Evolver per process (for the region sizes of --mib).
Evolver& evolver(const std::vector<std::size_t>& sizes) {
  static std::unique_ptr<Evolver> e;
  if (!e || e->sizes() != sizes) e = std::make_unique<Evolver>(sizes);
  return *e;
}

// Throws CheckFailure naming the first of `len` bytes that differ; `where`
// describes a byte offset (relative to `got`).
template <class Describe>
void compare_bytes(const char* got, const char* want, std::size_t len, const Describe& where) {
  if (std::memcmp(got, want, len) == 0) return;
  std::size_t k = 0;
  while (got[k] == want[k])
    ++k;
  char msg[64];
  std::snprintf(msg, sizeof msg, " is 0x%02x, expected 0x%02x", static_cast<unsigned char>(got[k]), static_cast<unsigned char>(want[k]));
  throw CheckFailure(where(k) + msg);
}

struct Options {
  std::string mode, store_path, session;
  std::vector<std::string> names;
  std::size_t mib = 1;
  std::uint32_t chunk_size = 0;
  long count = -1;
  long start = 1;
  long max = 100000;
  std::string prefix = "keep-";
  std::string content_of;
  bool churn = false;
  long every_ms = 1;
  long keep = 3;
  long named_every = 4;
  long gc_every = 0;
  long hold_ms = -1;  // -1: until stdin reaches end of file
};

std::vector<std::size_t> region_sizes(std::size_t mib) { return {mib * kMiB + 4097, 300001, 5 * mib * kMiB - 3}; }

long parse_number(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < 0) throw UsageError(flag + " needs a non-negative integer, not '" + text + "'");
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  std::vector<std::string> pos;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(a + " needs a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (a == "--mib") {
      o.mib = static_cast<std::size_t>(parse_number(a, value()));
      if (o.mib < 1) throw UsageError("--mib must be at least 1");
    } else if (a == "--chunk-size") {
      o.chunk_size = static_cast<std::uint32_t>(parse_number(a, value()));
    } else if (a == "--count") {
      o.count = parse_number(a, value());
    } else if (a == "--start") {
      o.start = parse_number(a, value());
    } else if (a == "--max") {
      o.max = parse_number(a, value());
    } else if (a == "--prefix") {
      o.prefix = value();
    } else if (a == "--content-of") {
      o.content_of = value();
    } else if (a == "--churn") {
      o.churn = true;
    } else if (a == "--every-ms") {
      o.every_ms = parse_number(a, value());
    } else if (a == "--keep") {
      o.keep = parse_number(a, value());
    } else if (a == "--named-every") {
      o.named_every = parse_number(a, value());
    } else if (a == "--gc-every") {
      o.gc_every = parse_number(a, value());
    } else if (a == "--hold-ms") {
      o.hold_ms = parse_number(a, value());
    } else if (a.rfind("--", 0) == 0) {
      throw UsageError("unknown option " + a);
    } else {
      pos.push_back(a);
    }
  }
  if (!pos.empty() && pos[0] == "describe") {
    if (pos.size() != 2) throw UsageError("describe needs exactly one NAME");
    std::uint64_t evolving = 0;
    if (evolving_position(pos[1], &evolving))
      throw UsageError("describe: '" + pos[1] + "' is an evolving name (autosave-N, named-N), not made of units");
    o.mode = pos[0];
    o.names = {pos[1]};
    return o;
  }
  if (pos.size() < 3) throw UsageError("need MODE STORE SESSION");
  o.mode = pos[0];
  o.store_path = pos[1];
  o.session = pos[2];
  o.names.assign(pos.begin() + 3, pos.end());
  if ((o.mode == "loop" || o.mode == "autosave") && o.count < 0) throw UsageError(o.mode + " needs --count N");
  if ((o.mode == "loop" || o.mode == "fill" || o.mode == "autosave") && !o.names.empty()) throw UsageError(o.mode + " takes no snapshot names");
  if (o.mode == "clone" && o.names.size() != 1) throw UsageError("clone needs exactly one NAME");
  // (autosave(0 ms) turns autosave off: checkpoint_point() would never take one.)
  if (o.mode == "autosave" && (o.every_ms < 1 || o.keep < 1)) throw UsageError("autosave needs --every-ms and --keep of at least 1");
  if (o.mode == "snap" && o.names.empty()) throw UsageError("snap needs at least one NAME");
  return o;
}

dvr::Store open_store(const Options& o) {
  dvr::StoreOptions so;
  // By default the chunks are the content's units, so that tests can reason
  // about which chunks a snapshot shares (see `describe`).
  so.chunk_size = o.chunk_size ? o.chunk_size : static_cast<std::uint32_t>(kUnit);
  return dvr::Store::open(o.store_path, so);
}

std::string numbered(const std::string& prefix, long n) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%04ld", n);
  return prefix + buf;
}

// Throws CheckFailure naming the first byte of the regions at `ptrs` that
// differs from `name`'s content.
void compare_content(const std::vector<char*>& ptrs, const std::vector<std::size_t>& sizes, const std::string& name) {
  std::uint64_t pos = 0;
  if (evolving_position(name, &pos)) {
    Evolver& e = evolver(sizes);
    auto& want = e.at(pos);
    for (std::size_t r = 0; r < sizes.size(); ++r)
      compare_bytes(ptrs[r], want[r].data(), sizes[r], [&](std::size_t k) {
        return "region r" + std::to_string(r) + " byte " + std::to_string(k) + " (of " + std::to_string(sizes[r]) + "; " + e.origin(pos, r, k) + ")";
      });
    return;
  }
  Content c(name, sizes);
  std::vector<char> want(kUnit);
  for (std::size_t r = 0; r < sizes.size(); ++r) {
    for (std::size_t off = 0, u = 0; off < sizes[r]; off += kUnit, ++u) {
      std::size_t len = std::min(kUnit, sizes[r] - off);
      c.fill(r, u, want.data(), len);
      const char* got = ptrs[r] + off;
      if (std::memcmp(got, want.data(), len) == 0) continue;
      std::size_t k = 0;
      while (got[k] == want[k])
        ++k;
      char msg[256];
      std::snprintf(msg, sizeof msg, "region r%zu byte %zu (of %zu; unit %zu, %s) is 0x%02x, expected 0x%02x", r, off + k, sizes[r], u,
                    kind_name(c.kind(r, u)), static_cast<unsigned char>(got[k]), static_cast<unsigned char>(want[k]));
      throw CheckFailure(msg);
    }
  }
}

// A session holding the three test regions.
class Workload {
 public:
  Workload(const dvr::Store& store, const std::string& session, std::size_t mib)
      : session_(store, session), sizes_(region_sizes(mib)), tracked_(sizes_[1] + 1) {
    ptrs_.push_back(static_cast<char*>(session_.alloc("r0", sizes_[0]).data()));
    ptrs_.push_back(tracked_.data() + 1);  // deliberately not aligned
    session_.track("r1", ptrs_[1], sizes_[1]);
    ptrs_.push_back(static_cast<char*>(session_.alloc("r2", sizes_[2]).data()));
  }

  void write(const std::string& name) {
    std::uint64_t pos = 0;
    if (evolving_position(name, &pos)) {
      write_position(pos);
      return;
    }
    Content c(name, sizes_);
    for (std::size_t r = 0; r < sizes_.size(); ++r)
      c.fill_region(r, ptrs_[r], sizes_[r]);
  }

  // Live memory := the evolving content at `pos`.
  void write_position(std::uint64_t pos) {
    auto& now = evolver(sizes_).at(pos);
    for (std::size_t r = 0; r < sizes_.size(); ++r)
      std::memcpy(ptrs_[r], now[r].data(), sizes_[r]);
  }

  // Applies the writes that take position pos-1 to pos to live memory.
  void step_to(std::uint64_t pos) {
    Evolver& e = evolver(sizes_);
    for (auto& w : writes_of(pos, sizes_))
      apply_write(w, ptrs_[w.region], e.base(w.region).data());
  }

  void poison() {
    for (std::size_t r = 0; r < sizes_.size(); ++r)
      std::memset(ptrs_[r], 0xA5, sizes_[r]);
  }

  // Throws CheckFailure naming the first byte that differs from `name`'s content.
  void compare(const std::string& name) const { compare_content(ptrs_, sizes_, name); }

  dvr::Session& session() { return session_; }

 private:
  dvr::Session session_;
  std::vector<std::size_t> sizes_;
  std::vector<char> tracked_;
  std::vector<char*> ptrs_;
};

void say(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

void take(Workload& w, const std::string& name, bool announce = false, const std::string& content_of = "") {
  if (announce) say("> snapshot " + name);
  w.write(content_of.empty() ? name : content_of);
  w.session().snapshot(name, {.label = "dvr-test-worker pid " + std::to_string(::getpid())});
  say(name);
}

int run_loop(const Options& o) {
  dvr::Store store = open_store(o);
  Workload w(store, o.session, o.mib);
  if (o.churn)
    for (auto& info : store.list(o.session))
      if (info.name.rfind("tmp-" + o.prefix, 0) == 0) store.remove(o.session, info.name);
  std::string previous_tmp;
  for (long i = o.start; i < o.start + o.count; ++i) {
    std::string name = numbered(o.prefix, i);
    take(w, name, o.churn);
    if (!o.churn) continue;
    std::string tmp = "tmp-" + name;
    take(w, tmp, true);
    if (!previous_tmp.empty()) {
      say("> remove " + previous_tmp);
      store.remove(o.session, previous_tmp);
    }
    previous_tmp = tmp;
    if (i % 3 == 0) {
      say("> gc");
      store.gc();
    }
  }
  return 0;
}

int run_snap(const Options& o) {
  dvr::Store store = open_store(o);
  Workload w(store, o.session, o.mib);
  for (auto& name : o.names)
    take(w, name, false, o.content_of);
  return 0;
}

int run_check(const Options& o) {
  dvr::StoreOptions so;
  so.create = false;
  dvr::Store store = dvr::Store::open(o.store_path, so);
  std::vector<std::string> names = o.names;
  if (names.empty()) {
    for (auto& info : store.list(o.session)) {
      if (info.damaged) throw dvr::Error(dvr::Errc::corrupt, "snapshot '" + o.session + "/" + info.name + "' is listed as damaged: " + info.damage);
      names.push_back(info.name);
    }
    if (names.empty()) throw CheckFailure("session '" + o.session + "' has no snapshots to check");
  }
  for (auto& name : names) {
    std::string ref = o.session + "/" + name;
    Workload w(store, o.session, o.mib);  // a fresh session for every restore
    w.poison();
    w.session().restore(name);
    try {
      w.compare(name);
    } catch (const CheckFailure& e) {
      throw CheckFailure("snapshot '" + ref + "' restored wrong: " + e.what());
    }
    say("ok " + ref);
  }
  return 0;
}

int run_describe(const Options& o) {
  auto sizes = region_sizes(o.mib);
  Content c(o.names[0], sizes);
  std::vector<char> buf(kUnit);
  for (std::size_t r = 0; r < sizes.size(); ++r)
    for (std::size_t off = 0, u = 0; off < sizes[r]; off += kUnit, ++u) {
      std::size_t len = std::min(kUnit, sizes[r] - off);
      c.fill(r, u, buf.data(), len);
      std::string hex;
      char h[3];
      for (std::size_t k = 0; k < std::min<std::size_t>(32, len); ++k) {
        std::snprintf(h, sizeof h, "%02x", static_cast<unsigned char>(buf[k]));
        hex += h;
      }
      std::printf("r%zu %zu %s %zu %zu %s\n", r, u, kind_name(c.kind(r, u)), off, len, hex.c_str());
    }
  return 0;
}

int run_fill(const Options& o) {
  dvr::Store store = open_store(o);
  Workload w(store, o.session, o.mib);
  long committed = 0;
  for (long i = o.start; i < o.start + o.max; ++i) {
    std::string name = numbered("fill-", i);
    try {
      w.write(name);
      w.session().snapshot(name);
    } catch (const dvr::Error& e) {
      std::string line = std::string("error ") + dvr::errc_name(e.code()) + ": " + e.what();
      say(line);
      std::cerr << line << "\n";
      say("committed before the error: " + std::to_string(committed));
      return e.code() == dvr::Errc::no_space ? 3 : 1;
    }
    say("committed " + name);
    ++committed;
  }
  std::cerr << "fill: no error after " << o.max << " snapshots\n";
  return 1;
}

void sleep_ms(double ms) { std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms)); }

// The autosaves of `session` now, by number.
std::set<std::uint64_t> autosaves_in(const dvr::Store& store, const std::string& session) {
  std::set<std::uint64_t> out;
  for (auto& info : store.list(session))
    if (auto n = autosave_number(info.name)) out.insert(n);
  return out;
}

int run_autosave(const Options& o) {
  dvr::Store store = open_store(o);
  Workload w(store, o.session, o.mib);
  dvr::Session& s = w.session();
  // Number on as the library does: after the highest autosave listed.
  std::set<std::string> names;
  for (auto& info : store.list(o.session))
    names.insert(info.name);
  std::set<std::uint64_t> autosaves = autosaves_in(store, o.session);
  std::uint64_t next = autosaves.empty() ? 1 : *autosaves.rbegin() + 1;

  // Recover as an application would: the newest intact snapshot.
  const std::uint64_t unknown = ~std::uint64_t{0};
  std::uint64_t pos = unknown;  // the evolving position live memory holds
  if (auto latest = s.latest()) {
    say("> restore " + latest->name);
    s.restore(latest->name);
    try {
      w.compare(latest->name);
    } catch (const CheckFailure& e) {
      throw CheckFailure("recovered snapshot '" + o.session + "/" + latest->name + "' restored wrong: " + e.what());
    }
    say("recovered " + latest->name);
    if (!evolving_position(latest->name, &pos)) pos = unknown;
  }
  // Step `next` starts from position 2(next-1), or from its first half when
  // named-next was the last thing committed.
  if (pos != 2 * (next - 1) && pos != 2 * next - 1) {
    w.write_position(2 * (next - 1));
    pos = 2 * (next - 1);
    say("rebuilt " + autosave_name(next - 1));
  }

  s.autosave(std::chrono::milliseconds(o.every_ms), static_cast<std::size_t>(o.keep));
  const std::string label = "dvr-test-worker pid " + std::to_string(::getpid());
  for (long i = 0; i < o.count; ++i) {
    const std::uint64_t n = next;
    if (pos == 2 * n - 2) {
      w.step_to(2 * n - 1);
      pos = 2 * n - 1;
      const std::string named = named_name(n);
      if (o.named_every > 0 && n % static_cast<std::uint64_t>(o.named_every) == 0 && !names.count(named)) {
        say("> snapshot " + named);
        s.snapshot(named, {.label = label});
        names.insert(named);
        say("committed " + named);
      }
    }
    w.step_to(2 * n);
    pos = 2 * n;
    const std::string name = autosave_name(n);
    say("> checkpoint " + name);
    std::optional<dvr::SnapshotInfo> taken;
    while (!(taken = s.checkpoint_point()))
      sleep_ms(0.1);
    if (taken->name != name) throw CheckFailure("checkpoint_point() took '" + taken->name + "', expected '" + name + "'");
    say("committed " + name);
    autosaves.insert(n);
    names.insert(name);
    ++next;
    // What retention removed: it may only remove autosaves.
    std::set<std::uint64_t> now = autosaves_in(store, o.session);
    for (auto a : autosaves)
      if (!now.count(a)) {
        say("removed " + autosave_name(a));
        names.erase(autosave_name(a));
      }
    for (auto a : now)
      if (!autosaves.count(a)) throw CheckFailure("autosave '" + autosave_name(a) + "' appeared from elsewhere");
    autosaves = now;
    if (o.gc_every > 0 && (i + 1) % o.gc_every == 0) {
      say("> gc");
      store.gc();
      say("gc done");
    }
  }
  return 0;
}

// The full content `name` implies, region by region.
std::vector<std::vector<char>> content_of(const std::string& name, const std::vector<std::size_t>& sizes) {
  std::uint64_t pos = 0;
  if (evolving_position(name, &pos)) return evolver(sizes).at(pos);
  std::vector<std::vector<char>> out;
  Content c(name, sizes);
  for (std::size_t r = 0; r < sizes.size(); ++r) {
    out.emplace_back(sizes[r]);
    c.fill_region(r, out.back().data(), sizes[r]);
  }
  return out;
}

int run_clone(const Options& o) {
  dvr::StoreOptions so;
  so.create = false;
  dvr::Store store = dvr::Store::open(o.store_path, so);
  const std::string& name = o.names[0];
  const std::string ref = o.session + "/" + name;
  const auto sizes = region_sizes(o.mib);
  dvr::Clone clone = store.open_snapshot(o.session, name);
  std::vector<char*> ptrs;
  for (std::size_t r = 0; r < sizes.size(); ++r) {
    dvr::Region& region = clone.region("r" + std::to_string(r));
    if (region.size() != sizes[r])
      throw CheckFailure("clone of '" + ref + "': region " + region.name() + " has " + std::to_string(region.size()) + " bytes, expected " +
                         std::to_string(sizes[r]));
    ptrs.push_back(static_cast<char*>(region.data()));
  }
  auto compare = [&](const std::vector<std::vector<char>>& want, const char* when) {
    for (std::size_t r = 0; r < sizes.size(); ++r)
      compare_bytes(ptrs[r], want[r].data(), sizes[r], [&](std::size_t k) {
        return std::string("clone of '") + ref + "' " + when + ": region r" + std::to_string(r) + " byte " + std::to_string(k) + " (page " +
               std::to_string(k / 4096) + ")";
      });
  };
  try {
    compare_content(ptrs, sizes, name);
  } catch (const CheckFailure& e) {
    throw CheckFailure("clone of '" + ref + "' shows wrong content: " + e.what());
  }
  say("cloned " + name);

  // Private writes: 64 bytes in every fifth page, and the last byte of each region.
  std::vector<std::vector<char>> want = content_of(name, sizes);
  for (std::size_t r = 0; r < sizes.size(); ++r) {
    for (std::size_t page = r % 5; page * 4096 < sizes[r]; page += 5) {
      std::size_t off = page * 4096 + 100, len = std::min<std::size_t>(64, sizes[r] > off ? sizes[r] - off : 0);
      for (std::size_t k = 0; k < len; k += 8) {
        std::uint64_t v = mix((r << 32) ^ (off + k) ^ 0xC10Eull);
        std::memcpy(ptrs[r] + off + k, &v, std::min<std::size_t>(8, len - k));
        std::memcpy(want[r].data() + off + k, &v, std::min<std::size_t>(8, len - k));
      }
    }
    ptrs[r][sizes[r] - 1] = static_cast<char>(~ptrs[r][sizes[r] - 1]);
    want[r][sizes[r] - 1] = static_cast<char>(~want[r][sizes[r] - 1]);
  }
  compare(want, "after writing to it");
  say("wrote " + name);

  if (o.hold_ms >= 0) {
    sleep_ms(static_cast<double>(o.hold_ms));
  } else {
    say("holding " + name);
    char buf[256];
    while (std::fread(buf, 1, sizeof buf, stdin) > 0) {
    }
  }
  compare(want, "after holding it");
  say("ok clone " + ref);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "dvr-test-worker: " << e.what() << "\n\n" << kUsage;
    return 2;
  }
  try {
    if (o.mode == "loop") return run_loop(o);
    if (o.mode == "snap") return run_snap(o);
    if (o.mode == "check") return run_check(o);
    if (o.mode == "fill") return run_fill(o);
    if (o.mode == "describe") return run_describe(o);
    if (o.mode == "autosave") return run_autosave(o);
    if (o.mode == "clone") return run_clone(o);
    std::cerr << "dvr-test-worker: unknown mode '" << o.mode << "'\n\n" << kUsage;
    return 2;
  } catch (const dvr::Error& e) {
    std::cerr << "error " << dvr::errc_name(e.code()) << ": " << e.what() << "\n";
    return 3;
  } catch (const CheckFailure& e) {
    std::cerr << "FAIL " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "FAIL unexpected exception: " << e.what() << "\n";
    return 1;
  }
}
