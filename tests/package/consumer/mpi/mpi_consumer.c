/* An outside MPI program in C using the installed C API of dvr_mpi
 * (dvr/dvr_mpi.h): the same as mpi_main.cpp. Built by tests/package/run.sh
 * through find_package(dvr) + dvr::mpi and through pkg-config dvr_mpi.
 *
 *   mpirun -np 2 consumer_mpi_c STORE_DIR [EXPECTED_VERSION]
 */
#include <dvr/dvr_mpi.h>
#include <mpi.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SIZE (256u << 10)

static int rank;

static int failed(const char* what) {
  fprintf(stderr, "consumer_mpi_c (rank %d): %s: %s\n", rank, what, dvr_errmsg());
  MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (argc < 2) {
    fprintf(stderr, "usage: consumer_mpi_c STORE_DIR [EXPECTED_VERSION]\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  if (argc > 2 && strcmp(dvr_version(), argv[2]) != 0) {
    fprintf(stderr, "consumer_mpi_c: libdvr says version %s, expected %s\n", dvr_version(), argv[2]);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  unsigned char* data = malloc(SIZE);
  unsigned char* original = malloc(SIZE);
  if (!data || !original) MPI_Abort(MPI_COMM_WORLD, 1);
  for (size_t i = 0; i < SIZE; ++i) data[i] = (unsigned char)(i * 7 + 3 + (size_t)rank);
  memcpy(original, data, SIZE);

  char dir[4096];
  snprintf(dir, sizeof dir, "%s/rank-%d", argv[1], rank);
  dvr_store* store = NULL;
  dvr_mpi_session* m = NULL;
  dvr_session* s = NULL;
  dvr_mpi_info info;
  char name[DVR_NAME_MAX + 1];
  if (dvr_store_open(dir, &store) != DVR_OK) return failed("dvr_store_open");
  if (dvr_mpi_session_open(store, "consumer-c", MPI_COMM_WORLD, NULL, &m) != DVR_OK) return failed("dvr_mpi_session_open");
  if (dvr_mpi_local(m, &s) != DVR_OK) return failed("dvr_mpi_local");
  if (dvr_track(s, "data", data, SIZE) != DVR_OK) return failed("dvr_track");
  if (dvr_mpi_snapshot(m, "step-1", &info) != DVR_OK) return failed("dvr_mpi_snapshot");
  for (size_t i = 0; i < SIZE; i += 4096) data[i] ^= 0xff;
  if (dvr_mpi_restore_latest(m, name, sizeof name) != DVR_OK) return failed("dvr_mpi_restore_latest");
  if (strcmp(name, "step-1") != 0 || memcmp(data, original, SIZE) != 0) {
    fprintf(stderr, "consumer_mpi_c (rank %d): restore of step-1 was not bit-exact (got '%s')\n", rank, name);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  /* An error from dvr_mpi sets the same dvr_errmsg() as libdvr's own calls. */
  if (dvr_mpi_restore_latest(m, name, 1) != DVR_E_INVALID_ARGUMENT || strstr(dvr_errmsg(), "dvr_mpi_restore_latest") == NULL) {
    fprintf(stderr, "consumer_mpi_c (rank %d): a bad argument to dvr_mpi_restore_latest gave '%s'\n", rank, dvr_errmsg());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  dvr_mpi_session_close(m);
  dvr_store_close(store);
  if (rank == 0)
    printf("consumer_mpi_c: dvr %s, global snapshot %s (seq %llu) and restore on %d ranks ok\n", dvr_version(), info.name,
           (unsigned long long)info.seq, size);
  free(data);
  free(original);
  MPI_Finalize();
  return 0;
}
