// A clone's namespaces (proc/netns.hpp) without root: addresses parsed and
// derived, the job's Unix socket paths read from a CRIU image built here the
// way CRIU writes one, and --net/--ip refused with a message that names the
// option and what to do, before anything is set up.
#include <catch2/catch.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "dvr/proc.hpp"
#include "proc/netns.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvr::proc::impl::CloneView;
using dvr::proc::impl::host_end_for;
using dvr::proc::impl::Ipv4Prefix;
using dvr::proc::impl::parse_ipv4_prefix;
using dvr::proc::impl::unix_socket_paths;
using dvrtest::TempDir;

namespace {

// protobuf, the little CRIU's images need.
std::string varint(std::uint64_t v) {
  std::string s;
  do {
    unsigned char b = v & 0x7f;
    v >>= 7;
    s.push_back(static_cast<char>(v ? b | 0x80 : b));
  } while (v);
  return s;
}
std::string field_varint(int f, std::uint64_t v) { return varint(static_cast<std::uint64_t>(f) << 3) + varint(v); }
std::string field_bytes(int f, const std::string& b) { return varint(static_cast<std::uint64_t>(f) << 3 | 2) + varint(b.size()) + b; }

// A unix_sk_entry with its required fields, as CRIU 4.2 fills them.
std::string unix_sk(std::uint32_t id, const std::string& name, const std::string& name_dir = "", std::uint32_t state = 10) {
  std::string fown = field_varint(1, 0) + field_varint(2, 0) + field_varint(3, 0) + field_varint(4, 0) + field_varint(5, 0);
  std::string m = field_varint(1, id) + field_varint(2, 1000 + id) + field_varint(3, 1) + field_varint(4, state) + field_varint(5, 0x800) +
                  field_varint(6, 0) + field_varint(7, 511) + field_varint(8, 0) + field_bytes(9, fown) + field_bytes(10, field_varint(1, 0)) +
                  field_bytes(11, name);
  if (!name_dir.empty()) m += field_bytes(14, name_dir);
  return m + field_varint(16, 1) + field_varint(17, static_cast<std::uint64_t>(-1) & 0xffffffff);
}
std::string file_entry_unix(std::uint32_t id, const std::string& usk) { return field_varint(1, 5) + field_varint(2, id) + field_bytes(16, usk); }
std::string file_entry_reg(std::uint32_t id, const std::string& path) {
  return field_varint(1, 1) + field_varint(2, id) + field_bytes(3, field_varint(1, id) + field_varint(2, 0) + field_bytes(6, path));
}

std::string le32(std::uint32_t v) {
  std::string s(4, '\0');
  for (int k = 0; k < 4; ++k)
    s[static_cast<std::size_t>(k)] = static_cast<char>((v >> (8 * k)) & 0xff);
  return s;
}
std::string image(const std::vector<std::string>& records, std::uint32_t magic = 0x56303138) {
  std::string s = le32(0x54564319) + le32(magic);
  for (auto& r : records)
    s += le32(static_cast<std::uint32_t>(r.size())) + r;
  return s;
}

}  // namespace

TEST_CASE("netns: IPv4 addresses with a prefix are parsed strictly", "[proc][netns]") {
  auto a = parse_ipv4_prefix("10.213.0.2/24");
  REQUIRE(a);
  CHECK(a->addr == 0x0ad50002);
  CHECK(a->prefix == 24);
  CHECK(a->text() == "10.213.0.2/24");
  CHECK(a->network() == 0x0ad50000);
  for (const char* bad : {"10.213.0.2", "10.213.0.300/24", "10.213.0.2/33", "10.213.0.2/", "/24", "10.213.0.2/2x", "10.213.0.2/024x", "fe80::1/64",
                          "10.213.0/24", ""})
    CHECK_FALSE(parse_ipv4_prefix(bad));
  auto h = parse_ipv4_prefix("10.213.0.1", true);
  REQUIRE(h);
  CHECK(h->prefix == 32);
}

TEST_CASE("netns: the host end takes the network's first other address", "[proc][netns]") {
  CHECK(host_end_for(*parse_ipv4_prefix("10.213.0.2/24")).text() == "10.213.0.1/24");
  CHECK(host_end_for(*parse_ipv4_prefix("10.213.0.1/24")).text() == "10.213.0.2/24");
  CHECK(host_end_for(*parse_ipv4_prefix("192.168.7.77/16")).text() == "192.168.0.1/16");
  CHECK(host_end_for(*parse_ipv4_prefix("10.213.1.2/30")).text() == "10.213.1.1/30");
  CHECK(parse_ipv4_prefix("10.213.0.2/24")->overlaps(*parse_ipv4_prefix("10.213.0.200/30")));
  CHECK(parse_ipv4_prefix("10.0.0.1/8")->overlaps(*parse_ipv4_prefix("10.213.0.2/24")));
  CHECK_FALSE(parse_ipv4_prefix("10.213.0.2/24")->overlaps(*parse_ipv4_prefix("10.213.1.2/24")));
}

