/* Memory DVR — the C API of coordinated snapshots across MPI ranks.
 *
 * dvr::mpi::Session (dvr/mpi.hpp, docs/mpi.md) for C, in library dvr_mpi
 * (CMake target dvr::mpi); the conventions of dvr/dvr.h hold (statuses,
 * dvr_errmsg(), names, one thread per session at a time).
 *
 *   dvr_store* store;                  // each rank its own (node-local) store
 *   dvr_mpi_session* m;
 *   dvr_session* s;
 *   dvr_store_open(my_dir, &store);
 *   dvr_mpi_session_open(store, "heat", MPI_COMM_WORLD, NULL, &m);   // collective
 *   dvr_mpi_local(m, &s);              // borrowed: register this rank's memory
 *   dvr_track(s, "u", u, n * sizeof(double));
 *   char name[DVR_NAME_MAX + 1];
 *   if (dvr_mpi_restore_latest(m, name, sizeof name) == DVR_OK)      // collective
 *     step = atoi(name + 5) + 1;       // else DVR_E_NOT_FOUND: a fresh start
 *   ...
 *   dvr_mpi_snapshot(m, "step-100", NULL);                           // collective
 *   ...
 *   dvr_mpi_session_close(m);          // also ends the borrowed dvr_session
 *   dvr_store_close(store);
 *
 * Collective calls (dvr_mpi_session_open, dvr_mpi_snapshot,
 * dvr_mpi_restore_latest) are called by every rank of the communicator, in
 * the same order. When the library fails on some rank, every rank returns the
 * same failure and dvr_errmsg() names the failing ranks and their messages.
 * Argument errors (a NULL argument, a name buffer under DVR_NAME_MAX + 1
 * bytes) are found on the calling rank before the collective starts: that rank
 * returns DVR_E_INVALID_ARGUMENT at once while the others wait in the
 * collective, as with MPI's own argument errors — treat them as programming
 * errors (MPI_Abort).
 *
 * docs/mpi_api.md has the overview, docs/mpi.md the protocol.
 */
#ifndef DVR_DVR_MPI_H
#define DVR_DVR_MPI_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#include "dvr/dvr.h"
#include "dvr/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An open MPI session: one rank's part of a session coordinated across a
 * communicator. */
typedef struct dvr_mpi_session dvr_mpi_session;

/* Options of dvr_mpi_session_open (dvr::mpi::Options). Start from
 * dvr_mpi_options_init() and change what you need. */
typedef struct dvr_mpi_options {
  int partner_offset; /* the partner of rank r is (r + partner_offset) mod size; 0: size / 2 */
  int partner_copies; /* nonzero: send partner copies after each global snapshot */
  size_t keep;        /* global snapshots kept (own parts and partner copies); 0 keeps all */
  int level;          /* zstd level of partner copies (0: none) */
} dvr_mpi_options;

/* One global snapshot as this rank sees it (dvr::mpi::GlobalInfo). */
typedef struct dvr_mpi_info {
  char name[DVR_NAME_MAX + 1];
  uint64_t seq;           /* commit order (1, 2, ...) */
  uint64_t stored_bytes;  /* this rank's part: bytes added to its store */
  uint64_t partner_bytes; /* bytes this rank sent to its partner */
  double seconds;         /* the whole collective call, on this rank */
} dvr_mpi_info;

/* Fills *opts with the defaults: partner_offset 0, partner_copies 1, keep 3,
 * level 1. NULL is allowed and does nothing. */
DVR_EXPORT void dvr_mpi_options_init(dvr_mpi_options* opts);

/* Collective over `comm`. Opens session `name` in this rank's `store` (each
 * rank its own store directory). `opts` NULL means the defaults. `comm` is
 * used, not duplicated: it must stay valid until dvr_mpi_session_close. The
 * session keeps the store open. On failure *out is NULL.
 * Errors: INVALID_ARGUMENT (NULL argument, bad name, MPI_COMM_NULL, MPI not
 * initialized). */
DVR_EXPORT dvr_status dvr_mpi_session_open(dvr_store* store, const char* name, MPI_Comm comm, const dvr_mpi_options* opts, dvr_mpi_session** out);

/* Ends the session on this rank (not collective): forgets its regions and
 * frees those made by dvr_alloc; snapshots stay in the stores. The handle
 * from dvr_mpi_local ends with it. NULL is allowed and does nothing. */
DVR_EXPORT void dvr_mpi_session_close(dvr_mpi_session* session);

/* Sets *out to this rank's own session: dvr_track / dvr_alloc / dvr_untrack
 * its regions there (dvr_snapshot / dvr_restore on it act on this rank
 * alone). The handle is borrowed: it stays valid until
 * dvr_mpi_session_close, which ends it; dvr_session_close leaves it alone.
 * Every call returns the same handle. On failure *out is NULL.
 * Errors: INVALID_ARGUMENT (NULL argument). */
DVR_EXPORT dvr_status dvr_mpi_local(dvr_mpi_session* session, dvr_session** out);

/* This rank's partner: the rank that keeps copies of its parts.
 * Errors: INVALID_ARGUMENT (NULL argument). */
DVR_EXPORT dvr_status dvr_mpi_partner(const dvr_mpi_session* session, int* out);

/* Collective. Global snapshot `name` of every rank's regions: committed only
 * if every rank took its part, then the partner copies are sent and retention
 * applied. `out` (may be NULL) receives this rank's view of it.
 * Errors (on every rank): IO naming the failing ranks (a local snapshot
 * failed: the snapshot is committed nowhere; or the partner copies failed:
 * it is committed, the copies are not), INVALID_ARGUMENT (NULL argument). */
DVR_EXPORT dvr_status dvr_mpi_snapshot(dvr_mpi_session* session, const char* name, dvr_mpi_info* out);

/* Collective. Restores, on every rank, the newest global snapshot every rank
 * can restore (from its own store or from its partner's copy) and copies its
 * name into name_buf, which holds at least DVR_NAME_MAX + 1 bytes. On failure
 * name_buf holds "" (if buf_size > 0).
 * Errors: NOT_FOUND (on every rank: there is none, a fresh start), IO (on
 * every rank, naming the failing ranks), INVALID_ARGUMENT (NULL argument,
 * buf_size < DVR_NAME_MAX + 1). */
DVR_EXPORT dvr_status dvr_mpi_restore_latest(dvr_mpi_session* session, char* name_buf, size_t buf_size);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DVR_DVR_MPI_H */
