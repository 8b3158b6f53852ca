// Finding and running CRIU and the DVR CRIU plugin (see criu_runner.hpp);
// plugin_dir() and preflight() of dvr/proc.hpp.
#include <poll.h>

#include <chrono>

#include "base/log.hpp"
#include "proc/criu_runner.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/sched.h>  // clone_args
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "base/os.hpp"
#include "dvr/proc.hpp"
#include "proc/image_server.hpp"
#include "proc/proc_heaps.hpp"
#include "proc/processes.hpp"
#include "track/dirty.hpp"

extern char** environ;

namespace dvr::proc {

namespace impl {

std::string self_dir() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  return dir_of(std::string(buf, static_cast<std::size_t>(n)));
}

namespace {

// The lines of a CRIU log that say what failed.
std::string criu_errors(const std::string& log_path) {
  std::ifstream in(log_path);
  std::string line, out;
  int n = 0;
  while (std::getline(in, line)) {
    if (line.find("Error") == std::string::npos) continue;
    if (line.find("RLIMIT_NOFILE") != std::string::npos) continue;  // harmless in containers
    if (n++ < 6) out += "\n  " + line;
  }
  return out;
}

}  // namespace

bool is_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string dir_of(const std::string& p) {
  auto k = p.find_last_of('/');
  return k == std::string::npos ? "." : p.substr(0, k);
}

double since(std::chrono::steady_clock::time_point t0) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }

std::string find_criu() {
  if (const char* e = std::getenv("DVR_CRIU"); e && *e) return is_file(e) ? e : "";
  std::string path = std::getenv("PATH") ? std::getenv("PATH") : "";
  path += ":/usr/sbin:/sbin:/usr/local/sbin";
  std::istringstream in(path);
  std::string d;
  while (std::getline(in, d, ':'))
    if (!d.empty() && ::access((d + "/criu").c_str(), X_OK) == 0) return d + "/criu";
  return "";
}

