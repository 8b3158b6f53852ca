// Memory DVR — whole-process snapshots with CRIU (see dvr/proc.hpp, docs/criu.md).
#include "dvr/proc.hpp"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <random>
#include <sstream>

#include "dvr/clone.hpp"
#include "dvr/session.hpp"
#include "base/os.hpp"
#include "proc/proc_heaps.hpp"
#include "proc/proc_pages.hpp"
#include "store/store_impl.hpp"

extern char** environ;

namespace dvr::proc {

namespace {

using detail::Fd;
namespace heaps = detail::heaps;
namespace procpages = detail::procpages;

constexpr const char* kMetaRegion = "dvr-proc.meta";
constexpr const char* kPluginFile = "dvr_criu.so";

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool is_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string dir_of(const std::string& p) {
  auto k = p.find_last_of('/');
  return k == std::string::npos ? "." : p.substr(0, k);
}

std::string self_dir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  return dir_of(std::string(buf, static_cast<std::size_t>(n)));
}

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

// Runs argv with stdout and stderr captured (merged); `in_child` runs in the
// child before exec. Returns the exit status (128+N for signal N).
int run_capture(const std::vector<std::string>& argv, const std::vector<std::string>& env_extra, std::string* output,
                const std::function<bool()>& in_child = {}) {
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) detail::throw_errno(errno, "cannot create a pipe");
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  for (auto& x : env_extra) {
    auto key = x.substr(0, x.find('=') + 1);
    std::erase_if(env, [&](const std::string& y) { return y.rfind(key, 0) == 0; });
    env.push_back(x);
  }
  std::vector<char*> args, envp;
  for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
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

std::string criu_version(const std::string& criu) {
  std::string out;
  if (run_capture({criu, "--version"}, {}, &out) != 0) return "";
  auto k = out.find("Version:");
  if (k == std::string::npos) return "";
  std::string v = out.substr(k + 8);
  v.erase(0, v.find_first_not_of(" \t"));
  return v.substr(0, v.find_first_of(" \t\n"));
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

std::string read_proc_path(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string read_proc(pid_t pid, const char* what) { return read_proc_path("/proc/" + std::to_string(pid) + "/" + what); }

// Work directory for CRIU images, private to the owner, removed on destruction.
struct WorkDir {
  std::string path;
  explicit WorkDir(const std::string& store_path, const std::string& what) {
    std::string base = store_path + "/proc-work";
    detail::make_private_dir(base);
    detail::require_real_dir(base);
    std::random_device rd;
    path = base + "/" + what + "-" + std::to_string(::getpid()) + "-" + std::to_string(rd());
    if (::mkdir(path.c_str(), 0700) != 0) detail::throw_errno(errno, "cannot create work directory " + path);
  }
  ~WorkDir() {
    for (auto& f : detail::list_dir(path)) ::unlink((path + "/" + f).c_str());
    ::rmdir(path.c_str());
  }
  // Keeps CRIU's log where an operator can read it; returns its new path.
  std::string keep_log(const std::string& log, const std::string& as) const {
    std::string to = dir_of(path) + "/" + as;
    if (::rename((path + "/" + log).c_str(), to.c_str()) != 0) return path + "/" + log;
    return to;
  }
};

// A mapping of a whole file, unmapped on destruction.
struct Map {
  void* p = MAP_FAILED;
  std::size_t n = 0;
  Map(int fd, std::size_t len, int prot, int flags, const std::string& what) : n(len) {
    p = ::mmap(nullptr, len, prot, flags, fd, 0);
    if (p == MAP_FAILED) detail::throw_errno(errno, "cannot map " + what);
  }
  ~Map() {
    if (p != MAP_FAILED) ::munmap(p, n);
  }
  Map(const Map&) = delete;
  Map& operator=(const Map&) = delete;
};

// After CRIU failed: the plugin's reason (if it gave one), the error lines of
// CRIU's log, and where the log is kept for the operator.
struct CriuFailure {
  std::string plugin_error, errors, log;
};
CriuFailure criu_failure(const WorkDir& work, const std::string& log, const std::string& keep_as) {
  CriuFailure f;
  try {
    f.plugin_error = detail::read_file(work.path + "/" + heaps::kErrorName);
  } catch (const Error&) {
  }
  f.errors = criu_errors(work.path + "/" + log);
  f.log = work.keep_log(log, keep_as);
  return f;
}

// key=value lines (values may hold anything but a newline).
std::string format_meta(const ProcInfo& p) {
  std::ostringstream o;
  o << "dvr-proc 1\n"
    << "pid=" << p.pid << "\n"
    << "own_pid_namespace=" << (p.own_pid_namespace ? 1 : 0) << "\n"
    << "criu_version=" << p.criu_version << "\n"
    << "leave_running=" << (p.leave_running ? 1 : 0) << "\n"
    << "image_bytes=" << p.image_bytes << "\n";
  for (auto& h : p.heaps) o << "heap=" << h.bytes << "\t" << h.store << "\t" << h.session << "\t" << h.path << "\n";
  for (auto& f : p.files) o << "file=" << f.size << "\t" << f.mtime_ns << "\t" << f.path << "\n";
  o << "kernel=" << p.kernel << "\n";
  std::string cmd = p.command;
  std::replace(cmd.begin(), cmd.end(), '\n', ' ');
  o << "command=" << cmd << "\n";
  return o.str();
}

void parse_meta(const std::string& text, ProcInfo& p) {
  std::istringstream in(text);
  std::string line;
  if (!std::getline(in, line) || line.rfind("dvr-proc ", 0) != 0)
    throw Error(Errc::corrupt, "process snapshot '" + p.name + "' has no valid metadata");
  if (line != "dvr-proc 1")
    throw Error(Errc::unsupported, "process snapshot '" + p.name + "' was written by a newer dvr (" + line + ")");
  while (std::getline(in, line)) {
    auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    std::string k = line.substr(0, eq), v = line.substr(eq + 1);
    try {
      if (k == "pid") p.pid = static_cast<pid_t>(std::stol(v));
      else if (k == "own_pid_namespace") p.own_pid_namespace = v == "1";
      else if (k == "criu_version") p.criu_version = v;
      else if (k == "leave_running") p.leave_running = v == "1";
      else if (k == "image_bytes") p.image_bytes = std::stoull(v);
      else if (k == "command") p.command = v;
      else if (k == "kernel") p.kernel = v;
      else if (k == "file") {
        auto t1 = v.find('\t'), t2 = v.find('\t', t1 + 1);
        if (t1 == std::string::npos || t2 == std::string::npos) throw std::invalid_argument("file");
        p.files.push_back({v.substr(t2 + 1), std::stoull(v.substr(0, t1)), std::stoll(v.substr(t1 + 1, t2 - t1 - 1))});
      }
      else if (k == "heap") {
        auto t1 = v.find('\t'), t2 = v.find('\t', t1 + 1), t3 = v.find('\t', t2 + 1);
        if (t1 == std::string::npos || t2 == std::string::npos || t3 == std::string::npos) throw std::invalid_argument("heap");
        p.heaps.push_back({v.substr(t3 + 1), std::stoull(v.substr(0, t1)), v.substr(t1 + 1, t2 - t1 - 1), v.substr(t2 + 1, t3 - t2 - 1)});
      }
    } catch (const std::exception&) {
      throw Error(Errc::corrupt, "process snapshot '" + p.name + "' has damaged metadata (" + k + ")");
    }
  }
}

heaps::HeapImage heap_image(const ProcInfo& p);
std::uint64_t heap_bytes(const Store& store, const ProcInfo& p);

ProcInfo read_info(const Store& store, const SnapshotInfo& si, bool verify) {
  ProcInfo p;
  p.name = si.name;
  p.time_ns = si.time_ns;
  p.parent = si.parent;
  p.stored_bytes = si.stored_bytes;
  if (si.damaged) throw Error(Errc::corrupt, "process snapshot '" + si.name + "' is damaged: " + si.damage);
  Clone c = store.open_snapshot(kImageSession, si.name, {.verify = verify});
  Region& meta = c.region(kMetaRegion);
  parse_meta(std::string(static_cast<const char*>(meta.data()), meta.size()), p);
  p.stored_bytes += heap_bytes(store, p);
  return p;
}

// A process and all its descendants (from /proc/PID/task/TID/children).
std::vector<pid_t> process_tree(pid_t root) {
  std::vector<pid_t> out{root};
  for (std::size_t k = 0; k < out.size() && out.size() < 100000; ++k) {
    std::string task = "/proc/" + std::to_string(out[k]) + "/task";
    for (auto& tid : detail::list_dir(task)) {
      std::istringstream in(read_proc_path(task + "/" + tid + "/children"));
      for (long c; in >> c;)
        if (std::find(out.begin(), out.end(), static_cast<pid_t>(c)) == out.end()) out.push_back(static_cast<pid_t>(c));
    }
  }
  return out;
}

void signal_tree(const std::vector<pid_t>& tree, int sig) {
  for (pid_t p : tree) ::kill(p, sig);
}

std::string kernel_release() {
  struct utsname u {};
  return ::uname(&u) == 0 ? u.release : "";
}

// The programs and libraries the processes map (not heaps, devices or
// deleted files), with what identifies their content well enough for CRIU.
std::vector<MappedFile> mapped_files(const std::vector<pid_t>& tree) {
  std::vector<MappedFile> out;
  auto add = [&](const std::string& path) {
    if (path.empty() || path[0] != '/' || path.find(" (deleted)") != std::string::npos) return;
    for (const char* skip : {"/proc/", "/sys/", "/memfd:"})  // devices fail S_ISREG below
      if (path.rfind(skip, 0) == 0) return;
    if (!heaps::store_of_heap(path).empty()) return;
    if (std::any_of(out.begin(), out.end(), [&](const MappedFile& f) { return f.path == path; })) return;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
    out.push_back({path, static_cast<std::uint64_t>(st.st_size), st.st_mtim.tv_sec * 1000000000ll + st.st_mtim.tv_nsec});
  };
  for (pid_t p : tree) {
    char buf[4096];
    ssize_t n = ::readlink(("/proc/" + std::to_string(p) + "/exe").c_str(), buf, sizeof buf - 1);
    if (n > 0) add(std::string(buf, static_cast<std::size_t>(n)));
    std::istringstream maps(read_proc(p, "maps"));
    std::string line;
    while (std::getline(maps, line)) {
      auto slash = line.find(" /");
      if (slash != std::string::npos && line.find("rw-s") == std::string::npos) add(line.substr(slash + 1));
    }
  }
  return out;
}

// Work directories left by a dvr that was killed midway (its PID is in the
// name and is gone): full images, worth removing.
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
    for (auto& f : detail::list_dir(path)) ::unlink((path + "/" + f).c_str());
    ::rmdir(path.c_str());
  }
}

// The label of proc/NAME: "process PID: COMMAND" (`dvr ls` shows it; a new
// dump looks for an earlier one of the same command by it).
std::string label_for(pid_t pid, const std::string& command) { return "process " + std::to_string(pid) + ": " + command; }
std::string command_of_label(const std::string& label) {
  auto k = label.find(": ");
  return label.rfind("process ", 0) == 0 && k != std::string::npos ? label.substr(k + 2) : std::string();
}

heaps::HeapImage heap_image(const ProcInfo& p) {
  heaps::HeapImage img;
  img.snapshot = kHeapPrefix + p.name;
  for (auto& h : p.heaps) img.heaps.push_back({h.store, h.session, "", h.path, h.bytes});
  return img;
}

// Where each heap snapshot of `p` is: this store when it holds it (it came
// here with the process snapshot), else the heap's own store.
heaps::HeapImage heap_image_in(const Store& store, const ProcInfo& p) {
  heaps::HeapImage img = heap_image(p);
  for (auto& h : img.heaps) h.store = heaps::heap_store(h, img.snapshot, store.path());
  return img;
}

// Bytes the heap snapshots of a process snapshot added to their stores.
std::uint64_t heap_bytes(const Store& store, const ProcInfo& p) {
  std::uint64_t n = 0;
  std::vector<std::pair<std::string, std::string>> seen;
  heaps::HeapImage img = heap_image_in(store, p);
  for (auto& h : img.heaps) {
    if (std::find(seen.begin(), seen.end(), std::make_pair(h.store, h.session)) != seen.end()) continue;
    seen.emplace_back(h.store, h.session);
    try {
      n += Store::open(h.store, {.create = false}).info(h.session, img.snapshot).stored_bytes;
    } catch (const Error&) {
    }
  }
  return n;
}

std::string comm_of(pid_t pid) {
  std::string c = read_proc(pid, "comm");
  while (!c.empty() && (c.back() == '\n' || c.back() == ' ')) c.pop_back();
  return c.substr(0, 64);
}

// What to add to CRIU's errors when a known cause shows in them.
std::string criu_hint(const std::string& errors) {
  if (errors.find("Can't get 1:16 opt") != std::string::npos || errors.find("Can't get 1:34 opt") != std::string::npos)
    return "\nCRIU 4.1 cannot dump TCP or UDP sockets on Linux 6.16 and newer (SO_PASSCRED is refused on them; fixed in "
           "CRIU 4.2): close the job's network sockets before dumping, or serve over a Unix socket";
  if (errors.find("ghost file") != std::string::npos)
    return "\na file the job maps (its program or a library) was replaced or deleted since it started; restart the job "
           "from the files as they are now";
  if (errors.find("bad size") != std::string::npos)
    return "\na file the job keeps open changed size since the dump; CRIU reopens open files by path and checks their "
           "size (files opened with O_APPEND are exempt, as `dvr run --output` does)";
  return "";
}

bool in_own_pid_namespace(pid_t pid) {
  std::istringstream in(read_proc(pid, "status"));
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("NSpid:", 0) == 0) {
      std::istringstream f(line.substr(6));
      std::vector<std::string> ids;
      std::string x;
      while (f >> x) ids.push_back(x);
      return ids.size() > 1 && ids.back() == "1";
    }
  return false;
}

