// 2-D heat diffusion over MPI ranks with coordinated Memory DVR snapshots
// (dvr::mpi::Session, docs/mpi.md).
//
//   mpirun -np 4 build/dvr-example-mpi-heat --store-root DIR [--nx 256] [--ny 256]
//       [--steps 200] [--every 20] [--keep K] [--partner-offset P]
//       [--abort-at STEP [--abort-rank R] [--abort-mpi] [--abort-after-local]]
//       [--fail-commit-at STEP --fail-rank R] [--json] [--quiet]
//
// The global nx x ny grid is split in horizontal strips, one per rank; each
// step exchanges the halo rows with the neighbours (MPI_Sendrecv) and applies
// the explicit 5-point stencil u += a * (N + S + E + W - 4u) (Jacobi: the new
// field is computed from the old one only). The top edge is held at 1, the
// other edges at 0. Rank r keeps its strip, halos included, in region "u" of
// its own store DIR/node-r (each rank's store stands for a node's memory) and
// the step counter in region "meta"; every K steps all ranks take the global
// snapshot "step-NNNNNN". At start, restore_latest() brings back the newest
// global snapshot that every rank can restore (a rank whose store was lost
// takes its part from its partner's copy), and the run resumes from its step.
//
// Failures, for the tests (tests/mpi):
//   --abort-at STEP       at STEP, before that step's checkpoint, rank R
//                         (--abort-rank; every rank without it) dies with
//                         _exit(42), or MPI_Abort with --abort-mpi. With
//                         --abort-after-local every rank first takes its
//                         local part of step-STEP directly (s.local()), as
//                         if the crash came between the local snapshots and
//                         the commit: that snapshot must never be chosen, and
//                         the restart must be able to take it again.
//   --fail-commit-at STEP at STEP a snapshot is attempted (on the schedule or
//                         not) and rank R (--fail-rank) passes an invalid name,
//                         so its local snapshot fails: every rank gets the
//                         exception, reports it, and the run goes on.
//
// At the end rank 0 prints the field's checksum: each global row is hashed
// (FNV-1a over its bytes, mixed with its row number) and the row hashes are
// added modulo 2^64, so the value does not depend on the number of ranks; plus
// the sum of all values (per-rank sums added in rank order).
// The C API only (OpenMPI's and MPICH's C++ bindings are deprecated and warn).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "dvr/mpi.hpp"

namespace {

struct Args {
  std::string store_root;
  long nx = 256, ny = 256, steps = 200, every = 20;
  long keep = -1;            // -1: the library's default
  long partner_offset = -1;  // -1: the library's default
  long abort_at = -1, abort_rank = -1;
  bool abort_mpi = false;
  bool abort_after_local = false;
  long fail_commit_at = -1, fail_rank = -1;
  bool json = false, quiet = false;
};

[[noreturn]] void usage(int rank, const char* msg) {
  if (rank == 0)
    std::fprintf(stderr,
                 "dvr-example-mpi-heat: %s\n"
                 "usage: mpirun -np N dvr-example-mpi-heat --store-root DIR [--nx 256] [--ny 256] [--steps 200]\n"
                 "         [--every 20] [--keep K] [--partner-offset P] [--abort-at STEP [--abort-rank R] [--abort-mpi] [--abort-after-local]]\n"
                 "         [--fail-commit-at STEP --fail-rank R] [--json] [--quiet]\n",
                 msg);
  MPI_Finalize();
  std::exit(2);
}

long to_long(int rank, const char* opt, const char* s) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(s, &end, 10);
  if (errno || end == s || *end) usage(rank, (std::string("bad number for ") + opt + ": " + s).c_str());
  return v;
}