int run_capture(const std::vector<std::string>& argv, const std::vector<std::string>& env_extra, std::string* output,
                const std::function<bool()>& in_child, const std::function<void()>& tick) {
  const auto t0 = std::chrono::steady_clock::now();
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) detail::throw_errno(errno, "cannot create a pipe");
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e)
    env.emplace_back(*e);
  for (auto& x : env_extra) {
    auto key = x.substr(0, x.find('=') + 1);
    std::erase_if(env, [&](const std::string& y) { return y.rfind(key, 0) == 0; });
    env.push_back(x);
  }
  std::vector<char*> args, envp;
  for (auto& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (auto& e : env)
    envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  pid_t child = ::fork();
  if (child < 0) {
    int e = errno;
    ::close(pipefd[0]);
    ::close(pipefd[1]);
    detail::throw_errno(e, "cannot start " + argv[0]);
  }
  if (child == 0) {
    ::dup2(pipefd[1], 1);
    ::dup2(pipefd[1], 2);
    int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, 0);
    if (in_child && !in_child()) ::_exit(126);
    ::execve(args[0], args.data(), envp.data());
    std::string msg = "cannot run " + argv[0] + ": " + std::strerror(errno) + "\n";
    (void)!::write(2, msg.data(), msg.size());
    ::_exit(127);
  }
  ::close(pipefd[1]);
  char buf[4096];
  std::exception_ptr tick_error;
  for (;;) {
    if (tick) {
      // Output or the end of it, or 100 ms: then progress is reported.
      pollfd pfd{pipefd[0], POLLIN, 0};
      int ready = ::poll(&pfd, 1, 100);
      if (ready < 0 && errno != EINTR) break;
      if (ready <= 0) {
        if (!tick_error) try {
            tick();
          } catch (...) {
            tick_error = std::current_exception();  // the program runs to its end; then this is thrown
          }
        continue;
      }
    }
    ssize_t n = ::read(pipefd[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (output) output->append(buf, static_cast<std::size_t>(n));
  }
  ::close(pipefd[0]);
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (detail::log_enabled(LogLevel::info)) {
    std::string line;
    for (auto& a : argv)
      line += (line.empty() ? "" : " ") + a;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    detail::log_write(LogLevel::info, "ran `" + line + "`: exit status " + std::to_string(rc) + " after " + std::to_string(s) + " s");
  }
  if (tick_error) std::rethrow_exception(tick_error);
  return rc;
}

bool streams_pages(const std::string& version) {
  int major = 0, minor = 0;
  std::sscanf(version.c_str(), "%d.%d", &major, &minor);
  const char* files = std::getenv("DVR_PROC_PAGE_IMAGES");
  return (major > 4 || (major == 4 && minor >= 2)) && !(files && std::string(files) == "1");
}

std::string criu_version(const std::string& criu) {
  std::string out;
  if (run_capture({criu, "--version"}, {}, &out) != 0) return "";
  auto k = out.find("Version:");
  if (k == std::string::npos) return "";
  std::string v = out.substr(k + 8);
  v.erase(0, v.find_first_not_of(" \t"));
  return v.substr(0, v.find_first_of(" \t\n"));
}

WorkDir::WorkDir(const std::string& store_path, const std::string& what) {
  std::string base = store_path + "/proc-work";
  detail::make_private_dir(base);
  detail::require_real_dir(base);
  std::random_device rd;
  path = base + "/" + what + "-" + std::to_string(::getpid()) + "-" + std::to_string(rd());
  if (::mkdir(path.c_str(), 0700) != 0) detail::throw_errno(errno, "cannot create work directory " + path);
}

WorkDir::~WorkDir() {
  for (auto& f : detail::list_dir(path))
    ::unlink((path + "/" + f).c_str());
  ::rmdir(path.c_str());
}

std::string WorkDir::keep_log(const std::string& log, const std::string& as) const {
  std::string to = dir_of(path) + "/" + as;
  if (::rename((path + "/" + log).c_str(), to.c_str()) != 0) return path + "/" + log;
  return to;
}

void clean_stale_work(const std::string& store_path) {
  std::string base = store_path + "/proc-work";
  for (auto& d : detail::list_dir(base)) {
    auto a = d.find('-', d.find('-') + 1);  // dump-NAME-PID-RANDOM / restore-NAME-PID-RANDOM
    auto r = d.rfind('-');
    if (a == std::string::npos || r == std::string::npos || r == 0) continue;
    auto p = d.rfind('-', r - 1);
    if (p == std::string::npos) continue;
    long pid = std::strtol(d.c_str() + p + 1, nullptr, 10);
    std::string path = base + "/" + d;
    struct stat st {};
    if (pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH || ::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    for (auto& f : detail::list_dir(path))
      ::unlink((path + "/" + f).c_str());
    ::rmdir(path.c_str());
  }
}

CriuFailure criu_failure(const WorkDir& work, const std::string& log, const std::string& keep_as) {
  CriuFailure f;
  try {
    f.plugin_error = detail::read_file(work.path + "/" + detail::heaps::kErrorName);
  } catch (const Error&) {
  }
  f.errors = criu_errors(work.path + "/" + log);
  f.log = work.keep_log(log, keep_as);
  return f;
}

std::string criu_hint(const std::string& errors) {
  if (errors.find("Can't get 1:16 opt") != std::string::npos || errors.find("Can't get 1:34 opt") != std::string::npos)
    return "\nTCP servers cannot be dumped with CRIU < 4.2 on Linux 6.16 and newer (SO_PASSCRED is refused on inet sockets; "
           "fixed in CRIU 4.2): run install-deps.sh, which builds CRIU 4.2 from Debian's source";
  if (errors.find("Connected TCP socket, consider using") != std::string::npos)
    return "\nthe job has established TCP connections (connected clients): dump it with `dvr proc dump --tcp-established` to "
           "keep them (the clients stay connected and `dvr proc restore` brings the connections back), or disconnect the "
           "clients first";
  if (errors.find("Connected TCP socket in image") != std::string::npos)
    return "\nthe snapshot holds established TCP connections: restore it with --tcp-established";
  if (errors.find("nftables") != std::string::npos)
    return "\n--tcp-established locks the connections with nftables (CRIU's --network-lock nftables): it needs a CRIU built "
           "with libnftables (install-deps.sh builds it so) and nf_tables in the kernel";
  if (errors.find("Can't bind inet socket") != std::string::npos && errors.find("Address already in use") != std::string::npos)
    return "\nthe job's TCP or UDP port is taken on this host (by the running original, for a clone): stop what listens there, "
           "or run the clone in a network namespace of its own (`dvr proc clone NAME --net new`)";
  if (errors.find("ghost file") != std::string::npos)
    return "\na file the job maps (its program or a library) was replaced or deleted since it started; restart the job "
           "from the files as they are now";
  if (errors.find("bad size") != std::string::npos)
    return "\na file the job keeps open changed size since the dump; CRIU reopens open files by path and checks their "
           "size (files opened with O_APPEND are exempt, as `dvr run --output` does)";
  return "";
}

std::string plugin_or_throw(const std::string& dir, const char* verb) {
  std::string d = dir.empty() ? plugin_dir() : dir;
  if (d.empty() || !is_file(d + "/" + kPluginFile))
    throw Error(Errc::unsupported,
                std::string("cannot ") + verb + ": the DVR CRIU plugin " + kPluginFile + " was not found" +
                    (d.empty() ? std::string(" (looked in $DVR_CRIU_PLUGIN_DIR, criu-plugin/ beside dvr and ../lib/dvr/criu)") : " in " + d) +
                    "; build and install it (cmake --install), or point $DVR_CRIU_PLUGIN_DIR at its directory");
  return d;
}

std::pair<std::string, std::string> criu_or_throw(const char* verb) {
  std::string criu = find_criu();
  if (criu.empty())
    throw Error(Errc::unsupported, std::string("cannot ") + verb + ": criu was not found; run install-deps.sh, which installs CRIU >= 4.2");
  std::string v = criu_version(criu);
  if (v.empty() || std::atoi(v.c_str()) < 4)
    throw Error(Errc::unsupported, std::string("cannot ") + verb + ": " + criu + " is version " + (v.empty() ? "unknown" : v) +
                                       "; dvr needs CRIU 4.x (3.x cannot run on kernels >= 6.13); ./install-deps.sh installs it");
  return {criu, v};
}

void require_root(const char* verb) {
  if (::geteuid() != 0)
    throw Error(Errc::permission,
                std::string("cannot ") + verb + ": CRIU needs root (or CAP_CHECKPOINT_RESTORE and CAP_SYS_ADMIN); run dvr proc as root");
}

}  // namespace impl

using impl::is_file;
using impl::kPluginFile;

std::string plugin_dir() {
  if (const char* e = std::getenv("DVR_CRIU_PLUGIN_DIR"); e && *e) return is_file(std::string(e) + "/" + kPluginFile) ? e : "";
  std::string self = impl::self_dir();
  for (std::string d : {self + "/criu-plugin", self + "/" DVR_CRIU_PLUGIN_RELDIR, self + "/../lib/dvr/criu"})
    if (is_file(d + "/" + kPluginFile)) return d;
  return "";
}

namespace {

using impl::criu_errors;
using impl::criu_hint;
using impl::dir_of;
using impl::run_capture;
using impl::since;

// Whether `version` ("4.2.1") is at least major.minor.
bool version_at_least(const std::string& version, int major, int minor) {
  int a = 0, b = 0;
  std::sscanf(version.c_str(), "%d.%d", &a, &b);
  return a > major || (a == major && b >= minor);
}

Capability& add(Preflight& p, std::string name, bool ok, std::string detail, bool required = true) {
  p.capabilities.push_back({std::move(name), ok, required, true, std::move(detail)});
  return p.capabilities.back();
}

void skip(Preflight& p, std::string name, std::string why, bool required = true) {
  p.capabilities.push_back({std::move(name), false, required, false, "not checked: " + std::move(why)});
}

// --- the probes: a tiny process holding TCP sockets, dumped and restored

// A private temporary directory ($TMPDIR, else /tmp), removed with its
// images; CRIU's logs stay when a probe failed (`keep_logs`).
struct ProbeDir {
  std::string path;
  bool keep_logs = false;
  ProbeDir() {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/dvr-check-XXXXXX";
    if (!::mkdtemp(tmpl.data())) detail::throw_errno(errno, "cannot create a temporary directory in " + tmpl);
    path = tmpl;
  }
  ~ProbeDir() {
    bool left = false;
    for (auto& f : detail::list_dir(path)) {
      if (keep_logs && f.size() > 4 && f.compare(f.size() - 4, 4, ".log") == 0) {
        left = true;
        continue;
      }
      ::unlink((path + "/" + f).c_str());
    }
    if (!left) ::rmdir(path.c_str());
  }
  ProbeDir(const ProbeDir&) = delete;
  ProbeDir& operator=(const ProbeDir&) = delete;
};

// What the probe process holds: a TCP socket listening on 127.0.0.1:port and,
// for the established probe, both ends of a connection to it (client, server),
// with one byte sent and not yet read.
struct ProbeSockets {
  detail::Fd listener, client, server;
  int port = 0;
  bool established = false;
};

// A descriptor >= 10 (so that the child can move it to 3, 4, 5), close-on-exec.
detail::Fd high_fd(int fd, const char* what) {
  if (fd < 0) detail::throw_errno(errno, std::string("cannot create ") + what);
  int h = ::fcntl(fd, F_DUPFD_CLOEXEC, 10);
  int e = errno;
  ::close(fd);
  if (h < 0) detail::throw_errno(e, std::string("cannot duplicate ") + what);
  return detail::Fd(h);
}

sockaddr_in loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

ProbeSockets make_sockets(bool established) {
  ProbeSockets s;
  s.listener = high_fd(::socket(AF_INET, SOCK_STREAM, 0), "a TCP socket");
  sockaddr_in a = loopback(0);
  socklen_t len = sizeof a;
  if (::bind(s.listener.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(s.listener.get(), 8) != 0 ||
      ::getsockname(s.listener.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0)
    detail::throw_errno(errno, "cannot listen on 127.0.0.1");
  s.port = ntohs(a.sin_port);
  s.established = established;
  if (!established) return s;
  s.client = high_fd(::socket(AF_INET, SOCK_STREAM, 0), "a TCP socket");
  if (::connect(s.client.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) detail::throw_errno(errno, "cannot connect to 127.0.0.1");
  s.server = high_fd(::accept(s.listener.get(), nullptr, nullptr), "an accepted TCP connection");
  if (::write(s.client.get(), "q", 1) != 1) detail::throw_errno(errno, "cannot write to a TCP connection");
  return s;
}

// Starts `sleep` as PID 1 of a PID namespace of its own (as `dvr run` does),
// leading a session of its own, holding the sockets as descriptors 3, 4, 5
// and nothing else, and gives them to it (ours are closed: a dumped
// process's sockets must go with it); returns its PID once it runs sleep.
// (`sleep` rather than a copy of this process: the probe's images stay tiny
// whatever the caller holds.)
pid_t start_probe_process(ProbeSockets& s) {
  std::string sleep_bin = is_file("/usr/bin/sleep") ? "/usr/bin/sleep" : "/bin/sleep";
  const char* argv[] = {sleep_bin.c_str(), "600", nullptr};
  clone_args ca{};
  ca.flags = CLONE_NEWPID;
  ca.exit_signal = SIGCHLD;
  long pid = ::syscall(SYS_clone3, &ca, sizeof ca);
  if (pid < 0) detail::throw_errno(errno, "cannot start a process in a new PID namespace");
  if (pid == 0) {
    ::setsid();
    int null = ::open("/dev/null", O_RDWR);
    if (null < 0) ::_exit(126);
    ::dup2(null, 0);
    ::dup2(null, 1);
    ::dup2(null, 2);
    ::dup2(s.listener.get(), 3);
    if (s.client) ::dup2(s.client.get(), 4);
    if (s.server) ::dup2(s.server.get(), 5);
    ::syscall(SYS_close_range, s.client ? 6u : 4u, ~0u, 0u);
    ::execv(argv[0], const_cast<char* const*>(argv));
    ::_exit(127);
  }
  s.listener = detail::Fd();
  s.client = detail::Fd();
  s.server = detail::Fd();
  for (int k = 0; k < 500 && impl::read_proc(static_cast<pid_t>(pid), "comm").rfind("sleep", 0) != 0; ++k)
    ::usleep(2000);
  return static_cast<pid_t>(pid);
}

// Waits (up to 10 s) until `pid` is gone or a zombie; reaps it if it is our child.
void wait_dead(pid_t pid, bool child) {
  if (child) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return;
  }
  for (int k = 0; k < 1000; ++k) {
    std::string stat = impl::read_proc(pid, "stat");
    auto r = stat.rfind(')');
    if (stat.empty() || r == std::string::npos || r + 2 >= stat.size() || stat[r + 2] == 'Z' || stat[r + 2] == 'X') return;
    ::usleep(10000);
  }
}

// Reads one byte from `fd` within 5 s; -1 if none came.
int read_byte(int fd) {
  pollfd pf{fd, POLLIN, 0};
  if (::poll(&pf, 1, 5000) != 1) return -1;
  unsigned char c = 0;
  return ::read(fd, &c, 1) == 1 ? c : -1;
}

// After the restore: the listening socket accepts connections on its port,
// and the established connection (taken from the restored process with
// pidfd_getfd) delivers the byte queued before the dump, then a new one.
std::string check_restored(pid_t pid, const ProbeSockets& s) {
  detail::Fd c(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a = loopback(s.port);
  if (!c || ::connect(c.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    return "the restored process does not listen on 127.0.0.1:" + std::to_string(s.port) + " (" + std::strerror(errno) + ")";
  if (!s.established) return "";
  detail::Fd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!pidfd) return std::string("cannot reach the restored process's sockets (pidfd_open: ") + std::strerror(errno) + ")";
  detail::Fd client(static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd.get(), 4, 0)));
  detail::Fd server(static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd.get(), 5, 0)));
  if (!client || !server) return std::string("cannot reach the restored process's sockets (pidfd_getfd: ") + std::strerror(errno) + ")";
  if (read_byte(server.get()) != 'q') return "the restored connection lost the byte queued in it before the dump";
  if (::write(client.get(), "e", 1) != 1 || read_byte(server.get()) != 'e') return "the restored connection does not carry data";
  return "";
}

// Dumps (killing it) and restores a probe process; "" when it came back
// working, else what failed (CRIU's errors and where its log is).
std::string probe(const std::string& criu, const std::string& plugin, bool established, const std::string& options_note) {
  ProbeDir dir;
  ProbeSockets s = make_sockets(established);
  std::vector<std::string> tcp;
  if (established) tcp = {"--tcp-established", "--network-lock", "nftables"};
  std::vector<std::string> libdir;
  if (!plugin.empty()) libdir = {"--libdir", dir_of(plugin)};
  pid_t pid = start_probe_process(s);
  std::string out;
  std::vector<std::string> argv = {criu, "dump", "-t", std::to_string(pid), "-D", dir.path, "-o", "dump.log", "-v2"};
  argv.insert(argv.end(), tcp.begin(), tcp.end());
  argv.insert(argv.end(), libdir.begin(), libdir.end());
  int rc = run_capture(argv, {}, &out);
  ::kill(pid, SIGKILL);  // CRIU killed it after a dump; not after a failure
  wait_dead(pid, true);
  auto failed = [&](const char* what, const std::string& log) {
    dir.keep_logs = true;
    std::string errors = criu_errors(dir.path + "/" + log);
    std::string hint = criu_hint(errors);
    return std::string("criu ") + what + options_note + " failed:" + (errors.empty() ? " " + out : errors) +
           (hint.empty() ? "" : "\n " + hint.substr(1)) + "\n  full log: " + dir.path + "/" + log;
  };
  if (rc != 0) return failed("dump", "dump.log");
  const std::string pidfile = dir.path + "/restored.pid";
  argv = {criu, "restore", "-D", dir.path, "-o", "restore.log", "-v2", "--restore-detached", "--pidfile", pidfile};
  argv.insert(argv.end(), tcp.begin(), tcp.end());
  argv.insert(argv.end(), libdir.begin(), libdir.end());
  out.clear();
  if (run_capture(argv, {}, &out) != 0) return failed("restore", "restore.log");
  pid_t restored = 0;
  try {
    restored = static_cast<pid_t>(std::stol(detail::read_file(pidfile)));
  } catch (const std::exception&) {
    return "criu restore wrote no PID file";
  }
  std::string why = check_restored(restored, s);
  ::kill(restored, SIGKILL);
  wait_dead(restored, false);
  return why;
}

// The two probes, each a capability.
void probe_tcp(Preflight& p, const std::string& criu, const std::string& plugin) {
  auto t0 = std::chrono::steady_clock::now();
  std::string why;
  try {
    why = probe(criu, plugin, false, "");
  } catch (const Error& e) {
    why = e.what();
  }
  char took[32];
  std::snprintf(took, sizeof took, " (%.2f s)", since(t0));
  if (why.empty())
    add(p, "tcp listen", true, "a process listening on TCP 127.0.0.1 was dumped and restored, and accepts connections again" + std::string(took));
  else
    add(p, "tcp listen", false, "a process listening on TCP 127.0.0.1 could not be dumped and restored (nor can TCP servers): " + why);
  if (!why.empty()) {
    skip(p, "tcp established", "the listening probe failed", false);
    return;
  }
  t0 = std::chrono::steady_clock::now();
  try {
    why = probe(criu, plugin, true, " --tcp-established");
  } catch (const Error& e) {
    why = e.what();
  }
  std::snprintf(took, sizeof took, " (%.2f s)", since(t0));
  if (why.empty())
    add(p, "tcp established", true,
        "a process holding an established TCP connection was dumped and restored with --tcp-established, the connection intact" + std::string(took),
        false);
  else
    add(p, "tcp established", false,
        "`dvr proc dump --tcp-established` will fail (dumps without it are not affected): " + why +
            "\n  it needs a CRIU built with libnftables (install-deps.sh builds it so), and nf_tables and TCP repair in the kernel",
        false);
}

}  // namespace

Preflight preflight(const std::string& dir, bool quick) {
  Preflight p;
  const bool root = ::geteuid() == 0;
  if (root)
    add(p, "root", true, "running as root");
  else
    add(p, "root", false, "not root: CRIU needs root (or CAP_CHECKPOINT_RESTORE and CAP_SYS_ADMIN); run dvr proc as root");

  // CRIU itself.
  p.criu = impl::find_criu();
  bool criu_ok = false;
  if (p.criu.empty()) {
    add(p, "criu", false, "criu was not found: run install-deps.sh, which installs CRIU >= 4.2 (or set $DVR_CRIU to its path)");
  } else {
    p.criu_version = impl::criu_version(p.criu);
    criu_ok = !p.criu_version.empty() && std::atoi(p.criu_version.c_str()) >= 4;
    if (criu_ok)
      add(p, "criu", true, p.criu + " " + p.criu_version);
    else
      add(p, "criu", false,
          p.criu + " is version " + (p.criu_version.empty() ? "unknown" : p.criu_version) +
              ": dvr needs CRIU 4.x, 4.2 or newer on Linux >= 6.16 (3.x cannot run on kernels >= 6.13); run install-deps.sh");
  }

  // The kernel's features (`criu check`).
  const std::string kernel = impl::kernel_release();
  if (!criu_ok) {
    skip(p, "kernel", "needs CRIU 4.x");
  } else if (!root) {
    skip(p, "kernel", "`criu check` needs root");
  } else if (quick) {
    skip(p, "kernel", "quick check");
  } else {
    std::string out;
    if (impl::run_capture({p.criu, "check"}, {}, &out) == 0) {
      add(p, "kernel", true, "Linux " + kernel + ": `criu check` finds every feature CRIU needs");
    } else {
      std::string why;
      std::istringstream in(out);
      std::string line;
      while (std::getline(in, line))
        if (line.find("Error") != std::string::npos && line.find("RLIMIT_NOFILE") == std::string::npos) why += "; " + line;
      add(p, "kernel", false, "`criu check` failed: Linux " + kernel + " lacks features CRIU needs" + why);
    }
  }

  // The plugin.
  std::string d = dir.empty() ? plugin_dir() : dir;
  if (!d.empty() && is_file(d + "/" + kPluginFile)) {
    p.plugin = d + "/" + kPluginFile;
    add(p, "plugin", true, p.plugin);
  } else {
    add(p, "plugin", false,
        std::string("the DVR CRIU plugin ") + kPluginFile + " was not found" + (d.empty() ? "" : " in " + d) +
            ": build it (cmake --build) and install it, or set $DVR_CRIU_PLUGIN_DIR to its directory");
  }

  // TCP and UDP sockets: Linux 6.16 refuses SO_PASSCRED on them, which CRIU
  // < 4.2 asks for; then the real thing.
  int kmajor = 0, kminor = 0;
  std::sscanf(kernel.c_str(), "%d.%d", &kmajor, &kminor);
  const bool new_kernel = kmajor > 6 || (kmajor == 6 && kminor >= 16);
  if (!criu_ok)
    skip(p, "inet sockets", "needs CRIU 4.x");
  else if (new_kernel && !version_at_least(p.criu_version, 4, 2))
    add(p, "inet sockets", false,
        "TCP servers cannot be dumped with CRIU < 4.2 on this kernel (Linux " + kernel + " refuses SO_PASSCRED on inet sockets; CRIU " +
            p.criu_version + " asks for it); run install-deps.sh, which builds CRIU 4.2 from Debian's source");
  else
    add(p, "inet sockets", true, "CRIU " + p.criu_version + " on Linux " + kernel + " can dump TCP and UDP sockets");
  if (!criu_ok)
    skip(p, "tcp listen", "needs CRIU 4.x"), skip(p, "tcp established", "needs CRIU 4.x", false);
  else if (!root)
    skip(p, "tcp listen", "the probe needs root"), skip(p, "tcp established", "the probe needs root", false);
  else if (quick)
    skip(p, "tcp listen", "quick check"), skip(p, "tcp established", "quick check", false);
  else
    probe_tcp(p, p.criu, p.plugin);

  // What makes dumps cheaper, without which they still work.
  if (!criu_ok)
    skip(p, "page stream", "needs CRIU 4.x", false);
  else if (impl::streams_pages(p.criu_version))
    add(p, "page stream", true, "CRIU " + p.criu_version + " passes pages straight between the store and CRIU (page server, image streamer)", false);
  else if (version_at_least(p.criu_version, 4, 2))
    add(p, "page stream", false, "$DVR_PROC_PAGE_IMAGES=1: page images go through files (slower, and the space twice)", false);
  else
    add(p, "page stream", false,
        "CRIU " + p.criu_version + " < 4.2 writes page images to files first (slower, and the space twice); run install-deps.sh", false);
  std::string why;
  if (!criu_ok || !impl::streams_pages(p.criu_version))
    skip(p, "page fill", "needs the page stream", false);
  else if (impl::ImageServer::fill_supported(&why))
    add(p, "page fill", true, "restore writes a job's private memory into it on every CPU (process_vm_writev, /proc/PID/mem)", false);
  else
    add(p, "page fill", false, why + "; restores hand every page to CRIU through a pipe instead (slower)", false);
  if (detail::WriteTracker::open(&why))
    add(p, "write tracking", true, "userfaultfd write-protection and PAGEMAP_SCAN: dumps store only the heap pages written since a snapshot", false);
  else
    add(p, "write tracking", false, why + "; dumps of DVR heaps compare every page by hash instead (slower; Linux >= 6.7 has it)", false);

  for (auto& c : p.capabilities)
    if (c.required && !c.ok && c.checked) p.problems.push_back(c.detail);
  p.ok = p.problems.empty();
  return p;
}

}  // namespace dvr::proc
