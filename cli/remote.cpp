// Reaching a store on another machine through ssh: see remote.hpp.
#include "remote.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <sstream>
#include <utility>

#include "cli_util.hpp"
#include "dvr/transfer.hpp"
#include "output.hpp"

namespace dvr::cli {

namespace {

// What a kept receiver says first on every connection: it is alive and ours.
constexpr char kKeptHello[8] = {'D', 'V', 'R', 'K', 'E', 'P', 'T', '1'};

std::string hex64(std::uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

// A directory of this user's alone, NAME under $XDG_RUNTIME_DIR, else
// /tmp/NAME-UID; made if missing. Anything else there (another owner, other
// users' access, a link) is refused: whoever could reach a socket in it could
// run commands as this user, here or on the far machine.
std::string private_dir(const std::string& name, const std::string& what) {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  // A socket's path (DIR/ + up to 45 characters) must fit a sockaddr_un.
  std::string dir = xdg && xdg[0] == '/' && std::strlen(xdg) <= 48 ? std::string(xdg) + "/" + name : "/tmp/" + name + "-" + std::to_string(::geteuid());
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw Error(Errc::io, "cannot create " + printable(dir) + " for " + what + ": " + std::strerror(errno));
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) throw Error(Errc::io, "cannot inspect " + printable(dir) + ": " + std::strerror(errno));
  std::string wrong = !S_ISDIR(st.st_mode)       ? "it is not a directory"
                      : st.st_uid != ::geteuid() ? "it belongs to user " + std::to_string(st.st_uid)
                      : (st.st_mode & 077) != 0  ? "other users may use it"
                                                 : "";
  if (!wrong.empty())
    throw Error(Errc::permission, "refusing to keep " + what + " in " + printable(dir) + ": " + wrong +
                                      " (it must be a private directory of this user: remove it, or set XDG_RUNTIME_DIR)");
  return dir;
}

// ssh's words from --ssh, with the control options when kept, and the port;
// the host and the command come after.
std::vector<std::string> ssh_words(const std::string& ssh, const SshTarget& t, long keep_s) {
  std::vector<std::string> argv;
  std::istringstream in(ssh);
  for (std::string w; in >> w;)
    argv.push_back(w);
  if (argv.empty()) throw Error(Errc::invalid_argument, "--ssh is empty");
  if (keep_s > 0) {
    // ssh's %C: a hash of the local host, the far host, port and user.
    argv.insert(argv.begin() + 1, {"-o", "ControlMaster=auto", "-o", "ControlPath=" + ssh_control_dir() + "/%C", "-o",
                                   "ControlPersist=" + std::to_string(keep_s)});
  }
  if (!t.port.empty()) {
    argv.push_back("-p");
    argv.push_back(t.port);
  }
  return argv;
}

[[noreturn]] void exec_words(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (auto& x : argv)
    args.push_back(const_cast<char*>(x.c_str()));
  args.push_back(nullptr);
  ::execvp(args[0], args.data());
  std::fprintf(stderr, "dvr: cannot run %s: %s\n", args[0], std::strerror(errno));
  ::_exit(127);
}

// Runs ARGV with no input, its stdout and stderr collected; killed after
// limit_s seconds. Returns its exit status (128 + signal) and its output.
std::pair<int, std::string> run_collected(const std::vector<std::string>& argv, int limit_s) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) throw Error(Errc::io, std::string("cannot create a pipe: ") + std::strerror(errno));
  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(p[0]);
    ::close(p[1]);
    throw Error(Errc::io, std::string("cannot start ") + argv[0] + ": " + std::strerror(errno));
  }
  if (pid == 0) {
    int null = ::open("/dev/null", O_RDONLY);
    ::dup2(null, 0);
    ::dup2(p[1], 1);
    ::dup2(p[1], 2);
    exec_words(argv);
  }
  ::close(p[1]);
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(limit_s);
  bool killed = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      ::kill(pid, SIGKILL);
      killed = true;
      break;
    }
    pollfd f{p[0], POLLIN, 0};
    const int ready = ::poll(&f, 1, static_cast<int>(left));
    if (ready < 0 && errno != EINTR) break;
    if (ready <= 0) continue;  // interrupted, or the time is up (checked above)
    char b[4096];
    const ssize_t n = ::read(p[0], b, sizeof b);
    if (n > 0 && out.size() < (1u << 16)) out.append(b, static_cast<std::size_t>(n));
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) break;
  }
  ::close(p[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (killed) out += "(no answer within " + std::to_string(limit_s) + " s)";
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

// The last non-empty line of TEXT, escaped for the terminal.
std::string last_line(const std::string& text) {
  std::string line, last;
  std::istringstream in(text);
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return printable(last);
}

// The local socket forwarded to the kept receiver of (t, remote_dvr).
std::string kept_socket(const SshTarget& t, const std::string& remote_dvr) {
  const std::string key = t.host + '\0' + t.port + '\0' + t.path + '\0' + remote_dvr;
  return ssh_control_dir() + "/recv-" + hex64(XXH3_64bits(key.data(), key.size())) + ".sock";
}

bool fill_sockaddr(const std::string& path, sockaddr_un& a) {
  a = {};
  a.sun_family = AF_UNIX;
  if (path.size() >= sizeof a.sun_path) return false;
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  return true;
}

// Connects to PATH and waits up to limit_s for the kept receiver's greeting:
// the connected socket, or -1 (errno_out: connect's errno, 0 when the
// connection was made but nobody greeted).
int connect_greeted(const std::string& path, int limit_s, int* errno_out = nullptr) {
  sockaddr_un a;
  if (!fill_sockaddr(path, a)) return -1;
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    if (errno_out) *errno_out = errno;
    ::close(fd);
    return -1;
  }
  if (errno_out) *errno_out = 0;
  timeval tv{limit_s, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char hello[sizeof kKeptHello];
  std::size_t got = 0;
  while (got < sizeof hello) {
    const ssize_t n = ::read(fd, hello + got, sizeof hello - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  if (got != sizeof hello || std::memcmp(hello, kKeptHello, sizeof hello) != 0) {
    ::close(fd);
    return -1;
  }
  tv = {0, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

bool write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

std::string now_text() {
  char b[32];
  const std::time_t t = std::time(nullptr);
  std::tm tm {};
  ::localtime_r(&t, &tm);
  std::strftime(b, sizeof b, "%Y-%m-%d %H:%M:%S", &tm);
  return b;
}

// The kept receiver's loop: one forked process per connection (of this user
// only), at most 8 at a time; returns when idle_s passed without one, or when
// SOCK is no longer the socket bound to `listener`.
void serve_kept(Store& store, int listener, const std::string& sock, const struct stat& bound, long idle_s,
                const transfer::ReceiveOptions& ro) {
  constexpr int kMaxRunning = 8;
  struct stat dir {};
  const bool have_dir = ::stat(store.path().c_str(), &dir) == 0;
  int running = 0;
  auto last = std::chrono::steady_clock::now();
  for (;;) {
    while (::waitpid(-1, nullptr, WNOHANG) > 0) {
      --running;
      last = std::chrono::steady_clock::now();
    }
    struct stat st {};
    if (::lstat(sock.c_str(), &st) != 0 || st.st_ino != bound.st_ino || st.st_dev != bound.st_dev) {
      std::cerr << now_text() << " " << printable(sock) << " was removed or replaced; stopping\n";
      return;
    }
    if (running == 0 && std::chrono::steady_clock::now() - last >= std::chrono::seconds(idle_s)) {
      std::cerr << now_text() << " idle for " << idle_s << " s; stopping\n";
      ::unlink(sock.c_str());
      return;
    }
    if (running >= kMaxRunning) {
      ::usleep(50000);
      continue;
    }
    pollfd f{listener, POLLIN, 0};
    if (::poll(&f, 1, 1000) <= 0) continue;
    int c = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    ucred who {};
    socklen_t len = sizeof who;
    if (::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &who, &len) != 0 || who.uid != ::geteuid()) {
      std::cerr << now_text() << " refused a connection from user " << who.uid << " (pid " << who.pid << ")\n";
      ::close(c);
      continue;
    }
    struct stat now_dir {};
    if (!have_dir || ::stat(store.path().c_str(), &now_dir) != 0 || now_dir.st_ino != dir.st_ino || now_dir.st_dev != dir.st_dev) {
      // Not the store it was started for (removed, or made anew): the
      // client, greeted by nobody, opens a session of its own.
      std::cerr << now_text() << " the store " << printable(store.path()) << " is gone or was replaced; stopping\n";
      ::close(c);
      ::unlink(sock.c_str());
      return;
    }
    last = std::chrono::steady_clock::now();
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(listener);
      int rc = 1;
      try {
        char first = 0;
        if (!write_all(c, kKeptHello, sizeof kKeptHello)) {
          // the client is gone
        } else if (::recv(c, &first, 1, MSG_PEEK) == 0) {
          rc = 0;  // a check that we are here (connect_kept_receiver), nothing to receive
        } else {
          transfer::Stats s = transfer::receive_negotiated(store, c, c, ro);
          std::string refs;
          for (auto& r : s.refs)
            refs += (refs.empty() ? "" : ", ") + printable(r);
          std::cerr << now_text() << " received " << refs << ": " << format_bytes(static_cast<double>(s.wire_bytes)) << " in "
                    << format_seconds(s.seconds) << "\n";
          rc = 0;
        }
      } catch (const std::exception& e) {
        // The sender has the message too (the negotiation carries it).
        std::cerr << now_text() << " a push failed: " << printable(e.what()) << "\n";
      }
      ::_exit(rc);
    }
    if (pid > 0) ++running;
    ::close(c);
  }
}

}  // namespace

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

std::string ssh_control_dir() { return private_dir("dvr-ssh", "ssh connections"); }

long keep_ssh_seconds(const std::string& option) {
  std::string text = option;
  const char* from = "--keep-ssh";
  if (text.empty()) {
    const char* env = std::getenv("DVR_KEEP_SSH");
    if (!env || !*env) return 0;
    text = env;
    from = "DVR_KEEP_SSH";
  }
  return duration_up_to_7d(text, from);
}

long duration_up_to_7d(const std::string& text, const std::string& from) {
  double s = 0;
  try {
    s = parse_duration(text);  // never negative
  } catch (const std::exception& e) {
    throw Error(Errc::invalid_argument, from + ": " + e.what());
  }
  if (s > 7 * 86400) throw Error(Errc::invalid_argument, from + ": '" + printable(text) + "' is not a duration up to 7d");
  return static_cast<long>(s + 0.5);
}

SshChild::SshChild(const std::string& ssh, const SshTarget& t, const std::vector<std::string>& remote, long keep_s) {
  std::vector<std::string> argv = ssh_words(ssh, t, keep_s);
  argv.push_back(t.host);
  std::string cmd;
  for (auto& r : remote)
    cmd += (cmd.empty() ? "" : " ") + shell_word(r);
  argv.push_back(cmd);
  int a[2], b[2];
  if (::pipe2(a, O_CLOEXEC) != 0 || ::pipe2(b, O_CLOEXEC) != 0) throw Error(Errc::io, "cannot create pipes for ssh");
  pid = ::fork();
  if (pid < 0) throw Error(Errc::io, "cannot start ssh");
  if (pid == 0) {
    ::dup2(a[0], 0);
    ::dup2(b[1], 1);
    exec_words(argv);
  }
  ::close(a[0]);
  ::close(b[1]);
  to = a[1];
  from = b[0];
}

int SshChild::finish() {
  if (to >= 0) ::close(to);
  if (from >= 0) ::close(from);
  to = from = -1;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  pid = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

SshChild::~SshChild() {
  if (pid > 0) {
    ::kill(pid, SIGTERM);
    finish();
  }
}

int connect_kept_receiver(const SshTarget& t, const std::string& remote_dvr) {
  std::string path;
  try {
    path = kept_socket(t, remote_dvr);
  } catch (const Error&) {
    return -1;  // the push that follows says what is wrong with the directory
  }
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) return -1;
  int err = 0;
  int fd = connect_greeted(path, 10, &err);
  // Nobody listens: the kept connection is gone (ssh leaves its forwarded
  // socket behind). A connection that nobody greets: the far receiver is gone.
  if (fd < 0 && err == ECONNREFUSED) ::unlink(path.c_str());
  return fd;
}

void keep_receiver(const std::string& ssh, const SshTarget& t, const std::string& remote_dvr, long keep_s) {
  std::string local, why;
  try {
    local = kept_socket(t, remote_dvr);
  } catch (const Error& e) {
    why = e.what();
  }
  const std::string note = local + ".off";
  struct stat st {};
  if (why.empty() && ::stat(note.c_str(), &st) == 0 && std::time(nullptr) - st.st_mtime < keep_s) return;  // said already
  try {
    if (why.empty()) {
      std::vector<std::string> start = ssh_words(ssh, t, keep_s);
      start.push_back(t.host);
      start.push_back(shell_word(remote_dvr) + " --store " + shell_word(t.path) + " receive --listen --idle " + std::to_string(keep_s));
      auto [rc, out] = run_collected(start, 60);
      std::string far;
      const auto at = out.rfind("listening /");
      if (rc == 0 && at != std::string::npos && (at == 0 || out[at - 1] == '\n')) far = out.substr(at + 10, out.find('\n', at) - at - 10);
      if (far.empty()) {
        why = "the far dvr started no kept receiver (" + (rc == 0 ? std::string("it named no socket") : last_line(out)) + ")";
      } else if (far.find_first_of(": \t\r\\") != std::string::npos || far.size() > 100) {
        why = "the far dvr named a socket ssh cannot forward (" + printable(far) + ")";
      } else {
        std::vector<std::string> forward = ssh_words(ssh, t, keep_s);
        forward.insert(forward.begin() + 1, {"-o", "StreamLocalBindUnlink=yes", "-O", "forward", "-L", local + ":" + far});
        forward.push_back(t.host);
        auto [frc, fout] = run_collected(forward, 30);
        if (frc != 0) {
          why = "ssh did not forward a socket to the far receiver (" + last_line(fout) + ")";
        } else if (int fd = connect_kept_receiver(t, remote_dvr); fd >= 0) {
          ::close(fd);  // it greeted: the next push goes through it
        } else {
          // ssh forwards locally whatever the far sshd allows; the far sshd
          // refuses each connection then.
          why = "the far sshd refuses forwarded connections to it (AllowStreamLocalForwarding, AllowTcpForwarding or "
                "DisableForwarding in its sshd_config)";
          std::vector<std::string> cancel = ssh_words(ssh, t, keep_s);
          cancel.insert(cancel.begin() + 1, {"-O", "cancel", "-L", local + ":" + far});
          cancel.push_back(t.host);
          run_collected(cancel, 30);
          ::unlink(local.c_str());
        }
      }
    }
  } catch (const Error& e) {
    why = e.what();
  }
  if (why.empty()) {
    ::unlink(note.c_str());
    return;
  }
  if (!local.empty()) {
    int fd = ::open(note.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) {
      write_all(fd, why.data(), why.size());
      ::close(fd);
    }
  }
  std::cerr << "dvr: note: the connection to " << printable(t.host) << " is kept, but each push there starts a dvr again: " << why
            << "\n";
}

int listen_kept_receiver(Store& store, long idle_s, const transfer::ReceiveOptions& ro) {
  if (idle_s <= 0) throw Error(Errc::invalid_argument, "--listen needs --idle DURATION above 0 (how long the receiver waits for the next push)");
  const std::string dir = private_dir("dvr-receive", "receiver sockets");
  char* real = ::realpath(store.path().c_str(), nullptr);
  const std::string key = real ? real : store.path();
  std::free(real);
  const std::string sock = dir + "/" + hex64(XXH3_64bits(key.data(), key.size())) + ".sock";
  if (int fd = connect_greeted(sock, 5); fd >= 0) {
    ::close(fd);
    std::cout << "listening " << sock << "\n" << std::flush;
    return 0;
  }
  sockaddr_un a;
  if (!fill_sockaddr(sock, a)) throw Error(Errc::invalid_argument, "the socket path " + printable(sock) + " is too long; set XDG_RUNTIME_DIR shorter");
  ::unlink(sock.c_str());
  int l = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (l < 0) throw Error(Errc::io, std::string("cannot create a socket: ") + std::strerror(errno));
  const mode_t old = ::umask(077);
  const int bound = ::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::umask(old);
  if (bound != 0 || ::listen(l, 16) != 0) {
    const int e = errno;
    ::close(l);
    throw Error(Errc::io, "cannot listen on " + printable(sock) + ": " + std::strerror(e));
  }
  struct stat st {};
  if (::lstat(sock.c_str(), &st) != 0) {
    ::close(l);
    throw Error(Errc::io, "cannot inspect " + printable(sock) + ": " + std::strerror(errno));
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(l);
    ::unlink(sock.c_str());
    throw Error(Errc::io, std::string("cannot start the kept receiver: ") + std::strerror(errno));
  }
  if (pid > 0) {
    ::close(l);
    std::cout << "listening " << sock << "\n" << std::flush;
    return 0;
  }
  // The daemon: out of the ssh session (which ends when we close its
  // descriptors), its messages in a log beside the socket.
  ::setsid();
  if (store.path().rfind('/', 0) == 0) {
    [[maybe_unused]] const int moved = ::chdir("/");  // keeps no mount busy; where it fails, staying put is harmless
  }
  const std::string log = sock.substr(0, sock.size() - 5) + ".log";
  int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  int lf = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
  ::dup2(null, 0);
  ::dup2(null, 1);
  ::dup2(lf >= 0 ? lf : null, 2);
  if (null > 2) ::close(null);
  if (lf > 2) ::close(lf);
  std::cerr << now_text() << " kept receiver of " << printable(key) << " (pid " << ::getpid() << ") listening on " << printable(sock)
            << ", idle limit " << idle_s << " s\n";
  ::signal(SIGPIPE, SIG_IGN);
  serve_kept(store, l, sock, st, idle_s, ro);
  ::_exit(0);
}

}  // namespace dvr::cli