Args parse(int argc, char** argv, int rank) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string o = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(rank, (o + " needs a value").c_str());
      return argv[++i];
    };
    if (o == "--store-root")
      a.store_root = value();
    else if (o == "--nx")
      a.nx = to_long(rank, "--nx", value());
    else if (o == "--ny")
      a.ny = to_long(rank, "--ny", value());
    else if (o == "--steps")
      a.steps = to_long(rank, "--steps", value());
    else if (o == "--every")
      a.every = to_long(rank, "--every", value());
    else if (o == "--keep")
      a.keep = to_long(rank, "--keep", value());
    else if (o == "--partner-offset")
      a.partner_offset = to_long(rank, "--partner-offset", value());
    else if (o == "--abort-at")
      a.abort_at = to_long(rank, "--abort-at", value());
    else if (o == "--abort-rank")
      a.abort_rank = to_long(rank, "--abort-rank", value());
    else if (o == "--abort-mpi")
      a.abort_mpi = true;
    else if (o == "--abort-after-local")
      a.abort_after_local = true;
    else if (o == "--fail-commit-at")
      a.fail_commit_at = to_long(rank, "--fail-commit-at", value());
    else if (o == "--fail-rank")
      a.fail_rank = to_long(rank, "--fail-rank", value());
    else if (o == "--json")
      a.json = true;
    else if (o == "--quiet")
      a.quiet = true;
    else if (o == "-h" || o == "--help")
      usage(rank, "help");
    else
      usage(rank, ("unknown option " + o).c_str());
  }
  if (a.store_root.empty()) usage(rank, "--store-root is required");
  if (a.nx < 3 || a.ny < 1 || a.steps < 0 || a.every < 0) usage(rank, "need --nx >= 3, --ny >= 1, --steps >= 0, --every >= 0");
  if (a.fail_commit_at >= 0 && a.fail_rank < 0) usage(rank, "--fail-commit-at needs --fail-rank");
  return a;
}

// What region "meta" holds.
struct Meta {
  std::uint64_t magic;
  std::uint64_t step;  // steps done
  std::uint64_t nx, ny, ranks;
};
constexpr std::uint64_t kMagic = 0x5441454852564400ull;  // "\0DVRHEAT"

std::uint64_t fnv1a(const void* p, std::size_t n) {
  auto* b = static_cast<const unsigned char*>(p);
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < n; ++i)
    h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

