// dvr-test-mpi-first: the pipelined first checkpoint of dvr::mpi (docs/mpi.md,
// "The first checkpoint"), driven by tests/mpi/test_first_checkpoint.py.
//
//   mpirun -np 4 dvr-test-mpi-first MODE ROOT
//
// Rank R uses the store ROOT/node-R, session "t", regions of odd sizes (a
// region that ends inside a chunk and inside a page, and an all-zero one).
// Modes, each checking everything it says and printing "ok MODE" on rank 0
// (any failed check: a message on stderr and MPI_Abort):
//   exact    the first checkpoint's partner copy is bit-exact (same content
//            fingerprint as the part; its clone reads the same bytes), and
//            after rank 1's store is removed, restore_latest() brings the
//            part back from the partner with the same bytes.
//   fail     a checkpoint that one rank fails (an invalid name on rank 2,
//            while the others stream their whole parts to their partners)
//            is committed nowhere and leaves no part and no partner copy in
//            any store; the previous checkpoint stays committed and
//            restorable; a first checkpoint that fails leaves nothing.
//   partner  a partner whose base of the copy differs from the sender's (the
//            stream does not fit it) makes every rank throw an error naming
//            the partner copies, that rank and why; the checkpoint stays
//            committed; without that base the next copy travels whole and
//            restores after the sender's store is lost.
//   prepare  a rank that lacks its part and cannot open its store for the
//            exchange still takes part in it: every rank throws (none
//            hangs), and restore_latest() succeeds once the store opens.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "dvr/clone.hpp"
#include "dvr/mpi.hpp"
#include "dvr/transfer.hpp"

namespace {

int rank = 0, size = 1;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "dvr-test-mpi-first: rank %d: check failed: %s\n", rank, what.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::abort();
}

void check(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

// Region sizes: 3 MiB + 1234 bytes (not a chunk or page multiple), 1 MiB of zeros.
constexpr std::size_t kData = (3u << 20) + 1234, kZeros = 1u << 20;

void fill(char* p, std::size_t n, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<char>(x);
  }
}

std::string node(const std::string& root, int r) { return root + "/node-" + std::to_string(r); }

struct Job {
  std::optional<dvr::mpi::Session> s;
  char* data = nullptr;
  char* zeros = nullptr;
  Job(const std::string& root, int keep = 3) {
    s.emplace(dvr::Store::open(node(root, rank)), "t", MPI_COMM_WORLD, dvr::mpi::Options{.keep = static_cast<std::size_t>(keep)});
    data = static_cast<char*>(s->local().alloc("data", kData).data());
    zeros = static_cast<char*>(s->local().alloc("zeros", kZeros).data());
  }
};

std::vector<std::string> names(const std::vector<dvr::mpi::GlobalInfo>& v) {
  std::vector<std::string> out;
  for (auto& g : v)
    out.push_back(g.name);
  return out;
}

std::vector<std::string> listed(const dvr::Store& st, const std::string& session) {
  std::vector<std::string> out;
  for (auto& i : st.list(session)) {
    check(!i.damaged, session + "/" + i.name + " is damaged in " + st.path());
    out.push_back(i.name);
  }
  return out;
}

// The partner copy of this rank's part `name` is bit-exact: its fingerprint
// equals the part's, and a clone of it reads the live bytes.
void check_copy_exact(Job& j, const std::string& root, const std::string& name) {
  const int partner = j.s->partner();
  MPI_Barrier(MPI_COMM_WORLD);  // every copy is in (snapshot() returned everywhere)
  dvr::Store mine = dvr::Store::open(node(root, rank));
  dvr::Store theirs = dvr::Store::open(node(root, partner));
  const std::string copy = "t.rank-" + std::to_string(rank) + "/" + name;
  check(dvr::transfer::fingerprint(theirs, copy) == dvr::transfer::fingerprint(mine, "t/" + name),
        "the partner copy " + copy + " in " + theirs.path() + " has other content than the part");
  dvr::Clone c = theirs.open_snapshot("t.rank-" + std::to_string(rank), name);
  check(std::memcmp(c.region("data").data(), j.data, kData) == 0, "the partner copy's region 'data' differs from memory");
  const char* z = static_cast<const char*>(c.region("zeros").data());
  for (std::size_t i = 0; i < kZeros; ++i)
    check(z[i] == 0, "the partner copy's region 'zeros' is not zero");
  MPI_Barrier(MPI_COMM_WORLD);
}

