// What /proc says about live processes and this host, for `dvr proc`.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "dvr/proc.hpp"

namespace dvr::proc::impl {

/// The contents of /proc/PID/WHAT ("" if it cannot be read).
std::string read_proc(pid_t pid, const char* what);

/// The command line of a process, its arguments joined by spaces (else its
/// comm).
std::string command_line(pid_t pid);

/// Its comm, for messages (at most 64 characters).
std::string comm_of(pid_t pid);

/// A process and all its descendants (from /proc/PID/task/TID/children).
std::vector<pid_t> process_tree(pid_t root);
void signal_tree(const std::vector<pid_t>& tree, int sig);
/// Waits until every process of `tree` has exited (gone or a zombie: its
/// files and sockets are closed, so a restore can bind its ports again), at
/// most `limit`.
void wait_exited(const std::vector<pid_t>& tree, std::chrono::milliseconds limit);

/// True when `pid` is PID 1 of a PID namespace of its own (a `dvr run` job).
bool in_own_pid_namespace(pid_t pid);

/// `uname -r`.
std::string kernel_release();

/// The programs and libraries the processes map (not heaps, devices or
/// deleted files), with what identifies their content well enough for CRIU.
std::vector<MappedFile> mapped_files(const std::vector<pid_t>& tree);

}  // namespace dvr::proc::impl
