// dvr-mpi-bench — coordinated snapshots across MPI ranks (dvr::mpi) against the
// usual way an MPI code checkpoints: every rank writing its data into one
// shared file with MPI-IO, measured in the same run.
//
//   mpirun -np 4 build/dvr-mpi-bench [--mib 256] [--rounds 5] [--dirty-pct 5]
//       [--store-root DIR] [--keep-files] [--no-partner-copies] [--level N] [--json]
//
// Each rank holds --mib MiB (SDK-owned, filled with non-repeating data, so all
// pre-faulted and nothing deduplicates) in its own store DIR/node-R (default: a
// fresh directory under /dev/shm, removed at the end). One round changes
// --dirty-pct % of every rank's pages (spread evenly), then times:
//   ours: s.snapshot() — local snapshot, the commit vote, the partner copies
//         and retention (keep 2); --no-partner-copies leaves the copies
//         out, --level sets their zstd level (0: none);
//   peer: every rank writes its whole data at rank * size into one new shared
//         file on the same file system, then MPI_File_sync and MPI_File_close
//         (the previous round's file is deleted) — once with
//         MPI_File_write_at_all (collective) and once with MPI_File_write_at
//         (independent). The figure's peer is the faster of the two (OpenMPI's
//         default OMPIO aggregates collective writes through a few ranks and
//         can be the slower one for this contiguous pattern); both are shown.
// Each time is the slowest rank's, after a barrier; the figure is the median
// over the rounds ("min": our best round). Before the rounds, the first (full)
// checkpoint is timed the same way. After them, one more change is undone by
// restore_latest() against reading the last files back (MPI_File_read_at_all,
// MPI_File_read_at: what a restart reads), each checked against the data.
// The peer is fair: the same run, the same file system as the stores (the
// files lie beside them), the same bytes per rank, from the same pre-faulted
// memory, with its sync (MPI_File_sync) and close inside the time.
// With --json, one object per line, each with name, value, unit, peer,
// peer_value and ratio, where above 1 always means ours is better:
//   costs (unit "s", "B"):   ratio = peer_value / value
//   rates (unit "GB/s"):     ratio = value / peer_value
// "bytes" is the data of all ranks; the partner-bytes line gives the bytes sent
// to partners per checkpoint (summed over ranks) against the bytes MPI-IO writes;
// each snapshot figure has a "..._per_rank_bw" line (GB/s per rank: a rank's
// bytes over the slowest rank's time) and, in its own line, the phases of the
// slowest rank (local_s, partner_s — overlapping local_s —, vote_s, commit_s,
// retention_s; dvr::mpi::GlobalInfo).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <fcntl.h>
#include <mpi.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "cli_util.hpp"
#include "dvr/mpi.hpp"

using namespace dvr::cli;

namespace {

constexpr std::size_t kPage = 4096;

struct Args {
  std::size_t mib = 256;
  int rounds = 5;
  double dirty_pct = 5;
  std::string store_root;
  bool keep_files = false;
  bool json = false;
  bool partner_copies = true;
  int level = -1;  // -1: the library's default
};

[[noreturn]] void usage(int rank, const std::string& msg) {
  if (rank == 0)
    std::fprintf(stderr,
                 "dvr-mpi-bench: %s\nusage: mpirun -np N dvr-mpi-bench [--mib 256] [--rounds 5] [--dirty-pct 5] "
                 "[--store-root DIR] [--keep-files] [--no-partner-copies] [--level N] [--json]\n",
                 msg.c_str());
  MPI_Finalize();
  std::exit(2);
}

Args parse(int argc, char** argv, int rank) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string o = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(rank, o + " needs a value");
      return argv[++i];
    };
    try {
      if (o == "--mib")
        a.mib = std::stoul(value());
      else if (o == "--rounds")
        a.rounds = std::stoi(value());
      else if (o == "--dirty-pct")
        a.dirty_pct = std::stod(value());
      else if (o == "--store-root")
        a.store_root = value();
      else if (o == "--keep-files")
        a.keep_files = true;
      else if (o == "--no-partner-copies")
        a.partner_copies = false;
      else if (o == "--level")
        a.level = std::stoi(value());
      else if (o == "--json")
        a.json = true;
      else if (o == "-h" || o == "--help")
        usage(rank, "help");
      else
        usage(rank, "unknown option " + o);
    } catch (const std::logic_error&) {
      usage(rank, "bad value for " + o);
    }
  }
  if (a.mib < 1 || a.rounds < 1 || a.dirty_pct <= 0 || a.dirty_pct > 100) usage(rank, "need --mib >= 1, --rounds >= 1, 0 < --dirty-pct <= 100");
  return a;
}

