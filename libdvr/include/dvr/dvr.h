/* Memory DVR — the C API.
 *
 * A thin C99 layer over the C++ API (dvr/dvr.hpp) for C and Fortran codes:
 *
 *   dvr_store* store;
 *   dvr_session* s;
 *   if (dvr_store_open(NULL, &store) != DVR_OK ||         // NULL: the default store
 *       dvr_session_open(store, "heat", &s) != DVR_OK) {
 *     fprintf(stderr, "dvr: %s\n", dvr_errmsg());
 *     ...
 *   }
 *   dvr_track(s, "u", u, n * sizeof(double));
 *   dvr_snapshot(s, "step-000100", "after 100 steps");
 *   ...
 *   dvr_restore(s, "step-000100");                       // u is bit-exact again
 *   dvr_session_close(s);
 *   dvr_store_close(store);
 *
 * Errors. Every call that can fail returns a dvr_status; it never throws, never
 * aborts and never exits. On failure dvr_errmsg() gives a message that names the
 * store, session, snapshot, region or argument involved and says what to do (the
 * same text the C++ API puts in dvr::Error), and a call that fails has changed
 * nothing: live memory is untouched and no partial snapshot is published.
 *
 * Names (sessions, regions, snapshots): 1 to DVR_NAME_MAX characters from
 * A-Z a-z 0-9 . _ -, not starting with '.'. Strings are NUL-terminated UTF-8.
 *
 * Threads. dvr_errmsg() is per thread. A dvr_session is used by one thread at a
 * time, and its regions must not be written by other threads while
 * dvr_snapshot or dvr_restore runs. A dvr_store may be used from several
 * threads at once. Several processes may share one store.
 *
 * docs/c_api.md has a table of the calls, the Fortran binding pattern and how to
 * build against the library.
 */
#ifndef DVR_DVR_H
#define DVR_DVR_H

#include <stddef.h>
#include <stdint.h>

#include "dvr/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The longest session, region or snapshot name, in bytes (without the NUL).
 * A buffer of DVR_NAME_MAX + 1 bytes holds any name. */
#define DVR_NAME_MAX 128

/* What a call did. The codes from DVR_E_NOT_FOUND to DVR_E_PERMISSION mirror
 * dvr::Errc, in its order; codes added later come last, keeping the values. */
typedef enum dvr_status {
  DVR_OK = 0,
  DVR_E_NOT_FOUND,        /* unknown session, snapshot, region or store */
  DVR_E_ALREADY_EXISTS,   /* a snapshot or region of that name exists already */
  DVR_E_CORRUPT,          /* data or metadata failed its checksum, or is malformed */
  DVR_E_NO_SPACE,         /* the store's file system is full, a file-size limit, or no memory for a region */
  DVR_E_INVALID_ARGUMENT, /* NULL or bad argument: bad name, size 0 or mismatch, overlapping region, ... */
  DVR_E_IO,               /* any other operating-system error */
  DVR_E_UNSUPPORTED,      /* newer store format, missing kernel or file-system feature */
  DVR_E_PERMISSION,       /* store owned by another user, or not accessible */
  DVR_E_NOMEM,            /* the library ran out of memory for its own bookkeeping */
  DVR_E_INTERNAL,         /* an unexpected failure inside the library (a bug: please report it) */
  DVR_E_CANCELLED         /* a background snapshot was cancelled before it was published */
} dvr_status;

/* An open store (a directory holding every snapshot). */
typedef struct dvr_store dvr_store;
/* An open session: one application's named set of memory regions in a store. */
typedef struct dvr_session dvr_session;

/* One snapshot, as listed by dvr_list. The strings live in the list's memory
 * and stay valid until dvr_list_free. */
typedef struct dvr_snapshot_info {
  const char* name;
  const char* parent;     /* the snapshot this one was taken after ("" = none) */
  const char* label;      /* free text given at snapshot time ("" = none) */
  const char* damage;     /* why the snapshot is damaged ("" when intact) */
  int64_t time_ns;        /* commit time (Unix epoch, ns); for a damaged one, its file's mtime */
  uint64_t logical_bytes; /* sum of the region sizes */
  uint64_t stored_bytes;  /* bytes this snapshot added to the store when taken */
  int damaged;            /* 1 when its manifest is unreadable: it cannot be restored */
} dvr_snapshot_info;

/* The message of the calling thread's most recent failed dvr_* call, "" when
 * none has failed on this thread. Successful calls leave it as it is. The
 * pointer stays valid until the next failing call on this thread. Never NULL. */
DVR_EXPORT const char* dvr_errmsg(void);

