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
// Identical names give identical content, in any session or store.

#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
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
        test can find where a unit's chunk is stored). Touches no store.
  fill STORE SESSION [--start K] [--max N]
        take fresh (non-dedupable) snapshots fill-0001, ... until a dvr::Error;
        print "committed NAME" for each, then the error code and message.

Options:
  --mib M          region scale (default 1): r0 = M MiB + 4097, r1 = 300001,
                   r2 = 5*M MiB - 3 bytes
  --chunk-size B   chunk size when this creates the store (default 64 KiB, the
                   content's unit)

Exit status:
  0  everything succeeded
  1  failure: a restored byte differed (stderr: "FAIL snapshot 'S/N' restored
     wrong: region, byte, got, expected"), `check` found nothing to check, or
     `fill` ended by an error other than no_space or not at all within --max
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
  for (unsigned char c : name) h = (h ^ c) * 0x100000001B3ull;
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
    for (std::size_t off = 0, u = 0; off < size; off += kUnit, ++u) fill(region, u, dst + off, std::min(kUnit, size - off));
  }

 private:
  std::uint64_t h_;
  bool all_fresh_;
  std::uint64_t permille_;
  std::size_t units0_;
};

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
    } else if (a.rfind("--", 0) == 0) {
      throw UsageError("unknown option " + a);
    } else {
      pos.push_back(a);
    }
  }
  if (!pos.empty() && pos[0] == "describe") {
    if (pos.size() != 2) throw UsageError("describe needs exactly one NAME");
    o.mode = pos[0];
    o.names = {pos[1]};
    return o;
  }
  if (pos.size() < 3) throw UsageError("need MODE STORE SESSION");
  o.mode = pos[0];
  o.store_path = pos[1];
  o.session = pos[2];
  o.names.assign(pos.begin() + 3, pos.end());
  if (o.mode == "loop" && o.count < 0) throw UsageError("loop needs --count N");
  if ((o.mode == "loop" || o.mode == "fill") && !o.names.empty()) throw UsageError(o.mode + " takes no snapshot names");
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
    Content c(name, sizes_);
    for (std::size_t r = 0; r < sizes_.size(); ++r) c.fill_region(r, ptrs_[r], sizes_[r]);
  }

  void poison() {
    for (std::size_t r = 0; r < sizes_.size(); ++r) std::memset(ptrs_[r], 0xA5, sizes_[r]);
  }

  // Throws CheckFailure naming the first byte that differs from `name`'s content.
  void compare(const std::string& name) const {
    Content c(name, sizes_);
    std::vector<char> want(kUnit);
    for (std::size_t r = 0; r < sizes_.size(); ++r) {
      for (std::size_t off = 0, u = 0; off < sizes_[r]; off += kUnit, ++u) {
        std::size_t len = std::min(kUnit, sizes_[r] - off);
        c.fill(r, u, want.data(), len);
        const char* got = ptrs_[r] + off;
        if (std::memcmp(got, want.data(), len) == 0) continue;
        std::size_t k = 0;
        while (got[k] == want[k]) ++k;
        char msg[256];
        std::snprintf(msg, sizeof msg, "region r%zu byte %zu (of %zu; unit %zu, %s) is 0x%02x, expected 0x%02x", r, off + k, sizes_[r],
                      u, kind_name(c.kind(r, u)), static_cast<unsigned char>(got[k]), static_cast<unsigned char>(want[k]));
        throw CheckFailure(msg);
      }
    }
  }

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
  for (auto& name : o.names) take(w, name, false, o.content_of);
  return 0;
}

int run_check(const Options& o) {
  dvr::StoreOptions so;
  so.create = false;
  dvr::Store store = dvr::Store::open(o.store_path, so);
  std::vector<std::string> names = o.names;
  if (names.empty()) {
    for (auto& info : store.list(o.session)) {
      if (info.damaged)
        throw dvr::Error(dvr::Errc::corrupt, "snapshot '" + o.session + "/" + info.name + "' is listed as damaged: " + info.damage);
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