// Non-repeating, non-zero content so that no chunk deduplicates (also across ranks).
void fill_unique(char* p, std::size_t n, std::uint64_t seed) {
  auto* w = reinterpret_cast<std::uint64_t*>(p);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::size_t i = 0; i < n / 8; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    w[i] = x;
  }
}

// Changes one word in `pct` % of the pages, spread evenly; `round` shifts
// which pages and what is written, so each round changes other pages.
std::size_t dirty(char* p, std::size_t n, double pct, int round) {
  const std::size_t pages = n / kPage;
  const std::size_t stride = std::max<std::size_t>(1, static_cast<std::size_t>(100.0 / pct + 0.5));
  std::size_t changed = 0;
  for (std::size_t page = static_cast<std::size_t>(round) % stride; page < pages; page += stride, ++changed)
    reinterpret_cast<std::uint64_t*>(p + page * kPage)[5] ^= 0x0101010101010101ull * static_cast<unsigned>(round + 1);
  return changed;
}

std::uint64_t digest(const char* p, std::size_t n) {
  auto* w = reinterpret_cast<const std::uint64_t*>(p);
  std::uint64_t h = 0;
  for (std::size_t i = 0; i < n / 8; ++i)
    h = (h ^ w[i]) * 0x100000001b3ull + i;
  return h;
}

double max_over_ranks(double v) {
  double m = 0;
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

std::uint64_t sum_over_ranks(std::uint64_t v) {
  std::uint64_t s = 0;
  MPI_Allreduce(&v, &s, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t k = v.size() / 2;
  return v.size() % 2 ? v[k] : (v[k - 1] + v[k]) / 2;
}

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw std::runtime_error(std::string(what) + ": " + std::string(msg, static_cast<std::size_t>(len)));
}

// The peer: one shared file, each rank's data at rank * n, written with
// MPI_File_write_at_all (collective) or MPI_File_write_at (independent).
// Returns this rank's seconds (the caller takes the max).
double mpiio_write(const std::string& path, const char* data, std::size_t n, int rank, bool collective) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  MPI_File f;
  check_mpi(MPI_File_open(MPI_COMM_WORLD, path.c_str(), MPI_MODE_CREATE | MPI_MODE_WRONLY, MPI_INFO_NULL, &f), "MPI_File_open");
  MPI_File_set_errhandler(f, MPI_ERRORS_RETURN);
  constexpr std::size_t piece = std::size_t{1} << 30;  // counts are ints
  for (std::size_t off = 0; off < n; off += piece) {
    const int count = static_cast<int>(std::min(piece, n - off));
    const auto at = static_cast<MPI_Offset>(static_cast<std::size_t>(rank) * n + off);
    check_mpi(collective ? MPI_File_write_at_all(f, at, data + off, count, MPI_BYTE, MPI_STATUS_IGNORE)
                         : MPI_File_write_at(f, at, data + off, count, MPI_BYTE, MPI_STATUS_IGNORE),
              collective ? "MPI_File_write_at_all" : "MPI_File_write_at");
  }
  check_mpi(MPI_File_sync(f), "MPI_File_sync");
  check_mpi(MPI_File_close(&f), "MPI_File_close");
  return MPI_Wtime() - t0;
}

double mpiio_read(const std::string& path, char* data, std::size_t n, int rank, bool collective) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  MPI_File f;
  check_mpi(MPI_File_open(MPI_COMM_WORLD, path.c_str(), MPI_MODE_RDONLY, MPI_INFO_NULL, &f), "MPI_File_open");
  MPI_File_set_errhandler(f, MPI_ERRORS_RETURN);
  constexpr std::size_t piece = std::size_t{1} << 30;
  for (std::size_t off = 0; off < n; off += piece) {
    const int count = static_cast<int>(std::min(piece, n - off));
    const auto at = static_cast<MPI_Offset>(static_cast<std::size_t>(rank) * n + off);
    check_mpi(collective ? MPI_File_read_at_all(f, at, data + off, count, MPI_BYTE, MPI_STATUS_IGNORE)
                         : MPI_File_read_at(f, at, data + off, count, MPI_BYTE, MPI_STATUS_IGNORE),
              collective ? "MPI_File_read_at_all" : "MPI_File_read_at");
  }
  check_mpi(MPI_File_close(&f), "MPI_File_close");
  return MPI_Wtime() - t0;
}

