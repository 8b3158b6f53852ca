// Finding and running CRIU and the DVR CRIU plugin (see criu_runner.hpp);
// plugin_dir() and preflight() of dvr/proc.hpp.
#include "proc/criu_runner.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "base/os.hpp"
#include "dvr/proc.hpp"
#include "proc/proc_heaps.hpp"

extern char** environ;

namespace dvr::proc {

namespace impl {

namespace {

std::string self_dir() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  return dir_of(std::string(buf, static_cast<std::size_t>(n)));
}

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
                const std::function<bool()>& in_child) {
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
  for (;;) {
    ssize_t n = ::read(pipefd[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (output) output->append(buf, static_cast<std::size_t>(n));
  }
  ::close(pipefd[0]);
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
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
    throw Error(Errc::unsupported,
                std::string("cannot ") + verb + ": criu was not found; install CRIU 4.x (./install-deps.sh takes it from Debian 13)");
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

Preflight preflight(const std::string& dir, bool quick) {
  Preflight p;
  p.criu = impl::find_criu();
  if (p.criu.empty()) {
    p.problems.push_back("criu was not found: install CRIU 4.x (./install-deps.sh takes criu from Debian 13)");
  } else {
    p.criu_version = impl::criu_version(p.criu);
    if (p.criu_version.empty() || std::atoi(p.criu_version.c_str()) < 4)
      p.problems.push_back(p.criu + " is version " + (p.criu_version.empty() ? "unknown" : p.criu_version) +
                           ": dvr needs CRIU 4.x (3.x cannot run on kernels >= 6.13); ./install-deps.sh installs it");
    else if (!quick) {
      std::string out;
      if (::geteuid() != 0) {
        p.problems.push_back("not root: CRIU needs root to dump and restore processes");
      } else if (impl::run_capture({p.criu, "check"}, {}, &out) != 0) {
        std::string why;
        std::istringstream in(out);
        std::string line;
        while (std::getline(in, line))
          if (line.find("Error") != std::string::npos && line.find("RLIMIT_NOFILE") == std::string::npos) why += "; " + line;
        p.problems.push_back("`criu check` failed: the kernel lacks features CRIU needs" + why);
      }
    }
  }
  std::string d = dir.empty() ? plugin_dir() : dir;
  if (!d.empty() && is_file(d + "/" + kPluginFile))
    p.plugin = d + "/" + kPluginFile;
  else
    p.problems.push_back(std::string("the DVR CRIU plugin ") + kPluginFile + " was not found" + (d.empty() ? "" : " in " + d) +
                         ": build it (cmake --build) and install it, or set $DVR_CRIU_PLUGIN_DIR to its directory");
  p.ok = p.problems.empty();
  return p;
}

}  // namespace dvr::proc
