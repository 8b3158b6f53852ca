// JSON documents and escaped text of the dvr command (output.hpp).
#include "output.hpp"

#include <cstdio>
#include <ctime>
#include <iostream>

namespace dvr::cli {

std::string utf8_safe(const std::string& s) { return dvr::utf8_safe(s); }  // the library's one UTF-8 rule (dvr/log.hpp)

std::string printable_lines(const std::string& s) {
  std::string out;
  std::size_t at = 0;
  for (;;) {
    const std::size_t nl = s.find('\n', at);
    out += printable(s.substr(at, nl == std::string::npos ? std::string::npos : nl - at));
    if (nl == std::string::npos) return out;
    out += '\n';
    at = nl + 1;
  }
}

std::string rfc3339(std::int64_t time_ns) {
  std::int64_t sec = time_ns / 1000000000, ns = time_ns % 1000000000;
  if (ns < 0) {
    ns += 1000000000;
    --sec;
  }
  std::time_t t = static_cast<std::time_t>(sec);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof buf - n, ".%09lldZ", static_cast<long long>(ns));
  return buf;
}

json to_json(const SnapshotInfo& i) {
  json regions = json::array();
  for (auto& r : i.regions)
    regions.push_back({{"name", jstr(r.name)}, {"size", r.size}, {"sdk_owned", r.sdk_owned}});
  return json{{"session", jstr(i.session)},
              {"name", jstr(i.name)},
              {"parent", jstr(i.parent)},
              {"label", jstr(i.label)},
              {"time_ns", i.time_ns},
              {"time", rfc3339(i.time_ns)},
              {"seq", i.seq},
              {"origin_time_ns", i.origin_time_ns},
              {"logical_bytes", i.logical_bytes},
              {"stored_bytes", i.stored_bytes},
              {"chunks", i.chunks},
              {"zero_chunks", i.zero_chunks},
              {"regions", std::move(regions)},
              {"tracking", jstr(i.tracking)},
              {"chunks_read", i.chunks_read},
              {"damaged", i.damaged},
              {"damage", jstr(i.damage)},
              {"pending", i.pending}};
}

json to_json(const std::vector<SnapshotInfo>& infos) {
  json a = json::array();
  for (auto& i : infos)
    a.push_back(to_json(i));
  return a;
}

json to_json(const RegionDiff& d) {
  return json{{"name", jstr(d.name)},         {"size_a", d.size_a},         {"size_b", d.size_b},
              {"only_in_a", d.only_in_a},     {"only_in_b", d.only_in_b},   {"bytes_differ", d.bytes_differ},
              {"pages_differ", d.pages_differ}};
}

json to_json(const VerifyReport& r) {
  json doc = document();
  doc["snapshots"] = r.snapshots;
  doc["chunks"] = r.chunks;
  doc["bytes"] = r.bytes;
  json problems = json::array();
  for (auto& p : r.problems)
    problems.push_back({{"session", jstr(p.session)}, {"snapshot", jstr(p.snapshot)}, {"what", jstr(p.what)}});
  doc["problems"] = std::move(problems);
  json damaged = json::array();
  for (auto& d : r.damaged_snapshots())
    damaged.push_back(jstr(d));
  doc["damaged_snapshots"] = std::move(damaged);
  json warnings = json::array();
  for (auto& w : r.warnings)
    warnings.push_back(jstr(w));
  doc["warnings"] = std::move(warnings);
  doc["ok"] = r.ok();
  return doc;
}

json to_json(const GcReport& r) {
  json doc = document();
  doc["bytes_before"] = r.bytes_before;
  doc["bytes_after"] = r.bytes_after;
  doc["packs_removed"] = r.packs_removed;
  doc["temp_files_removed"] = r.temp_files_removed;
  return doc;
}

json to_json(const StoreStats& s) {
  json doc = document();
  doc["path"] = jstr(s.path);
  doc["medium"] = medium_name(s.medium);
  doc["format_version"] = s.format_version;
  doc["chunk_size"] = s.chunk_size;
  doc["sessions"] = s.sessions;
  doc["snapshots"] = s.snapshots;
  doc["logical_bytes"] = s.logical_bytes;
  doc["pack_bytes"] = s.pack_bytes;
  doc["pack_files"] = s.pack_files;
  json warnings = json::array();
  for (auto& w : s.warnings)
    warnings.push_back(jstr(w));
  doc["warnings"] = std::move(warnings);
  return doc;
}

