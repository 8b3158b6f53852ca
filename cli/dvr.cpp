// dvr — the Memory DVR command line. A thin layer over <dvr/dvr.hpp>.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <optional>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <chrono>
#include <ctime>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli_util.hpp"
#include "demo.hpp"
#include "dvr/dvr.hpp"
#include "dvr/proc.hpp"
#include "dvr/transfer.hpp"

namespace {

using namespace dvr;
using namespace dvr::cli;

const char* kUsage = R"(usage: dvr [--store DIR] COMMAND [ARGS]

Memory DVR: named snapshots of application memory, restored in milliseconds.

Commands:
  demo [--size 1G] [--trials N] [--json]
                      build a data set, snapshot it, run trials that mutate it
                      and restore between them; print build vs restore times
  ls [SESSION] [--json]
                      list snapshots (all sessions, or one)
  info SESSION/NAME [--json]
                      show one snapshot: time, parent, label, sizes, regions
  rm SESSION/NAME...  remove snapshots (their space is reclaimed by gc)
  gc [--json]         reclaim the space of removed and interrupted snapshots
  verify [--json]     re-hash every stored chunk; name each damaged snapshot
                      (exit status 1 when anything is damaged)
  stat [--json]       the store: path, medium, format, space used
  log SESSION [--json]
                      the session's snapshots as a tree of parent links
                      (time, label, bytes added)
  diff SESSION/A SESSION/B [--json]
                      per region: how many bytes and pages differ
  proc dump PID --name NAME [--leave-running] [--tcp-established] [--json]
                      snapshot a whole process tree with CRIU (root); a DVR
                      persistent heap it maps is snapshotted, not copied;
                      --tcp-established: with its connected TCP sockets
                      (clients stay connected across dump and restore)
  proc restore NAME [--detach] [--pidfile FILE] [--tcp-established] [--json]
                      bring it back (waits for it unless --detach); a dump
                      with --tcp-established restores its connections
  proc clone NAME [--net new|NETNS] [--ip ADDR/PREFIX [--host-ip ADDR]]
       [--pidfile FILE] [--tcp-established] [--json]
                      start a copy beside the running original (fresh PID
                      namespace, private copies of its heaps, its own Unix
                      sockets); --net new: in a network namespace of its
                      own with a veth pair to the host (the clone at --ip,
                      default a free 10.213.x.y/30), --net NETNS: in
                      /run/netns/NETNS; its TCP connections are closed
                      unless --tcp-established
  proc ls [--json] | proc info NAME [--json] | proc rm NAME...
                      process snapshots of the store
  proc check [--json] every capability dvr proc depends on (root, CRIU,
                      kernel features, plugin, TCP sockets: a real dump and
                      restore of a tiny process), one line each, with what
                      to do about what is missing
  run [--output FILE] [--cwd DIR] [--heap [MAX] [--heap-session NAME]]
      -- CMD [ARGS...]
                      start CMD as PID 1 of its own PID namespace, detached,
                      so it can be dumped, restored and cloned; prints its PID;
                      --heap: an unmodified program's heap (malloc, new, its
                      own anonymous mmap) lives in a DVR persistent heap of
                      MAX bytes (default 4G) in the store, so `proc dump`
                      stores only the pages written since the last dump
  send REF [--base BASE] [--compress=auto|zstd|none] [--level N] [--json]
                      write snapshot REF (SESSION/NAME, or proc/NAME with its
                      heaps) as a verified, compressed stream to stdout;
                      --compress: auto (default: zstd for the chunks whose
                      first bytes compress, the others raw), zstd (every
                      chunk), none; --level: zstd's level (default 1)
  receive [--json]    read such a stream from stdin into the store; nothing
                      is stored unless all of it checks out
  export REF -o FILE [--base BASE] [--compress=auto|zstd|none] [--level N] [--json]
  import FILE [--json]
                      the same through a file
  push REF ssh://[USER@]HOST[:PORT]/STORE [--base BASE] [--ssh CMD]
       [--remote-dvr PATH] [--compress=auto|zstd|none] [--level N] [--json]
                      send REF to a store on another machine through ssh;
                      only what the far store lacks travels
  pull ssh://[USER@]HOST[:PORT]/STORE REF [--ssh CMD] [--remote-dvr PATH] [--json]
                      the reverse
  recover SESSION [--json]
                      the newest intact snapshot of a session (after a crash,
                      the one to restore); exit status 1 when there is none

Options:
  --store DIR         the store directory (default: $DVR_STORE, else
                      /dev/shm/dvr-$UID)
  --version           print the version
  -h, --help          this help
)";

struct Args {
  std::string store_path;
  std::string command;
  std::vector<std::string> rest;
  bool json = false;

  bool take_flag(const std::string& flag) {
    for (auto it = rest.begin(); it != rest.end(); ++it)
      if (*it == flag) {
        rest.erase(it);
        return true;
      }
    return false;
  }
  std::string take_option(const std::string& flag, const std::string& fallback) {
    for (auto it = rest.begin(); it != rest.end(); ++it) {
      if (*it == flag) {
        if (it + 1 == rest.end()) throw Error(Errc::invalid_argument, flag + " needs a value");
        std::string v = *(it + 1);
        rest.erase(it, it + 2);
        return v;
      }
      if (it->rfind(flag + "=", 0) == 0) {
        std::string v = it->substr(flag.size() + 1);
        rest.erase(it);
        return v;
      }
    }
    return fallback;
  }
  void no_more() const {
    for (auto& r : rest)
      throw Error(Errc::invalid_argument, "unexpected argument '" + r + "' for `dvr " + command + "`; see `dvr --help`");
  }
};

Store open_store(const Args& a, bool create) {
  StoreOptions o;
  o.create = create;
  return a.store_path.empty() ? Store::open_default(o) : Store::open(a.store_path, o);
}

