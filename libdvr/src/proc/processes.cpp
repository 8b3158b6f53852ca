// What /proc says about live processes and this host (see processes.hpp).
#include <dirent.h>
#include "proc/processes.hpp"

#include <signal.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <chrono>
#include <sstream>
#include <thread>

#include "base/os.hpp"
#include "proc/proc_heaps.hpp"

namespace dvr::proc::impl {

namespace {

namespace heaps = detail::heaps;

std::string read_proc_path(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string read_proc(pid_t pid, const char* what) { return read_proc_path("/proc/" + std::to_string(pid) + "/" + what); }

std::string command_line(pid_t pid) {
  std::string command = read_proc(pid, "cmdline");
  std::replace(command.begin(), command.end(), '\0', ' ');
  while (!command.empty() && command.back() == ' ')
    command.pop_back();
  if (command.empty()) command = read_proc(pid, "comm");
  return command;
}

std::string comm_of(pid_t pid) {
  std::string c = read_proc(pid, "comm");
  while (!c.empty() && (c.back() == '\n' || c.back() == ' '))
    c.pop_back();
  return c.substr(0, 64);
}

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
  for (pid_t p : tree)
    ::kill(p, sig);
}

namespace {
std::size_t threads_left(pid_t pid) {
  DIR* d = ::opendir(("/proc/" + std::to_string(pid) + "/task").c_str());
  if (!d) return 0;
  std::size_t n = 0;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n;
}
}  // namespace

void wait_exited(const std::vector<pid_t>& tree, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (pid_t p : tree) {
    for (;;) {
      // Gone, or a zombie: either way its files and sockets are closed.
      std::string stat;
      try {
        stat = read_proc(p, "stat");
      } catch (const std::exception&) {
        break;
      }
      auto close = stat.rfind(')');
      const bool dead =
          stat.empty() || close == std::string::npos || close + 2 >= stat.size() || stat[close + 2] == 'Z' || stat[close + 2] == 'X';
      // A zombie main thread does not close the files yet: its other
      // threads, still tearing the memory down, hold them until they are
      // gone from /proc/PID/task.
      if (dead && threads_left(p) <= 1) break;
      if (std::chrono::steady_clock::now() >= deadline) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
}

bool in_own_pid_namespace(pid_t pid) {
  std::istringstream in(read_proc(pid, "status"));
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("NSpid:", 0) == 0) {
      std::istringstream f(line.substr(6));
      std::vector<std::string> ids;
      std::string x;
      while (f >> x)
        ids.push_back(x);
      return ids.size() > 1 && ids.back() == "1";
    }
  return false;
}

std::string kernel_release() {
  struct utsname u {};
  return ::uname(&u) == 0 ? u.release : "";
}

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
    char buf[PATH_MAX];
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

}  // namespace dvr::proc::impl
