// dvr — the Memory DVR command line. A thin layer over <dvr/dvr.hpp>:
// parsing with CLI11, JSON with nlohmann-json (output.hpp), progress on
// stderr (progress.hpp). docs/cli.md documents every verb, its JSON document
// and its exit status.
#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli_util.hpp"
#include "completion.hpp"
#include "demo.hpp"
#include "serve.hpp"
#include "dvr/dvr.hpp"
#include "dvr/proc.hpp"
#include "dvr/transfer.hpp"
#include "output.hpp"
#include "progress.hpp"
#include "remote.hpp"

namespace {

using namespace dvr;
using namespace dvr::cli;

// ---- what every command shares --------------------------------------------

struct Globals {
  std::string store_path;
  std::string progress = "auto";
  std::string lock_timeout;  // "" waits for the store's lock as long as it takes
};
Globals g;

ProgressMode progress_mode() { return parse_progress_mode(g.progress); }

Store open_store(bool create) {
  StoreOptions o;
  o.create = create;
  if (!g.lock_timeout.empty()) o.lock_timeout = std::chrono::milliseconds(static_cast<long long>(parse_duration(g.lock_timeout) * 1000));
  return g.store_path.empty() ? Store::open_default(o) : Store::open(g.store_path, o);
}

// The start of a command a message suggests: `dvr`, with the store when one
// was given (--store), quoted for a shell where it needs it.
std::string dvr_here(const Store& store) { return g.store_path.empty() ? "dvr" : "dvr --store " + dvr::shell_word(store.path()); }

std::string format_time(std::int64_t ns) {
  std::time_t t = static_cast<std::time_t>(ns / 1000000000);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

std::string bytes(std::uint64_t n) { return format_bytes(static_cast<double>(n)); }

// An unknown session is an error for every verb that names one.
void require_session(const Store& store, const std::string& session) {
  auto all = store.sessions();
  if (std::find(all.begin(), all.end(), session) != all.end()) return;
  (void)store.list(session);  // an invalid name is invalid_argument (exit status 2)
  std::string known;
  for (std::size_t k = 0; k < all.size() && k < 8; ++k)
    known += (k ? ", " : "") + printable(all[k]);
  if (all.size() > 8) known += ", ...";
  throw Error(Errc::not_found, "no session '" + printable(session) + "' in store " + store.path() +
                                   (all.empty() ? std::string(" (it has no snapshots)") : " (sessions: " + known + ")") +
                                   "; `dvr --store " + dvr::shell_word(store.path()) + " ls` lists the snapshots");
}

// A whole number within [lo, hi] (CLI11 validator: the message names the
// option, CLI11 prefixes it).
CLI::Validator whole_number(long long lo, long long hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        char* end = nullptr;
        errno = 0;
        long long v = std::strtoll(s.c_str(), &end, 10);
        if (s.empty() || *end || errno == ERANGE) return "'" + s + "' is not a whole number (expected " + std::to_string(lo) + " or more)";
        if (v < lo || v > hi) return "'" + s + "' is out of range (expected " + std::to_string(lo) + " to " + std::to_string(hi) + ")";
        return "";
      },
      "N");
}

// One of the words (CLI11 prefixes the option's name).
CLI::Validator one_of(std::vector<std::string> words) {
  std::string list;
  for (std::size_t k = 0; k < words.size(); ++k)
    list += (k == 0 ? "" : k + 1 == words.size() ? " or " : ", ") + words[k];
  return CLI::Validator(
      [words, list](std::string& s) -> std::string {
        return std::find(words.begin(), words.end(), s) != words.end() ? "" : "must be " + list + ", not '" + s + "'";
      },
      "MODE");
}

CLI::Validator size_value() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        try {
          parse_size(s);
        } catch (const std::exception& e) {
          return e.what();
        }
        return "";
      },
      "SIZE");
}

CLI::Validator duration_value() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        try {
          if (parse_duration(s) < 1) return "duration '" + s + "' is shorter than a second";
        } catch (const std::exception& e) {
          return e.what();
        }
        return "";
      },
      "DURATION");
}

// ---- snapshots --------------------------------------------------------------

struct LsArgs {
  std::string session;
  bool json = false;
};

int cmd_ls(const LsArgs& a) {
  Store store = open_store(false);
  if (!a.session.empty()) require_session(store, a.session);
  auto snaps = a.session.empty() ? store.list() : store.list(a.session);
  if (a.json) {
    json doc = document();
    doc["session"] = a.session.empty() ? json(nullptr) : jstr(a.session);
    doc["snapshots"] = to_json(snaps);
    print_json(doc);
    return 0;
  }
  if (snaps.empty()) {
    std::cout << "no snapshots in " << printable(store.path()) << "\n";
    return 0;
  }
  std::printf("%-32s %-19s %10s %10s  %s\n", "SNAPSHOT", "TIME", "SIZE", "ADDED", "LABEL");
  for (auto& i : snaps) {
    std::string ref = printable(i.session + "/" + i.name);
    if (i.damaged) {
      std::printf("%-32s DAMAGED: %s\n", ref.c_str(), printable(i.damage).c_str());
      continue;
    }
    std::printf("%-32s %-19s %10s %10s  %s\n", ref.c_str(), format_time(i.time_ns).c_str(), bytes(i.logical_bytes).c_str(),
                bytes(i.stored_bytes).c_str(), printable(i.label).c_str());
  }
  return 0;
}

struct RefArgs {
  std::string ref;
  bool json = false;
};

int cmd_info(const RefArgs& a) {
  auto [session, name] = dvr::split_ref(a.ref);
  Store store = open_store(false);
  SnapshotInfo i = store.info(session, name);
  if (a.json) {
    json doc = document();
    doc.update(to_json(i));
    print_json(doc);
    return 0;
  }
  std::cout << "snapshot  " << printable(i.session + "/" + i.name) << "\n"
            << "time      " << format_time(i.time_ns) << " (" << rfc3339(i.time_ns) << ")\n"
            << (i.origin_time_ns != i.time_ns ? "made      " + rfc3339(i.origin_time_ns) + " (where it came from; the time above is its arrival)\n" : "")
            << "order     " << i.seq << " (commit order in this store: the highest is the newest)\n"
            << "parent    " << (i.parent.empty() ? "(none)" : printable(i.parent)) << "\n"
            << "label     " << printable(i.label) << "\n"
            << "size      " << bytes(i.logical_bytes) << " (" << i.logical_bytes << " bytes)\n"
            << "added     " << bytes(i.stored_bytes) << " to the store when taken\n"
            << "chunks    " << i.chunks << " (" << i.zero_chunks << " all-zero, not stored)\n"
            << "taken     " << (i.tracking == "write_protect" ? "incrementally (write-protect tracking): " : "by reading all memory (hash): ")
            << i.chunks_read << " chunk(s) read\n"
            << "regions   " << i.regions.size() << "\n";
  for (auto& r : i.regions)
    std::cout << "  " << printable(r.name) << "  " << bytes(r.size) << " (" << r.size << " bytes)" << (r.sdk_owned ? "  sdk-owned" : "  tracked")
              << "\n";
  return 0;
}

struct RmArgs {
  std::vector<std::string> refs;
  bool json = false;
};

int cmd_rm(const RmArgs& a) {
  // Each reference once, in the order given; every one is checked before
  // any is removed.
  std::vector<std::pair<std::string, std::string>> refs;
  std::set<std::string> seen;
  for (auto& ref : a.refs)
    if (seen.insert(ref).second) refs.push_back(dvr::split_ref(ref));
  Store store = open_store(false);
  for (auto& [session, name] : refs) {
    try {
      // proc/NAME is looked up as a process snapshot (its message points at `dvr proc ls`).
      if (session == proc::kImageSession)
        proc::info(store, name);
      else
        store.info(session, name);
    } catch (const Error& e) {
      if (e.code() != Errc::corrupt) throw;  // a damaged snapshot can still be removed
    }
    proc::check_removable(store, session, name);  // a process snapshot's heap goes with it, not alone
  }
  json removed = json::array();
  for (auto& [session, name] : refs) {
    proc::remove_snapshot(store, session, name);  // proc/NAME: with its heap snapshots
    removed.push_back(jstr(session + "/" + name));
    if (!a.json) std::cout << "removed " << printable(session + "/" + name) << "\n";
  }
  if (a.json) {
    json doc = document();
    doc["removed"] = std::move(removed);
    print_json(doc);
  } else {
    std::cout << "run `" << printable(dvr_here(store)) << " gc` to reclaim the space\n";
  }
  return 0;
}

struct PruneArgs {
  std::string session;
  unsigned keep_last = 0, keep_hourly = 0, keep_daily = 0, keep_weekly = 0, keep_monthly = 0;
  std::string keep_within;
  bool dry_run = false;
  bool json = false;
};

int cmd_prune(const PruneArgs& a) {
  Store store = open_store(false);
  require_session(store, a.session);
  PrunePolicy policy;
  policy.keep_last = a.keep_last;
  policy.keep_hourly = a.keep_hourly;
  policy.keep_daily = a.keep_daily;
  policy.keep_weekly = a.keep_weekly;
  policy.keep_monthly = a.keep_monthly;
  if (!a.keep_within.empty()) policy.keep_within = std::chrono::seconds(static_cast<long long>(parse_duration(a.keep_within)));
  if (!a.keep_last && !a.keep_hourly && !a.keep_daily && !a.keep_weekly && !a.keep_monthly && a.keep_within.empty())
    throw Error(Errc::invalid_argument,
                "give at least one rule (--keep-last, --keep-within, --keep-hourly, --keep-daily, --keep-weekly, --keep-monthly): a policy "
                "that keeps nothing would remove every snapshot of '" + printable(a.session) + "' (`dvr rm` removes snapshots by name)");
  PruneReport r = store.prune(a.session, policy, a.dry_run);
  if (a.json) {
    print_json(prune_document(a.session, r));
    return 0;
  }
  for (auto& d : r.decisions) {
    // A removal's reason is "removed" and what still refers to it ("; ...").
    std::string why = d.reason;
    if (!d.keep && why.rfind("removed", 0) == 0) why = why.size() > 9 ? why.substr(9) : "";
    std::cout << (d.keep ? "keep    " : (r.dry_run ? "would remove " : "remove  ")) << printable(d.snapshot.name) << "  "
              << format_time(d.snapshot.time_ns) << (why.empty() ? "" : "  " + printable(why)) << "\n";
  }
  std::cout << (r.dry_run ? "dry run: would remove " : "removed ") << r.removed << " of " << r.decisions.size() << " snapshot(s) of session '"
            << printable(a.session) << "'";
  if (r.dry_run)
    std::cout << "; run it again without --dry-run to remove them\n";
  else
    std::cout << (r.removed ? "; run `" + printable(dvr_here(store)) + " gc` to reclaim the space\n" : "\n");
  return 0;
}