std::string format_time(std::int64_t ns) {
  std::time_t t = static_cast<std::time_t>(ns / 1000000000);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

std::string info_json(const SnapshotInfo& i) {
  std::string s = "{\"session\":" + json_string(i.session) + ",\"name\":" + json_string(i.name);
  if (i.damaged) return s + ",\"damaged\":true,\"damage\":" + json_string(i.damage) + "}";
  s += ",\"parent\":" + json_string(i.parent) + ",\"label\":" + json_string(i.label) + ",\"time_ns\":" + std::to_string(i.time_ns) +
       ",\"logical_bytes\":" + std::to_string(i.logical_bytes) + ",\"stored_bytes\":" + std::to_string(i.stored_bytes) +
       ",\"chunks\":" + std::to_string(i.chunks) + ",\"zero_chunks\":" + std::to_string(i.zero_chunks) +
       ",\"chunks_read\":" + std::to_string(i.chunks_read) + ",\"tracking\":" + json_string(i.tracking) + ",\"damaged\":false,\"regions\":[";
  for (std::size_t k = 0; k < i.regions.size(); ++k)
    s += (k ? "," : "") + std::string("{\"name\":") + json_string(i.regions[k].name) + ",\"size\":" + std::to_string(i.regions[k].size) +
         ",\"sdk_owned\":" + (i.regions[k].sdk_owned ? "true" : "false") + "}";
  return s + "]}";
}

std::string snapshots_json(const std::vector<SnapshotInfo>& snaps) {
  std::string out = "[";
  for (std::size_t k = 0; k < snaps.size(); ++k)
    out += (k ? "," : "") + info_json(snaps[k]);
  return out + "]";
}

int cmd_ls(Args& a) {
  a.json = a.take_flag("--json");
  std::string session = a.rest.empty() ? "" : a.rest.front();
  if (session.rfind("--", 0) == 0) throw Error(Errc::invalid_argument, "unknown option '" + session + "' for `dvr ls`; see `dvr --help`");
  if (!a.rest.empty()) a.rest.erase(a.rest.begin());
  a.no_more();
  Store store = open_store(a, false);
  auto snaps = session.empty() ? store.list() : store.list(session);
  if (a.json) {
    std::cout << snapshots_json(snaps) << "\n";
    return 0;
  }
  if (snaps.empty()) {
    std::cout << (session.empty() ? "no snapshots in " + store.path() : "no snapshots in session '" + session + "'") << "\n";
    return 0;
  }
  std::printf("%-32s %-19s %10s %10s  %s\n", "SNAPSHOT", "TIME", "SIZE", "ADDED", "LABEL");
  for (auto& i : snaps) {
    std::string ref = i.session + "/" + i.name;
    if (i.damaged) {
      std::printf("%-32s DAMAGED: %s\n", ref.c_str(), i.damage.c_str());
      continue;
    }
    std::printf("%-32s %-19s %10s %10s  %s\n", ref.c_str(), format_time(i.time_ns).c_str(),
                format_bytes(static_cast<double>(i.logical_bytes)).c_str(), format_bytes(static_cast<double>(i.stored_bytes)).c_str(),
                i.label.c_str());
  }
  return 0;
}

int cmd_info(Args& a) {
  a.json = a.take_flag("--json");
  if (a.rest.size() != 1) throw Error(Errc::invalid_argument, "usage: dvr info SESSION/NAME [--json]");
  auto [session, name] = dvr::split_ref(a.rest.front());
  Store store = open_store(a, false);
  SnapshotInfo i = store.info(session, name);
  if (a.json) {
    std::cout << info_json(i) << "\n";
    return 0;
  }
  std::cout << "snapshot  " << i.session << "/" << i.name << "\n"
            << "time      " << format_time(i.time_ns) << "\n"
            << "parent    " << (i.parent.empty() ? "(none)" : i.parent) << "\n"
            << "label     " << i.label << "\n"
            << "size      " << format_bytes(static_cast<double>(i.logical_bytes)) << " (" << i.logical_bytes << " bytes)\n"
            << "added     " << format_bytes(static_cast<double>(i.stored_bytes)) << " to the store when taken\n"
            << "chunks    " << i.chunks << " (" << i.zero_chunks << " all-zero, not stored)\n"
            << "taken     " << (i.tracking == "write_protect" ? "incrementally (write-protect tracking): " : "by reading all memory (hash): ")
            << i.chunks_read << " chunk(s) read\n"
            << "regions   " << i.regions.size() << "\n";
  for (auto& r : i.regions)
    std::cout << "  " << r.name << "  " << format_bytes(static_cast<double>(r.size)) << " (" << r.size << " bytes)"
              << (r.sdk_owned ? "  sdk-owned" : "  tracked") << "\n";
  return 0;
}

int cmd_rm(Args& a) {
  if (a.rest.empty()) throw Error(Errc::invalid_argument, "usage: dvr rm SESSION/NAME...");
  Store store = open_store(a, false);
  for (auto& ref : a.rest) {  // check every reference before removing any
    auto [session, name] = dvr::split_ref(ref);
    try {
      store.info(session, name);
    } catch (const Error& e) {
      if (e.code() != Errc::corrupt) throw;  // a damaged snapshot can still be removed
    }
  }
  for (auto& ref : a.rest) {
    auto [session, name] = dvr::split_ref(ref);
    store.remove(session, name);
    std::cout << "removed " << ref << "\n";
  }
  std::cout << "run `dvr gc` to reclaim the space\n";
  return 0;
}

int cmd_gc(Args& a) {
  a.json = a.take_flag("--json");
  a.no_more();
  Store store = open_store(a, false);
  GcReport r = store.gc();
  double freed = static_cast<double>(r.bytes_before > r.bytes_after ? r.bytes_before - r.bytes_after : 0);
  if (a.json) {
    std::cout << "{\"bytes_before\":" << r.bytes_before << ",\"bytes_after\":" << r.bytes_after << ",\"packs_removed\":" << r.packs_removed
              << ",\"temp_files_removed\":" << r.temp_files_removed << "}\n";
    return 0;
  }
  std::cout << "gc: reclaimed " << format_bytes(freed) << " (" << format_bytes(static_cast<double>(r.bytes_before)) << " -> "
            << format_bytes(static_cast<double>(r.bytes_after)) << "), " << r.packs_removed << " pack file(s) removed, " << r.temp_files_removed
            << " leftover temporary file(s) removed\n";
  return 0;
}

int cmd_verify(Args& a) {
  a.json = a.take_flag("--json");
  a.no_more();
  Store store = open_store(a, false);
  bool tty = ::isatty(STDERR_FILENO) && !a.json;
  double last = 0;
  VerifyReport r = store.verify([&](std::uint64_t done, std::uint64_t total) {
    double now = seconds_now();
    if (!tty || (now - last < 0.2 && done < total)) return;
    last = now;
    std::fprintf(stderr, "\rverify: %3.0f%% (%s of %s)", total ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0,
                 format_bytes(static_cast<double>(done)).c_str(), format_bytes(static_cast<double>(total)).c_str());
  });
  if (tty) std::fprintf(stderr, "\r\033[K");
  if (a.json) {
    std::cout << "{\"ok\":" << (r.ok() ? "true" : "false") << ",\"snapshots\":" << r.snapshots << ",\"chunks\":" << r.chunks
              << ",\"bytes\":" << r.bytes << ",\"damaged\":[";
    auto d = r.damaged_snapshots();
    for (std::size_t k = 0; k < d.size(); ++k)
      std::cout << (k ? "," : "") << json_string(d[k]);
    std::cout << "],\"problems\":[";
    for (std::size_t k = 0; k < r.problems.size(); ++k)
      std::cout << (k ? "," : "") << "{\"session\":" << json_string(r.problems[k].session) << ",\"snapshot\":" << json_string(r.problems[k].snapshot)
                << ",\"what\":" << json_string(r.problems[k].what) << "}";
    std::cout << "]}\n";
    return r.ok() ? 0 : 1;
  }
  std::cout << "verified " << r.snapshots << " snapshot(s), " << r.chunks << " stored chunk(s), " << format_bytes(static_cast<double>(r.bytes))
            << "\n";
  if (r.ok()) {
    std::cout << "ok: no damage found\n";
    return 0;
  }
  for (auto& p : r.problems)
    std::cout << "DAMAGED " << (p.snapshot.empty() ? p.session : p.session + "/" + p.snapshot) << ": " << p.what << "\n";
  std::cout << r.damaged_snapshots().size() << " damaged snapshot(s)\n";
  return 1;
}

int cmd_stat(Args& a) {
  a.json = a.take_flag("--json");
  a.no_more();
  Store store = open_store(a, false);
  StoreStats s = store.stats();
  if (a.json) {
    std::cout << "{\"path\":" << json_string(s.path) << ",\"medium\":\"" << medium_name(s.medium) << "\",\"format_version\":" << s.format_version
              << ",\"chunk_size\":" << s.chunk_size << ",\"sessions\":" << s.sessions << ",\"snapshots\":" << s.snapshots
              << ",\"logical_bytes\":" << s.logical_bytes << ",\"pack_bytes\":" << s.pack_bytes << ",\"pack_files\":" << s.pack_files << "}\n";
    return 0;
  }
  std::cout << "store      " << s.path << "\n"
            << "medium     " << medium_name(s.medium) << (s.medium == Medium::dram ? "  (tmpfs: survives process crashes, NOT reboots)" : "") << "\n"
            << "format     " << s.format_version << ", chunk size " << format_bytes(s.chunk_size) << "\n"
            << "sessions   " << s.sessions << ", snapshots " << s.snapshots << "\n"
            << "logical    " << format_bytes(static_cast<double>(s.logical_bytes)) << " in all snapshots\n"
            << "stored     " << format_bytes(static_cast<double>(s.pack_bytes)) << " in " << s.pack_files << " pack file(s)\n";
  return 0;
}

// The one positional argument of a command that also takes --json.
std::string single_argument(Args& a, const char* usage) {
  a.json = a.take_flag("--json");
  if (a.rest.size() != 1) throw Error(Errc::invalid_argument, std::string("usage: ") + usage);
  return a.rest.front();
}

int cmd_log(Args& a) {
  std::string session = single_argument(a, "dvr log SESSION [--json]");
  Store store = open_store(a, false);
  auto snaps = store.list(session);
  if (a.json) {
    std::cout << snapshots_json(snaps) << "\n";
    return 0;
  }
  if (snaps.empty()) {
    std::cout << "no snapshots in session '" << session << "'\n";
    return 0;
  }
  // Children by parent, oldest first; roots are snapshots whose parent is
  // empty or no longer exists.
  std::map<std::string, std::vector<const SnapshotInfo*>> children;
  std::set<std::string> names;
  for (auto& i : snaps)
    names.insert(i.name);
  std::vector<const SnapshotInfo*> roots;
  for (auto& i : snaps) {
    if (!i.damaged && !i.parent.empty() && names.count(i.parent) && i.parent != i.name)
      children[i.parent].push_back(&i);
    else
      roots.push_back(&i);
  }
  std::function<void(const SnapshotInfo*, const std::string&, bool, bool)> draw = [&](const SnapshotInfo* i, const std::string& prefix, bool last,
                                                                                      bool root) {
    std::string line = root ? "" : prefix + (last ? "`-- " : "|-- ");
    if (i->damaged) {
      std::cout << line << i->name << "  DAMAGED: " << i->damage << "\n";
    } else {
      std::printf("%s%s  %s  +%s%s%s\n", line.c_str(), i->name.c_str(), format_time(i->time_ns).c_str(),
                  format_bytes(static_cast<double>(i->stored_bytes)).c_str(), i->label.empty() ? "" : "  ", i->label.c_str());
    }
    auto& kids = children[i->name];
    std::string next = root ? "" : prefix + (last ? "    " : "|   ");
    for (std::size_t k = 0; k < kids.size(); ++k)
      draw(kids[k], next, k + 1 == kids.size(), false);
  };
  for (auto* r : roots)
    draw(r, "", true, true);
  return 0;
}

int cmd_diff(Args& a) {
  a.json = a.take_flag("--json");
  if (a.rest.size() != 2) throw Error(Errc::invalid_argument, "usage: dvr diff SESSION/A SESSION/B [--json]");
  auto [sa, na] = dvr::split_ref(a.rest[0]);
  auto [sb, nb] = dvr::split_ref(a.rest[1]);
  Store store = open_store(a, false);
  auto diffs = store.diff(sa, na, sb, nb);
  if (a.json) {
    std::cout << "[";
    for (std::size_t k = 0; k < diffs.size(); ++k) {
      auto& d = diffs[k];
      std::cout << (k ? "," : "") << "{\"region\":" << json_string(d.name) << ",\"size_a\":" << d.size_a << ",\"size_b\":" << d.size_b
                << ",\"only_in_a\":" << (d.only_in_a ? "true" : "false") << ",\"only_in_b\":" << (d.only_in_b ? "true" : "false")
                << ",\"bytes_differ\":" << d.bytes_differ << ",\"pages_differ\":" << d.pages_differ << "}";
    }
    std::cout << "]\n";
    return 0;
  }
  std::printf("%-24s %14s %12s  %s\n", "REGION", "BYTES DIFFER", "PAGES", "NOTE");
  for (auto& d : diffs) {
    std::string note = d.only_in_a            ? "only in " + a.rest[0]
                       : d.only_in_b          ? "only in " + a.rest[1]
                       : d.size_a != d.size_b ? "size " + std::to_string(d.size_a) + " -> " + std::to_string(d.size_b)
                       : d.bytes_differ == 0  ? "identical"
                                              : "";
    std::printf("%-24s %14llu %12llu  %s\n", d.name.c_str(), static_cast<unsigned long long>(d.bytes_differ),
                static_cast<unsigned long long>(d.pages_differ), note.c_str());
  }
  return 0;
}

int cmd_recover(Args& a) {
  std::string session = single_argument(a, "dvr recover SESSION [--json]");
  Store store = open_store(a, false);
  std::vector<std::string> skipped;
  auto found = store.latest(session, &skipped);
  if (a.json) {
    std::cout << "{\"latest\":" << (found ? info_json(*found) : "null") << ",\"skipped\":[";
    for (std::size_t k = 0; k < skipped.size(); ++k)
      std::cout << (k ? "," : "") << json_string(skipped[k]);
    std::cout << "]}\n";
    return found ? 0 : 1;
  }
  for (auto& s : skipped)
    std::cout << "skipped (damaged) " << s << "\n";
  if (!found) {
    std::cout << "no intact snapshot in session '" << session << "'\n";
    return 1;
  }
  std::cout << "newest intact snapshot: " << session << "/" << found->name << "  (" << format_time(found->time_ns) << ")\n"
            << "restore it with Session::restore(\"" << found->name << "\")\n";
  return 0;
}

std::string proc_json(const proc::ProcInfo& p) {
  std::string s = "{\"name\":" + json_string(p.name) + ",\"time_ns\":" + std::to_string(p.time_ns) + ",\"pid\":" + std::to_string(p.pid) +
                  ",\"own_pid_namespace\":" + (p.own_pid_namespace ? "true" : "false") + ",\"command\":" + json_string(p.command) +
                  ",\"criu_version\":" + json_string(p.criu_version) + ",\"leave_running\":" + (p.leave_running ? "true" : "false") +
                  ",\"tcp_established\":" + (p.tcp_established ? "true" : "false") + ",\"image_bytes\":" + std::to_string(p.image_bytes) +
                  ",\"stored_bytes\":" + std::to_string(p.stored_bytes) + ",\"parent\":" + json_string(p.parent) + ",\"heaps\":[";
  for (std::size_t k = 0; k < p.heaps.size(); ++k)
    s += (k ? "," : "") + std::string("{\"path\":") + json_string(p.heaps[k].path) + ",\"bytes\":" + std::to_string(p.heaps[k].bytes) + "}";
  s += "]";
  if (p.seconds > 0) s += ",\"seconds\":" + std::to_string(p.seconds);
  return s + "}";
}

pid_t parse_pid(const std::string& text) {
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end || v <= 0 || v > 0x7fffffff) throw Error(Errc::invalid_argument, "'" + text + "' is not a process ID");
  return static_cast<pid_t>(v);
}

