// Finding and running CRIU and the DVR CRIU plugin for `dvr proc`, and the
// private work directories their images pass through.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace dvr::proc::impl {

/// The plugin's file name, in plugin_dir().
inline constexpr const char* kPluginFile = "dvr_criu.so";

bool is_file(const std::string& path);
/// The directory part of `path` ("." for none).
std::string dir_of(const std::string& path);
/// The directory of the running program ("." if it cannot be told).
std::string self_dir();
/// Seconds since t0.
double since(std::chrono::steady_clock::time_point t0);

/// The criu binary: $DVR_CRIU, else criu on $PATH or in the sbin
/// directories; "" if none.
std::string find_criu();
/// `criu --version`'s version ("4.1.1"), "" if it cannot be told.
std::string criu_version(const std::string& criu);

/// Runs argv with stdout and stderr captured (merged) into *output;
/// `env_extra` ("KEY=VALUE") replace or add to the environment; `in_child`
/// runs in the child before exec (false: exit 126). Returns the exit status
/// (128+N for signal N). `tick`, when given, is called on this thread about
/// every 100 ms while the program runs (progress; what it throws is
/// propagated once the program has exited). Each run is logged at info: the
/// command line, how long it took and its exit status.
int run_capture(const std::vector<std::string>& argv, const std::vector<std::string>& env_extra, std::string* output,
                const std::function<bool()>& in_child = {}, const std::function<void()>& tick = {});

/// Whether CRIU `version` ("4.2.1") passes pages to dvr directly: its page
/// server at dump and its image streamer at restore (CRIU >= 4.2), unless
/// $DVR_PROC_PAGE_IMAGES=1 asks for page image files (to compare, or as a
/// way around a CRIU problem). Otherwise images go through files.
bool streams_pages(const std::string& version);

/// Throws permission unless root; `verb` says what was asked ("dump a process").
void require_root(const char* verb);
/// The criu binary and its version; throws unsupported for none or one older than 4.x.
std::pair<std::string, std::string> criu_or_throw(const char* verb);
/// The plugin's directory (`dir`, or plugin_dir() for ""); throws unsupported without it.
std::string plugin_or_throw(const std::string& dir, const char* verb);

/// A work directory for CRIU images, STORE/proc-work/WHAT-PID-RANDOM, private
/// to the owner, removed with everything in it on destruction.
struct WorkDir {
  std::string path;
  WorkDir(const std::string& store_path, const std::string& what);
  ~WorkDir();
  WorkDir(const WorkDir&) = delete;
  WorkDir& operator=(const WorkDir&) = delete;
  /// Keeps CRIU's log `log` where an operator can read it (STORE/proc-work/AS);
  /// returns its new path.
  std::string keep_log(const std::string& log, const std::string& as) const;
};

/// Removes work directories left by a dvr that was killed midway (its PID in
/// the name is gone): full images, worth removing.
void clean_stale_work(const std::string& store_path);

/// After CRIU failed: the plugin's reason (if it gave one), the error lines of
/// CRIU's log, and where the log is kept for the operator.
struct CriuFailure {
  std::string plugin_error, errors, log;
};
CriuFailure criu_failure(const WorkDir& work, const std::string& log, const std::string& keep_as);

/// What to add to CRIU's errors when a known cause shows in them ("" if none).
std::string criu_hint(const std::string& errors);

}  // namespace dvr::proc::impl
