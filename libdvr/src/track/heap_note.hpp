// Tracking notes of persistent heaps: what a session that write-tracks a
// region mapped from a heap file (AllocOptions::persistent) leaves beside it
// after each snapshot or restore, STORE/heaps/SESSION/.REGION.track: "in
// process P, the pages of this heap not written since they were
// write-protected equal snapshot S". The CRIU plugin (proc/proc_heaps.hpp)
// reads it to store only the pages written since. Format: criu-plugin/README.md.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <utility>

namespace dvr::detail::heaps {

/// What a session that tracks a persistent region's writes leaves beside it.
struct TrackNote {
  std::uint64_t start_time = 0;       // of the process (/proc/PID/stat field 22)
  std::uint64_t pid_ns = 0;           // inode of its PID namespace
  std::uintptr_t start = 0, end = 0;  // write-tracked whole pages
  std::uintptr_t data = 0;            // where the region is mapped
  std::uint64_t size = 0;
  std::string snapshot;        // the session's base snapshot
  std::uint64_t checksum = 0;  // of that snapshot's manifest
};
std::string note_path(const std::string& heap_file);
/// Writes the note (best effort), for this process unless n.start_time names
/// another (with n.pid_ns).
void write_note(const std::string& heap_file, TrackNote note);
/// The note beside a heap file, if any and well-formed.
bool read_note(const std::string& heap_file, TrackNote& note);
/// Start time and PID-namespace inode of a process (0, 0 if unknown).
std::pair<std::uint64_t, std::uint64_t> identity(pid_t pid);

}  // namespace dvr::detail::heaps