int cmd_proc(Args& a) {
  if (a.rest.empty()) throw Error(Errc::invalid_argument, "dvr proc needs a verb: dump, restore, clone, ls, info, rm or check; see `dvr --help`");
  std::string verb = a.rest.front();
  a.rest.erase(a.rest.begin());
  a.command = "proc " + verb;
  a.json = a.take_flag("--json");
  if (verb == "check") {
    a.no_more();
    proc::Preflight p = proc::preflight();
    auto status = [](const proc::Capability& c) { return !c.checked ? "skipped" : c.ok ? "ok" : "missing"; };
    if (a.json) {
      std::string s = "{\"ok\":" + std::string(p.ok ? "true" : "false") + ",\"criu\":" + json_string(p.criu) +
                      ",\"criu_version\":" + json_string(p.criu_version) + ",\"plugin\":" + json_string(p.plugin) + ",\"problems\":[";
      for (std::size_t k = 0; k < p.problems.size(); ++k)
        s += (k ? "," : "") + json_string(p.problems[k]);
      s += "],\"capabilities\":[";
      for (std::size_t k = 0; k < p.capabilities.size(); ++k) {
        const auto& c = p.capabilities[k];
        s += (k ? "," : "") + std::string("{\"name\":") + json_string(c.name) + ",\"status\":\"" + status(c) +
             "\",\"ok\":" + (c.ok ? "true" : "false") + ",\"required\":" + (c.required ? "true" : "false") + ",\"detail\":" + json_string(c.detail) +
             "}";
      }
      std::cout << s << "]}\n";
    } else {
      // One line per capability: its status, its name, what was found or
      // what to do (an optional one missing says so).
      for (auto& c : p.capabilities) {
        std::string st = status(c), name = c.name;
        st.resize(std::max<std::size_t>(st.size() + 1, 9), ' ');
        name.resize(std::max<std::size_t>(name.size() + 1, 17), ' ');
        // A detail of several lines (CRIU's errors) goes on under the first.
        std::string detail, line;
        std::istringstream in(c.detail);
        for (bool first = true; std::getline(in, line); first = false) {
          if (!first) line.erase(0, line.find_first_not_of(' '));
          detail += (first ? "" : "\n" + std::string(st.size() + name.size() + 2, ' ')) + line;
        }
        std::cout << st << name << (!c.required && c.checked && !c.ok ? "optional: " : "") << detail << "\n";
      }
      for (auto& x : p.problems)
        std::cerr << "dvr: " << x << "\n";
      if (p.ok)
        std::cout << "ready: processes can be dumped and restored\n";
      else
        std::cout << "not ready: " << p.problems.size() << (p.problems.size() == 1 ? " capability is" : " capabilities are") << " missing (above)\n";
    }
    return p.ok ? 0 : 1;
  }
  if (verb == "dump") {
    proc::DumpOptions o;
    o.leave_running = a.take_flag("--leave-running");
    o.tcp_established = a.take_flag("--tcp-established");
    std::string name = a.take_option("--name", "");
    if (a.rest.size() != 1 || name.empty())
      throw Error(Errc::invalid_argument, "usage: dvr proc dump PID --name NAME [--leave-running] [--tcp-established] [--json]");
    pid_t pid = parse_pid(a.rest.front());
    Store store = open_store(a, true);
    proc::ProcInfo p = proc::dump(store, pid, name, o);
    if (a.json) {
      std::cout << proc_json(p) << "\n";
    } else {
      std::cout << "dumped process " << p.pid << " as proc/" << p.name << " in " << format_seconds(p.seconds) << ": "
                << format_bytes(static_cast<double>(p.image_bytes)) << " of CRIU images, " << format_bytes(static_cast<double>(p.stored_bytes))
                << " added to the store" << (p.parent.empty() ? "" : " (compared with proc/" + p.parent + ")") << "\n";
      for (auto& h : p.heaps)
        std::cout << "  heap " << h.path << " (" << format_bytes(static_cast<double>(h.bytes)) << ") snapshotted as " << h.session << "/"
                  << proc::kHeapPrefix << p.name << "\n";
      std::cout << (o.leave_running ? "the process keeps running\n" : "the process was stopped\n");
      if (o.tcp_established)
        std::cout << "its established TCP connections were dumped (their peers' packets wait until they are restored); "
                     "`dvr proc restore "
                  << p.name << "` restores them\n";
    }
    return 0;
  }
  if (verb == "restore" || verb == "clone") {
    proc::RestoreOptions o;
    o.clone = verb == "clone";
    o.detach = o.clone || a.take_flag("--detach");
    o.pidfile = a.take_option("--pidfile", "");
    // Taken for restore too, so that the library says they are for clones.
    o.net = a.take_option("--net", "");
    o.ip = a.take_option("--ip", "");
    o.host_ip = a.take_option("--host-ip", "");
    o.tcp_established = a.take_flag("--tcp-established");
    if (a.rest.size() != 1)
      throw Error(Errc::invalid_argument, "usage: dvr proc " + verb + " NAME " +
                                              (o.clone ? "[--net new|NETNS] [--ip ADDR/PREFIX [--host-ip ADDR]] " : "[--detach] ") +
                                              "[--pidfile FILE] [--tcp-established] [--json]");
    Store store = open_store(a, false);
    // A dump with established connections restores them by itself (a clone
    // closes them, the original still holding them): say so.
    proc::ProcInfo before = proc::info(store, a.rest.front());
    if (before.tcp_established && !o.tcp_established)
      std::cerr
          << "dvr: "
          << (o.clone ? "note: proc/" + before.name +
                            " was dumped with --tcp-established; the clone gets its TCP connections closed (--tcp-close), as the original holds them"
                      : "note: proc/" + before.name + " was dumped with --tcp-established: restoring its TCP connections (--tcp-established)")
          << "\n";
    proc::RestoreResult r = proc::restore(store, a.rest.front(), o);
    for (auto& n : r.notes)
      std::cerr << "dvr: note: " << n << "\n";
    if (!o.detach) return r.exit_status;
    if (a.json) {
      std::cout << "{\"name\":" << json_string(a.rest.front()) << ",\"pid\":" << r.pid << ",\"seconds\":" << r.seconds;
      if (!r.net.empty()) std::cout << ",\"net\":" << json_string(r.net);
      if (!r.ip.empty())
        std::cout << ",\"ip\":" << json_string(r.ip) << ",\"host_ip\":" << json_string(r.host_ip) << ",\"host_if\":" << json_string(r.host_if);
      std::cout << "}\n";
    } else {
      if (!r.ip.empty())
        std::cerr << "dvr: clone " << r.pid << " runs in a network namespace of its own at " << r.ip << " (host end " << r.host_if << " at "
                  << r.host_ip << "); it goes when the clone exits; run commands in it with nsenter -t " << r.pid << " -n CMD\n";
      else if (!r.net.empty())
        std::cerr << "dvr: clone " << r.pid << " runs in network namespace " << r.net << "\n";
      std::cout << r.pid << "\n";
    }
    return 0;
  }
  if (verb == "ls" || verb == "info") {
    std::string name;
    if (verb == "info") {
      if (a.rest.size() != 1) throw Error(Errc::invalid_argument, "usage: dvr proc info NAME [--json]");
      name = a.rest.front();
      a.rest.clear();
    }
    a.no_more();
    Store store = open_store(a, false);
    std::vector<proc::ProcInfo> all = verb == "ls" ? proc::list(store) : std::vector<proc::ProcInfo>{proc::info(store, name)};
    if (a.json) {
      if (verb == "info") {
        std::cout << proc_json(all.front()) << "\n";
      } else {
        std::cout << "[";
        for (std::size_t k = 0; k < all.size(); ++k)
          std::cout << (k ? "," : "") << proc_json(all[k]);
        std::cout << "]\n";
      }
      return 0;
    }
    for (auto& p : all) {
      std::cout << p.name << "  " << format_time(p.time_ns) << "  pid " << p.pid << "  images " << format_bytes(static_cast<double>(p.image_bytes))
                << "  stored " << format_bytes(static_cast<double>(p.stored_bytes));
      if (!p.heaps.empty()) std::cout << "  heaps " << p.heaps.size();
      std::cout << "  " << p.command << "\n";
    }
    return 0;
  }
  if (verb == "rm") {
    if (a.rest.empty()) throw Error(Errc::invalid_argument, "usage: dvr proc rm NAME...");
    Store store = open_store(a, false);
    for (auto& n : a.rest)
      proc::info(store, n);  // every name is checked before anything is removed
    for (auto& n : a.rest)
      proc::remove(store, n);
    return 0;
  }
  throw Error(Errc::invalid_argument, "unknown verb 'proc " + verb + "'; use dump, restore, clone, ls, info, rm or check");
}

