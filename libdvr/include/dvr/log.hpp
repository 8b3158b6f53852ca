// Memory DVR — what the library tells about its work: a level and a sink.
//
// libdvr logs through this small sink rather than spdlog: it is embedded in
// other programs (Python, MPI codes, the CRIU plugin inside CRIU) that may
// link their own spdlog or fmt of another version, and a header-only logger
// of one version inside a shared library of another is an ODR clash waiting
// to happen. A callback lets each front end route the lines where its users
// look (Python's logging, the CLI's stderr, an application's own log).
//
// Nothing is logged below warn unless asked: set the level here or with the
// environment variable DVR_LOG=error|warn|info|debug (read once, when the
// library first logs or is asked for its level; set_log_level() wins). At
// info: why write tracking fell back to hashing (per region), each CRIU run
// (its command line, duration and exit status), lock waits that time out and
// are retried, autosaves, background snapshots starting and ending, gc's
// summary. At debug: the thread bound of each store opened, and each
// snapshot and restore with its figures.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "dvr/export.h"

namespace dvr {

/// Severity, most severe first. A message is logged when its level is at or
/// above the current one (debug logs everything).
enum class LogLevel { error, warn, info, debug };

/// "error", "warn", "info", "debug".
DVR_EXPORT const char* log_level_name(LogLevel level) noexcept;

/// Parses a level name as written above; throws dvr::Error (invalid_argument)
/// naming `text` and the accepted names.
DVR_EXPORT LogLevel parse_log_level(std::string_view text);

/// Sets the level for the whole process (every thread, every store).
/// Overrides $DVR_LOG. Thread-safe.
DVR_EXPORT void set_log_level(LogLevel level) noexcept;

/// The current level: what set_log_level() set, else $DVR_LOG, else warn.
/// An invalid $DVR_LOG logs one warning naming the value and the accepted
/// ones, and leaves the level at warn.
DVR_EXPORT LogLevel log_level() noexcept;

/// `text` made safe to print on one line of a terminal: the one rule of
/// every text output of dvr (the CLI's listings and messages, log lines,
/// `python -m memdvr`, the IPython magics), so that a label or name that
/// arrived from elsewhere cannot move the cursor, retitle the terminal or
/// forge a line. Valid UTF-8 stays as it is, except:
///  - backslash becomes \\ (so an escape can be told from text that looks
///    like one); newline, tab, carriage return become \n, \t, \r;
///  - the other C0 controls (U+0000 to U+001F) and DEL become \xNN;
///  - C1 controls (U+0080 to U+009F: CSI is U+009B) become \u00NN, and so do
///    the line and paragraph separators U+2028, U+2029 and the bidirectional
///    controls U+200E, U+200F, U+202A to U+202E, U+2066 to U+2069 (\uNNNN);
///  - each byte that is not part of well-formed UTF-8 (RFC 3629: no overlong
///    forms, no surrogates, nothing above U+10FFFF) becomes \xNN.
/// docs/cli.md, "Text output". JSON output is not escaped this way: it
/// carries the exact text. Thread-safe.
DVR_EXPORT std::string escape_text(std::string_view text);

/// `text` as valid UTF-8 and otherwise unchanged: each byte that is not part
/// of well-formed UTF-8 (the same rule as above) becomes the four characters
/// \xNN; controls stay. For JSON strings (`dvr --json`, `dvr serve`), which
/// must be UTF-8 and carry the exact text. Thread-safe.
DVR_EXPORT std::string utf8_safe(std::string_view text);

/// `text` as one word of a shell command that a message suggests (`dvr
/// --store PATH ls`): as it is when it holds only A-Z a-z 0-9 and / . _ - + :
/// @ % , =, else in single quotes (a quote inside as '\'').
DVR_EXPORT std::string shell_word(std::string_view text);

/// Where messages go: called with the level and one line of text, escaped
/// with escape_text(), no trailing newline. nullptr restores the default sink, which writes
/// "dvr[PID] LEVEL: message\n" to stderr in one write. The sink may be
/// called from any thread of the library, several at once (it must be
/// thread-safe), and must not call back into a Store. Exceptions it throws
/// are swallowed: logging never fails an operation. Thread-safe; a message
/// being logged while the sink is replaced goes to the old or the new one.
DVR_EXPORT void set_log_sink(std::function<void(LogLevel, std::string_view)> sink);

}  // namespace dvr
