// dvr serve: the HTTP server, the REST API and the dashboard's static files
// (serve.hpp; docs/dashboard.md; docs/openapi.json). cpp-httplib (Debian's
// libcpp-httplib, built with OpenSSL) does HTTP and TLS; everything a route
// answers is built from the library (dvr::Store, dvr::proc, dvr::transfer)
// and the documents of the dvr command (cli/output.hpp).
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <httplib.h>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "dvr/dvr.hpp"
#include "dvr/proc.hpp"
#include "dvr/transfer.hpp"
#include "dvr/jobs.hpp"
#include "cli_util.hpp"
#include "output.hpp"
#include "serve.hpp"

namespace dvr::server {

const char* openapi_text();  // docs/openapi.json, compiled in (openapi_doc.cpp.in)

namespace {

using cli::json;
using cli::jstr;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void log_line(const std::string& text) { std::cerr << "dvr serve: " + cli::printable(text) + "\n" << std::flush; }

// ---- errors as HTTP ---------------------------------------------------------

// An error the API answers: its status, code, message and hint.
struct ApiError : std::runtime_error {
  int status;
  std::string code, hint;
  ApiError(int s, std::string c, const std::string& message, std::string h = "")
      : std::runtime_error(message), status(s), code(std::move(c)), hint(std::move(h)) {}
};

int status_of(Errc c) {
  switch (c) {
    case Errc::not_found: return 404;
    case Errc::invalid_argument: return 400;
    case Errc::already_exists: return 409;
    case Errc::permission: return 403;
    case Errc::no_space: return 507;
    case Errc::unsupported: return 501;
    case Errc::cancelled: return 409;
    case Errc::corrupt: return 409;
    default: return 500;
  }
}

json error_body(const std::string& code, const std::string& message, const std::string& hint) {
  return json{{"code", code}, {"message", jstr(message)}, {"hint", jstr(hint)}};
}

void send_json(httplib::Response& res, int status, const json& doc) {
  res.status = status;
  res.set_header("Cache-Control", "no-store");
  res.set_content(doc.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void send_error(httplib::Response& res, int status, const std::string& code, const std::string& message, const std::string& hint = "") {
  json doc = cli::document();
  doc["error"] = error_body(code, message, hint);
  send_json(res, status, doc);
}

// ---- small helpers ----------------------------------------------------------

std::string read_private_file(const std::string& path, const char* option) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0)
    throw Error(Errc::not_found, std::string(option) + " " + path + ": " + std::strerror(errno));
  if (S_ISLNK(st.st_mode) || !S_ISREG(st.st_mode))
    throw Error(Errc::permission, std::string(option) + " " + path + " is not a regular file (a symbolic link is refused); give the file itself");
  if (st.st_uid != ::geteuid())
    throw Error(Errc::permission, std::string(option) + " " + path + " is owned by uid " + std::to_string(st.st_uid) + ", not by you (uid " +
                                      std::to_string(::geteuid()) + "); run `chown " + std::to_string(::geteuid()) + " " + path + "`");
  if (st.st_mode & 077) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw Error(Errc::permission, std::string(option) + " " + path + " has mode " + mode + ", readable by others; run `chmod 600 " + path + "`");
  }
  std::ifstream f(path);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back())))
    text.pop_back();
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front())))
    text.erase(0, 1);
  if (text.empty()) throw Error(Errc::invalid_argument, std::string(option) + " " + path + " is empty; write a token (e.g. `openssl rand -hex 32 > " + path + "`)");
  if (text.find_first_of(" \t\r\n") != std::string::npos || text.size() > 4096)
    throw Error(Errc::invalid_argument, std::string(option) + " " + path + " must hold one token: one line without spaces");
  return text;
}

std::string random_hex(std::size_t bytes) {
  std::ifstream f("/dev/urandom", std::ios::binary);
  std::string raw(bytes, '\0');
  f.read(raw.data(), static_cast<std::streamsize>(bytes));
  if (!f) throw Error(Errc::io, "cannot read /dev/urandom");
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out += hex[c >> 4];
    out += hex[c & 15];
  }
  return out;
}

bool equal_constant_time(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char d = 0;
  for (std::size_t k = 0; k < a.size(); ++k)
    d |= static_cast<unsigned char>(a[k] ^ b[k]);
  return d == 0;
}

std::string hostname() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

struct Space {
  std::uint64_t free = 0, total = 0;
  unsigned long fsid = 0;
};

Space space_of(const std::string& path) {
  struct statvfs v {};
  Space s;
  if (::statvfs(path.c_str(), &v) == 0) {
    s.free = static_cast<std::uint64_t>(v.f_bavail) * v.f_frsize;
    s.total = static_cast<std::uint64_t>(v.f_blocks) * v.f_frsize;
    s.fsid = v.f_fsid;
  }
  return s;
}

// Bytes the store's pack files occupy (their allocated blocks): cheap (one
// directory), unlike stats(), which reads every manifest.
std::uint64_t pack_bytes_on_disk(const std::string& store) {
  std::uint64_t total = 0;
  std::string dir = store + "/packs";
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      struct stat st {};
      if (e->d_name[0] != '.' && ::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode))
        total += static_cast<std::uint64_t>(st.st_blocks) * 512;
    }
    ::closedir(d);
  }
  return total;
}

std::uint64_t rss_of(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::strtoull(line.c_str() + 6, nullptr, 10) * 1024;
  return 0;
}

// "HOST:PORT" or "[V6]:PORT" → host, port.
std::pair<std::string, int> parse_listen(const std::string& text) {
  std::string host, port;
  if (!text.empty() && text[0] == '[') {
    auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':')
      throw Error(Errc::invalid_argument, "--listen '" + text + "' is not [ADDRESS]:PORT");
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    auto colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0) throw Error(Errc::invalid_argument, "--listen '" + text + "' is not HOST:PORT (e.g. 127.0.0.1:8642)");
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  char* end = nullptr;
  long p = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end || p < 0 || p > 65535) throw Error(Errc::invalid_argument, "--listen '" + text + "' has a bad port (0 to 65535; 0: any free one)");
  return {host, static_cast<int>(p)};
}

