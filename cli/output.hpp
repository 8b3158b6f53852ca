// What the dvr command prints: JSON documents (one schema, docs/cli.md) and
// text for people (control characters and invalid UTF-8 escaped).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dvr/log.hpp"
#include "dvr/proc.hpp"
#include "dvr/store.hpp"
#include "dvr/transfer.hpp"

namespace dvr::cli {

using json = nlohmann::ordered_json;

/// The version of the JSON documents dvr and `python -m memdvr` print; every
/// top-level document carries it as "schema_version". Raised when a field
/// changes meaning or goes; new fields keep it.
inline constexpr int kSchemaVersion = 1;

/// `s` as valid UTF-8: every byte that is not part of a well-formed UTF-8
/// sequence becomes the four characters \xNN (as Python's "backslashreplace"
/// writes it). Valid text is returned unchanged.
std::string utf8_safe(const std::string& s);

/// `s` for a terminal: dvr::escape_text (dvr/log.hpp), the one rule of every
/// text output (docs/cli.md, "Text output"), so that a label received from
/// another store cannot move the cursor or clear the screen.
inline std::string printable(const std::string& s) { return dvr::escape_text(s); }

/// A message of several lines (an error with a list, CRIU's output) for a
/// terminal: each line escaped with printable(), the line breaks kept.
std::string printable_lines(const std::string& s);

/// Nanoseconds since the Unix epoch as RFC 3339 UTC with nanoseconds:
/// "2026-12-02T00:31:07.123456789Z".
std::string rfc3339(std::int64_t time_ns);

/// A string value for a JSON document (utf8_safe).
inline json jstr(const std::string& s) { return utf8_safe(s); }

/// A new top-level document: {"schema_version": 1}.
inline json document() { return json{{"schema_version", kSchemaVersion}}; }

json to_json(const SnapshotInfo& info);
json to_json(const std::vector<SnapshotInfo>& infos);
json to_json(const RegionDiff& d);
json to_json(const VerifyReport& r);  // with schema_version
json to_json(const GcReport& r);      // with schema_version
json to_json(const StoreStats& s);    // with schema_version
json to_json(const proc::ProcInfo& p);
/// A transfer's statistics; `sent`: the sending side (sent_bytes, read_bytes, ...).
json to_json(const transfer::Stats& st, bool sent);  // with schema_version

// Whole documents, shared by the dvr command and `dvr serve` (server/):
/// The `log` (and `ls` of one session) document: {session, snapshots}.
json log_document(const std::string& session, const std::vector<SnapshotInfo>& snaps);
/// The `prune` document: {session, dry_run, removed, decisions}.
json prune_document(const std::string& session, const PruneReport& r);
/// The `diff` document of snapshots `a` and `b` (as the user named them).
json diff_document(const std::string& a, const std::string& b, const std::vector<RegionDiff>& regions);
/// The `proc_ls` document: {processes}.
json proc_ls_document(const std::vector<proc::ProcInfo>& all);
/// The `proc_restore` document of a detached restore or clone of `name`.
json restore_document(const std::string& name, const proc::RestoreResult& r);
/// The `rm` / `proc_rm` document: {removed}.
json removed_document(const std::vector<std::string>& removed);

/// Prints a document on stdout, one line.
void print_json(const json& doc);

/// The `error` document of a command that failed with `--json`:
/// {error: {code, message, exit_status}}; `code` is dvr::errc_name's
/// ("not_found", ...), or "invalid_argument" for bad usage.
json error_document(const std::string& code, const std::string& message, int exit_status);

/// Whether a command's own document has been printed (print_json of one
/// without an "event" key): a command that reports and then fails (`recover`
/// of an unknown session) prints no `error` document after it.
bool document_printed();

/// Whether the command line asks for JSON: `--json` before any `--` (what
/// follows `--` is a program's own arguments).
bool json_requested(int argc, char** argv);

}  // namespace dvr::cli