TEST_CASE("netns: the job's named Unix sockets are read from files.img", "[proc][netns]") {
  std::string img = image({file_entry_reg(1, "/usr/bin/redis-server"), file_entry_unix(2, unix_sk(2, "/run/redis/redis.sock")),
                           file_entry_unix(3, unix_sk(3, std::string("\0abstract", 9))),  // abstract: nothing on disk
                           file_entry_unix(4, unix_sk(4, "")),                            // unnamed
                           file_entry_unix(5, unix_sk(5, "rel.sock", "/srv/app")),        // relative to its directory
                           file_entry_unix(6, unix_sk(6, "/run/redis/redis.sock", "", 1)),  // an accepted connection names it again
                           file_entry_unix(7, unix_sk(7, "nodir.sock"))});                  // relative, no directory: left out
  CHECK(unix_socket_paths(img, true) == std::vector<std::string>{"/run/redis/redis.sock", "/srv/app/rel.sock"});
  // An older unixsk.img holds the entries themselves.
  CHECK(unix_socket_paths(image({unix_sk(1, "/tmp/a.sock"), unix_sk(2, "/tmp/b.sock")}, 0x56302113), false) ==
        std::vector<std::string>{"/tmp/a.sock", "/tmp/b.sock"});
  // Damage: what comes before it is kept, nothing is read beyond.
  std::string cut = img.substr(0, img.size() - 5);
  CHECK(unix_socket_paths(cut, true) == std::vector<std::string>{"/run/redis/redis.sock", "/srv/app/rel.sock"});
  std::string bad_len = image({file_entry_unix(2, unix_sk(2, "/a/b.sock"))}) + le32(0xffffff00) + "xx";
  CHECK(unix_socket_paths(bad_len, true) == std::vector<std::string>{"/a/b.sock"});
  CHECK(unix_socket_paths("", true).empty());
  CHECK(unix_socket_paths(image({"\xff\xff\xff"}), true).empty());
}

TEST_CASE("netns: misplaced or bad --net and --ip are refused before anything is set up", "[proc][netns]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  proc::ProcInfo p;
  auto refused = [&](proc::RestoreOptions o) { return dvrtest::catch_error([&] { CloneView v(store, "job", p, o); }); };

  proc::RestoreOptions restore;
  restore.net = "new";
  auto c = refused(restore);
  CHECK(c.code == Errc::invalid_argument);
  CHECK_THAT(c.what, Catch::Contains("are for clones") && Catch::Contains("dvr proc clone job --net new"));

  proc::RestoreOptions o;
  o.clone = true;
  o.ip = "10.213.0.2/24";
  c = refused(o);
  CHECK(c.code == Errc::invalid_argument);
  CHECK_THAT(c.what, Catch::Contains("--ip and --host-ip need --net new"));

  o.net = "new";
  for (const char* bad : {"10.213.0.2", "10.213.0.2/31", "10.213.0.256/24", "nonsense"}) {
    o.ip = bad;
    c = refused(o);
    CHECK(c.code == Errc::invalid_argument);
    CHECK_THAT(c.what, Catch::Contains(std::string("--ip '") + bad + "'") && Catch::Contains("ADDR/PREFIX"));
  }
  o.ip = "10.213.0.255/24";
  CHECK_THAT(refused(o).what, Catch::Contains("broadcast address"));
  o.ip = "10.213.0.2/24";
  o.host_ip = "10.214.0.1";
  CHECK_THAT(refused(o).what, Catch::Contains("--host-ip 10.214.0.1 must be another host address") && Catch::Contains("10.213.0.0/24"));
  o.host_ip = "10.213.0.2";
  CHECK(refused(o).code == Errc::invalid_argument);
  o.ip = "";
  o.host_ip = "10.213.0.1";
  CHECK_THAT(refused(o).what, Catch::Contains("--host-ip needs --ip"));

  proc::RestoreOptions named;
  named.clone = true;
  named.net = "dvr-unit-no-such-netns";
  c = refused(named);
  CHECK(c.code == Errc::not_found);
  CHECK_THAT(c.what, Catch::Contains("/run/netns/dvr-unit-no-such-netns does not exist") && Catch::Contains("ip netns add dvr-unit-no-such-netns"));
  named.net = "/nonexistent/dvr-ns";
  CHECK_THAT(refused(named).what, Catch::Contains("no network namespace /nonexistent/dvr-ns"));
  named.net = "bad name";
  CHECK_THAT(refused(named).what, Catch::Contains("--net 'bad name' is neither new nor the name"));
  named.net = "/proc/self/ns/pid";
  CHECK_THAT(refused(named).what, Catch::Contains("is not a network namespace"));
  named.net = "/proc/self/ns/net";
  named.ip = "10.213.0.2/24";
  CHECK_THAT(refused(named).what, Catch::Contains("keeps the addresses it has"));
}