void mode_exact(const std::string& root) {
  std::vector<char> want(kData);
  {
    Job j(root);
    fill(j.data, kData, 7 + static_cast<std::uint64_t>(rank));
    std::memcpy(want.data(), j.data, kData);
    check(!j.s->restore_latest(), "a fresh start found a snapshot");
    dvr::mpi::GlobalInfo g = j.s->snapshot("first");
    check(g.seq == 1, "the first checkpoint has seq " + std::to_string(g.seq));
    check(g.partner_bytes >= kData, "the first checkpoint sent only " + std::to_string(g.partner_bytes) + " bytes to the partner");
    check(names(j.s->committed()) == std::vector<std::string>{"first"}, "'first' is not the one committed snapshot");
    check_copy_exact(j, root, "first");
  }
  // Rank 1's node is lost; its part comes back from its partner's copy.
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 1) std::filesystem::remove_all(node(root, 1));
  MPI_Barrier(MPI_COMM_WORLD);
  Job j(root);
  std::memset(j.data, 0x5a, kData);
  auto got = j.s->restore_latest();
  check(got && *got == "first", "restore_latest() after the loss gave " + (got ? *got : std::string("nothing")));
  check(std::memcmp(j.data, want.data(), kData) == 0, "the restored region 'data' differs from the checkpoint");
  for (std::size_t i = 0; i < kZeros; ++i)
    check(j.zeros[i] == 0, "the restored region 'zeros' is not zero");
}

// Every rank throws the same global failure for `name`, naming rank `bad`.
void expect_failure(Job& j, const std::string& name, int bad, const char* what) {
  try {
    j.s->snapshot(name);
  } catch (const dvr::Error& e) {
    const std::string m = e.what();
    check(m.find("failed and was not committed") != std::string::npos, std::string(what) + ": unexpected message: " + m);
    check(m.find("rank " + std::to_string(bad) + ":") != std::string::npos, std::string(what) + ": the message names no rank " + std::to_string(bad) + ": " + m);
    return;
  }
  fail(std::string(what) + ": snapshot() did not throw");
}

// No part, no copy and no record of `name` anywhere in this rank's store.
void check_nothing_left(const std::string& root, const std::string& name, const std::vector<std::string>& committed) {
  dvr::Store mine = dvr::Store::open(node(root, rank));
  for (const std::string& session : {std::string("t"), "t.rank-" + std::to_string((rank - size / 2 + size) % size)}) {
    auto have = listed(mine, session);
    for (auto& n : have)
      check(n != name, session + "/" + name + " was left in " + mine.path());
    check(have == committed, session + " holds other snapshots than the committed ones in " + mine.path());
  }
  check(!std::filesystem::exists(node(root, rank) + "/mpi/t/" + name + ".commit"), "a commit record of " + name + " exists");
}

void mode_fail(const std::string& root) {
  Job j(root);
  fill(j.data, kData, 11 + static_cast<std::uint64_t>(rank));
  // A first checkpoint that fails: nothing anywhere.
  expect_failure(j, rank == 2 ? "bad/name" : "c0", 2, "the failed first checkpoint");
  check(j.s->committed().empty(), "a failed first checkpoint left a committed one");
  MPI_Barrier(MPI_COMM_WORLD);
  check_nothing_left(root, "c0", {});
  MPI_Barrier(MPI_COMM_WORLD);
  // A committed one, then one with all-new data that rank 2 fails.
  j.s->snapshot("c1");
  std::vector<char> want(j.data, j.data + kData);
  fill(j.data, kData, 99 + static_cast<std::uint64_t>(rank));
  expect_failure(j, rank == 2 ? "bad/name" : "c2", 2, "the failed second checkpoint");
  check(names(j.s->committed()) == std::vector<std::string>{"c1"}, "after the failure, 'c1' is not the one committed snapshot");
  MPI_Barrier(MPI_COMM_WORLD);
  check_nothing_left(root, "c2", {"c1"});
  MPI_Barrier(MPI_COMM_WORLD);
  auto got = j.s->restore_latest();
  check(got && *got == "c1", "restore_latest() gave " + (got ? *got : std::string("nothing")) + ", not c1");
  check(std::memcmp(j.data, want.data(), kData) == 0, "c1 restored other bytes");
  // The name that failed can be taken again.
  j.s->snapshot("c2");
  check_copy_exact(j, root, "c2");
}