json to_json(const proc::ProcInfo& p) {
  json heaps = json::array();
  for (auto& h : p.heaps)
    heaps.push_back({{"path", jstr(h.path)}, {"bytes", h.bytes}, {"store", jstr(h.store)}, {"session", jstr(h.session)}, {"sealed", h.sealed}});
  json files = json::array();
  for (auto& f : p.files)
    files.push_back({{"path", jstr(f.path)}, {"size", f.size}, {"mtime_ns", f.mtime_ns}});
  return json{{"name", jstr(p.name)},
              {"time_ns", p.time_ns},
              {"time", rfc3339(p.time_ns)},
              {"seq", p.seq},
              {"origin_time_ns", p.origin_time_ns},
              {"pid", p.pid},
              {"own_pid_namespace", p.own_pid_namespace},
              {"command", jstr(p.command)},
              {"criu_version", jstr(p.criu_version)},
              {"kernel", jstr(p.kernel)},
              {"leave_running", p.leave_running},
              {"tcp_established", p.tcp_established},
              {"image_bytes", p.image_bytes},
              {"stored_bytes", p.stored_bytes},
              {"parent", jstr(p.parent)},
              {"heaps", std::move(heaps)},
              {"files", std::move(files)},
              {"seconds", p.seconds}};
}

json to_json(const transfer::Stats& st, bool sent) {
  json doc = document();
  json refs = json::array();
  for (auto& r : st.refs)
    refs.push_back(jstr(r));
  doc["ref"] = std::move(refs);
  doc["base"] = jstr(st.base);
  doc["logical_bytes"] = st.logical_bytes;
  doc[sent ? "sent_bytes" : "received_bytes"] = st.wire_bytes;
  doc["data_bytes"] = st.data_bytes;
  doc["compression_ratio"] = st.compression_ratio;
  doc["chunks"] = st.chunks;
  doc["chunks_skipped"] = st.chunks_skipped;
  doc["stored_bytes"] = st.stored_bytes;
  if (sent) {
    doc["chunks_compressed"] = st.chunks_compressed;
    doc["chunks_raw"] = st.chunks_raw;
    doc["read_bytes"] = st.read_bytes;
  }
  doc["signed_by"] = jstr(st.signed_by);
  doc["seconds"] = st.seconds;
  return doc;
}

json log_document(const std::string& session, const std::vector<SnapshotInfo>& snaps) {
  json doc = document();
  doc["session"] = jstr(session);
  doc["snapshots"] = to_json(snaps);
  return doc;
}

json prune_document(const std::string& session, const PruneReport& r) {
  json doc = document();
  doc["session"] = jstr(session);
  doc["dry_run"] = r.dry_run;
  doc["removed"] = r.removed;
  json decisions = json::array();
  for (auto& d : r.decisions) {
    json one;
    one["snapshot"] = to_json(d.snapshot);
    one["keep"] = d.keep;
    one["reason"] = jstr(d.reason);
    decisions.push_back(std::move(one));
  }
  doc["decisions"] = std::move(decisions);
  return doc;
}

json diff_document(const std::string& a, const std::string& b, const std::vector<RegionDiff>& regions) {
  json doc = document();
  doc["a"] = jstr(a);
  doc["b"] = jstr(b);
  json list = json::array();
  for (auto& d : regions)
    list.push_back(to_json(d));
  doc["regions"] = std::move(list);
  return doc;
}

json proc_ls_document(const std::vector<proc::ProcInfo>& all) {
  json doc = document();
  json list = json::array();
  for (auto& p : all)
    list.push_back(to_json(p));
  doc["processes"] = std::move(list);
  return doc;
}

json restore_document(const std::string& name, const proc::RestoreResult& r) {
  json doc = document();
  doc["name"] = jstr(name);
  doc["pid"] = r.pid;
  doc["seconds"] = r.seconds;
  if (!r.net.empty()) doc["net"] = jstr(r.net);
  if (!r.ip.empty()) {
    doc["ip"] = jstr(r.ip);
    doc["host_ip"] = jstr(r.host_ip);
    doc["host_if"] = jstr(r.host_if);
  }
  return doc;
}

json removed_document(const std::vector<std::string>& removed) {
  json doc = document();
  json list = json::array();
  for (auto& r : removed)
    list.push_back(jstr(r));
  doc["removed"] = std::move(list);
  return doc;
}

namespace {
bool g_document_printed = false;  // a command's own document (not an event line) went out
}  // namespace

void print_json(const json& doc) {
  std::cout << doc.dump() << "\n";
  if (!doc.contains("event")) g_document_printed = true;
}

bool document_printed() { return g_document_printed; }

json error_document(const std::string& code, const std::string& message, int exit_status) {
  json doc = document();
  doc["error"] = json{{"code", code}, {"message", jstr(message)}, {"exit_status", exit_status}};
  return doc;
}

bool json_requested(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--") return false;
    if (arg == "--json") return true;
  }
  return false;
}

}  // namespace dvr::cli
