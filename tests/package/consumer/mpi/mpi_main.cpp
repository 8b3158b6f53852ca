// An outside MPI program using the installed dvr::mpi (dvr/mpi.hpp): every
// rank keeps a buffer in its own store, a global snapshot is taken, the
// buffers change, restore_latest() brings them back bit-exact on every rank.
// Built by tests/package/run.sh through find_package(dvr) + dvr::mpi
// (CMakeLists.txt here) and through pkg-config dvr_mpi, and run on 2 ranks.
//
//   mpirun -np 2 consumer_mpi STORE_DIR [EXPECTED_VERSION]
#include <dvr/dvr.hpp>
#include <dvr/mpi.hpp>
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, status = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    if (argc < 2) throw std::runtime_error("usage: consumer_mpi STORE_DIR [EXPECTED_VERSION]");
    if (argc > 2 && std::strcmp(dvr::version(), argv[2]) != 0)
      throw std::runtime_error(std::string("libdvr says version ") + dvr::version() + ", expected " + argv[2]);
    dvr::mpi::Session s(dvr::Store::open(std::string(argv[1]) + "/rank-" + std::to_string(rank)), "consumer", MPI_COMM_WORLD);
    std::vector<unsigned char> data(256 << 10);
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 7 + 3 + rank);
    const std::vector<unsigned char> original = data;
    s.local().track("data", data.data(), data.size());
    dvr::mpi::GlobalInfo g = s.snapshot("step-1");
    for (std::size_t i = 0; i < data.size(); i += 4096) data[i] ^= 0xff;
    auto name = s.restore_latest();
    if (!name || *name != "step-1") throw std::runtime_error("restore_latest() did not find step-1");
    if (data != original) throw std::runtime_error("restore was not bit-exact");
    if (rank == 0)
      std::printf("consumer_mpi: dvr %s, global snapshot %s (seq %llu) and restore on %d ranks ok\n", dvr::version(),
                  g.name.c_str(), static_cast<unsigned long long>(g.seq), s.size());
  } catch (const std::exception& e) {  // dvr::Error, thrown inside libdvr / libdvr_mpi, caught here
    std::fprintf(stderr, "consumer_mpi (rank %d): %s\n", rank, e.what());
    status = 1;
  }
  MPI_Finalize();
  return status;
}
