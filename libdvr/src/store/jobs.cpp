// The job registry (dvr/jobs.hpp).
#include "dvr/jobs.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "base/os.hpp"
#include "dvr/error.hpp"
#include "store/store_impl.hpp"

namespace dvr {

namespace {

using json = nlohmann::ordered_json;

constexpr const char* kAutosaveKind = "autosave";

std::string run_dir(const std::string& store) { return store + "/run"; }

// PID.json, or PID.autosave.SESSION.json for a session's autosave.
std::string file_name(const JobRecord& r) {
  std::string name = std::to_string(r.pid);
  if (r.kind == kAutosaveKind) name += std::string(".") + kAutosaveKind + "." + r.session;
  return name + ".json";
}

}  // namespace

std::uint64_t process_start_ticks(pid_t pid) {
  if (pid <= 0) return 0;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return 0;
  auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return 0;
  std::istringstream in(line.substr(close + 2));
  std::string field;
  // Field 3 (state) is the first after the command; field 22 is starttime.
  for (int k = 3; k <= 22 && in >> field; ++k) {
    if (k == 3 && (field == "Z" || field == "X")) return 0;
    if (k == 22) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return 0;
}

std::string process_command(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::string out(4096, '\0');
  f.read(out.data(), static_cast<std::streamsize>(out.size()));
  out.resize(static_cast<std::size_t>(std::max<std::streamsize>(0, f.gcount())));
  std::replace(out.begin(), out.end(), '\0', ' ');
  while (!out.empty() && out.back() == ' ')
    out.pop_back();
  return out;
}

bool job_alive(const JobRecord& r) {
  std::uint64_t t = process_start_ticks(r.pid);
  return t != 0 && t == r.start_ticks;
}

void write_job(const std::string& store_path, const JobRecord& r) {
  if (r.kind == kAutosaveKind) detail::check_name("session", r.session);
  const std::string dir = run_dir(store_path);
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) throw Error(Errc::io, "cannot create " + dir + ": " + std::strerror(errno));
  const std::int64_t now = detail::now_ns();
  json doc{{"schema_version", 1},          {"pid", r.pid},
           {"start_ticks", r.start_ticks}, {"started_ns", r.started_ns ? r.started_ns : now},
           {"kind", r.kind},               {"session", r.session},
           {"command", r.command},         {"heap", r.heap},
           {"interval_s", r.interval_s},   {"last_dump", r.last_dump},
           {"last_dump_ns", r.last_dump_ns}, {"last_error", r.last_error},
           {"updated_ns", now}};
  const std::string text = doc.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  const std::string file = dir + "/" + file_name(r);
  const std::string tmp = dir + "/." + file_name(r) + ".tmp-" + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) throw Error(Errc::io, "cannot create " + tmp + ": " + std::strerror(errno));
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ok = ::close(fd) == 0 && ok;
  if (!ok || ::rename(tmp.c_str(), file.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    throw Error(Errc::io, "cannot write " + file + ": " + std::strerror(e));
  }
}

void remove_job(const std::string& store_path, const JobRecord& r) { ::unlink((run_dir(store_path) + "/" + file_name(r)).c_str()); }

std::vector<JobRecord> read_jobs(const std::string& store_path) {
  std::vector<JobRecord> out;
  const std::string dir = run_dir(store_path);
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.size() < 6 || name[0] == '.' || name.compare(name.size() - 5, 5, ".json") != 0) continue;
    std::string digits = name.substr(0, std::min(name.find('.'), name.size() - 5));
    if (digits.empty() || digits.size() > 10 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    int fd = ::open((dir + "/" + name).c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st {};
    std::string text;
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= 65536) {
      text.resize(static_cast<std::size_t>(st.st_size));
      ssize_t n = ::pread(fd, text.data(), text.size(), 0);
      text.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
    }
    ::close(fd);
    json doc = json::parse(text, nullptr, false);
    if (!doc.is_object()) continue;
    try {
      JobRecord r;
      r.pid = doc.at("pid").get<pid_t>();
      r.start_ticks = doc.at("start_ticks").get<std::uint64_t>();
      r.started_ns = doc.at("started_ns").get<std::int64_t>();
      r.kind = doc.at("kind").get<std::string>();
      r.session = doc.value("session", std::string());  // records of dvr 0.x before autosave had none
      r.command = doc.at("command").get<std::string>();
      r.heap = doc.at("heap").get<std::string>();
      r.interval_s = doc.at("interval_s").get<double>();
      r.last_dump = doc.at("last_dump").get<std::string>();
      r.last_dump_ns = doc.at("last_dump_ns").get<std::int64_t>();
      r.last_error = doc.at("last_error").get<std::string>();
      r.updated_ns = doc.at("updated_ns").get<std::int64_t>();
      // The file must be the one this record would be written to: a record
      // cannot speak for another process or session than its name says.
      if (r.kind == kAutosaveKind) {
        try {
          detail::check_name("session", r.session);
        } catch (const Error&) {
          continue;
        }
      }
      if (file_name(r) != name) continue;
      out.push_back(std::move(r));
    } catch (const json::exception&) {
      continue;  // a record of another version, or damaged: not ours to read
    }
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return std::tie(a.pid, a.session) < std::tie(b.pid, b.session); });
  return out;
}

}  // namespace dvr
