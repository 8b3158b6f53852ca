// Unit tests of the log (dvr/log.hpp): levels, the sink, DVR_LOG, escaping,
// and what the library logs.
#include <thread>

#include "base/log.hpp"
#include "proc/criu_runner.hpp"
#include "test_support.hpp"

using dvr::LogLevel;
using dvr::Session;
using dvr::Store;
using dvrtest::catch_error;
using dvrtest::TempDir;
namespace fs = std::filesystem;

namespace {

// Captures what is logged while it lives, at `level`; restores the default
// sink and the warn level afterwards.
struct Captured {
  std::mutex mu;
  std::vector<std::pair<LogLevel, std::string>> lines;
  explicit Captured(LogLevel level) {
    dvr::set_log_sink([this](LogLevel l, std::string_view m) {
      std::lock_guard<std::mutex> g(mu);
      lines.emplace_back(l, std::string(m));
    });
    dvr::set_log_level(level);
  }
  ~Captured() {
    dvr::set_log_sink(nullptr);
    dvr::set_log_level(LogLevel::warn);
  }
  bool has(LogLevel level, const std::string& part) {
    std::lock_guard<std::mutex> g(mu);
    return std::any_of(lines.begin(), lines.end(), [&](auto& l) { return l.first == level && l.second.find(part) != std::string::npos; });
  }
};

}  // namespace

TEST_CASE("log: level names parse both ways, and a bad one names the accepted ones", "[log]") {
  for (LogLevel l : {LogLevel::error, LogLevel::warn, LogLevel::info, LogLevel::debug})
    CHECK(dvr::parse_log_level(dvr::log_level_name(l)) == l);
  auto e = catch_error([] { dvr::parse_log_level("loud\n"); });
  CHECK(e.code == dvr::Errc::invalid_argument);
  CHECK_THAT(e.what, Catch::Contains("'loud\\n'"));  // escaped
  CHECK_THAT(e.what, Catch::Contains("error, warn, info, debug"));
}

TEST_CASE("log: messages below the level are neither delivered nor built", "[log]") {
  Captured cap(LogLevel::warn);
  int built = 0;
  auto message = [&] {
    ++built;
    return std::string("made");
  };
  DVR_LOG(info, message());
  DVR_LOG(debug, message());
  CHECK(built == 0);
  CHECK(cap.lines.empty());
  DVR_LOG(warn, message());
  DVR_LOG(error, message());
  CHECK(built == 2);
  CHECK(cap.lines.size() == 2);
  dvr::set_log_level(LogLevel::debug);
  CHECK(dvr::log_level() == LogLevel::debug);
  DVR_LOG(debug, message());
  CHECK(cap.has(LogLevel::debug, "made"));
}

TEST_CASE("log: control characters are escaped, one line per message", "[log]") {
  CHECK(dvr::detail::escape_text("a\nb\tc\rd\x01\x7f\\e") == "a\\nb\\tc\\rd\\x01\\x7f\\\\e");
  CHECK(dvr::detail::escape_text("plain text: ok") == "plain text: ok");
  Captured cap(LogLevel::warn);
  dvr::detail::log_write(LogLevel::warn, "line one\nline two\x1b[31m");
  REQUIRE(cap.lines.size() == 1);
  CHECK(cap.lines[0].second == "line one\\nline two\\x1b[31m");
}

TEST_CASE("log: a sink that throws does not fail the caller", "[log]") {
  dvr::set_log_sink([](LogLevel, std::string_view) { throw std::runtime_error("sink broke"); });
  CHECK_NOTHROW(dvr::detail::log_write(LogLevel::error, "to a broken sink"));
  dvr::set_log_sink(nullptr);
}

TEST_CASE("log: the default sink writes one line 'dvr[PID] LEVEL: message' to stderr", "[log]") {
  TempDir dir;
  const std::string file = dir / "stderr.txt";
  fflush(stderr);
  int saved = ::dup(2);
  int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  ::dup2(fd, 2);
  ::close(fd);
  dvr::set_log_sink(nullptr);
  dvr::detail::log_write(LogLevel::error, "to stderr\n");
  ::dup2(saved, 2);
  ::close(saved);
  CHECK(dvrtest::read_file(file) == "dvr[" + std::to_string(::getpid()) + "] error: to stderr\\n\n");
}

TEST_CASE("log: DVR_LOG sets the level, and an invalid value warns once naming it", "[log]") {
  struct Restore {
    ~Restore() {
      ::unsetenv("DVR_LOG");
      dvr::detail::reread_log_env();
    }
  } restore;
  ::setenv("DVR_LOG", "debug", 1);
  dvr::detail::reread_log_env();
  CHECK(dvr::log_level() == LogLevel::debug);
  ::setenv("DVR_LOG", "info", 1);
  dvr::detail::reread_log_env();
  CHECK(dvr::log_level() == LogLevel::info);
  std::vector<std::string> warnings;
  dvr::set_log_sink([&](LogLevel l, std::string_view m) {
    if (l == LogLevel::warn) warnings.emplace_back(m);
  });
  ::setenv("DVR_LOG", "verbose", 1);
  dvr::detail::reread_log_env();
  CHECK(dvr::log_level() == LogLevel::warn);
  CHECK(dvr::log_level() == LogLevel::warn);  // asked again: no second warning
  dvr::set_log_sink(nullptr);
  REQUIRE(warnings.size() == 1);
  CHECK_THAT(warnings[0], Catch::Contains("DVR_LOG"));
  CHECK_THAT(warnings[0], Catch::Contains("'verbose'"));
  CHECK_THAT(warnings[0], Catch::Contains("error, warn, info, debug"));
  // set_log_level wins over the environment.
  ::setenv("DVR_LOG", "debug", 1);
  dvr::detail::reread_log_env();
  dvr::set_log_level(LogLevel::error);
  CHECK(dvr::log_level() == LogLevel::error);
}