int cmd_gc(bool as_json) {
  Store store = open_store(false);
  ProgressReporter progress("gc", progress_mode());
  GcReport r = store.gc(progress.callback());
  progress.finish();
  if (as_json) {
    print_json(to_json(r));
    return 0;
  }
  std::uint64_t freed = r.bytes_before > r.bytes_after ? r.bytes_before - r.bytes_after : 0;
  std::cout << "gc: reclaimed " << bytes(freed) << " (" << bytes(r.bytes_before) << " -> " << bytes(r.bytes_after) << "), " << r.packs_removed
            << " pack file(s) removed, " << r.temp_files_removed << " leftover temporary file(s) removed\n";
  return 0;
}

int cmd_verify(bool as_json) {
  Store store = open_store(false);
  ProgressReporter progress("verify", progress_mode());
  VerifyReport r = store.verify(progress.callback());
  progress.finish();
  if (as_json) {
    print_json(to_json(r));
    return r.ok() ? 0 : 1;
  }
  std::cout << "verified " << r.snapshots << " snapshot(s), " << r.chunks << " stored chunk(s), " << bytes(r.bytes) << "\n";
  for (auto& w : r.warnings)
    std::cout << "WARNING: " << printable(w) << "\n";
  if (r.ok()) {
    std::cout << "ok: no damage found\n";
    return 0;
  }
  for (auto& p : r.problems)
    std::cout << "DAMAGED " << printable(p.snapshot.empty() ? p.session : p.session + "/" + p.snapshot) << ": " << printable(p.what) << "\n";
  std::cout << r.damaged_snapshots().size() << " damaged snapshot(s); `dvr rm SESSION/NAME` removes one, `dvr recover SESSION` names the "
            << "newest intact one\n";
  return 1;
}

int cmd_stat(bool as_json) {
  Store store = open_store(false);
  StoreStats s = store.stats();
  if (as_json) {
    print_json(to_json(s));
    return 0;
  }
  std::cout << "store      " << printable(s.path) << "\n"
            << "medium     " << medium_name(s.medium) << (s.medium == Medium::dram ? "  (tmpfs: survives process crashes, NOT reboots)" : "") << "\n"
            << "format     " << s.format_version << ", chunk size " << format_bytes(s.chunk_size) << "\n"
            << "sessions   " << s.sessions << ", snapshots " << s.snapshots << "\n"
            << "logical    " << bytes(s.logical_bytes) << " in all snapshots\n"
            << "stored     " << bytes(s.pack_bytes) << " in " << s.pack_files << " pack file(s)\n";
  for (auto& w : s.warnings)
    std::cout << "WARNING: " << printable(w) << "\n";
  return 0;
}