/* The library version, "MAJOR.MINOR.PATCH". Never NULL. */
DVR_EXPORT const char* dvr_version(void);

/* ---- stores ---------------------------------------------------------------- */

/* Opens the store in directory `path`, creating it when the directory does not
 * exist or is empty; path NULL opens the default store ($DVR_STORE, else
 * /dev/shm/dvr-<uid>). On success *out is a handle for dvr_store_close; on
 * failure *out is NULL.
 * Errors: INVALID_ARGUMENT (out NULL, a non-empty directory that is not a
 * store, a path that is not a directory), PERMISSION (a store owned by another
 * user), UNSUPPORTED (a store written by a newer dvr), CORRUPT (a damaged
 * superblock), NO_SPACE, IO. */
DVR_EXPORT dvr_status dvr_store_open(const char* path, dvr_store** out);

/* Closes a store handle. Sessions opened from it stay usable: each keeps the
 * store open until it is closed itself. NULL is allowed and does nothing. */
DVR_EXPORT void dvr_store_close(dvr_store* store);

/* Sets *out to the store's directory. The string belongs to the handle and
 * stays valid until dvr_store_close.
 * Errors: INVALID_ARGUMENT (store or out NULL). */
DVR_EXPORT dvr_status dvr_store_path(const dvr_store* store, const char** out);

/* Lists the snapshots of `session`, oldest first, damaged ones included and
 * marked. On success *out points to *count entries in one allocation to be
 * released with dvr_list_free (*out is NULL when *count is 0: an unknown
 * session has no snapshots). On failure *out is NULL and *count 0.
 * Errors: INVALID_ARGUMENT (NULL argument, bad session name), IO. */
DVR_EXPORT dvr_status dvr_list(dvr_store* store, const char* session, dvr_snapshot_info** out, size_t* count);

/* Frees a list returned by dvr_list (NULL is allowed and does nothing). */
DVR_EXPORT void dvr_list_free(dvr_snapshot_info* list);

/* Copies into name_buf the name of the newest snapshot of `session` whose
 * manifest and data are intact (every chunk is re-hashed, so this reads the
 * snapshot's data once); newer damaged snapshots are skipped. After a crash,
 * this names the snapshot to restore. A buffer of DVR_NAME_MAX + 1 bytes is
 * always large enough. On failure name_buf holds "" (if buf_size > 0).
 * Errors: NOT_FOUND (the session has no intact snapshot), INVALID_ARGUMENT
 * (NULL argument, bad session name, buffer too small), IO. */
DVR_EXPORT dvr_status dvr_latest(dvr_store* store, const char* session, char* name_buf, size_t buf_size);

/* Deletes snapshot `snapshot` of `session`. Its space is reused by later
 * snapshots (`dvr gc` gives it back to the file system).
 * Errors: NOT_FOUND, INVALID_ARGUMENT (NULL argument, bad name), IO. */
DVR_EXPORT dvr_status dvr_remove(dvr_store* store, const char* session, const char* snapshot);

/* ---- sessions and regions ---------------------------------------------------- */

/* Opens session `name` in `store`. The session keeps the store open. On
 * failure *out is NULL.
 * Errors: INVALID_ARGUMENT (NULL argument, bad name). */
DVR_EXPORT dvr_status dvr_session_open(dvr_store* store, const char* name, dvr_session** out);

/* Closes a session: forgets its regions and frees those made by dvr_alloc
 * (tracked memory is the caller's and is left alone). Snapshots stay in the
 * store. NULL is allowed and does nothing, and so is a handle from
 * dvr_mpi_local (dvr/dvr_mpi.h), which closes with its dvr_mpi_session. */
DVR_EXPORT void dvr_session_close(dvr_session* session);

/* Registers caller-owned memory [data, data + size) as region `region`. The
 * memory must stay valid until dvr_untrack or dvr_session_close. Snapshots
 * capture it and restores write it back in place.
 * Errors: INVALID_ARGUMENT (NULL argument, bad name, size 0, overlap with
 * another region, memory not all mapped readable and writable),
 * ALREADY_EXISTS (a region of that name exists). Memory in a MAP_SHARED
 * mapping is compared by hashing (docs/incremental.md). */
DVR_EXPORT dvr_status dvr_track(dvr_session* session, const char* region, void* data, size_t size);

/* Allocates an SDK-owned region `region` of `size` bytes, page-aligned and
 * zero-filled, and sets *out to it. It lives until dvr_untrack or
 * dvr_session_close. On failure *out is NULL.
 * Errors: INVALID_ARGUMENT (NULL argument, bad name, size 0), ALREADY_EXISTS,
 * NO_SPACE (the memory cannot be mapped). */