TEST_CASE("log: a region that falls back to hash tracking says why, at info", "[log]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Captured cap(LogLevel::info);
  std::vector<char> small(100);
  Session s(store, "logged");
  s.track("tiny", small.data(), small.size());  // no whole page: cannot be write-protected
  CHECK(s.tracking("tiny") == dvr::Tracking::hash);
  CHECK(cap.has(LogLevel::info, "session 'logged': region 'tiny' falls back to hash tracking"));
}

TEST_CASE("log: gc logs its summary, autosave its snapshots, debug the store's threads", "[log]") {
  TempDir dir;
  Captured cap(LogLevel::debug);
  Store store = Store::open(dir.store(), {.threads = 2});
  CHECK(cap.has(LogLevel::debug, "up to 2 threads per call"));
  auto data = dvrtest::random_bytes(1u << 20, 2401);
  Session s(store, "auto");
  s.track("r", data.data(), data.size());
  s.autosave(std::chrono::milliseconds(1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE(s.checkpoint_point().has_value());
  CHECK(cap.has(LogLevel::info, "session 'auto': autosave autosave-1 taken"));
  CHECK(cap.has(LogLevel::debug, "snapshot auto/autosave-1"));
  store.gc();
  CHECK(cap.has(LogLevel::info, "gc of store " + dir.store()));
}

TEST_CASE("log: every program run for CRIU is logged with its command line and exit status", "[log]") {
  Captured cap(LogLevel::info);
  std::string out;
  const std::string sh = fs::exists("/usr/bin/sh") ? "/usr/bin/sh" : "/bin/sh";
  CHECK(dvr::proc::impl::run_capture({sh, "-c", "exit 3"}, {}, &out) == 3);
  CHECK(cap.has(LogLevel::info, "ran `" + sh + " -c exit 3`: exit status 3 after "));
  // With a tick, it is called on this thread while the program runs.
  int ticks = 0;
  CHECK(dvr::proc::impl::run_capture({sh, "-c", "sleep 1"}, {}, &out, {}, [&] { ++ticks; }) == 0);
  CHECK(ticks >= 1);
}

TEST_CASE("escape: one rule for every text output (C0, DEL, C1, separators, bidi controls, invalid UTF-8)", "[log][escape]") {
  // docs/cli.md, "Text output": the same function escapes log lines, the
  // CLI's text and memdvr's (through its binding).
  CHECK(dvr::escape_text("\x1b]0;title\x07") == "\\x1b]0;title\\x07");
  CHECK(dvr::escape_text("\xc2\x9b" "31m \xc2\x85") == "\\u009b31m \\u0085");  // C1: CSI, NEL
  CHECK(dvr::escape_text("\xc2\xa0nbsp caf\xc3\xa9 \xe2\x9c\x93") == "\xc2\xa0nbsp caf\xc3\xa9 \xe2\x9c\x93");
  CHECK(dvr::escape_text("a\xe2\x80\xa8" "b\xe2\x80\xa9") == "a\\u2028b\\u2029");  // line, paragraph separators
  CHECK(dvr::escape_text("\xe2\x80\xae" "evil\xe2\x81\xa6\xe2\x81\xa9\xe2\x80\x8e") == "\\u202eevil\\u2066\\u2069\\u200e");
  CHECK(dvr::escape_text("\xe2\x80\x8d") == "\xe2\x80\x8d");  // a joiner is not a control
  // Not UTF-8: a stray continuation byte, an overlong '/', a surrogate, a
  // truncated sequence, a byte above F4: each byte as \xNN.
  CHECK(dvr::escape_text("\x80") == "\\x80");
  // utf8_safe (JSON strings): the same UTF-8 rule, controls kept.
  CHECK(dvr::utf8_safe("caf\xc3\xa9 \x1b[0m\n\xe2\x80\xae") == "caf\xc3\xa9 \x1b[0m\n\xe2\x80\xae");
  CHECK(dvr::utf8_safe("\xff\xc0\xaf|\xed\xa0\x80|\xf4\x90\x80\x80|\xe2\x82") == "\\xff\\xc0\\xaf|\\xed\\xa0\\x80|\\xf4\\x90\\x80\\x80|\\xe2\\x82");
  CHECK(dvr::escape_text("\xc0\xaf") == "\\xc0\\xaf");
  CHECK(dvr::escape_text("\xed\xa0\x80") == "\\xed\\xa0\\x80");
  CHECK(dvr::escape_text("ok\xe2\x9c") == "ok\\xe2\\x9c");
  CHECK(dvr::escape_text("\xf5\x80\x80\x80") == "\\xf5\\x80\\x80\\x80");
  CHECK(dvr::escape_text(std::string_view("nul\0end", 7)) == "nul\\x00end");
  // An escape can be told from text that looks like one.
  CHECK(dvr::escape_text("\\x1b") == "\\\\x1b");
}

TEST_CASE("shell_word: a path in a suggested command is one shell word", "[log][escape]") {
  CHECK(dvr::shell_word("/dev/shm/dvr-0") == "/dev/shm/dvr-0");
  CHECK(dvr::shell_word("/tmp/dir with space/st") == "'/tmp/dir with space/st'");
  CHECK(dvr::shell_word("/tmp/$(rm -rf x)") == "'/tmp/$(rm -rf x)'");
  CHECK(dvr::shell_word("it's") == "'it'\\''s'");
  CHECK(dvr::shell_word("") == "''");
}