// The peer's two ways, each the slowest rank's time, several rounds each; the
// figure's peer is the faster way (by median), so the peer is at its best.
struct Peer {
  std::vector<double> collective, independent;
  void add(double c, double i) {
    collective.push_back(c);
    independent.push_back(i);
  }
};

struct Figure {
  std::string name, unit, peer, note;
  double value, peer_value, min = -1;
  std::uint64_t partner_bytes = 0, stored_bytes = 0;
  bool bytes_figure = false;
  double peer_collective = -1, peer_independent = -1;  // the two MPI-IO ways (medians)
  // Where our time went (snapshot figures): each phase's slowest rank.
  struct Phases {
    double local = 0, partner = 0, vote = 0, commit = 0, retention = 0;
  };
  std::optional<Phases> phases;
  bool higher_is_better = false;  // a rate (GB/s): ratio = value / peer_value
  double ratio() const {
    if (higher_is_better) return peer_value > 0 ? value / peer_value : 0;
    return value > 0 ? peer_value / value : 0;
  }
};

Figure::Phases phases_of(const dvr::mpi::GlobalInfo& g) {
  return {max_over_ranks(g.local_seconds), max_over_ranks(g.partner_seconds), max_over_ranks(g.vote_seconds), max_over_ranks(g.commit_seconds),
          max_over_ranks(g.retention_seconds)};
}

// Per-rank bandwidth of a time figure: each rank's bytes over the slowest
// rank's time, ours against the peer's (ratio = ours / peer: above 1, ours is
// better, as for every figure).
Figure bandwidth_of(const Figure& f, std::size_t bytes_per_rank) {
  Figure b;
  b.name = f.name + "_per_rank_bw";
  b.unit = "GB/s";
  b.peer = f.peer;
  b.note = "bytes per rank / time (slowest rank)";
  b.value = static_cast<double>(bytes_per_rank) / f.value / 1e9;
  b.peer_value = static_cast<double>(bytes_per_rank) / f.peer_value / 1e9;
  b.higher_is_better = true;
  return b;
}

// Fills in the peer of `f` from `p`: the faster of the two ways.
Figure with_peer(Figure f, const Peer& p, const char* collective_name, const char* independent_name, double (*pick)(std::vector<double>)) {
  f.peer_collective = pick(p.collective);
  f.peer_independent = pick(p.independent);
  const bool coll = f.peer_collective <= f.peer_independent;
  f.peer = coll ? collective_name : independent_name;
  f.peer_value = coll ? f.peer_collective : f.peer_independent;
  return f;
}

// The directory this run made for itself (empty: given with --store-root, or
// kept with --keep-files): removed by a rank that fails before MPI_Abort
// kills the others, so a failed run leaves no gigabytes in /dev/shm.
std::string g_own_root;

