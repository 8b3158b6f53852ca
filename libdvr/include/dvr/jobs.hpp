// Memory DVR — the registry of running jobs of a store.
//
// What runs against a store announces itself in STORE/run/: `dvr run` for the
// job it starts (kind "run"), `dvr proc dump --every` for its series
// ("dump_every"), and a Session with autosave on (Session::autosave, kind
// "autosave", one record per session of the process). `dvr serve` reads the
// records for /api/v1/jobs and raises alerts from them: a last dump or
// autosave that failed, one that is late (docs/dashboard.md, "Jobs").
//
// Each record is a small JSON file written atomically (a temporary file
// renamed over it): STORE/run/PID.json for a process's job, and
// STORE/run/PID.autosave.SESSION.json for a session's autosave. A record
// whose process is gone (no such PID, or a PID reused by another process: its
// start time differs) is stale; readers skip or remove it. Records are
// advisory: they are not part of any snapshot, not synced, and nothing is
// lost when one cannot be written.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dvr/export.h"

namespace dvr {

/// One job's record (every field is in the file).
struct JobRecord {
  pid_t pid = 0;
  /// The process's start time, field 22 of /proc/PID/stat (clock ticks
  /// since boot): with the PID, it names the process uniquely.
  std::uint64_t start_ticks = 0;
  std::int64_t started_ns = 0;    // wall clock when the record was first written (0: now)
  std::string kind;               // "run", "dump_every" or "autosave"
  std::string session;            // kind "autosave": the session's name; otherwise ""
  std::string command;            // the process's command line, words joined by spaces
  std::string heap;               // the DVR heap file (dvr run --heap), or ""
  double interval_s = 0;          // periodic dumps or autosaves: their interval (0: none)
  std::string last_dump;          // the newest dump's or autosave's reference (proc/NAME, SESSION/NAME), or ""
  std::int64_t last_dump_ns = 0;  // when it was taken (0: none yet)
  std::string last_error;         // the last dump's or autosave's error, or ""
  std::int64_t updated_ns = 0;    // when the record was last written
};

/// The start time of process `pid` (field 22 of /proc/PID/stat), or 0 when
/// there is no such process (a zombie counts as gone).
DVR_EXPORT std::uint64_t process_start_ticks(pid_t pid);

/// The command line of process `pid` (/proc/PID/cmdline, words joined by
/// spaces, at most 4 KiB), or "" when it cannot be read.
DVR_EXPORT std::string process_command(pid_t pid);

/// Whether the record's process still runs (same PID, same start time).
DVR_EXPORT bool job_alive(const JobRecord& r);

/// Writes the record into STORE/run/ (creating run/, mode 0700), atomically,
/// under the file name its pid, kind and session give (see above). Throws
/// dvr::Error (io, naming the file) when it cannot, and invalid_argument for
/// a kind "autosave" record whose session is not a valid session name.
DVR_EXPORT void write_job(const std::string& store_path, const JobRecord& r);

/// Removes the record of process `pid` (kind "autosave": of its `session`);
/// nothing when there is none.
DVR_EXPORT void remove_job(const std::string& store_path, const JobRecord& r);

/// Every record of the store (files named as above, regular files up to 64
/// KiB, read without following links; others are skipped), by PID, then
/// session.
DVR_EXPORT std::vector<JobRecord> read_jobs(const std::string& store_path);

}  // namespace dvr