DVR_EXPORT dvr_status dvr_alloc(dvr_session* session, const char* region, size_t size, void** out);

/* Forgets region `region` (and frees it if dvr_alloc made it). Snapshots that
 * recorded it keep it.
 * Errors: NOT_FOUND, INVALID_ARGUMENT (NULL argument). */
DVR_EXPORT dvr_status dvr_untrack(dvr_session* session, const char* region);

/* Captures every region of the session as snapshot `name`, with an optional
 * free-text `label` (NULL = none). Data is persisted before the snapshot
 * becomes visible: after a crash it is either fully there or not at all.
 * Unchanged data costs almost no time or space (only pages written since the
 * last snapshot or restore are read, where the kernel allows tracking them).
 * Errors: ALREADY_EXISTS (a snapshot of that name; remove it first),
 * INVALID_ARGUMENT (NULL argument, bad name, no regions), NO_SPACE (store full:
 * nothing is published, earlier snapshots are intact), IO. */
DVR_EXPORT dvr_status dvr_snapshot(dvr_session* session, const char* name, const char* label);

/* Puts every region recorded in snapshot `name` of this session back,
 * bit-exact. Everything to be copied is checked against its checksum before
 * the first byte of live memory changes: on any error live memory is
 * untouched. Regions the snapshot does not record are left as they are.
 * Errors: NOT_FOUND (no such snapshot), CORRUPT (damaged snapshot data),
 * INVALID_ARGUMENT (NULL argument, bad name, a recorded region that is not in
 * the session or has another size now), IO. */
DVR_EXPORT dvr_status dvr_restore(dvr_session* session, const char* name);

/* A snapshot being taken in the background (dvr_snapshot_background). */
typedef struct dvr_snapshot_job dvr_snapshot_job;

/* Starts snapshot `name` (optional `label`, NULL = none) in the background and
 * returns once every region is write-protected: threads of the library copy
 * the regions into the store while the program runs on, and the program's
 * first write to memory not yet copied waits until it is copied aside, so the
 * snapshot is exactly the memory at the call. It is taken at once instead
 * (dvr_snapshot_job_background says 0, dvr_snapshot_job_note why) when less
 * than a quarter of the memory changed since the last snapshot, when a region
 * is not write-tracked, or when the process may not use a userfaultfd that
 * catches the kernel's writes (root, CAP_SYS_PTRACE,
 * vm.unprivileged_userfaultfd=1 or /dev/userfaultfd). dvr_snapshot,
 * dvr_restore, dvr_track, dvr_alloc and dvr_untrack on the session first wait
 * for it; dvr_session_close cancels it. *job receives a handle, freed with
 * dvr_snapshot_job_free (which does not stop the snapshot); on failure NULL.
 * Errors at the call: ALREADY_EXISTS, INVALID_ARGUMENT (NULL argument, bad
 * name, no regions). Failures while copying are dvr_snapshot_job_wait's. */
DVR_EXPORT dvr_status dvr_snapshot_background(dvr_session* session, const char* name, const char* label, dvr_snapshot_job** job);

/* Waits until the snapshot is published (DVR_OK) or has failed: NO_SPACE, IO,
 * CANCELLED (nothing was published; earlier snapshots are intact). */
DVR_EXPORT dvr_status dvr_snapshot_job_wait(dvr_snapshot_job* job);

/* 1 when it is published, failed or cancelled; 0 while it runs. */
DVR_EXPORT int dvr_snapshot_job_done(const dvr_snapshot_job* job);

/* Region bytes read into the store so far, and in all (NULL = not wanted). */
DVR_EXPORT void dvr_snapshot_job_progress(const dvr_snapshot_job* job, uint64_t* done, uint64_t* total);

/* Asks it to stop; returns at once. When it has not published yet, nothing is
 * published and dvr_snapshot_job_wait returns DVR_E_CANCELLED. */
DVR_EXPORT void dvr_snapshot_job_cancel(dvr_snapshot_job* job);

/* 1 when it runs (ran) in the background, 0 when it was taken at once. */
DVR_EXPORT int dvr_snapshot_job_background(const dvr_snapshot_job* job);

/* Why it was taken at once ("" when it ran in the background). Valid until
 * dvr_snapshot_job_free. */
DVR_EXPORT const char* dvr_snapshot_job_note(const dvr_snapshot_job* job);

/* Seconds the call that started it blocked the caller. */
DVR_EXPORT double dvr_snapshot_job_stall(const dvr_snapshot_job* job);

/* Frees the handle (NULL is ignored). The snapshot goes on. */
DVR_EXPORT void dvr_snapshot_job_free(dvr_snapshot_job* job);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DVR_DVR_H */