void drop_own_root() {
  if (g_own_root.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(g_own_root, ec);
}

int run(const Args& a, int rank, int size) {
  // The directory: given, or made by rank 0 under /dev/shm and broadcast.
  std::string root = a.store_root;
  const bool own_root = root.empty();
  if (own_root) {
    char buf[4096] = {0};
    if (rank == 0) {
      char tmpl[] = "/dev/shm/dvr-mpi-bench.XXXXXX";
      if (!::mkdtemp(tmpl))
        std::perror("mkdtemp /dev/shm/dvr-mpi-bench.XXXXXX");
      else
        std::snprintf(buf, sizeof buf, "%s", tmpl);
    }
    MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, MPI_COMM_WORLD);
    root = buf;
    if (root.empty()) return 1;  // every rank got the same empty answer
    if (!a.keep_files) g_own_root = root;
  } else if (rank == 0) {
    std::filesystem::create_directories(root);
  }
  MPI_Barrier(MPI_COMM_WORLD);

  const std::size_t n = a.mib << 20;
  const std::uint64_t all_bytes = static_cast<std::uint64_t>(n) * static_cast<std::uint64_t>(size);
  std::vector<Figure> figures;
  std::string medium;
  bool exact = true;
  {
    dvr::mpi::Options opt;
    opt.keep = 2;
    opt.partner_copies = a.partner_copies;
    if (a.level >= 0) opt.level = a.level;
    dvr::mpi::Session s(dvr::Store::open(root + "/node-" + std::to_string(rank)), "bench", MPI_COMM_WORLD, opt);
    medium = dvr::medium_name(s.local().store().medium());
    char* data = static_cast<char*>(s.local().alloc("data", n).data());
    fill_unique(data, n, 1000 + static_cast<std::uint64_t>(rank));  // pre-faults every page
    dvrbench::let_kernel_read(root, data, n);

    // The peer's files: "c-N" written collectively, "i-N" independently (round N).
    auto file = [&](char way, int round) { return root + "/mpiio-" + way + "-" + std::to_string(round) + ".bin"; };
    auto drop_files = [&](int round) {
      MPI_Barrier(MPI_COMM_WORLD);
      if (rank == 0) {
        MPI_File_delete(file('c', round).c_str(), MPI_INFO_NULL);
        MPI_File_delete(file('i', round).c_str(), MPI_INFO_NULL);
      }
      MPI_Barrier(MPI_COMM_WORLD);
    };
    auto peer_write = [&](Peer& p, int round) {
      const double c = max_over_ranks(mpiio_write(file('c', round), data, n, rank, true));
      const double i = max_over_ranks(mpiio_write(file('i', round), data, n, rank, false));
      p.add(c, i);
    };
    const std::string pct = std::to_string(static_cast<int>(a.dirty_pct)) + "pct";

    // The first checkpoint: everything is new.
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    auto g = s.snapshot("round-0");
    const double full_ours = max_over_ranks(MPI_Wtime() - t0);
    const Figure::Phases full_phases = phases_of(g);
    Peer full_peer;
    peer_write(full_peer, 0);
    figures.push_back(with_peer({"mpi_snapshot_full", "s", "", "first checkpoint: all data new", full_ours, 0, -1, sum_over_ranks(g.partner_bytes),
                                 sum_over_ranks(g.stored_bytes)},
                                full_peer, "mpiio_write_at_all+sync", "mpiio_write_at+sync", median));
    figures.back().phases = full_phases;
    figures.push_back(bandwidth_of(figures.back(), n));

    std::vector<double> ours, partner, stored;
    std::vector<Figure::Phases> round_phases;
    Peer peer;
    std::size_t changed = 0;
    for (int round = 1; round <= a.rounds; ++round) {
      changed = dirty(data, n, a.dirty_pct, round);
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = MPI_Wtime();
      g = s.snapshot("round-" + std::to_string(round));
      ours.push_back(max_over_ranks(MPI_Wtime() - t0));
      round_phases.push_back(phases_of(g));
      partner.push_back(static_cast<double>(sum_over_ranks(g.partner_bytes)));
      stored.push_back(static_cast<double>(sum_over_ranks(g.stored_bytes)));
      peer_write(peer, round);
      drop_files(round - 1);
    }
    char note[128];
    std::snprintf(note, sizeof note, "%g%% of pages changed (%zu per rank), median of %d", a.dirty_pct, changed, a.rounds);
    figures.push_back(with_peer({"mpi_snapshot_" + pct, "s", "", note, median(ours), 0, *std::min_element(ours.begin(), ours.end()),
                                 static_cast<std::uint64_t>(median(partner)), static_cast<std::uint64_t>(median(stored))},
                                peer, "mpiio_write_at_all+sync", "mpiio_write_at+sync", median));
    {
      // The phases of the median round.
      std::vector<std::size_t> order(ours.size());
      for (std::size_t k = 0; k < order.size(); ++k)
        order[k] = k;
      std::sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return ours[x] < ours[y]; });
      figures.back().phases = round_phases[order[order.size() / 2]];
    }
    figures.push_back(bandwidth_of(figures.back(), n));
    figures.push_back({"mpi_partner_bytes_" + pct, "B", "mpiio_bytes", "bytes sent to partners per checkpoint, all ranks", median(partner),
                       static_cast<double>(all_bytes)});
    figures.back().bytes_figure = true;

    // A restart's read: undo one more change with restore_latest() vs
    // reading the last MPI-IO files back; each must give the last checkpoint.
    const std::uint64_t want = digest(data, n);
    dirty(data, n, a.dirty_pct, a.rounds + 1);
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = MPI_Wtime();
    auto name = s.restore_latest();
    const double rest_ours = max_over_ranks(MPI_Wtime() - t0);
    exact = exact && name && *name == "round-" + std::to_string(a.rounds) && digest(data, n) == want;
    Peer rest_peer;
    dirty(data, n, a.dirty_pct, a.rounds + 1);
    const double rc = max_over_ranks(mpiio_read(file('c', a.rounds), data, n, rank, true));
    exact = exact && digest(data, n) == want;
    dirty(data, n, a.dirty_pct, a.rounds + 1);
    const double ri = max_over_ranks(mpiio_read(file('i', a.rounds), data, n, rank, false));
    exact = exact && digest(data, n) == want;
    rest_peer.add(rc, ri);
    figures.push_back(with_peer({"mpi_restore_latest_" + pct, "s", "", "after one more change: ours copies back what differs", rest_ours, 0},
                                rest_peer, "mpiio_read_at_all", "mpiio_read_at", median));
    drop_files(a.rounds);
  }
  int ok = exact ? 1 : 0, all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0 && own_root && !a.keep_files) std::filesystem::remove_all(root);

  if (rank == 0) {
    if (a.json) {
      for (const auto& f : figures) {
        std::cout << "{\"name\":" << json_string(f.name) << ",\"value\":" << json_number(f.value) << ",\"unit\":\"" << f.unit
                  << "\",\"peer\":" << json_string(f.peer) << ",\"peer_value\":" << json_number(f.peer_value)
                  << ",\"ratio\":" << (f.ratio() > 0 ? json_number(f.ratio()) : std::string("null")) << ",\"bytes\":" << all_bytes
                  << ",\"ranks\":" << size << ",\"medium\":\"" << medium << "\"";
        if (!f.bytes_figure && f.unit == "s" && f.name.find("snapshot") != std::string::npos)
          std::cout << ",\"partner_bytes\":" << f.partner_bytes << ",\"stored_bytes\":" << f.stored_bytes;
        if (f.min >= 0) std::cout << ",\"min\":" << json_number(f.min);
        if (f.phases)
          std::cout << ",\"local_s\":" << json_number(f.phases->local) << ",\"partner_s\":" << json_number(f.phases->partner)
                    << ",\"vote_s\":" << json_number(f.phases->vote) << ",\"commit_s\":" << json_number(f.phases->commit)
                    << ",\"retention_s\":" << json_number(f.phases->retention);
        if (f.peer_collective >= 0)
          std::cout << ",\"peer_collective\":" << json_number(f.peer_collective) << ",\"peer_independent\":" << json_number(f.peer_independent);
        std::cout << "}\n";
      }
    } else {
      std::printf("dvr-mpi-bench: %d ranks x %zu MiB (%s), store medium %s, %d rounds\n", size, a.mib,
                  format_bytes(static_cast<double>(all_bytes)).c_str(), medium.c_str(), a.rounds);
      std::printf("  %-28s %12s %12s %8s   %s\n", "figure", "ours", "peer", "ratio", "peer / note");
      for (const auto& f : figures) {
        auto show = [&](double v) {
          if (f.higher_is_better) {
            char b[32];
            std::snprintf(b, sizeof b, "%.2f GB/s", v);
            return std::string(b);
          }
          return f.bytes_figure ? format_bytes(v) : format_seconds(v);
        };
        std::printf("  %-28s %12s %12s %8.2f   %s: %s\n", f.name.c_str(), show(f.value).c_str(), show(f.peer_value).c_str(), f.ratio(),
                    f.peer.c_str(), f.note.c_str());
        if (f.phases)
          std::printf("  %-28s phases (slowest rank each): local %s, partner copies %s (overlapping local), vote %s, commit %s, retention %s\n", "",
                      format_seconds(f.phases->local).c_str(), format_seconds(f.phases->partner).c_str(), format_seconds(f.phases->vote).c_str(),
                      format_seconds(f.phases->commit).c_str(), format_seconds(f.phases->retention).c_str());
        if (f.peer_collective >= 0)
          std::printf("  %-28s MPI-IO collective %s, independent %s\n", "", format_seconds(f.peer_collective).c_str(),
                      format_seconds(f.peer_independent).c_str());
        if (!f.bytes_figure && f.unit == "s" && f.name.find("snapshot") != std::string::npos)
          std::printf("  %-28s partner copies %s, stored %s (all ranks)\n", "", format_bytes(static_cast<double>(f.partner_bytes)).c_str(),
                      format_bytes(static_cast<double>(f.stored_bytes)).c_str());
      }
      std::printf("  ratio = peer / ours for costs (s, B), ours / peer for rates (GB/s): above 1, ours is better\n");
    }
    if (!all_ok) std::fprintf(stderr, "dvr-mpi-bench: a restore did not give back the checkpoint's data\n");
    std::fflush(stdout);
  }
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const Args a = parse(argc, argv, rank);
  int rc = 0;
  try {
    rc = run(a, rank, size);
  } catch (const dvr::Error& e) {
    std::fprintf(stderr, "dvr-mpi-bench: rank %d: error (%s): %s\n", rank, dvr::errc_name(e.code()), e.what());
    std::fflush(nullptr);
    drop_own_root();
    MPI_Abort(MPI_COMM_WORLD, 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dvr-mpi-bench: rank %d: error: %s\n", rank, e.what());
    std::fflush(nullptr);
    drop_own_root();
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return rc;
}