int cmd_log(const LsArgs& a) {
  Store store = open_store(false);
  require_session(store, a.session);
  auto snaps = store.list(a.session);
  if (a.json) {
    print_json(log_document(a.session, snaps));
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
      std::cout << line << printable(i->name) << "  DAMAGED: " << printable(i->damage) << "\n";
    } else {
      std::printf("%s%s  %s  +%s%s%s\n", line.c_str(), printable(i->name).c_str(), format_time(i->time_ns).c_str(), bytes(i->stored_bytes).c_str(),
                  i->label.empty() ? "" : "  ", printable(i->label).c_str());
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

struct DiffArgs {
  std::string a, b;
  bool json = false;
};

int cmd_diff(const DiffArgs& a) {
  auto [sa, na] = dvr::split_ref(a.a);
  auto [sb, nb] = dvr::split_ref(a.b);
  Store store = open_store(false);
  auto diffs = store.diff(sa, na, sb, nb);
  if (a.json) {
    print_json(diff_document(a.a, a.b, diffs));
    return 0;
  }
  std::printf("%-24s %14s %12s  %s\n", "REGION", "BYTES DIFFER", "PAGES", "NOTE");
  for (auto& d : diffs) {
    std::string note = d.only_in_a            ? "only in " + a.a
                       : d.only_in_b          ? "only in " + a.b
                       : d.size_a != d.size_b ? "size " + std::to_string(d.size_a) + " -> " + std::to_string(d.size_b)
                       : d.bytes_differ == 0  ? "identical"
                                              : "";
    std::printf("%-24s %14llu %12llu  %s\n", printable(d.name).c_str(), static_cast<unsigned long long>(d.bytes_differ),
                static_cast<unsigned long long>(d.pages_differ), printable(note).c_str());
  }
  return 0;
}

int cmd_recover(const LsArgs& a) {
  Store store = open_store(false);
  auto sessions = store.sessions();
  const bool known = std::find(sessions.begin(), sessions.end(), a.session) != sessions.end();
  std::vector<std::string> skipped;
  std::optional<SnapshotInfo> found;
  if (known)
    found = store.latest(a.session, &skipped);
  else
    (void)store.list(a.session);  // an invalid name is invalid_argument (exit status 2)
  if (a.json) {
    json doc = document();
    doc["session"] = jstr(a.session);
    doc["latest"] = found ? to_json(*found) : json(nullptr);
    json sk = json::array();
    for (auto& s : skipped) {  // "session/name: why"
      auto colon = s.find(": ");
      sk.push_back({{"snapshot", jstr(s.substr(0, colon))}, {"why", jstr(colon == std::string::npos ? "" : s.substr(colon + 2))}});
    }
    doc["skipped"] = std::move(sk);
    print_json(doc);
  }
  if (!known) require_session(store, a.session);  // the message, exit status 1
  if (a.json) return found ? 0 : 1;
  for (auto& s : skipped)
    std::cout << "skipped (damaged) " << printable(s) << "\n";
  if (!found) {
    std::cout << "no intact snapshot in session '" << printable(a.session) << "'\n";
    return 1;
  }
  std::cout << "newest intact snapshot: " << printable(a.session + "/" + found->name) << "  (" << format_time(found->time_ns) << ")\n"
            << "restore it in the program with session.restore(\"" << printable(found->name) << "\") (Python, C++), or copy it elsewhere with "
            << "`" << printable(dvr_here(store)) << " export " << printable(a.session + "/" + found->name) << " -o FILE`\n";
  return 0;
}

// ---- moving snapshots -------------------------------------------------------

struct TransferArgs {
  std::string ref, file, url, base, compress, level, ssh, remote_dvr = "dvr";
  std::string sign;                        // --sign KEY: the secret key file
  std::vector<std::string> require_keys;   // --require-signature PUBKEY...
  std::string remote_sign;                 // pull --remote-sign KEY: the far side's secret key file
  std::string keep_ssh;                    // push/pull --keep-ssh DURATION (empty: $DVR_KEEP_SSH, else not kept)
  std::string idle;                        // receive --listen --idle DURATION
  bool no_compress = false, negotiate = false, listen = false, json = false;
};

// --require-signature's public keys, loaded (a bad file fails before the transfer starts).
std::vector<transfer::VerifyKey> required_keys(const TransferArgs& a) {
  std::vector<transfer::VerifyKey> keys;
  for (auto& f : a.require_keys)
    keys.push_back(transfer::VerifyKey::load(f));
  return keys;
}

transfer::Options transfer_options(const TransferArgs& a) {
  transfer::Options o;
  o.base = a.base;
  if (!a.compress.empty()) o.compress = transfer::parse_compress(a.compress, "--compress");
  if (a.no_compress) {
    if (!a.compress.empty() && o.compress != transfer::Compress::none)
      throw Error(Errc::invalid_argument, "--compress=" + a.compress + " and --no-compress exclude each other");
    o.compress = transfer::Compress::none;
  }
  if (!a.level.empty()) {
    if (o.compress == transfer::Compress::none) throw Error(Errc::invalid_argument, "--level and --compress=none (--no-compress) exclude each other");
    o.level = std::stoi(a.level);  // checked by its validator: 1 to 19
  }
  if (!a.sign.empty()) o.sign_with = transfer::SigningKey::load(a.sign);
  return o;
}

void print_transfer(const transfer::Stats& st, bool sent, bool as_json, std::ostream& out) {
  if (as_json) {
    out << to_json(st, sent).dump() << "\n";
    return;
  }
  std::string refs;
  for (auto& r : st.refs)
    refs += (refs.empty() ? "" : ", ") + printable(r);
  out << (sent ? "sent " : "received ") << refs << ": " << bytes(st.logical_bytes) << " of snapshot data, " << bytes(st.wire_bytes)
      << (sent ? " sent" : " received");
  if (st.data_bytes) out << " (compression " << std::fixed << std::setprecision(2) << st.compression_ratio << "x)";
  out << ", " << st.chunks_skipped << " of " << st.chunks << " chunks skipped" << (st.base.empty() ? std::string() : " (relative to " + st.base + ")");
  if (!sent) out << ", " << bytes(st.stored_bytes) << " added to the store";
  if (!st.signed_by.empty()) out << ", signed by " << st.signed_by;
  out << ", " << format_seconds(st.seconds) << "\n";
}

// A receive (receive, import) with its progress: bytes of the stream read,
// out of the file's size (0 from a pipe, until the end).
transfer::Stats receive_counted(Store& store, int fd, const char* op, std::vector<transfer::VerifyKey> keys) {
  ProgressReporter progress(op, progress_mode());
  transfer::ReceiveOptions ro;
  ro.progress = progress.callback();
  ro.require_signature = std::move(keys);
  transfer::Stats st = transfer::receive(store, fd, ro);
  progress.finish();
  return st;
}

int cmd_send(const TransferArgs& a) {
  transfer::Options o = transfer_options(a);
  if (!a.negotiate && ::isatty(1))
    throw Error(Errc::invalid_argument, "dvr send writes a binary stream: redirect it (dvr send REF > FILE, or | dvr receive)");
  Store store = open_store(false);
  // The far side of a push or pull shows no bar: its stderr is the near
  // side's terminal, which shows its own.
  ProgressReporter progress("send", a.negotiate ? ProgressMode::none : progress_mode());
  o.progress = progress.callback();
  transfer::Stats st = a.negotiate ? transfer::send_negotiated(store, a.ref, 0, 1, o) : transfer::send(store, a.ref, 1, o);
  progress.finish();
  print_transfer(st, true, a.json, std::cerr);
  return 0;
}

int cmd_receive(const TransferArgs& a) {
  std::vector<transfer::VerifyKey> keys = required_keys(a);
  Store store = open_store(true);
  transfer::ReceiveOptions ro;
  ro.require_signature = keys;
  if (a.listen) return listen_kept_receiver(store, a.idle.empty() ? 0 : duration_up_to_7d(a.idle, "--idle"), ro);
  transfer::Stats st = a.negotiate ? transfer::receive_negotiated(store, 0, 1, ro) : receive_counted(store, 0, "receive", keys);
  print_transfer(st, false, a.json, a.negotiate ? std::cerr : std::cout);
  return 0;
}

// The part file of an export in progress, removed by a signal that ends dvr
// (SIGINT, SIGTERM, SIGHUP): an interrupted export leaves no half file.
char g_export_part[4096];
extern "C" void unlink_export_part(int sig) {
  if (g_export_part[0]) ::unlink(g_export_part);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

int cmd_export(const TransferArgs& a) {
  transfer::Options o = transfer_options(a);
  Store store = open_store(false);
  ProgressReporter progress("export", progress_mode());
  o.progress = progress.callback();
  transfer::Stats st;
  struct stat target {};
  if (::stat(a.file.c_str(), &target) == 0 && !S_ISREG(target.st_mode)) {
    if (S_ISDIR(target.st_mode))
      throw Error(Errc::invalid_argument, "cannot export to " + a.file + ": it is a directory; give a file name (-o DIR/NAME.dvr)");
    // A FIFO, device or socket is written in place, as `dvr send > FILE`
    // would: renaming a file over it would replace it (/dev/null, a pipe a
    // reader waits on).
    int fd = ::open(a.file.c_str(), O_WRONLY | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) throw Error(Errc::io, "cannot open " + a.file + " for writing: " + std::strerror(errno));
    try {
      st = transfer::send(store, a.ref, fd, o);
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    progress.finish();
    print_transfer(st, true, a.json, std::cout);
    return 0;
  }
  // Written beside FILE, renamed over it when complete: no half files (and
  // none left by an export to FILE that was killed).
  transfer::remove_stale_export_parts(a.file);
  std::string tmp = a.file + ".part-" + std::to_string(::getpid());
  if (tmp.size() >= sizeof g_export_part) throw Error(Errc::invalid_argument, "export: the file name is too long: " + a.file);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) throw Error(errno == ENOENT ? Errc::not_found : Errc::io, "cannot create " + tmp + ": " + std::strerror(errno));
  std::memcpy(g_export_part, tmp.c_str(), tmp.size() + 1);
  struct sigaction act {}, old_int {}, old_term {}, old_hup {};
  act.sa_handler = unlink_export_part;
  ::sigaction(SIGINT, &act, &old_int);
  ::sigaction(SIGTERM, &act, &old_term);
  ::sigaction(SIGHUP, &act, &old_hup);
  auto restore_signals = [&] {
    ::sigaction(SIGINT, &old_int, nullptr);
    ::sigaction(SIGTERM, &old_term, nullptr);
    ::sigaction(SIGHUP, &old_hup, nullptr);
    g_export_part[0] = '\0';
  };
  try {
    st = transfer::send(store, a.ref, fd, o);
    if (::fsync(fd) != 0) throw Error(errno == ENOSPC ? Errc::no_space : Errc::io, "cannot write " + tmp + ": " + std::strerror(errno));
    ::close(fd);
    fd = -1;
    if (::rename(tmp.c_str(), a.file.c_str()) != 0) throw Error(Errc::io, "cannot rename " + tmp + " to " + a.file + ": " + std::strerror(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    restore_signals();
    throw;
  }
  restore_signals();
  progress.finish();
  print_transfer(st, true, a.json, std::cout);
  return 0;
}

int cmd_import(const TransferArgs& a) {
  std::vector<transfer::VerifyKey> keys = required_keys(a);
  int fd = ::open(a.file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(errno == ENOENT ? Errc::not_found : Errc::io, "cannot open " + a.file + ": " + std::strerror(errno));
  struct stat file {};
  if (::fstat(fd, &file) == 0 && S_ISDIR(file.st_mode)) {
    ::close(fd);
    throw Error(Errc::invalid_argument, "cannot import " + a.file + ": it is a directory; give the file `dvr export` wrote");
  }
  transfer::Stats st;
  try {
    Store store = open_store(true);
    st = receive_counted(store, fd, "import", keys);
  } catch (const Error& e) {
    ::close(fd);
    // A refused stream: the message says what; this says which file.
    if (e.code() == Errc::corrupt || e.code() == Errc::permission || e.code() == Errc::unsupported)
      throw Error(e.code(), "import of " + a.file + ": " + e.what());
    throw;
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  print_transfer(st, false, a.json, std::cout);
  return 0;
}

int cmd_push_pull(const TransferArgs& a, bool push) {
  std::string ssh = a.ssh;
  if (ssh.empty()) {
    const char* env_ssh = std::getenv("DVR_SSH");
    ssh = env_ssh && *env_ssh ? env_ssh : "ssh";
  }
  transfer::Options o = transfer_options(a);
  std::vector<transfer::VerifyKey> keys = required_keys(a);
  SshTarget t = parse_ssh_url(a.url);
  Store store = open_store(!push);
  std::vector<std::string> remote = {a.remote_dvr, "--store", t.path};
  if (push) {
    remote.insert(remote.end(), {"receive", "--negotiate"});
  } else {
    remote.insert(remote.end(), {"send", "--negotiate", a.ref});
    if (!o.base.empty()) remote.insert(remote.end(), {"--base", o.base});
    if (!a.remote_sign.empty()) remote.insert(remote.end(), {"--sign", a.remote_sign});
    // Spelled so that a far dvr older than --compress understands the
    // default and none (it compresses every chunk, as zstd does).
    if (o.compress == transfer::Compress::none) {
      remote.push_back("--no-compress");
    } else {
      if (o.compress == transfer::Compress::zstd) remote.push_back("--compress=zstd");
      remote.insert(remote.end(), {"--level", std::to_string(o.level)});
    }
  }
  const long keep_s = keep_ssh_seconds(a.keep_ssh);
  // A push goes through the kept receiver a push before left at the far
  // end, if it is still there (remote.hpp); else through an ssh session.
  const int kept = push && keep_s > 0 ? connect_kept_receiver(t, a.remote_dvr) : -1;
  std::optional<SshChild> child;
  if (kept < 0) child.emplace(ssh, t, remote, keep_s);
  const int from = kept >= 0 ? kept : child->from, to = kept >= 0 ? kept : child->to;
  ProgressReporter progress(push ? "push" : "pull", progress_mode());
  o.progress = progress.callback();
  transfer::Stats st;
  try {
    if (push) {
      st = transfer::send_negotiated(store, a.ref, from, to, o);
    } else {
      transfer::ReceiveOptions ro;
      ro.progress = o.progress;  // stream bytes; the size is not known before
      ro.require_signature = keys;
      st = transfer::receive_negotiated(store, from, to, ro);
    }
  } catch (const Error& e) {
    progress.finish();
    if (kept >= 0) ::close(kept);
    else if (child->finish() == 255) throw Error(Errc::io, "ssh to " + t.host + " failed (exit 255; see its message above)");
    throw;
  }
  progress.finish();
  if (kept >= 0) {
    ::close(kept);
  } else if (int rc = child->finish(); rc != 0) {
    throw Error(Errc::io, "the far side (ssh " + t.host + ") exited with status " + std::to_string(rc) + " after the transfer");
  }
  print_transfer(st, push, a.json, std::cout);
  std::cout.flush();  // the summary first: keeping a receiver takes two more ssh commands
  if (child && push && keep_s > 0) keep_receiver(ssh, t, a.remote_dvr, keep_s);
  return 0;
}

// ---- whole processes --------------------------------------------------------

pid_t parse_pid(const std::string& text) {
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end || v <= 0 || v > 0x7fffffff) throw Error(Errc::invalid_argument, "'" + text + "' is not a process ID");
  return static_cast<pid_t>(v);
}

// Whether `pid` still runs (a zombie does not).
bool process_alive(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (!f) return false;
  char line[512] = {};
  bool alive = std::fgets(line, sizeof line, f) != nullptr;
  std::fclose(f);
  const char* close = std::strrchr(line, ')');
  return alive && !(close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X'));
}

void print_dump(const proc::ProcInfo& p, const proc::DumpOptions& o, const Store& store) {
  std::cout << "dumped process " << p.pid << " as proc/" << printable(p.name) << " in " << format_seconds(p.seconds) << ": " << bytes(p.image_bytes)
            << " of CRIU images, " << bytes(p.stored_bytes) << " added to the store"
            << (p.parent.empty() ? "" : " (compared with proc/" + printable(p.parent) + ")") << "\n";
  for (auto& h : p.heaps)
    std::cout << "  heap " << printable(h.path) << " (" << bytes(h.bytes) << ") " << (h.sealed ? "sealed, stored in place" : "snapshotted")
              << " as " << printable(h.session) << "/" << proc::kHeapPrefix << printable(p.name) << "\n";
  std::cout << (o.leave_running ? "the process keeps running\n" : "the process was stopped\n");
  if (o.tcp_established)
    std::cout << "its established TCP connections were dumped (their peers' packets wait until they are restored); `"
              << printable(dvr_here(store)) << " proc restore " << printable(p.name) << "` restores them\n";
}

// A periodic dump series: NAME-YYYYMMDDTHHMMSSZ.
std::string series_name(const std::string& name) {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return name + "-" + buf;
}

// A series' prefix and interval, checked before any job starts: every dump
// name (NAME-<UTC time>, "-N" added when two fall in one second) must be a
// valid process snapshot name, and an interval of 0 would dump without pause.
double checked_series(const std::string& name, const std::string& every) {
  dvr::split_ref("proc/" + name);
  constexpr std::size_t kSuffix = 17 + 4;  // "-20261207T200139Z" and room for "-NNN"
  if (name.size() + kSuffix > 120)
    throw Error(Errc::invalid_argument, "series name '" + name + "' is too long: its dumps are NAME-<UTC time>, and a process snapshot name has at most 120 "
                                        "characters, so NAME has at most " + std::to_string(120 - kSuffix));
  const double every_s = parse_duration(every);
  if (!(every_s > 0)) throw Error(Errc::invalid_argument, "--every/--dump-every " + every + " is no interval; give one like 30s, 10m or 2h");
  return every_s;
}

bool in_series(const std::string& dump, const std::string& name) {
  if (dump.size() < name.size() + 17 || dump.compare(0, name.size() + 1, name + "-") != 0) return false;
  std::string stamp = dump.substr(name.size() + 1, 16);  // YYYYMMDDTHHMMSSZ, then maybe -N
  for (std::size_t k = 0; k < 16; ++k) {
    bool digit = std::isdigit(static_cast<unsigned char>(stamp[k]));
    if ((k == 8 && stamp[k] != 'T') || (k == 15 && stamp[k] != 'Z') || (k != 8 && k != 15 && !digit)) return false;
  }
  std::string rest = dump.substr(name.size() + 17);
  return rest.empty() || (rest.size() > 1 && rest[0] == '-' && rest.find_first_not_of("0123456789", 1) == std::string::npos);
}

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

struct StopSignals {
  struct sigaction old_int {}, old_term {};
  StopSignals() {
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;  // no SA_RESTART: sleeps end at once
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGINT, &sa, &old_int);
    ::sigaction(SIGTERM, &sa, &old_term);
  }
  ~StopSignals() {
    ::sigaction(SIGINT, &old_int, nullptr);
    ::sigaction(SIGTERM, &old_term, nullptr);
  }
};

struct PeriodicArgs {
  std::string name;
  double every_s = 0;
  unsigned keep = 0;  // 0 = keep all
  bool tcp_established = false;
  bool json = false;
  // What a stop signal does to the process (dvr run --dump-every: passed on).
  bool forward_signal = false;
  // The job's record in STORE/run/PID.json (dvr/jobs.hpp): dvr run's, or a
  // new one (kind dump_every).
  std::optional<JobRecord> record;
};

// The job registry that `dvr serve` reads: best effort (a store that cannot
// take the record still gets its dumps), said once on stderr.
void write_record(const std::string& store_path, const JobRecord& r) {
  static bool warned = false;
  try {
    dvr::write_job(store_path, r);
  } catch (const Error& e) {
    if (!warned) std::cerr << "dvr: note: " << e.what() << " (dvr serve will not list this job)\n";
    warned = true;
  }
}

std::string joined(const std::vector<std::string>& argv) {
  std::string out;
  for (auto& a : argv)
    out += (out.empty() ? "" : " ") + a;
  return out;
}


// Dumps `pid` as NAME-<UTC time> every `every_s` seconds (each compared with
// the previous one, so it stores what changed) until the process exits or a
// SIGINT/SIGTERM arrives, keeping the newest `keep` of the series.
int periodic_dumps(pid_t pid, const PeriodicArgs& a) {
  dvr::split_ref("proc/" + a.name);  // the name's check, before the first dump
  Store store = open_store(true);
  StopSignals signals;
  JobRecord record;
  // A `dvr run` job's own record comes back when the series ends.
  std::optional<JobRecord> before;
  if (!a.record)
    for (auto& r : dvr::read_jobs(store.path()))
      if (r.pid == pid && dvr::job_alive(r)) before = r;
  if (a.record) {
    record = *a.record;
  } else {
    record.pid = pid;
    record.start_ticks = dvr::process_start_ticks(pid);
    record.kind = "dump_every";
    record.command = dvr::process_command(pid);
  }
  record.interval_s = a.every_s;
  write_record(store.path(), record);
  // Removed when the series ends, unless its last dump failed (dvr serve then
  // shows a dump_failed alert until the record goes).
  struct RecordGuard {
    const std::string& store;
    JobRecord& r;
    std::optional<JobRecord>& before;
    ~RecordGuard() {
      if (!r.last_error.empty()) return;
      if (before && dvr::job_alive(*before))
        write_record(store, *before);
      else
        dvr::remove_job(store, r);
    }
  } record_guard{store.path(), record, before};
  proc::DumpOptions o;
  o.leave_running = true;
  o.tcp_established = a.tcp_established;
  unsigned dumps = 0, removed = 0;
  auto say = [&](const std::string& what, json event) {
    if (a.json) {
      json doc = document();
      doc["event"] = event.at("event");
      event.erase("event");
      doc.update(event);
      print_json(doc);
      std::cout.flush();
    } else {
      std::cout << what << "\n" << std::flush;
    }
  };
  std::string why;
  while (true) {
    if (g_stop_signal) {
      why = std::string("stopped by ") + strsignal(g_stop_signal) + "; the process keeps running";
      break;
    }
    if (!process_alive(pid)) {
      why = "process " + std::to_string(pid) + " has exited";
      break;
    }
    std::string dump = series_name(a.name);
    for (int n = 2; [&] {
           try {
             proc::info(store, dump);
             return true;
           } catch (const Error&) {
             return false;
           }
         }();
         ++n)
      dump = series_name(a.name) + "-" + std::to_string(n);
    proc::ProcInfo p;
    try {
      // A bar per dump; none with --json (its lines would mix with the events).
      ProgressReporter progress("proc dump", a.json ? ProgressMode::none : progress_mode());
      o.progress = progress.callback();
      p = proc::dump(store, pid, dump, o);
      o.progress = nullptr;
    } catch (const Error& e) {
      if (!process_alive(pid)) {
        why = "process " + std::to_string(pid) + " exited during a dump (proc/" + dump + " was not stored)";
        break;
      }
      if (g_stop_signal) {  // Ctrl-C reaches CRIU too (one process group): a stop, not a failed dump
        why = std::string("stopped by ") + strsignal(g_stop_signal) + " during a dump (proc/" + dump + " was not stored)";
        break;
      }
      record.last_error = std::string("proc/") + dump + ": " + e.what();
      write_record(store.path(), record);
      throw;
    }
    ++dumps;
    record.last_dump = p.name;
    record.last_dump_ns = p.time_ns;
    record.last_error.clear();
    write_record(store.path(), record);
    if (a.json) {
      json ev = to_json(p);
      ev["event"] = "dump";
      say("", ev);
    } else {
      std::cout << "dumped process " << pid << " as proc/" << printable(p.name) << ": " << bytes(p.stored_bytes) << " added"
                << (p.parent.empty() ? "" : " (compared with proc/" + printable(p.parent) + ")") << ", " << format_seconds(p.seconds) << "\n"
                << std::flush;
    }
    if (a.keep > 0) {
      std::vector<proc::ProcInfo> series;
      for (auto& q : proc::list(store))
        if (in_series(q.name, a.name)) series.push_back(q);
      std::sort(series.begin(), series.end(), [](auto& x, auto& y) { return x.seq < y.seq; });  // commit order, not the clock
      for (std::size_t k = 0; k + a.keep < series.size(); ++k) {
        proc::remove(store, series[k].name);
        ++removed;
        say("removed proc/" + printable(series[k].name) + " (keeping the newest " + std::to_string(a.keep) + ")",
            json{{"event", "removed"}, {"name", jstr(series[k].name)}});
      }
    }
    // Sleeps in short steps: the process's exit and a signal end it early.
    auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(a.every_s);
    while (!g_stop_signal && process_alive(pid) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (g_stop_signal && a.forward_signal && process_alive(pid)) {
    ::kill(pid, g_stop_signal);
    why = std::string("stopped by ") + strsignal(g_stop_signal) + ", passed on to process " + std::to_string(pid);
  }
  unsigned kept = 0;
  for (auto& q : proc::list(store))
    kept += in_series(q.name, a.name);
  say(why + "; " + std::to_string(dumps) + " dump(s) taken, " + std::to_string(removed) + " removed, " + std::to_string(kept) + " of series " +
          printable(a.name) + " in the store (`" + printable(dvr_here(store)) + " proc ls`)",
      json{{"event", "end"}, {"why", why}, {"dumps", dumps}, {"removed", removed}, {"kept", kept}});
  return 0;
}

struct ProcArgs {
  std::string target;  // PID or NAME
  std::vector<std::string> names;
  std::string name, pidfile, net, ip, host_ip, every;
  std::vector<std::string> heap_dirs;  // proc restore/clone --heap-dir
  unsigned keep = 0;
  bool leave_running = false, tcp_established = false, detach = false, json = false;
};

int cmd_proc_check(bool as_json) {
  proc::Preflight p = proc::preflight();
  auto status = [](const proc::Capability& c) { return !c.checked ? "skipped" : c.ok ? "ok" : "missing"; };
  if (as_json) {
    json doc = document();
    doc["ok"] = p.ok;
    doc["criu"] = jstr(p.criu);
    doc["criu_version"] = jstr(p.criu_version);
    doc["plugin"] = jstr(p.plugin);
    json problems = json::array();
    for (auto& x : p.problems)
      problems.push_back(jstr(x));
    doc["problems"] = std::move(problems);
    json caps = json::array();
    for (auto& c : p.capabilities)
      caps.push_back({{"name", jstr(c.name)}, {"status", status(c)}, {"ok", c.ok}, {"required", c.required}, {"detail", jstr(c.detail)}});
    doc["capabilities"] = std::move(caps);
    print_json(doc);
    return p.ok ? 0 : 1;
  }
  // One line per capability: its status, its name, what was found or what to
  // do (an optional one missing says so).
  for (auto& c : p.capabilities) {
    std::string st = status(c), name = c.name;
    st.resize(std::max<std::size_t>(st.size() + 1, 9), ' ');
    name.resize(std::max<std::size_t>(name.size() + 1, 17), ' ');
    // A detail of several lines (CRIU's errors) goes on under the first.
    std::string detail, line;
    std::istringstream in(c.detail);
    for (bool first = true; std::getline(in, line); first = false) {
      if (!first) line.erase(0, line.find_first_not_of(' '));
      detail += (first ? "" : "\n" + std::string(st.size() + name.size() + 2, ' ')) + printable(line);
    }
    std::cout << st << name << (!c.required && c.checked && !c.ok ? "optional: " : "") << detail << "\n";
  }
  for (auto& x : p.problems)
    std::cerr << "dvr: " << x << "\n";
  if (p.ok)
    std::cout << "ready: processes can be dumped and restored\n";
  else
    std::cout << "not ready: " << p.problems.size() << (p.problems.size() == 1 ? " capability is" : " capabilities are") << " missing (above)\n";
  return p.ok ? 0 : 1;
}

int cmd_proc_dump(const ProcArgs& a) {
  pid_t pid = parse_pid(a.target);
  if (!a.every.empty()) {
    if (!process_alive(pid)) throw Error(Errc::not_found, "no process " + std::to_string(pid) + " runs; `ps -p " + std::to_string(pid) + "` shows it");
    PeriodicArgs p;
    p.name = a.name;
    p.every_s = checked_series(a.name, a.every);
    p.keep = a.keep;
    p.tcp_established = a.tcp_established;
    p.json = a.json;
    return periodic_dumps(pid, p);
  }
  if (a.keep) throw Error(Errc::invalid_argument, "--keep goes with --every (a series of periodic dumps)");
  proc::DumpOptions o;
  o.leave_running = a.leave_running;
  o.tcp_established = a.tcp_established;
  Store store = open_store(true);
  ProgressReporter progress("proc dump", progress_mode());
  o.progress = progress.callback();
  proc::ProcInfo p = proc::dump(store, pid, a.name, o);
  progress.finish();
  if (a.json) {
    json doc = document();
    doc.update(to_json(p));
    print_json(doc);
  } else {
    print_dump(p, o, store);
  }
  return 0;
}

int cmd_proc_restore(const ProcArgs& a, bool clone) {
  proc::RestoreOptions o;
  o.clone = clone;
  o.detach = clone || a.detach;
  o.pidfile = a.pidfile;
  o.net = a.net;  // taken for restore too, so that the library says they are for clones
  o.ip = a.ip;
  o.host_ip = a.host_ip;
  o.tcp_established = a.tcp_established;
  o.heap_dirs = a.heap_dirs;
  Store store = open_store(false);
  // A dump with established connections restores them by itself (a clone
  // closes them, the original still holding them): say so.
  proc::ProcInfo before = proc::info(store, a.target);
  if (before.tcp_established && !o.tcp_established)
    std::cerr << "dvr: "
              << (o.clone ? "note: proc/" + before.name +
                                " was dumped with --tcp-established; the clone gets its TCP connections closed (--tcp-close), as the original holds them"
                          : "note: proc/" + before.name + " was dumped with --tcp-established: restoring its TCP connections (--tcp-established)")
              << "\n";
  // The bar goes at its final call, before the process runs (a restore that
  // waits for the process returns only when it exits).
  ProgressReporter progress(clone ? "proc clone" : "proc restore", progress_mode());
  o.progress = progress.callback();
  proc::RestoreResult r = proc::restore(store, a.target, o);
  progress.finish();
  for (auto& n : r.notes)
    std::cerr << "dvr: note: " << printable_lines(n) << "\n";
  if (!o.detach) return r.exit_status;
  if (a.json) {
    print_json(restore_document(a.target, r));
  } else {
    if (!r.ip.empty())
      std::cerr << "dvr: clone " << r.pid << " runs in a network namespace of its own at " << r.ip << " (host end " << r.host_if << " at " << r.host_ip
                << "); it goes when the clone exits; run commands in it with nsenter -t " << r.pid << " -n CMD\n";
    else if (!r.net.empty())
      std::cerr << "dvr: clone " << r.pid << " runs in network namespace " << r.net << "\n";
    std::cout << r.pid << "\n";
  }
  return 0;
}

int cmd_proc_ls(bool as_json) {
  Store store = open_store(false);
  auto all = proc::list(store);
  if (as_json) {
    print_json(proc_ls_document(all));
    return 0;
  }
  if (all.empty()) {
    std::cout << "no process snapshots in " << printable(store.path()) << " (`" << printable(dvr_here(store)) << " proc dump PID --name NAME` takes one)\n";
    return 0;
  }
  std::printf("%-28s %-19s %8s %10s %10s %5s  %s\n", "NAME", "TIME", "PID", "IMAGES", "STORED", "HEAPS", "COMMAND");
  for (auto& p : all)
    std::printf("%-28s %-19s %8d %10s %10s %5zu  %s\n", printable(p.name).c_str(), format_time(p.time_ns).c_str(), static_cast<int>(p.pid),
                bytes(p.image_bytes).c_str(), bytes(p.stored_bytes).c_str(), p.heaps.size(), printable(p.command).c_str());
  return 0;
}

int cmd_proc_info(const ProcArgs& a) {
  Store store = open_store(false);
  proc::ProcInfo p = proc::info(store, a.target);
  if (a.json) {
    json doc = document();
    doc.update(to_json(p));
    print_json(doc);
    return 0;
  }
  std::uint64_t heap_bytes = 0;
  for (auto& h : p.heaps)
    heap_bytes += h.bytes;
  std::cout << "process snapshot  proc/" << printable(p.name) << "\n"
            << "time              " << format_time(p.time_ns) << " (" << rfc3339(p.time_ns) << ")\n"
            << "process           " << p.pid << (p.own_pid_namespace ? " (PID 1 of its own PID namespace: `dvr run`)" : "") << "\n"
            << "command           " << printable(p.command) << "\n"
            << "images            " << bytes(p.image_bytes) << " of CRIU images\n"
            << "stored            " << bytes(p.stored_bytes) << " added to the store by this dump\n"
            << "compared with     " << (p.parent.empty() ? "(none: a full dump)" : "proc/" + printable(p.parent)) << "\n"
            << "dumped            " << (p.leave_running ? "leaving it running" : "stopping it")
            << (p.tcp_established ? ", with its established TCP connections" : "") << "\n"
            << "CRIU              " << (p.criu_version.empty() ? "(not recorded)" : printable(p.criu_version)) << "\n"
            << "kernel            " << (p.kernel.empty() ? "(not recorded)" : printable(p.kernel)) << "\n"
            << "heaps             " << p.heaps.size() << (p.heaps.empty() ? "" : " (" + bytes(heap_bytes) + ")") << "\n";
  for (auto& h : p.heaps)
    std::cout << "  " << printable(h.path) << "  " << bytes(h.bytes) << "  snapshot " << printable(h.session) << "/" << proc::kHeapPrefix
              << printable(p.name) << "\n";
  std::cout << "mapped files      " << p.files.size() << " (programs and libraries a restore needs unchanged)\n"
            << "restore it with `" << printable(dvr_here(store)) << " proc restore " << printable(p.name) << "`, or start a copy beside it with `"
            << printable(dvr_here(store)) << " proc clone " << printable(p.name) << "`\n";
  return 0;
}

int cmd_proc_rm(const ProcArgs& a) {
  std::vector<std::string> names;
  std::set<std::string> seen;
  for (auto& n : a.names)
    if (seen.insert(n).second) names.push_back(n);
  Store store = open_store(false);
  std::vector<proc::ProcInfo> infos;
  for (auto& n : names)
    infos.push_back(proc::info(store, n));  // every name is checked before anything is removed
  json removed = json::array();
  for (auto& p : infos) {
    // Which heap snapshots there are to remove, asked before: one may be gone already.
    std::vector<std::string> lines;
    // A received snapshot's heap snapshots are removed in this store only,
    // whatever store its metadata names (proc::remove, docs/migration.md).
    for (auto& h : p.heaps) {
      const std::string ref = printable(h.session + "/" + proc::kHeapPrefix + p.name);
      if (!h.store.empty() && h.store != store.path() && !p.received()) {
        lines.push_back(" and its heap snapshot " + ref + " in store " + printable(h.store));
        continue;
      }
      bool here = false;
      try {
        store.info(h.session, proc::kHeapPrefix + p.name);
        here = true;
      } catch (const Error& e) {
        here = e.code() == Errc::corrupt;  // damaged, but there (and removed)
      }
      lines.push_back(here ? " and its heap snapshot " + ref : " (its heap snapshot " + ref + " was gone already)");
    }
    proc::remove(store, p.name);
    removed.push_back(jstr(p.name));
    if (!a.json) {
      std::cout << "removed proc/" << printable(p.name);
      for (auto& l : lines)
        std::cout << l;
      std::cout << "\n";
    }
  }
  if (a.json) {
    json doc = document();
    doc["removed"] = std::move(removed);
    print_json(doc);
  } else {
    std::cout << "run `" << printable(dvr_here(store)) << " gc` to reclaim the space\n";
  }
  return 0;
}

struct RunArgs {
  std::vector<std::string> argv;
  std::string output, cwd, heap, heap_session, dump_every, name;
  unsigned keep = 0;
  bool heap_given = false, json = false;
};

int cmd_run(const RunArgs& a) {
  if (a.argv.empty()) throw Error(Errc::invalid_argument, "dvr run needs a command: dvr run [OPTIONS] -- CMD [ARGS...]");
  proc::RunOptions o;
  o.output = a.output;
  o.cwd = a.cwd;
  std::string session = a.heap_session;
  if (a.heap_given) o.heap_bytes = parse_size(a.heap.empty() ? "4G" : a.heap);
  if (!session.empty() && !o.heap_bytes) throw Error(Errc::invalid_argument, "--heap-session goes with --heap");
  if (!a.dump_every.empty() && a.name.empty()) throw Error(Errc::invalid_argument, "--dump-every needs --name NAME (the dumps are NAME-<UTC time>)");
  if (a.dump_every.empty() && (!a.name.empty() || a.keep))
    throw Error(Errc::invalid_argument, "--name and --keep go with --dump-every (periodic dumps of the job)");
  // Everything about the series is checked before the job starts.
  const double every_s = a.dump_every.empty() ? 0 : checked_series(a.name, a.dump_every);
  std::optional<Store> store;
  if (o.heap_bytes) {
    store = open_store(true);
    if (session.empty()) {
      std::string base = a.argv[0].substr(a.argv[0].find_last_of('/') + 1);
      for (char& c : base)
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') c = '-';
      session = "run-" + (base.empty() ? std::string("job") : base) + "-" + std::to_string(::time(nullptr));
      // Two jobs started in one second get sessions of their own.
      const std::string first = session;
      for (int n = 2; ::access((store->path() + "/heaps/" + session).c_str(), F_OK) == 0; ++n)  // the heap's directory
        session = first + "-" + std::to_string(n);
    }
    o.heap_store = store->path();
    o.heap_session = session;
  }
  pid_t pid = proc::run(a.argv, o);
  // The job's record for dvr serve: in the store of its heap, else in the
  // store if there is one (dvr run without --heap makes none).
  JobRecord record;
  record.pid = pid;
  record.start_ticks = dvr::process_start_ticks(pid);
  record.kind = "run";
  record.command = joined(a.argv);
  record.heap = o.heap_bytes ? proc::heap_path(o.heap_store, session) : "";
  std::optional<Store> registry_store = store;
  if (!registry_store) {
    try {
      registry_store = open_store(!a.dump_every.empty());
    } catch (const Error&) {
      // no store: nothing to register in
    }
  }
  if (registry_store && a.dump_every.empty()) write_record(registry_store->path(), record);
  if (a.json && a.dump_every.empty()) {
    json doc = document();
    doc["pid"] = pid;
    doc["heap"] = o.heap_bytes ? jstr(proc::heap_path(o.heap_store, session)) : json(nullptr);
    doc["heap_session"] = o.heap_bytes ? jstr(session) : json(nullptr);
    print_json(doc);
  } else if (!a.json) {
    std::cout << pid << "\n" << std::flush;
  }
  if (o.heap_bytes)
    std::cerr << "dvr run: heap " << proc::heap_path(o.heap_store, session) << " (" << bytes(o.heap_bytes) << ", session " << session
              << "); dump it with `dvr --store " << printable(dvr::shell_word(o.heap_store)) << " proc dump " << pid << " --name NAME`\n";
  if (a.dump_every.empty()) return 0;
  PeriodicArgs p;
  p.name = a.name;
  p.every_s = every_s;
  p.keep = a.keep;
  p.json = a.json;
  p.forward_signal = true;
  p.record = record;
  return periodic_dumps(pid, p);
}

// ---- the command tree -------------------------------------------------------

const char* kDescription =
    "Memory DVR: named snapshots of application memory, restored in milliseconds.\n"
    "Snapshots are SESSION/NAME; process snapshots are proc/NAME. `dvr COMMAND --help` shows a command's options and examples.";

void add_json(CLI::App* sub, bool& flag) { sub->add_flag("--json", flag, "print one JSON document on stdout (docs/cli.md)"); }

// --sign KEY (send, export, push): the sender's side of a signed stream.
void add_sign_option(CLI::App* sub, TransferArgs& t) {
  sub->add_option("--sign", t.sign, "sign the stream with this secret key file (made by `dvr keygen`)")->type_name("KEY");
}

// --require-signature PUBKEY (receive, import, pull): the receiver's side.
void add_require_option(CLI::App* sub, TransferArgs& t) {
  sub->add_option("--require-signature", t.require_keys,
                  "store nothing unless the stream is signed by this public key (PREFIX.pub; repeat to accept any of several)")
      ->type_name("PUBKEY")
      ->allow_extra_args(false);
}

int cmd_keygen(const std::string& prefix, bool as_json) {
  if (prefix.empty() || prefix.back() == '/')
    throw Error(Errc::invalid_argument, "--out " + prefix + " names no file: give a prefix like DIR/NAME (NAME.key and NAME.pub are written)");
  transfer::SigningKey k = transfer::SigningKey::generate();
  k.save(prefix);
  if (as_json) {
    json doc = document();
    doc["secret_key"] = jstr(prefix + ".key");
    doc["public_key"] = jstr(prefix + ".pub");
    doc["fingerprint"] = k.fingerprint();
    print_json(doc);
  } else {
    std::cout << "wrote " << printable(prefix) << ".key (secret, mode 0600: keep it on the sending side) and " << printable(prefix)
              << ".pub (public: give it to the receivers); key " << k.fingerprint() << "\n";
  }
  return 0;
}

void add_transfer_options(CLI::App* sub, TransferArgs& t) {
  sub->add_option("--base", t.base, "send only what differs from this snapshot (NAME or SESSION/NAME) of the same session, which the receiver holds");
  sub->add_option("--compress", t.compress, "auto (default: chunks that compress), zstd (every chunk) or none")
      ->check(one_of({"auto", "zstd", "none"}));
  sub->add_flag("--no-compress", t.no_compress, "the same as --compress=none");
  sub->add_option("--level", t.level, "zstd's level (default 1)")->check(whole_number(1, 19));
}

// push and pull: how the far side is reached.
void add_ssh_options(CLI::App* sub, TransferArgs& t) {
  sub->add_option("--ssh", t.ssh, "the ssh command (default $DVR_SSH, else ssh)")->type_name("CMD");
  sub->add_option("--remote-dvr", t.remote_dvr, "the far dvr (default dvr)")->type_name("PATH");
  sub->add_option("--keep-ssh", t.keep_ssh,
                  "keep the ssh connection open this long after the transfer, for the next push or pull to the same host "
                  "(OpenSSH's ControlPersist), and for push a receiver at the far end that later pushes reach through it "
                  "without a login (default $DVR_KEEP_SSH, else 0: closed)")
      ->type_name("DURATION");
}

int run(int argc, char** argv) {
  CLI::App app(kDescription, "dvr");
  app.get_formatter()->label("Usage", "usage");
  app.get_formatter()->column_width(34);
  app.fallthrough();  // --store and --progress after the command too
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("dvr ") + dvr::version(), "print the version");
  app.add_option("--store", g.store_path, "the store directory (default: $DVR_STORE, else /dev/shm/dvr-$UID)")
      ->type_name("DIR")
      // An empty --store "$S" (an unset variable) must not mean the default store.
      ->check([](const std::string& v) { return v.empty() ? std::string("the store directory is empty (an unset variable?)") : std::string(); });
  app.add_option("--lock-timeout", g.lock_timeout,
                 "give up (exit 1, nothing changed) when the store stays locked by another process this long (default: wait)")
      ->type_name("DURATION")
      ->check([](const std::string& v) {
        try {
          (void)parse_duration(v);
          return std::string();
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
      });
  app.add_option("--progress", g.progress, "progress of long operations on stderr: auto (a bar on a terminal), bar, json (lines), none")
      ->check(one_of({"auto", "bar", "json", "none"}));
  app.footer(
      "Examples:\n"
      "  dvr ls                          every snapshot of the default store\n"
      "  dvr --store /mnt/pmem0/dvr ls sweep\n"
      "  dvr verify --progress=json      progress as JSON lines on stderr\n"
      "  dvr completion bash > /etc/bash_completion.d/dvr\n"
      "Exit status: 0 success, 1 failure (or damage found), 2 bad usage. See docs/cli.md.");
  int rc = 0;
  std::function<int()> action;

  DemoOptions demo;
  std::string demo_size = "1G";
  auto* c_demo = app.add_subcommand("demo", "build a data set, snapshot it, run trials that mutate it and restore between them");
  c_demo->add_option("--size", demo_size, "bytes of feature data (default 1G)")->check(size_value());
  c_demo->add_option("--trials", demo.trials, "trials, each followed by a restore (default 5)")->check(whole_number(1, 1000000));
  add_json(c_demo, demo.json);
  c_demo->footer("Examples:\n  dvr demo\n  dvr demo --size 4G --trials 10 --json");
  c_demo->callback([&] {
    action = [&] {
      demo.size = parse_size(demo_size);
      demo.progress = progress_mode();
      Store store = open_store(true);
      return run_demo(store, demo);
    };
  });

  LsArgs ls;
  auto* c_ls = app.add_subcommand("ls", "list snapshots (of every session, or of one), oldest first");
  c_ls->add_option("session", ls.session, "only this session (an unknown one is an error)");
  add_json(c_ls, ls.json);
  c_ls->footer("Examples:\n  dvr ls\n  dvr ls sweep --json | jq '.snapshots[].name'");
  c_ls->callback([&] { action = [&] { return cmd_ls(ls); }; });

  RefArgs info;
  auto* c_info = app.add_subcommand("info", "one snapshot: time, parent, label, sizes, regions");
  c_info->add_option("ref", info.ref, "the snapshot")->required()->type_name("SESSION/NAME");
  add_json(c_info, info.json);
  c_info->footer("Examples:\n  dvr info sweep/loaded\n  dvr info sweep/loaded --json | jq .regions");
  c_info->callback([&] { action = [&] { return cmd_info(info); }; });

  RmArgs rm;
  auto* c_rm = app.add_subcommand("rm", "remove snapshots (every name is checked before any is removed; `dvr gc` reclaims the space)");
  c_rm->add_option("refs", rm.refs, "the snapshots (a name given twice is removed once)")->required()->type_name("SESSION/NAME...");
  add_json(c_rm, rm.json);
  c_rm->footer("Examples:\n  dvr rm sweep/trial-1 sweep/trial-2 && dvr gc");
  c_rm->callback([&] { action = [&] { return cmd_rm(rm); }; });

  PruneArgs prune;
  auto* c_prune = app.add_subcommand("prune", "remove a session's old snapshots by a retention policy (each keep rule keeps the newest snapshot per bucket)");
  c_prune->add_option("session", prune.session, "the session")->required();
  c_prune->add_option("--keep-last", prune.keep_last, "keep the newest N snapshots")->check(whole_number(1, 1000000));
  c_prune->add_option("--keep-within", prune.keep_within, "keep the snapshots taken within this long of the newest (90s, 10m, 2h, 3d, 1w)")
      ->check(duration_value());
  c_prune->add_option("--keep-hourly", prune.keep_hourly, "keep the newest snapshot of each of the last N hours that have one")->check(whole_number(1, 1000000));
  c_prune->add_option("--keep-daily", prune.keep_daily, "... of each of the last N days (UTC)")->check(whole_number(1, 1000000));
  c_prune->add_option("--keep-weekly", prune.keep_weekly, "... of each of the last N ISO weeks")->check(whole_number(1, 1000000));
  c_prune->add_option("--keep-monthly", prune.keep_monthly, "... of each of the last N months")->check(whole_number(1, 1000000));
  c_prune->add_flag("--dry-run,-n", prune.dry_run, "say what would be removed; remove nothing");
  add_json(c_prune, prune.json);
  c_prune->footer(
      "A snapshot is kept when any rule keeps it; damaged snapshots are never removed. Removing a parent leaves its\n"
      "children complete (each snapshot lists all its data); an open clone keeps its data until it is closed.\n"
      "Examples:\n  dvr prune sweep --keep-last 3 --dry-run\n  dvr prune sweep --keep-within 2h --keep-daily 7 && dvr gc\n"
      "  dvr prune proc --keep-last 5 --json | jq '.decisions[] | select(.keep | not) | .snapshot.name'\n");
  c_prune->callback([&] { action = [&] { return cmd_prune(prune); }; });

  bool gc_json = false;
  auto* c_gc = app.add_subcommand("gc", "reclaim the space of removed and interrupted snapshots");
  add_json(c_gc, gc_json);
  c_gc->footer("Examples:\n  dvr gc\n  dvr gc --json | jq '.bytes_before - .bytes_after'");
  c_gc->callback([&] { action = [&] { return cmd_gc(gc_json); }; });

  bool verify_json = false;
  auto* c_verify = app.add_subcommand("verify", "re-hash every stored chunk, name each damaged snapshot (exit status 1 on damage)");
  add_json(c_verify, verify_json);
  c_verify->footer("Examples:\n  dvr verify\n  dvr verify --json --progress=json");
  c_verify->callback([&] { action = [&] { return cmd_verify(verify_json); }; });

  bool stat_json = false;
  auto* c_stat = app.add_subcommand("stat", "the store: path, medium, format, space used");
  add_json(c_stat, stat_json);
  c_stat->footer("Examples:\n  dvr stat\n  dvr --store /mnt/pmem0/dvr stat --json");
  c_stat->callback([&] { action = [&] { return cmd_stat(stat_json); }; });

  LsArgs log;
  auto* c_log = app.add_subcommand("log", "a session's snapshots as a tree of parent links (time, label, bytes added)");
  c_log->add_option("session", log.session, "the session")->required();
  add_json(c_log, log.json);
  c_log->footer("Examples:\n  dvr log sweep");
  c_log->callback([&] { action = [&] { return cmd_log(log); }; });

  DiffArgs diff;
  auto* c_diff = app.add_subcommand("diff", "per region: how many bytes and pages differ between two snapshots");
  c_diff->add_option("a", diff.a, "the first snapshot")->required()->type_name("SESSION/A");
  c_diff->add_option("b", diff.b, "the second snapshot")->required()->type_name("SESSION/B");
  add_json(c_diff, diff.json);
  c_diff->footer("Examples:\n  dvr diff sweep/loaded sweep/trial-3");
  c_diff->callback([&] { action = [&] { return cmd_diff(diff); }; });

  LsArgs rec;
  auto* c_rec = app.add_subcommand("recover", "the newest intact snapshot of a session (exit status 1 when there is none)");
  c_rec->add_option("session", rec.session, "the session")->required();
  add_json(c_rec, rec.json);
  c_rec->footer("Examples:\n  dvr recover sweep\n  dvr recover sweep --json | jq -r .latest.name");
  c_rec->callback([&] { action = [&] { return cmd_recover(rec); }; });

  // proc
  auto* c_proc = app.add_subcommand("proc", "whole-process snapshots with CRIU (root): dump, restore, clone, ls, info, rm, check");
  c_proc->require_subcommand(1);
  c_proc->footer("Examples:\n  dvr proc check\n  dvr proc dump 1234 --name job --every 10m --keep 6\n  dvr proc restore job-20261202T003107Z");
  ProcArgs pa;
  auto* p_dump = c_proc->add_subcommand("dump", "snapshot a process tree (a DVR persistent heap it maps is snapshotted, not copied)");
  p_dump->add_option("pid", pa.target, "the root process")->required()->type_name("PID");
  p_dump->add_option("--name", pa.name, "the snapshot's name (with --every: the series' prefix)")->required();
  p_dump->add_flag("--leave-running", pa.leave_running, "keep the process running (default: stop it once dumped)");
  p_dump->add_flag("--tcp-established", pa.tcp_established, "with its connected TCP sockets (clients stay connected)");
  p_dump->add_option("--every", pa.every, "dump every DURATION (10m, 2h, 30s) as NAME-<UTC time>, each compared with the previous, until the "
                                          "process exits or SIGINT/SIGTERM; implies --leave-running")
      ->check(duration_value());
  p_dump->add_option("--keep", pa.keep, "with --every: keep the newest N dumps of the series (default: all)")->check(whole_number(1, 1000000));
  add_json(p_dump, pa.json);
  p_dump->footer(
      "Examples:\n  dvr proc dump 1234 --name before-upgrade --leave-running\n"
      "  dvr proc dump 1234 --name train --every 10m --keep 6     (train-20261202T003107Z, ...)");
  p_dump->callback([&] { action = [&] { return cmd_proc_dump(pa); }; });

  auto* p_restore = c_proc->add_subcommand("restore", "bring a process snapshot back (waits for it and exits with its status, unless --detach)");
  // `proc/NAME`, the form ls and rm print, names the same process snapshot.
  auto proc_ref = CLI::Validator([](std::string& v) {
    if (v.rfind("proc/", 0) == 0) v.erase(0, 5);
    return std::string();
  }, "", "proc/NAME");
  p_restore->add_option("name", pa.target, "the process snapshot")->required()->type_name("NAME")->transform(proc_ref);
  p_restore->add_flag("--detach", pa.detach, "return once it runs; print its PID");
  p_restore->add_option("--pidfile", pa.pidfile, "write its PID to FILE")->type_name("FILE");
  p_restore->add_flag("--tcp-established", pa.tcp_established, "restore its TCP connections (automatic for a dump that has them)");
  p_restore->add_option("--heap-dir", pa.heap_dirs,
                        "also allow DVR heap files in DIR/SESSION/REGION (default: only this store's heaps/; e.g. another store's heaps/ directory)")
      ->type_name("DIR");
  p_restore->add_option("--net", pa.net, "(clones only)")->group("");
  p_restore->add_option("--ip", pa.ip, "(clones only)")->group("");
  p_restore->add_option("--host-ip", pa.host_ip, "(clones only)")->group("");
  add_json(p_restore, pa.json);
  p_restore->footer("Examples:\n  dvr proc restore job --detach --pidfile /run/job.pid");
  p_restore->callback([&] { action = [&] { return cmd_proc_restore(pa, false); }; });

  auto* p_clone = c_proc->add_subcommand("clone", "start a copy beside the running original (fresh PID namespace, private heaps)");
  p_clone->add_option("name", pa.target, "the process snapshot")->required()->type_name("NAME")->transform(proc_ref);
  p_clone->add_option("--net", pa.net, "new (a network namespace of its own, veth pair to the host) or NETNS (/run/netns/NETNS)");
  p_clone->add_option("--ip", pa.ip, "with --net new: the clone's address (default a free 10.213.x.y/30)")->type_name("ADDR/PREFIX");
  p_clone->add_option("--host-ip", pa.host_ip, "with --ip: the host end's address")->type_name("ADDR");
  p_clone->add_option("--pidfile", pa.pidfile, "write its PID to FILE")->type_name("FILE");
  p_clone->add_flag("--tcp-established", pa.tcp_established, "keep TCP connections (default: closed, the original holds them)");
  p_clone->add_option("--heap-dir", pa.heap_dirs, "also allow DVR heap files in DIR/SESSION/REGION (default: only this store's heaps/)")->type_name("DIR");
  add_json(p_clone, pa.json);
  p_clone->footer("Examples:\n  dvr proc clone job --net new\n  dvr proc clone job --net new --ip 10.213.0.2/30 --json");
  p_clone->callback([&] { action = [&] { return cmd_proc_restore(pa, true); }; });

  bool pls_json = false;
  auto* p_ls = c_proc->add_subcommand("ls", "process snapshots of the store, oldest first");
  add_json(p_ls, pls_json);
  p_ls->footer("Examples:\n  dvr proc ls\n  dvr proc ls --json");
  p_ls->callback([&] { action = [&] { return cmd_proc_ls(pls_json); }; });

  auto* p_info = c_proc->add_subcommand("info", "one process snapshot: time, sizes, heaps, kernel, CRIU version");
  p_info->add_option("name", pa.target, "the process snapshot")->required()->type_name("NAME")->transform(proc_ref);
  add_json(p_info, pa.json);
  p_info->footer("Examples:\n  dvr proc info job\n  dvr proc info proc/job --json");
  p_info->callback([&] { action = [&] { return cmd_proc_info(pa); }; });

  auto* p_rm = c_proc->add_subcommand("rm", "remove process snapshots and their heap snapshots (every name checked first)");
  p_rm->add_option("names", pa.names, "the process snapshots")->required()->type_name("NAME...")->transform(proc_ref);
  add_json(p_rm, pa.json);
  p_rm->footer("Examples:\n  dvr proc rm job-20261202T003107Z\n  dvr proc rm old1 old2 && dvr gc");
  p_rm->callback([&] { action = [&] { return cmd_proc_rm(pa); }; });

  bool check_json = false;
  auto* p_check = c_proc->add_subcommand("check", "every capability dvr proc depends on, one line each, with what to do about what is missing");
  add_json(p_check, check_json);
  p_check->footer("Examples:\n  dvr proc check\n  dvr proc check --json");
  p_check->callback([&] { action = [&] { return cmd_proc_check(check_json); }; });

  RunArgs ra;
  auto* c_run = app.add_subcommand("run", "start CMD as PID 1 of its own PID namespace, detached, so that it can be dumped, restored, cloned");
  c_run->add_option("--output", ra.output, "append its stdout and stderr to FILE (default /dev/null)")->type_name("FILE");
  c_run->add_option("--cwd", ra.cwd, "its working directory")->type_name("DIR");
  auto* heap_opt = c_run->add_option("--heap", ra.heap, "its heap (malloc, new, anonymous mmap) lives in a DVR persistent heap of MAX bytes "
                                                        "(default 4G) in the store")
                       ->expected(0, 1)
                       ->type_name("[MAX]")
                       ->check(size_value());
  c_run->add_option("--heap-session", ra.heap_session, "the heap's session (default run-PROGRAM-UNIXTIME)")->type_name("NAME");
  c_run->add_option("--dump-every", ra.dump_every, "stay in the foreground and dump the job every DURATION as NAME-<UTC time> until it exits "
                                                   "(SIGINT/SIGTERM are passed on to the job)")
      ->check(duration_value());
  c_run->add_option("--name", ra.name, "with --dump-every: the dumps' prefix");
  c_run->add_option("--keep", ra.keep, "with --dump-every: keep the newest N dumps")->check(whole_number(1, 1000000));
  add_json(c_run, ra.json);
  c_run->add_option("command", ra.argv, "the program and its arguments, after --")->type_name("-- CMD [ARGS...]");
  c_run->footer(
      "Examples:\n  dvr run --output job.log -- ./train --epochs 10\n  dvr run --heap 8G -- redis-server --save ''\n"
      "  dvr run --dump-every 10m --keep 6 --name train -- ./train");
  c_run->callback([&] {
    ra.heap_given = heap_opt->count() > 0;
    action = [&] { return cmd_run(ra); };
  });

  TransferArgs send;
  auto* c_send = app.add_subcommand("send", "write a snapshot (SESSION/NAME, or proc/NAME with its heaps) as a verified stream to stdout");
  c_send->add_option("ref", send.ref, "the snapshot")->required()->type_name("REF");
  add_transfer_options(c_send, send);
  add_sign_option(c_send, send);
  c_send->add_flag("--negotiate", send.negotiate, "(the far side of push/pull)")->group("");
  add_json(c_send, send.json);
  c_send->footer(
      "Examples:\n  dvr send sweep/loaded > loaded.dvr\n  dvr send sweep/b --base sweep/a | ssh host dvr receive\n"
      "  dvr send sweep/loaded --sign ~/.dvr/me.key | ssh host dvr receive --require-signature me.pub");
  c_send->callback([&] { action = [&] { return cmd_send(send); }; });

  TransferArgs recv;
  auto* c_recv = app.add_subcommand("receive", "read such a stream from stdin into the store; nothing is stored unless all of it checks out");
  c_recv->add_flag("--negotiate", recv.negotiate, "(the far side of push)")->group("");
  c_recv->add_flag("--listen", recv.listen, "(the far side of push --keep-ssh: start or find this store's kept receiver)")->group("");
  c_recv->add_option("--idle", recv.idle, "(with --listen: how long the kept receiver waits for the next push)")->group("");
  add_require_option(c_recv, recv);
  add_json(c_recv, recv.json);
  c_recv->footer("Examples:\n  dvr receive < loaded.dvr\n  dvr receive --require-signature alice.pub < loaded.dvr");
  c_recv->callback([&] { action = [&] { return cmd_receive(recv); }; });

  TransferArgs exp;
  auto* c_exp = app.add_subcommand("export", "write a snapshot's stream to a file (complete or not at all)");
  c_exp->add_option("ref", exp.ref, "the snapshot")->required()->type_name("REF");
  c_exp->add_option("-o,--output", exp.file, "the file")->required()->type_name("FILE");
  add_transfer_options(c_exp, exp);
  add_sign_option(c_exp, exp);
  add_json(c_exp, exp.json);
  c_exp->footer(
      "Examples:\n  dvr export sweep/loaded -o loaded.dvr\n  dvr export proc/job -o job.dvr --compress=zstd --level 3\n"
      "  dvr export sweep/loaded -o loaded.dvr --sign ~/.dvr/alice.key   (receivers: dvr import --require-signature alice.pub)");
  c_exp->callback([&] { action = [&] { return cmd_export(exp); }; });

  TransferArgs imp;
  auto* c_imp = app.add_subcommand("import", "read a stream file into the store");
  c_imp->add_option("file", imp.file, "the file")->required()->type_name("FILE");
  add_require_option(c_imp, imp);
  add_json(c_imp, imp.json);
  c_imp->footer(
      "Examples:\n  dvr import loaded.dvr\n  dvr import loaded.dvr --progress=json\n"
      "  dvr import loaded.dvr --require-signature alice.pub   (refuses a file not signed by alice.key)");
  c_imp->callback([&] { action = [&] { return cmd_import(imp); }; });

  std::string keygen_out;
  bool keygen_json = false;
  auto* c_keygen = app.add_subcommand("keygen", "make an Ed25519 key pair for signed streams (export/send --sign, import/receive --require-signature)");
  c_keygen->add_option("--out", keygen_out, "write PREFIX.key (secret, mode 0600) and PREFIX.pub (public); refuses to overwrite")
      ->required()
      ->type_name("PREFIX");
  add_json(c_keygen, keygen_json);
  c_keygen->footer(
      "Examples:\n  dvr keygen --out ~/.dvr/alice\n  dvr export sweep/loaded -o loaded.dvr --sign ~/.dvr/alice.key\n"
      "  dvr import loaded.dvr --require-signature alice.pub   (on the receiving side)");
  c_keygen->callback([&] { action = [&] { return cmd_keygen(keygen_out, keygen_json); }; });

  TransferArgs push, pull;
  auto* c_push = app.add_subcommand("push", "send a snapshot to a store on another machine through ssh (only what it lacks travels)");
  c_push->add_option("ref", push.ref, "the snapshot")->required()->type_name("REF");
  c_push->add_option("url", push.url, "the far store")->required()->type_name("ssh://[USER@]HOST[:PORT]/STORE");
  add_ssh_options(c_push, push);
  add_transfer_options(c_push, push);
  add_sign_option(c_push, push);
  add_json(c_push, push.json);
  c_push->footer(
      "Examples:\n  dvr push sweep/loaded ssh://node2/dev/shm/dvr-0\n  dvr push sweep/loaded ssh://node2/dev/shm/dvr-0 --sign ~/.dvr/me.key\n"
      "  dvr push sweep/step7 ssh://node2/dev/shm/dvr-0 --keep-ssh 10m   (the next push within 10 minutes reuses the connection)");
  c_push->callback([&] { action = [&] { return cmd_push_pull(push, true); }; });

  auto* c_pull = app.add_subcommand("pull", "the reverse of push");
  c_pull->add_option("url", pull.url, "the far store")->required()->type_name("ssh://[USER@]HOST[:PORT]/STORE");
  c_pull->add_option("ref", pull.ref, "the snapshot")->required()->type_name("REF");
  add_ssh_options(c_pull, pull);
  add_transfer_options(c_pull, pull);
  add_require_option(c_pull, pull);
  c_pull->add_option("--remote-sign", pull.remote_sign, "the far side signs the stream with this secret key file (a path on the far machine)")
      ->type_name("KEY");
  add_json(c_pull, pull.json);
  c_pull->footer(
      "Examples:\n  dvr pull ssh://node2/dev/shm/dvr-0 sweep/loaded\n"
      "  dvr pull ssh://node2/dev/shm/dvr-0 sweep/loaded --remote-sign /etc/dvr/node2.key --require-signature node2.pub");
  c_pull->callback([&] { action = [&] { return cmd_push_pull(pull, false); }; });

  server::ServeOptions so;
  std::vector<std::string> serve_stores;
  std::string verify_every = "6h";
  auto* c_serve = app.add_subcommand("serve", "serve the dashboard and the REST API (docs/dashboard.md) until SIGINT or SIGTERM");
  c_serve->add_option("--listen", so.listen, "address and port (default 127.0.0.1:8642; port 0: any free one); a non-loopback address needs "
                                              "--token-file and --tls-cert/--tls-key")
      ->type_name("HOST:PORT");
  c_serve->add_option("--store", serve_stores, "a store to serve (repeatable; default: the global --store, else the default store)")
      ->type_name("DIR");
  c_serve->add_option("--peer", so.peers, "another host's dvr serve, shown in the global view (repeatable)")->type_name("URL");
  c_serve->add_option("--peer-ca", so.peer_ca, "CA certificates for https:// peers (default: the system's)")->type_name("FILE");
  c_serve->add_option("--peer-token-file", so.peer_token_file, "the token sent to peers (mode 0600)")->type_name("FILE");
  c_serve->add_option("--token-file", so.token_file, "require Authorization: Bearer with this token (a file of mode 0600 owned by you)")
      ->type_name("FILE");
  c_serve->add_option("--tls-cert", so.tls_cert, "serve HTTPS with this PEM certificate (with --tls-key)")->type_name("FILE");
  c_serve->add_option("--tls-key", so.tls_key, "... and this PEM private key")->type_name("FILE");
  c_serve->add_option("--web-root", so.web_root, "the built dashboard (default: web/ beside the dvr binary)")->type_name("DIR");
  c_serve->add_option("--sample-every", so.sample_every_s, "seconds between memory samples (default 10; kept >= 24 h)")
      ->check(CLI::Range(0.05, 3600.0))
      ->type_name("S");
  c_serve->add_option("--check-every", so.check_every_s, "seconds between the cheap checks: damage flags, space, permissions (default 30)")
      ->check(CLI::Range(0.1, 86400.0))
      ->type_name("S");
  c_serve->add_option("--verify-every", verify_every, "a full verify of each store this often (default 6h; 0: only when asked)")
      ->type_name("DURATION");
  c_serve->add_option("--action-rate", so.action_rate, "actions of one kind per minute (default 6, as a burst)")->check(whole_number(1, 100000));
  c_serve->footer(
      "Prints {\"schema_version\":1,\"event\":\"listening\",\"url\":...,\"port\":...} on stdout once it listens; log lines go to stderr.\n"
      "Examples:\n  dvr serve                                  http://127.0.0.1:8642/ for the default store\n"
      "  dvr serve --store /mnt/pmem0/dvr --store /dev/shm/dvr-0 --peer http://node2:8642\n"
      "  dvr serve --listen 0.0.0.0:8642 --token-file ~/.dvr-token --tls-cert cert.pem --tls-key key.pem\n"
      "  curl -s http://127.0.0.1:8642/api/v1/stores | jq '.stores[].id'");
  c_serve->callback([&] {
    action = [&] {
      so.stores = serve_stores;
      if (so.stores.empty() && !g.store_path.empty()) so.stores.push_back(g.store_path);
      so.verify_every_s = verify_every == "0" ? 0 : parse_duration(verify_every);
      return server::serve(so);
    };
  });

  std::string shell;
  auto* c_comp = app.add_subcommand("completion", "print a shell completion script");
  c_comp->add_option("shell", shell, "the shell (bash)")->required()->check(one_of({"bash"}));
  c_comp->footer("Examples:\n  source <(dvr completion bash)\n  dvr completion bash > /etc/bash_completion.d/dvr");
  c_comp->callback([&] {
    action = [&] {
      std::cout << bash_completion(app);
      return 0;
    };
  });

  // Everything after the first `--` is `dvr run`'s program and its
  // arguments, taken as they are: left to CLI11, the `--` would go to an
  // option with an optional value (`--heap [MAX] -- CMD -x`) and CMD's
  // options would be read as dvr's.
  int dvr_args = argc;
  for (int i = 1; i < argc; ++i)
    if (std::string_view(argv[i]) == "--") {
      dvr_args = i;
      break;
    }
  try {
    app.parse(dvr_args, argv);
    if (dvr_args < argc) {
      if (!c_run->parsed()) throw CLI::ExtrasError("only `dvr run` takes a program after --", CLI::ExitCodes::ExtrasError);
      ra.argv.insert(ra.argv.end(), argv + dvr_args + 1, argv + argc);
    }
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // The innermost command given, for the message.
    const CLI::App* cmd = &app;
    std::string path = "dvr";
    for (auto subs = cmd->get_subcommands(); !subs.empty(); subs = cmd->get_subcommands()) {
      cmd = subs.front();
      path += " " + cmd->get_name();
    }
    std::string msg = e.what();
    if (dynamic_cast<const CLI::ExtrasError*>(&e) || dynamic_cast<const CLI::RequiredError*>(&e)) {
      auto extra = app.remaining(true);
      if (cmd == &app && !extra.empty() && extra.front().rfind("-", 0) != 0)
        msg = "unknown command '" + extra.front() + "'";
      else if (!extra.empty())
        msg = std::string(extra.front().rfind("-", 0) == 0 ? "unknown option '" : "unexpected argument '") + extra.front() + "' for `" + path + "`";
      else if (cmd == &app)
        msg = "a command is needed";
    }
    if (argc == 1) std::cerr << app.help();
    std::cerr << "dvr: " << msg << "; see `" << path << " --help`\n";
    if (json_requested(argc, argv)) print_json(error_document("invalid_argument", msg + "; see `" + path + " --help`", 2));
    return 2;
  }
  if (!action) return 2;
  progress_mode();
  rc = action();
  return rc;
}

// The heap of this short-lived process (docs/performance.md, "The dvr
// command's heap"): a command reads many manifests and builds the store's
// index, all in memory it has not touched before, and on a VM a first touch
// costs several microseconds a page. So glibc keeps what is freed for reuse
// instead of giving it back (mmap threshold 32 MiB, trim at 128 MiB), grows
// the heap 64 MiB at a time, and the first 64 MiB are asked to be
// transparent huge pages (where THP is "madvise", as on Debian): building the
// index of a store of 18 snapshots took 23-26 ms instead of 105-148 ms.
// Memory it does not touch costs nothing; a program dvr starts (exec) keeps
// none of this.
void tune_heap() {
#ifdef __GLIBC__
  ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 128 << 20);
  ::mallopt(M_TOP_PAD, 64 << 20);
  char* before = static_cast<char*>(::sbrk(0));
  void* volatile grow = std::malloc(1 << 20);  // volatile: not optimised away
  std::free(grow);
  char* after = static_cast<char*>(::sbrk(0));
  const std::uintptr_t huge = 2u << 20;
  const std::uintptr_t from = (reinterpret_cast<std::uintptr_t>(before) + huge - 1) & ~(huge - 1);
  if (before != reinterpret_cast<char*>(-1) && reinterpret_cast<std::uintptr_t>(after) > from)
    ::madvise(reinterpret_cast<void*>(from), reinterpret_cast<std::uintptr_t>(after) - from, MADV_HUGEPAGE);  // advice: failure is harmless
#endif
}

// A failed command: its message on stderr and, when JSON was asked for, an
// `error` document on stdout (a script reading the one document learns what
// went wrong as well as the exit status).
int failed(int argc, char** argv, const char* code, const char* message, int status) {
  std::cerr << "dvr: " << printable_lines(message) << "\n";
  if (json_requested(argc, argv) && !document_printed()) {
    try {
      print_json(error_document(code, message, status));
    } catch (const std::exception&) {
      // stdout itself failed: the message above is all there is
    }
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  tune_heap();
  ::signal(SIGPIPE, SIG_IGN);  // a closed pipe is an error message, not a silent death
  try {
    return run(argc, argv);
  } catch (const dvr::Error& e) {
    return failed(argc, argv, dvr::errc_name(e.code()), e.what(), e.code() == dvr::Errc::invalid_argument ? 2 : 1);
  } catch (const std::invalid_argument& e) {
    return failed(argc, argv, "invalid_argument", e.what(), 2);
  } catch (const std::exception& e) {
    return failed(argc, argv, "io", e.what(), 1);
  }
}
