// Starting a job that can be dumped, restored and cloned: proc::run, PID 1 of
// a PID namespace of its own (dvr/proc.hpp).
#include <fcntl.h>
#include <sched.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "base/os.hpp"
#include "dvr/proc.hpp"

namespace dvr::proc {

pid_t run(const std::vector<std::string>& argv, const RunOptions& options) {
  if (argv.empty()) throw Error(Errc::invalid_argument, "dvr run needs a command: dvr run -- CMD [ARGS...]");
  int out_fd = -1;
  if (!options.output.empty()) {
    out_fd = ::open(options.output.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (out_fd < 0) detail::throw_errno(errno, "cannot open output file " + options.output);
  }
  int report[2];  // the job's PID, or errno of what failed
  if (::pipe2(report, O_CLOEXEC) != 0) {
    int e = errno;
    if (out_fd >= 0) ::close(out_fd);
    detail::throw_errno(e, "cannot create a pipe");
  }
  std::vector<char*> args;
  for (auto& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t middle = ::fork();
  if (middle < 0) {
    int e = errno;
    ::close(report[0]);
    ::close(report[1]);
    if (out_fd >= 0) ::close(out_fd);
    detail::throw_errno(e, "cannot start " + argv[0]);
  }
  if (middle == 0) {
    ::close(report[0]);
    auto fail = [&](int stage) {
      long msg[2] = {-stage, errno};
      (void)!::write(report[1], msg, sizeof msg);
      ::_exit(1);
    };
    if (::unshare(CLONE_NEWPID) != 0) fail(1);
    pid_t job = ::fork();
    if (job < 0) fail(2);
    if (job == 0) {
      // PID 1 of the new namespace, leader of a session of its own.
      ::setsid();
      int null = ::open("/dev/null", O_RDWR);
      if (null < 0) fail(3);
      ::dup2(null, 0);
      ::dup2(out_fd >= 0 ? out_fd : null, 1);
      ::dup2(out_fd >= 0 ? out_fd : null, 2);
      if (null > 2) ::close(null);
      if (!options.cwd.empty() && ::chdir(options.cwd.c_str()) != 0) fail(4);
      // Nothing else of ours stays open in the job (report[1] closes on exec).
      if (report[1] > 3) ::syscall(SYS_close_range, 3u, static_cast<unsigned>(report[1] - 1), 0u);
      ::syscall(SYS_close_range, static_cast<unsigned>(report[1] + 1), ~0u, 0u);
      ::execvp(args[0], args.data());
      fail(5);
    }
    long msg[2] = {job, 0};
    (void)!::write(report[1], msg, sizeof msg);
    ::_exit(0);
  }
  ::close(report[1]);
  if (out_fd >= 0) ::close(out_fd);
  // Two messages may come: the job's PID from the middle process, then (only
  // if exec failed) the job's own failure.
  long first[2] = {0, 0}, second[2] = {0, 0};
  auto read_msg = [&](long* msg) {
    ssize_t n;
    while ((n = ::read(report[0], msg, 2 * sizeof(long))) < 0 && errno == EINTR) {
    }
    return n;
  };
  ssize_t n1 = read_msg(first);
  ssize_t n2 = n1 == sizeof first && first[0] > 0 ? read_msg(second) : 0;
  ::close(report[0]);
  int status = 0;
  ::waitpid(middle, &status, 0);
  auto failure = [&](long stage, long err) {
    std::string w = stage == 1   ? "create a PID namespace (needs root or CAP_SYS_ADMIN)"
                    : stage == 3 ? "open /dev/null"
                    : stage == 4 ? "change to directory " + options.cwd
                    : stage == 5 ? "run '" + argv[0] + "'"
                                 : "start the job";
    throw Error(err == ENOENT                   ? Errc::not_found
                : err == EPERM || err == EACCES ? Errc::permission
                                                : Errc::io,
                "dvr run: cannot " + w + ": " + std::strerror(static_cast<int>(err)));
  };
  if (n1 != sizeof first) throw Error(Errc::io, "dvr run: the job could not be started");
  if (first[0] <= 0) failure(-first[0], first[1]);
  if (n2 == sizeof second) failure(-second[0], second[1]);
  return static_cast<pid_t>(first[0]);
}

}  // namespace dvr::proc
