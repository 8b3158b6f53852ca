// The registry of running jobs: `dvr run` and `dvr proc dump --every` write
// STORE/run/PID.json (atomically: a temporary file renamed over it) while
// they run, and `dvr serve` reads it for /api/v1/jobs and its alerts
// (docs/dashboard.md, "Jobs"). A record whose process is gone (no such PID,
// or a PID reused by another process: its start time differs) is stale.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dvr::server {

/// One job's record (STORE/run/PID.json; every field is in the file).
struct JobRecord {
  pid_t pid = 0;
  /// The process's start time, field 22 of /proc/PID/stat (clock ticks
  /// since boot): with the PID, it names the process uniquely.
  std::uint64_t start_ticks = 0;
  std::int64_t started_ns = 0;        // wall clock when the record was first written
  std::string kind;                   // "run" (dvr run) or "dump_every" (dvr proc dump --every)
  std::string command;                // the job's command line, words joined by spaces
  std::string heap;                   // the DVR heap file (dvr run --heap), or ""
  double interval_s = 0;              // periodic dumps: their interval (0: none)
  std::string last_dump;              // the newest dump's name (proc/NAME), or ""
  std::int64_t last_dump_ns = 0;      // when it was taken (0: none yet)
  std::string last_error;             // the last dump's error, or ""
  std::int64_t updated_ns = 0;        // when the record was last written
};

/// The start time of process `pid` (field 22 of /proc/PID/stat), or 0 when
/// there is no such process (a zombie counts as gone).
std::uint64_t process_start_ticks(pid_t pid);

/// Whether the record's process still runs (same PID, same start time).
bool job_alive(const JobRecord& r);

/// Writes STORE/run/PID.json (creating run/, mode 0700), atomically.
/// Throws dvr::Error (io, naming the file) when it cannot.
void write_job(const std::string& store_path, const JobRecord& r);

/// Removes STORE/run/PID.json; nothing when there is none.
void remove_job(const std::string& store_path, pid_t pid);

/// Every record of the store (files named PID.json, regular files up to 64
/// KiB, read without following links; others are skipped), by PID.
std::vector<JobRecord> read_jobs(const std::string& store_path);

}  // namespace dvr::server