// ---- moving snapshots -------------------------------------------------------

transfer::Options transfer_options(Args& a) {
  transfer::Options o;
  o.base = a.take_option("--base", "");
  std::string level = a.take_option("--level", "");
  std::string compress = a.take_option("--compress", "");
  if (!compress.empty()) o.compress = transfer::parse_compress(compress, "--compress");
  if (a.take_flag("--no-compress")) {
    if (!compress.empty() && o.compress != transfer::Compress::none)
      throw Error(Errc::invalid_argument, "--compress=" + compress + " and --no-compress exclude each other");
    o.compress = transfer::Compress::none;
  }
  if (!level.empty()) {
    if (o.compress == transfer::Compress::none) throw Error(Errc::invalid_argument, "--level and --compress=none (--no-compress) exclude each other");
    char* end = nullptr;
    long v = std::strtol(level.c_str(), &end, 10);
    if (*end || v < 1 || v > 19) throw Error(Errc::invalid_argument, "--level must be 1 to 19 (zstd), not '" + level + "'");
    o.level = static_cast<int>(v);
  }
  // Progress on a terminal: bytes, rate, ETA, ten times a second.
  if (::isatty(2)) {
    auto t0 = std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
    auto last = std::make_shared<double>(-1);
    o.progress = [t0, last](std::uint64_t done, std::uint64_t total) {
      double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - *t0).count();
      if (t - *last < 0.1 && done < total) return;
      *last = t;
      double rate = t > 0 ? static_cast<double>(done) / t : 0;
      double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0;
      std::fprintf(stderr, "\r  %s / %s  %s/s  ETA %s   ", format_bytes(static_cast<double>(done)).c_str(),
                   format_bytes(static_cast<double>(total)).c_str(), format_bytes(rate).c_str(), format_seconds(eta).c_str());
      if (done >= total) std::fprintf(stderr, "\n");
    };
  }
  return o;
}