void mode_partner(const std::string& root) {
  const int holder = 3;                            // keeps the copies of rank 1
  const int client = (holder - size / 2 + size) % size;
  const std::string copies = "t.rank-" + std::to_string(client);
  {
    Job j(root);
    fill(j.data, kData, 23 + static_cast<std::uint64_t>(rank));
    j.s->snapshot("p1");
    // The holder's copy of p1 is replaced by other (valid) content of that
    // name: p2, sent against p1, does not fit it.
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == holder) {
      dvr::Session other(dvr::Store::open(node(root, holder)), copies);
      std::vector<char> junk(kData, 'x');
      other.track("data", junk.data(), kData);
      std::vector<char> zeros(kZeros, 0);
      other.track("zeros", zeros.data(), kZeros);
      other.snapshot("p1", {.replace = true});
    }
    MPI_Barrier(MPI_COMM_WORLD);
    fill(j.data, kData, 29 + static_cast<std::uint64_t>(rank));
    bool threw = false;
    try {
      j.s->snapshot("p2");
    } catch (const dvr::Error& e) {
      threw = true;
      const std::string m = e.what();
      check(m.find("the partner copies of global snapshot 'p2' failed (it is committed; the copies are not)") != std::string::npos,
            "unexpected message: " + m);
      check(m.find("rank " + std::to_string(holder) + ": ") != std::string::npos && m.find("differs from the sender's base") != std::string::npos,
            "the message does not say that rank " + std::to_string(holder) + "'s base differs: " + m);
    }
    check(threw, "a partner copy that could not be stored was not reported");
    check(names(j.s->committed()) == std::vector<std::string>{"p1", "p2"}, "'p2' is not committed although every part is");
    // Without the bad base, the next copy travels whole and is exact.
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == holder) dvr::Store::open(node(root, holder)).remove(copies, "p1");
    MPI_Barrier(MPI_COMM_WORLD);
    fill(j.data, kData, 31 + static_cast<std::uint64_t>(rank));
    dvr::mpi::GlobalInfo g = j.s->snapshot("p3");
    if (rank == client) check(g.partner_bytes >= kData, "the copy to a partner without a base was not sent whole");
    check_copy_exact(j, root, "p3");
  }
  // The client loses its store: its part of p3 comes back from the holder.
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == client) std::filesystem::remove_all(node(root, client));
  MPI_Barrier(MPI_COMM_WORLD);
  Job j(root);
  auto got = j.s->restore_latest();
  check(got && *got == "p3", "restore_latest() gave " + (got ? *got : std::string("nothing")) + ", not p3");
  std::vector<char> want(kData);
  fill(want.data(), kData, 31 + static_cast<std::uint64_t>(rank));
  check(std::memcmp(j.data, want.data(), kData) == 0, "p3 restored other bytes");
}

// Rank 1 lacks its part of `first` and cannot open its store again for the
// exchange (its lock file is a directory for a while): it still takes part
// in the exchange, so every rank throws one error naming rank 1's store and
// none waits for ever; once the store opens again, restore_latest() brings
// the part back from the partner with the same bytes (no message of the
// failed exchange is left over to be taken for this one's).
void mode_prepare(const std::string& root) {
  std::vector<char> want(kData);
  {
    Job j(root);
    fill(j.data, kData, 41 + static_cast<std::uint64_t>(rank));
    std::memcpy(want.data(), j.data, kData);
    j.s->snapshot("first");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 1) dvr::Store::open(node(root, 1)).remove("t", "first");
  MPI_Barrier(MPI_COMM_WORLD);
  Job j(root);
  const std::string lock = node(root, 1) + "/lock";
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 1) {
    check(std::rename(lock.c_str(), (lock + ".aside").c_str()) == 0, "cannot move " + lock + " aside");
    std::filesystem::create_directory(lock);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  std::memset(j.data, 0x5a, kData);
  bool threw = false;
  try {
    j.s->restore_latest();
  } catch (const dvr::Error& e) {
    threw = true;
    const std::string m = e.what();
    check(m.find("could not be brought back from partners") != std::string::npos, "unexpected message: " + m);
    check(m.find("rank 1: ") != std::string::npos && m.find(lock) != std::string::npos,
          "the message does not name rank 1's lock file " + lock + ": " + m);
  }
  check(threw, "restore_latest() did not throw while rank 1 could not open its store");
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 1) {
    std::filesystem::remove(lock);
    check(std::rename((lock + ".aside").c_str(), lock.c_str()) == 0, "cannot move " + lock + " back");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto got = j.s->restore_latest();
  check(got && *got == "first", "restore_latest() after the store opened again gave " + (got ? *got : std::string("nothing")));
  check(std::memcmp(j.data, want.data(), kData) == 0, "the restored region 'data' differs from the checkpoint");
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc != 3 || size != 4) {
    if (rank == 0) std::fprintf(stderr, "usage: mpirun -np 4 dvr-test-mpi-first exact|fail|partner|prepare ROOT\n");
    MPI_Finalize();
    return 2;
  }
  const std::string mode = argv[1], root = argv[2];
  try {
    if (mode == "exact")
      mode_exact(root);
    else if (mode == "fail")
      mode_fail(root);
    else if (mode == "partner")
      mode_partner(root);
    else if (mode == "prepare")
      mode_prepare(root);
    else
      fail("unknown mode " + mode);
  } catch (const std::exception& e) {
    fail(std::string("unexpected exception: ") + e.what());
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::printf("ok %s\n", mode.c_str());
  MPI_Finalize();
  return 0;
}
