#include "track/heap_note.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>

namespace dvr::detail::heaps {

std::string note_path(const std::string& heap_file) {
  auto k = heap_file.find_last_of('/');
  return heap_file.substr(0, k + 1) + "." + heap_file.substr(k + 1) + ".track";
}

std::pair<std::uint64_t, std::uint64_t> identity(pid_t pid) {
  std::string base = pid ? "/proc/" + std::to_string(pid) : std::string("/proc/self");
  std::ifstream in(base + "/stat");
  std::string stat;
  std::getline(in, stat);
  // Field 22, counted after the command name (which may hold spaces).
  auto close = stat.rfind(')');
  std::uint64_t start_time = 0;
  if (close != std::string::npos) {
    std::istringstream f(stat.substr(close + 2));
    std::string x;
    for (int field = 3; field <= 22 && (f >> x); ++field)
      if (field == 22) start_time = std::strtoull(x.c_str(), nullptr, 10);
  }
  struct stat st {};
  std::uint64_t ns = ::stat((base + "/ns/pid").c_str(), &st) == 0 ? st.st_ino : 0;
  return {start_time, ns};
}

void write_note(const std::string& heap_file, TrackNote n) {
  auto [start_time, ns] = n.start_time ? std::make_pair(n.start_time, n.pid_ns) : identity(0);
  std::ostringstream o;
  o << "dvr-heap-track 1\n"
    << "process " << start_time << " " << ns << "\n"
    << "tracked " << n.start << " " << n.end << "\n"
    << "region " << n.data << " " << n.size << "\n"
    << "checksum " << n.checksum << "\n"
    << "snapshot " << n.snapshot << "\n";
  std::string text = o.str(), path = note_path(heap_file);
  // A random name: jobs of `dvr run` are all PID 1.
  std::random_device rd;
  std::string tmp = path + ".tmp" + std::to_string(rd()) + std::to_string(rd());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    ::unlink(path.c_str());  // no note is safe; an old one is not
    return;
  }
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    ::unlink(path.c_str());
  }
}

bool read_note(const std::string& heap_file, TrackNote& n) {
  int fd = ::open(note_path(heap_file).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return false;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return false;
  }
  char buf[1024];
  ssize_t len = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (len <= 0) return false;
  std::istringstream in(std::string(buf, static_cast<std::size_t>(len)));
  std::string line, key;
  if (!std::getline(in, line) || line != "dvr-heap-track 1") return false;
  int seen = 0;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    f >> key;
    if (key == "process" && (f >> n.start_time >> n.pid_ns))
      seen |= 1;
    else if (key == "tracked" && (f >> n.start >> n.end))
      seen |= 2;
    else if (key == "region" && (f >> n.data >> n.size))
      seen |= 4;
    else if (key == "checksum" && (f >> n.checksum))
      seen |= 8;
    else if (key == "snapshot" && line.size() > 9) {
      n.snapshot = line.substr(9);
      seen |= 16;
    }
  }
  return seen == 31 && n.start < n.end && n.data <= n.start && n.end <= n.data + ((n.size + 4095) & ~std::uint64_t(4095));
}

}  // namespace dvr::detail::heaps
