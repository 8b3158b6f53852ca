// The metadata of a process snapshot (see metadata.hpp, docs/format.md).
#include "proc/metadata.hpp"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "dvr/error.hpp"

namespace dvr::proc::impl {

namespace {

constexpr const char* kHeader = "dvr-proc 1";

// The `n` tab-separated fields of `v`; the last one takes the rest of the
// line (a path may hold tabs). Throws std::invalid_argument for fewer.
std::vector<std::string> fields(const std::string& v, std::size_t n) {
  std::vector<std::string> out;
  std::size_t at = 0;
  for (std::size_t k = 0; k + 1 < n; ++k) {
    auto tab = v.find('\t', at);
    if (tab == std::string::npos) throw std::invalid_argument("too few fields");
    out.push_back(v.substr(at, tab - at));
    at = tab + 1;
  }
  out.push_back(v.substr(at));
  return out;
}

}  // namespace

std::string encode_meta(const Meta& meta) {
  const ProcInfo& p = meta.info;
  std::ostringstream o;
  o << kHeader << "\n"
    << "pid=" << p.pid << "\n"
    << "own_pid_namespace=" << (p.own_pid_namespace ? 1 : 0) << "\n"
    << "criu_version=" << p.criu_version << "\n"
    << "leave_running=" << (p.leave_running ? 1 : 0) << "\n"
    << "tcp_established=" << (p.tcp_established ? 1 : 0) << "\n"
    << "image_bytes=" << p.image_bytes << "\n";
  for (auto& h : p.heaps)
    o << "heap=" << h.bytes << "\t" << h.store << "\t" << h.session << "\t" << h.path << "\n";
  for (auto& f : p.files)
    o << "file=" << f.size << "\t" << f.mtime_ns << "\t" << f.path << "\n";
  o << "kernel=" << p.kernel << "\n";
  std::string cmd = p.command;
  std::replace(cmd.begin(), cmd.end(), '\n', ' ');
  o << "command=" << cmd << "\n";
  for (auto& e : meta.empty_images)
    o << "empty=" << e << "\n";
  for (auto& g : meta.paged_images)
    o << "paged=" << g.pages << "\t" << g.pagemap << "\t" << g.size << "\n";
  return o.str();
}

Meta decode_meta(std::string_view text, const std::string& name) {
  Meta meta;
  ProcInfo& p = meta.info;
  p.name = name;
  std::istringstream in{std::string(text)};
  std::string line;
  if (!std::getline(in, line) || line.rfind("dvr-proc ", 0) != 0) throw Error(Errc::corrupt, "process snapshot '" + name + "' has no valid metadata");
  if (line != kHeader) throw Error(Errc::unsupported, "process snapshot '" + name + "' was written by a newer dvr (" + line + ")");
  while (std::getline(in, line)) {
    auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    std::string k = line.substr(0, eq), v = line.substr(eq + 1);
    try {
      if (k == "pid")
        p.pid = static_cast<pid_t>(std::stol(v));
      else if (k == "own_pid_namespace")
        p.own_pid_namespace = v == "1";
      else if (k == "criu_version")
        p.criu_version = v;
      else if (k == "leave_running")
        p.leave_running = v == "1";
      else if (k == "tcp_established")
        p.tcp_established = v == "1";
      else if (k == "image_bytes")
        p.image_bytes = std::stoull(v);
      else if (k == "command")
        p.command = v;
      else if (k == "kernel")
        p.kernel = v;
      else if (k == "file") {
        auto f = fields(v, 3);  // size, mtime_ns, path
        p.files.push_back({f[2], std::stoull(f[0]), std::stoll(f[1])});
      } else if (k == "heap") {
        auto f = fields(v, 4);  // bytes, store, session, path
        p.heaps.push_back({f[3], std::stoull(f[0]), f[1], f[2]});
      } else if (k == "empty") {
        meta.empty_images.push_back(v);
      } else if (k == "paged") {
        auto f = fields(v, 3);  // pages image, pagemap image, size
        meta.paged_images.push_back({f[0], f[1], std::stoull(f[2])});
      }
    } catch (const std::exception&) {
      throw Error(Errc::corrupt, "process snapshot '" + name + "' has damaged metadata (" + k + ")");
    }
  }
  return meta;
}

std::string label_for(pid_t pid, const std::string& command) { return "process " + std::to_string(pid) + ": " + command; }

std::string command_of_label(const std::string& label) {
  auto k = label.find(": ");
  return label.rfind("process ", 0) == 0 && k != std::string::npos ? label.substr(k + 2) : std::string();
}

}  // namespace dvr::proc::impl