std::string plugin_or_throw(const std::string& dir, const char* verb) {
  std::string d = dir.empty() ? plugin_dir() : dir;
  if (d.empty() || !is_file(d + "/" + kPluginFile))
    throw Error(Errc::unsupported, std::string("cannot ") + verb + ": the DVR CRIU plugin " + kPluginFile + " was not found" +
                                       (d.empty() ? std::string(" (looked in $DVR_CRIU_PLUGIN_DIR, criu-plugin/ beside dvr and ../lib/dvr/criu)")
                                                  : " in " + d) +
                                       "; build and install it (cmake --install), or point $DVR_CRIU_PLUGIN_DIR at its directory");
  return d;
}

// The criu binary and its version; throws unsupported for anything but 4.x+.
std::pair<std::string, std::string> criu_or_throw(const char* verb) {
  std::string criu = find_criu();
  if (criu.empty())
    throw Error(Errc::unsupported, std::string("cannot ") + verb + ": criu was not found; install CRIU 4.x (./install-deps.sh takes it from Debian 13)");
  std::string v = criu_version(criu);
  if (v.empty() || std::atoi(v.c_str()) < 4)
    throw Error(Errc::unsupported, std::string("cannot ") + verb + ": " + criu + " is version " + (v.empty() ? "unknown" : v) +
                                       "; dvr needs CRIU 4.x (3.x cannot run on kernels >= 6.13); ./install-deps.sh installs it");
  return {criu, v};
}