std::string transfer_json(const transfer::Stats& st, bool sent) {
  std::string refs = "[";
  for (std::size_t k = 0; k < st.refs.size(); ++k)
    refs += (k ? "," : "") + json_string(st.refs[k]);
  refs += "]";
  std::ostringstream o;
  o << "{\"ref\":" << refs << ",\"base\":" << json_string(st.base) << ",\"logical_bytes\":" << st.logical_bytes
    << (sent ? ",\"sent_bytes\":" : ",\"received_bytes\":") << st.wire_bytes << ",\"data_bytes\":" << st.data_bytes
    << ",\"compression_ratio\":" << st.compression_ratio << ",\"chunks\":" << st.chunks << ",\"chunks_skipped\":" << st.chunks_skipped
    << ",\"stored_bytes\":" << st.stored_bytes;
  if (sent)
    o << ",\"chunks_compressed\":" << st.chunks_compressed << ",\"chunks_raw\":" << st.chunks_raw << ",\"read_bytes\":" << st.read_bytes;
  o << ",\"seconds\":" << st.seconds << "}";
  return o.str();
}

void print_transfer(const transfer::Stats& st, bool sent, bool json, std::ostream& out) {
  if (json) {
    out << transfer_json(st, sent) << "\n";
    return;
  }
  std::string refs;
  for (auto& r : st.refs)
    refs += (refs.empty() ? "" : ", ") + r;
  out << (sent ? "sent " : "received ") << refs << ": " << format_bytes(static_cast<double>(st.logical_bytes)) << " of snapshot data, "
      << format_bytes(static_cast<double>(st.wire_bytes)) << (sent ? " sent" : " received");
  if (st.data_bytes) out << " (compression " << std::fixed << std::setprecision(2) << st.compression_ratio << "x)";
  out << ", " << st.chunks_skipped << " of " << st.chunks << " chunks skipped"
      << (st.base.empty() ? std::string() : " (relative to " + st.base + ")");
  if (!sent) out << ", " << format_bytes(static_cast<double>(st.stored_bytes)) << " added to the store";
  out << ", " << format_seconds(st.seconds) << "\n";
}