std::uint64_t mix(std::uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string step_name(long step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%06ld", step);
  return buf;
}

int run(const Args& a, int rank, int size) {
  const double t_start = MPI_Wtime();
  // This rank's strip: rows [row0, row0 + n) of the global grid.
  const long base = a.ny / size, extra = a.ny % size;
  const long n = base + (rank < extra ? 1 : 0);
  const long row0 = rank * base + std::min<long>(rank, extra);
  if (a.ny < size) {  // the same answer on every rank
    if (rank == 0) std::fprintf(stderr, "dvr-example-mpi-heat: --ny %ld is less than the %d ranks\n", a.ny, size);
    return 2;
  }
  const long nx = a.nx;
  const int up = rank > 0 ? rank - 1 : MPI_PROC_NULL;
  const int down = rank + 1 < size ? rank + 1 : MPI_PROC_NULL;

  std::error_code ec;
  std::filesystem::create_directories(a.store_root, ec);  // the ranks race here; the open below reports real errors
  const std::string dir = a.store_root + "/node-" + std::to_string(rank);

  dvr::mpi::Options opt;
  if (a.keep >= 0) opt.keep = static_cast<std::size_t>(a.keep);
  if (a.partner_offset >= 0) opt.partner_offset = static_cast<int>(a.partner_offset);
  dvr::mpi::Session s(dvr::Store::open(dir), "heat", MPI_COMM_WORLD, opt);

  // The strip with one halo row above and below: (n + 2) x nx doubles.
  double* u = s.local().alloc("u", static_cast<std::size_t>((n + 2) * nx) * sizeof(double)).as<double>().data();
  auto* meta = static_cast<Meta*>(s.local().alloc("meta", sizeof(Meta)).data());

  std::string resumed;
  if (auto name = s.restore_latest()) {
    resumed = *name;
    if (meta->magic != kMagic || meta->nx != static_cast<std::uint64_t>(a.nx) || meta->ny != static_cast<std::uint64_t>(a.ny) ||
        meta->ranks != static_cast<std::uint64_t>(size)) {
      std::fprintf(stderr,
                   "dvr-example-mpi-heat: rank %d: snapshot %s is of another run (grid %" PRIu64 "x%" PRIu64 " on %" PRIu64
                   " ranks; this one: %ldx%ld on %d)\n",
                   rank, name->c_str(), meta->nx, meta->ny, meta->ranks, a.nx, a.ny, size);
      MPI_Abort(MPI_COMM_WORLD, 3);
    }
    if (rank == 0 && !a.json) std::printf("resumed from %s (step %" PRIu64 " of %ld)\n", name->c_str(), meta->step, a.steps);
  } else {
    *meta = Meta{kMagic, 0, static_cast<std::uint64_t>(a.nx), static_cast<std::uint64_t>(a.ny), static_cast<std::uint64_t>(size)};
    for (long i = 0; i < n; ++i) {
      const long g = row0 + i;
      for (long j = 0; j < nx; ++j) {
        double v = 0.25 * (1.0 + std::sin(0.05 * static_cast<double>(g) + 0.11 * static_cast<double>(j)));
        if (std::labs(g - a.ny / 2) < a.ny / 8 && std::labs(j - nx / 2) < nx / 8) v = 2.0;  // a hot square
        if (j == 0 || j == nx - 1) v = 0.0;                                                 // fixed side edges
        u[(i + 1) * nx + j] = v;
      }
    }
    // Halo rows outside the grid are the fixed top (1) and bottom (0) edges;
    // the others are filled by the exchange.
    for (long j = 0; j < nx; ++j) {
      u[j] = rank == 0 ? 1.0 : 0.0;
      u[(n + 1) * nx + j] = 0.0;
    }
    if (rank == 0 && !a.json) std::printf("fresh start: %ldx%ld grid on %d ranks\n", a.nx, a.ny, size);
  }

  std::vector<double> next(static_cast<std::size_t>(n * nx));
  const double alpha = 0.2;  // stable for <= 0.25
  long checkpoints = 0;
  std::vector<std::string> failed;
  double ckpt_seconds = 0;  // this rank's time in snapshot()
  std::uint64_t partner_bytes = 0, stored_bytes = 0;
  const long first_step = static_cast<long>(meta->step);

  for (long step = first_step; step < a.steps;) {
    MPI_Sendrecv(u + nx, static_cast<int>(nx), MPI_DOUBLE, up, 0, u + (n + 1) * nx, static_cast<int>(nx), MPI_DOUBLE, down, 0, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
    MPI_Sendrecv(u + n * nx, static_cast<int>(nx), MPI_DOUBLE, down, 1, u, static_cast<int>(nx), MPI_DOUBLE, up, 1, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
    for (long i = 1; i <= n; ++i) {
      const double* c = u + i * nx;
      double* o = next.data() + (i - 1) * nx;
      o[0] = c[0];
      o[nx - 1] = c[nx - 1];
      for (long j = 1; j < nx - 1; ++j)
        o[j] = c[j] + alpha * (c[j - nx] + c[j + nx] + c[j - 1] + c[j + 1] - 4.0 * c[j]);
    }
    std::memcpy(u + nx, next.data(), next.size() * sizeof(double));
    meta->step = static_cast<std::uint64_t>(++step);

    if (step == a.abort_at && a.abort_after_local) {
      // A crash between the two phases of a global snapshot: every rank has
      // its local part of step-STEP (what phase 1 leaves), none is committed.
      s.local().snapshot(step_name(step));
      MPI_Barrier(MPI_COMM_WORLD);
    }
    if (step == a.abort_at && (a.abort_rank < 0 || rank == a.abort_rank)) {
      std::fprintf(stderr, "rank %d: crashing at step %ld (--abort-at)\n", rank, step);
      std::fflush(nullptr);
      if (a.abort_mpi) MPI_Abort(MPI_COMM_WORLD, 42);
      ::_exit(42);
    }
    const bool fail_here = step == a.fail_commit_at;
    if ((a.every > 0 && step % a.every == 0) || fail_here) {
      std::string name = step_name(step);
      if (fail_here && rank == a.fail_rank) name = "bad/" + name;  // an invalid name: this rank's snapshot fails
      try {
        auto g = s.snapshot(name);
        ++checkpoints;
        ckpt_seconds += g.seconds;
        partner_bytes += g.partner_bytes;
        stored_bytes += g.stored_bytes;
        if (rank == 0 && !a.json && !a.quiet)
          std::printf("checkpoint %s: seq %" PRIu64 ", %" PRIu64 " bytes stored, %" PRIu64 " to partner, %.4f s\n", g.name.c_str(), g.seq,
                      g.stored_bytes, g.partner_bytes, g.seconds);
      } catch (const std::exception& e) {
        failed.push_back(step_name(step));
        std::fprintf(stderr, "rank %d: checkpoint %s failed: %s\n", rank, step_name(step).c_str(), e.what());
        if (rank == 0 && !a.json) std::printf("checkpoint %s failed; going on\n", step_name(step).c_str());
      }
    }
  }

  // The checksum: row hashes (independent of the decomposition) added mod 2^64,
  // and the sum of all values with per-rank sums added in rank order.
  std::uint64_t h = 0;
  double sum = 0;
  for (long i = 1; i <= n; ++i) {
    const double* row = u + i * nx;
    h += mix(fnv1a(row, static_cast<std::size_t>(nx) * sizeof(double)) ^ mix(static_cast<std::uint64_t>(row0 + i - 1)));
    for (long j = 0; j < nx; ++j)
      sum += row[j];
  }
  std::uint64_t total_h = 0;
  MPI_Reduce(&h, &total_h, 1, MPI_UINT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
  std::vector<double> sums(rank == 0 ? size : 0);
  MPI_Gather(&sum, 1, MPI_DOUBLE, sums.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  double max_ckpt = 0;
  MPI_Reduce(&ckpt_seconds, &max_ckpt, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  std::uint64_t sent[2] = {partner_bytes, stored_bytes}, sent_total[2] = {0, 0};
  MPI_Reduce(sent, sent_total, 2, MPI_UINT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
  const auto committed = s.committed();
  const double seconds = MPI_Wtime() - t_start;

  if (rank == 0) {
    double total = 0;
    for (double v : sums)
      total += v;
    char hex[20];
    std::snprintf(hex, sizeof hex, "%016" PRIx64, total_h);
    if (a.json) {
      std::string out = "{\"checksum\":\"" + std::string(hex) + "\"";
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.17g", total);
      out += ",\"sum\":" + std::string(buf);
      out += ",\"steps\":" + std::to_string(a.steps) + ",\"first_step\":" + std::to_string(first_step);
      out += ",\"nx\":" + std::to_string(a.nx) + ",\"ny\":" + std::to_string(a.ny) + ",\"ranks\":" + std::to_string(size);
      out += ",\"resumed_from\":" + (resumed.empty() ? std::string("null") : json_string(resumed));
      out += ",\"checkpoints\":" + std::to_string(checkpoints);
      out += ",\"failed\":[";
      for (std::size_t i = 0; i < failed.size(); ++i)
        out += (i ? "," : "") + json_string(failed[i]);
      out += "],\"committed\":[";
      for (std::size_t i = 0; i < committed.size(); ++i)
        out += (i ? "," : "") + json_string(committed[i].name);
      std::snprintf(buf, sizeof buf, "%.6g", max_ckpt);
      out += "],\"checkpoint_seconds\":" + std::string(buf);
      out += ",\"partner_bytes\":" + std::to_string(sent_total[0]) + ",\"stored_bytes\":" + std::to_string(sent_total[1]);
      std::snprintf(buf, sizeof buf, "%.6g", seconds);
      out += ",\"seconds\":" + std::string(buf) + ",\"partner\":" + std::to_string(s.partner()) + "}";
      std::printf("%s\n", out.c_str());
    } else {
      std::printf(
          "%ld steps (%ld this run), %ld checkpoints (%zu failed), %.3f s in snapshots (slowest rank), "
          "%" PRIu64 " bytes to partners\n",
          a.steps, a.steps > first_step ? a.steps - first_step : 0, checkpoints, failed.size(), max_ckpt, sent_total[0]);
      if (!resumed.empty()) std::printf("resumed from %s\n", resumed.c_str());
      std::printf("checksum %s sum %.17g\n", hex, total);
    }
    std::fflush(stdout);
  }
  return 0;
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
    std::fprintf(stderr, "dvr-example-mpi-heat: rank %d: error (%s): %s\n", rank, dvr::errc_name(e.code()), e.what());
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 1);  // the other ranks may be waiting in a collective
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dvr-example-mpi-heat: rank %d: error: %s\n", rank, e.what());
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return rc;
}
