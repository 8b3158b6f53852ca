// `dvr proc check` (proc::preflight) and what --tcp-established leaves in a
// process snapshot: the metadata key tcp_established, the hints dvr adds to
// CRIU's errors, and the capabilities preflight reports with a stand-in criu
// ($DVR_CRIU: a script that says it is CRIU 4.1.1 and fails inet dumps as
// 4.1 does on Linux >= 6.16). The real CRIU's probes run in tests/proc
// (test_tcp_servers.py, test_check.py).
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/utsname.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <string>

#include "dvr/proc.hpp"
#include "proc/criu_runner.hpp"
#include "proc/metadata.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvr::proc::impl::criu_hint;
using dvr::proc::impl::decode_meta;
using dvr::proc::impl::encode_meta;
using dvr::proc::impl::Meta;
using dvrtest::TempDir;

namespace {

// Sets an environment variable for the scope, then puts the old value back.
struct EnvGuard {
  std::string name, old;
  bool had;
  EnvGuard(const char* n, const std::string& value) : name(n) {
    const char* o = std::getenv(n);
    had = o != nullptr;
    if (o) old = o;
    ::setenv(n, value.c_str(), 1);
  }
  ~EnvGuard() {
    if (had)
      ::setenv(name.c_str(), old.c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;
};

const proc::Capability* find(const proc::Preflight& p, const std::string& name) {
  for (auto& c : p.capabilities)
    if (c.name == name) return &c;
  return nullptr;
}

// A criu that reports `version`, passes `criu check`, and fails every dump
// the way CRIU 4.1 fails on an inet socket under Linux >= 6.16.
std::string fake_criu(const TempDir& dir, const std::string& version) {
  std::string path = dir / "criu";
  std::ofstream(path) << "#!/bin/sh\n"
                         "case \"$1\" in\n"
                         "  --version) echo 'Version: "
                      << version
                      << "'; exit 0 ;;\n"
                         "  check) echo 'Looks good.'; exit 0 ;;\n"
                         "esac\n"
                         "D=.; O=criu.log\n"
                         "while [ $# -gt 0 ]; do case \"$1\" in -D) D=$2; shift ;; -o) O=$2; shift ;; esac; shift; done\n"
                         "echo '(00.01) Error (criu/sockets.c:690): Can'\\''t get 1:16 opt: Operation not supported' >> \"$D/$O\"\n"
                         "echo '(00.01) Error (criu/cr-dump.c:1975): Dumping FAILED.' >> \"$D/$O\"\n"
                         "exit 1\n";
  ::chmod(path.c_str(), 0755);
  return path;
}

bool kernel_at_least_6_16() {
  struct utsname u {};
  int a = 0, b = 0;
  if (::uname(&u) == 0) std::sscanf(u.release, "%d.%d", &a, &b);
  return a > 6 || (a == 6 && b >= 16);
}

}  // namespace

TEST_CASE("proc metadata records tcp_established and reads it back", "[proc][tcp]") {
  Meta m;
  m.info.pid = 42;
  m.info.command = "redis-server 127.0.0.1:6379";
  m.info.tcp_established = true;
  std::string text = encode_meta(m);
  CHECK_THAT(text, Catch::Contains("\ntcp_established=1\n"));
  CHECK(decode_meta(text, "x").info.tcp_established);

  m.info.tcp_established = false;
  CHECK_THAT(encode_meta(m), Catch::Contains("\ntcp_established=0\n"));
  CHECK_FALSE(decode_meta(encode_meta(m), "x").info.tcp_established);
  // Written by a dvr that did not know the key: no established connections.
  CHECK_FALSE(decode_meta("dvr-proc 1\npid=7\ncommand=x\n", "x").info.tcp_established);
}

TEST_CASE("CRIU's TCP errors get hints that say what to do", "[proc][tcp]") {
  CHECK_THAT(criu_hint("  Error (criu/sk-inet.c:200): inet: Connected TCP socket, consider using --tcp-established option."),
             Catch::Contains("dvr proc dump --tcp-established"));
  CHECK_THAT(criu_hint("  Error (criu/sk-inet.c:912): inet: Connected TCP socket in image"), Catch::Contains("--tcp-established"));
  std::string passcred = criu_hint("  Error (criu/sockets.c:690): Can't get 1:16 opt: Operation not supported");
  CHECK_THAT(passcred, Catch::Contains("CRIU < 4.2"));
  CHECK_THAT(passcred, Catch::Contains("install-deps.sh"));
  CHECK_THAT(criu_hint("  Error (criu/netfilter.c:232): CRIU was built without libnftables support"), Catch::Contains("libnftables"));
  CHECK(criu_hint("  Error (criu/cr-dump.c:1975): Dumping FAILED.").empty());
}

TEST_CASE("proc check: a missing criu is named, and what depends on it is not checked", "[proc][check]") {
  TempDir dir;
  EnvGuard criu("DVR_CRIU", dir / "no-criu-here");
  proc::Preflight p = proc::preflight("", true);
  CHECK_FALSE(p.ok);
  const proc::Capability* c = find(p, "criu");
  REQUIRE(c);
  CHECK_FALSE(c->ok);
  CHECK(c->checked);
  CHECK_THAT(c->detail, Catch::Contains("install-deps.sh"));
  for (const char* name : {"kernel", "inet sockets", "tcp listen", "tcp established"}) {
    INFO(name);
    const proc::Capability* d = find(p, name);
    REQUIRE(d);
    CHECK_FALSE(d->checked);
    CHECK_THAT(d->detail, Catch::StartsWith("not checked"));
  }
  // problems: exactly the required capabilities checked and missing.
  std::size_t missing = 0;
  for (auto& x : p.capabilities)
    missing += x.required && x.checked && !x.ok;
  CHECK(p.problems.size() == missing);
}

TEST_CASE("proc check: CRIU 4.1 on Linux >= 6.16 cannot dump TCP servers", "[proc][check][tcp]") {
  TempDir dir;
  EnvGuard criu("DVR_CRIU", fake_criu(dir, "4.1.1"));
  proc::Preflight p = proc::preflight("", true);  // quick: no `criu check`, no probes
  CHECK(p.criu_version == "4.1.1");
  const proc::Capability* inet = find(p, "inet sockets");
  REQUIRE(inet);
  REQUIRE(inet->checked);
  if (kernel_at_least_6_16()) {
    CHECK_FALSE(inet->ok);
    CHECK_THAT(inet->detail, Catch::Contains("TCP servers cannot be dumped with CRIU < 4.2 on this kernel"));
    CHECK_THAT(inet->detail, Catch::Contains("install-deps.sh, which builds CRIU 4.2 from Debian's source"));
    CHECK_FALSE(p.ok);
  } else {
    CHECK(inet->ok);
  }
  const proc::Capability* stream = find(p, "page stream");
  REQUIRE(stream);
  CHECK_FALSE(stream->ok);
  CHECK_FALSE(stream->required);
  const proc::Capability* listen = find(p, "tcp listen");
  REQUIRE(listen);
  CHECK_FALSE(listen->checked);
}

TEST_CASE("proc check: the TCP probe reports CRIU's error and keeps its log", "[proc][check][tcp]") {
  if (::geteuid() != 0) DVR_SKIP("the TCP probe needs root");
  TempDir dir;
  EnvGuard criu("DVR_CRIU", fake_criu(dir, "4.1.1"));
  EnvGuard tmp("TMPDIR", dir.path());
  proc::Preflight p = proc::preflight();
  // The probe ran the stand-in: its dump failed with 4.1's error, quoted,
  // with the hint, and its log kept in $TMPDIR.
  const proc::Capability* listen = find(p, "tcp listen");
  REQUIRE(listen);
  CHECK(listen->checked);
  CHECK_FALSE(listen->ok);
  CHECK_THAT(listen->detail, Catch::Contains("Can't get 1:16 opt"));
  CHECK_THAT(listen->detail, Catch::Contains("CRIU < 4.2"));
  CHECK_THAT(listen->detail, Catch::Contains(dir.path() + "/dvr-check-"));
  const proc::Capability* est = find(p, "tcp established");
  REQUIRE(est);
  CHECK_FALSE(est->checked);
  CHECK_FALSE(p.ok);
  bool named = false;
  for (auto& x : p.problems)
    named = named || x.find("Can't get 1:16 opt") != std::string::npos;
  CHECK(named);
}