struct SshTarget {
  std::string host;  // [user@]host
  std::string port;
  std::string path;
};

SshTarget parse_ssh_url(const std::string& url) {
  const std::string scheme = "ssh://";
  if (url.rfind(scheme, 0) != 0) throw Error(Errc::invalid_argument, "'" + url + "' is not an ssh://[USER@]HOST[:PORT]/STORE address");
  std::string rest = url.substr(scheme.size());
  auto slash = rest.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == rest.size())
    throw Error(Errc::invalid_argument, "'" + url + "' names no store path; write ssh://HOST/ABSOLUTE/PATH");
  SshTarget t;
  std::string authority = rest.substr(0, slash);
  t.path = rest.substr(slash);
  auto at = authority.rfind('@');
  auto colon = authority.find(':', at == std::string::npos ? 0 : at);
  if (colon != std::string::npos) {
    t.port = authority.substr(colon + 1);
    authority = authority.substr(0, colon);
    if (t.port.empty() || t.port.find_first_not_of("0123456789") != std::string::npos)
      throw Error(Errc::invalid_argument, "'" + url + "' has a bad port");
  }
  t.host = authority;
  if (t.host.empty() || t.host[0] == '-') throw Error(Errc::invalid_argument, "'" + url + "' has a bad host");
  return t;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s)
    out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs `ssh ... HOST REMOTE-COMMAND` with its stdin and stdout connected to
