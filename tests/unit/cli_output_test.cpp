// The dvr command's output layer (cli/output.hpp): valid UTF-8 always,
// control characters escaped for terminals, RFC 3339 times; and the label
// rule at the API (Session::snapshot refuses a label that is not UTF-8, while
// one that arrives in a stream from elsewhere is still listed and shown).
#include <catch2/catch.hpp>
#include <sys/mman.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "dvr/dvr.hpp"
#include "dvr/transfer.hpp"
#include "format/manifest.hpp"
#include "output.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::catch_error;
using dvrtest::TempDir;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  REQUIRE(out.good());
}

// Whether nlohmann-json takes `text` back (it rejects invalid UTF-8).
bool parses(const std::string& text) {
  try {
    return !cli::json::parse(text).is_discarded();
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

TEST_CASE("cli output: invalid UTF-8 becomes \\xNN and valid text is unchanged", "[cli]") {
  CHECK(cli::utf8_safe("plain") == "plain");
  CHECK(cli::utf8_safe("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80") == "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  CHECK(cli::utf8_safe("a\xff" "b") == "a\\xffb");
  CHECK(cli::utf8_safe("\xc3") == "\\xc3");                  // truncated sequence
  CHECK(cli::utf8_safe("\xc0\xaf") == "\\xc0\\xaf");         // overlong '/'
  CHECK(cli::utf8_safe("\xed\xa0\x80") == "\\xed\\xa0\\x80");  // a UTF-16 surrogate
  CHECK(cli::utf8_safe("\xf4\x90\x80\x80") == "\\xf4\\x90\\x80\\x80");  // above U+10FFFF
  for (const std::string s : {"\xff", "x\xc3", "\xe2\x82", "ok\x80\x80"}) {
    cli::json doc = cli::document();
    doc["label"] = cli::jstr(s);
    CHECK(parses(doc.dump()));
  }
}

TEST_CASE("cli output: text for a terminal escapes control characters", "[cli]") {
  CHECK(cli::printable("line\nnext\ttab") == "line\\nnext\\ttab");
  CHECK(cli::printable("\x1b[2J") == "\\x1b[2J");            // clear screen
  CHECK(cli::printable("\xc2\x9b" "31m") == "\\u009b31m");   // C1 CSI
  CHECK(cli::printable("del\x7f") == "del\\x7f");
  CHECK(cli::printable("caf\xc3\xa9") == "caf\xc3\xa9");
  CHECK(cli::printable("bad\xfe") == "bad\\xfe");
}

TEST_CASE("cli output: times are RFC 3339 UTC with nanoseconds", "[cli]") {
  CHECK(cli::rfc3339(0) == "1970-01-01T00:00:00.000000000Z");
  CHECK(cli::rfc3339(1796172107123456789) == "2026-12-02T00:41:47.123456789Z");
  CHECK(cli::rfc3339(-1) == "1969-12-31T23:59:59.999999999Z");
}

TEST_CASE("cli output: a snapshot's JSON object has every documented field", "[cli]") {
  SnapshotInfo i;
  i.session = "s";
  i.name = "n";
  i.time_ns = 1000000001;
  i.regions.push_back({"r", 4096, true});
  cli::json j = cli::to_json(i);
  std::vector<std::string> keys;
  for (auto& [k, v] : j.items())
    keys.push_back(k);
  CHECK(keys == std::vector<std::string>{"session", "name", "parent", "label", "time_ns", "time", "seq", "origin_time_ns", "logical_bytes", "stored_bytes", "chunks",
                                         "zero_chunks", "regions", "tracking", "chunks_read", "damaged", "damage", "pending"});
  CHECK(j["time"] == "1970-01-01T00:00:01.000000001Z");
  CHECK(j["regions"][0]["name"] == "r");
}

TEST_CASE("cli output: Session::snapshot refuses a label that is not UTF-8, a received one is listed and shown escaped", "[cli]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::vector<char> buf(8192, 'x');
  {
    Session s(store, "s");
    s.track("r", buf.data(), buf.size());
    auto c = catch_error([&] { s.snapshot("bad", {.label = "caf\xe9"}); });
    CHECK(c.code == Errc::invalid_argument);
    CHECK_THAT(c.what, Catch::Contains("UTF-8") && Catch::Contains("0xe9"));
    CHECK(store.list("s").empty());
    s.snapshot("good", {.label = "caf\xc3\xa9\tok"});
  }
  // A store written by something else (an older dvr, another
  // implementation of the format) can hold any bytes: give the manifest
  // such a label, then move the snapshot to another store as a stream.
  const std::string file = dir.store() + "/sessions/s/good.snap";
  detail::Manifest m = detail::decode_manifest(read_file(file), file);
  m.label = std::string("from \xff\xfe elsewhere\x1b[2J");
  write_file(file, detail::encode_manifest(m));
  REQUIRE(store.info("s", "good").label == m.label);
  int fd = ::memfd_create("cli-stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  transfer::send(store, "s/good", fd);
  REQUIRE(::lseek(fd, 0, SEEK_SET) == 0);
  Store other = Store::open(dir.path() + "/other");
  transfer::receive(other, fd);
  ::close(fd);
  auto listed = other.list("s");
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].label == m.label);
  const std::string text = cli::to_json(listed).dump();
  CHECK(parses(text));
  CHECK_THAT(text, Catch::Contains("from \\\\xff\\\\xfe elsewhere\\u001b[2J"));
  CHECK(cli::printable(listed[0].label) == "from \\xff\\xfe elsewhere\\x1b[2J");
}