void require_root(const char* verb) {
  if (::geteuid() != 0)
    throw Error(Errc::permission, std::string("cannot ") + verb + ": CRIU needs root (or CAP_CHECKPOINT_RESTORE and CAP_SYS_ADMIN); run dvr proc as root");
}

}  // namespace

std::string plugin_dir() {
  if (const char* e = std::getenv("DVR_CRIU_PLUGIN_DIR"); e && *e) return is_file(std::string(e) + "/" + kPluginFile) ? e : "";
  std::string self = self_dir();
  for (std::string d : {self + "/criu-plugin", self + "/" DVR_CRIU_PLUGIN_RELDIR, self + "/../lib/dvr/criu"})
    if (is_file(d + "/" + kPluginFile)) return d;
  return "";
}

Preflight preflight(const std::string& dir, bool quick) {
  Preflight p;
  p.criu = find_criu();
  if (p.criu.empty()) {
    p.problems.push_back("criu was not found: install CRIU 4.x (./install-deps.sh takes criu from Debian 13)");
  } else {
    p.criu_version = criu_version(p.criu);
    if (p.criu_version.empty() || std::atoi(p.criu_version.c_str()) < 4)
      p.problems.push_back(p.criu + " is version " + (p.criu_version.empty() ? "unknown" : p.criu_version) +
                           ": dvr needs CRIU 4.x (3.x cannot run on kernels >= 6.13); ./install-deps.sh installs it");
    else if (!quick) {
      std::string out;
      if (::geteuid() != 0) {
        p.problems.push_back("not root: CRIU needs root to dump and restore processes");
      } else if (run_capture({p.criu, "check"}, {}, &out) != 0) {
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
  if (!d.empty() && is_file(d + "/" + kPluginFile)) p.plugin = d + "/" + kPluginFile;
  else
    p.problems.push_back(std::string("the DVR CRIU plugin ") + kPluginFile + " was not found" + (d.empty() ? "" : " in " + d) +
                         ": build it (cmake --build) and install it, or set $DVR_CRIU_PLUGIN_DIR to its directory");
  p.ok = p.problems.empty();
  return p;
}

ProcInfo dump(Store& store, pid_t pid, const std::string& name, const DumpOptions& options) {
  auto t0 = std::chrono::steady_clock::now();
  detail::check_name("process snapshot", name);
  if (name.size() > 120) throw Error(Errc::invalid_argument, "process snapshot name '" + name + "' is longer than 120 characters");
  require_root("dump a process");
  if (pid <= 0 || ::kill(pid, 0) != 0)
    throw Error(Errc::not_found, "cannot dump process " + std::to_string(pid) + ": no such process");
  for (auto& s : store.list(kImageSession))
    if (s.name == name)
      throw Error(Errc::already_exists, "process snapshot '" + name + "' exists already in store " + store.path() +
                                            "; pick another name or remove it with `dvr proc rm " + name + "`");
  const auto [criu, version] = criu_or_throw("dump a process");
  const std::string plugin = plugin_or_throw(options.plugin_dir, "dump a process");

  ProcInfo info;
  info.name = name;
  info.pid = pid;
  info.own_pid_namespace = in_own_pid_namespace(pid);
  info.criu_version = version;
  info.leave_running = options.leave_running;
  info.command = read_proc(pid, "cmdline");
  std::replace(info.command.begin(), info.command.end(), '\0', ' ');
  while (!info.command.empty() && info.command.back() == ' ') info.command.pop_back();
  if (info.command.empty()) info.command = read_proc(pid, "comm");
  info.kernel = kernel_release();

  clean_stale_work(store.path());
  WorkDir work(store.path(), "dump-" + name);
  // The tree is left stopped, not killed, until its images are safely in the
  // store: if storing them fails, the job goes on instead of being lost.
  std::vector<std::string> argv = {criu, "dump", "-t", std::to_string(pid), "-D", work.path, "-o", "dump.log", "-v2",
                                   "--libdir", plugin, options.leave_running ? "--leave-running" : "--leave-stopped"};
  const std::vector<pid_t> tree = process_tree(pid);
  info.files = mapped_files(tree);
  std::string out;
  int rc = run_capture(argv, {"DVR_CRIU_NAME=" + name}, &out);
  // Heap snapshots the plugin took, to be removed again if the dump fails.
  auto drop_heaps = [&] {
    try {
      heaps::remove_heaps(heaps::parse_image(detail::read_file(work.path + "/" + heaps::kImageName)));
    } catch (const Error&) {
    }
  };
  if (rc != 0) {
    auto [plugin_error, errors, log] = criu_failure(work, "dump.log", "dump-" + name + ".log");
    drop_heaps();
    if (!options.leave_running) signal_tree(tree, SIGCONT);  // CRIU resumes it on failure; make sure
    if (!plugin_error.empty()) throw Error(Errc::io, "cannot dump process " + std::to_string(pid) + ": " + plugin_error);
    throw Error(Errc::io, "CRIU could not dump process " + std::to_string(pid) + " (exit " + std::to_string(rc) + "):" +
                              (errors.empty() ? "\n  " + out : errors) + criu_hint(errors) + "\nfull log: " + log +
                              "\n(`dvr proc check` checks CRIU and the kernel; a job started with `dvr run` dumps most reliably)");
  }

  // The images become regions of snapshot proc/NAME; page images go in by
  // chunks, compared page by page with the newest earlier dump of the same
  // command, so what did not change is not stored again.
  try {
    std::vector<std::unique_ptr<Map>> maps;
    auto map_file = [&](const std::string& p, std::uint64_t n, int fd) {
      maps.push_back(std::make_unique<Map>(fd, n, PROT_READ, MAP_PRIVATE, "CRIU image " + p));
      return maps.back()->p;
    };
    Session s(store, kImageSession, SessionOptions{.tracking = Tracking::hash});
    // Page images go in as windows of the address space (proc_pages.hpp).
    std::vector<std::unique_ptr<procpages::Windows>> windows;
    std::vector<std::string> paged;  // page images stored as windows
    std::string paged_meta;
    for (auto& f : detail::list_dir(work.path)) {
      if (f.rfind("pagemap-", 0) != 0) continue;
      std::string p = work.path + "/" + f;
      Fd fd = detail::open_or_throw(p, O_RDONLY);
      std::uint64_t n = detail::file_size(fd.get(), p);
      procpages::Pagemap pm;
      if (n == 0 || !procpages::parse_pagemap(static_cast<const char*>(map_file(p, n, fd.get())), n, pm)) continue;
      std::string pages = "pages-" + std::to_string(pm.pages_id) + ".img", pp = work.path + "/" + pages;
      if (!detail::path_exists(pp)) continue;
      Fd pfd = detail::open_or_throw(pp, O_RDONLY);
      std::uint64_t size = detail::file_size(pfd.get(), pp);
      auto w = std::make_unique<procpages::Windows>();
      if (size == 0 || !w->build(pm, pfd.get(), size, false, nullptr)) continue;  // stored as it is
      for (auto& win : w->windows()) s.track(procpages::window_region(pm.pages_id, win.start), win.base, procpages::kWindow);
      windows.push_back(std::move(w));
      paged.push_back(pages);
      paged_meta += "paged=" + pages + "\t" + f + "\t" + std::to_string(size) + "\n";
      info.image_bytes += size;
    }
    for (auto& f : detail::list_dir(work.path)) {
      if (f == "dump.log" || f == heaps::kErrorName) continue;
      if (std::find(paged.begin(), paged.end(), f) != paged.end()) continue;
      std::string p = work.path + "/" + f;
      Fd fd = detail::open_or_throw(p, O_RDONLY);
      std::uint64_t n = detail::file_size(fd.get(), p);
      if (f == heaps::kImageName) info.heaps.clear();
      if (n == 0) continue;  // CRIU writes some empty images; restore recreates them
      void* data = map_file(p, n, fd.get());
      info.image_bytes += n;
      if (f == heaps::kImageName) {
        heaps::HeapImage hi = heaps::parse_image(std::string(static_cast<const char*>(data), n));
        for (auto& h : hi.heaps) info.heaps.push_back({h.path, h.bytes, h.store, h.session});
      }
      s.track(f, data, n);
    }
    // Empty images are recorded by name in the metadata.
    std::string empties;
    for (auto& f : detail::list_dir(work.path)) {
      if (f == "dump.log") continue;
      struct stat st {};
      if (::stat((work.path + "/" + f).c_str(), &st) == 0 && st.st_size == 0) empties += "empty=" + f + "\n";
    }
    std::string base;
    std::int64_t newest = -1;
    for (auto& si : store.list(kImageSession)) {
      if (si.damaged || si.name == name || si.time_ns <= newest || command_of_label(si.label) != info.command) continue;
      newest = si.time_ns;
      base = si.name;
    }
    info.parent = base;
    std::string meta = format_meta(info) + empties + paged_meta;
    s.track(kMetaRegion, meta.data(), meta.size());
    if (!base.empty()) s.base_on(base);
    SnapshotInfo si = s.snapshot(name, {.label = label_for(pid, info.command)});
    info.time_ns = si.time_ns;
    info.stored_bytes = si.stored_bytes + heap_bytes(store, info);
  } catch (const Error& e) {
    drop_heaps();
    if (options.leave_running) throw;
    signal_tree(tree, SIGCONT);
    throw Error(e.code(), std::string(e.what()) + " (the process was not stopped: it keeps running)");
  }
  // Stored: now the job is stopped for good (dump without --leave-running).
  if (!options.leave_running) signal_tree(tree, SIGKILL);
  info.seconds = since(t0);
  return info;
}

std::vector<ProcInfo> list(const Store& store) {
  std::vector<ProcInfo> out;
  for (auto& si : store.list(kImageSession)) {
    try {
      out.push_back(read_info(store, si, false));
    } catch (const Error& e) {
      ProcInfo p;
      p.name = si.name;
      p.time_ns = si.time_ns;
      p.command = std::string("(damaged: ") + e.what() + ")";
      out.push_back(p);
    }
  }
  return out;
}

ProcInfo info(const Store& store, const std::string& name) {
  detail::check_name("process snapshot", name);
  for (auto& si : store.list(kImageSession))
    if (si.name == name) return read_info(store, si, false);
  throw Error(Errc::not_found, "no process snapshot '" + name + "' in store " + store.path() + "; `dvr proc ls` lists them");
}

void remove(Store& store, const std::string& name) {
  ProcInfo p = info(store, name);  // not_found with the right message
  heaps::HeapImage img = heap_image_in(store, p);
  store.remove(kImageSession, name);
  heaps::remove_heaps(img);
}

RestoreResult restore(Store& store, const std::string& name, const RestoreOptions& options) {
  auto t0 = std::chrono::steady_clock::now();
  const char* verb = options.clone ? "clone a process" : "restore a process";
  detail::check_name("process snapshot", name);
  ProcInfo p = info(store, name);
  require_root(verb);
  const std::string criu = criu_or_throw(verb).first;
  const std::string plugin = plugin_or_throw(options.plugin_dir, verb);
  // Preflight: what CRIU needs from this host, compared with the dumping one.
  {
    std::vector<std::string> differ;
    for (auto& f : p.files) {
      struct stat st {};
      if (::stat(f.path.c_str(), &st) != 0) differ.push_back(f.path + " is missing");
      else if (static_cast<std::uint64_t>(st.st_size) != f.size)
        differ.push_back(f.path + " is " + std::to_string(st.st_size) + " bytes here, " + std::to_string(f.size) + " where it was dumped");
      else if (st.st_mtim.tv_sec * 1000000000ll + st.st_mtim.tv_nsec != f.mtime_ns)
        differ.push_back(f.path + " was modified since the dump (same size, another time stamp)");
    }
    if (!differ.empty()) {
      std::string list;
      for (std::size_t k = 0; k < differ.size() && k < 8; ++k) list += "\n  " + differ[k];
      if (differ.size() > 8) list += "\n  ... and " + std::to_string(differ.size() - 8) + " more";
      throw Error(Errc::unsupported, "cannot " + std::string(verb) + " '" + name + "': CRIU needs the programs and libraries it "
                                     "ran with, at the same paths, and here they differ:" + list +
                                     "\ninstall the same versions (the same packages or build) at the same paths; nothing was changed");
    }
  }
  if (options.clone && !p.own_pid_namespace)
    throw Error(Errc::invalid_argument, "process snapshot '" + name + "' (PID " + std::to_string(p.pid) +
                                            ") was not dumped from a job in its own PID namespace, so a clone would need the "
                                            "original's PIDs; start jobs with `dvr run -- CMD` to clone them");
  if (!p.own_pid_namespace && ::kill(p.pid, 0) == 0)
    throw Error(Errc::io, "cannot restore process snapshot '" + name + "': PID " + std::to_string(p.pid) +
                              " is in use (" + comm_of(p.pid) +
                                            "); stop that process first, or start jobs with `dvr run -- CMD` so that they "
                                            "restore in a PID namespace of their own (nothing was changed)");
  if (!options.clone)
    for (auto& h : p.heaps) {
      auto users = heaps::processes_mapping(h.path);
      if (!users.empty())
        throw Error(Errc::io, "cannot restore process snapshot '" + name + "': its heap file " + h.path +
                                                " is mapped by running process " + users.front() +
                                                "; stop it first, or use `dvr proc clone " + name +
                                                "` to run a copy beside it (nothing was changed)");
    }

  // The PID file is opened before anything runs: failing to write it later
  // would leave a job running that nobody can find.
  detail::Fd user_pidfile;
  if (!options.pidfile.empty()) {
    user_pidfile = detail::Fd(::open(options.pidfile.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!user_pidfile) detail::throw_errno(errno, "cannot write PID file " + options.pidfile);
  }
  clean_stale_work(store.path());
  // Images back into files, in one pass that checks every page against its
  // checksum before it is copied.
  std::optional<WorkDir> work_dir(std::in_place, store.path(), "restore-" + name);
  WorkDir& work = *work_dir;
  {
    std::vector<std::unique_ptr<Map>> maps;
    std::string meta;
    Session s(store, kImageSession, SessionOptions{.tracking = Tracking::hash});
    // Page images stored as windows: recreate each file, and map its pages
    // into windows where the restore writes them (proc_pages.hpp). The layout
    // comes from the stored pagemap, read here unchecked; the restore below
    // checks every byte, these included, before CRIU runs.
    std::vector<std::unique_ptr<procpages::Windows>> windows;
    std::map<std::string, void*> window_at;
    std::vector<std::string> paged;
    {
      Clone peek = store.open_snapshot(kImageSession, name, {.verify = false});
      Region& m = peek.region(kMetaRegion);
      std::istringstream in(std::string(static_cast<const char*>(m.data()), m.size()));
      std::string line;
      while (std::getline(in, line)) {
        if (line.rfind("paged=", 0) != 0) continue;
        auto t1 = line.find('\t'), t2 = line.find('\t', t1 + 1);
        if (t1 == std::string::npos || t2 == std::string::npos) throw Error(Errc::corrupt, "process snapshot '" + name + "' has damaged metadata (paged)");
        std::string pages = line.substr(6, t1 - 6), pagemap = line.substr(t1 + 1, t2 - t1 - 1);
        std::uint64_t size = std::strtoull(line.c_str() + t2 + 1, nullptr, 10);
        detail::check_name("image", pages);
        procpages::Pagemap pm;
        Region& r = peek.region(pagemap);
        std::string why = "its pagemap cannot be read";
        std::string path = work.path + "/" + pages;
        Fd fd = detail::open_or_throw(path, O_RDWR | O_CREAT | O_EXCL);
        if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) detail::throw_errno(errno, "cannot size " + path);
        auto w = std::make_unique<procpages::Windows>();
        if (!procpages::parse_pagemap(static_cast<const char*>(r.data()), r.size(), pm) || !w->build(pm, fd.get(), size, true, &why))
          throw Error(Errc::corrupt, "process snapshot '" + name + "': " + pages + " cannot be rebuilt (" + why + ")");
        for (auto& win : w->windows()) window_at[procpages::window_region(pm.pages_id, win.start)] = win.base;
        windows.push_back(std::move(w));
        paged.push_back(pages);
      }
    }
    for (auto& r : store.info(kImageSession, name).regions) {
      if (auto it = window_at.find(r.name); it != window_at.end()) {
        if (r.size != procpages::kWindow) throw Error(Errc::corrupt, "process snapshot '" + name + "': region " + r.name + " has a wrong size");
        s.track(r.name, it->second, r.size);
        window_at.erase(it);
        continue;
      }
      if (r.name.rfind("mem-", 0) == 0)
        throw Error(Errc::corrupt, "process snapshot '" + name + "': region " + r.name + " lies outside every stored pagemap");
      if (r.name == kMetaRegion) {
        meta.resize(r.size);
        s.track(r.name, meta.data(), r.size);
        continue;
      }
      std::string path = work.path + "/" + r.name;
      Fd fd = detail::open_or_throw(path, O_RDWR | O_CREAT | O_EXCL);
      if (::ftruncate(fd.get(), static_cast<off_t>(r.size)) != 0) detail::throw_errno(errno, "cannot size " + path);
      // Populated in one go: a GiB of page images faulted in page by page
      // would cost more than copying it.
      auto m = std::make_unique<Map>(fd.get(), r.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, path);
      s.track(r.name, m->p, r.size);
      maps.push_back(std::move(m));
    }
    if (!window_at.empty())
      throw Error(Errc::corrupt, "process snapshot '" + name + "' lacks page window " + window_at.begin()->first + " its pagemap needs");
    s.restore(name);
    std::istringstream in(meta);
    std::string line;
    while (std::getline(in, line))
      if (line.rfind("empty=", 0) == 0) {
        detail::check_name("image", line.substr(6));
        detail::open_or_throw(work.path + "/" + line.substr(6), O_WRONLY | O_CREAT | O_EXCL);
      }
  }
  // The heaps are checked by the plugin, every page before any file changes.
  // Their present content is kept first, to be put back if CRIU fails after
  // the plugin has rewritten them (what the job wrote since is not lost).
  heaps::HeapImage backup;
  if (!options.clone) {
    std::vector<std::string> present;
    for (auto& h : p.heaps)
      if (detail::path_exists(h.path) && !heaps::store_of_heap(h.path).empty()) present.push_back(h.path);
    if (!present.empty()) {
      std::random_device rd;
      backup = heaps::snapshot_heaps(present, 0, "proc-restore-backup-" + std::to_string(rd()) + std::to_string(rd()), false);
    }
  }
  struct BackupGuard {
    heaps::HeapImage& img;
    bool put_back = true;
    ~BackupGuard() {
      if (img.heaps.empty()) return;
      try {
        if (put_back) heaps::restore_heaps(img);
        heaps::remove_heaps(img);
      } catch (const std::exception&) {
      }
    }
  } backup_guard{backup};

  std::string pidfile = work.path + "/restored.pid";
  std::vector<std::string> argv = {criu, "restore", "-D", work.path, "-o", "restore.log", "-v2", "--libdir", plugin,
                                   "--restore-detached", "--pidfile", pidfile};
  std::function<bool()> in_child;
  if (options.clone && !p.heaps.empty()) {
    // A mount namespace of its own, with an empty tmpfs over each heap
    // directory: the plugin puts the heaps' dump-time content there, and the
    // clone maps those copies instead of the original's files.
    std::vector<std::string> dirs;
    for (auto& h : p.heaps) {
      std::string d = dir_of(h.path);
      if (std::find(dirs.begin(), dirs.end(), d) == dirs.end()) dirs.push_back(d);
    }
    in_child = [dirs] {
      if (::unshare(CLONE_NEWNS) != 0) return false;
      if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return false;
      for (auto& d : dirs)
        if (::mount("dvr-clone-heap", d.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700") != 0) return false;
      return true;
    };
  }
  // Restored processes become our children when we wait for them.
  struct Subreaper {
    bool on;
    explicit Subreaper(bool want) : on(want && ::prctl(PR_SET_CHILD_SUBREAPER, 1) == 0) {}
    ~Subreaper() {
      if (on) ::prctl(PR_SET_CHILD_SUBREAPER, 0);
    }
  } subreaper(!options.detach && !options.clone);
  std::string out;
  int rc = run_capture(argv, {"DVR_CRIU_STORE=" + store.path()}, &out, in_child);
  if (rc != 0) {
    auto [plugin_error, errors, log] = criu_failure(work, "restore.log", "restore-" + name + ".log");
    if (rc == 126) throw Error(Errc::io, "cannot " + std::string(verb) + ": could not set up a private mount namespace for its heaps");
    if (!plugin_error.empty()) throw Error(Errc::io, "cannot restore process snapshot '" + name + "': " + plugin_error);
    throw Error(Errc::io, "CRIU could not restore process snapshot '" + name + "' (exit " + std::to_string(rc) + "):" +
                              (errors.empty() ? "\n  " + out : errors) + criu_hint(errors) + "\nfull log: " + log +
                              "\n(nothing of it is left running; `dvr proc check` checks CRIU and the kernel)");
  }
  backup_guard.put_back = false;  // CRIU succeeded: the restored heaps stay
  RestoreResult r;
  if (!p.kernel.empty() && p.kernel != kernel_release())
    r.notes.push_back("dumped on kernel " + p.kernel + ", restored on " + kernel_release());
  if (!p.criu_version.empty() && p.criu_version != criu_version(criu))
    r.notes.push_back("dumped with CRIU " + p.criu_version + ", restored with " + criu_version(criu));
  try {
    r.pid = static_cast<pid_t>(std::stol(detail::read_file(pidfile)));
  } catch (const std::exception&) {
    throw Error(Errc::io, "CRIU restored process snapshot '" + name + "' but wrote no PID file");
  }
  r.seconds = since(t0);
  if (user_pidfile) {
    std::string text = std::to_string(r.pid) + "\n";
    try {
      detail::write_all(user_pidfile.get(), text.data(), text.size(), options.pidfile);
    } catch (const Error&) {
      signal_tree(process_tree(r.pid), SIGKILL);  // nobody could find it: not left running
      throw;
    }
  }
  work_dir.reset();  // the images are not needed while the job runs
  if (!options.detach && !options.clone) {
    int status = 0;
    while (::waitpid(r.pid, &status, 0) < 0) {
      if (errno == EINTR) continue;
      throw Error(Errc::io, "cannot wait for restored process " + std::to_string(r.pid) + ": " + std::strerror(errno));
    }
    r.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  return r;
}

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
  for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
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
    throw Error(err == ENOENT ? Errc::not_found : err == EPERM || err == EACCES ? Errc::permission : Errc::io,
                "dvr run: cannot " + w + ": " + std::strerror(static_cast<int>(err)));
  };
  if (n1 != sizeof first) throw Error(Errc::io, "dvr run: the job could not be started");
  if (first[0] <= 0) failure(-first[0], first[1]);
  if (n2 == sizeof second) failure(-second[0], second[1]);
  return static_cast<pid_t>(first[0]);
}

}  // namespace dvr::proc