// us; its stderr (the far dvr's messages) goes to ours.
struct SshChild {
  pid_t pid = -1;
  int to = -1, from = -1;
  SshChild(const std::string& ssh, const SshTarget& t, const std::vector<std::string>& remote) {
    std::vector<std::string> argv;
    std::istringstream in(ssh);
    for (std::string w; in >> w;)
      argv.push_back(w);
    if (argv.empty()) throw Error(Errc::invalid_argument, "--ssh is empty");
    if (!t.port.empty()) {
      argv.push_back("-p");
      argv.push_back(t.port);
    }
    argv.push_back(t.host);
    std::string cmd;
    for (auto& r : remote)
      cmd += (cmd.empty() ? "" : " ") + shell_quote(r);
    argv.push_back(cmd);
    int a[2], b[2];
    if (::pipe2(a, O_CLOEXEC) != 0 || ::pipe2(b, O_CLOEXEC) != 0) throw Error(Errc::io, "cannot create pipes for ssh");
    pid = ::fork();
    if (pid < 0) throw Error(Errc::io, "cannot start ssh");
    if (pid == 0) {
      ::dup2(a[0], 0);
      ::dup2(b[1], 1);
      std::vector<char*> args;
      for (auto& x : argv)
        args.push_back(const_cast<char*>(x.c_str()));
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      std::fprintf(stderr, "dvr: cannot run %s: %s\n", args[0], std::strerror(errno));
      ::_exit(127);
    }
    ::close(a[0]);
    ::close(b[1]);
    to = a[1];
    from = b[0];
  }
  int finish() {
    if (to >= 0) ::close(to);
    if (from >= 0) ::close(from);
    to = from = -1;
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  ~SshChild() {
    if (pid > 0) {
      ::kill(pid, SIGTERM);
      finish();
    }
  }
};

int cmd_send(Args& a) {
  a.json = a.take_flag("--json");
  bool negotiate = a.take_flag("--negotiate");
  transfer::Options o = transfer_options(a);
  if (a.rest.size() != 1) throw Error(Errc::invalid_argument, "usage: dvr send REF [--base BASE] [--compress=auto|zstd|none] [--level N] [--json] > FILE");
  if (!negotiate && ::isatty(1))
    throw Error(Errc::invalid_argument, "dvr send writes a binary stream: redirect it (dvr send REF > FILE, or | dvr receive)");
  Store store = open_store(a, false);
  transfer::Stats st = negotiate ? transfer::send_negotiated(store, a.rest.front(), 0, 1, o) : transfer::send(store, a.rest.front(), 1, o);
  print_transfer(st, true, a.json, std::cerr);
  return 0;
}

int cmd_receive(Args& a) {
  a.json = a.take_flag("--json");
  bool negotiate = a.take_flag("--negotiate");
  a.no_more();
  Store store = open_store(a, true);
  transfer::Stats st = negotiate ? transfer::receive_negotiated(store, 0, 1) : transfer::receive(store, 0);
  print_transfer(st, false, a.json, negotiate ? std::cerr : std::cout);
  return 0;
}

int cmd_export(Args& a) {
  a.json = a.take_flag("--json");
  std::string file = a.take_option("-o", "");
  transfer::Options o = transfer_options(a);
  if (a.rest.size() != 1 || file.empty())
    throw Error(Errc::invalid_argument, "usage: dvr export REF -o FILE [--base BASE] [--compress=auto|zstd|none] [--level N] [--json]");
  Store store = open_store(a, false);
  // Written beside FILE, renamed over it when complete: no half files.
  std::string tmp = file + ".part-" + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) throw Error(errno == ENOENT ? Errc::not_found : Errc::io, "cannot create " + tmp + ": " + std::strerror(errno));
  transfer::Stats st;
  try {
    st = transfer::send(store, a.rest.front(), fd, o);
    if (::fsync(fd) != 0) throw Error(errno == ENOSPC ? Errc::no_space : Errc::io, "cannot write " + tmp + ": " + std::strerror(errno));
    ::close(fd);
    fd = -1;
    if (::rename(tmp.c_str(), file.c_str()) != 0) throw Error(Errc::io, "cannot rename " + tmp + " to " + file + ": " + std::strerror(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  print_transfer(st, true, a.json, std::cout);
  return 0;
}

int cmd_import(Args& a) {
  a.json = a.take_flag("--json");
  if (a.rest.size() != 1) throw Error(Errc::invalid_argument, "usage: dvr import FILE [--json]");
  int fd = ::open(a.rest.front().c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(errno == ENOENT ? Errc::not_found : Errc::io, "cannot open " + a.rest.front() + ": " + std::strerror(errno));
  Store store = open_store(a, true);
  transfer::Stats st;
  try {
    st = transfer::receive(store, fd);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  print_transfer(st, false, a.json, std::cout);
  return 0;
}

int cmd_push_pull(Args& a, bool push) {
  a.json = a.take_flag("--json");
  const char* env_ssh = std::getenv("DVR_SSH");
  std::string ssh = a.take_option("--ssh", env_ssh && *env_ssh ? env_ssh : "ssh");
  std::string remote_dvr = a.take_option("--remote-dvr", "dvr");
  transfer::Options o = transfer_options(a);
  if (a.rest.size() != 2)
    throw Error(Errc::invalid_argument, push ? "usage: dvr push REF ssh://[USER@]HOST[:PORT]/STORE [--ssh CMD] [--remote-dvr PATH] [--json]"
                                             : "usage: dvr pull ssh://[USER@]HOST[:PORT]/STORE REF [--ssh CMD] [--remote-dvr PATH] [--json]");
  std::string ref = push ? a.rest[0] : a.rest[1];
  SshTarget t = parse_ssh_url(push ? a.rest[1] : a.rest[0]);
  Store store = open_store(a, !push);
  std::vector<std::string> remote = {remote_dvr, "--store", t.path};
  if (push) {
    remote.insert(remote.end(), {"receive", "--negotiate"});
  } else {
    remote.insert(remote.end(), {"send", "--negotiate", ref});
    if (!o.base.empty()) remote.insert(remote.end(), {"--base", o.base});
    // Spelled so that a far dvr older than --compress understands the
    // default and none (it compresses every chunk, as zstd does).
    if (o.compress == transfer::Compress::none) {
      remote.push_back("--no-compress");
    } else {
      if (o.compress == transfer::Compress::zstd) remote.push_back("--compress=zstd");
      remote.insert(remote.end(), {"--level", std::to_string(o.level)});
    }
  }
  SshChild child(ssh, t, remote);
  transfer::Stats st;
  try {
    st = push ? transfer::send_negotiated(store, ref, child.from, child.to, o) : transfer::receive_negotiated(store, child.from, child.to);
  } catch (const Error& e) {
    int rc = child.finish();
    if (rc == 255) throw Error(Errc::io, "ssh to " + t.host + " failed (exit 255; see its message above)");
    throw;
  }
  int rc = child.finish();
  if (rc != 0) throw Error(Errc::io, "the far side (ssh " + t.host + ") exited with status " + std::to_string(rc) + " after the transfer");
  print_transfer(st, push, a.json, std::cout);
  return 0;
}

int cmd_run(Args& a) {
  auto dashes = std::find(a.rest.begin(), a.rest.end(), std::string("--"));
  const char* usage = "usage: dvr run [--output FILE] [--cwd DIR] [--heap [MAX] [--heap-session NAME]] -- CMD [ARGS...]";
  if (dashes == a.rest.end() || dashes + 1 == a.rest.end()) throw Error(Errc::invalid_argument, usage);
  std::vector<std::string> argv(dashes + 1, a.rest.end());
  a.rest.erase(dashes, a.rest.end());
  proc::RunOptions o;
  o.output = a.take_option("--output", "");
  o.cwd = a.take_option("--cwd", "");
  std::string session = a.take_option("--heap-session", "");
  // --heap [MAX]: the size is optional (default 4G).
  for (auto it = a.rest.begin(); it != a.rest.end(); ++it) {
    if (*it != "--heap" && it->rfind("--heap=", 0) != 0) continue;
    std::string size = *it == "--heap" ? "4G" : it->substr(7);
    auto next = it + 1;
    if (*it == "--heap" && next != a.rest.end() && next->rfind("--", 0) != 0) {
      size = *next;
      a.rest.erase(next);
    }
    o.heap_bytes = parse_size(size);
    a.rest.erase(it);
    break;
  }
  a.no_more();
  if (!session.empty() && !o.heap_bytes) throw Error(Errc::invalid_argument, "--heap-session goes with --heap");
  std::optional<Store> store;
  if (o.heap_bytes) {
    store = a.store_path.empty() ? Store::open_default() : Store::open(a.store_path);
    if (session.empty()) {
      std::string base = argv[0].substr(argv[0].find_last_of('/') + 1);
      for (char& c : base)
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') c = '-';
      session = "run-" + (base.empty() ? std::string("job") : base) + "-" + std::to_string(::time(nullptr));
    }
    o.heap_store = store->path();
    o.heap_session = session;
  }
  pid_t pid = proc::run(argv, o);
  std::cout << pid << "\n";
  if (o.heap_bytes)
    std::cerr << "dvr run: heap " << proc::heap_path(o.heap_store, session) << " (" << format_bytes(static_cast<double>(o.heap_bytes))
              << ", session " << session << "); dump it with `dvr proc dump " << pid << " --name NAME`\n";
  return 0;
}

int run(int argc, char** argv) {
  Args a;
  std::vector<std::string> args(argv + 1, argv + argc);
  for (std::size_t k = 0; k < args.size(); ++k) {
    const std::string& s = args[k];
    if (a.command.empty() && (s == "-h" || s == "--help" || s == "help")) {
      std::cout << kUsage;
      return 0;
    }
    if (a.command.empty() && s == "--version") {
      std::cout << "dvr " << dvr::version() << "\n";
      return 0;
    }
    if (s == "--store" || s.rfind("--store=", 0) == 0) {
      if (s == "--store") {
        if (k + 1 == args.size()) throw Error(Errc::invalid_argument, "--store needs a directory");
        a.store_path = args[++k];
      } else {
        a.store_path = s.substr(8);
      }
      continue;
    }
    if (!a.command.empty() && s == "--") {  // the rest is a command line (dvr run)
      a.rest.insert(a.rest.end(), args.begin() + static_cast<std::ptrdiff_t>(k), args.end());
      break;
    }
    if (a.command.empty())
      a.command = s;
    else
      a.rest.push_back(s);
  }
  for (auto& r : a.rest) {
    if (r == "--") break;
    if (r == "-h" || r == "--help") {
      std::cout << kUsage;
      return 0;
    }
  }
  if (a.command.empty()) {
    std::cerr << kUsage;
    return 2;
  }
  if (a.command == "ls") return cmd_ls(a);
  if (a.command == "info") return cmd_info(a);
  if (a.command == "rm") return cmd_rm(a);
  if (a.command == "gc") return cmd_gc(a);
  if (a.command == "verify") return cmd_verify(a);
  if (a.command == "stat") return cmd_stat(a);
  if (a.command == "log") return cmd_log(a);
  if (a.command == "diff") return cmd_diff(a);
  if (a.command == "recover") return cmd_recover(a);
  if (a.command == "proc") return cmd_proc(a);
  if (a.command == "run") return cmd_run(a);
  if (a.command == "send") return cmd_send(a);
  if (a.command == "receive") return cmd_receive(a);
  if (a.command == "export") return cmd_export(a);
  if (a.command == "import") return cmd_import(a);
  if (a.command == "push") return cmd_push_pull(a, true);
  if (a.command == "pull") return cmd_push_pull(a, false);
  if (a.command == "demo") {
    DemoOptions o;
    o.size = parse_size(a.take_option("--size", "1G"));
    o.trials = std::stoi(a.take_option("--trials", "5"));
    o.json = a.take_flag("--json");
    a.no_more();
    if (o.trials < 1) throw Error(Errc::invalid_argument, "--trials must be at least 1");
    StoreOptions so;
    Store store = a.store_path.empty() ? Store::open_default(so) : Store::open(a.store_path, so);
    return run_demo(store, o);
  }
  throw Error(Errc::invalid_argument, "unknown command '" + a.command + "'; see `dvr --help`");
}

}  // namespace

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);  // a closed pipe is an error message, not a silent death
  try {
    return run(argc, argv);
  } catch (const dvr::Error& e) {
    std::cerr << "dvr: " << e.what() << "\n";
    return e.code() == dvr::Errc::invalid_argument ? 2 : 1;
  } catch (const std::invalid_argument& e) {
    std::cerr << "dvr: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "dvr: " << e.what() << "\n";
    return 1;
  }
}
