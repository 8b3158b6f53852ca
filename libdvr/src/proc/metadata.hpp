// The metadata of a process snapshot: region dvr-proc.meta of proc/NAME, and
// the snapshot's label. Text, one key=value line each; every key is listed
// in docs/format.md ("Process snapshots"). This is its only reader and writer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dvr/proc.hpp"

namespace dvr::proc::impl {

/// The region of proc/NAME that holds the metadata.
inline constexpr const char* kMetaRegion = "dvr-proc.meta";

/// A CRIU page image stored as windows (proc_pages.hpp) instead of as a region.
struct PagedImage {
  std::string pages;    // its file, pages-ID.img
  std::string pagemap;  // the pagemap image (a region) that lays it out
  std::uint64_t size = 0;
};

struct Meta {
  /// The fields of ProcInfo that are recorded: pid, own_pid_namespace,
  /// criu_version, leave_running, tcp_established, image_bytes, heaps,
  /// files, kernel, command.
  /// (name, time_ns, parent and stored_bytes come from the snapshot itself.)
  ProcInfo info;
  std::vector<std::string> empty_images;  // image files CRIU wrote empty
  std::vector<PagedImage> paged_images;
};

/// The text of dvr-proc.meta (format version 1). A newline in the command
/// becomes a space; no other field may hold a newline, nor a tab before its
/// last one.
std::string encode_meta(const Meta& meta);

/// Parses dvr-proc.meta of process snapshot `name` (meta.info.name = name).
/// Lines without '=' and unknown keys are ignored (a newer dvr may add keys).
/// Throws corrupt (no header, a malformed value) or unsupported (a newer
/// format version).
Meta decode_meta(std::string_view text, const std::string& name);

/// The label of proc/NAME: "process PID: COMMAND" (`dvr ls` shows it; a new
/// dump looks for an earlier one of the same command by it).
std::string label_for(pid_t pid, const std::string& command);
/// The COMMAND of such a label ("" for any other label).
std::string command_of_label(const std::string& label);

}  // namespace dvr::proc::impl