bool is_loopback(const std::string& host) {
  if (host == "localhost") return true;
  in_addr a4{};
  if (::inet_pton(AF_INET, host.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
  in6_addr a6{};
  if (::inet_pton(AF_INET6, host.c_str(), &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
  return false;
}

// ---- memory samples ---------------------------------------------------------

struct Sample {
  std::int64_t time_ns = 0;
  std::uint64_t mem_total = 0, mem_available = 0, mem_used = 0, cached = 0, swap_used = 0, pmem_total = 0, pmem_used = 0, store_bytes = 0;
};

json to_json(const Sample& s) {
  return json{{"time_ns", s.time_ns},     {"mem_total", s.mem_total},   {"mem_available", s.mem_available},
              {"mem_used", s.mem_used},   {"cached", s.cached},         {"swap_used", s.swap_used},
              {"pmem_total", s.pmem_total}, {"pmem_used", s.pmem_used}, {"store_bytes", s.store_bytes}};
}

std::map<std::string, std::uint64_t> read_meminfo() {
  std::map<std::string, std::uint64_t> m;
  std::ifstream f("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0;
  std::string unit;
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream in(line);
    if (in >> key >> kib) {
      if (!key.empty() && key.back() == ':') key.pop_back();
      m[key] = kib * 1024;
    }
  }
  return m;
}

// ---- the server's state -------------------------------------------------------

struct StoreEntry {
  std::string id, path;
  Medium medium = Medium::disk;
  std::atomic<bool> busy{false};  // an expensive action runs
  // What the checks found (under Server::mu_).
  std::set<std::string> damaged_flags;             // session/name flagged damaged by ls
  std::map<std::string, std::string> verify_damage;  // session/name → what, from the last verify
  std::int64_t last_verify_ns = 0;
  Space space;
  std::string permission_problem;
};

struct Operation {
  std::string id, action, store;
  std::atomic<std::uint64_t> done{0}, total{0};
  std::int64_t started_ns = 0;
  // Under Server::mu_:
  std::string state = "running";
  std::int64_t finished_ns = 0;
  json result, error;
};

struct Bucket {
  double tokens = 0;
  std::chrono::steady_clock::time_point last{};
};

struct Route {
  std::string method, path;  // path template: /api/v1/stores/{id}
};

const std::vector<std::string> kActions = {"verify", "gc", "prune", "rm", "proc-dump", "proc-restore", "proc-clone", "push"};
bool expensive(const std::string& action) { return action != "prune" && action != "rm"; }

class Server {
 public:
  explicit Server(const ServeOptions& o) : opt_(o) {}
  int run();

 private:
  ServeOptions opt_;
  std::string host_, token_, peer_token_, csrf_, origin_scheme_, web_root_;
  int port_ = 0;
  bool loopback_ = true;
  std::vector<std::unique_ptr<StoreEntry>> stores_;
  std::unique_ptr<httplib::Server> http_;
  std::vector<Route> routes_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<Sample> samples_;
  std::size_t capacity_ = 8640;
  std::deque<std::shared_ptr<Operation>> ops_;
  std::uint64_t next_op_ = 1;
  // Each operation's thread; finished ones are joined when the next starts.
  std::vector<std::pair<std::shared_ptr<Operation>, std::thread>> workers_;
  std::map<std::string, Bucket> buckets_;
  std::map<std::string, std::int64_t> alert_since_;
  // Peers: the cached answers and when they were fetched.
  std::mutex peers_mu_;
  std::vector<json> peer_hosts_;
  std::chrono::steady_clock::time_point peers_at_{};
  bool peers_fetched_ = false;

  void setup();
  void register_routes();
  void add(const std::string& method, const std::string& path, std::function<void(const httplib::Request&, httplib::Response&)> handler);
  bool guard(const httplib::Request& req, httplib::Response& res);
  void serve_static(const httplib::Request& req, httplib::Response& res);
  std::string fallback_page() const;
  std::string inject_meta(const std::string& html) const;

  StoreEntry& store_entry(const std::string& id);
  static Store open(const StoreEntry& e) { return Store::open(e.path); }
  static void check_name(const std::string& what, const std::string& name);
  static void require_session(const Store& store, const StoreEntry& e, const std::string& session);

  // id, free and total bytes, dedup ratio: what the server adds to a store's stat document.
  json store_extras(const StoreEntry& e, const StoreStats& st);
  json store_summary(const StoreEntry& e);
  json self_host();
  json hosts(bool local_only);
  json jobs_doc();
  json alerts_doc();
  std::vector<json> peers();

  void sampler();
  void checker();
  void check_store(StoreEntry& e);
  void take_sample();

  json operation_json(const Operation& op);
  std::shared_ptr<Operation> start_action(StoreEntry& e, const std::string& action, const json& body);
  // With op == nullptr only checks the body (fields, names, sessions and
  // snapshots that must exist): what start_action answers with 400/404 at
  // once, before an operation exists.
  json run_action(StoreEntry& e, Operation* op, const std::string& action, const json& body);
  json push(StoreEntry& e, Operation& op, const std::string& ref, const std::string& to);
  Progress progress_of(Operation& op);
};

// ---- setup ----------------------------------------------------------------------

void Server::setup() {
  auto [host, port] = parse_listen(opt_.listen);
  host_ = host;
  port_ = port;
  loopback_ = is_loopback(host);
  const bool tls = !opt_.tls_cert.empty() || !opt_.tls_key.empty();
  if (tls && (opt_.tls_cert.empty() || opt_.tls_key.empty()))
    throw Error(Errc::invalid_argument, "--tls-cert and --tls-key go together: give both PEM files (openssl req -x509 makes a pair)");
  if (!loopback_ && (opt_.token_file.empty() || !tls))
    throw Error(Errc::invalid_argument, "--listen " + opt_.listen + " is not a loopback address: serving it needs --token-file FILE (a private token) "
                                        "and --tls-cert/--tls-key (HTTPS); give them, or listen on 127.0.0.1");
  origin_scheme_ = tls ? "https" : "http";
  if (!opt_.token_file.empty()) token_ = read_private_file(opt_.token_file, "--token-file");
  if (!opt_.peer_token_file.empty()) peer_token_ = read_private_file(opt_.peer_token_file, "--peer-token-file");
  for (auto& p : opt_.peers)
    if (p.rfind("http://", 0) != 0 && p.rfind("https://", 0) != 0)
      throw Error(Errc::invalid_argument, "--peer '" + p + "' is not an http:// or https:// address of another dvr serve");
  if (opt_.sample_every_s < 0.05 || opt_.sample_every_s > 3600)
    throw Error(Errc::invalid_argument, "--sample-every must be from 0.05 to 3600 seconds");
  // At least 24 h of samples, and at least 8640; at most 1,000,000 (about 80 MB).
  capacity_ = static_cast<std::size_t>(std::clamp(86400.0 / opt_.sample_every_s + 1, 8640.0, 1000000.0));
  csrf_ = random_hex(24);

  std::vector<std::string> paths = opt_.stores;
  if (paths.empty()) paths.push_back(Store::default_path());
  std::map<std::string, int> used;
  for (auto& p : paths) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0)
      throw Error(Errc::not_found, "--store " + p + ": " + std::strerror(errno) + " (a store is made by its first snapshot, or `dvr --store " + p + " demo`)");
    if (!S_ISDIR(st.st_mode)) throw Error(Errc::invalid_argument, "--store " + p + " is not a directory");
    if (st.st_uid != ::geteuid())
      throw Error(Errc::permission, "store " + p + " is owned by uid " + std::to_string(st.st_uid) + ", not by you (uid " + std::to_string(::geteuid()) +
                                        "): run dvr serve as the store's owner");
    Store s = Store::open(p);  // not a store: the library's message
    for (auto& e : stores_)
      if (e->path == s.path()) throw Error(Errc::invalid_argument, "--store " + p + " is given twice");
    auto e = std::make_unique<StoreEntry>();
    e->path = s.path();
    e->medium = s.medium();
    std::string base = e->path.substr(e->path.find_last_of('/') + 1);
    std::string id;
    for (char c : base)
      id += (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.') ? c : '-';
    if (id.empty() || id[0] == '.') id = "store" + id;
    int n = ++used[id];
    if (n > 1) id += "-" + std::to_string(n);
    e->id = id;
    stores_.push_back(std::move(e));
  }

  if (!opt_.web_root.empty()) {
    struct stat st {};
    if (::stat(opt_.web_root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      throw Error(Errc::not_found, "--web-root " + opt_.web_root + " is not a directory (build the dashboard: cmake --build build --target dvr-web)");
    web_root_ = opt_.web_root;
  } else {
    char exe[PATH_MAX] = {};
    ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
    std::string dir = n > 0 ? std::string(exe, static_cast<std::size_t>(n)) : std::string();
    dir = dir.substr(0, dir.find_last_of('/'));
    for (const std::string& c : {dir + "/web", dir + "/../share/memory-dvr/web"}) {
      struct stat st {};
      if (::stat(c.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
        web_root_ = c;
        break;
      }
    }
  }
}

// ---- routes ---------------------------------------------------------------------

void Server::add(const std::string& method, const std::string& path, std::function<void(const httplib::Request&, httplib::Response&)> handler) {
  routes_.push_back({method, path});
  std::string re = std::regex_replace(path, std::regex(R"(\{[a-z_]+\})"), "([^/]+)");
  re = std::regex_replace(re, std::regex(R"(\.)"), "\\.");
  auto wrapped = [handler](const httplib::Request& req, httplib::Response& res) {
    try {
      handler(req, res);
    } catch (const ApiError& e) {
      if (e.status == 429) res.set_header("Retry-After", e.hint.empty() ? "1" : e.hint.substr(0, e.hint.find(' ')));
      send_error(res, e.status, e.code, e.what(), e.status == 429 ? "retry after " + res.get_header_value("Retry-After") + " s" : e.hint);
    } catch (const Error& e) {
      send_error(res, status_of(e.code()), errc_name(e.code()), e.what());
    } catch (const json::exception& e) {
      send_error(res, 400, "invalid_argument", std::string("bad JSON: ") + e.what(), "send a JSON object as docs/openapi.json describes");
    } catch (const std::exception& e) {
      send_error(res, 500, "internal", e.what());
    }
  };
  if (method == "GET")
    http_->Get(re, wrapped);
  else
    http_->Post(re, wrapped);
}

StoreEntry& Server::store_entry(const std::string& id) {
  for (auto& e : stores_)
    if (e->id == id) return *e;
  std::string known;
  for (auto& e : stores_)
    known += (known.empty() ? "" : ", ") + e->id;
  throw ApiError(404, "not_found", "no store '" + id + "' (stores: " + known + ")", "GET /api/v1/stores lists the stores by id");
}

void Server::check_name(const std::string& what, const std::string& name) {
  if (!is_valid_name(name))
    throw ApiError(400, "invalid_argument", what + " name '" + name + "' is not valid", "names are 1 to 128 characters of A-Z a-z 0-9 . _ -, not starting with '.'");
}

void Server::require_session(const Store& store, const StoreEntry& e, const std::string& session) {
  check_name("session", session);
  auto all = store.sessions();
  if (std::find(all.begin(), all.end(), session) == all.end())
    throw ApiError(404, "not_found", "no session '" + session + "' in store " + e.id,
                   "GET /api/v1/stores/" + e.id + "/sessions lists its sessions");
}

json Server::store_extras(const StoreEntry& e, const StoreStats& st) {
  Space sp = space_of(e.path);
  return json{{"id", e.id},
              {"free_bytes", sp.free},
              {"total_bytes", sp.total},
              {"dedup_ratio", st.pack_bytes ? static_cast<double>(st.logical_bytes) / static_cast<double>(st.pack_bytes) : 1.0}};
}

json Server::store_summary(const StoreEntry& e) {
  StoreStats st = open(e).stats();
  json stat = cli::to_json(st);  // the one serializer of StoreStats; the summary takes its main fields
  json out = store_extras(e, st);
  for (const char* k : {"path", "medium", "format_version", "sessions", "snapshots", "logical_bytes", "pack_bytes"})
    out[k] = stat.at(k);
  return out;
}

void Server::register_routes() {
  add("GET", "/api/v1/health", [this](const httplib::Request&, httplib::Response& res) {
    json doc = cli::document();
    doc["version"] = version();
    doc["host"] = jstr(hostname());
    std::int64_t t = now_ns();
    doc["time"] = cli::rfc3339(t);
    doc["time_ns"] = t;
    doc["stores"] = stores_.size();
    doc["peers"] = opt_.peers.size();
    doc["auth"] = token_.empty() ? "csrf" : "token";
    doc["tls"] = origin_scheme_ == "https";
    doc["sample_every_s"] = opt_.sample_every_s;
    send_json(res, 200, doc);
  });
  add("GET", "/api/v1/hosts", [this](const httplib::Request& req, httplib::Response& res) {
    send_json(res, 200, hosts(req.get_param_value("local") == "1"));
  });
  add("GET", "/api/v1/stores", [this](const httplib::Request&, httplib::Response& res) {
    json doc = cli::document();
    json list = json::array();
    for (auto& e : stores_)
      list.push_back(store_summary(*e));
    doc["stores"] = std::move(list);
    send_json(res, 200, doc);
  });
  add("GET", "/api/v1/stores/{id}", [this](const httplib::Request& req, httplib::Response& res) {
    StoreEntry& e = store_entry(req.matches[1]);
    StoreStats st = open(e).stats();
    json doc = cli::to_json(st);
    json sum = store_extras(e, st);
    doc.update(sum);
    // The stat document's own warnings (loosened permissions) first, then the server's.
    json warnings = doc.contains("warnings") ? doc["warnings"] : json::array();
    if (e.medium == Medium::dram) warnings.push_back("the store is on tmpfs (DRAM): it survives process crashes, not reboots");
    std::uint64_t fr = sum["free_bytes"], tot = sum["total_bytes"];
    if (tot && (fr * 10 < tot || fr < (1ull << 30))) warnings.push_back("low space: " + cli::format_bytes(static_cast<double>(fr)) + " free");
    {
      std::lock_guard lk(mu_);
      if (!e.permission_problem.empty() && std::find(warnings.begin(), warnings.end(), jstr(e.permission_problem)) == warnings.end())
        warnings.push_back(jstr(e.permission_problem));
    }
    doc["warnings"] = std::move(warnings);
    send_json(res, 200, doc);
  });
  add("GET", "/api/v1/stores/{id}/sessions", [this](const httplib::Request& req, httplib::Response& res) {
    StoreEntry& e = store_entry(req.matches[1]);
    Store s = open(e);
    std::map<std::string, std::vector<SnapshotInfo>> by;
    for (auto& i : s.list())
      by[i.session].push_back(i);
    json list = json::array();
    for (auto& [name, snaps] : by) {
      std::uint64_t logical = 0, stored = 0;
      const SnapshotInfo* latest = nullptr;
      for (auto& i : snaps) {
        logical += i.logical_bytes;
        stored += i.stored_bytes;
        if (!i.damaged && !i.pending && (!latest || i.time_ns >= latest->time_ns)) latest = &i;
      }
      list.push_back(json{{"name", jstr(name)},
                          {"snapshots", snaps.size()},
                          {"latest", latest ? cli::to_json(*latest) : json(nullptr)},
                          {"logical_bytes", logical},
                          {"stored_bytes", stored}});
    }
    json doc = cli::document();
    doc["store"] = e.id;
    doc["sessions"] = std::move(list);
    send_json(res, 200, doc);
  });
  add("GET", "/api/v1/stores/{id}/sessions/{session}/snapshots", [this](const httplib::Request& req, httplib::Response& res) {
    StoreEntry& e = store_entry(req.matches[1]);
    Store s = open(e);
    require_session(s, e, req.matches[2]);
    send_json(res, 200, cli::log_document(req.matches[2], s.list(req.matches[2])));
  });
  add("GET", "/api/v1/stores/{id}/sessions/{session}/snapshots/{name}", [this](const httplib::Request& req, httplib::Response& res) {
    StoreEntry& e = store_entry(req.matches[1]);
    Store s = open(e);
    require_session(s, e, req.matches[2]);
    check_name("snapshot", req.matches[3]);
    json doc = cli::document();
    try {
      doc.update(cli::to_json(s.info(req.matches[2], req.matches[3])));
    } catch (const Error& err) {
      if (err.code() != Errc::not_found) throw;
      throw ApiError(404, "not_found", err.what(), "GET /api/v1/stores/" + e.id + "/sessions/" + std::string(req.matches[2]) + "/snapshots lists them");
    }
    send_json(res, 200, doc);
  });
  add("GET", "/api/v1/stores/{id}/sessions/{session}/diff", [this](const httplib::Request& req, httplib::Response& res) {
    StoreEntry& e = store_entry(req.matches[1]);
    Store s = open(e);
    std::string session = req.matches[2];
    require_session(s, e, session);
    std::string a = req.get_param_value("a"), b = req.get_param_value("b");
    if (a.empty() || b.empty()) throw ApiError(400, "invalid_argument", "diff needs ?a=NAME&b=NAME", "two snapshot names of the session");
    check_name("snapshot", a);
    check_name("snapshot", b);
    send_json(res, 200, cli::diff_document(session + "/" + a, session + "/" + b, s.diff(session, a, session, b)));
  });
  add("GET", "/api/v1/stores/{id}/processes", [this](const httplib::Request& req, httplib::Response& res) {
    StoreEntry& e = store_entry(req.matches[1]);
    Store s = open(e);
    send_json(res, 200, cli::proc_ls_document(proc::list(s)));
  });
  add("GET", "/api/v1/jobs", [this](const httplib::Request&, httplib::Response& res) { send_json(res, 200, jobs_doc()); });
  // A record of an ended job that stays for its error (dump_failed,
  // autosave_failed): dismissing it removes the record and its alert.
  add("POST", "/api/v1/stores/{id}/jobs/{pid}/dismiss", [this](const httplib::Request& req, httplib::Response& res) {
    StoreEntry& e = store_entry(req.matches[1]);
    const std::string pid_text = req.matches[2];
    json body = req.body.empty() ? json::object() : json::parse(req.body);
    if (!body.is_object()) throw ApiError(400, "invalid_argument", "the body must be a JSON object", "{} or {\"session\": NAME} for an autosave");
    const std::string session = body.value("session", std::string());
    if (!session.empty()) check_name("session", session);
    for (auto& r : read_jobs(e.path)) {
      if (std::to_string(r.pid) != pid_text || r.session != session) continue;
      if (job_alive(r))
        throw ApiError(409, "busy", "job " + pid_text + " of store " + e.id + " still runs", "only the record of an ended job can be dismissed");
      remove_job(e.path, r);
      log_line("dismissed the job record of pid " + pid_text + (session.empty() ? "" : " session " + session) + " in store " + e.id);
      json doc = cli::document();
      doc["dismissed"] = true;
      send_json(res, 200, doc);
      return;
    }
    throw ApiError(404, "not_found", "no job record of pid " + pid_text + (session.empty() ? "" : " session " + session) + " in store " + e.id,
                   "GET /api/v1/jobs lists the jobs (an autosave's needs {\"session\": NAME})");
  });
  add("GET", "/api/v1/memory", [this](const httplib::Request& req, httplib::Response& res) {
    std::int64_t since = 0;
    if (req.has_param("since")) {
      std::string t = req.get_param_value("since");
      char* end = nullptr;
      errno = 0;
      since = std::strtoll(t.c_str(), &end, 10);
      if (t.empty() || *end || errno == ERANGE) throw ApiError(400, "invalid_argument", "since '" + t + "' is not a time in ns since the epoch", "e.g. ?since=0");
    }
    json doc = cli::document();
    doc["interval_s"] = opt_.sample_every_s;
    doc["capacity"] = capacity_;
    json list = json::array();
    {
      std::lock_guard lk(mu_);
      for (auto& s : samples_)
        if (s.time_ns > since) list.push_back(to_json(s));
    }
    doc["samples"] = std::move(list);
    send_json(res, 200, doc);
  });
  add("GET", "/api/v1/alerts", [this](const httplib::Request&, httplib::Response& res) { send_json(res, 200, alerts_doc()); });
  add("GET", "/api/v1/operations", [this](const httplib::Request&, httplib::Response& res) {
    json doc = cli::document();
    json list = json::array();
    std::lock_guard lk(mu_);
    for (auto& op : ops_)
      list.push_back(operation_json(*op));
    doc["operations"] = std::move(list);
    send_json(res, 200, doc);
  });
  add("GET", "/api/v1/operations/{id}", [this](const httplib::Request& req, httplib::Response& res) {
    std::string id = req.matches[1];
    std::lock_guard lk(mu_);
    for (auto& op : ops_)
      if (op->id == id) {
        json doc = cli::document();
        doc["operation"] = operation_json(*op);
        send_json(res, 200, doc);
        return;
      }
    throw ApiError(404, "not_found", "no operation '" + id + "' (finished ones are kept while they are among the newest 200)",
                   "GET /api/v1/operations lists them");
  });
  add("GET", "/api/v1/openapi.json", [this](const httplib::Request&, httplib::Response& res) {
    res.status = 200;
    res.set_content(openapi_text(), "application/json");
    res.set_header("Cache-Control", "no-store");
  });
  add("GET", "/api/v1/routes", [this](const httplib::Request&, httplib::Response& res) {
    json doc = cli::document();
    json list = json::array();
    for (auto& r : routes_)
      list.push_back(json{{"method", r.method}, {"path", r.path}});
    doc["routes"] = std::move(list);
    send_json(res, 200, doc);
  });
  for (auto& action : kActions)
    add("POST", "/api/v1/stores/{id}/actions/" + action, [this, action](const httplib::Request& req, httplib::Response& res) {
      StoreEntry& e = store_entry(req.matches[1]);
      json body = req.body.empty() ? json::object() : json::parse(req.body);
      if (!body.is_object()) throw ApiError(400, "invalid_argument", "the body must be a JSON object", "e.g. {} for verify");
      auto op = start_action(e, action, body);
      // A quick action finishes before the reply (then it says done).
      {
        std::unique_lock lk(mu_);
        cv_.wait_for(lk, std::chrono::milliseconds(300), [&] { return op->state != "running"; });
      }
      json doc = cli::document();
      {
        std::lock_guard lk(mu_);
        doc["operation"] = operation_json(*op);
      }
      send_json(res, 202, doc);
    });
}

// ---- security ---------------------------------------------------------------------

// Runs before routing: the Host check (no DNS rebinding on loopback), the
// token, and for mutating requests the same-origin and CSRF checks.
// Returns true when it answered the request (refused it).
bool Server::guard(const httplib::Request& req, httplib::Response& res) {
  res.set_header("X-Content-Type-Options", "nosniff");
  res.set_header("X-Frame-Options", "DENY");
  res.set_header("Referrer-Policy", "no-referrer");
  const std::string own_port = std::to_string(port_);
  const std::string host_header = req.get_header_value("Host");
  if (loopback_) {
    // The name of "NAME:PORT", "[V6]:PORT", "NAME" or "[V6]".
    std::string name = host_header;
    if (!name.empty() && name[0] == '[') {
      name = name.substr(1, name.find(']') == std::string::npos ? std::string::npos : name.find(']') - 1);
    } else if (name.find(':') != std::string::npos) {
      name = name.substr(0, name.find(':'));
    }
    if (!(name == "localhost" || is_loopback(name))) {
      send_error(res, 403, "forbidden", "Host '" + host_header + "' is not this loopback server",
                 "open the dashboard at " + origin_scheme_ + "://127.0.0.1:" + own_port + "/");
      return true;
    }
  }
  const bool api = req.path.rfind("/api/", 0) == 0;
  const bool mutating = req.method != "GET" && req.method != "HEAD" && req.method != "OPTIONS";
  if (mutating) {
    const std::string origin = req.get_header_value("Origin");
    const std::string own = origin_scheme_ + "://" + host_header;
    if (!origin.empty() && origin != own) {
      send_error(res, 403, "forbidden", "cross-origin request from '" + origin + "' refused", "only the dashboard of this server (" + own + ") may change things");
      return true;
    }
    const std::string site = req.get_header_value("Sec-Fetch-Site");
    if (!site.empty() && site != "same-origin" && site != "none") {
      send_error(res, 403, "forbidden", "cross-site request (Sec-Fetch-Site: " + site + ") refused", "only the dashboard of this server may change things");
      return true;
    }
  }
  const bool open_route = req.path == "/api/v1/health" || req.path == "/api/v1/openapi.json";
  if (api && !token_.empty() && (mutating || !open_route)) {
    const std::string auth = req.get_header_value("Authorization");
    if (auth.rfind("Bearer ", 0) != 0 || !equal_constant_time(auth.substr(7), token_)) {
      res.set_header("WWW-Authenticate", "Bearer");
      send_error(res, 401, "unauthorized", auth.empty() ? "this server needs a token" : "wrong token",
                 "send Authorization: Bearer TOKEN with the token of the server's --token-file");
      return true;
    }
  } else if (api && mutating && !equal_constant_time(req.get_header_value("X-DVR-CSRF"), csrf_)) {
    send_error(res, 403, "forbidden", "a change needs the X-DVR-CSRF header",
               "send the token of the dvr-csrf meta tag of this server's /index.html as X-DVR-CSRF");
    return true;
  }
  return false;
}

// ---- static files -------------------------------------------------------------

std::string Server::inject_meta(const std::string& html) const {
  std::string meta = "<meta name=\"dvr-csrf\" content=\"" + csrf_ + "\"><meta name=\"dvr-auth\" content=\"" + (token_.empty() ? "csrf" : "token") + "\">";
  std::string lower = html;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  auto head = lower.find("<head");
  if (head != std::string::npos) {
    auto close = lower.find('>', head);
    if (close != std::string::npos) return html.substr(0, close + 1) + meta + html.substr(close + 1);
  }
  return meta + html;
}

std::string Server::fallback_page() const {
  return inject_meta(
      "<!doctype html><html><head><meta charset=\"utf-8\"><title>Memory DVR</title></head><body>"
      "<h1>Memory DVR</h1><p>The dashboard's web assets are not built. Build them with</p>"
      "<pre>cmake --build build --target dvr-web</pre>"
      "<p>(README.md, \"Dashboard\"; it needs npm), then reload, or start <code>dvr serve --web-root DIR</code> with the built folder. "
      "The REST API works without them: <a href=\"/api/v1/openapi.json\">/api/v1/openapi.json</a>, "
      "<a href=\"/api/v1/stores\">/api/v1/stores</a>.</p></body></html>");
}

void Server::serve_static(const httplib::Request& req, httplib::Response& res) {
  res.set_header("Content-Security-Policy",
                 "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'");
  if (req.path.rfind("/api/", 0) == 0 || req.path == "/api") {
    send_error(res, 404, "not_found", "no such API route: " + req.method + " " + req.path, "GET /api/v1/routes lists the routes");
    return;
  }
  std::vector<std::string> parts;
  std::string cur;
  for (std::size_t k = 1; k <= req.path.size(); ++k) {
    if (k == req.path.size() || req.path[k] == '/') {
      if (!cur.empty()) parts.push_back(cur);
      cur.clear();
    } else {
      cur += req.path[k];
    }
  }
  for (auto& p : parts) {
    bool ok = !p.empty() && p[0] != '.' && p.size() <= 255;
    for (unsigned char c : p)
      ok = ok && (std::isalnum(c) || c == '.' || c == '_' || c == '-');
    if (!ok || parts.size() > 16) {
      res.status = 400;
      res.set_content("bad path\n", "text/plain");
      return;
    }
  }
  // A path without an extension is a page of the dashboard: index.html.
  bool page = parts.empty() || parts.back().find('.') == std::string::npos;
  if (page) parts = {"index.html"};
  int dir = web_root_.empty() ? -1 : ::open(web_root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  int fd = -1;
  for (std::size_t k = 0; dir >= 0 && k < parts.size(); ++k) {
    bool last = k + 1 == parts.size();
    int next = ::openat(dir, parts[k].c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | (last ? 0 : O_DIRECTORY));
    ::close(dir);
    dir = -1;
    if (next < 0) break;
    if (last)
      fd = next;
    else
      dir = next;
  }
  if (dir >= 0) ::close(dir);
  struct stat st {};
  if (fd >= 0 && (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > (64 << 20))) {
    ::close(fd);
    fd = -1;
  }
  if (fd < 0) {
    if (page) {
      res.status = 200;
      res.set_header("Cache-Control", "no-store");
      res.set_content(fallback_page(), "text/html; charset=utf-8");
    } else {
      res.status = 404;
      res.set_content("not found\n", "text/plain");
    }
    return;
  }
  std::string body(static_cast<std::size_t>(st.st_size), '\0');
  ssize_t n = ::pread(fd, body.data(), body.size(), 0);
  ::close(fd);
  body.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  const std::string& name = parts.back();
  std::string ext = name.substr(name.find_last_of('.') + 1);
  static const std::map<std::string, std::string> types = {
      {"html", "text/html; charset=utf-8"}, {"js", "text/javascript; charset=utf-8"}, {"mjs", "text/javascript; charset=utf-8"},
      {"css", "text/css; charset=utf-8"},   {"json", "application/json"},             {"svg", "image/svg+xml"},
      {"png", "image/png"},                 {"ico", "image/x-icon"},                  {"txt", "text/plain; charset=utf-8"},
      {"map", "application/json"},          {"woff2", "font/woff2"}};
  auto t = types.find(ext);
  if (name == "index.html") {
    body = inject_meta(body);
    res.set_header("Cache-Control", "no-store");
  }
  res.status = 200;
  res.set_content(body, t == types.end() ? "application/octet-stream" : t->second);
}

// ---- jobs, alerts, hosts ------------------------------------------------------------

json Server::jobs_doc() {
  json list = json::array();
  for (auto& e : stores_) {
    std::optional<Store> s;
    for (auto& r : read_jobs(e->path)) {
      bool alive = job_alive(r);
      if (!alive && r.last_error.empty()) {
        remove_job(e->path, r);  // gone without an error to report: stale
        continue;
      }
      const bool autosave = r.kind == "autosave";
      json last = nullptr, last_snapshot = nullptr;
      if (!r.last_dump.empty()) {
        try {
          if (!s) s = open(*e);
          if (autosave) {
            auto [session, name] = dvr::split_ref(r.last_dump);
            last_snapshot = cli::to_json(s->info(session, name));
          } else {
            last = cli::to_json(proc::info(*s, r.last_dump));
          }
        } catch (const Error&) {
          // removed since (--keep, autosave retention), or not readable
        }
      }
      std::uint64_t heap_bytes = 0;
      struct stat st {};
      if (!r.heap.empty() && ::stat(r.heap.c_str(), &st) == 0) heap_bytes = static_cast<std::uint64_t>(st.st_blocks) * 512;
      json next = nullptr;
      if (alive && r.interval_s > 0) next = (r.last_dump_ns ? r.last_dump_ns : r.started_ns) + static_cast<std::int64_t>(r.interval_s * 1e9);
      list.push_back(json{{"pid", r.pid},
                          {"store", e->id},
                          {"kind", r.kind == "dump_every" || r.kind == "autosave" ? r.kind : "run"},
                          {"session", r.session.empty() ? json(nullptr) : jstr(r.session)},
                          {"command", jstr(r.command)},
                          {"started_ns", r.started_ns},
                          {"rss_bytes", alive ? rss_of(r.pid) : 0},
                          {"heap", r.heap.empty() ? json(nullptr) : jstr(r.heap)},
                          {"heap_bytes", heap_bytes},
                          {"interval_s", r.interval_s > 0 ? json(r.interval_s) : json(nullptr)},
                          {"last_dump", last},
                          {"last_snapshot", last_snapshot},
                          {"last_dump_name", r.last_dump.empty() ? json(nullptr) : jstr(r.last_dump)},
                          {"next_dump_ns", next},
                          {"last_error", r.last_error.empty() ? json(nullptr) : jstr(r.last_error)},
                          {"alive", alive}});
    }
  }
  json doc = cli::document();
  doc["jobs"] = std::move(list);
  return doc;
}

json Server::alerts_doc() {
  struct A {
    std::string severity, kind, store, subject, message;
  };
  std::vector<A> found;
  {
    std::lock_guard lk(mu_);
    for (auto& e : stores_) {
      std::set<std::string> reported;
      for (auto& [ref, what] : e->verify_damage) {
        found.push_back({"error", "damaged_snapshot", e->id, ref, "verify found " + ref + " damaged: " + what + " (dvr rm it; dvr recover names the newest intact one)"});
        reported.insert(ref);
      }
      for (auto& ref : e->damaged_flags)
        if (!reported.count(ref)) found.push_back({"error", "damaged_snapshot", e->id, ref, ref + " is damaged (dvr rm it; dvr recover names the newest intact one)"});
      if (e->space.total && (e->space.free * 10 < e->space.total || e->space.free < (1ull << 30)))
        found.push_back({"warning", "low_space", e->id, e->path,
                         "store " + e->id + " has " + cli::format_bytes(static_cast<double>(e->space.free)) + " free of " +
                             cli::format_bytes(static_cast<double>(e->space.total)) + " (dvr prune and dvr gc reclaim space)"});
      if (!e->permission_problem.empty()) found.push_back({"warning", "permissions", e->id, e->path, e->permission_problem});
    }
  }
  json jobs = jobs_doc()["jobs"];
  for (auto& j : jobs) {
    std::string store = j["store"], subject = "pid " + std::to_string(j["pid"].get<long long>());
    bool series = j["interval_s"].is_number();
    const bool autosave = j["kind"] == "autosave";
    const std::string kindword = autosave ? "autosave" : "dump";
    std::string what = "the periodic dump of " + j["command"].get<std::string>() + " (" + subject + ")";
    if (autosave) {
      what = "the autosave of session " + j["session"].get<std::string>() + " in " + j["command"].get<std::string>() + " (" + subject + ")";
      subject += " session " + j["session"].get<std::string>();
    }
    if (j["last_error"].is_string()) {
      found.push_back({"error", kindword + "_failed", store, subject,
                       what + " failed: " + j["last_error"].get<std::string>() +
                           (j["alive"].get<bool>() ? "" : " (the process has ended; dismiss the alert on the jobs view, or POST /api/v1/stores/" + store + "/jobs/" +
                                                              std::to_string(j["pid"].get<long long>()) + "/dismiss" +
                                                              (autosave ? " with {\"session\": \"" + j["session"].get<std::string>() + "\"}" : "") + ")")});
    } else if (series && j["alive"].get<bool>() && j["next_dump_ns"].is_number()) {
      std::int64_t due = j["next_dump_ns"].get<std::int64_t>();
      std::int64_t grace = static_cast<std::int64_t>(j["interval_s"].get<double>() * 1e9) + 60'000'000'000LL;
      if (now_ns() > due + grace)
        found.push_back({"warning", kindword + "_late", store, subject,
                         what + " is late: due " + cli::rfc3339(due) +
                             (autosave ? " (the program has not reached Session::checkpoint_point() since)" : "")});
    }
  }
  for (auto& h : peers())
    if (!h["reachable"].get<bool>())
      found.push_back({"warning", "peer_unreachable", "", h["url"].get<std::string>(),
                       "peer " + h["url"].get<std::string>() + " is unreachable: " + h.value("error", std::string())});
  json list = json::array();
  std::lock_guard lk(mu_);
  std::map<std::string, std::int64_t> since;
  for (auto& a : found) {
    std::string id = a.kind + ":" + a.store + ":" + a.subject;
    auto it = alert_since_.find(id);
    std::int64_t t = it == alert_since_.end() ? now_ns() : it->second;
    since[id] = t;
    list.push_back(json{{"id", jstr(id)}, {"severity", a.severity}, {"kind", a.kind}, {"store", jstr(a.store)},
                        {"subject", jstr(a.subject)}, {"message", jstr(a.message)}, {"since_ns", t}});
  }
  alert_since_ = std::move(since);  // an alert that went and comes back starts anew
  json doc = cli::document();
  doc["alerts"] = std::move(list);
  return doc;
}

json Server::self_host() {
  json stores = json::array();
  for (auto& e : stores_) {
    try {
      stores.push_back(store_summary(*e));
    } catch (const Error&) {
      // a store that cannot be read now shows in the alerts
    }
  }
  json memory = nullptr;
  {
    std::lock_guard lk(mu_);
    if (!samples_.empty()) memory = to_json(samples_.back());
  }
  return json{{"name", jstr(hostname())}, {"url", ""}, {"reachable", true}, {"memory", memory}, {"stores", std::move(stores)}, {"alerts", 0}};
}

std::vector<json> Server::peers() {
  std::lock_guard lk(peers_mu_);
  if (peers_fetched_ && std::chrono::steady_clock::now() - peers_at_ < std::chrono::seconds(5)) return peer_hosts_;
  std::vector<json> out;
  for (auto& url : opt_.peers) {
    std::string base = url;
    while (!base.empty() && base.back() == '/')
      base.pop_back();
    std::string name = base.substr(base.find("://") + 3);
    json h{{"name", jstr(name)}, {"url", jstr(url)}, {"reachable", false}, {"error", ""}, {"memory", nullptr}, {"stores", json::array()}, {"alerts", 0}};
    try {
      httplib::Client c(base);
      c.set_connection_timeout(2, 0);
      c.set_read_timeout(5, 0);
      c.set_write_timeout(2, 0);
      if (base.rfind("https://", 0) == 0) {
        c.enable_server_certificate_verification(true);
        if (!opt_.peer_ca.empty()) c.set_ca_cert_path(opt_.peer_ca.c_str());
      }
      httplib::Headers headers;
      if (!peer_token_.empty()) headers.emplace("Authorization", "Bearer " + peer_token_);
      auto r = c.Get("/api/v1/hosts?local=1", headers);
      if (!r) {
        h["error"] = "no answer (" + httplib::to_string(r.error()) + ")";
      } else if (r->status != 200) {
        h["error"] = "HTTP " + std::to_string(r->status);
      } else {
        json doc = json::parse(r->body);
        json self = doc.at("hosts").at(0);
        h["name"] = self.at("name");
        h["memory"] = self.at("memory");
        h["stores"] = self.at("stores");
        h["alerts"] = self.at("alerts");
        h["reachable"] = true;
        h.erase("error");
      }
    } catch (const std::exception& e) {
      h["error"] = jstr(std::string("bad answer: ") + e.what());
    }
    out.push_back(std::move(h));
  }
  peer_hosts_ = out;
  peers_at_ = std::chrono::steady_clock::now();
  peers_fetched_ = true;
  return out;
}

json Server::hosts(bool local_only) {
  json list = json::array();
  json self = self_host();
  if (!local_only) {
    self["alerts"] = alerts_doc()["alerts"].size();
    list.push_back(std::move(self));
    for (auto& h : peers())
      list.push_back(h);
  } else {
    json alerts = alerts_doc()["alerts"];
    std::size_t own = 0;
    for (auto& a : alerts)
      own += a["kind"] != "peer_unreachable";
    self["alerts"] = own;
    list.push_back(std::move(self));
  }
  json doc = cli::document();
  doc["hosts"] = std::move(list);
  return doc;
}

// ---- background: memory samples and checks ----------------------------------------------

void Server::take_sample() {
  auto m = read_meminfo();
  Sample s;
  s.time_ns = now_ns();
  s.mem_total = m["MemTotal"];
  s.mem_available = m["MemAvailable"];
  s.mem_used = s.mem_total > s.mem_available ? s.mem_total - s.mem_available : 0;
  s.cached = m["Cached"];
  s.swap_used = m["SwapTotal"] > m["SwapFree"] ? m["SwapTotal"] - m["SwapFree"] : 0;
  std::set<unsigned long> seen;
  for (auto& e : stores_) {
    s.store_bytes += pack_bytes_on_disk(e->path);
    if (e->medium != Medium::pmem) continue;
    Space sp = space_of(e->path);
    if (!seen.insert(sp.fsid).second) continue;
    s.pmem_total += sp.total;
    s.pmem_used += sp.total - sp.free;
  }
  std::lock_guard lk(mu_);
  samples_.push_back(s);
  while (samples_.size() > capacity_)
    samples_.pop_front();
}

void Server::sampler() {
  std::unique_lock lk(mu_);
  while (!stopping_) {
    lk.unlock();
    take_sample();
    lk.lock();
    cv_.wait_for(lk, std::chrono::duration<double>(opt_.sample_every_s), [&] { return stopping_; });
  }
}

void Server::check_store(StoreEntry& e) {
  std::set<std::string> damaged;
  std::string perm;
  try {
    Store s = open(e);
    for (auto& i : s.list())
      if (i.damaged) damaged.insert(i.session + "/" + i.name);
  } catch (const Error& err) {
    perm = std::string("store cannot be read: ") + err.what();
  }
  struct stat st {};
  if (::stat(e.path.c_str(), &st) == 0) {
    if (st.st_uid != ::geteuid())
      perm = "store " + e.path + " is owned by uid " + std::to_string(st.st_uid) + ", not by the server's user";
    else if (st.st_mode & 077)
      perm = "store " + e.path + " is readable by others (mode " + std::to_string((st.st_mode >> 6) & 7) + std::to_string((st.st_mode >> 3) & 7) +
             std::to_string(st.st_mode & 7) + "); run `chmod 700 " + e.path + "`";
  }
  Space sp = space_of(e.path);
  std::lock_guard lk(mu_);
  e.damaged_flags = std::move(damaged);
  e.permission_problem = perm;
  e.space = sp;
}

void Server::checker() {
  std::unique_lock lk(mu_);
  auto last_verify = std::chrono::steady_clock::now();
  while (!stopping_) {
    lk.unlock();
    for (auto& e : stores_)
      check_store(*e);
    // The full verify (re-hashing everything) only every --verify-every.
    if (opt_.verify_every_s > 0 && std::chrono::steady_clock::now() - last_verify > std::chrono::duration<double>(opt_.verify_every_s)) {
      last_verify = std::chrono::steady_clock::now();
      for (auto& e : stores_) {
        try {
          start_action(*e, "verify", json::object());
        } catch (const ApiError&) {
          // busy: the next round
        }
      }
    }
    lk.lock();
    cv_.wait_for(lk, std::chrono::duration<double>(opt_.check_every_s), [&] { return stopping_; });
  }
}

// ---- operations -----------------------------------------------------------------

json Server::operation_json(const Operation& op) {
  return json{{"id", op.id},
              {"action", op.action},
              {"store", op.store},
              {"state", op.state},
              {"done", op.done.load()},
              {"total", op.total.load()},
              {"started_ns", op.started_ns},
              {"finished_ns", op.finished_ns ? json(op.finished_ns) : json(nullptr)},
              {"result", op.result},
              {"error", op.error}};
}

Progress Server::progress_of(Operation& op) {
  return [this, &op](std::uint64_t done, std::uint64_t total) {
    op.done = done;
    op.total = total;
    bool stop;
    {
      std::lock_guard lk(mu_);
      stop = stopping_;
    }
    if (stop) throw Error(Errc::cancelled, "dvr serve is stopping");
  };
}

std::shared_ptr<Operation> Server::start_action(StoreEntry& e, const std::string& action, const json& body) {
  // A body that cannot work is answered now (400, 404), without an
  // operation and without spending the action's rate-limit token.
  (void)run_action(e, nullptr, action, body);
  auto op = std::make_shared<Operation>();
  {
    std::lock_guard lk(mu_);
    if (stopping_) throw ApiError(503, "cancelled", "dvr serve is stopping");
    // The rate limit: a token bucket per action kind.
    Bucket& b = buckets_[action];
    auto now = std::chrono::steady_clock::now();
    const double rate = opt_.action_rate / 60.0;  // tokens per second
    if (b.last == std::chrono::steady_clock::time_point{}) {
      b.tokens = opt_.action_rate;
    } else {
      b.tokens = std::min<double>(opt_.action_rate, b.tokens + std::chrono::duration<double>(now - b.last).count() * rate);
    }
    b.last = now;
    if (b.tokens < 1) {
      int wait = static_cast<int>(std::ceil((1 - b.tokens) / rate));
      throw ApiError(429, "rate_limited", "too many " + action + " actions (at most " + std::to_string(opt_.action_rate) + " a minute)",
                     std::to_string(wait) + " s");
    }
    if (expensive(action)) {
      bool expected = false;
      if (!e.busy.compare_exchange_strong(expected, true))
        throw ApiError(429, "busy", "store " + e.id + " is busy with another expensive action (verify, gc, push, proc-*); one runs at a time", "2 s");
    }
    b.tokens -= 1;
    op->id = std::to_string(next_op_++);
    op->action = action;
    op->store = e.id;
    op->started_ns = now_ns();
    ops_.push_back(op);
    // Bounded: the oldest finished operations go.
    while (ops_.size() > 200) {
      auto it = std::find_if(ops_.begin(), ops_.end(), [](auto& o) { return o->state != "running"; });
      if (it == ops_.end()) break;
      ops_.erase(it);
    }
  }
  log_line("operation " + op->id + ": " + action + " on store " + e.id + " started");
  std::lock_guard lk(mu_);
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->first->state != "running" && it->first->finished_ns) {
      it->second.join();  // it has set its state: it is about to return
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  workers_.emplace_back(op, [this, op, &e, action, body] {
    json result, error;
    try {
      result = run_action(e, op.get(), action, body);
    } catch (const ApiError& x) {
      error = error_body(x.code, x.what(), x.hint);
    } catch (const Error& x) {
      error = error_body(errc_name(x.code()), x.what(), "");
    } catch (const json::exception& x) {
      error = error_body("invalid_argument", std::string("bad arguments: ") + x.what(), "see docs/openapi.json for the action's body");
    } catch (const std::exception& x) {
      error = error_body("internal", x.what(), "");
    }
    if (expensive(action)) e.busy = false;
    check_store(e);
    {
      std::lock_guard lk2(mu_);
      op->result = result.is_null() ? json(nullptr) : result;
      op->error = error.is_null() ? json(nullptr) : error;
      op->state = error.is_null() ? "done" : "failed";
      op->finished_ns = now_ns();
    }
    cv_.notify_all();
    log_line("operation " + op->id + ": " + action + " on store " + e.id + " " + (error.is_null() ? "done" : "failed: " + error["message"].get<std::string>()));
  });
  return op;
}

// Typed fields of an action's body (400 naming the field when wrong).
template <typename T>
T field(const json& body, const char* name, std::optional<T> fallback = std::nullopt) {
  if (!body.contains(name)) {
    if (fallback) return *fallback;
    throw ApiError(400, "invalid_argument", std::string("the body lacks \"") + name + "\"", "see docs/openapi.json for the action's body");
  }
  try {
    return body.at(name).get<T>();
  } catch (const json::exception&) {
    throw ApiError(400, "invalid_argument", std::string("\"") + name + "\" has the wrong type", "see docs/openapi.json for the action's body");
  }
}

void only_fields(const json& body, const std::set<std::string>& allowed, const std::string& action) {
  for (auto& [k, v] : body.items())
    if (!allowed.count(k)) throw ApiError(400, "invalid_argument", "unknown field \"" + k + "\" for " + action, "see docs/openapi.json for the action's body");
}

json Server::run_action(StoreEntry& e, Operation* op, const std::string& action, const json& body) {
  Store s = open(e);
  if (action == "verify") {
    only_fields(body, {}, action);
    if (!op) return {};
    VerifyReport r = s.verify(progress_of(*op));
    std::map<std::string, std::string> damage;
    for (auto& p : r.problems)
      if (!p.snapshot.empty()) damage[p.session + "/" + p.snapshot] = p.what;
    {
      std::lock_guard lk(mu_);
      e.verify_damage = std::move(damage);
      e.last_verify_ns = now_ns();
    }
    return cli::to_json(r);
  }
  if (action == "gc") {
    only_fields(body, {}, action);
    if (!op) return {};
    return cli::to_json(s.gc(progress_of(*op)));
  }
  if (action == "prune") {
    only_fields(body, {"session", "keep_last", "keep_within_s", "keep_hourly", "keep_daily", "keep_weekly", "keep_monthly", "dry_run"}, action);
    std::string session = field<std::string>(body, "session");
    require_session(s, e, session);
    PrunePolicy p;
    auto count = [&](const char* name, long long most) {
      long long v = field<long long>(body, name, 0LL);
      if (v < 0 || v > most)
        throw ApiError(400, "invalid_argument", std::string("\"") + name + "\" must be from 0 to " + std::to_string(most));
      return v;
    };
    constexpr long long kCounts = 1000000, kCentury = 100LL * 366 * 24 * 3600;
    p.keep_last = static_cast<unsigned>(count("keep_last", kCounts));
    p.keep_within = std::chrono::seconds(count("keep_within_s", kCentury));  // seconds: 30 days is 2592000
    p.keep_hourly = static_cast<unsigned>(count("keep_hourly", kCounts));
    p.keep_daily = static_cast<unsigned>(count("keep_daily", kCounts));
    p.keep_weekly = static_cast<unsigned>(count("keep_weekly", kCounts));
    p.keep_monthly = static_cast<unsigned>(count("keep_monthly", kCounts));
    const bool dry_run = field<bool>(body, "dry_run", false);
    if (!op) {
      (void)s.prune(session, p, true);  // a policy the library refuses (no rule at all): refused now too
      return {};
    }
    return cli::prune_document(session, s.prune(session, p, dry_run));
  }
  if (action == "rm") {
    only_fields(body, {"session", "names"}, action);
    std::string session = field<std::string>(body, "session");
    require_session(s, e, session);
    auto names = field<std::vector<std::string>>(body, "names");
    if (names.empty()) throw ApiError(400, "invalid_argument", "\"names\" is empty", "name the snapshots to remove");
    std::vector<std::string> unique;
    for (auto& n : names) {
      check_name("snapshot", n);
      if (std::find(unique.begin(), unique.end(), n) == unique.end()) unique.push_back(n);
    }
    for (auto& n : unique) {
      try {
        s.info(session, n);
      } catch (const Error& x) {
        if (x.code() != Errc::corrupt) throw;  // a damaged snapshot can still be removed
      }
      proc::check_removable(s, session, n);  // a process snapshot's heap goes with it, not alone
    }
    if (!op) return {};
    std::vector<std::string> removed;
    op->total = unique.size();
    for (auto& n : unique) {
      proc::remove_snapshot(s, session, n);  // proc/NAME: with its heap snapshots
      removed.push_back(session + "/" + n);
      op->done = removed.size();
    }
    return cli::removed_document(removed);
  }
  if (action == "proc-dump") {
    only_fields(body, {"pid", "name", "leave_running", "tcp_established"}, action);
    long long pid = field<long long>(body, "pid");
    if (pid <= 0 || pid > INT_MAX) throw ApiError(400, "invalid_argument", "\"pid\" is not a process ID");
    std::string name = field<std::string>(body, "name");
    check_name("process snapshot", name);
    proc::DumpOptions o;
    o.leave_running = field<bool>(body, "leave_running", true);
    o.tcp_established = field<bool>(body, "tcp_established", false);
    if (!op) return {};
    o.progress = progress_of(*op);
    json doc = cli::document();
    doc.update(cli::to_json(proc::dump(s, static_cast<pid_t>(pid), name, o)));
    return doc;
  }
  if (action == "proc-restore" || action == "proc-clone") {
    bool clone = action == "proc-clone";
    if (clone)
      only_fields(body, {"name", "net", "ip", "host_ip", "tcp_established"}, action);
    else
      only_fields(body, {"name", "tcp_established"}, action);
    std::string name = field<std::string>(body, "name");
    check_name("process snapshot", name);
    proc::RestoreOptions o;
    o.clone = clone;
    o.detach = true;
    o.tcp_established = field<bool>(body, "tcp_established", false);
    if (clone) {
      o.net = field<std::string>(body, "net", std::string());
      o.ip = field<std::string>(body, "ip", std::string());
      o.host_ip = field<std::string>(body, "host_ip", std::string());
    }
    if (!op) return {};
    o.progress = progress_of(*op);
    proc::RestoreResult r = proc::restore(s, name, o);
    return cli::restore_document(name, r);
  }
  if (action == "push") {
    only_fields(body, {"ref", "to"}, action);
    const std::string ref = field<std::string>(body, "ref"), to = field<std::string>(body, "to");
    auto [session, name] = split_ref(ref);
    check_name("session", session);
    check_name("snapshot", name);
    if (!op) return {};
    return push(e, *op, ref, to);
  }
  throw ApiError(404, "not_found", "no action '" + action + "'");
}

// push: to another store of this server (a send into a pipe, received on
// another thread), or to ssh://HOST/STORE (`dvr push`, this same binary).
json Server::push(StoreEntry& e, Operation& op, const std::string& ref, const std::string& to) {
  auto [session, name] = split_ref(ref);
  check_name("session", session);
  check_name("snapshot", name);
  if (to.rfind("ssh://", 0) == 0) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0) throw Error(Errc::io, "cannot create a pipe");
    if (::pipe2(err, O_CLOEXEC) != 0) {
      ::close(out[0]);
      ::close(out[1]);
      throw Error(Errc::io, "cannot create a pipe");
    }
    std::vector<std::string> argv = {"/proc/self/exe", "--store", e.path, "--progress=none", "push", ref, to, "--json"};
    pid_t pid = ::fork();
    if (pid < 0) throw Error(Errc::io, "cannot fork");
    if (pid == 0) {
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) ::dup2(devnull, 0);
      sigset_t all;
      sigemptyset(&all);
      ::pthread_sigmask(SIG_SETMASK, &all, nullptr);
      std::vector<char*> args;
      for (auto& a : argv)
        args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    std::string text, errors;
    std::thread reader([&] {
      char buf[4096];
      for (ssize_t n; (n = ::read(err[0], buf, sizeof buf)) > 0;)
        if (errors.size() < 65536) errors.append(buf, static_cast<std::size_t>(n));
    });
    char buf[4096];
    for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;)
      if (text.size() < 65536) text.append(buf, static_cast<std::size_t>(n));
    reader.join();
    ::close(out[0]);
    ::close(err[0]);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      while (!errors.empty() && errors.back() == '\n')
        errors.pop_back();
      throw Error(Errc::io, "dvr push " + ref + " " + to + " failed: " + (errors.empty() ? "exit status " + std::to_string(WEXITSTATUS(status)) : errors));
    }
    return json::parse(text);
  }
  StoreEntry* target = nullptr;
  for (auto& x : stores_)
    if (x->id == to) target = x.get();
  if (!target)
    throw ApiError(404, "not_found", "push target '" + to + "' is neither a store of this server nor an ssh:// address",
                   "give a store id of GET /api/v1/stores, or ssh://[USER@]HOST[:PORT]/STORE");
  if (target == &e) throw ApiError(400, "invalid_argument", "push to the store itself", "name another store");
  Store src = open(e);
  Store dst = open(*target);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw Error(Errc::io, "cannot create a pipe");
  std::exception_ptr recv_error;
  std::thread receiver([&] {
    try {
      transfer::receive(dst, fds[0]);
    } catch (...) {
      recv_error = std::current_exception();
    }
    ::close(fds[0]);
  });
  transfer::Stats st;
  std::exception_ptr send_error;
  try {
    transfer::Options o;
    o.progress = progress_of(op);
    st = transfer::send(src, ref, fds[1], o);
  } catch (...) {
    send_error = std::current_exception();
  }
  ::close(fds[1]);
  receiver.join();
  if (send_error) std::rethrow_exception(send_error);
  if (recv_error) std::rethrow_exception(recv_error);
  return cli::to_json(st, true);
}

// ---- running ---------------------------------------------------------------------

int Server::run() {
  setup();
  // The signals end the server from the main thread (sigwait); every other
  // thread has them blocked.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  if (!opt_.tls_cert.empty()) {
    auto ssl = std::make_unique<httplib::SSLServer>(opt_.tls_cert.c_str(), opt_.tls_key.c_str());
    if (!ssl->is_valid())
      throw Error(Errc::invalid_argument, "--tls-cert " + opt_.tls_cert + " / --tls-key " + opt_.tls_key +
                                              " cannot be loaded (PEM certificate and its private key, readable by you)");
    http_ = std::move(ssl);
  } else {
    http_ = std::make_unique<httplib::Server>();
  }
  // SO_REUSEADDR only: cpp-httplib's default also sets SO_REUSEPORT, with
  // which a second server on the same port would start and share the
  // connections instead of failing with "address in use".
  http_->set_socket_options([](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  http_->set_payload_max_length(opt_.max_body);
  http_->set_read_timeout(10, 0);
  http_->set_write_timeout(10, 0);
  http_->set_keep_alive_timeout(5);
  http_->new_task_queue = [] { return new httplib::ThreadPool(16); };
  http_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    return guard(req, res) ? httplib::Server::HandlerResponse::Handled : httplib::Server::HandlerResponse::Unhandled;
  });
  register_routes();
  http_->Get(".*", [this](const httplib::Request& req, httplib::Response& res) { serve_static(req, res); });
  http_->Post(".*", [](const httplib::Request& req, httplib::Response& res) {
    send_error(res, req.path.rfind("/api/", 0) == 0 ? 404 : 405, req.path.rfind("/api/", 0) == 0 ? "not_found" : "method_not_allowed",
               "no such route: POST " + req.path, "GET /api/v1/routes lists the routes");
  });
  http_->set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (res.status == 413) {
      send_error(res, 413, "payload_too_large", "the request body is too large", "action bodies are small JSON objects");
    } else if (res.body.empty() && res.status >= 400) {
      send_error(res, res.status, res.status == 404 ? "not_found" : res.status == 405 ? "method_not_allowed" : "invalid_argument",
                 "HTTP " + std::to_string(res.status) + " for " + req.method + " " + req.path, "GET /api/v1/routes lists the routes");
    }
  });
  http_->set_logger([](const httplib::Request& req, const httplib::Response& res) {
    if (res.status >= 400 || (req.method != "GET" && req.method != "HEAD")) log_line(req.method + " " + req.path + " " + std::to_string(res.status));
  });

  int port = port_;
  if (port_ == 0) {
    port = http_->bind_to_any_port(host_);
    if (port < 0) throw Error(Errc::io, "cannot listen on " + host_ + " (any port)");
  } else if (!http_->bind_to_port(host_, port_)) {
    throw Error(Errc::io, "cannot listen on " + opt_.listen + ": " + std::strerror(errno) + " (another server there? try --listen 127.0.0.1:0)");
  }
  port_ = port;
  std::string url_host = host_.find(':') != std::string::npos ? "[" + host_ + "]" : host_;
  std::string url = origin_scheme_ + "://" + url_host + ":" + std::to_string(port_);

  std::thread sampler_thread([this] { sampler(); });
  std::thread checker_thread([this] { checker(); });
  std::thread http_thread([this] { http_->listen_after_bind(); });
  while (!http_->is_running())
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  {
    json ev = cli::document();
    ev["event"] = "listening";
    ev["url"] = url;
    ev["port"] = port_;
    std::cout << ev.dump() << "\n" << std::flush;
  }
  log_line("listening on " + url + " (" + std::to_string(stores_.size()) + " store(s)" +
           (web_root_.empty() ? ", dashboard not built: cmake --build build --target dvr-web" : ", dashboard from " + web_root_) + ")");

  int sig = 0;
  ::sigwait(&stop_signals, &sig);
  log_line(std::string("stopping (") + strsignal(sig) + ")");
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  http_->stop();
  http_thread.join();
  sampler_thread.join();
  checker_thread.join();
  std::vector<std::pair<std::shared_ptr<Operation>, std::thread>> workers;
  {
    std::lock_guard lk(mu_);
    workers.swap(workers_);
  }
  for (auto& w : workers)
    w.second.join();
  log_line("stopped");
  return 0;
}

}  // namespace

int serve(const ServeOptions& options) {
  Server s(options);
  return s.run();
}

}  // namespace dvr::server
